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

    python tests/benchmarks/bench_decision.py --baseline main   # the same figures for another commit too

``--baseline REF`` exports REF (``git archive``) to a temporary directory and runs this script against that
tree in a subprocess (same Python, same inputs), then prints both, side by side. The load is timed by the
wall clock and by the CPU time of the process: on a shared machine the second is the steadier figure.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent


def use_tree(tree: Path) -> None:
    """Import policy/ from this tree (this checkout, or a --baseline export)."""
    sys.path.insert(0, str(tree))
    global Request, precheck, Target, parse_policy, ALLOW, HostRule, HostTable, Origin, Policy, HostPattern
    from policy.decision import Request, precheck
    from policy.hosts import Target
    from policy.loader import parse_policy
    from policy.model import ALLOW, HostRule, HostTable, Origin, Policy
    from policy.patterns import HostPattern

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


def load_yaml(size: int, budget: float | None) -> tuple[Any, float, float]:
    text = policy_yaml(size)
    if budget is not None:
        def expire(signum, frame):
            raise OutOfTime
        signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, budget)
    started, cpu = time.perf_counter(), time.process_time()
    try:
        policy = parse_policy(text, f"bench-{size}.yaml")
    finally:
        if budget is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
    return policy, time.perf_counter() - started, time.process_time() - cpu


def build_direct(size: int) -> tuple[Any, float]:
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


def time_precheck(policy: Any, hosts: list[str], allowed: bool, rounds: int) -> float | None:
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


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(20240601)
    rows: list[dict[str, Any]] = []
    for size in args.sizes:
        gc.unfreeze()
        gc.collect()
        row: dict[str, Any] = {"size": size, "how": "YAML", "note": None}
        try:
            policy, row["load_s"], row["load_cpu_s"] = load_yaml(size, args.yaml_budget if size >= 1_000_000 else None)
        except OutOfTime:
            row["note"] = (f"{size:,} entries: the YAML load ran out of its {args.yaml_budget:g} s budget and was "
                           "abandoned; the list was built directly with HostTable.build (no YAML)")
            policy, row["load_s"] = build_direct(size)
            row["how"], row["load_cpu_s"] = "direct", None
        assert len(policy.allow) == size
        gc.collect()
        gc.freeze()  # the policy is long-lived: keep the collector from rescanning a million rules
        cells = {}
        for labels in LABELS:
            for hit in (True, False):
                hosts = hosts_for(size, labels, hit, args.hosts, rng)
                cells[f"{labels}/{'hit' if hit else 'miss'}"] = time_precheck(policy, hosts, hit, args.rounds)
        row["cells"] = cells
        row["mean_us"] = statistics.fmean(v for v in cells.values() if v is not None)
        rows.append(row)
        del policy
        print(f"  measured {size:>9,} entries (load via {row['how']}: {row['load_s']:.2f} s)", file=sys.stderr,
              flush=True)
    return rows


def print_table(rows: list[dict[str, Any]], title: str) -> None:
    print()
    print(f"{title}: precheck() mean µs per decision (best of the passes; CONNECT, default deny)")
    head = (f"{'entries':>9} | {'built':>6} | {'load wall':>9} | {'load CPU':>8} | {'mean':>5} |"
            + "".join(f" {n} lbl hit/miss |" for n in LABELS))
    print(head)
    print("-" * len(head))
    for row in rows:
        cpu = f"{row['load_cpu_s']:6.2f} s" if row["load_cpu_s"] is not None else "       -"
        line = f"{row['size']:>9,} | {row['how']:>6} | {row['load_s']:7.2f} s | {cpu} | {row['mean_us']:5.2f} |"
        for labels in LABELS:
            hit, miss = row["cells"][f"{labels}/hit"], row["cells"][f"{labels}/miss"]
            hit_text = f"{hit:5.2f}" if hit is not None else "   - "
            line += f" {hit_text} / {miss:5.2f}  |"
        print(line)
    for row in rows:
        if row["note"]:
            print("note:", row["note"])


def run_baseline(ref: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """This script, against REF's policy/ exported to a temporary directory, in a fresh process."""
    with tempfile.TemporaryDirectory(prefix="bench-baseline-") as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "policy"], check=True,
                                 capture_output=True).stdout
        with tarfile.open(fileobj=__import__("io").BytesIO(archive)) as tar:
            tar.extractall(tmp, filter="data")
        command = [sys.executable, __file__, "--tree", tmp, "--json", "--hosts", str(args.hosts),
                   "--rounds", str(args.rounds), "--yaml-budget", str(args.yaml_budget),
                   "--sizes", *map(str, args.sizes)]
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--hosts", type=int, default=1000, help="hosts per cell (default 1000)")
    parser.add_argument("--rounds", type=int, default=15,
                        help="timed passes per cell; the best is kept (other load on the machine only adds time)")
    parser.add_argument("--yaml-budget", type=float, default=120.0,
                        help="seconds allowed for the YAML load of 1,000,000 entries before building directly")
    parser.add_argument("--baseline", metavar="REF", help="also measure this git commit or branch, side by side")
    parser.add_argument("--tree", type=Path, default=ROOT, help=argparse.SUPPRESS)  # the baseline's export
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # how a baseline run answers
    args = parser.parse_args()

    before = run_baseline(args.baseline, args) if args.baseline else None
    use_tree(args.tree)
    rows = measure(args)
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"\nPython {sys.version.split()[0]}; {args.hosts} hosts per cell, best of {args.rounds} passes")
    if before is not None:
        print_table(before, f"before ({args.baseline})")
    print_table(rows, "after (this tree)" if before is not None else "egresswall")
    print()
    print("hit: an allow rule matches (exact, *. or . entry); miss: no rule names the host, default deny.")
    print("'-': the list has no entry giving a host of that many labels. mean: over every cell of the row.")
    if before is not None:
        print()
        print(f"{'entries':>9} | {'load wall before/after':>22} | {'load CPU before/after':>21} | "
              f"{'µs/decision before/after':>24}")
        for old, new in zip(before, rows, strict=True):
            cpu_old = f"{old['load_cpu_s']:.2f}" if old["load_cpu_s"] is not None else "-"
            cpu_new = f"{new['load_cpu_s']:.2f}" if new["load_cpu_s"] is not None else "-"
            print(f"{new['size']:>9,} | {old['load_s']:9.2f} / {new['load_s']:8.2f} s | {cpu_old:>9} / {cpu_new:>7} s"
                  f" | {old['mean_us']:11.2f} / {new['mean_us']:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
