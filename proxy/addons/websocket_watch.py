"""An allowed WebSocket under a session is held to it after its 101, as a passed-through tunnel is.

The handshake is a request, decided and charged like any other; the messages after it are not, so
without this a WebSocket ran on after its session ended or expired and its bytes were never charged to
the session's byte budgets. From ``websocket_start`` on, the gate's sweep (``Gate._sweep_sessions``)
sees it: every second its message bytes so far (and its pings' and pongs') are charged, and it is closed
(the client connection closed, as a passed-through tunnel's is) once the session has ended, expired or
gone past a byte budget, with a line saying why. A message that would carry the session past a byte budget
is not relayed, and the WebSocket is closed then (proxy/byte_allowance.py). (WebSockets are carried on
mitmproxy's path on both transports: the fast path hands every upgrade to it.)

A message over ``limits.max_websocket_message`` ends its WebSocket (proxy/mitm_patches.py bounds it, and
marks the connection); its refusal is recorded here, when the WebSocket ends.

Every WebSocket, under a session or not, keeps only its newest message: mitmproxy's layer appends each
message to ``flow.websocket.messages`` for the flow's whole life, so one long WebSocket held everything it
ever carried in the worker's memory (nothing of egresswall reads the older ones).
"""

from __future__ import annotations

from mitmproxy import http

from ..byte_allowance import DOWN, UP
from ..gate import LIMITS, Gate, OpenWebSocket
from ..mitm_patches import WEBSOCKET_ALLOWANCE, WEBSOCKET_CONTROL_BYTES, WEBSOCKET_TOO_BIG
from ..peers import peer_of
from .decision import FLOW_ID, SESSION, TARGET, VERDICT
from .tunnel_watch import close_client

HELD = "egresswall_websocket_held"  # (OpenWebSocket, [bytes from the client, bytes from the server])
COUNTS = "egresswall_websocket_counts"  # [message bytes from the client, from the server], every WebSocket


class WebSocketWatch:
    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    async def websocket_start(self, flow: http.HTTPFlow) -> None:
        # Awaited: mitmproxy's WebSocket layer relays nothing (a message behind the handshake neither) until this
        # hook has returned, so the first message is taken from what the store says is left.
        counts = flow.metadata[COUNTS] = [0, 0]  # for its record (audit_trail.py), under a session or not
        session = flow.metadata.get(SESSION)
        if session is None:
            return
        client_id = flow.client_conn.id
        held = await self.gate.websocket_opened(flow.metadata[FLOW_ID], peer_of(flow.client_conn.peername),
                                          flow.metadata[TARGET], flow.metadata[VERDICT], session,
                                          lambda: close_client(client_id), lambda: _moved(flow, counts))
        flow.metadata[HELD] = (held, counts)
        if held.allowance is not None:  # pings and pongs are taken from it too (proxy/mitm_patches.py)
            flow.client_conn.__dict__[WEBSOCKET_ALLOWANCE] = (held.allowance, UP)
            flow.server_conn.__dict__[WEBSOCKET_ALLOWANCE] = (held.allowance, DOWN)

    def websocket_message(self, flow: http.HTTPFlow) -> None:
        if flow.websocket is None or not flow.websocket.messages:
            return
        del flow.websocket.messages[:-1]
        message = flow.websocket.messages[-1]
        held: tuple[OpenWebSocket, list[int]] | None = flow.metadata.get(HELD)
        if held is not None:
            allowance = held[0].allowance
            if allowance is not None and not allowance.take(UP if message.from_client else DOWN, len(message.content)):
                message.drop()  # past its session's byte budget: not relayed; the gate closes the WebSocket
                return
        counts = flow.metadata.get(COUNTS)
        if counts is not None:
            counts[0 if message.from_client else 1] += len(message.content)

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        verdict = flow.metadata.get(VERDICT)
        for conn in (flow.client_conn, flow.server_conn):
            reason = conn.__dict__.pop(WEBSOCKET_TOO_BIG, None)
            if reason is not None:
                self.gate.refuse(peer_of(flow.client_conn.peername), flow.request.method, flow.metadata.get(TARGET),
                                 0, LIMITS, "limits.max_websocket_message", reason,
                                 flow_id=f"{flow.metadata.get(FLOW_ID, flow.id)}-ws",
                                 session=verdict.session if verdict is not None else None)
        held = flow.metadata.pop(HELD, None)
        if held is not None:
            self.gate.websocket_closed(held[0], *_moved(flow, held[1]))


def websocket_bytes(flow: http.HTTPFlow) -> tuple[int, int]:
    """What a WebSocket has carried so far each way (its record's bytes_up and bytes_down)."""
    return _moved(flow, flow.metadata.get(COUNTS, [0, 0]))


def _moved(flow: http.HTTPFlow, counts: list[int]) -> tuple[int, int]:
    """A WebSocket's bytes each way: its messages', and its pings' and pongs' (relayed to the other side too)."""
    return (counts[0] + flow.client_conn.__dict__.get(WEBSOCKET_CONTROL_BYTES, 0),
            counts[1] + flow.server_conn.__dict__.get(WEBSOCKET_CONTROL_BYTES, 0))
