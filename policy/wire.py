"""The names egresswall's refusals carry on the wire, shared by the proxy that sets them and the clients
(the page reader, the probe) that read them. Pure data: a refusal is answered by the proxy, read here.

A refused request gets ``X-Egresswall-Rule`` (what decided, as in ``check``) and ``X-Egresswall-Reason`` (a
sentence). Only egresswall may send headers starting ``x-egresswall-``: the proxy strips them from every
upstream response, so a client that sees them knows the refusal is egresswall's own.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping

# RFC 9110 5.6.2: a token's characters (a method is a token, and so are the names in an Accept value).
TCHAR = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]"
METHOD = re.compile(TCHAR + "+")

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


def client_reason(stage: str, rule: str, reason: str, host: str | None) -> str:
    """The reason a client reads (a refusal's header and body, and what ``browse`` reports to the agent that asked
    it). For a name, no address it resolved to: a page in a contained browser could point a name of its own at an
    internal name (a CNAME) and read internal addresses off its refusals, one name at a time (review round 23).
    An address refusal names the rule that refused it; a refused alias (CNAME) names the rule, not the alias (an
    internal resolver's chain may name more internal hosts); any other reason (a connect that failed, "connect
    to 10.1.2.3:443 failed") has each address in it written ``[address]``. The audit record and ``egresswall
    check`` keep the whole reason; for an address the client sent itself, it is said as it is."""
    if not host or _is_address(host):
        return reason
    if stage == "address":
        return (f"{host} resolves to an address egresswall does not connect to ({rule}); which one is in the "
                "proxy's audit log")
    if stage == "resolve" and not rule.startswith("dns:"):  # a CNAME in its chain refused: not the alias
        return (f"{host} is an alias (CNAME) of a name egresswall refuses ({rule}); which name is in the proxy's "
                "audit log")
    if rule == UPSTREAM_PROXY_RULE:  # the operator's upstream proxy, named as the README's hint says: not the name's
        return reason
    return _ADDRESS_LIKE.sub(lambda found: "[address]" if _is_address(found.group()) else found.group(), reason)


UPSTREAM_PROXY_RULE = "connect:upstream"  # proxy/refusals.py CONNECT_UPSTREAM: the policy's upstream proxy failed
# What may be an address in a sentence: a dotted quad, or hex digits and colons (with a zone, in brackets or not).
_ADDRESS_LIKE = re.compile(r"(?<![\w.:])(?:\d{1,3}(?:\.\d{1,3}){3}(?![\w.])"
                           r"|\[[0-9A-Fa-f:.]+(?:%[\w.-]+)?\]|[0-9A-Fa-f]*:[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*)")


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True
