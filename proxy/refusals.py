"""The responses egresswall sends instead of forwarding: always with a reason a human can read."""

from __future__ import annotations

from mitmproxy import http

from policy.decision import Verdict

REASON_HEADER = "X-Egresswall-Reason"
RULE_HEADER = "X-Egresswall-Rule"
OWN_HEADER_PREFIX = "x-egresswall-"  # headers only egresswall may set; stripped from upstream responses


def _one_line(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())
    text = text.encode("ascii", "backslashreplace").decode("ascii")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def refusal(status: int, rule: str, reason: str) -> http.Response:
    body = f"egresswall refused this request.\nrule: {rule}\nreason: {reason}\n"
    response = http.Response.make(
        status,
        body.encode("utf-8"),
        {"Content-Type": "text/plain; charset=utf-8", "Cache-Control": "no-store", "Connection": "close"},
    )
    response.headers[REASON_HEADER] = _one_line(reason)
    response.headers[RULE_HEADER] = _one_line(rule, 200)
    return response


def from_verdict(verdict: Verdict) -> http.Response:
    return refusal(403, verdict.rule, verdict.reason)
