"""An origin's response head made safe to relay, on mitmproxy's path as the fast front does it.

- Hop-by-hop headers (RFC 9110 7.6.1) belong to the origin's connection, not the client's: ``Connection``,
  every header it names, ``Keep-Alive``, ``Proxy-Authenticate`` and the rest are removed (a ``Connection:
  close`` is put back when the origin said it, which mitmproxy reads for its own connection handling).
- An obs-fold (RFC 9112 5.2) is replaced by a space: mitmproxy keeps the fold inside the value and would
  write it out as it came, a header a client may split into a second one.
- A 204 has no body whatever its head says (RFC 9110 8.6): a Content-Length relayed with it makes a
  kept-alive client read the first bytes of the next response as this one's body.
- Nor has a 304 (RFC 9110 15.4.5), which keeps its Content-Length (the length of the representation it
  stands for) but loses a ``Transfer-Encoding: chunked``: mitmproxy reads no body for it, but seeing
  ``chunked`` in the head it sends, it ended the body it never read with a last chunk, ``0`` CRLF CRLF,
  bytes a kept-alive client read as the start of the next response.
- The status line carries egresswall's own HTTP version, HTTP/1.1 (RFC 9110 6.2: an intermediary sends its own
  version in what it forwards), as the fast path's re-framing does: mitmproxy relayed ``HTTP/1.2`` or
  ``HTTP/0.9`` as the origin wrote it. Whether the origin's connection closes is read before.

A ``101 Switching Protocols`` is left alone: ``AuditTrail`` refuses one the decision did not allow, and
an allowed WebSocket upgrade needs its ``Connection`` and ``Upgrade``.
"""

from __future__ import annotations

import re

from mitmproxy import http
from mitmproxy.net.http.http1 import connection_close

from ..http_hygiene import hop_by_hop_names, without_names
from .decision import VERDICT

_OBS_FOLD = re.compile(rb"[ \t]*\r?\n[ \t]*")


class ResponseHygiene:
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        response = flow.response
        if response is None or VERDICT not in flow.metadata or response.status_code == 101:
            return  # our own refusal, or an upgrade AuditTrail has judged
        headers = response.headers
        closing = connection_close(response.http_version, headers)
        if response.http_version.startswith(("HTTP/0.", "HTTP/1.")):  # not an HTTP/2 or /3 upstream's
            response.http_version = "HTTP/1.1"
        headers.fields = without_names(headers.fields, hop_by_hop_names(headers.get_all("connection")))
        if closing:
            headers["Connection"] = "close"
        if response.status_code == 204:
            headers.pop("content-length", None)
        if response.status_code in (204, 304):
            headers.pop("transfer-encoding", None)
        if any(b"\n" in value for _, value in headers.fields):
            headers.fields = tuple((name, _OBS_FOLD.sub(b" ", value)) for name, value in headers.fields)
