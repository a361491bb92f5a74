#!/usr/bin/env python3
"""Where a TLS tunnel's set-up CPU goes: squid, the floor under egresswall's front, and egresswall, in one run.

    make bench-tunnel-cpu        # or: python tests/benchmarks/bench_tunnel_cpu.py [--tunnels N] [--rounds R]

``make bench`` reports tunnel set-ups per second; on a machine whose two cores also run the bench's
client and nginx, that rate follows the CPU each proxy spends per tunnel. This measures that CPU
directly, from ``/proc/PID/stat`` (user and kernel time of the proxy process over N tunnels, each a TLS
handshake and one small GET through a CONNECT, 8 at a time — ``bench_proxy.py``'s workload), so it is
much less sensitive to what else runs than a rate is. Three targets, rounds alternating:

* squid (Debian's, the forward-only config ``make bench`` uses);
* floor: ``floor_relay.py``, egresswall's front I/O skeleton with the same code and event loop but no
  checks at all — what Python and uvloop cost before any decision is made;
* egresswall with default settings and one worker (every tunnel's CPU in one process).

Then, in this process, the gate's own steps for the same tunnel, timed one by one (µs each): the head
parse, the decision with its audit line, the ClientHello judgment and the closing line. Roughly,
egresswall ≈ floor + those steps. Everything listens on 127.0.0.x; nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(ROOT))

from bench_proxy import NAME, UPSTREAM_IP, Stack, _client_tls, _one_tunnel_request, squid_version  # noqa: E402
from benchstack import free_port, raise_fd_limit, wait_port  # noqa: E402
from tls_build import real_client_hello  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, kernel) seconds a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def tunnels(stack: Stack, proxy: tuple[str, int], count: int, concurrent: int = 8) -> float:
    """Run ``count`` tunnels through ``proxy``; the seconds it took."""
    async def run() -> None:
        context, gate = _client_tls(), asyncio.Semaphore(concurrent)

        async def one() -> None:
            async with gate:
                await _one_tunnel_request(stack, proxy, context)

        await asyncio.gather(*(one() for _ in range(count)))

    started = time.monotonic()
    asyncio.run(run())
    return time.monotonic() - started


def gate_steps(stack: Stack, policy_path: Path, repeat: int) -> dict[str, float]:
    """µs per step of the gate's work for one allowed tunnel, in process, with the bench's own policy."""
    from proxy import front
    from proxy.audit import AuditLog
    from proxy.gate import Gate
    from proxy.metrics import Metrics
    from proxy.reload import PolicyHolder

    with tempfile.TemporaryDirectory() as tmp:
        gate = Gate(PolicyHolder(str(policy_path)), AuditLog(str(Path(tmp) / "audit.jsonl")), Metrics())
        authority = f"{NAME}:{stack.tls_port}"
        head = f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode()
        hello = real_client_hello(NAME)
        loop = asyncio.new_event_loop()
        loop.run_until_complete(gate.decide_connect("127.0.0.1", authority))  # the resolver's cache is warm
        timings: dict[str, float] = {}

        def timed(label: str, step) -> list:
            results = []
            started = time.perf_counter()
            for _ in range(repeat):
                results.append(step())
            timings[label] = (time.perf_counter() - started) / repeat * 1e6
            return results

        async def decide():
            return await gate.decide_connect("127.0.0.1", authority)

        timed("head parse (h11)", lambda: front._parse_head(head))
        timed("(an empty loop turn)", lambda: loop.run_until_complete(asyncio.sleep(0)))
        opened = [outcome.tunnel for outcome in timed("decision + its audit line", lambda: loop.run_until_complete(
            decide()))]
        timings["decision + its audit line"] -= timings["(an empty loop turn)"]
        judged = iter(opened)

        def judge_hello():
            tunnel = next(judged)
            return gate.tunnel_start(tunnel, gate.first_message(tunnel), hello)

        timed("ClientHello judged", judge_hello)
        closing = iter(opened)
        timed("closing audit line", lambda: gate.tunnel_closed(next(closing), 1000, 2000, None))
        loop.close()
        return timings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tunnels", type=int, default=1000, help="tunnels per target per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    raise_fd_limit()
    figures: dict[str, list[tuple[float, float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="ew-bench-cpu-") as tmp:
        stack = Stack(Path(tmp), 1)
        floor = None
        try:
            stack.start()
            floor_port = free_port()
            floor = subprocess.Popen([sys.executable, str(HERE / "floor_relay.py"), str(floor_port), UPSTREAM_IP,
                                      str(stack.tls_port)])
            wait_port("127.0.0.1", floor_port, 20)
            targets = {"squid": (stack.squid.pid, stack.proxies()["squid"]),
                       "floor": (floor.pid, ("127.0.0.1", floor_port)),
                       "egresswall": (stack.egresswall.pid, stack.proxies()["egresswall"])}
            names = list(targets)
            for round_no in range(args.rounds):
                order = names[round_no % 3:] + names[:round_no % 3]
                for name in order:
                    pid, proxy = targets[name]
                    before = cpu_seconds(pid)
                    took = tunnels(stack, proxy, args.tunnels)
                    after = cpu_seconds(pid)
                    figures.setdefault(name, []).append(((after[0] - before[0]) / args.tunnels * 1000,
                                                         (after[1] - before[1]) / args.tunnels * 1000,
                                                         args.tunnels / took))
            steps = gate_steps(stack, stack.processes.work / "policy.yaml", 2000)
        finally:
            if floor is not None:
                floor.kill()
                floor.wait()
            stack.stop()
    print("| target | user ms / tunnel | kernel ms / tunnel | tunnels/s (8 at a time) |")
    print("|---|---|---|---|")
    for name in figures:
        user, kernel, rate = (statistics.median(column) for column in zip(*figures[name], strict=True))
        print(f"| {name} | {user:.2f} | {kernel:.2f} | {rate:.0f} |")
    print("\nthe gate's steps for one allowed tunnel, in process (µs):")
    for label, micros in steps.items():
        if not label.startswith("("):
            print(f"  {label:28s} {micros:7.1f}")
    print(f"  {'sum':28s} {sum(v for k, v in steps.items() if not k.startswith('(')):7.1f}")
    print(f"\n{args.rounds} round(s) of {args.tunnels} tunnels, medians; {os.cpu_count()} CPUs; squid "
          f"{squid_version()}; egresswall and the floor on uvloop, one process each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
