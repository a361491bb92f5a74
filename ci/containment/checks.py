"""Judge one run from its evidence, and print the table.

Checks (a run passes when every one passes):

  stand-ins         no internal stand-in (10.x, 172.16.x, 192.168.x, 100.64.x, 169.254.169.254, the ULA,
                    the proxy namespace's own loopback) saw a connection, a datagram or a packet, and
                    the lab's STUN server saw no datagram
  browser-loopback  the listener on the browser namespace's loopback saw nothing
  capture           every packet the browser namespace sent was TCP to the proxy's address and port
  audit             every internal attempt has a refusal in egresswall's audit log with the right
                    reason, and no decision let an internal address through
  allowed           the allowed lab pages were read (the browser reached them, the lab server served them)
  probe             the probe reported an outcome for every route it lists, for every target
  browser           no internal target was reached, as the browser itself saw it
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from containment import topology as T
from containment.capture import Packet
from containment.lab import Evidence

CHECKS = {
    "stand-ins": "internal stand-ins and the STUN server saw nothing",
    "browser-loopback": "the browser namespace's loopback listener saw nothing",
    "capture": "the browser namespace sent packets only to the proxy's address and port",
    "audit": "egresswall refused every internal attempt, for the right reason",
    "allowed": "the allowed lab pages were read",
    "probe": "the probe reported every route it lists",
    "browser": "the browser reached no internal target",
}
OUTCOMES = {"reached", "blocked", "error", "timeout"}
INTERNAL_ADDRESSES = {ipaddress.ip_address(a) for a in T.INTERNAL.values()}
REFUSED_EARLY = {"form", "scheme", "port", "host"}  # refused before any address was looked at


@dataclass
class Check:
    id: str
    passed: bool
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def title(self) -> str:
        return CHECKS[self.id]


@dataclass
class Row:
    route: str
    target: str  # the target's URL
    browser: str
    verdict: str
    reason: str
    standins: str
    capture: str
    ok: bool


@dataclass
class Judgement:
    checks: list[Check]
    rows: list[Row]
    standin_summary: list[tuple[str, str, int, int, int]]  # name, address, tcp, udp, packets
    capture_summary: list[str]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def failed(self) -> list[str]:
        return [c.id for c in self.checks if not c.passed]


# ---- helpers -------------------------------------------------------------------------------------

def _canonical(host: str | None) -> str:
    host = (host or "").strip("[]").lower().rstrip(".")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        return str(ip.ipv4_mapped)
    return str(ip)


def _is_internal(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return ip in INTERNAL_ADDRESSES or ip.is_loopback or str(ip).startswith("64:ff9b:")


def decisions_for(target: T.Target, audit: list[dict]) -> list[dict]:
    """The audit log's decisions about this target's host and port."""
    host = _canonical(target.host)
    parts = urlsplit(target.url)
    scheme, path = parts.scheme, parts.path or "/"
    found = []
    for record in audit:
        if record.get("event") != "decision":
            continue
        rhost = record.get("host")
        if rhost is None and record.get("url"):  # refused for its form: only the raw URL is logged
            try:
                rhost = urlsplit(record["url"] if "://" in record["url"] else "http://" + record["url"]).hostname
            except ValueError:
                rhost = None
        if _canonical(rhost) != host or record.get("port") not in (None, target.port):
            continue
        # Chromium sends http:// through a proxy as GET (the path is logged), ws://, https:// and wss://
        # as CONNECT: match by path where there is one, so a row counts its own decisions.
        connect = record.get("method") == "CONNECT"
        if (scheme == "http") == connect:
            continue
        if scheme == "http" and record.get("path") is not None and record["path"] != path:
            continue
        found.append(record)
    return found


def _redirect_decisions(target: T.Target, audit: list[dict]) -> list[dict]:
    final = target.extra.get("final_host", "")
    return [r for r in audit if r.get("event") == "decision" and _canonical(r.get("host")) == final
            and (r.get("path") or "").startswith("/from-redirect")]


def _right_reason(target: T.Target, record: dict, own_policy: bool) -> tuple[bool, str]:
    if record.get("verdict") != "refuse":
        return False, f"{record.get('verdict')} ({record.get('rule')})"
    stage, reason = record.get("stage"), record.get("reason") or ""
    if target.reason and target.reason.lower() in reason.lower():
        return True, ""
    if own_policy and stage in REFUSED_EARLY:
        return True, f"refused by your policy's {stage} rules before the address check: {record.get('rule')}"
    return False, f"refused, but for another reason ({stage}: {reason[:120]})"


def _attempt_target(attempt: dict, keys_by_url: dict[str, str]) -> T.Target | None:
    name = str(attempt.get("target", ""))
    if name in T.TARGETS_BY_KEY:
        return T.TARGETS_BY_KEY[name]
    key = keys_by_url.get(name) or keys_by_url.get(str(attempt.get("url", "")))
    return T.TARGETS_BY_KEY.get(key) if key else None


def _multi_or_broadcast(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_multicast or address in ("255.255.255.255", T.BROWSER_BROADCAST)


def _packet_is_proxy(p: Packet) -> bool:
    return p.proto == "TCP" and p.dst == T.PROXY_ADDR and p.dport == T.PROXY_PORT


# ---- judging -------------------------------------------------------------------------------------

def judge(report: list[dict] | None, evidence: Evidence, *, targets: list[T.Target], routes: list[str],
          own_policy: bool, probe_page_path: str | None) -> Judgement:
    keys_by_url = {t.url: t.key for t in targets}
    report = report or []
    audit = evidence.audit
    checks: list[Check] = []

    # stand-ins
    standin_events = [e for e in evidence.net_events if e.get("kind") == "standin"] + evidence.proxy_loopback
    stun_events = [e for e in evidence.net_events if e.get("kind") == "stun"]
    c = Check("stand-ins", True)
    for e in standin_events:
        c.problems.append(f"{e['standin']} {e['address']}:{e['port']}/{e['proto']} saw a connection from "
                          f"{e['peer']}: {e.get('data', '')!r}")
    for name, packets in evidence.counters.items():
        if packets:
            c.problems.append(f"{packets} packet(s) arrived for {name} ({T.INTERNAL.get(name, T.PUBLIC_STUN)})")
    for e in stun_events:
        c.problems.append(f"the STUN server {e['address']}:{e['port']} got a datagram from {e['peer']}")
    c.passed = not c.problems
    checks.append(c)

    # browser-loopback
    c = Check("browser-loopback", True)
    for e in evidence.browser_loopback:
        c.problems.append(f"the browser sent {e['proto'].upper()} to its own loopback {e['address']}:{e['port']} "
                          f"directly, past the proxy: {e.get('data', '')!r}")
    # The kernel's count catches what no listener was bound for (another port, UDP): nothing in the
    # browser namespace uses loopback by itself (Playwright drives Chromium over a pipe).
    connects, datagrams = (evidence.browser_counters.get(k, 0) for k in ("lo-tcp-connect", "lo-udp"))
    if connects > len([e for e in evidence.browser_loopback if e.get("proto") == "tcp"]):
        c.problems.append(f"{connects} TCP connection attempt(s) on the browser namespace's loopback")
    if datagrams:
        c.problems.append(f"{datagrams} UDP datagram(s) on the browser namespace's loopback")
    c.passed = not c.problems
    checks.append(c)

    # capture
    c = Check("capture", True)
    ip_packets = [p for p in evidence.packets if p.kind in ("IPv4", "IPv6")]
    to_proxy = [p for p in ip_packets if _packet_is_proxy(p)]
    others = [p for p in ip_packets if not _packet_is_proxy(p)]
    other_frames = [p for p in evidence.packets if p.kind == "other"]
    grouped: dict[str, int] = {}
    for p in others + other_frames:
        grouped[p.describe()] = grouped.get(p.describe(), 0) + 1
    for what, count in grouped.items():
        c.problems.append(f"{count} packet(s) {what}")
    if not to_proxy:
        c.problems.append("the capture saw no packet to the proxy at all: it proves nothing")
    sent = evidence.browser_counters.get("sent")
    unicast = [p for p in ip_packets if p.kind == "IPv4" and not _multi_or_broadcast(p.dst)]
    if sent is not None and len(unicast) < sent:
        c.problems.append(f"the capture is incomplete: the kernel counted {sent} unicast IP packets leaving the "
                          f"browser namespace, the capture holds {len(unicast)}")
    arp = sum(1 for p in evidence.packets if p.kind == "ARP")
    c.notes.append(f"{len(to_proxy)} packet(s) to the proxy {T.PROXY_ADDR}:{T.PROXY_PORT}, {arp} ARP (link layer)")
    c.passed = not c.problems
    checks.append(c)
    capture_summary = [f"to the proxy {T.PROXY_ADDR}:{T.PROXY_PORT}: {len(to_proxy)} packet(s)"]
    capture_summary += [f"NOT to the proxy: {count} x {what}" for what, count in grouped.items()]
    capture_summary.append(f"ARP: {arp} frame(s) (link layer, not counted)")

    attempted = {t.key for a in report if (t := _attempt_target(a, keys_by_url))}

    # audit
    c = Check("audit", True)
    row_verdicts: dict[str, tuple[str, str]] = {}
    for target in targets:
        if target.key not in attempted:
            continue
        if target.expect == "refuse":
            records = _redirect_decisions(target, audit) if target.extra.get("final_host") else \
                decisions_for(target, audit)
            if not records:
                c.problems.append(f"{target.key}: no decision for {target.url} in the audit log (the request "
                                  "never reached the proxy)")
                row_verdicts[target.key] = ("none", "never reached the proxy")
                continue
            bad = [(r, why) for r in records for ok, why in [_right_reason(target, r, own_policy)] if not ok]
            for r, why in bad:
                c.problems.append(f"{target.key}: {r.get('method')} {r.get('host')}:{r.get('port')} {why}")
            for r in records:
                ok, why = _right_reason(target, r, own_policy)
                if ok and why:
                    c.notes.append(f"{target.key}: {why}")
            first = bad[0][0] if bad else records[0]
            verdicts = sorted({r.get("verdict", "?") for r in records})
            row_verdicts[target.key] = ("/".join(verdicts) + f" x{len(records)}",
                                        f"{first.get('rule')}: {first.get('reason')}")
        elif target.expect == "rebind":
            records = decisions_for(target, audit)
            for r in records:
                internal = [a for a in r.get("addresses", []) if _is_internal(a)]
                if internal and r.get("verdict") != "refuse":
                    c.problems.append(f"{target.key}: allowed although it resolved to {internal}")
                if r.get("verdict") != "refuse" and r.get("pinned") and _is_internal(str(r["pinned"])):
                    c.problems.append(f"{target.key}: connected to {r['pinned']}")
            refusals = [r for r in records if r.get("verdict") == "refuse"]
            if len(records) > 1 and not refusals:
                c.problems.append(f"{target.key}: {len(records)} decisions and no refusal, although the name "
                                  "answers the internal address after the first lookup")
            shown = refusals[0] if refusals else (records[0] if records else {})
            row_verdicts[target.key] = (
                "/".join(sorted({r.get("verdict", "?") for r in records})) + f" x{len(records)}" if records
                else "none", f"{shown.get('rule', '')}: {shown.get('reason', '')}" if shown else "")
        elif target.expect == "allow":
            records = decisions_for(target, audit)
            allowed = [r for r in records if r.get("verdict") in ("allow", "report")]
            refused = [r for r in records if r.get("verdict") == "refuse"]
            row_verdicts[target.key] = ("/".join(sorted({r.get("verdict", "?") for r in records}))
                                        + f" x{len(records)}" if records else "none",
                                        f"{(allowed or refused or [{}])[0].get('rule', '')}")
    # Whatever the probe did: no decision may have let an internal address through.
    for r in audit:
        if r.get("event") != "decision" or r.get("verdict") == "refuse":
            continue
        internal = [a for a in r.get("addresses", []) if _is_internal(a)]
        host_internal = _is_internal(_canonical(r.get("host")))
        if internal or host_internal:
            c.problems.append(f"egresswall let {r.get('method')} {r.get('host')}:{r.get('port')} through to an "
                              f"internal address (resolved {r.get('addresses')}; the address rules let it pass; "
                              f"decided by {r.get('rule')})")
    c.passed = not c.problems
    checks.append(c)

    # allowed
    c = Check("allowed", True)
    web = [e for e in evidence.net_events if e.get("kind") == "web"]
    if probe_page_path is not None and not any(e.get("path", "").startswith(probe_page_path) for e in web):
        c.problems.append(f"the probe page {probe_page_path} was never fetched from the lab's public host")
    for target in targets:
        if target.expect != "allow" or target.key not in attempted:
            continue
        outcomes = [a.get("outcome") for a in report if _attempt_target(a, keys_by_url) == target]
        records = decisions_for(target, audit)
        refused_early = [r for r in records if r.get("verdict") == "refuse" and r.get("stage") in REFUSED_EARLY]
        if own_policy and refused_early and not any(r.get("verdict") == "allow" for r in records):
            c.notes.append(f"{target.key}: your policy refuses {target.url} ({refused_early[0].get('rule')}); "
                           "not counted")
            continue
        path = urlsplit(target.url).path or "/"
        served = [e for e in web if (e.get("host") or "").split(":")[0] == target.host
                  and (e.get("path") or "").split("?")[0] == path]
        if "reached" not in outcomes:
            c.problems.append(f"{target.key}: the browser did not read {target.url} (outcomes: {outcomes})")
        if not served:
            c.problems.append(f"{target.key}: the lab's public host never served {target.url}")
    c.passed = not c.problems
    checks.append(c)

    # probe
    c = Check("probe", True)
    if not report:
        c.problems.append("the probe reported nothing")
    for a in report:
        if a.get("outcome") not in OUTCOMES:
            c.problems.append(f"{a.get('route')} -> {a.get('target')}: outcome {a.get('outcome')!r}")
        elif "did not report" in str(a.get("error") or ""):
            c.problems.append(f"{a.get('route')} -> {a.get('target')}: {a.get('error')}")
        if _attempt_target(a, keys_by_url) is None:
            c.problems.append(f"{a.get('route')} -> {a.get('target')}: not one of the lab's targets")
    reported_routes = {a.get("route") for a in report}
    for route in routes:
        if route not in reported_routes:
            c.problems.append(f"route {route}: listed by the probe, no outcome reported")
    for target in targets:
        if target.key not in attempted:
            c.problems.append(f"target {target.key} ({target.url}): no attempt reported")
    c.passed = not c.problems
    checks.append(c)

    # browser
    c = Check("browser", True)
    for a in report:
        target = _attempt_target(a, keys_by_url)
        if target and target.expect in ("refuse", "no-traffic") and a.get("outcome") == "reached":
            c.problems.append(f"{a.get('route')} reached {target.url}: {a.get('error') or ''}".strip())
    c.passed = not c.problems
    checks.append(c)

    # rows
    failing_keys = _failing_keys(checks)
    rows = []
    for a in report:
        target = _attempt_target(a, keys_by_url)
        key = target.key if target else str(a.get("target"))
        verdict, reason = row_verdicts.get(key, ("-", ""))
        if target and target.expect == "no-traffic":
            verdict, reason = "n/a", "UDP: no proxy carries it"
        rows.append(Row(
            route=str(a.get("route")), target=target.url if target else key,
            browser=str(a.get("outcome")), verdict=verdict, reason=reason,
            standins=_standins_for(target, standin_events, evidence, stun_events) if target else "?",
            capture=_capture_for(target, others) if target else "?",
            ok=not (target is None or key in failing_keys or (target.expect in ("refuse", "no-traffic")
                                                              and a.get("outcome") == "reached")),
        ))
    standin_summary = []
    for name, address in [*T.INTERNAL.items(), ("proxy-loopback", "127.0.0.1 ::1"),
                          ("browser-loopback", "127.0.0.1 ::1")]:
        events = evidence.browser_loopback if name == "browser-loopback" else standin_events
        mine = [e for e in events if e.get("standin") == name]
        standin_summary.append((name, address, sum(1 for e in mine if e["proto"] == "tcp"),
                                sum(1 for e in mine if e["proto"] == "udp"), evidence.counters.get(name, 0)))
    standin_summary.append(("stun (public)", T.PUBLIC_STUN, 0, len(stun_events), evidence.counters.get("stun", 0)))
    return Judgement(checks, rows, standin_summary, capture_summary)


def _failing_keys(checks: list[Check]) -> set[str]:
    keys = set()
    for c in checks:
        for problem in c.problems:
            head = problem.split(":", 1)[0]
            if head in T.TARGETS_BY_KEY:
                keys.add(head)
    return keys


def _standins_for(target: T.Target, standin_events: list[dict], evidence: Evidence, stun: list[dict]) -> str:
    if target.expect == "allow":
        return "-"
    addresses = set(target.addresses)
    hits = [e for e in standin_events + evidence.browser_loopback if e.get("address") in addresses]
    if target.url.startswith("stun:"):
        hits += [e for e in stun if e.get("address") in addresses]
    if not hits:
        return "nothing"
    where = sorted({e.get("standin", "stun") for e in hits})
    return f"{len(hits)} HIT ({','.join(where)})"


def _capture_for(target: T.Target, others: list[Packet]) -> str:
    addresses = set(target.addresses)
    hits = [p for p in others if p.dst in addresses and p.dport in (None, target.port)]
    return f"{len(hits)} pkt DIRECT" if hits else "proxy only"


# ---- printing ------------------------------------------------------------------------------------

def _cut(text: str, width: int) -> str:
    text = re.sub(r"\(/\S*/([^/\s]+:\d+)\)", r"(\1)", " ".join(str(text).split()))  # rule file: name only
    return text if len(text) <= width else text[:width - 1] + "~"


def format_table(j: Judgement, only_failing: bool = False) -> str:
    """The run's table: one row per attempt. ``only_failing``: just the rows that failed (negative runs)."""
    columns = [("route", 20), ("target", 46), ("browser", 8), ("proxy", 13), ("proxy rule / reason", 58),
               ("stand-ins", 12), ("capture", 12), ("", 4)]
    lines = ["  ".join(f"{name:<{width}}" for name, width in columns).rstrip(),
             "  ".join("-" * width for _, width in columns)]
    rows = [r for r in j.rows if not r.ok] if only_failing else j.rows
    for r in rows:
        values = [r.route, r.target, r.browser, r.verdict, r.reason, r.standins, r.capture, "ok" if r.ok else "FAIL"]
        lines.append("  ".join(f"{_cut(v, w):<{w}}" for v, (_, w) in zip(values, columns, strict=True)).rstrip())
    if only_failing:
        lines.append(f"({len(j.rows) - len(rows)} rows that held are not shown; --json has every row)")
    lines.append("")
    lines.append("stand-ins                 address              tcp  udp  packets")
    for name, address, tcp, udp, packets in j.standin_summary:
        lines.append(f"  {name:<23} {address:<20} {tcp:>3}  {udp:>3}  {packets:>7}")
    lines.append("capture of the browser namespace's interface:")
    lines += [f"  {line}" for line in j.capture_summary]
    lines.append("")
    for c in j.checks:
        lines.append(f"{'PASS' if c.passed else 'FAIL'}  {c.id:<17} {c.title}")
        for problem in c.problems[:12]:
            lines.append(f"        - {problem}")
        if len(c.problems) > 12:
            lines.append(f"        ... and {len(c.problems) - 12} more")
        for note in list(dict.fromkeys(c.notes))[:6]:
            lines.append(f"        note: {note}")
    return "\n".join(lines)
