"""One record per finished response; upstreams cannot forge egresswall's headers or switch protocols.

``responseheaders`` strips the headers only egresswall may set, refuses a ``101 Switching Protocols``
the decision did not allow (an upstream must not turn a plain request into a raw relay), and counts
the response's bytes as they stream; ``response`` and ``error`` write the closing record (for a WebSocket,
``websocket_end``, with the bytes its messages carried).
"""

from __future__ import annotations

import time

from mitmproxy import http
from wsproto.extensions import PerMessageDeflate
from wsproto.utilities import split_comma_header

from ..gate import Gate
from ..mitm_patches import ANSWERED, state
from ..peers import peer_of
from ..refusals import OWN_HEADER_PREFIX
from .byte_count import DOWN, UP, counting_stream
from .decision import CHARGED, FLOW_ID, STARTED, TARGET, VERDICT, accept_of, to_response
from .websocket_watch import websocket_bytes

REFUSED = "egresswall_refused_response"  # a refusal that replaced an upstream's response (sent as it is)


class AuditTrail:
    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self.live: dict[str, http.HTTPFlow] = {}  # allowed exchanges (WebSockets too) whose record is still to come

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if VERDICT in flow.metadata:  # allowed (DecisionAddon's hook ran before this one)
            self.live[flow.id] = flow

    def record_open(self) -> None:
        """A stop: each exchange and WebSocket still open when the connections were closed gets its record now
        (error: egresswall stopped), while the audit log is open, rather than none once mitmproxy is shut down."""
        for flow in list(self.live.values()):
            self._ended(flow, "stopped")

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        verdict = flow.metadata.get(VERDICT)
        if flow.response is None or verdict is None:
            return  # our own refusal, not an upstream response
        for name in [n for n in flow.response.headers if n.lower().startswith(OWN_HEADER_PREFIX)]:
            del flow.response.headers[name]
        if flow.response.status_code == 101:
            if not _allowed_websocket(flow):
                rule, why = "http:unrequested-upgrade", ("the upstream answered 101 Switching Protocols to a request "
                                                         "that was not an allowed WebSocket upgrade")
            else:
                rule, why = "http:websocket-extension", _extensions_problem(flow.response.headers)
            if why is None:
                flow.response.stream = counting_stream(flow.metadata, DOWN)
                return
            flow.request.egresswall_no_pipe = True  # mitm_patches: the upstream connection is not made a pipe
            target = flow.metadata.get(TARGET)
            refusal = self.gate.refuse(peer_of(flow.client_conn.peername), flow.request.method, target, 502, "http",
                                       rule, why, accept=accept_of(flow), session=verdict.session)
            flow.response = to_response(refusal)
            # mitmproxy still reads the upstream's body and puts it into flow.response before the response
            # hook: the refusal is set again there, so the client gets exactly our body, never the upstream's.
            flow.metadata[REFUSED] = refusal
            flow.metadata.pop(VERDICT, None)  # its record is written: no response record follows
            return
        flow.response.stream = counting_stream(flow.metadata, DOWN)

    def response(self, flow: http.HTTPFlow) -> None:
        refusal = flow.metadata.get(REFUSED)
        if refusal is not None:
            flow.response = to_response(refusal)
            return
        if flow.websocket is not None:
            return  # a WebSocket follows its 101: its record is written when it ends, with what it carried
        self._ended(flow, None)

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        self._ended(flow, None)

    def error(self, flow: http.HTTPFlow) -> None:
        self._ended(flow, flow.error.msg if flow.error else "error")

    def _ended(self, flow: http.HTTPFlow, error: str | None) -> None:
        self.live.pop(flow.id, None)
        verdict = flow.metadata.get(VERDICT)
        if verdict is None or flow.metadata.get("egresswall_ended"):
            return  # refused (its decision record says so) or already recorded
        flow.metadata["egresswall_ended"] = True
        if flow.client_conn.id in state().idle_closed and flow.response is None:
            # mitmproxy reports its own idle timeout as "Client disconnected.": say what happened.
            error = (f"nothing moved for limits.idle_timeout ({self.gate.policy.limits.idle_timeout:g}s): the "
                     "upstream sent no response, and egresswall closed the connection")
        websocket = flow.websocket is not None and flow.response is not None and flow.response.status_code == 101
        if websocket:
            # Its messages' bytes, pings and pongs included; its session was charged them as they moved
            # (websocket_watch.py), so they are recorded here and not charged again.
            up, down = websocket_bytes(flow)
        else:
            down = flow.metadata.get(DOWN, {}).get("bytes", 0)
            streamed = flow.metadata.get(UP)  # a streamed body's count; a buffered one is on the flow
            up = streamed["bytes"] if streamed is not None else len(flow.request.raw_content or b"")
        # The status the client was sent: a response whose head mitmproxy refused (framed two ways, a header
        # name it will not pass on, a control byte) is on the flow, but its client got egresswall's 502
        # instead (ANSWERED, noted by the protocol-error patch); only a head that reached
        # ``responseheaders`` (DOWN) went on. The fast path records the same.
        if flow.response is not None and DOWN in flow.metadata:
            status = flow.response.status_code
        else:
            status = flow.metadata.get(ANSWERED)
        self.gate.response_closed(flow.metadata[FLOW_ID], peer_of(flow.client_conn.peername), flow.request.method,
                                  flow.metadata.get(TARGET), verdict, flow.metadata.get(STARTED, time.monotonic()),
                                  up, down, status, error, flow.metadata.get(CHARGED, 0), charge=not websocket)


def _extensions_problem(headers: http.Headers) -> str | None:
    """Why the WebSocket extensions an upstream's 101 names cannot be used, or None. mitmproxy's WebSocket layer
    takes permessage-deflate's parameters as wsproto reads them at its start, and a value wsproto refuses
    (``server_max_window_bits=abc``, ``=7``) raised there unguarded: a crash traceback in the log, and a client
    holding a 101 on a connection that carried nothing until the idle timeout (review round 20). Judged here
    the same way (mitmproxy ignores other extensions), so such a 101 is refused instead."""
    value = headers.get("Sec-WebSocket-Extensions", "")
    for extension in split_comma_header(value.encode("ascii", "replace")):
        if extension.split(";", 1)[0].strip() == PerMessageDeflate.name:
            try:
                PerMessageDeflate().finalize(extension)
            except (ValueError, TypeError, IndexError):  # its words quote the upstream's value: not for a reason
                return ("the upstream's 101 names permessage-deflate with parameters egresswall cannot use (a "
                        "window size outside 9-15, not a number, or none)")
    return None


def _allowed_websocket(flow: http.HTTPFlow) -> bool:
    """The request was an allowed WebSocket upgrade, and the 101 really is a WebSocket handshake."""
    target = flow.metadata.get(TARGET)
    response = flow.response
    return (target is not None and target.scheme in ("ws", "wss")
            and flow.request.headers.get("upgrade", "").strip().lower() == "websocket"
            and response is not None and response.headers.get("upgrade", "").strip().lower() == "websocket"
            and "sec-websocket-accept" in response.headers)
