"""The policy an import produces: a small model, built into an egresswall ``Policy`` (to check it
decides like squid) and written as YAML whose comments say where each entry came from."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from policy.addresses import AddressRules
from policy.model import ALLOW, DENY, HostRule, HostTable, Origin, Policy
from policy.patterns import HostPattern
from policy.ports import port_runs
from policy.yamldoc import plain_reads_as_text

from .report import printable

HTTP_SCHEMES = ("http", "ws")
TLS_SCHEMES = ("https", "wss")


@dataclass
class RuleSpec:
    pattern: str
    ports: frozenset[int] | None = None
    schemes: tuple[str, ...] | None = None
    methods: tuple[str, ...] | None = None
    paths: tuple[str, ...] | None = None
    comment: str = ""

    @property
    def unconditional(self) -> bool:
        return self.ports is None and self.schemes is None and self.methods is None and self.paths is None

    def host_rule(self, action: str, source: str = "squid import") -> HostRule:
        return HostRule(action=action, pattern=HostPattern.parse(self.pattern),
                        origin=Origin(source, 0, 0, self.pattern),
                        ports=self.ports, schemes=frozenset(self.schemes) if self.schemes else None,
                        methods=frozenset(self.methods) if self.methods else None, paths=self.paths)


@dataclass
class ScopeSpec:
    """The global section (name None) or one role."""

    name: str | None
    default: str
    default_comment: str = ""
    clients: list[str] = field(default_factory=list)
    comment: str = ""
    allow: list[RuleSpec] = field(default_factory=list)
    deny: list[RuleSpec] = field(default_factory=list)


@dataclass
class PolicySpec:
    header: list[str]
    connect_ports: frozenset[int]
    http_ports: frozenset[int]
    ports_comment: str = ""
    address_allow: list[tuple[str, str]] = field(default_factory=list)  # (cidr, comment)
    address_deny: list[tuple[str, str]] = field(default_factory=list)
    nameservers: list[str] = field(default_factory=list)
    nameservers_comment: str = ""
    scopes: list[ScopeSpec] = field(default_factory=list)

    def address_rules(self) -> AddressRules:
        return AddressRules(allow=[c for c, _ in self.address_allow], deny=[c for c, _ in self.address_deny])

    def scope_policy(self, scope: ScopeSpec, addresses: AddressRules | None = None) -> Policy:
        """One scope as a policy of its own (a role decides exactly like this when the global section
        has no deny rules, which is how ``to_yaml`` writes roles)."""
        return Policy(source="squid import", mode="enforce", default=scope.default,
                      default_origin=Origin("squid import"),
                      allow=HostTable.build([rule.host_rule(ALLOW) for rule in scope.allow]),
                      deny=HostTable.build([rule.host_rule(DENY) for rule in scope.deny]),
                      addresses=addresses or self.address_rules(), connect_ports=self.connect_ports,
                      http_ports=self.http_ports)


def port_items(ports: frozenset[int]) -> list[int | str]:
    items: list[int | str] = []
    for low, high in port_runs(ports):
        if high - low >= 2:
            items.append(f"{low}-{high}")
        else:
            items.extend(range(low, high + 1))
    return items


def _ports_yaml(ports: frozenset[int]) -> str:
    return "[" + ", ".join(str(i) if isinstance(i, int) else f'"{i}"' for i in port_items(ports)) + "]"


_PLAIN = re.compile(r"[A-Za-z0-9.][A-Za-z0-9._/-]*")  # whole text only (fullmatch: "$" matches before a final "\n")


def _scalar(text: str) -> str:
    """``text`` as a YAML scalar the policy loader reads back as that text: plain where it is a plain name the
    loader reads as text (``1e5``, ``10``, ``true`` and ``null`` are not), else quoted."""
    if _PLAIN.fullmatch(text) and plain_reads_as_text(text):
        return text
    # JSON's escapes are YAML's but for a character beyond U+FFFF, which JSON writes as two \u escapes (a
    # surrogate pair) and YAML reads as two lone surrogates: it gets YAML's \U escape.
    return _SURROGATE_PAIR.sub(_astral, json.dumps(text))


# A \u escape pair (not an escaped backslash followed by "u": an even run of backslashes before it).
_SURROGATE_PAIR = re.compile(r"(?<!\\)((?:\\\\)*)\\u(d[89ab][0-9a-f]{2})\\u(d[c-f][0-9a-f]{2})")


def _astral(pair: re.Match[str]) -> str:
    high, low = int(pair[2], 16), int(pair[3], 16)
    return f"{pair[1]}\\U{0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00):08x}"


def comment_lines(text: str, indent: str = "") -> list[str]:
    """YAML comment lines for a text: one per ``\\n`` the text means as a line break, everything else that
    could end a comment line or break the document (a NEL or line separator YAML reads as a line break, a
    control character, a byte that is not UTF-8, from a file name or a squid.conf value) escaped."""
    return [f"{indent}# {printable(line)}".rstrip() for line in text.split("\n")] if text else []


def _rule_yaml(rule: RuleSpec, indent: str) -> list[str]:
    out = comment_lines(rule.comment, indent)
    if rule.unconditional:
        return [*out, f"{indent}- {_scalar(rule.pattern)}"]
    out.append(f"{indent}- host: {_scalar(rule.pattern)}")
    if rule.ports is not None:
        out.append(f"{indent}  ports: {_ports_yaml(rule.ports)}")
    if rule.schemes is not None:
        out.append(f"{indent}  schemes: [{', '.join(rule.schemes)}]")
    if rule.methods is not None:
        out.append(f"{indent}  methods: [{', '.join(_scalar(method) for method in rule.methods)}]")
    if rule.paths is not None:
        out.append(f"{indent}  paths: [{', '.join(json.dumps(p) for p in rule.paths)}]")
    return out


def _hosts_yaml(scope: ScopeSpec, indent: str) -> list[str]:
    if not scope.allow and not scope.deny:
        return []
    out = [f"{indent}hosts:"]
    for key, rules in (("deny", scope.deny), ("allow", scope.allow)):
        if rules:
            out.append(f"{indent}  {key}:")
            for rule in rules:
                out += _rule_yaml(rule, indent + "    ")
    return out


def to_yaml(spec: PolicySpec) -> str:
    out = [line for text in spec.header for line in (comment_lines(text) or ["#"])]
    out += ["version: 1", "mode: enforce"]
    scopes = spec.scopes
    global_scope = next((s for s in scopes if s.name is None), ScopeSpec(None, DENY,
                                                                             "every client has a role below"))
    out += comment_lines(global_scope.default_comment, "")
    out.append(f"default: {global_scope.default}")
    out += comment_lines(spec.ports_comment, "")
    out += ["ports:", f"  connect: {_ports_yaml(spec.connect_ports)}", f"  http: {_ports_yaml(spec.http_ports)}"]
    if spec.address_allow or spec.address_deny:
        out.append("addresses:")
        for key, entries in (("allow", spec.address_allow), ("deny", spec.address_deny)):
            if entries:
                out.append(f"  {key}:")
                previous = None
                for cidr, comment in entries:
                    if comment != previous:  # one comment for a run of entries with the same origin
                        out += comment_lines(comment, "    ")
                    previous = comment
                    out.append(f"    - {_scalar(cidr)}")
    if spec.nameservers:
        out += comment_lines(spec.nameservers_comment, "")
        out += ["resolver:", f"  nameservers: [{', '.join(json.dumps(ns) for ns in spec.nameservers)}]"]
    out += _hosts_yaml(global_scope, "")
    roles = [s for s in scopes if s.name is not None]
    if roles:
        out.append("roles:")
        for role in roles:
            out += comment_lines(role.comment, "  ")
            out.append(f"  - name: {_scalar(role.name or '')}")
            out.append(f"    clients: [{', '.join(_scalar(c) for c in role.clients)}]")
            out += comment_lines(role.default_comment, "    ")
            out.append(f"    default: {role.default}")
            out += _hosts_yaml(role, "    ")
    return "\n".join(out) + "\n"
