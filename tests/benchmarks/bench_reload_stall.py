#!/usr/bin/env python3
"""How long a reload of a big allowlist stops the event loop: the longest gap between ticks of a 1 ms timer.

    python tests/benchmarks/bench_reload_stall.py                 # 1,000,000 names
    python tests/benchmarks/bench_reload_stall.py --sizes 100000 1000000

Not a test (pytest collects test_*.py only). For each size a policy file of that many names (the same
generated entries as ``bench_decision.py``) is loaded by ``proxy.reload.PolicyHolder``, then reloaded the
way SIGHUP reloads it (``request_reload``: a big file in a thread) while the event loop ticks every
millisecond and allocates a little, as traffic would. A reload in a thread still holds Python's global
lock for every stretch of C that does not let go of it — PyYAML composing nodes, freeing millions of
objects at once — and the loop's longest gap is what a request arriving then would wait. No sockets.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent.parent))

from bench_decision import policy_yaml  # noqa: E402

from proxy.reload import PolicyHolder  # noqa: E402


async def reload_while_ticking(holder: PolicyHolder) -> tuple[float, list[float]]:
    """(seconds the reload took, the gaps between ticks while it ran)."""
    gaps: list[float] = []
    started = time.monotonic()
    holder.request_reload()
    last = time.monotonic()
    while holder._reloading is not None and not holder._reloading.done():
        await asyncio.sleep(0.001)
        now = time.monotonic()
        gaps.append(now - last)
        [].extend(range(64))  # a little allocation per tick, as requests make
        last = now
    return time.monotonic() - started, gaps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000])
    args = parser.parse_args()
    print("| names | reload s | longest stall of the loop, s | p99 gap, ms | gaps over 100 ms |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            path = Path(tmp) / f"policy-{size}.yaml"
            path.write_text(policy_yaml(size))
            holder = PolicyHolder(str(path))
            took, gaps = asyncio.run(reload_while_ticking(holder))
            gaps.sort()
            p99 = gaps[int(len(gaps) * 0.99)] if gaps else 0.0
            print(f"| {size:,} | {took:.1f} | {max(gaps, default=0):.2f} | {p99 * 1000:.1f} | "
                  f"{sum(g > 0.1 for g in gaps)} |")
            del holder
    print(f"\nPython {sys.version.split()[0]}; median gap {statistics.median(gaps) * 1000:.2f} ms in the last run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
