#!/usr/bin/env python3
"""Side by side, in one run, on loopback: direct (no proxy) vs squid vs egresswall (and, for plain HTTP, its floor).

    make bench            # full: 3 rounds per figure, medians
    make bench-quick      # one short round each, under two minutes

Workloads (the shape of a contained browser: mostly TLS tunnels; plain HTTP is what operators compare):
  1. plain-HTTP keep-alive small GETs (wrk): requests/s, p50/p99 latency, at 1 and 32 connections;
  2. CONNECT tunnel setup: new TLS tunnels per second, each doing one small request;
  3. CONNECT tunnel throughput: MB/s of a 100 MB download through one tunnel;
  4. memory: RSS idle and with 1,000 open idle tunnels;
  5. the policy: decision time and reload time for host allowlists of 10, 10,000 and 1,000,000 entries.
The plain-HTTP figures also bench "floor": ``floor_http.py``, the fast path's I/O skeleton (same event
loop, head read, h11 framing both ways, upstream reuse) with no gate, on egresswall's worker count; what
it cannot reach, no work on egresswall's checks can. Rounds alternate between the targets so machine
drift hits all alike. Everything listens on 127.0.0.x; nothing leaves the machine. nginx plays the
upstream; a DnsLab answers egresswall's lookups and a hosts file answers squid's, both with the same
address; the floor sends every request to nginx's address without a lookup.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(ROOT))

from benchstack import (  # noqa: E402
    Processes,
    egresswall_policy,
    free_port,
    raise_fd_limit,
    start_egresswall,
    start_nginx,
    start_squid,
    wait_port,
)
from dnslab import DnsLab, Record  # noqa: E402
from labnet import self_signed  # noqa: E402

UPSTREAM_IP = "127.0.0.2"
NAME = "bench.lab.example"
HTTP_ONLY = {"floor"}  # targets benched on the plain-HTTP figures only


def rss_kib(pid: int) -> int:
    """RSS of a process and its children (squid forks helpers), in KiB."""
    total = 0
    pids = [pid] + [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True,
                                                   text=True).stdout.split()]
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


class Stack:
    """nginx upstream, squid, egresswall and a DNS server, started once for the whole run; with ``floor``,
    also ``floor_http.py`` (plain HTTP to nginx, no gate) on egresswall's worker count."""

    def __init__(self, work: Path, ew_workers: int, variants: dict[str, list[str]] | None = None,
                 floor: bool = False) -> None:
        self.work = work
        self.ew_workers = ew_workers
        self.processes = Processes(work)
        self.http_port, self.tls_port = free_port(UPSTREAM_IP), free_port(UPSTREAM_IP)
        self.squid_port, self.ew_port, self.ew_admin = free_port(), free_port(), free_port()
        self.floor_port = free_port() if floor else None
        # More egresswall instances, each with extra command-line options (e.g. --no-fast-http), benched
        # beside the default one in the same run: name -> (port, options).
        self.variants = {name: (free_port(), options) for name, options in (variants or {}).items()}
        self.variant_procs: dict[str, subprocess.Popen] = {}
        self.dns = DnsLab({NAME: [Record("A", UPSTREAM_IP, ttl=300)]})

    def start(self) -> None:
        self.dns.__enter__()
        self._nginx()
        self.squid = start_squid(self.processes, self.squid_port, {NAME: UPSTREAM_IP}, [self.http_port],
                                 [self.tls_port])
        allow = [f".site{i}.example.org" for i in range(1000)] + [NAME]
        policy = egresswall_policy(allow, [f"{UPSTREAM_IP}/32"], [80, self.http_port], [443, self.tls_port],
                                   self.dns.address, deny=["*.ads.example.com"])
        self.egresswall = start_egresswall(self.processes, self.ew_port, self.ew_admin, policy, self.ew_workers)
        for name, (port, options) in self.variants.items():
            self.variant_procs[name] = start_egresswall(self.processes, port, None, policy, self.ew_workers,
                                                        name=name, options=options)
        if self.floor_port is not None:
            self.floor = self.processes.spawn([sys.executable, str(HERE / "floor_http.py"), str(self.floor_port),
                                               UPSTREAM_IP, str(self.http_port), "--workers", str(self.ew_workers)],
                                              "floor")
            wait_port("127.0.0.1", self.floor_port)
            time.sleep(1.0 if self.ew_workers > 1 else 0)  # every worker bound, as for egresswall

    def _nginx(self) -> None:
        (self.work / "www").mkdir()
        (self.work / "www" / "small").write_bytes(b"x" * 100)
        with open(self.work / "www" / "big", "wb") as f:
            f.truncate(100 * 1024 * 1024)
        _, cert = self_signed([NAME], str(self.work))
        self.nginx = start_nginx(self.processes, f"""
  access_log off; sendfile on; keepalive_requests 1000000; keepalive_timeout 120;
  server {{ listen {UPSTREAM_IP}:{self.http_port}; root {self.work}/www; }}
  server {{ listen {UPSTREAM_IP}:{self.tls_port} ssl; root {self.work}/www;
           ssl_certificate {cert}; ssl_certificate_key {self.work}/key.pem; }}
""", [(UPSTREAM_IP, self.http_port), (UPSTREAM_IP, self.tls_port)])

    def stop(self) -> None:
        self.processes.stop()
        self.dns.__exit__()

    def proxies(self) -> dict[str, tuple[str, int] | None]:
        return {"direct": None, "squid": ("127.0.0.1", self.squid_port), "egresswall": ("127.0.0.1", self.ew_port),
                **({"floor": ("127.0.0.1", self.floor_port)} if self.floor_port is not None else {}),
                **{name: ("127.0.0.1", port) for name, (port, _) in self.variants.items()}}

    def pid(self, target: str) -> int:
        return {"squid": self.squid.pid, "egresswall": self.egresswall.pid}[target]


# ---- workloads -----------------------------------------------------------------------------------

WRK_LUA = """
wrk.method = "GET"
wrk.path = "{path}"
wrk.headers["Host"] = "{host}"
"""


def plain_http(stack: Stack, proxy: tuple[str, int] | None, connections: int, seconds: float) -> dict[str, float]:
    host = f"{NAME}:{stack.http_port}"
    if proxy is None:
        url, path = f"http://{UPSTREAM_IP}:{stack.http_port}/small", "/small"
    else:
        url, path = f"http://{proxy[0]}:{proxy[1]}/", f"http://{host}/small"
    script = stack.work / "wrk.lua"
    script.write_text(WRK_LUA.format(path=path, host=host))
    threads = 1 if connections == 1 else 2
    run = subprocess.run(["wrk", "-t", str(threads), "-c", str(connections), "-d", f"{int(seconds)}s", "--latency",
                          "-s", str(script), url], capture_output=True, text=True, timeout=seconds + 60)
    out = run.stdout
    found = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if not found:
        raise RuntimeError(f"wrk failed via {proxy}: {out}{run.stderr}")
    rps = float(found.group(1))
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if errors:
        raise RuntimeError(f"wrk saw {errors.group(1)} error responses via {proxy}:\n{out}")
    return {"rps": rps, "p50_ms": _latency(out, "50%"), "p99_ms": _latency(out, "99%")}


def _latency(out: str, pct: str) -> float:
    value, unit = re.search(rf"{re.escape(pct)}\s+([\d.]+)(us|ms|s)", out).groups()
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]


async def _open_tunnel(stack: Stack, proxy: tuple[str, int] | None):
    if proxy is None:
        return await asyncio.open_connection(UPSTREAM_IP, stack.tls_port)
    reader, writer = await asyncio.open_connection(*proxy)
    writer.write(f"CONNECT {NAME}:{stack.tls_port} HTTP/1.1\r\nHost: {NAME}:{stack.tls_port}\r\n\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    if b" 200 " not in head.split(b"\r\n", 1)[0]:
        raise RuntimeError(f"CONNECT refused: {head[:200]!r}")
    return reader, writer


def _client_tls() -> ssl.SSLContext:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


async def _one_tunnel_request(stack: Stack, proxy, context: ssl.SSLContext) -> None:
    reader, writer = await _open_tunnel(stack, proxy)
    await writer.start_tls(context, server_hostname=NAME)
    writer.write(f"GET /small HTTP/1.1\r\nHost: {NAME}\r\nConnection: close\r\n\r\n".encode())
    await reader.read()
    writer.close()


def tunnel_setups(stack: Stack, proxy, seconds: float, workers: int = 8) -> dict[str, float]:
    async def run() -> int:
        context, done, deadline = _client_tls(), 0, time.monotonic() + seconds

        async def worker() -> None:
            nonlocal done
            while time.monotonic() < deadline:
                await _one_tunnel_request(stack, proxy, context)
                done += 1

        await asyncio.gather(*(worker() for _ in range(workers)))
        return done

    start = time.monotonic()
    count = asyncio.run(run())
    return {"tunnels_per_s": count / (time.monotonic() - start)}


def tunnel_throughput(stack: Stack, proxy) -> dict[str, float]:
    """curl, not Python, reads the 100 MB: Python's TLS would be the bottleneck, not the proxy."""
    url = f"https://{NAME}:{stack.tls_port}/big"
    args = ["curl", "-sk", "-o", "/dev/null", "-w", "%{size_download} %{speed_download}",
            "--resolve", f"{NAME}:{stack.tls_port}:{UPSTREAM_IP}", url]
    if proxy is not None:
        args[1:1] = ["-x", f"http://{proxy[0]}:{proxy[1]}"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120).stdout.split()
    if len(out) != 2 or int(out[0]) < 100 * 1024 * 1024:
        raise RuntimeError(f"short download via {proxy}: {out}")
    return {"MB_per_s": float(out[1]) / 1e6}


def memory(stack: Stack, target: str, tunnels: int) -> dict[str, float]:
    pid = stack.pid(target)
    idle = rss_kib(pid)

    async def hold() -> int:
        opened = await asyncio.gather(*(_open_tunnel(stack, stack.proxies()[target]) for _ in range(tunnels)))
        await asyncio.sleep(1.0)
        loaded = rss_kib(pid)
        for _, writer in opened:
            writer.close()
        return loaded

    loaded = asyncio.run(hold())
    return {"rss_idle_MiB": idle / 1024, "rss_tunnels_MiB": loaded / 1024,
            "KiB_per_tunnel": (loaded - idle) / tunnels}


def policy_figures(sizes: list[int]) -> list[tuple[int, float, float]]:
    """(entries, µs per decision, load seconds), from ``bench_decision.py`` in a fresh process: the state a
    proxy loads its policy in at start-up, not this process's heap after the runs above (which made the
    same load take a third longer), and one way of measuring for both benchmarks."""
    out = subprocess.run([sys.executable, str(HERE / "bench_decision.py"), "--json", "--rounds", "5", "--hosts", "200",
                          "--sizes", *map(str, sizes)], check=True, capture_output=True, text=True, cwd=ROOT).stdout
    return [(row["size"], row["mean_us"], row["load_s"]) for row in json.loads(out)]


# ---- the run -------------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one short round per figure (under two minutes)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="egresswall worker processes (default: one per CPU)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=OPTIONS",
                        help="also bench an egresswall started with these extra options, in the same run, e.g. "
                             "--variant 'ew-mitm-http=--no-fast-http' (plain HTTP and tunnel figures only)")
    args = parser.parse_args()
    variants = {name: options.split() for name, _, options in (v.partition("=") for v in args.variant)}
    for tool in ("nginx", "squid", "wrk", "curl"):
        if not shutil.which(tool):
            print(f"bench: {tool} is not installed (ci/install.sh --bench installs it)", file=sys.stderr)
            return 2
    raise_fd_limit()
    rounds = args.rounds or (1 if args.quick else 3)
    seconds = 2.0 if args.quick else 5.0
    tunnel_count = 300 if args.quick else 1000
    sizes = [10, 10_000] + ([] if args.quick else [1_000_000])
    targets = ["direct", "squid", "floor", "egresswall", *variants]
    results: dict[tuple[str, str], list[float]] = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ew-bench-", delete=not os.environ.get("BENCH_KEEP")) as tmp:
        stack = Stack(Path(tmp), args.workers, variants, floor=True)
        try:
            stack.start()
            for round_no in range(rounds):
                shift = round_no % len(targets)
                order = targets[shift:] + targets[:shift]  # alternate who goes first
                for target in order:
                    proxy = stack.proxies()[target]
                    for conns in (1, 32):
                        for key, value in plain_http(stack, proxy, conns, seconds).items():
                            results.setdefault((f"http c={conns} {key}", target), []).append(value)
                    if target in HTTP_ONLY:
                        continue
                    setups = tunnel_setups(stack, proxy, seconds)["tunnels_per_s"]
                    results.setdefault(("tls tunnel setups/s", target), []).append(setups)
                    throughput = tunnel_throughput(stack, proxy)["MB_per_s"]
                    results.setdefault(("tunnel throughput MB/s", target), []).append(throughput)
            for target in ("squid", "egresswall"):
                for key, value in memory(stack, target, tunnel_count).items():
                    label = key.replace("tunnels", f"{tunnel_count}_tunnels")
                    results.setdefault((label, target), []).append(value)
        finally:
            stack.stop()
    print_table(results, targets)
    print("\npolicy (bench_decision.py, a fresh process, the real loader): entries | µs/decision | load+index s")
    for size, micros, reload_s in policy_figures(sizes):
        print(f"  {size:>9,} | {micros:10.2f} | {reload_s:8.2f}")
    print(f"\n{rounds} round(s), medians; {time.monotonic() - started:.0f}s in all; "
          f"{os.cpu_count()} CPUs; egresswall with {args.workers} worker(s); squid {squid_version()} (1 worker)")
    return 0


def print_table(results: dict[tuple[str, str], list[float]], targets: list[str]) -> None:
    metrics = list(dict.fromkeys(metric for metric, _ in results))
    added = {}  # the latency a proxy adds over direct, per target: the figure the goal is set in
    for target in targets[1:]:
        for conns in (1, 32):
            mine, direct = results.get((f"http c={conns} p50_ms", target)), results.get((f"http c={conns} p50_ms",
                                                                                          "direct"))
            if mine and direct:
                added[(f"http c={conns} added p50_ms", target)] = [statistics.median(mine) - statistics.median(direct)]
    results = {**results, **added}
    metrics += list(dict.fromkeys(metric for metric, _ in added))
    ours = [t for t in targets if t not in ("direct", "squid")]
    print(f"\n{'figure':<30}" + "".join(f"{t:>13}" for t in targets)
          + "".join(f"{t[:9] + '/squid':>16}" for t in ours) + f"{'ew/direct':>11}{'ew/floor':>11}")
    for metric in metrics:
        cells, medians = "", {}
        for target in targets:
            values = results.get((metric, target))
            if values:
                medians[target] = statistics.median(values)
                cells += f"{medians[target]:>13.2f}"
            else:
                cells += f"{'-':>13}"
        print(f"{metric:<30}{cells}" + "".join(f"{_ratio(medians, t, 'squid'):>16}" for t in ours)
              + f"{_ratio(medians, 'egresswall', 'direct'):>11}{_ratio(medians, 'egresswall', 'floor'):>11}")


def _ratio(medians: dict[str, float], a: str, b: str) -> str:
    return f"{medians[a] / medians[b]:.2f}" if a in medians and medians.get(b) else "-"


def squid_version() -> str:
    out = subprocess.run(["squid", "-v"], capture_output=True, text=True).stdout
    match = re.search(r"Version (\S+)", out)
    return match.group(1) if match else "?"


if __name__ == "__main__":
    sys.exit(main())
