"""The operator's hint in a refusal: what would change the answer, from the verdict and the target only.

One pure function, ``hint_for``, used by both refusal bodies (the ``hint:`` line of the text body and
the ``hint`` field of the JSON body). Everything it says is built from the verdict (stage, rule, rule
id, the matched deny rule) and the target egresswall parsed — never from anything an upstream server
sent — so a refusal cannot be made to carry someone else's words.

The policy itself is not needed: a default-deny verdict's ``rule_id`` already says whose default
refused (``default:deny`` or ``roles.NAME.default:deny``, policy/rule_ids.py), which is all the hint
names.
"""

from __future__ import annotations

from policy.addresses import AddressRules
from policy.decision import Verdict
from policy.model import ALLOW

CAPS = frozenset({"limits.max_connections", "limits.max_connections_per_client", "limits.max_buffered_request_bodies",
                  "shutdown"})
RETRY_LATER = "retry later"


def hint_for(verdict: Verdict, host: str | None = None, port: int | None = None) -> str:
    """What an operator (or the agent reporting to one) can do about this refusal, in one line."""
    stage, rule, rule_id = verdict.stage, verdict.rule, verdict.rule_id
    name = host if host else "this host"
    if stage == "host":
        near = verdict.matched if not verdict.allowed and verdict.matched is not None else None
        if near is not None and near.action == ALLOW:
            # A rule names the host and its conditions did not hold: adding the host again would change nothing.
            return (f"rule {near.pattern.text} ({near.where}) names {name} but does not allow this request; "
                    "change that rule's conditions to admit it")
        if rule_id.endswith(".default:deny") and rule_id.startswith("roles."):
            role = rule_id[len("roles."):-len(".default:deny")]
            return f"add {name} to hosts.allow of role {role}" + _literal_refused(host)
        if rule_id == "default:deny":
            return f"add {name} to hosts.allow" + _literal_refused(host)
        pattern = verdict.matched.pattern.text if verdict.matched is not None else rule_id
        return f"this host is refused by deny rule {pattern} ({rule}); only editing that rule admits it"
    if stage == "port":
        shown = port if port is not None else "this port"
        return f"port {shown} is not in ports.connect/ports.http ({rule} decided); add it to {rule} to allow it"
    if stage == "address":
        if rule == "self":
            return ("this is egresswall's own (a listener or its session store); a request to the proxy itself is "
                    "never forwarded")
        if rule.startswith("cloud-metadata"):
            return ("this is a cloud metadata address, refused whatever addresses.allow says while "
                    "addresses.refuse_cloud_metadata is true (with it false, a non-global one still needs an "
                    "addresses.allow range)")
        if rule_id.startswith("addresses.deny:"):
            return f"this address is refused by the address deny rule {rule}; only editing that rule admits it"
        # special-purpose and outside-global-unicast: refused by default, and an address range is what re-admits.
        return f"this address is not global unicast ({rule}); only an addresses.allow range re-admits it, a host " \
               "allow rule cannot"
    if stage == "resolve":
        if rule.startswith("dns:"):
            return (f"the name did not resolve ({rule}); check the name and the nameservers in resolver, "
                    "or retry later")
        return f"the name is an alias (CNAME) of a refused name ({rule}); every name in the chain must pass"
    if stage == "form":
        if rule == "form:host-header":
            return "the Host header must name the request's target; no policy change admits this request"
        if rule == "http:override-header":
            return ("this request is decided by its path or method (a host rule, or a session's URL grant): send it "
                    "for the path and method it means, without a header that asks for another")
        if rule == "form:scheme":  # not malformed: a scheme egresswall does not speak (ftp://, file://)
            return "only http, https, ws and wss are proxied; no policy change admits another scheme"
        return f"the request is malformed ({rule}); fix the client: no policy change admits it"
    if stage == "scheme":
        return "only http, https, ws and wss are proxied"
    if stage == "limits":
        if rule in CAPS or rule.endswith("_timeout"):
            return RETRY_LATER
        return f"the request is over {rule}; send less, or raise {rule} in the policy"
    if stage == "audit":
        return ("retry later; the operator must make the audit log writable (egresswall does not let "
                "through what it cannot record)")
    if stage == "connect" and rule == "connect:upstream":  # refusals.CONNECT_UPSTREAM
        if "refused the tunnel: 407" in verdict.reason:  # upstream_connect's words for the upstream's 407
            return "the upstream proxy refused egresswall's credentials: check upstream.credentials_file in the policy"
        return ("the upstream proxy egresswall forwards through did not answer or refused (the reason names it); "
                "retry later, or ask its owner")
    if stage == "connect":
        return "the checked address did not accept the connection; retry later"
    if stage == "internal":  # gate.INTERNAL_STAGE: a bug of egresswall's
        return "an error inside egresswall refused this; tell the operator (the proxy's log has the details)"
    if stage == "http":
        return f"egresswall does not relay this ({rule}); no policy change admits it"
    if stage == "tls":
        return f"the tunnel's TLS start was refused ({rule}); the SNI must name the CONNECT host"
    if stage == "session":
        return _session_hint(rule)
    return f"refused by {rule}"


def _literal_refused(host: str | None) -> str:
    """For an IP literal the address rules refuse by default, what a host rule alone cannot do: "add 10.0.0.5 to
    hosts.allow" was followed by a refusal by special-purpose 10.0.0.0/8 (a newcomer's review, round 17)."""
    try:
        verdict = AddressRules().check(host) if host else None
    except ValueError:  # a name, not an address
        return ""
    if verdict is None or verdict.allowed:
        return ""
    if verdict.rule.startswith("cloud-metadata"):
        return f"; but {host} is a cloud metadata address ({verdict.rule}), which no host rule admits"
    return f", and re-admit it with an addresses.allow range: it is not global unicast ({verdict.rule})"


def _session_hint(rule: str) -> str:
    if rule in ("session:required", "session:credentials"):
        return "present a session: Proxy-Authorization: Basic base64(session-id:secret), from the admin API"
    if rule == "session:store-unavailable":
        return RETRY_LATER + "; the operator must make the session store reachable (sessions fail closed)"
    if rule.startswith("session:budget-") or rule in ("session:expired", "session:ended"):
        return "the session is spent; the platform may extend it or create a new one"
    return ("the session does not grant this; only the platform that created the session can grant it (a new "
            "session); the policy cannot")
