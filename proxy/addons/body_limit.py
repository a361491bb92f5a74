"""``limits.max_request_body`` for bodies without a Content-Length (chunked).

A declared length over the limit is refused by the gate before anything is read. A chunked body is
buffered — never streamed — so the upstream sees nothing of a request that turns out to be over the
limit (proxy/mitm_patches.py answers 413 as soon as the buffer passes it). Every other body is
streamed as it arrives.
"""

from __future__ import annotations

from mitmproxy import http

from ..gate import Gate
from ..mitm_patches import BODY_LIMIT
from ..peers import peer_of
from ..refusals import Refusal
from .decision import FLOW_ID, TARGET, VERDICT, accept_of, to_response


def refuse_body_over_limit(gate: Gate, flow: http.HTTPFlow, limit: int) -> Refusal:
    """A buffered body went over the limit (proxy/mitm_patches.py calls this): the 413 and its record. The
    record is the flow's closing one, so the allowed verdict is dropped and no response record follows."""
    flow.metadata.pop(VERDICT, None)
    refusal = gate.refuse(peer_of(flow.client_conn.peername), flow.request.method, flow.metadata.get(TARGET), 413,
                          "limits", "limits.max_request_body",
                          f"the request body is over the limit of {limit} bytes (limits.max_request_body)",
                          flow_id=flow.metadata.get(FLOW_ID), event="response", accept=accept_of(flow))
    flow.response = to_response(refusal)
    return refusal


class BodyLimit:
    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or VERDICT not in flow.metadata:
            return
        if "transfer-encoding" in flow.request.headers:
            flow.request.stream = False
            flow.metadata[BODY_LIMIT] = self.gate.policy.limits.max_request_body
        else:
            flow.request.stream = True
