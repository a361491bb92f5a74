"""Forwarding through an upstream proxy (``upstream:`` in the policy; mitmproxy's upstream mode).

egresswall has decided the request or the CONNECT before this runs (``DecisionAddon``), on its own
resolution; this addon only shapes what the upstream is asked for:

* the upstream is asked for exactly the name egresswall checked (the normalised A-label host, not the
  client's spelling of it: a trailing dot or upper case must not make the two resolve different names), in
  the request line and in the Host header;
* the upstream's credentials go only to the upstream: on the CONNECT egresswall sends it, and on a
  plain-HTTP request, which is sent to it in absolute form whatever form the client used — never on a
  request inside a tunnel (any request on a client connection whose CONNECT was answered), which the
  upstream relays to the origin unread, and never on a TRACE, whose answer echoes what was sent. Runs after
  ``HopByHop``, which strips the client's own ``Proxy-Authorization``.
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
        if flow.client_conn.id in self.table.tunneled or self.table.tunnels.get(flow.server_conn.id) is not None:
            return  # inside a tunnel: this goes to the origin, never the upstream's password
        # A plain request, in absolute form or (as a client may send it to a proxy) in origin form with a Host:
        # both go to the upstream in absolute form, naming the host decided. Sent on in origin form, it was a
        # request for the upstream itself (squid answers its cache manager to one), without the credentials.
        target = flow.metadata[TARGET]
        flow.request.data.host = target.host
        flow.request.authority = target.authority
        if "host" in flow.request.headers:  # the same name there: an upstream may route by Host (one, checked)
            flow.request.headers["Host"] = target.host_header  # no :80 the client did not write
        if self.authorization and flow.request.method.upper() != "TRACE":
            # RFC 9110 9.3.8: a client must not put stored credentials in a TRACE, whose answer echoes the
            # request (an upstream answers one itself at Max-Forwards: 0): without them the upstream may refuse
            # it (407), never echo them to the client.
            flow.request.headers["Proxy-Authorization"] = self.authorization
