#!/usr/bin/env python3
"""Decision time per request for host allowlists of 10, 1,000, 100,000 and 1,000,000 entries.

    python tests/benchmarks/bench_decision.py            # all sizes
    python tests/benchmarks/bench_decision.py --sizes 10 1000 --rounds 3

Not a test (pytest collects test_*.py only). Pure CPU: no DNS, no sockets. Each list is written as YAML
and loaded with ``policy.loader.parse_policy`` (the load time is printed too). For 1,000,000 entries the
YAML load is attempted with a time budget (--yaml-budget, default 120 s); when it runs out the list is
built directly with ``HostTable.build`` and the output says so.

``precheck`` is timed for hosts of 2 to 6 labels, hits (a rule allows them) and misses (default deny,
so the near-miss scan runs too). The host index looks a host up by each of its suffixes, so the figures
should grow with the number of labels and stay flat as the list grows.
"""

from __future__ import annotations

import argparse
import gc
import random
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from policy.decision import Request, precheck  # noqa: E402
from policy.hosts import Target  # noqa: E402
from policy.loader import parse_policy  # noqa: E402
from policy.model import ALLOW, HostRule, HostTable, Origin, Policy  # noqa: E402
from policy.patterns import HostPattern  # noqa: E402

SIZES = (10, 1_000, 100_000, 1_000_000)
LABELS = (2, 3, 4, 5, 6)
KINDS = ("", "*.", ".")  # exact, subdomains only, apex and subdomains
HEADER = "version: 1\nmode: enforce\ndefault: deny\nhosts:\n  allow:\n"


class OutOfTime(Exception):
    pass


def entry(i: int) -> tuple[str, str]:
    """The i-th allowlist entry: (kind prefix, name). Names have 2 to 5 labels, so hits span 2 to 6."""
    labels = 2 + i % 4
    suffix = ("com", "example.com", f"a{i % 97}.example.com", f"b{i % 13}.a{i % 97}.example.net")[labels - 2]
    return KINDS[(i // 4) % 3], f"n{i}.{suffix}"


def policy_yaml(size: int) -> str:
    return HEADER + "".join(f"    - '{kind}{name}'\n" for kind, name in map(entry, range(size)))


def load_yaml(size: int, budget: float | None) -> tuple[Policy, float]:
    text = policy_yaml(size)
    if budget is not None:
        def expire(signum, frame):
            raise OutOfTime
        signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, budget)
    started = time.perf_counter()
    try:
        policy = parse_policy(text, f"bench-{size}.yaml")
    finally:
        if budget is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
    return policy, time.perf_counter() - started


def build_direct(size: int) -> tuple[Policy, float]:
    """The model without YAML: the same rules, HostPattern.parse for each, then HostTable.build."""
    base = parse_policy(HEADER + "    - placeholder.example\n", f"bench-{size}.yaml")
    started = time.perf_counter()
    rules = [HostRule(ALLOW, HostPattern.parse(kind + name), Origin(f"bench-{size}.yaml", 6 + i, 7))
             for i, (kind, name) in enumerate(map(entry, range(size)))]
    policy = replace(base, allow=HostTable.build(rules))
    return policy, time.perf_counter() - started


def hosts_for(size: int, labels: int, hit: bool, count: int, rng: random.Random) -> list[str]:
    """Hosts of exactly `labels` labels that the list allows (hit) or does not name (miss)."""
    out: list[str] = []
    if not hit:
        tail = ["org", "example.org", "c1.example.org", "d2.c1.example.org", "e3.d2.c1.example.org"][labels - 2]
        return [f"q{rng.randrange(10**9)}.{tail}" for _ in range(count)]
    attempts = 0
    while len(out) < count:
        attempts += 1
        if attempts > count * 200:
            break  # a list this small has no entry that yields this many labels
        i = rng.randrange(size)
        kind, name = entry(i)
        have = name.count(".") + 1
        if kind in ("", ".") and have == labels:  # exact, or the apex of a '.' entry
            out.append(name)
        elif kind in ("*.", ".") and have + 1 == labels:  # one label below a '*.' or '.' entry
            out.append(f"x{rng.randrange(1000)}.{name}")
    return out


def time_precheck(policy: Policy, hosts: list[str], allowed: bool, rounds: int) -> float | None:
    """Best-of-rounds mean µs per precheck; also checks every verdict is the expected one."""
    if not hosts:
        return None
    requests = [Request(Target("https", host, 443, "/"), method="CONNECT", tunnel=True) for host in hosts]
    for request in requests:
        verdict = precheck(policy, request)
        assert verdict.allowed is allowed, (request.target.host, verdict.reason)
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter_ns()
        for request in requests:
            precheck(policy, request)
        best = min(best, (time.perf_counter_ns() - started) / len(requests))
    return best / 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--hosts", type=int, default=1000, help="hosts per cell (default 1000)")
    parser.add_argument("--rounds", type=int, default=15,
                        help="timed passes per cell; the best is kept (other load on the machine only adds time)")
    parser.add_argument("--yaml-budget", type=float, default=120.0,
                        help="seconds allowed for the YAML load of 1,000,000 entries before building directly")
    args = parser.parse_args()

    rng = random.Random(20240601)
    notes: list[str] = []
    rows: list[tuple[int, str, str, dict[tuple[int, bool], float | None]]] = []
    for size in args.sizes:
        gc.unfreeze()
        gc.collect()
        how = "YAML"
        try:
            policy, load = load_yaml(size, args.yaml_budget if size >= 1_000_000 else None)
            load_text = f"{load:8.2f} s"
        except OutOfTime:
            notes.append(f"{size:,} entries: the YAML load ran out of its {args.yaml_budget:g} s budget and was "
                         "abandoned; the list was built directly with HostTable.build (no YAML)")
            policy, load = build_direct(size)
            how, load_text = "direct", f"{load:8.2f} s"
        assert len(policy.allow) == size
        gc.collect()
        gc.freeze()  # the policy is long-lived: keep the collector from rescanning a million rules
        cells = {}
        for labels in LABELS:
            for hit in (True, False):
                hosts = hosts_for(size, labels, hit, args.hosts, rng)
                cells[(labels, hit)] = time_precheck(policy, hosts, hit, args.rounds)
        rows.append((size, how, load_text, cells))
        print(f"  measured {size:>9,} entries (load via {how}: {load_text.strip()})", file=sys.stderr, flush=True)

    print()
    print("egresswall precheck(): mean µs per decision (best of "
          f"{args.rounds} passes over {args.hosts} hosts; CONNECT, default deny)")
    print(f"Python {sys.version.split()[0]}")
    print()
    head = f"{'entries':>9} | {'built':>6} | {'load':>10} |" + "".join(f" {n} lbl hit/miss |" for n in LABELS)
    print(head)
    print("-" * len(head))
    for size, how, load_text, cells in rows:
        line = f"{size:>9,} | {how:>6} | {load_text:>10} |"
        for labels in LABELS:
            hit, miss = cells[(labels, True)], cells[(labels, False)]
            hit_text = f"{hit:5.2f}" if hit is not None else "   - "
            line += f" {hit_text} / {miss:5.2f}  |"
        print(line)
    print()
    print("hit: an allow rule matches (exact, *. or . entry); miss: no rule names the host, default deny.")
    print("'-': the list has no entry giving a host of that many labels.")
    for note in notes:
        print("note:", note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
