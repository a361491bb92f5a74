"""Remove hop-by-hop headers from a request before it is forwarded (RFC 9110, 7.6.1).

mitmproxy forwards the request object it also reads its own connection handling from: a client's
``Connection: close`` decides whether mitmproxy closes the client connection after the response.
So after the strip a ``Connection: close`` is put back when the client asked to close (it means the
same hop-by-hop thing to the upstream: this connection ends after this exchange), and ``Connection:
Upgrade`` for an allowed WebSocket handshake, which needs it. Nothing else the client named survives.

A request without a Host header (HTTP/1.0, or a client that left it out) gets one naming the host and port
it was decided on before it goes on (RFC 9112 3.2.2): mitmproxy forwarded it without, so the origin — a name-based
virtual host — served its default site, not the host egresswall decided on (review round 16). The fast path
hands such a request to this path.
"""

from __future__ import annotations

from mitmproxy import http
from mitmproxy.net.http.http1 import connection_close

from ..http_hygiene import WEBSOCKET, hop_by_hop_names, upgrade_kind, without_names
from .decision import TARGET, VERDICT


class HopByHop:
    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or VERDICT not in flow.metadata:
            return  # refused: nothing is forwarded
        request = flow.request
        headers = request.headers
        websocket = upgrade_kind(headers.get_all("upgrade")) == WEBSOCKET  # decided and allowed, or refused before
        closing = connection_close(request.http_version, headers)
        hop_by_hop = hop_by_hop_names(headers.get_all("connection"), keep_upgrade=websocket)
        headers.fields = without_names(headers.fields, hop_by_hop)
        target = flow.metadata.get(TARGET)
        if target is not None and "host" not in headers and request.http_version in ("HTTP/1.0", "HTTP/1.1"):
            headers.insert(0, "Host", target.authority)  # the host and port decided on
        if websocket:
            headers["Connection"] = "Upgrade"
        elif closing:
            headers["Connection"] = "close"
