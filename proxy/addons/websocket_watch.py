"""An allowed WebSocket under a session is held to it after its 101, as a passed-through tunnel is.

The handshake is a request, decided and charged like any other; the messages after it are not, so
without this a WebSocket ran on after its session ended or expired and its bytes were never charged to
the session's byte budgets. From ``websocket_start`` on, the gate's sweep (``Gate._sweep_sessions``)
sees it: every second its message bytes so far are charged, and it is closed (the client connection
closed, as a passed-through tunnel's is) once the session has ended, expired or gone past a byte budget,
with a line saying why. (WebSockets are carried on mitmproxy's path on both transports: the fast path
hands every upgrade to it.)

Every WebSocket, under a session or not, keeps only its newest message: mitmproxy's layer appends each
message to ``flow.websocket.messages`` for the flow's whole life, so one long WebSocket held everything it
ever carried in the worker's memory (nothing of egresswall reads the older ones).
"""

from __future__ import annotations

from mitmproxy import http

from ..gate import Gate, OpenWebSocket
from ..peers import peer_of
from .decision import FLOW_ID, SESSION, TARGET, VERDICT
from .tunnel_watch import close_client

HELD = "egresswall_websocket_held"  # (OpenWebSocket, [bytes from the client, bytes from the server])


class WebSocketWatch:
    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    def websocket_start(self, flow: http.HTTPFlow) -> None:
        session = flow.metadata.get(SESSION)
        if session is None:
            return
        counts = [0, 0]
        client_id = flow.client_conn.id
        held = self.gate.websocket_opened(flow.metadata[FLOW_ID], peer_of(flow.client_conn.peername),
                                          flow.metadata[TARGET], flow.metadata[VERDICT], session,
                                          lambda: close_client(client_id), lambda: (counts[0], counts[1]))
        flow.metadata[HELD] = (held, counts)

    def websocket_message(self, flow: http.HTTPFlow) -> None:
        if flow.websocket is None or not flow.websocket.messages:
            return
        del flow.websocket.messages[:-1]
        held: tuple[OpenWebSocket, list[int]] | None = flow.metadata.get(HELD)
        if held is not None:
            message = flow.websocket.messages[-1]
            held[1][0 if message.from_client else 1] += len(message.content)

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        held = flow.metadata.pop(HELD, None)
        if held is not None:
            self.gate.websocket_closed(held[0], held[1][0], held[1][1])
