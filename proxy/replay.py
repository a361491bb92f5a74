"""Replay: re-decide logged decisions with another policy and say what would change.

Pure: records in, a ``ReplayReport`` out. Each decision is re-decided with ``policy.decision`` from
what its record carries — client (for roles), method, scheme, host, port, path where the proxy saw it,
and the addresses and CNAME chain the name resolved to *at the time*. Nothing is looked up again: a
replay shows what the edit changes, not what DNS says today. What a record cannot tell is said, not
guessed: a name the old policy refused before any lookup has no addresses, so when the new policy's
host rules admit it the outcome is "allow, not resolved at the time" (its addresses are checked when it
is first asked for), and a lookup that failed at the time fails again.

Only policy decisions are replayed (stages scheme, port, host, resolve, address). Form refusals, caps
(limits), TLS and HTTP framing refusals, audit-log refusals and connect failures do not depend on the
host and address rules; they are counted as not replayed, with their places, like every line that is
not a record of this format.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from policy.decision import RESOLVE, Request, Resolution, Verdict, decide, precheck
from policy.hosts import HostFormError, Target, parse_authority
from policy.model import Policy

from .audit_reader import LogItem, Record, Unreadable, shown

POLICY_STAGES = frozenset({"scheme", "port", "host", "resolve", "address"})
NOT_POLICY_STAGES = frozenset({"form", "limits", "tls", "http", "audit", "connect"})
LET_THROUGH = frozenset({"allow", "report"})  # report mode lets a would-be refusal through
FAIL_ON = ("refuse", "allow", "any")
PLACES_KEPT = 1000  # per reason: a log full of cap refusals must not fill memory with line numbers


class NotReplayable(ValueError):
    """Why one decision record cannot be re-decided."""


@dataclass(frozen=True)
class Outcome:
    """A decision in the record's vocabulary: verdict allow / refuse / report."""

    verdict: str
    stage: str
    rule: str
    rule_id: str
    reason: str
    unresolved: bool = False  # allowed by host rules, but the name was not resolved at the time

    @classmethod
    def of(cls, verdict: Verdict, unresolved: bool = False) -> Outcome:
        word = "report" if verdict.report_only else ("allow" if verdict.allowed else "refuse")
        rule_id = getattr(verdict, "rule_id", "") or verdict.rule  # the rule's stable id where the core has one
        return cls(word, verdict.stage, verdict.rule, rule_id, verdict.reason, unresolved)


def why_not_replayable(record: Record) -> str | None:
    """None for a policy decision this module can re-decide, else the reason it is skipped."""
    if record.stage in NOT_POLICY_STAGES:
        return f"not a policy decision (stage {record.stage})"
    if record.stage not in POLICY_STAGES:
        return f"unknown stage {record.stage[:40]!r}"
    if record.host is None or record.port is None or record.scheme is None:
        return "no target (host, port and scheme are not all in the record)"
    if record.method is None:
        return "no method in the record"
    return None


def request_of(record: Record, at: datetime | None = None) -> Request:
    """The request as the proxy saw it. ``at`` (rule expiry) defaults to the record's own time."""
    reason = why_not_replayable(record)
    if reason is not None:
        raise NotReplayable(reason)
    assert record.host is not None and record.port is not None and record.scheme is not None
    assert record.method is not None
    target = _target(record.scheme, record.host, record.port, record.path)
    tunnel = record.method.upper() == "CONNECT"
    return Request(target=target, method=record.method, client=record.client, tunnel=tunnel,
                   websocket=not tunnel and target.scheme in ("ws", "wss"), at=at or record.time)


def _target(scheme: str, host: str, port: int, path: str | None) -> Target:
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        target = parse_authority(authority, scheme)
    except HostFormError as err:
        raise NotReplayable(f"the record's target does not parse: {err.reason}") from None
    if target.host != host:
        # The gate logs the normalised host; anything else was not written by it.
        raise NotReplayable(f"the record's host {host[:80]!r} is not in normalised form ({target.host[:80]!r})")
    return replace(target, path=path or "")


def redecide(policy: Policy, record: Record, at: datetime | None = None) -> Outcome:
    request = request_of(record, at)
    if request.target.ip is not None:
        return Outcome.of(decide(policy, request))
    if record.addresses or record.cnames:  # the name was resolved at the time: judge those answers
        resolution = Resolution(request.target.host, record.addresses, record.cnames)
        return Outcome.of(decide(policy, request, resolution))
    verdict = precheck(policy, request)
    if not verdict.allowed:
        return Outcome.of(verdict)
    if record.stage == RESOLVE and record.rule.startswith("dns:"):
        # The lookup itself failed (timeout, NXDOMAIN, no records): replay does no DNS, so it fails again.
        return Outcome.of(Verdict(False, RESOLVE, record.rule, f"the lookup failed at the time: {record.reason}",
                                  role=verdict.role))
    # Refused before any lookup (scheme, port, host): the new policy would now resolve the name.
    return Outcome.of(verdict, unresolved=True)


@dataclass(frozen=True)
class Example:
    place: str
    time: str
    client: str | None
    request: str
    old: Outcome
    new: Outcome

    def as_json(self) -> dict[str, Any]:
        return {"line": self.place, "time": self.time, "client": self.client, "request": self.request,
                "old": _outcome_json(self.old), "new": _outcome_json(self.new)}


@dataclass
class Change:
    """Every replayed decision that went from one verdict to another (or, same verdict, other rule)."""

    old: str
    new: str
    count: int = 0
    hosts: Counter[str] = field(default_factory=Counter)
    rules: Counter[tuple[str, str]] = field(default_factory=Counter)
    examples: list[Example] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {"from": self.old, "to": self.new, "count": self.count,
                "hosts": [{"host": host, "count": n} for host, n in self.hosts.most_common()],
                "rules": [{"from": old, "to": new, "count": n} for (old, new), n in self.rules.most_common()],
                "examples": [example.as_json() for example in self.examples]}


@dataclass
class Skipped:
    count: int = 0
    places: list[str] = field(default_factory=list)


@dataclass
class ReplayReport:
    replayed: int = 0
    changes: dict[tuple[str, str], Change] = field(default_factory=dict)
    other_rule: dict[tuple[str, str], Change] = field(default_factory=dict)  # same verdict, another rule
    not_replayed: dict[str, Skipped] = field(default_factory=dict)
    other_events: Counter[str] = field(default_factory=Counter)
    before_since: int = 0
    first: str | None = None
    last: str | None = None
    examples: int = 3

    @property
    def changed(self) -> int:
        return sum(change.count for change in self.changes.values())

    def skip(self, place: str, reason: str) -> None:
        skipped = self.not_replayed.setdefault(reason, Skipped())
        skipped.count += 1
        if len(skipped.places) < PLACES_KEPT:
            skipped.places.append(place)

    def add(self, record: Record, old: Outcome, new: Outcome) -> None:
        self.replayed += 1
        self.first = self.first or record.time_text
        self.last = record.time_text
        if old.verdict != new.verdict:
            table = self.changes
        elif old.rule_id != new.rule_id:
            table = self.other_rule
        else:
            return
        change = table.setdefault((old.verdict, new.verdict), Change(old.verdict, new.verdict))
        change.count += 1
        change.hosts[record.host or ""] += 1
        change.rules[(old.rule_id, new.rule_id)] += 1
        if len(change.examples) < self.examples:
            change.examples.append(Example(str(record.place), record.time_text, record.client,
                                           describe_request(record), old, new))

    def fails(self, fail_on: str | None) -> bool:
        """``--fail-on``: refuse (something let through would be refused), allow (something refused
        would be let through, report mode included), any (any verdict changes)."""
        if fail_on is None:
            return False
        if fail_on not in FAIL_ON:
            raise ValueError(f"--fail-on {fail_on!r}: expected one of {', '.join(FAIL_ON)}")
        for old, new in self.changes:
            if fail_on == "any" or (fail_on == "refuse" and old in LET_THROUGH and new == "refuse") or (
                    fail_on == "allow" and old == "refuse" and new in LET_THROUGH):
                return True
        return False

    def as_json(self) -> dict[str, Any]:
        return {
            "replayed": self.replayed, "changed": self.changed, "first": self.first, "last": self.last,
            "changes": [change.as_json() for change in _ordered(self.changes)],
            "same_verdict_other_rule": [change.as_json() for change in _ordered(self.other_rule)],
            "not_replayed": [{"reason": reason, "count": s.count, "lines": s.places}
                             for reason, s in sorted(self.not_replayed.items())],
            "other_events": dict(sorted(self.other_events.items())),
            "before_since": self.before_since,
        }


def replay(policy: Policy, items: Iterable[LogItem], since: datetime | None = None, at: datetime | None = None,
           examples: int = 3) -> ReplayReport:
    """Re-decide every decision line in ``items``; ``at`` judges rule expiry at one moment instead of
    each record's own time."""
    report = ReplayReport(examples=examples)
    for item in items:
        if isinstance(item, Unreadable):
            report.skip(str(item.place), f"cannot read: {item.reason}")
            continue
        if since is not None and item.time < since:
            report.before_since += 1
            continue
        if not isinstance(item, Record) or item.event != "decision":
            report.other_events[item.event] += 1
            continue
        old = Outcome(item.verdict, item.stage, item.rule, item.rule_id, item.reason)
        try:
            new = redecide(policy, item, at)
        except NotReplayable as err:
            report.skip(str(item.place), str(err))
            continue
        report.add(item, old, new)
    return report


def describe_request(record: Record) -> str:
    host = f"[{record.host}]" if record.host and ":" in record.host else record.host
    if record.method == "CONNECT":
        return f"CONNECT {host}:{record.port}"
    return f"{record.method} {record.scheme}://{host}:{record.port}{shown(record.path or '', 2000)}"


def _outcome_json(outcome: Outcome) -> dict[str, Any]:
    out = {"verdict": outcome.verdict, "stage": outcome.stage, "rule": outcome.rule, "rule_id": outcome.rule_id,
           "reason": outcome.reason}
    if outcome.unresolved:
        out["unresolved"] = True
    return out


# Refusals first: what an edit would break is what an operator reads first.
_ORDER = [("allow", "refuse"), ("report", "refuse"), ("refuse", "allow"), ("refuse", "report"),
          ("allow", "report"), ("report", "allow")]


def _ordered(table: dict[tuple[str, str], Change]) -> list[Change]:
    return sorted(table.values(), key=lambda c: (_ORDER.index((c.old, c.new)) if (c.old, c.new) in _ORDER
                                                 else len(_ORDER), c.old, c.new))


def render_text(report: ReplayReport, logs: list[str], policy_source: str, limit: int = 5) -> str:
    """What a human reads: each kind of change with its count, hosts, rules and examples."""
    out = [f"replay of {', '.join(logs)} against {policy_source}"]
    span = f" ({report.first} .. {report.last})" if report.first else ""
    out.append(f"{report.replayed} decision(s) replayed{span}, {report.changed} would change verdict")
    if report.replayed == 0:
        out.append("nothing was replayed: no decision line could be re-decided, so no change can be shown")
    for change in _ordered(report.changes):
        out += _render_change(change, limit, f"{change.old} -> {change.new}")
    for change in _ordered(report.other_rule):
        # Same verdict: worth a line (a broader rule now answers), not examples.
        rules = ", ".join(f"{old} -> {new} {n}" for (old, new), n in change.rules.most_common(limit))
        more = len(change.rules) - min(len(change.rules), limit)
        rules += f", ... ({more} more)" if more else ""
        out.append(f"still {change.old}, by another rule: {change.count} ({rules})")
    if report.not_replayed:
        total = sum(s.count for s in report.not_replayed.values())
        out.append(f"not replayed: {total} line(s)")
        for reason, skipped in sorted(report.not_replayed.items()):
            more = "" if skipped.count <= limit else f", ... ({skipped.count - limit} more)"
            out.append(f"  {reason}: {skipped.count} (at {', '.join(skipped.places[:limit])}{more})")
    if report.other_events:
        out.append("other lines (not decisions): " + ", ".join(f"{event} {n}" for event, n in
                                                               sorted(report.other_events.items())))
    if report.before_since:
        out.append(f"before --since: {report.before_since} line(s)")
    return "\n".join(out) + "\n"


def _render_change(change: Change, limit: int, title: str) -> list[str]:
    out = [f"{title}: {change.count}"]
    hosts = change.hosts.most_common(limit)
    more = len(change.hosts) - len(hosts)
    out.append("  by host: " + ", ".join(f"{host} {n}" for host, n in hosts) + (f", ... ({more} more)" if more else ""))
    out.append("  by rule:")
    for (old, new), n in change.rules.most_common(limit):
        out.append(f"    {old} -> {new}: {n}")
    for example in change.examples:
        out.append(f"  e.g. {example.place} {example.time} {example.client or '-'} {example.request}")
        out.append(f"       was {example.old.verdict} ({example.old.rule_id}): {example.old.reason}")
        note = " [the name was not resolved at the time: its addresses are checked when it is asked for]" if (
            example.new.unresolved) else ""
        out.append(f"       now {example.new.verdict} ({example.new.rule_id}): {example.new.reason}{note}")
    return out
