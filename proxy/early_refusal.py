"""Refuse a request that carries a body before reading the body.

mitmproxy answers a response set in ``requestheaders`` only after it has read (and buffered) the
whole request body, and it sends ``100 Continue`` first when the client asked for it: an upload
to a refused host would be read in full, into memory. We mark such refusals, leave the request
in streaming mode, and replace the one method that starts request streaming so that, for a
marked flow, it sends the refusal and closes the connection instead of opening an upstream one.
The rest of mitmproxy's state machine is untouched; tests/test_proxy_enforce.py proves the
behaviour (the 403 arrives while the body is still unsent).
"""

from __future__ import annotations

from mitmproxy import http
from mitmproxy.proxy import commands
from mitmproxy.proxy.layers.http import HttpStream

REFUSE_BEFORE_BODY = "egresswall_refuse_before_body"
_original = HttpStream.start_request_stream


def _start_request_stream(self: HttpStream):
    if self.flow.response is not None and self.flow.metadata.get(REFUSE_BEFORE_BODY):
        self.client_state = self.state_errored  # whatever body arrives now is dropped unread
        yield from self.send_response()
        yield commands.CloseConnection(self.context.client)
        return
    yield from _original(self)


def install() -> None:
    HttpStream.start_request_stream = _start_request_stream


def refuse_before_body(flow: http.HTTPFlow, response: http.Response) -> None:
    """Set ``response`` as the answer; if the request has a body still to come, do not read it."""
    flow.response = response
    has_body = flow.request.headers.get("content-length", "0") not in ("", "0") or (
        "transfer-encoding" in flow.request.headers)
    flow.request.headers.pop("expect", None)  # never promise "100 Continue" to a refused request
    if has_body:
        flow.metadata[REFUSE_BEFORE_BODY] = True
        flow.request.stream = True
