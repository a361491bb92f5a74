#!/usr/bin/env python3
"""The full load soak behind ``make soak``: 1,000 concurrent clients for a minute against the real
proxy, on loopback only, then ``kill -9`` in the middle of a second load. Prints its figures.

    make soak                                  # 1,000 clients, 60 s
    python tests/benchmarks/soak.py --clients 200 --seconds 10     # a quick look

Clients mix allowed and refused plain-HTTP requests and CONNECT tunnels (tests/loadgen.py). The
policy sets a total and a per-client cap below what the clients open, so both caps are exercised.
Checked (exit 1 when any fails): every answer is the policy's or a cap's; the upstream never held
more requests at once than the caps allow; the internal stand-ins saw no connection and the proxy
connected nowhere but the public upstream; the audit log has exactly one well-formed decision line
per request; file descriptors return to their idle count after each half of the load, and RSS, which CPython keeps
at its high-water mark, does not rise in the second half (nothing accumulates); after
``kill -9`` every line in the log is whole JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent.parent))

from audit_watch import open_fds, rss_kib  # noqa: E402
from loadgen import GREEDY, LoadLab, audit_matches, most_held_at_once, read_audit, run_load, wrong_answers  # noqa: E402
from proxyproc import ProxyProcess  # noqa: E402


def settle(proxy: ProxyProcess, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, body = proxy.admin("/metrics")
        if "\negresswall_open_connections 0" in body and "\negresswall_open_tunnels 0" in body:
            time.sleep(1)
            return
        time.sleep(0.2)
    raise SystemExit("connections did not close after the load")


def sample(pid: int, stop: threading.Event, peaks: dict[str, int]) -> None:
    while not stop.wait(0.5):
        try:
            peaks["fds"] = max(peaks.get("fds", 0), open_fds(pid))
            peaks["rss"] = max(peaks.get("rss", 0), rss_kib(pid))
        except (OSError, RuntimeError):
            return


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--total-cap", type=int, default=900, help="limits.max_connections (default 900)")
    parser.add_argument("--client-cap", type=int, default=64, help="limits.max_connections_per_client (64)")
    parser.add_argument("--greedy", type=int, default=128, help="clients sharing one address (default 128)")
    parser.add_argument("--kill-after", type=float, default=10, help="seconds into the second load to kill -9")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        if not ok:
            failures.append(what)

    folder = Path(tempfile.mkdtemp(prefix="ew-soak-"))
    lab = LoadLab(folder)
    limits = (f"limits:\n  max_connections: {args.total_cap}\n  max_connections_per_client: {args.client_cap}\n"
              "  idle_timeout: 30\n")
    policy = folder / "policy.yaml"
    policy.write_text(lab.policy_text(limits))
    rows: list[tuple[str, str]] = []
    try:
        # ---- 1. the soak ----------------------------------------------------------------------------
        proxy = ProxyProcess(["--policy", str(policy)], folder / "audit.jsonl")
        pid = proxy.process.pid
        for i in range(5):
            proxy.get(f"http://public.lab.example:{lab.http.port}/warm{i}")
        settle(proxy)
        fds_idle, rss_idle = open_fds(pid), rss_kib(pid)
        peaks: dict[str, int] = {}
        stop = threading.Event()
        sampler = threading.Thread(target=sample, args=(pid, stop, peaks), daemon=True)
        sampler.start()
        print(f"soak: {args.clients} clients for {args.seconds:g}s (caps: {args.total_cap} total, "
              f"{args.client_cap} per client; {args.greedy} clients on {GREEDY})", flush=True)
        # Two halves, each as heavy: file descriptors must be back at idle after each; RSS stays at its
        # high-water mark (CPython keeps freed memory), so the second half must not raise it further.
        halves = []
        for seed in (1, 2):
            half = asyncio.run(run_load((proxy.host, proxy.port), lab, args.clients, args.seconds / 2,
                                        greedy=args.greedy, seed=seed))
            settle(proxy)
            halves.append((half, open_fds(pid), rss_kib(pid)))
        stop.set()
        result = halves[0][0]
        result.sent += halves[1][0].sent
        result.seconds += halves[1][0].seconds
        fds_after = max(h[1] for h in halves)
        rss_first, rss_after = halves[0][2], halves[1][2]
        records, lines = read_audit(proxy.log_path)
        try:
            figures = audit_matches(records, result)
        except AssertionError as err:
            failures.append(f"audit log: {err}")
            figures = {"decision_lines": sum(1 for r in records if r["event"] == "decision"), "lines_lost": -1}
        proxy.stop()
        outbound = proxy.outbound()
        statuses = result.statuses()
        wrong = wrong_answers(result)
        unanswered = statuses.get(None, 0)
        check(not wrong, f"{len(wrong)} answers that are neither the policy's nor a cap's, e.g. {wrong[:3]}")
        check(unanswered <= len(result.sent) // 100, f"{unanswered} requests without an answer")
        check(statuses[429] > 0 and statuses[503] > 0, "the caps were not reached: no 429 or no 503")
        held_total = most_held_at_once([lab.http, lab.tls])
        held_greedy = most_held_at_once([lab.http, lab.tls], GREEDY)
        check(held_total <= args.total_cap, f"the upstreams held {held_total} requests at once")
        check(held_greedy <= args.client_cap, f"the upstreams held {held_greedy} of {GREEDY}'s requests at once")
        check(lab.internal_connections() == 0, f"{lab.internal_connections()} connections reached an internal stand-in")
        wrong_connects = [e for e in outbound if e["host"] != "127.0.0.2"]
        check(not wrong_connects, f"the proxy connected to {wrong_connects[:3]}")
        check(fds_after <= fds_idle + 2, f"file descriptors {fds_idle} idle, {fds_after} after")
        check(rss_first <= rss_idle + 256 * 1024, f"RSS {rss_idle} KiB idle, {rss_first} KiB after the first half")
        check(rss_after <= rss_first + 32 * 1024, f"RSS grew from {rss_first} to {rss_after} KiB in the second half")
        by_kind = result.by_kind()
        rows += [
            ("clients / seconds", f"{args.clients} / {result.seconds:.1f}"),
            ("requests under load", f"{len(result.sent)} ({len(result.sent) / result.seconds:.0f}/s)"),
            ("answers", ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items(), key=lambda kv: str(kv[0])))),
            *((f"  {kind}", ", ".join(f"{k}: {v}" for k, v in sorted(c.items(), key=lambda kv: str(kv[0]))))
              for kind, c in sorted(by_kind.items())),
            ("audit lines written", f"{lines} ({figures['decision_lines']} decisions)"),
            ("lines lost", str(figures["lines_lost"])),
            ("connections that reached a refused target", str(lab.internal_connections() + len(wrong_connects))),
            ("upstream requests held at once", f"{held_total} (cap {args.total_cap}); {GREEDY}: {held_greedy} "
                                               f"(cap {args.client_cap})"),
            ("file descriptors idle / peak / after", f"{fds_idle} / {peaks.get('fds', 0)} / "
                                                     f"{' and '.join(str(h[1]) for h in halves)}"),
            ("RSS MiB idle / peak / after each half", f"{rss_idle / 1024:.0f} / {peaks.get('rss', 0) / 1024:.0f} / "
                                                      f"{rss_first / 1024:.0f}, {rss_after / 1024:.0f}"),
        ]

        # ---- 2. kill -9 mid-load -------------------------------------------------------------------------
        proxy = ProxyProcess(["--policy", str(policy)], folder / "audit-killed.jsonl")
        stop = threading.Event()
        outcome: dict = {}
        loader = threading.Thread(target=lambda: outcome.update(r=asyncio.run(run_load(
            (proxy.host, proxy.port), lab, args.clients, args.kill_after + 60, greedy=args.greedy, timeout=5,
            stop=stop))))
        loader.start()
        time.sleep(args.kill_after)
        proxy.process.send_signal(signal.SIGKILL)
        proxy.process.wait(10)
        time.sleep(1)
        stop.set()
        loader.join(60)
        proxy.stop()
        try:
            _, killed_lines = read_audit(proxy.log_path)
            rows.append(("kill -9 after", f"{args.kill_after:g}s: {killed_lines} lines, every one whole JSON"))
        except ValueError as err:
            failures.append(f"after kill -9: {err}")
            rows.append(("kill -9", f"BROKEN LINE: {err}"))
    finally:
        lab.close()

    width = max(len(k) for k, _ in rows)
    print()
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print()
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
