"""The names egresswall's refusals carry on the wire, shared by the proxy that sets them and the clients
(the page reader, the probe) that read them. Pure data: a refusal is answered by the proxy, read here.

A refused request gets ``X-Egresswall-Rule`` (what decided, as in ``check``) and ``X-Egresswall-Reason`` (a
sentence). Only egresswall may send headers starting ``x-egresswall-``: the proxy strips them from every
upstream response, so a client that sees them knows the refusal is egresswall's own.
"""

from __future__ import annotations

from collections.abc import Mapping

REASON_HEADER = "X-Egresswall-Reason"
RULE_HEADER = "X-Egresswall-Rule"
RULE_ID_HEADER = "X-Egresswall-Rule-Id"  # the stable id (metrics and the audit record's rule_id)
OWN_HEADER_PREFIX = "x-egresswall-"


def refusal_from_headers(headers: Mapping[str, str]) -> tuple[str, str] | None:
    """(rule, reason) when the response headers are an egresswall refusal's, else None. Header names are
    matched without regard to case (HTTP/1 keeps the sender's case, Playwright lower-cases them)."""
    lowered = {name.lower(): value for name, value in headers.items()}
    rule = lowered.get(RULE_HEADER.lower())
    if rule is None:
        return None
    return rule, lowered.get(REASON_HEADER.lower(), "")
