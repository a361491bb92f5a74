#!/usr/bin/env python3
"""What an idle ``egresswall run`` holds: RSS, PSS and private memory per process, with the default policy.

    python tests/benchmarks/bench_memory.py                      # one process, then --workers 2
    python tests/benchmarks/bench_memory.py --baseline main      # the same for another commit, side by side

Not a test (pytest collects test_*.py only). Each configuration starts ``python -m proxy.cli run`` on
free 127.0.0.1 ports (proxy and admin), waits for ``/readyz``, lets it settle, then reads
``/proc/PID/status`` and ``/proc/PID/smaps_rollup`` of the supervisor and of each worker. Nothing is
sent anywhere but loopback, and nothing but the readiness check is sent at all: this is the idle figure.

RSS counts shared library pages in every process that maps them; PSS shares them out; "private" (USS)
is what the process alone holds, which is what a second worker adds. The modules line counts what the
process imported (read from a worker of the same tree, ``python -X importtime``), and the mitmproxy
addons line what its Master loaded.

``--baseline REF`` exports REF (``git archive``) to a temporary directory and runs the same measurement
with that tree first on ``PYTHONPATH`` (same Python, same packages installed).
"""

from __future__ import annotations

import argparse
import io
import os
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def memory_of(pid: int) -> dict[str, float]:
    """MiB: rss (VmRSS), pss and private (Private_Clean + Private_Dirty) from smaps_rollup."""
    out: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            out["rss"] = int(line.split()[1]) / 1024
    private = 0
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key == "Pss":
            out["pss"] = int(rest.split()[0]) / 1024
        elif key in ("Private_Clean", "Private_Dirty"):
            private += int(rest.split()[0])
    out["private"] = private / 1024
    return out


def children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(p) for p in text.split()]


def tree_env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    # The tree's own packages first (squid_compat lives in squid-compat/); a baseline export has no install.
    env["PYTHONPATH"] = os.pathsep.join([str(tree), str(tree / "squid-compat")])
    return env


def measure_run(tree: Path, workers: int, settle: float) -> dict[str, object]:
    listen, admin = free_port(), free_port()
    command = [sys.executable, "-m", "proxy.cli", "run", "--listen", f"127.0.0.1:{listen}",
               "--admin", f"127.0.0.1:{admin}", "--log", os.devnull, "--workers", str(workers)]
    process = subprocess.Popen(command, cwd=tree, env=tree_env(tree), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"egresswall run exited {process.returncode}: {process.stderr.read()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{admin}/readyz", timeout=1) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("egresswall run was not ready within 60 s")
            time.sleep(0.2)
        time.sleep(settle)
        supervisor = memory_of(process.pid)
        worker_pids = children(process.pid) if workers > 1 else []
        return {"supervisor": supervisor, "workers": [memory_of(pid) for pid in worker_pids]}
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def imported(tree: Path) -> tuple[int, list[str]]:
    """How many modules a worker process of this tree imports, and the mitmproxy addons its Master loads."""
    probe = ("import sys, proxy.cli.worker, proxy.cli.run\n"
             "import proxy.runner as r\n"
             "names = sorted(n for n in sys.modules if n.startswith('mitmproxy.addons.'))\n"
             "print(len(sys.modules)); print(' '.join(names))\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tree, env=tree_env(tree), capture_output=True, text=True,
                         check=True).stdout.splitlines()
    return int(out[0]), out[1].split()


def measure(tree: Path, rounds: int, settle: float) -> dict[str, object]:
    single = [measure_run(tree, 1, settle)["supervisor"] for _ in range(rounds)]
    pairs = [measure_run(tree, 2, settle) for _ in range(rounds)]
    modules, addons = imported(tree)

    def median(samples: list[dict[str, float]]) -> dict[str, float]:
        return {key: statistics.median(s[key] for s in samples) for key in samples[0]}

    return {
        "single": median(single),
        "supervisor": median([p["supervisor"] for p in pairs]),
        "worker": median([w for p in pairs for w in p["workers"]]),
        "modules": modules,
        "addon_modules": len(addons),
    }


def export(ref: str, into: str) -> Path:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return Path(into)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="starts per configuration; the median is printed")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds idle after ready before reading")
    parser.add_argument("--baseline", metavar="REF", help="also measure this git commit or branch, side by side")
    args = parser.parse_args()

    columns: list[tuple[str, dict[str, object]]] = []
    if args.baseline:
        with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
            columns.append((f"before ({args.baseline})", measure(export(args.baseline, tmp), args.rounds,
                                                                 args.settle)))
    columns.append(("after (this tree)" if args.baseline else "egresswall", measure(ROOT, args.rounds, args.settle)))

    print(f"\nidle egresswall run, default policy, loopback; median of {args.rounds} starts, read {args.settle:g} s "
          f"after /readyz; MiB (Python {sys.version.split()[0]})\n")
    head = f"{'figure':<44}" + "".join(f" | {name:>22}" for name, _ in columns)
    print(head)
    print("-" * len(head))
    rows = [("one process: RSS", "single", "rss"), ("one process: PSS", "single", "pss"),
            ("one process: private", "single", "private"),
            ("--workers 2, supervisor: RSS", "supervisor", "rss"),
            ("--workers 2, supervisor: private", "supervisor", "private"),
            ("--workers 2, per worker: RSS", "worker", "rss"), ("--workers 2, per worker: PSS", "worker", "pss"),
            ("--workers 2, per worker: private", "worker", "private")]
    for label, where, key in rows:
        print(f"{label:<44}" + "".join(f" | {figures[where][key]:22.1f}" for _, figures in columns))  # type: ignore[index]
    print(f"{'modules a worker imports':<44}" + "".join(f" | {figures['modules']:22d}" for _, figures in columns))
    print(f"{'mitmproxy.addons modules imported':<44}"
          + "".join(f" | {figures['addon_modules']:22d}" for _, figures in columns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
