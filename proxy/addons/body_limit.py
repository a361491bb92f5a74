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
from .decision import VERDICT


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
