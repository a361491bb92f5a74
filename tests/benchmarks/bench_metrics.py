#!/usr/bin/env python3
"""What counting costs a request: the hand-written counters ``/metrics`` had before against
``proxy/metrics.py`` (prometheus_client), per call and per request.

    python tests/benchmarks/bench_metrics.py              # 200,000 requests, 5 rounds, best round
    python tests/benchmarks/bench_metrics.py --requests 50000 --rounds 3

Not a test (pytest collects test_*.py only). Pure CPU, one thread. "A request" is what the gate counts
for a proxied plain-HTTP request or tunnel: one decision by verdict and rule id, one DNS lookup, the
open-connection gauge set twice (accept and close), the bytes each way. The rule ids cycle over 50
distinct values, as a policy's would. The baseline is the old ``proxy/metrics.py``'s way, a
``collections.Counter`` and plain ints, reproduced here.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from proxy.metrics import Metrics  # noqa: E402

RULE_IDS = [f"hosts.allow:host{i}.example.com" for i in range(50)]


class HandWritten:
    """The counters as they were: a Counter keyed by (verdict, rule) and plain ints."""

    def __init__(self) -> None:
        self.decisions: Counter[tuple[str, str]] = Counter()
        self.dns_lookups = 0
        self.dns_seconds_sum = 0.0
        self.open_connections = 0
        self.bytes_up = 0
        self.bytes_down = 0

    def request(self, rule_id: str) -> None:
        self.open_connections = 1
        self.dns_lookups += 1
        self.dns_seconds_sum += 0.002
        self.decisions[("allow", rule_id)] += 1
        self.bytes_up += 300
        self.bytes_down += 5000
        self.open_connections = 0


class WithPrometheusClient:
    def __init__(self) -> None:
        self.metrics = Metrics()

    def request(self, rule_id: str) -> None:
        m = self.metrics
        m.connections_open(1)
        m.observe_dns(0.002)
        m.decision("allow", rule_id)
        m.relayed(300, 5000)
        m.connections_open(0)


def best_seconds(request: Callable[[str], None], requests: int, rounds: int) -> float:
    ids = (RULE_IDS * (requests // len(RULE_IDS) + 1))[:requests]
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for rule_id in ids:
            request(rule_id)
        best = min(best, time.perf_counter() - started)
    return best


def single_calls(requests: int, rounds: int) -> list[tuple[str, float]]:
    """Microseconds per call of each prometheus_client-backed method, for the breakdown."""
    m = Metrics()
    calls: list[tuple[str, Callable[[str], None]]] = [
        ("decision(verdict, rule_id)", lambda r: m.decision("allow", r)),
        ("observe_dns(seconds)", lambda r: m.observe_dns(0.002)),
        ("relayed(up, down)", lambda r: m.relayed(300, 5000)),
        ("connections_open(n)", lambda r: m.connections_open(1)),
    ]
    return [(name, best_seconds(call, requests, rounds) / requests * 1e6) for name, call in calls]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    hand = best_seconds(HandWritten().request, args.requests, args.rounds) / args.requests * 1e6
    client = best_seconds(WithPrometheusClient().request, args.requests, args.rounds) / args.requests * 1e6
    print(f"counting one request ({args.requests} requests, best of {args.rounds} rounds, Python "
          f"{sys.version.split()[0]}):")
    print(f"  hand-written counters   {hand:6.2f} µs")
    print(f"  prometheus_client       {client:6.2f} µs  (+{client - hand:.2f} µs, {client / hand:.1f}x)")
    print("per call, prometheus_client:")
    for name, micros in single_calls(args.requests, args.rounds):
        print(f"  {name:28s} {micros:6.2f} µs")
    print(f"scrape: render() of the page above takes {render_ms():.2f} ms")


def render_ms() -> float:
    m = Metrics()
    for rule_id in RULE_IDS:
        m.decision("allow", rule_id)
        m.decision("refuse", rule_id)
    started = time.perf_counter()
    for _ in range(100):
        m.render()
    return (time.perf_counter() - started) / 100 * 1000


if __name__ == "__main__":
    main()
