#!/usr/bin/env python3
"""Page loads a user of a contained browser feels: no proxy vs squid vs egresswall, side by side in one run.

    make bench-pageload                  # 20 rounds (each round: one load per target, in turn)
    make bench-pageload BENCH_ARGS="--rounds 5"

Chromium (Debian's, launched by egresswall's own launcher with every containment flag) loads an HTTPS
page that pulls 60 subresources — 6 stylesheets, 19 scripts, 32 images, a web font, an XHR and a
WebSocket — from 12 host names, each on its own loopback address, served by nginx with TLS (HTTP/2 on
six hosts, HTTP/1.1 on six; tests/benchmarks/pagelab.py). Three browsers are launched once: one
through squid (Debian's, forward-only, the config ``make bench`` uses), one through egresswall with
default settings, and one with no proxy, whose argv is the launcher's minus ``--proxy-server`` and
``--proxy-bypass-list``, plus ``--host-resolver-rules`` mapping the 12 names to their addresses (the
proxied browsers resolve nothing: the proxy does, squid from a hosts file and egresswall from a DNS
server the run starts). Every load is in a fresh browser context (its own connections, no cache);
rounds alternate who goes first; one warm-up load per target is not counted.

Per load:
  * time to ``load``: the navigation timing entry's ``loadEventStart`` (ms from the navigation's start);
  * settled: when the XHR had answered and the WebSocket had echoed and closed (the page's clock);
  * connections opened: how many connections nginx accepted during the load (its stub_status
    ``accepts``). Each browser connection is one nginx connection on all three paths (a tunnel is
    relayed 1:1), so this is what the browser opened, the ones it never sent a request on included:
    Chromium opens more than it uses when it does not know yet that a host speaks HTTP/2, and
    through a proxy each costs a CONNECT and a decision;
  * connections used: distinct CDP ``Network.responseReceived`` ``connectionId`` values, plus one per
    WebSocket (Chromium gives a WebSocket a connection of its own; CDP reports none for it);
  * proxy CPU time: user + system CPU the proxy process (and its children) used during the load, from
    /proc (10 ms ticks): on a machine with few cores it is what a proxy takes from the browser.
A load in which any subresource failed, or any status was not 200, is reported and fails the run.
Everything listens on 127.0.0.x; nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(ROOT))

from bench_proxy import squid_version  # noqa: E402
from benchstack import (  # noqa: E402
    Processes,
    egresswall_policy,
    free_port,
    raise_fd_limit,
    start_egresswall,
    start_nginx,
    start_squid,
)
from dnslab import DnsLab, Record  # noqa: E402
from labnet import self_signed  # noqa: E402
from pagelab import HOSTS, EchoServer, PageLab  # noqa: E402
from unprivileged import SANDBOX  # noqa: E402

from browser import launch as launcher  # noqa: E402

TARGETS = ("direct", "squid", "egresswall")
# Chromium refuses some ports outright (ERR_UNSAFE_PORT); none is in Linux's ephemeral range, but say so.
CHROMIUM_UNSAFE_PORTS = {6000, 6566, 6665, 6666, 6667, 6668, 6669, 6697, 10080}


def common_free_port(addresses: list[str]) -> int:
    """A port free on every one of ``addresses`` (nginx listens on the same port on all twelve)."""
    for _ in range(50):
        port = free_port(addresses[0])
        if port in CHROMIUM_UNSAFE_PORTS:
            continue
        try:
            for address in addresses[1:]:
                free_port_on(address, port)
        except OSError:
            continue
        return port
    raise RuntimeError(f"no port free on all of {addresses}")


def free_port_on(address: str, port: int) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind((address, port))


class PageLoadStack:
    """The DNS server, the page's nginx and echo server, squid and egresswall, started once per run."""

    def __init__(self, work: Path, ew_workers: int = 1, ew_options: list[str] | None = None) -> None:
        self.work = work
        self.ew_workers = ew_workers
        self.ew_options = ew_options or []  # more `egresswall run` options (e.g. --no-uvloop), to compare
        self.processes = Processes(work)
        self.port = common_free_port([host.address for host in HOSTS])
        self.lab = PageLab(work, self.port, free_port())
        self.echo = EchoServer(self.lab.echo_port)
        self.squid_port, self.ew_port, self.ew_admin = free_port(), free_port(), free_port()
        self.nginx_status = free_port()
        self.dns = DnsLab({host.name: [Record("A", host.address, ttl=300)] for host in HOSTS})
        self.cert: Path | None = None

    def start(self) -> None:
        self.dns.__enter__()
        _, self.cert = self_signed([host.name for host in HOSTS], str(self.work))
        self.lab.write()
        self.echo.start()
        servers = self.lab.nginx_servers(self.cert, self.work / "key.pem", self.nginx_status)
        start_nginx(self.processes, servers, [*self.lab.listens(), ("127.0.0.1", self.nginx_status)])
        names = {host.name: host.address for host in HOSTS}
        self.squid = start_squid(self.processes, self.squid_port, names, [80], [self.port])
        policy = egresswall_policy(list(names), [f"{address}/32" for address in names.values()], [80], [self.port],
                                   self.dns.address)
        self.egresswall = start_egresswall(self.processes, self.ew_port, self.ew_admin, policy, self.ew_workers,
                                           options=self.ew_options)

    def stop(self) -> None:
        self.processes.stop()
        self.echo.stop()
        self.dns.__exit__()

    def proxy(self, target: str) -> str | None:
        return {"direct": None, "squid": f"127.0.0.1:{self.squid_port}",
                "egresswall": f"127.0.0.1:{self.ew_port}"}[target]

    def proxy_pid(self, target: str) -> int | None:
        return {"direct": None, "squid": self.squid.pid, "egresswall": self.egresswall.pid}[target]

    def egresswall_decisions(self) -> list[dict[str, Any]]:
        path = self.work / "audit.jsonl"
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
        return [r for r in records if r.get("event") == "decision"]

    def squid_log(self) -> list[str]:
        path = self.work / "squid-access.log"
        return path.read_text().splitlines() if path.exists() else []


def cpu_ms(pid: int) -> float:
    """CPU time (user + system) a process and its children have used so far, in ms (/proc, 10 ms ticks)."""
    pids = [pid] + [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True,
                                                   text=True).stdout.split()]
    ticks = 0
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat(5))
    return ticks * 1000 / os.sysconf("SC_CLK_TCK")


def nginx_accepts(status_port: int) -> int:
    """nginx's count of accepted connections so far, the one that asks included."""
    with urllib.request.urlopen(f"http://127.0.0.1:{status_port}/status", timeout=10) as reply:
        text = reply.read().decode()
    found = re.search(r"server accepts handled requests\s+(\d+)", text)
    if not found:
        raise RuntimeError(f"nginx's stub_status said {text!r}")
    return int(found.group(1))


@dataclass
class Load:
    target: str
    load_ms: float = math.nan
    settled_ms: float = math.nan
    connections_used: int = 0
    connections_opened: int = 0
    proxy_cpu_ms: float = math.nan  # the proxy's CPU time during the load
    statuses: dict[str, int] = field(default_factory=dict)  # URL -> HTTP status, subresources and page
    protocols: Counter = field(default_factory=Counter)
    failed: list[str] = field(default_factory=list)  # "URL: Chromium's error text"
    websockets: list[str] = field(default_factory=list)
    websocket_echo: str | None = None
    xhr_status: Any = None
    scripts_run: int = 0
    error: str | None = None

    def problems(self, lab: PageLab) -> list[str]:
        """Why this load is not a complete load of the page (empty when it is)."""
        found = [] if self.error is None else [self.error]
        found += [f"failed: {f}" for f in self.failed]
        found += [f"status {status}: {url}" for url, status in sorted(self.statuses.items()) if status != 200]
        expected = lab.subresource_urls() | {lab.page_url}
        got = set(self.statuses) | set(self.websockets)
        found += [f"no response: {url}" for url in sorted(expected - got)]
        found += [f"not part of the page: {url}" for url in sorted(got - expected)]
        if self.xhr_status != 200:
            found.append(f"the XHR ended with {self.xhr_status!r}")
        if self.websocket_echo != "ping from the page-load lab":
            found.append(f"the WebSocket echoed {self.websocket_echo!r}")
        scripts = sum(1 for url in expected if url.endswith(".js"))
        if self.scripts_run != scripts:
            found.append(f"{self.scripts_run} of {scripts} scripts ran")
        return found


def direct_launch_options(plan: launcher.LaunchPlan, resolver_rules: str) -> dict[str, Any]:
    """The contained launch without its proxy: the same switches and profile, Chromium resolving the lab
    names itself by ``resolver_rules`` (every other name fails)."""
    options = plan.launch_options()
    options.pop("proxy")
    options["args"] = [a for a in plan.args if not a.startswith(("--proxy-server=", "--proxy-bypass-list="))]
    options["args"] += ["--no-proxy-server", f"--host-resolver-rules={resolver_rules}"]
    return options


class Browsers:
    """One Chromium per target for the whole run, from egresswall's launcher (``browser/launch.py``)."""

    def __init__(self, stack: PageLoadStack) -> None:
        self.stack = stack
        self.plans: list[launcher.LaunchPlan] = []
        self.browsers: dict[str, Any] = {}
        self._playwright = None

    def __enter__(self) -> Browsers:
        from playwright.sync_api import sync_playwright

        self._playwright = sync_playwright().start()
        try:
            for target in TARGETS:
                proxy = self.stack.proxy(target)
                # the direct browser's plan names a proxy only to be built; its proxy flags are taken out
                plan = launcher.plan_launch(proxy or "127.0.0.1:9", ca_files=[self.stack.cert], sandbox=SANDBOX)
                self.plans.append(plan)
                if proxy is None:
                    rules = ", ".join(f"MAP {host.name} {host.address}" for host in HOSTS) + ", MAP * ~NOTFOUND"
                    self.browsers[target] = self._playwright.chromium.launch(**direct_launch_options(plan, rules))
                else:
                    self.browsers[target] = launcher.launch(self._playwright, plan)  # argv checked in /proc
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for browser in self.browsers.values():
            browser.close()
        for plan in self.plans:
            plan.cleanup()
        if self._playwright is not None:
            self._playwright.stop()


PAGE_FIGURES = """() => {
    const nav = performance.getEntriesByType('navigation')[0];
    return {load: nav ? nav.loadEventStart : null, settled: window.__settledAt ?? null,
            xhr: window.__xhr ?? null, ws: window.__ws ?? null, scripts: (window.__scripts || []).length};
}"""


def load_page(browser: Any, target: str, stack: PageLoadStack) -> Load:
    """One load of the lab page in a fresh context, observed through CDP and the page's own figures."""
    result = Load(target)
    connection_ids: set[float] = set()
    lab = stack.lab
    accepts_before = nginx_accepts(stack.nginx_status)
    proxy_pid = stack.proxy_pid(target)
    cpu_before = cpu_ms(proxy_pid) if proxy_pid else math.nan

    def response(event: dict[str, Any]) -> None:
        reply = event["response"]
        result.statuses[reply["url"]] = reply["status"]
        result.protocols[reply.get("protocol", "?")] += 1
        if reply.get("connectionId"):
            connection_ids.add(reply["connectionId"])

    requests: dict[str, str] = {}  # CDP request id -> URL, to name a failed request

    def failed(event: dict[str, Any]) -> None:
        result.failed.append(f"{requests.get(event['requestId'], '?')}: {event.get('errorText')}")

    context = browser.new_context()
    try:
        page = context.new_page()
        cdp = context.new_cdp_session(page)
        cdp.on("Network.requestWillBeSent", lambda e: requests.__setitem__(e["requestId"], e["request"]["url"]))
        cdp.on("Network.responseReceived", response)
        cdp.on("Network.loadingFailed", failed)
        cdp.on("Network.webSocketCreated", lambda e: result.websockets.append(e["url"]))
        cdp.send("Network.enable")
        try:
            page.goto(lab.page_url, wait_until="load", timeout=60_000)
            page.wait_for_function("window.__settled === true", timeout=30_000)
        except Exception as err:  # a timeout or a navigation error: reported with the load, not raised
            result.error = f"{type(err).__name__}: {str(err).splitlines()[0]}"
        try:
            figures = page.evaluate(PAGE_FIGURES)
        except Exception as err:  # the page never loaded (e.g. Chromium's error page replaced it)
            result.error = result.error or f"{type(err).__name__}: {str(err).splitlines()[0]}"
            figures = {"load": None, "settled": None, "xhr": None, "ws": None, "scripts": 0}
    finally:
        context.close()
    result.load_ms = figures["load"] or math.nan
    result.settled_ms = figures["settled"] or math.nan
    result.xhr_status, result.websocket_echo, result.scripts_run = figures["xhr"], figures["ws"], figures["scripts"]
    result.connections_used = len(connection_ids) + len(result.websockets)
    result.connections_opened = nginx_accepts(stack.nginx_status) - accepts_before - 1  # less the reading's own
    result.proxy_cpu_ms = cpu_ms(proxy_pid) - cpu_before if proxy_pid else math.nan
    return result


def run_loads(stack: PageLoadStack, browsers: Browsers, rounds: int, warmup: int = 1) -> list[Load]:
    for _ in range(warmup):
        for target in TARGETS:
            load_page(browsers.browsers[target], target, stack)
    loads = []
    for round_no in range(rounds):
        order = TARGETS[round_no % 3:] + TARGETS[:round_no % 3]  # alternate who goes first
        for target in order:
            loads.append(load_page(browsers.browsers[target], target, stack))
    return loads


# ---- the table -----------------------------------------------------------------------------------

def p90(values: list[float]) -> float:
    """The nearest-rank 90th percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


FIGURES = (("time to load, ms", "load_ms"), ("settled (XHR + WebSocket), ms", "settled_ms"),
           ("connections opened (nginx accepts)", "connections_opened"),
           ("connections used (CDP)", "connections_used"), ("proxy CPU time, ms", "proxy_cpu_ms"))


def table(loads: list[Load]) -> list[str]:
    rows = [f"{'figure':<44}" + "".join(f"{t:>12}" for t in TARGETS) + f"{'ew/squid':>10}"]
    for label, attribute in FIGURES:
        for stat_name, stat in (("median", statistics.median), ("p90", p90)):
            cells, values = "", {}
            for target in TARGETS:
                series = [getattr(load, attribute) for load in loads if load.target == target]
                series = [v for v in series if not math.isnan(v)]
                if series:
                    values[target] = stat(series)
                    cells += f"{values[target]:>12.1f}"
                else:
                    cells += f"{'-':>12}"
            ratio = f"{values['egresswall'] / values['squid']:.2f}" if values.get("squid") and "egresswall" in values \
                else "-"
            rows.append(f"{label + ' ' + stat_name:<44}{cells}{ratio:>10}")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20, help="loads per target (default 20)")
    parser.add_argument("--warmup", type=int, default=1, help="uncounted loads per target first (default 1)")
    parser.add_argument("--workers", type=int, default=1,
                        help="egresswall worker processes (default 1, egresswall's default; squid runs 1)")
    parser.add_argument("--egresswall-option", action="append", default=[], metavar="OPTION",
                        help="one more `egresswall run` option, e.g. --egresswall-option=--no-uvloop (repeatable)")
    args = parser.parse_args()
    for tool in ("nginx", "squid"):
        if not shutil.which(tool):
            print(f"bench-pageload: {tool} is not installed (ci/install.sh --bench installs it)", file=sys.stderr)
            return 2
    raise_fd_limit()
    started, load_before = time.monotonic(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ew-pageload-", delete=not os.environ.get("BENCH_KEEP")) as tmp:
        stack = PageLoadStack(Path(tmp), args.workers, args.egresswall_option)
        try:
            stack.start()
            with Browsers(stack) as browsers:
                loads = run_loads(stack, browsers, args.rounds, args.warmup)
            refusals = [d for d in stack.egresswall_decisions() if d.get("verdict") != "allow"]
        finally:
            stack.stop()
    broken = [(load, load.problems(stack.lab)) for load in loads]
    broken = [(load, problems) for load, problems in broken if problems]
    protocols = Counter()
    for load in loads:
        protocols.update(load.protocols)
    print("\n".join(["", *table(loads)]))
    print(f"\n{args.rounds} round(s) of {len(TARGETS)} loads (+{args.warmup} warm-up each), medians and nearest-rank "
          f"p90; {time.monotonic() - started:.0f}s in all; {os.cpu_count()} CPUs, load average "
          f"{load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after; egresswall with {args.workers} worker(s)"
          f"{' and ' + ' '.join(args.egresswall_option) if args.egresswall_option else ''}; "
          f"squid {squid_version()} (1 worker); responses by protocol {dict(protocols)}")
    for load, problems in broken:
        print(f"INCOMPLETE LOAD via {load.target}: " + "; ".join(problems[:8]), file=sys.stderr)
    for refusal in refusals:
        print(f"egresswall refused {refusal.get('host')}:{refusal.get('port')}: {refusal.get('reason')}",
              file=sys.stderr)
    return 1 if broken or refusals else 0


if __name__ == "__main__":
    sys.exit(main())
