"""``egresswall squid export``: a squid.conf access-control section enforcing a policy as closely as squid can.

The http_access program has the policy's order of decision: refused addresses, then ports and schemes,
then the global deny rules (every client), then each role (its deny rules, its allow rules, its default),
then the global allow rules and default. Host patterns use ``-n`` (no reverse lookups, as egresswall).
What squid cannot express is said in a comment where it applies; where squid cannot be exact, the
export refuses more than the policy, never less.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime

import idna
import netaddr

from policy.model import ALLOW, DENY, HostRule, Policy, Role
from policy.patterns import PatternKind
from policy.ports import port_runs

from . import addrsets
from .acls import SQUID_METHODS
from .report import printable

VALUES_PER_LINE = 8
NON_ASCII_HOST = "[^!-~]"  # a host with any byte outside printable ASCII (squid has no locale: bytes)
_POSIX_SPECIAL = frozenset(".[]()*+?{}|^$")


@dataclass
class _Writer:
    lines: list[str] = field(default_factory=list)
    counter: int = 0
    defined: set[str] = field(default_factory=set)

    def shared_acl(self, name: str, type_: str, values: list[str]) -> str:
        """An ACL several rules use, written once (before the first line that needs it)."""
        if name not in self.defined:
            self.defined.add(name)
            self.acl(name, type_, values)
        return name

    def comment(self, text: str) -> None:
        self.lines += [f"# {printable(line)}".rstrip() for line in text.split("\n")]

    def blank(self) -> None:
        self.lines.append("")

    def acl(self, name: str, type_: str, values: list[str], flags: str = "") -> None:
        flags = f"{flags} " if flags else ""
        for i in range(0, max(len(values), 1), VALUES_PER_LINE):
            self.lines.append(f"acl {name} {type_} {flags}{' '.join(values[i:i + VALUES_PER_LINE])}".rstrip())

    def access(self, action: str, *acls: str) -> None:
        self.lines.append(f"http_access {action} {' '.join(acls)}".rstrip())

    def name(self, stem: str) -> str:
        self.counter += 1
        return f"ew_{stem}{self.counter}"

    def text(self) -> str:
        """The file. squid joins a line ending in a backslash to the next one (an ACL value would swallow the
        http_access line after it) and ends a line at a newline, carriage return or NUL: no line written may
        do either, whatever a policy holds."""
        for number, line in enumerate(self.lines, 1):
            if any(ch in line for ch in "\n\r\0") or (line.endswith("\\") and not line.startswith("#")):
                raise RuntimeError(f"internal error: exported line {number} would not read as written: {line!r}")
        return "\n".join(self.lines) + "\n"


def export_policy(policy: Policy, now: datetime | None = None) -> str:
    now = now or datetime.now(UTC)
    out = _Writer()
    out.comment(f"squid.conf access control written by `egresswall squid export` from {policy.source}.\n"
                "Put it before any other http_access line (squid uses the first line that matches).\n\n"
                "What squid cannot express, and how this file deals with it:\n"
                "- pinning: egresswall connects only to an address it checked; squid resolves the name again\n"
                "  when it connects. The address list below refuses a name when ANY of its addresses is refused,\n"
                "  which is egresswall's 'every address must pass', but squid may still reach a new answer.\n"
                "- IPv6 wrappings: egresswall judges the IPv4 inside ::ffff:0:0/96 (IPv4-mapped); squid stores\n"
                "  IPv4 addresses as IPv4-mapped IPv6, so 'dst ::ffff:0:0/96' would match EVERY IPv4 address and is\n"
                "  never written: the IPv4 ranges below cover mapped addresses. NAT64 (64:ff9b::/96), 6to4\n"
                "  (2002::/16) and Teredo (2001::/32) are refused whole, as egresswall does. An ISATAP interface\n"
                "  identifier (::5efe:a.b.c.d, under any prefix) is not written: egresswall refuses one whose IPv4\n"
                "  is refused, squid cannot tell it from any other IPv6 address.\n"
                "- host forms: egresswall refuses userinfo, numeric IPv4 spellings, names without a dot, .local,\n"
                "  .internal and more before any rule; squid has no such check.\n"
                "- names that do not resolve: egresswall refuses them; squid answers with its own error page.\n"
                "- CNAME chains: egresswall refuses a name whose CNAME leads to a refused name; squid does not\n"
                "  look at the chain.\n"
                "- limits (connections, request body size) and the resolver settings are not access control and\n"
                "  are not written.")
    if policy.mode != "enforce":
        out.comment(f"- mode: {policy.mode}: squid has no report mode; this file enforces the host rules.")
    out.blank()
    _prologue(policy, out)
    for rule in policy.deny.rules:
        _rule(out, DENY, rule, None, now)
    roles = _effective_roles(policy)
    for role, clients in roles:
        out.blank()
        out.comment(f"role {role.name} ({role.origin})")
        if not clients:
            out.comment(f"every client of role {role.name} is in an earlier role; nothing to write")
            continue
        src = out.name(f"role_{_slug(role.name)}_")
        out.acl(src, "src", _squid_ranges(clients))
        for rule in role.deny.rules:
            _rule(out, DENY, rule, src, now)
        for rule in role.allow.rules:
            _rule(out, ALLOW, rule, src, now)
        default = role.default or policy.default
        out.comment(f"role {role.name}: default {default}" + ("" if role.default else " (the policy's)"))
        out.access(default, src)
    out.blank()
    if policy.allow.rules:
        out.comment("clients in no role" if roles else "allow rules")
    for rule in policy.allow.rules:
        _rule(out, ALLOW, rule, None, now)
    out.comment(f"default {policy.default} ({policy.default_origin})")
    out.access(policy.default, "all")
    return out.text()


def _prologue(policy: Policy, out: _Writer) -> None:
    allow = [cidr for action, cidr, _ in policy.address_rules_text if action == ALLOW]
    deny = [cidr for action, cidr, _ in policy.address_rules_text if action == DENY]
    # A deny range written inside one of the network's NAT64 prefixes refuses the IPv4 it reaches too.
    deny += [str(reached) for cidr in deny
             if (reached := policy.addresses.through_nat64(netaddr.IPNetwork(cidr))) != netaddr.IPNetwork(cidr)]
    # squid cannot judge the IPv4 a NAT64 address reaches: the network's translator prefixes are refused whole.
    nat64 = list(policy.addresses.nat64_prefixes)
    refused = addrsets.refused(allow, deny + nat64, policy.addresses.refuse_cloud_metadata)
    out.comment("Addresses egresswall refuses: every non-global range (IANA special-purpose registries),"
                + (" cloud metadata," if policy.addresses.refuse_cloud_metadata else "")
                + " and addresses.deny" + (", less addresses.allow" if allow else "") + ".")
    if nat64:
        out.comment("addresses.nat64 refused whole (egresswall judges the IPv4 each address reaches, squid cannot): "
                    + ", ".join(nat64))
    if allow:
        out.comment("re-admitted by addresses.allow: " + ", ".join(allow)
                    + f"\n(to import this file back: egresswall squid import --readmit {' --readmit '.join(allow)})")
    out.acl("ew_refused_addresses", "dst", _squid_ranges(refused))
    out.comment("Host names written with a byte outside printable ASCII: egresswall decides the A-label (xn--)\n"
                "of a Unicode name, whatever its case, normal form or dots (bücher.example, BÜCHER.example and\n"
                "bücher。example are all xn--bcher-kva.example); squid compares the bytes a client wrote, so no\n"
                "host rule can follow every spelling. They are refused (browsers send A-labels); each host rule\n"
                "below lists the Unicode spelling of a name too.")
    out.acl("ew_non_ascii_host", "dstdom_regex", [NON_ASCII_HOST], "-n")
    out.acl("ew_connect", "method", ["CONNECT"])
    out.acl("ew_connect_ports", "port", _port_values(policy.connect_ports) or ["0"])
    out.acl("ew_http_ports", "port", _port_values(policy.http_ports) or ["0"])
    out.acl("ew_http", "proto", ["HTTP"])
    out.acl("ew_https", "proto", ["HTTPS"])
    out.acl("ew_tls", "any-of", ["ew_connect", "ew_https"])
    out.access(DENY, "ew_refused_addresses")
    out.access(DENY, "ew_non_ascii_host")
    out.comment("ports: a CONNECT and an absolute-form https:// request by ports.connect, plain HTTP by ports.http;\n"
                "no scheme but http and https (ws/wss travel as http/https or CONNECT)")
    out.access(DENY, "ew_tls", "!ew_connect_ports")
    out.access(DENY, "!ew_tls", "!ew_http")
    out.access(DENY, "ew_http", "!ew_http_ports")


def _squid_ranges(addresses: netaddr.IPSet) -> list[str]:
    """The ranges as squid reads them back: never a /0. squid 5.7 reads ``0.0.0.0/0`` as ``all`` (every IPv6
    address too) and ``::/0`` as the one address ``::`` (acl_ip_data::FactoryParse, applyMask(0)), so each is
    written as its two halves."""
    out = []
    for text in addrsets.cidrs(addresses):
        if text == "0.0.0.0/0":
            out += ["0.0.0.0/1", "128.0.0.0/1"]
        elif text == "::/0":
            out += ["::/1", "8000::/1"]
        else:
            out.append(text)
    return out


def _effective_roles(policy: Policy) -> list[tuple[Role, netaddr.IPSet]]:
    """Each role with only the clients no earlier role has: egresswall uses the first matching role."""
    taken = netaddr.IPSet()
    out = []
    for role in policy.roles:
        clients = role.clients - taken
        # A client in ::ffff:0:0/96 is judged as its IPv4 address by egresswall and stored so by squid.
        clients -= netaddr.IPSet([addrsets.MAPPED])
        out.append((role, clients))
        taken |= role.clients
    return out


def _rule(out: _Writer, action: str, rule: HostRule, src: str | None, now: datetime) -> None:
    notes = [f"{action} {rule.pattern.text} ({rule.origin})" + (f": {rule.reason}" if rule.reason else "")]
    if rule.expires is not None:
        if rule.expired(now):
            out.comment(notes[0] + f"\nexpired {rule.expires:%Y-%m-%d %H:%M} UTC: not written")
            return
        notes.append(f"expires {rule.expires:%Y-%m-%d %H:%M} UTC: squid has no date ACL; remove this rule by then")
    if rule.intercept:
        notes.append("intercept: true: squid (without ssl_bump) sees only the CONNECT, not the requests inside; "
                     "method and path conditions then refuse the tunnel")
    conditions = [src] if src else []
    conditions.append(_host_acl(out, rule))
    methods = sorted(rule.methods - {"CONNECT"}) if rule.methods is not None else None
    if rule.methods is not None and not methods:
        out.comment(notes[0] + "\nmethods only CONNECT, which egresswall never sees as a request method: never matches")
        return
    if rule.ports is not None:
        name = out.name("ports")
        out.acl(name, "port", _port_values(rule.ports) or ["0"])
        conditions.append(name)
    if rule.schemes is not None:
        tls, plain = bool(rule.schemes & {"https", "wss"}), bool(rule.schemes & {"http", "ws"})
        if not (tls and plain):
            conditions.append("ew_tls" if tls else "ew_http")
        if rule.schemes <= {"ws", "wss"}:
            notes.append("schemes ws/wss only: squid cannot tell a WebSocket upgrade apart; written for http/https")
    if methods:
        values = _method_values(methods) if action == DENY else methods
        if values is None:
            notes.append(f"methods {', '.join(methods)}: squid compares an extension method as written, case "
                         "included, and egresswall in any case; too many spellings to list, so this deny rule "
                         "refuses every method")
        else:
            name = out.name("methods")
            out.acl(name, "method", values)
            conditions.append(name)
    if not rule.websocket:
        conditions.append("!" + out.shared_acl("ew_websocket", "req_header", ["Upgrade", "-i", "^websocket$"]))
    for note in notes:
        out.comment(note)
    if rule.paths is not None:
        _path_rule(out, action, rule.paths, conditions)
        return
    out.access(action, *conditions)


def _path_rule(out: _Writer, action: str, paths: tuple[str, ...], conditions: list[str]) -> None:
    """A rule with a path condition: urlpath_regex, never admitting a path a server may read as another."""
    regexes = {path: _path_regex(path, action) for path in paths}
    unwritable = {path: why for path, (regex, why) in regexes.items() if regex is None}
    written = [regex for regex, _ in regexes.values() if regex is not None]
    if unwritable:
        out.comment("; ".join(f"path {json.dumps(path)}: {why}" for path, why in unwritable.items()) + "; "
                    + ("this deny rule refuses every path" if action == DENY else "left out of this allow rule"))
        if action == DENY:
            out.access(action, *conditions)
            return
        if not written:
            return
    name = out.name("paths")
    # A deny rule's paths match without regard to case too (egresswall: IIS serves /ADMIN as /admin).
    out.acl(name, "urlpath_regex", written, "-i" if action == DENY else "")
    # A backslash is written [\] (a member of a POSIX bracket): a value ending in \ would end its line in a
    # backslash, and squid would join the next line (this rule's http_access) into the ACL. squid matches a
    # urlpath_regex against the path and the query: the last two look at the path only (an empty segment, as in
    # //admin, and a segment's ';' parameters, which Tomcat drops: /admin;x/secret is /admin/secret there).
    out.shared_acl("ew_ambiguous_path", "urlpath_regex",
                   [r"(^|/)(\.|%2[eE]){1,2}(/|;|$)", r"%2[fF]", r"%5[cC]", r"^[^?]*//", r"^[^?]*;", r"[\]"])
    if action == ALLOW:
        # egresswall admits no path a server may read as another one (/docs/../admin).
        out.access(action, *conditions, name, "!ew_ambiguous_path")
    else:
        out.access(action, *conditions, name)
        out.access(action, *conditions, "ew_ambiguous_path")


MAX_METHOD_SPELLINGS = 256


def _method_values(methods: list[str]) -> list[str] | None:
    """A deny rule's methods as squid must list them: egresswall matches a method in any case, squid an extension
    method (PATCH) only as written, so every spelling of it is listed (squid reads its own methods in any case);
    None when there would be more than MAX_METHOD_SPELLINGS."""
    values: list[str] = []
    for method in methods:
        if method in SQUID_METHODS:
            values.append(method)
            continue
        if 2 ** sum(ch.isalpha() for ch in method) > MAX_METHOD_SPELLINGS:
            return None
        values.extend("".join(spelling) for spelling in itertools.product(*({ch.upper(), ch.lower()}
                                                                              for ch in method)))
    return sorted(set(values))


def _host_acl(out: _Writer, rule: HostRule) -> str:
    """The host pattern as an ACL, in every spelling squid may compare: the A-label and the Unicode one."""
    pattern = rule.pattern
    name = out.name("host")
    spellings = _spellings(pattern.name)
    if pattern.kind is PatternKind.SUBDOMAINS:
        out.acl(name, "dstdom_regex", ["\\." + spelling.replace(".", "\\.") + "$" for spelling in spellings], "-n")
    elif ":" in pattern.name:
        out.acl(name, "dstdomain", [f"[{pattern.name}]"], "-n")
    else:
        dot = "." if pattern.kind is PatternKind.DOMAIN else ""
        out.acl(name, "dstdomain", [dot + spelling for spelling in spellings], "-n")
    return name


def _spellings(name: str) -> list[str]:
    """The name (A-labels, as egresswall keeps it) and, when it differs, its Unicode spelling: squid compares
    the bytes a client wrote, and a client may write bücher.example for xn--bcher-kva.example."""
    try:
        unicode = ".".join(idna.ulabel(label) if label.startswith("xn--") else label for label in name.split("."))
    except (idna.IDNAError, UnicodeError, ValueError):
        return [name]
    return [name] if unicode == name else [name, unicode]


def _path_regex(pattern: str, action: str) -> tuple[str | None, str]:
    """(a regex squid matches against the path and query, "") for an egresswall path pattern — a prefix, or an
    fnmatch glob over the whole path when it has '*' —, or (None, why not). egresswall matches the path without
    its query: a glob's '*' and '?' stop at the '?' and any query may follow; a prefix with a '?' in it (which no
    path holds) is written for a deny rule only (in squid it would admit a query)."""
    if "*" not in pattern:
        if "?" in pattern and action == ALLOW:
            return None, "a '?' squid would match against the query, where egresswall matches the path only"
        literal = _posix_literal(pattern)
        return (None, _UNWRITABLE) if literal is None else ("^" + literal, "")
    if "[" in pattern:  # fnmatch's [...] and [!...]: not carried over (a class squid may match a '?' with)
        return None, "a glob's [...] class, which the export does not translate"
    parts = []
    for ch in pattern:
        literal = _posix_literal(ch)
        if literal is None:
            return None, _UNWRITABLE
        parts.append({"*": "[^?]*", "?": "[^?]"}.get(ch, literal))
    return "^" + "".join(parts) + r"(\?.*)?$", ""


_UNWRITABLE = "a character squid.conf cannot carry in a regex (a space, a control or non-ASCII character)"


def _posix_literal(text: str) -> str | None:
    """The text as a POSIX extended regex matching it literally, or None when squid.conf cannot carry it (a
    space ends the value, a newline the line). A backslash is [\\]: inside a bracket squid reads it as itself,
    and the value cannot end in a backslash."""
    out = []
    for ch in text:
        if not (ch.isascii() and ch.isprintable()) or ch == " ":
            return None
        out.append("[\\]" if ch == "\\" else "\\" + ch if ch in _POSIX_SPECIAL else ch)
    return "".join(out)


def _port_values(ports: frozenset[int]) -> list[str]:
    return [str(low) if low == high else f"{low}-{high}" for low, high in port_runs(ports)]


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name)
