"""Warnings for operators: rules that can never match (a wss-only rule a tunnel never meets among them), rules
shadowed by earlier ones, expired entries, overlapping ranges, an allow rule taking in a whole public suffix and
a pattern IDNA reads as another host. A policy with warnings still loads; lint tells what it will do."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

import idna
import netaddr

from .model import ALLOW, DENY, HostRule, HostTable, Origin, Policy, ech_allowed
from .patterns import PatternKind
from .ports import ports_text


@dataclass(frozen=True)
class LintWarning:
    origin: Origin
    message: str

    def __str__(self) -> str:
        where = f"{self.origin.source}:{self.origin.line}:{self.origin.column}" if self.origin.line else str(
            self.origin)
        key = f" {self.origin.path}:" if self.origin.path else ""
        return f"{where}:{key} {self.message}"


def lint(policy: Policy, now: datetime | None = None) -> list[LintWarning]:
    now = now or datetime.now(UTC)
    warnings: list[LintWarning] = []
    scopes: list[tuple[str, HostTable, HostTable]] = [("", policy.allow, policy.deny)]
    scopes += [(f"role {r.name}: ", r.allow, r.deny) for r in policy.roles]
    for prefix, allow, deny in scopes:
        for table in (deny, allow):
            positions = {id(rule): i for i, rule in enumerate(table.rules)}
            for i, rule in enumerate(table.rules):
                warnings += [LintWarning(rule.origin, prefix + m) for m in _never_matches(policy, rule, now)]
                remapped = _remapped(rule)
                if remapped is not None:
                    warnings.append(LintWarning(rule.origin, f"{prefix}{rule.pattern.text!r} is read as {remapped!r} "
                                                             "(IDNA's mapping, as a browser reads a host); write it "
                                                             "so, and the rule says what it matches"))
                shadow = _shadowed_by(table, positions, i, rule)
                if shadow is not None:
                    warnings.append(LintWarning(rule.origin, f"{prefix}{rule.pattern.text} is shadowed by the earlier "
                                                             f"rule {shadow.pattern.text} ({shadow.where}), "
                                                             "which matches every request it would"))
        for rule in allow.rules:
            blocker = _blocking_deny(deny, policy.deny, rule)
            if blocker is not None:
                warnings.append(LintWarning(rule.origin, f"{prefix}allow {rule.pattern.text} can never match: deny "
                                                         f"rule {blocker.pattern.text} ({blocker.where}) refuses "
                                                         "every host it names"))
    warnings += _overlapping_ranges(policy)
    warnings += _whole_address_space_allowed(policy)
    warnings += _address_literals_not_readmitted(policy, scopes)
    warnings += _sessions_dodged_by_ech(policy)
    return warnings


def _sessions_dodged_by_ech(policy: Policy) -> list[LintWarning]:
    """Sessions narrow an open-web policy that lets Encrypted Client Hello through (``tls.ech`` unset, no host
    to refuse): a tunnel under a session granted one name is judged by its outer name, and ECH can carry any
    host behind it (a CDN's). Not refused by default, since every Chromium not launched by egresswall sends a
    GREASE ECH that cannot be told from a real one; said here, with the way to close it."""
    if not policy.requires_sessions or policy.tls_ech or not ech_allowed(policy):
        return []
    return [LintWarning(policy.default_origin, "sessions are required, but Encrypted Client Hello is let through "
                                               "(tls.ech unset on an open-web policy with no host to refuse): a "
                                               "session granted one name (a CDN's) can reach any host behind it "
                                               "with ECH; set tls: {ech: refuse} (its clients' Chromium then needs "
                                               "EncryptedClientHelloEnabled: false, which egresswall's launcher "
                                               "sets), or tls: {ech: allow} to accept it")]


def notes(policy: Policy) -> list[LintWarning]:
    """What the policy deliberately gives up, said every time it is linted (not warnings: ``--strict`` passes)."""
    upstream = policy.upstream
    if upstream is None:
        return []
    return [LintWarning(upstream.origin, f"every allowed request and tunnel goes through the upstream proxy "
                                         f"{upstream.url}, which resolves names itself: the address guarantee is "
                                         "weakened (address rules run on egresswall's own resolution, but the "
                                         "connection is not pinned to the address checked)")]


def _address_literals_not_readmitted(policy: Policy, scopes: list[tuple[str, HostTable, HostTable]]
                                     ) -> list[LintWarning]:
    """``allow: [10.0.0.5]`` lets the name through and the address rules refuse the connection: lists narrow
    and never widen, so only an addresses.allow range re-admits a non-global address."""
    out = []
    for prefix, allow, _ in scopes:
        for rule in allow.rules:
            name = rule.pattern.name
            if rule.pattern.kind is not PatternKind.EXACT or not (":" in name or name[-1:].isdigit()):
                continue  # a name (a host ending in a number is refused unless it is a dotted quad)
            checked = policy.addresses.check(name)
            if not checked.allowed:
                # One clause, as every other warning: the reason already says what re-admits the address
                # (an addresses.allow range, or nothing for cloud metadata); say only what it leaves out.
                unsaid = ("" if "host allow rule" in checked.reason
                          else "; a host allow rule does not re-admit an address")
                out.append(LintWarning(rule.origin, f"{prefix}allow {rule.pattern.text} can never be reached: "
                                                    f"{checked.reason}{unsaid}"))
    return out


def _remapped(rule: HostRule) -> str | None:
    """What a pattern written with characters IDNA maps to others (``ⓐ.com``, a zero-width space, full-width
    letters or dots) is read as; None when it reads as written, but for case. The rule id and metric label keep
    the written form, so a reader of either would not see which host the rule names (review round 16)."""
    text = rule.pattern.text
    if text.isascii():
        return None
    try:
        remapped = idna.uts46_remap(text, std3_rules=False, transitional=False)
    except (idna.IDNAError, UnicodeError, ValueError):
        return None  # refused by the loader already
    return None if remapped == text.lower() else remapped


def _never_matches(policy: Policy, rule: HostRule, now: datetime) -> list[str]:
    out = []
    name = rule.pattern.name
    if rule.pattern.kind is PatternKind.EXACT and "." not in name and ":" not in name:
        out.append(f"{rule.action} {rule.pattern.text} can never match: egresswall refuses a host name of one label "
                   "(form:no-dot) before any host rule; name the host in full")
    if rule.expired(now):
        out.append(f"{rule.action} {rule.pattern.text} expired at {rule.expires:%Y-%m-%d %H:%M} UTC and no "
                   "longer matches")
    elif rule.expires is not None and (rule.expires - now).days < 14:
        out.append(f"{rule.action} {rule.pattern.text} stops matching at {rule.expires:%Y-%m-%d %H:%M} UTC")
    if rule.ports is not None:
        usable = policy.connect_ports | policy.http_ports
        dead = sorted(rule.ports - usable)
        if dead:
            out.append(f"{rule.pattern.text}: port(s) [{ports_text(dead)}] are in neither ports.connect nor "
                       "ports.http, so requests to them are refused before host rules")
    plain_only = rule.schemes is not None and rule.schemes <= {"http", "ws"}  # says itself it is plain-HTTP only
    if rule.needs_visible_request and not rule.intercept and rule.action == ALLOW and not plain_only:
        seen_in_clear = rule.schemes is None or bool(rule.schemes & {"http", "ws"})
        suffix = ("; it matches only plain-HTTP requests" if seen_in_clear
                  else "; with only https/wss schemes it can never match")
        out.append(f"{rule.pattern.text}: methods/paths cannot be checked inside a TLS tunnel without "
                   f"intercept: true{suffix}")
    intercepted = rule.intercept if rule.action == ALLOW else any(
        r.intercept for r in policy.allow.candidates(rule.pattern.name))
    if rule.schemes is not None and "wss" in rule.schemes and "https" not in rule.schemes and not intercepted:
        # A browser's wss:// is a CONNECT, decided as https before any request inside it is seen (review round 21).
        out.append(f"{rule.action} {rule.pattern.text}: its scheme wss is never seen in a passed-through TLS tunnel "
                   "(a wss:// connection is a CONNECT, decided as https), so "
                   + ("wss:// to this host is not refused; add https, or intercept the host (intercept: true) on an "
                      "allow rule" if rule.action == DENY else
                      "it lets no wss:// through; add https, or intercept: true"))
    if rule.needs_visible_request and rule.action == DENY and not plain_only and not any(
            r.intercept for r in policy.allow.candidates(rule.pattern.name)):
        out.append(f"deny {rule.pattern.text}: its methods/paths are checked only in plain HTTP; HTTPS to this host "
                   "passes through a TLS tunnel unchecked unless an allow rule intercepts it (intercept: true)")
    return out


def _narrows(rule: HostRule) -> bool:
    return any(x is not None for x in (rule.ports, rule.schemes, rule.methods, rule.paths))


def _unconditional(rule: HostRule) -> bool:
    return not _narrows(rule) and rule.expires is None and rule.websocket


def _covering(table: HostTable, rule: HostRule):
    """Rules in table whose pattern covers rule's pattern (looked up by suffix, not by scanning)."""
    probe = rule.pattern.name if rule.pattern.kind is PatternKind.EXACT else "lint-probe." + rule.pattern.name
    seen = set()
    hosts = [probe] + ([rule.pattern.name] if rule.pattern.kind is PatternKind.DOMAIN else [])
    for host in hosts:
        for other in table.candidates(host):
            if id(other) not in seen and other.pattern.covers(rule.pattern):
                seen.add(id(other))
                yield other


def _shadowed_by(table: HostTable, positions: dict[int, int], position: int, rule: HostRule) -> HostRule | None:
    for other in _covering(table, rule):
        if positions[id(other)] < position and _unconditional(other):
            return other
    return None


def _blocking_deny(deny: HostTable, global_deny: HostTable, rule: HostRule) -> HostRule | None:
    for table in (deny, global_deny):
        for other in _covering(table, rule):
            if other.action == DENY and _unconditional(other):
                return other
    return None


def _whole_address_space_allowed(policy: Policy) -> list[LintWarning]:
    """An addresses.allow range that is a whole address family (``0.0.0.0/0``, ``::/0``, or ``::ffff:0:0/96``, which
    is read as the IPv4 it maps: all of it) re-admits loopback, private ranges and link-local with the rest; only
    cloud metadata and addresses.deny are refused then. Loaded as written, and said."""
    out: list[LintWarning] = []
    for action, cidr, origin in policy.address_rules_text:
        network = netaddr.IPNetwork(cidr)
        if action != ALLOW or network.prefixlen != 0:
            continue
        what = ("every IPv4 address (::ffff:0:0/96 is read so too: the IPv4 it maps): loopback, private ranges, "
                "link-local" if network.version == 4 else
                "every IPv6 address but ::1 and :: (which only naming them re-admits): unique-local, link-local, "
                "site-local")
        out.append(LintWarning(origin, f"addresses.allow {cidr} re-admits {what} and the rest of what egresswall "
                                       "refuses by default (only cloud metadata, addresses.deny and, for IPv6, the "
                                       "IPv4 inside a wrapping stay refused)"))
    return out


def _overlapping_ranges(policy: Policy) -> list[LintWarning]:
    out: list[LintWarning] = []
    ranges = [(action, netaddr.IPNetwork(cidr), cidr, origin) for action, cidr, origin in policy.address_rules_text]
    for i, (action_a, net_a, text_a, _) in enumerate(ranges):
        for action_b, net_b, text_b, origin_b in ranges[i + 1:]:
            if net_a.version != net_b.version or not (net_a.first <= net_b.last and net_b.first <= net_a.last):
                continue
            if action_a == action_b:
                message = f"addresses.{action_b} {text_b} overlaps {text_a}"
            else:
                message = f"{text_b} is in both addresses.allow and addresses.deny (with {text_a}); deny wins"
            out.append(LintWarning(origin_b, message))
    roles = policy.roles
    for i, role_a in enumerate(roles):
        for role_b in roles[i + 1:]:
            common = role_a.clients & role_b.clients
            if common:
                out.append(LintWarning(role_b.origin, f"role {role_b.name}'s clients overlap role {role_a.name}'s "
                                                      f"({', '.join(map(str, common.iter_cidrs()[:3]))}); the "
                                                      f"first role, {role_a.name}, wins"))
    return out
