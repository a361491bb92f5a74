"""The decision: a pure function from (client, method, target, resolved addresses) to a Verdict.

The order is the design's, and the first refusal wins:

1. the target is well formed (the normaliser already refused what is not; see ``refuse_form``);
2. scheme and port;
3. host deny rules, then host allow rules or the default;
4. — the caller resolves the name only now, so a refused name is never looked up —
5. every resolved address (and every name in the CNAME chain) must pass.

``precheck`` runs steps 1-3 and ``decide`` runs all of them; both are pure, so the caller can run
``precheck``, resolve, then ``decide`` with the addresses it got.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

import netaddr

from . import rule_ids
from .addresses import unwrap_mapped
from .hosts import HostFormError, Target, normalise_host
from .model import ALLOW, REPORT, HostRule, Policy, Role
from .ports import ports_text

FORM, SCHEME, PORT, HOST, RESOLVE, ADDRESS = "form", "scheme", "port", "host", "resolve", "address"
WOULD_REFUSE = "report mode: would refuse: "  # how the reason of what report mode let through begins
SCHEMES = frozenset({"http", "https", "ws", "wss"})


@dataclass(frozen=True)
class Request:
    """What the client asked for, as the proxy saw it."""

    target: Target
    method: str = "GET"
    client: str | None = None  # the client's address, which chooses its role
    tunnel: bool = False  # a CONNECT: method and path are not visible unless intercepted
    websocket: bool = False  # an Upgrade: websocket request
    at: datetime = field(default_factory=lambda: datetime.now(UTC))  # for rule expiry


@dataclass(frozen=True)
class Resolution:
    """What the resolver found for a name: the CNAME chain it followed and the addresses at its end."""

    name: str
    addresses: tuple[str, ...]
    cnames: tuple[str, ...] = ()
    ttl: int = 0


@dataclass(frozen=True, init=False)
class Verdict:
    allowed: bool
    stage: str
    rule: str  # what decided, for a human: "policy.yaml:12", "default deny (policy.yaml:3)", "ports.connect"
    reason: str  # a sentence for a human
    report_only: bool = False  # enforce mode would have refused this; report mode let it through
    matched: HostRule | None = None
    role: str | None = None
    addresses: tuple[str, ...] = ()
    pinned: str | None = None  # the one checked address to connect to
    # The same rule's stable id, for metrics and records (policy/rule_ids.py): "hosts.allow:docs.python.org",
    # "default:deny". Where ``rule`` holds no file position ("ports.connect", "special-purpose 10.0.0.0/8")
    # the id is that text, which is what "" means here.
    rule_id: str = ""
    session: str | None = None  # the id of the session the request came under (never its secret)

    def __init__(self, allowed: bool, stage: str, rule: str, reason: str, report_only: bool = False,
                 matched: HostRule | None = None, role: str | None = None, addresses: tuple[str, ...] = (),
                 pinned: str | None = None, rule_id: str = "", session: str | None = None) -> None:
        # Every request gets a verdict, and the generated __init__ of a frozen dataclass sets each field through
        # object.__setattr__, a slow call: eleven of them were a third of a decision. The fields are written into
        # the instance's dict instead, each once; the class is as frozen as before to everything after this.
        # (tests/test_decision.py checks this signature against the fields.)
        fields = self.__dict__
        fields["allowed"] = allowed
        fields["stage"] = stage
        fields["rule"] = rule
        fields["reason"] = reason
        fields["report_only"] = report_only
        fields["matched"] = matched
        fields["role"] = role
        fields["addresses"] = addresses
        fields["pinned"] = pinned
        fields["rule_id"] = rule_id or rule
        fields["session"] = session

    @property
    def needs_resolution(self) -> bool:
        return self.allowed and self.stage == HOST and not self.addresses and self.pinned is None


def refuse_form(error: HostFormError) -> Verdict:
    return Verdict(False, FORM, f"form:{error.form}", error.reason)


def refuse_resolution(kind: str, reason: str, precheck_verdict: Verdict | None = None) -> Verdict:
    role = precheck_verdict.role if precheck_verdict else None
    return Verdict(False, RESOLVE, f"dns:{kind}", reason, role=role)


def precheck(policy: Policy, request: Request) -> Verdict:
    """Steps 1-3. An allowed verdict for a name means: resolve it, then call ``decide``."""
    target = request.target
    # Without roles no client has one: the client's address is not even parsed (netaddr is slow at it).
    role = policy.role_for(_client_address(request.client)) if policy.roles else None
    role_name = role.name if role else None

    if target.scheme not in SCHEMES:
        return Verdict(False, SCHEME, "scheme", f"scheme {target.scheme!r} is not http, https, ws or wss",
                       role=role_name)
    # An https/wss request that is not itself a CONNECT came through one (intercepted) or will be sent
    # over TLS: either way it is judged by the CONNECT ports, not the plain-HTTP ones. Every CONNECT is
    # judged by the CONNECT ports, also one to a plain-HTTP port whose content egresswall parses.
    over_tls = request.tunnel or target.scheme in ("https", "wss")
    ports, kind = (policy.connect_ports, "CONNECT") if over_tls else (policy.http_ports, "plain-HTTP")
    if target.port not in ports:
        allowed = ports_text(ports) or "none"
        return Verdict(False, PORT, f"ports.{'connect' if over_tls else 'http'}",
                       f"port {target.port} is not an allowed {kind} port (allowed: {allowed})", role=role_name)

    verdict = _host_rules(policy, request, role, role_name)
    if not verdict.allowed and policy.mode == REPORT:
        # Report mode relaxes host rules only; scheme, port and address refusals stay enforced.
        verdict = replace(verdict, allowed=True, report_only=True,
                          reason=f"{WOULD_REFUSE}{verdict.reason}")
    if verdict.allowed and target.ip is not None:
        return decide_addresses(policy, verdict, (str(target.ip),), (), request)
    return verdict


def decide(policy: Policy, request: Request, resolution: Resolution | None = None) -> Verdict:
    """All steps. For a name, ``resolution`` is what the resolver found after ``precheck`` allowed it."""
    verdict = precheck(policy, request)
    if not verdict.allowed or request.target.ip is not None:
        return verdict
    if resolution is None:
        return Verdict(False, RESOLVE, "dns:unresolved", f"{request.target.host} was not resolved", role=verdict.role)
    return decide_addresses(policy, verdict, resolution.addresses, resolution.cnames, request)


def decide_addresses(policy: Policy, verdict: Verdict, addresses: Iterable[str], cnames: Iterable[str],
                     request: Request | None = None) -> Verdict:
    """Step 5: every name in the CNAME chain and every address must pass; one bad answer refuses."""
    addresses = tuple(addresses)
    role = next((r for r in policy.roles if r.name == verdict.role), None) if verdict.role else None
    reported: tuple[str, str, str] | None = None
    for name in cnames:
        refusal = _check_cname(policy, role, name, request)
        if refusal and refusal[2] and policy.mode == REPORT:
            # A deny rule reached through the alias is a host rule, which report mode relaxes (as it relaxes
            # the same rule asked for by name); an alias that is no name egresswall accepts (refusal[2] "")
            # and the addresses stay enforced. Reported in place of a host rule reported for the name itself:
            # allowing the name would not let it through (and ``suggest`` must not propose it).
            reported = reported or refusal
        elif refusal:
            return Verdict(False, RESOLVE, refusal[0], refusal[1], role=verdict.role, addresses=addresses,
                           rule_id=refusal[2])
    if not addresses:
        return Verdict(False, RESOLVE, "dns:empty", "the name has no A or AAAA records", role=verdict.role)
    for address in addresses:
        checked = policy.addresses.check(address)
        if not checked.allowed:
            return Verdict(False, ADDRESS, checked.rule, checked.reason, role=verdict.role, addresses=addresses,
                           rule_id=checked.rule_id)
    if reported is not None:
        return Verdict(True, RESOLVE, reported[0], f"{WOULD_REFUSE}{reported[1]}", report_only=True,
                       role=verdict.role, addresses=addresses, pinned=_choose_pin(addresses), rule_id=reported[2],
                       session=verdict.session)
    return replace(verdict, addresses=addresses, pinned=_choose_pin(addresses))


def decide_on_answer(policy: Policy, request: Request, answer: Resolution) -> Verdict:
    """The whole order of checks on an answer already had instead of a lookup: a request inside a tunnel goes
    where the tunnel's one upstream connection goes, so it is judged on the CONNECT's answer (by the policy in
    force now), never on a fresh one that may name another address than the bytes reach."""
    verdict = precheck(policy, request)
    if not verdict.needs_resolution:
        return verdict
    return decide_addresses(policy, verdict, answer.addresses, answer.cnames, request)


def decides_by_request_line(policy: Policy, host: str, client: str | None) -> bool:
    """Whether a host rule naming ``host`` (in the client's role's lists or the global ones) has ``paths`` or
    ``methods``: then what a request asks for beyond its request line (a header asking a server for another path
    or method) could reach what such a rule refuses."""
    role = role_of(policy, client) if policy.roles else None
    tables = ((role.deny, role.allow) if role else ()) + (policy.deny, policy.allow)
    return any(rule.paths is not None or rule.methods is not None
               for table in tables for rule in table.index.candidates(host))


def role_of(policy: Policy, client: str | None) -> Role | None:
    """The role a client address has (None: no role, or no parsable address)."""
    return policy.role_for(_client_address(client))


def _host_rules(policy: Policy, request: Request, role: Role | None, role_name: str | None) -> Verdict:
    # Each verdict is made once, with its role (dataclasses.replace would cost a third of a decision).
    host = request.target.host
    # An IPv6 literal that wraps an IPv4 (NAT64, 6to4, ...) is held against deny rules by that IPv4 too: a
    # denied IPv4 literal is not reached by its wrapping where the policy re-admits the wrapping's prefix.
    names = (host, *policy.addresses.embedded_ipv4s(host)) if ":" in host else (host,)
    # table.index.candidates, not table.candidates: one call fewer, on the path of every request.
    for table in ((role.deny,) if role else ()) + (policy.deny,):
        for name in names:
            rule = _first_holding(table.index.candidates(name), request)
            if rule is not None:
                why = f": {rule.reason}" if rule.reason else ""
                carries = "" if name == host else f" (it wraps IPv4 {name})"
                return Verdict(False, HOST, rule.where,
                               f"{host}{carries} is refused by deny rule {rule.pattern.text}{why}",
                               matched=rule, rule_id=rule.rule_id, role=role_name)
    allow = (role.allow if role else policy.allow).index.candidates(host)
    rule = _first_holding(allow, request)
    if rule is not None:
        return Verdict(True, HOST, rule.where, f"{host} is allowed by rule {rule.pattern.text}", matched=rule,
                       rule_id=rule.rule_id, role=role_name)
    own = role is not None and role.default is not None
    default = role.default if own else policy.default
    whose = f"role {role.name}" if own else "the policy"
    origin = role.origin if own else policy.default_origin
    rule_id = rule_ids.default(default, role.name if own else None)
    if default == ALLOW:
        return Verdict(True, HOST, f"default allow ({origin})",
                       f"{host} matches no rule and {whose} allows by default", rule_id=rule_id, role=role_name)
    # An allow rule that names the host but did not hold: said in the reason, and kept as ``matched`` (an allow
    # rule on a refusal) so that the hint and ``suggest`` point at that rule rather than at adding the host again.
    near, hint = _near_miss(allow, request) if allow else (None, "")
    return Verdict(False, HOST, f"default deny ({origin})",
                   f"{host} is not on the allowlist ({whose} denies by default){hint}", rule_id=rule_id,
                   role=role_name, matched=near)


def _first_holding(rules: list[HostRule], request: Request) -> HostRule | None:
    """The first of a host's candidate rules whose conditions hold for the request."""
    for rule in rules:
        if _conditions_hold(rule, request):
            return rule
    return None


def _conditions_hold(rule: HostRule, request: Request) -> bool:
    target = request.target
    if rule.expires is not None and request.at >= rule.expires:
        return False
    if rule.ports is not None and target.port not in rule.ports:
        return False
    if rule.schemes is not None and target.scheme not in rule.schemes:
        return False
    if request.websocket and not rule.websocket:
        return False
    if rule.methods is not None or rule.paths is not None:  # rule.needs_visible_request
        if request.tunnel:
            # A passed-through tunnel hides method and path. An allow rule that names them may open
            # the tunnel only when it intercepts (then each request inside is checked); a deny rule
            # with such conditions refuses only the requests it can see. (A CONNECT to a plain-HTTP port
            # may turn out to carry TLS, so it is no exception: such a rule does not open it either.)
            return rule.action == ALLOW and rule.intercept
        if rule.methods is not None and request.method.upper() not in rule.methods:
            return False
        if not rule.path_matches(target.path):
            return False
    return True


def _near_miss(candidates: list[HostRule], request: Request) -> tuple[HostRule | None, str]:
    """The first rule naming the host that did not hold, and why (expired, port, scheme...) — operators ask."""
    for rule in candidates:
        return rule, f"; rule {rule.pattern.text} ({rule.where}) {_why_not(rule, request)}"
    return None, ""


def _why_not(rule: HostRule, request: Request) -> str:
    if rule.expired(request.at):
        return f"expired {rule.expires:%Y-%m-%d %H:%M} UTC"
    if rule.ports is not None and request.target.port not in rule.ports:
        return f"allows only ports [{ports_text(rule.ports)}]"
    if rule.schemes is not None and request.target.scheme not in rule.schemes:
        return f"allows only {sorted(rule.schemes)}"
    if request.websocket and not rule.websocket:
        return "does not allow WebSocket"
    hidden = ", which a tunnel passed through unread hides (such a rule opens one only with intercept: true)"
    if rule.methods is not None and (request.tunnel or request.method.upper() not in rule.methods):
        return f"allows only methods {sorted(rule.methods)}" + (hidden if request.tunnel else "")
    return f"allows only paths {list(rule.paths or ())}" + (hidden if request.tunnel else "")


def _check_cname(policy: Policy, role: Role | None, name: str, request: Request | None
                 ) -> tuple[str, str, str] | None:
    """A CNAME may lead to a name the policy would refuse outright (db.internal, a denied host —
    for a client in a role, one its role denies too). A deny rule counts when it would refuse this
    same request sent to the alias's name (its ports, schemes, methods and paths included)."""
    try:
        host, _ = normalise_host(name.rstrip(".") or name)
    except HostFormError as err:
        return (f"cname:{err.form}", f"the name is an alias (CNAME) of {name!r}, which is refused: {err.reason}",
                "")
    aliased = replace(request, target=replace(request.target, host=host)) if request is not None else None
    tables = ((role.deny,) if role else ()) + (policy.deny,)
    for rule in (rule for table in tables for rule in table.candidates(host)):
        if aliased is not None:
            # Its expiry and WebSocket flag included: an expired deny rule refused every alias of its host while
            # the host itself was allowed (review round 18).
            holds = _conditions_hold(rule, aliased)
        else:  # no request to judge it on: only a rule with no condition but its expiry counts
            holds = (not rule.needs_visible_request and rule.ports is None and rule.schemes is None
                     and (rule.expires is None or datetime.now(UTC) < rule.expires))
        if holds:
            return (rule.where, f"the name is an alias (CNAME) of {host}, refused by deny rule {rule.pattern.text}",
                    rule.rule_id)
    return None


def _choose_pin(addresses: tuple[str, ...]) -> str:
    """Prefer IPv4: many networks (and the lab) route no IPv6. Every address was checked anyway."""
    for address in addresses:
        if ":" not in address:
            return address
    return addresses[0]


def _client_address(client: str | None) -> netaddr.IPAddress | None:
    if not client:
        return None
    try:
        # A dual-stack listener reports IPv4 clients as ::ffff:a.b.c.d; roles are written in IPv4.
        return netaddr.IPAddress(unwrap_mapped(client.split("%", 1)[0]))
    except (ValueError, netaddr.AddrFormatError):
        return None
