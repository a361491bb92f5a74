"""``limits.max_request_body`` for bodies without a Content-Length (chunked), and the budget they are
buffered in (``limits.max_buffered_request_bodies``, ``proxy/body_budget.py``).

A declared length over the limit is refused by the gate before anything is read. A chunked body is
buffered — never streamed — so the upstream sees nothing of a request that turns out to be over the
limit (proxy/mitm_patches.py answers 413 as soon as the body, counted as sent, passes it). Every piece
buffered is reserved in the gate's budget first (503/429 when it is full); the reservation is given back
when the flow ends — its response is in, or it failed, or was refused — or, whatever else happened, when
its client connection closes. On this path the flow keeps the whole body (``flow.request.content``, which
the response record counts) until its response is in, so it is held until then. Every other body is
streamed as it arrives.
"""

from __future__ import annotations

from mitmproxy import connection, http

from policy.sessions import STAGE as SESSION_STAGE

from ..body_budget import BodyHold
from ..body_reasons import body_over_limit_reason
from ..gate import Gate
from ..mitm_patches import BODY_LIMIT
from ..peers import peer_of
from ..refusals import Refusal
from .byte_count import UP, counting_stream
from .decision import CHARGED, FLOW_ID, SESSION, TARGET, VERDICT, accept_of, to_response

BODY_HOLD = "egresswall_body_hold"  # flow.metadata: what the flow's buffered body holds of the budget


def refuse_body_over_limit(gate: Gate, flow: http.HTTPFlow, limit: int) -> Refusal:
    """A buffered body went over the limit (proxy/mitm_patches.py calls this): the 413 and its record."""
    return _refuse_body(gate, flow, 413, "limits.max_request_body", body_over_limit_reason(limit))


def refuse_bad_body(gate: Gate, flow: http.HTTPFlow, rule: str, reason: str) -> Refusal:
    """A buffered body cannot be read on (proxy/mitm_patches.py: a line of it passed limits.max_header_bytes
    unfinished, its framing is malformed, it ends with trailer fields): 400 and its record."""
    return _refuse_body(gate, flow, 400, rule, reason, stage="form")


def reserve_body(gate: Gate, flow: http.HTTPFlow, size: int) -> Refusal | None:
    """``size`` more bytes of a buffered body (proxy/mitm_patches.py calls this before holding them): None,
    or the refusal when the budget for buffered bodies (or the client's share of it) is full."""
    hold = flow.metadata.get(BODY_HOLD)
    if hold is None:
        return None
    refused = hold.add(size, gate.policy.limits)
    if refused is None:
        return None
    return _refuse_body(gate, flow, refused.status, refused.rule, refused.reason)


def _refuse_body(gate: Gate, flow: http.HTTPFlow, status: int, rule: str, reason: str,
                 stage: str = "limits") -> Refusal:
    """The refusal of a body being buffered. The record is the flow's closing one, so the allowed verdict is
    dropped and no response record follows; what the body held is given back."""
    hold = flow.metadata.pop(BODY_HOLD, None)
    if hold is not None:
        hold.release()
    verdict = flow.metadata.pop(VERDICT, None)
    refusal = gate.refuse(peer_of(flow.client_conn.peername), flow.request.method, flow.metadata.get(TARGET), status,
                          stage, rule, reason, flow_id=flow.metadata.get(FLOW_ID), event="response",
                          accept=accept_of(flow), session=verdict.session if verdict is not None else None)
    flow.response = to_response(refusal)
    return refusal


class BodyLimit:
    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self.holds: dict[str, set[BodyHold]] = {}  # client connection id → the holds of its flows

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or VERDICT not in flow.metadata:
            return
        if "transfer-encoding" in flow.request.headers:
            flow.request.stream = False
            flow.metadata[BODY_LIMIT] = self.gate.policy.limits.max_request_body
            hold = self.gate.body_budget.hold(peer_of(flow.client_conn.peername))
            flow.metadata[BODY_HOLD] = hold
            self.holds.setdefault(flow.client_conn.id, set()).add(hold)
        else:
            # Streamed, the body is never kept on the flow: its bytes are counted as they pass (AuditTrail
            # recorded 0 for every Content-Length body, and a session's budgets.request_bytes went uncharged).
            flow.request.stream = counting_stream(flow.metadata, UP)

    async def request(self, flow: http.HTTPFlow) -> None:
        """A chunked body is whole here, before any of it goes upstream: a session's request_bytes judges it now
        (its admission could not know its size), as the fast path does (``Gate.chunked_body_refusal``)."""
        if flow.response is not None or BODY_HOLD not in flow.metadata:
            return
        size = len(flow.request.raw_content or b"")
        over = await self.gate.chunked_body_refusal(flow.metadata.get(SESSION), size)
        if over is not None:
            verdict, status = over
            _refuse_body(self.gate, flow, status, verdict.rule, verdict.reason, stage=SESSION_STAGE)
            return
        flow.metadata[CHARGED] = size  # charged to its session just now: not again when the exchange ends

    def response(self, flow: http.HTTPFlow) -> None:
        self._release(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._release(flow)

    def client_disconnected(self, client: connection.Client) -> None:
        """Whatever became of its flows (a reset mid-body, an idle close, a refusal), nothing they held
        outlives the connection."""
        for hold in self.holds.pop(client.id, ()):
            hold.release()

    def _release(self, flow: http.HTTPFlow) -> None:
        hold = flow.metadata.pop(BODY_HOLD, None)
        if hold is None:
            return
        hold.release()
        holds = self.holds.get(flow.client_conn.id)
        if holds is not None:
            holds.discard(hold)
            if not holds:
                del self.holds[flow.client_conn.id]
