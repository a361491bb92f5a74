"""Forwarding through an upstream proxy (``upstream:`` in the policy; mitmproxy's upstream mode).

egresswall has decided the request or the CONNECT before this runs (``DecisionAddon``), on its own
resolution; this addon only shapes what the upstream is asked for:

* the upstream is asked for exactly the name egresswall checked (the normalised A-label host, not the
  client's spelling of it: a trailing dot or upper case must not make the two resolve different names);
* the upstream's credentials go only to the upstream: on the CONNECT egresswall sends it, and on a
  plain-HTTP request sent to it in absolute form — never on a request inside a tunnel, which the
  upstream relays to the origin unread. Runs after ``HopByHop``, which strips the client's own
  ``Proxy-Authorization``.
"""

from __future__ import annotations

from mitmproxy import http

from ..gate import Gate
from ..upstream import basic_authorization
from .connections import ConnectionTable
from .decision import TARGET, VERDICT


class UpstreamForwarding:
    def __init__(self, gate: Gate, table: ConnectionTable, credentials: str | None) -> None:
        self.gate, self.table = gate, table
        self.authorization = basic_authorization(credentials) if credentials else None

    def http_connect(self, flow: http.HTTPFlow) -> None:
        tunnel = self.table.tunnels.get(flow.server_conn.id)
        if flow.response is not None or tunnel is None:
            return  # refused: mitmproxy answers the client and asks the upstream nothing
        flow.request.host = tunnel.target.host  # what the upstream's CONNECT names (mitmproxy reads it next)

    def http_connect_upstream(self, flow: http.HTTPFlow) -> None:
        if self.authorization:
            flow.request.headers["Proxy-Authorization"] = self.authorization

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or VERDICT not in flow.metadata:
            return  # refused before anything is sent
        if self.table.tunnels.get(flow.server_conn.id) is not None or not flow.request.data.authority:
            return  # inside a tunnel (origin form): this goes to the origin, never the upstream's password
        target = flow.metadata[TARGET]
        flow.request.data.host = target.host
        flow.request.authority = target.authority
        if self.authorization:
            flow.request.headers["Proxy-Authorization"] = self.authorization
