"""Suggest: a ``hosts.allow`` block from what the audit log shows was refused by host rules (or let
through by report mode, which is how an allowlist is rolled out).

Names are grouped by registrable domain with the Public Suffix List (the ``publicsuffixlist``
package's own snapshot: nothing is fetched at run time). What is never suggested, and is listed apart
with the reason instead:

* a name that resolved to an address the address rules refuse (an internal name, a rebinding name):
  every address in every record of the name is judged with the core's classification
  (``policy.addresses``; with ``--policy``, that policy's address rules, so a lab's re-admitted range
  counts as reachable), and one refused answer is enough;
* a name whose CNAME chain was refused;
* a public suffix itself (``co.uk``, ``github.io``; ``alice.github.io`` is suggested as itself, since
  ``github.io`` is a suffix under which anyone registers names);
* an IP address (allowlists name hosts), a name a deny rule refuses (an allow entry cannot override
  one), a request refused by ports or scheme before host rules.

The block is a whole policy document that loads and lints clean (checked before it is returned), with
``owner`` and ``expires`` on every entry and request counts and first/last seen as comments.
"""

from __future__ import annotations

import functools
import json
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta

from publicsuffixlist import PSLFILE, PublicSuffixList, encode_idn

from policy.addresses import AddressRules
from policy.decision import HOST, WOULD_REFUSE, precheck
from policy.hosts import HostFormError, normalise_host
from policy.lint import lint
from policy.loader import parse_policy
from policy.model import DENY, Policy

from .audit_reader import LogItem, Record, Unreadable, shown
from .replay import NotReplayable, Skipped, request_of

OWNER_PLACEHOLDER = "TODO"
DEFAULT_EXPIRY_DAYS = 90
SHOWN = 5  # places and addresses shown per line of comment


@functools.cache
def public_suffix_list() -> PublicSuffixList:
    """The package's bundled snapshot, ICANN and private sections (github.io is a private-section suffix)."""
    return PublicSuffixList(accept_unknown=True, only_icann=False)


def registrable_domain(host: str) -> str | None:
    """The name one owner registered (``bbc.co.uk``, ``alice.github.io``), or None for a public suffix."""
    return public_suffix_list().privatesuffix(host)


def is_public_suffix(host: str) -> bool:
    return public_suffix_list().is_public(host)


@functools.cache
def _suffix_parents() -> frozenset[str]:
    """Every name that has a public suffix strictly below it (amazonaws.com: s3.amazonaws.com), read
    from the same snapshot: ``.amazonaws.com`` would cover every S3 bucket, so it is never proposed."""
    parents: set[str] = set()
    with open(PSLFILE, encoding="utf-8") as source:
        for line in source:
            rule = line.strip().removeprefix("!").removeprefix("*.")
            if not rule or rule.startswith("//"):
                continue
            try:
                labels = encode_idn(rule).lower().split(".")
            except UnicodeError:
                labels = rule.lower().split(".")  # a rule Python's codec refuses: compared as written
            parents.update(".".join(labels[i:]) for i in range(1, len(labels)))
    return frozenset(parents)


def has_public_suffix_below(domain: str) -> bool:
    return domain in _suffix_parents()


@dataclass
class Seen:
    """One name the log asks for: how often, when, on which ports, what it resolved to."""

    host: str
    count: int = 0
    first: str = ""
    last: str = ""
    ports: Counter[int] = field(default_factory=Counter)
    addresses: set[str] = field(default_factory=set)

    def add(self, record: Record) -> None:
        self.count += 1
        self.first = self.first or record.time_text
        self.last = record.time_text
        if record.port is not None:
            self.ports[record.port] += 1
        self.addresses.update(record.addresses)


@dataclass
class Findings:
    allow: dict[str | None, dict[str, Seen]] = field(default_factory=dict)  # role (None: top level) -> names
    apart: dict[str, dict[str, str]] = field(default_factory=dict)  # name -> {reason: where first seen}
    asked: set[str] = field(default_factory=set)  # names a client asked for and did not get (candidates too)
    already_allowed: Counter[str] = field(default_factory=Counter)
    not_read: dict[str, Skipped] = field(default_factory=dict)
    decisions: int = 0
    before_since: int = 0
    first: str | None = None
    last: str | None = None

    def set_apart(self, host: str, reason: str, place: str = "") -> None:
        reasons = self.apart.setdefault(host, {})
        if reason not in reasons and len(reasons) < 3:
            reasons[reason] = place

    def listed_apart(self) -> dict[str, dict[str, str]]:
        """The names left out that a client asked for (not every name of the log with an odd address)."""
        return {host: reasons for host, reasons in self.apart.items() if host in self.asked}

    def skip(self, place: str, reason: str) -> None:
        skipped = self.not_read.setdefault(reason, Skipped())
        skipped.count += 1
        if len(skipped.places) < 1000:
            skipped.places.append(place)

    def suggested(self, role: str | None = None) -> dict[str, Seen]:
        """The names proposed (for a role's own lists when ``role`` is given), apart ones removed."""
        return {host: seen for host, seen in self.allow.get(role, {}).items() if host not in self.apart}


def collect(items: Iterable[LogItem], address_rules: AddressRules | None = None, policy: Policy | None = None,
            since: datetime | None = None) -> Findings:
    """Read the log once. With ``policy``, each candidate is judged by that policy's rules instead of the
    rule the record names (so names it already allows are left out), and its address rules are used."""
    rules = address_rules or (policy.addresses if policy is not None else AddressRules())
    found = Findings()
    for item in items:
        if isinstance(item, Unreadable):
            found.skip(str(item.place), item.reason)
            continue
        if since is not None and item.time < since:
            found.before_since += 1
            continue
        if not isinstance(item, Record) or item.event != "decision":
            continue
        found.decisions += 1
        found.first = found.first or item.time_text
        found.last = item.time_text
        if item.host is not None:
            _judge(found, item, rules, policy)
    return found


def _judge(found: Findings, record: Record, rules: AddressRules, policy: Policy | None) -> None:
    host = record.host
    assert host is not None
    try:
        normalised, ip = normalise_host(host)
    except HostFormError as err:
        found.skip(str(record.place), f"the record's host does not parse: {err.reason}")
        return
    if normalised != host:
        found.skip(str(record.place), "the record's host is not in normalised form")
        return
    where = str(record.place)
    for address in record.addresses:
        try:
            checked = rules.check(address)
        except ValueError:
            found.set_apart(host, f"resolved to {shown(address)}, which is not an IP address", where)
            continue
        if not checked.allowed:
            found.set_apart(host, f"resolved to {checked.address}, which the address rules refuse: "
                                  f"{checked.reason}", where)
    cname_refused = record.stage == "resolve" and not record.rule.startswith("dns:")
    if cname_refused:
        if record.verdict == "report":  # let through by report mode: enforce mode refuses it
            found.set_apart(host, "its CNAME chain is refused in enforce mode: "
                                  f"{shown(record.reason.removeprefix(WOULD_REFUSE))}", where)
        else:
            found.set_apart(host, f"its CNAME chain is refused: {shown(record.reason)}", where)
    if record.verdict == "refuse" and (record.stage == "address" or cname_refused):
        found.asked.add(host)  # in report mode, how an internal name shows: host rules passed it on, addresses not
    if not ((record.verdict == "refuse" and record.stage == HOST) or record.verdict == "report"):
        return
    found.asked.add(host)
    if ip is not None:
        found.set_apart(host, "an IP address, not a name: allowlists name hosts (addresses.allow re-admits "
                              "a range, if it must be reached)", where)
        return
    role = _candidate_role(found, record, policy)
    if role is False:
        return
    if is_public_suffix(host):
        found.set_apart(host, "a public suffix (Public Suffix List): names under it belong to many owners, "
                              "so no entry is proposed for it", where)
        return
    names = found.allow.setdefault(role, {})
    names.setdefault(host, Seen(host)).add(record)


def _candidate_role(found: Findings, record: Record, policy: Policy | None) -> str | None | bool:
    """The role whose allow list the name would go to (None: the top-level one), or False when an allow
    entry would not help (a deny rule, a port) or is not needed (the policy already allows it)."""
    host = record.host or ""
    if policy is None:
        if not _default_deny(record):
            found.set_apart(host, f"refused by deny rule {shown(record.rule_id)}: an allow entry does not "
                                  "override a deny rule", str(record.place))
            return False
        near = _NEAR_MISS.search(record.reason)
        if near is not None:  # the decision's words for an allow rule that named the host (policy/decision.py)
            found.set_apart(host, f"named by allow rule {shown(near[1])}, whose conditions refused this request: an "
                                  "entry for the host would widen that rule; change its conditions if this request "
                                  "should pass", str(record.place))
            return False
        return record.role
    try:
        verdict = precheck(policy, request_of(record))
    except NotReplayable as err:
        found.skip(str(record.place), str(err))
        return False
    if verdict.allowed and not verdict.report_only:
        found.already_allowed[host] += 1
        return False
    if verdict.stage != HOST:
        found.set_apart(host, f"refused by {shown(verdict.rule)} before host rules: {verdict.reason}",
                        str(record.place))
        return False
    if verdict.matched is not None and verdict.matched.action == DENY:
        found.set_apart(host, f"refused by deny rule {verdict.matched.pattern.text} ({verdict.rule}): an allow "
                              "entry does not override a deny rule", str(record.place))
        return False
    if verdict.matched is not None:
        # An allow rule names the host and refused this request by its conditions (methods, ports, paths...):
        # a bare entry for the host would widen what that rule was written to allow.
        near = verdict.matched
        found.set_apart(host, f"named by allow rule {near.pattern.text} ({near.where}), whose conditions refused "
                              "this request: an entry for the host would widen that rule; change its conditions "
                              "if this request should pass", str(record.place))
        return False
    return verdict.role


# "...denies by default); rule api.example.com (policy.yaml:7) allows only methods ['GET']" (``_near_miss``): the
# origin is read up to the ") " before the rule's words, as a file name may hold parentheses ("policy (copy).yaml").
_NEAR_MISS = re.compile(r"denies by default\); rule (\S+ \(.*\)) (?:expired |allows only |does not allow )")


def _default_deny(record: Record) -> bool:
    """A host refusal by the default rather than by a deny rule (this format's rule text, or the core's
    stable ids ``default:deny`` / ``roles.NAME.default:deny``)."""
    return record.rule.startswith("default deny") or record.rule_id == "default:deny" or (
        record.rule_id.startswith("roles.") and record.rule_id.endswith(".default:deny"))


# ---- the YAML ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Options:
    owner: str = OWNER_PLACEHOLDER
    expires: str | None = None  # a date, YYYY-MM-DD; None: no expiry
    domains: bool = False  # one ".registrable" entry per domain instead of the exact names


def expiry_date(text: str, today: date | None = None) -> str | None:
    """``--expires``: a date (2027-03-01), days from today (90d), or ``never``."""
    today = today or datetime.now(UTC).date()
    if text == "never":
        return None
    if text.endswith("d") and text[:-1].isascii() and text[:-1].isdigit():
        if not 1 <= int(text[:-1]) <= 36500:
            raise ValueError(f"--expires {text!r}: between 1d and 36500d")
        return (today + timedelta(days=int(text[:-1]))).isoformat()
    try:
        day = date.fromisoformat(text) if len(text) == 10 else None
    except ValueError:
        day = None
    if day is None:
        raise ValueError(f"--expires {text!r}: expected a date (2027-03-01), a number of days (90d) or never")
    if day <= today:
        raise ValueError(f"--expires {text}: the date has passed, so the entries would never match")
    return day.isoformat()


def render(found: Findings, options: Options, logs: list[str], address_source: str) -> str:
    """The proposed policy document; raises RuntimeError if it does not load (a bug, never shown)."""
    out = ["# egresswall suggest: a hosts.allow block from the audit log",
           f"# read: {', '.join(shown(log) for log in logs)} ({found.decisions} decision line(s)"
           + (f", {found.first} .. {found.last})" if found.first else ")"),
           "# from: requests refused by host rules, or let through by report mode",
           f"# addresses judged by: {address_source}",
           "# Review every entry before adding it to your policy: set owner; expires is when it stops matching."]
    out += _not_read_comments(found)
    out += ["version: 1", "hosts:"]
    entries = _entries(found, None, options)
    out += ["  allow:", *entries] if entries else ["  allow: []"]
    for role in sorted(r for r in found.allow if r is not None):
        role_entries = _entries(found, role, options)
        if role_entries:
            out.append(f"# Clients in role {shown(role)} are judged by that role's own host lists: these go under")
            out.append(f"# the hosts.allow of role {shown(role)} in your policy.")
            out += ["#" + line[1:] if line.startswith(" ") else line for line in role_entries]
    out += _apart_comments(found)
    text = "\n".join(out) + "\n"
    _check_loads(text)
    return text


def _entries(found: Findings, role: str | None, options: Options) -> list[str]:
    names = found.suggested(role)
    groups: dict[str, list[Seen]] = {}
    for host, seen in names.items():
        groups.setdefault(registrable_domain(host) or host, []).append(seen)
    out: list[str] = []
    for domain in sorted(groups):
        members = sorted(groups[domain], key=lambda s: s.host)
        requests = sum(s.count for s in members)
        out.append(f"    # {domain}: {len(members)} name(s), {requests} request(s)")
        covered_apart = [h for h in found.listed_apart() if h == domain or h.endswith("." + domain)]
        whole_domain = options.domains and not covered_apart and not has_public_suffix_below(domain)
        if options.domains and covered_apart:
            out.append(f"    # (exact names: .{domain} would also cover {', '.join(sorted(covered_apart)[:SHOWN])}, "
                       "listed apart below)")
        elif options.domains and not whole_domain:
            out.append(f"    # (exact names: public suffixes lie under {domain}, so .{domain} would cover names of "
                       "other owners)")
        if whole_domain:
            for seen in members:
                out.append(f"    # {_seen_comment(seen)}")
            out += _entry(f".{domain}", options)
            continue
        for seen in members:
            out.append(f"    # {_seen_comment(seen)}")
            out += _entry(seen.host, options)
    return out


def _entry(pattern: str, options: Options) -> list[str]:
    lines = [f"    - host: {json.dumps(pattern)}", f"      owner: {json.dumps(options.owner)}"]
    if options.expires is not None:
        lines.append(f"      expires: {json.dumps(options.expires)}")
    return lines


def _seen_comment(seen: Seen) -> str:
    ports = ", ".join(str(port) for port, _ in seen.ports.most_common())
    if seen.addresses:
        shown = sorted(seen.addresses)[:SHOWN]
        resolved = "resolved to " + ", ".join(shown) + (", ..." if len(seen.addresses) > SHOWN else "")
    else:
        resolved = "not resolved at the time (refused before any lookup; its addresses are checked when asked for)"
    return f"{seen.host}: {seen.count} request(s), first {seen.first}, last {seen.last}, port(s) {ports}; {resolved}"


def _apart_comments(found: Findings) -> list[str]:
    out = []
    apart = found.listed_apart()
    if apart:
        out.append("# Not suggested:")
        for host in sorted(apart):
            for reason, place in apart[host].items():
                out.append(f"#   {host}: {reason}" + (f" (first at {place})" if place else ""))
    if found.already_allowed:
        names = sorted(found.already_allowed)
        more = f", ... ({len(names) - SHOWN} more)" if len(names) > SHOWN else ""
        out.append(f"# Already allowed by the policy given, so left out: {', '.join(names[:SHOWN])}{more}")
    return out


def _not_read_comments(found: Findings) -> list[str]:
    out = []
    for reason, skipped in sorted(found.not_read.items()):
        more = f", ... ({skipped.count - SHOWN} more)" if skipped.count > SHOWN else ""
        out.append(f"# not read: {skipped.count} line(s): {shown(reason)} (at {', '.join(skipped.places[:SHOWN])}"
                   f"{more})")
    if found.before_since:
        out.append(f"# before --since: {found.before_since} line(s)")
    return out


def _check_loads(text: str) -> None:
    try:
        parse_policy(text, "<egresswall suggest>")
    except ValueError as err:
        raise RuntimeError(f"egresswall suggest produced a policy that does not load: {err}") from err


def lint_warnings(text: str) -> list[str]:
    """What ``egresswall lint`` says of the suggestion (an --expires within its warning window)."""
    return [str(warning) for warning in lint(parse_policy(text, "<egresswall suggest>"))]


