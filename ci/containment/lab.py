"""Build the containment lab (three namespaces, two veth pairs, lab hosts, packet filter, capture, proxy)
and tear it down again, whatever happens. See ``topology.py`` for the layout."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from lab_util import NetnsLab

from containment import topology as T
from containment.capture import Packet, read_pcap
from containment.certs import LabCerts

FILTER_FILE = T.ROOT / "ci" / "lab" / "browser-netns.nft"
PYTHONPATH = os.pathsep.join(str(p) for p in (T.ROOT / "ci", T.ROOT / "tests", T.ROOT))


# Long-running lab processes never outlive a lost run (the orchestrator killed with SIGKILL) by much:
# GNU timeout ends them, and passes on the signals the lab sends them (SIGINT, SIGTERM) meanwhile.
BOUNDED = ["timeout", "-k", "5", "900"]


class LabError(RuntimeError):
    """The lab itself could not be built or run (not a containment failure)."""


def filter_defines() -> dict[str, str]:
    return dict(re.findall(r"^define\s+(\w+)\s*=\s*(.+?)\s*$", FILTER_FILE.read_text(), re.M))


def child_env(tmpdir: Path | None = None) -> dict[str, str]:
    """The environment of every lab process: no proxy variables, the lab's modules importable, and
    temporary files (a browser profile) inside the run's own directory, which is removed afterwards."""
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env["PYTHONPATH"] = PYTHONPATH + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if tmpdir is not None:
        tmpdir.mkdir(parents=True, exist_ok=True)
        env["TMPDIR"] = str(tmpdir)
    return env


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None,
             log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise LabError(f"{what}: exited with {proc.returncode}" + _tail(log))
        if time.monotonic() > deadline:
            raise LabError(f"{what}: not ready after {timeout:.0f} s" + _tail(log))
        time.sleep(0.05)


def _tail(log: Path | None, lines: int = 15) -> str:
    if log is None or not log.exists():
        return ""
    return "\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Evidence:
    """Everything a run left behind, read after the processes stopped."""

    audit: list[dict] = field(default_factory=list)
    net_events: list[dict] = field(default_factory=list)  # public web, STUN, DNS, internal stand-ins
    proxy_loopback: list[dict] = field(default_factory=list)  # the proxy namespace's loopback stand-in
    browser_loopback: list[dict] = field(default_factory=list)  # the browser namespace's loopback stand-in
    counters: dict[str, int] = field(default_factory=dict)  # packets that arrived for each stand-in address
    browser_counters: dict[str, int] = field(default_factory=dict)  # browser ns: TCP/UDP on lo, packets sent
    packets: list[Packet] = field(default_factory=list)  # sent on the browser namespace's interface
    proxy_stderr: str = ""


class ContainmentLab:
    """One run's lab. ``with ContainmentLab(...) as lab:`` builds it; leaving the block tears it down."""

    def __init__(self, workdir: Path, certs: LabCerts, *, packet_filter: bool, probe_dir: Path | None,
                 browser_routes: bool = True, browser_egress: bool = False,
                 loopback_watch_ports: tuple[int, ...] | None = None) -> None:
        """``browser_routes``: the browser namespace routes the lab's hosts via the proxy's address (so a
        packet sent past the proxy is captured and rejected there); False gives it only its own link, like
        compose's ``internal: true`` network. ``browser_egress``: also a link from the browser namespace to
        the net namespace, with routes to the lab's hosts over it (compose's browser also on ``egress``: a
        leak the run must report). ``loopback_watch_ports``: count only TCP connections on the browser's
        loopback to these ports (a browser server's own relay uses loopback too); None: every one."""
        self.browser_routes, self.browser_egress = browser_routes, browser_egress
        self.loopback_watch_ports = loopback_watch_ports
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.certs = certs
        self.packet_filter = packet_filter
        self.probe_dir = probe_dir
        self.netns = NetnsLab(timeout=15)
        self.browser = self.proxy = self.net = ""
        self.capture_proc: subprocess.Popen | None = None
        self.proxy_proc: subprocess.Popen | None = None
        self.python = sys.executable
        # Chromium puts a unix socket into TMPDIR, and a socket path has at most 107 bytes: keep it short.
        self.tmp = self.dir / "t"
        self._own_tmp: Path | None = None
        if len(str(self.tmp)) > 56:
            self.tmp = self._own_tmp = Path(tempfile.mkdtemp(prefix="ewlab-", dir="/tmp"))
        self.env = child_env(self.tmp)

    def __enter__(self) -> ContainmentLab:
        try:
            self.build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        # Teardown is not interruptible: a second Ctrl-C or SIGTERM waits until the lab is gone.
        blocked = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        try:
            self.netns.close()
            if self._own_tmp is not None:
                shutil.rmtree(self._own_tmp, ignore_errors=True)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    # ---- building ----------------------------------------------------------------------------------

    def build(self) -> None:
        defines = filter_defines()
        if defines.get("proxy_addr") != T.PROXY_ADDR or defines.get("proxy_port") != str(T.PROXY_PORT):
            raise LabError(f"{FILTER_FILE}: proxy_addr/proxy_port must be {T.PROXY_ADDR}/{T.PROXY_PORT} "
                           f"for the lab, found {defines}")
        n = self.netns
        self.browser, self.proxy, self.net = (n.add_namespace(x) for x in ("browser", "proxy", "net"))
        for ns in (self.browser, self.proxy, self.net):
            # A new namespace inherits IPv4 settings from the machine's: say "no forwarding" explicitly.
            self.sysctl(ns, "net.ipv4.ip_forward=0", "net.ipv6.conf.all.forwarding=0",
                        "net.ipv6.conf.default.forwarding=0")
        # The browser's link carries IPv4 to the proxy and nothing else: no IPv6 on it, so no router
        # solicitations or neighbour discovery that the capture would have to excuse.
        self.sysctl(self.browser, "net.ipv6.conf.default.disable_ipv6=1")
        n.add_veth(self.browser, T.BROWSER_IF, self.proxy, T.PROXY_BROWSER_IF)
        n.add_veth(self.proxy, T.PROXY_NET_IF, self.net, T.NET_IF)
        n.add_address(self.browser, T.BROWSER_IF, f"{T.BROWSER_ADDR}/{T.BROWSER_LINK}")
        n.add_address(self.proxy, T.PROXY_BROWSER_IF, f"{T.PROXY_ADDR}/{T.BROWSER_LINK}")
        n.add_address(self.proxy, T.PROXY_NET_IF, f"{T.PROXY_NET_ADDR}/30")
        n.add_address(self.net, T.NET_IF, f"{T.NET_ADDR}/30")
        n.add_address(self.proxy, T.PROXY_NET_IF, f"{T.PROXY_NET_ADDR6}/64")
        n.add_address(self.net, T.NET_IF, f"{T.NET_ADDR6}/64")
        for address in T.LAB_HOSTS:
            n.add_address(self.net, T.NET_IF, f"{address}/{128 if ':' in address else 32}")
        # Routes: only the lab's own hosts, each via the one neighbour. No default route anywhere.
        for address in T.LAB_HOSTS_V4:
            if self.browser_routes:
                n.run(self.browser, ["ip", "route", "add", f"{address}/32", "via", T.PROXY_ADDR])
            n.run(self.proxy, ["ip", "route", "add", f"{address}/32", "via", T.NET_ADDR])
        if self.browser_egress:
            n.add_veth(self.browser, T.BROWSER_EGRESS_IF, self.net, T.NET_EGRESS_IF)
            n.add_address(self.browser, T.BROWSER_EGRESS_IF, f"{T.BROWSER_EGRESS_ADDR}/30")
            n.add_address(self.net, T.NET_EGRESS_IF, f"{T.NET_EGRESS_ADDR}/30")
            for address in T.LAB_HOSTS_V4:
                n.run(self.browser, ["ip", "route", "replace", f"{address}/32", "via", T.NET_EGRESS_ADDR])
        for address in T.LAB_HOSTS_V6:
            n.run(self.proxy, ["ip", "-6", "route", "add", f"{address}/128", "via", T.NET_ADDR6])
        self._verify_isolation()
        self._start_hosts()
        self._watch()
        if self.packet_filter:
            n.run(self.browser, ["nft", "-f", str(FILTER_FILE)])
        self._start_capture()

    def sysctl(self, ns: str, *settings: str) -> None:
        self.netns.run(ns, ["sysctl", "-q", "-w", *settings])

    def _verify_isolation(self) -> None:
        """No lab namespace may have a default route or forward packets (the lab's promise)."""
        for ns in (self.browser, self.proxy, self.net):
            for family in ("-4", "-6"):
                routes = self.netns.run(ns, ["ip", family, "route", "show", "default"]).stdout.strip()
                if routes:
                    raise LabError(f"{ns} has a default route: {routes}")
            forward = self.netns.run(ns, ["sysctl", "-n", "net.ipv4.ip_forward"]).stdout.strip()
            if forward != "0":
                raise LabError(f"{ns} forwards IPv4 packets")

    def _start_hosts(self) -> None:
        static = {"/probe/": str(self.probe_dir)} if self.probe_dir else {}
        internal = [{"name": name, "addresses": [address], "tcp": list(T.STANDIN_TCP_PORTS),
                     "udp": list(T.STANDIN_UDP_PORTS)} for name, address in T.INTERNAL.items()]
        loopback = {"addresses": ["127.0.0.1", "::1"], "tcp": list(T.LOOPBACK_TCP_PORTS),
                    "udp": list(T.LOOPBACK_UDP_PORTS)}
        configs = {
            "net": (self.net, {
                "standins": internal,
                "web": {"host": T.PUBLIC_WEB, "http_port": 80, "https_port": 443, "cert": str(self.certs.chain_file),
                        "key": str(self.certs.key_file), "static": static},
                "stun": {"host": T.PUBLIC_STUN, "port": T.STUN_PORT},
                "dns": {"host": T.LAB_DNS, "port": 53},
            }),
            "proxy-loopback": (self.proxy, {"standins": [{"name": "proxy-loopback", **loopback}]}),
            "browser-loopback": (self.browser, {"standins": [{"name": "browser-loopback", **loopback}]}),
        }
        for name, (ns, config) in configs.items():
            config.update(log=str(self.dir / f"{name}.jsonl"), ready=str(self.dir / f"{name}.ready"), lifetime=900)
            path = self.dir / f"{name}.json"
            path.write_text(json.dumps(config))
            out = self.dir / f"{name}.stderr"
            with open(out, "wb") as err:
                proc = self.netns.popen(ns, [self.python, "-m", "containment.hosts", str(path)],
                                        stdout=subprocess.DEVNULL, stderr=err, env=self.env)
            wait_for(lambda p=Path(config["ready"]): p.exists(), 20, f"lab hosts ({name})", proc, out)

    def _watch(self) -> None:
        """Counters that see every packet for a stand-in address, whatever its port or protocol."""
        rules = []
        for name, address in T.INTERNAL.items():
            family = "ip6" if ":" in address else "ip"
            rules.append(f'{family} daddr {address} counter comment "{name}"')
        rules.append(f'ip daddr {T.PUBLIC_STUN} meta l4proto udp counter comment "stun"')
        self._nft(self.net, "ewlab_watch", {"prerouting": rules})
        # The proxy namespace answers a packet the browser sent past the proxy with a rejection, as a
        # network whose only way out is the proxy would: the attempt fails at once instead of hanging
        # until its timeout. (It never forwards it: the capture has already seen it.)
        not_proxy = f'iifname "{T.PROXY_BROWSER_IF}" ip daddr != {T.PROXY_ADDR}'
        self._nft(self.proxy, "ewlab_edge", {"prerouting": [
            f"{not_proxy} meta l4proto tcp reject with tcp reset",
            f"{not_proxy} fib daddr type unicast reject with icmpx type admin-prohibited",
        ]})
        ports = "" if self.loopback_watch_ports is None else \
            f"tcp dport {{ {', '.join(str(p) for p in self.loopback_watch_ports)} }} "
        egress = [f'oifname "{T.BROWSER_EGRESS_IF}" counter comment "egress-sent"'] if self.browser_egress else []
        self._nft(self.browser, "ewlab_watch", {
            "output": [f'oifname "lo" {ports}tcp flags & (syn | ack) == syn counter comment "lo-tcp-connect"',
                       'oifname "lo" meta l4proto udp counter comment "lo-udp"'],
            # What really left on the browser's interface (after the filter): the capture must hold as
            # many unicast IP packets, or it missed some and proves nothing. (Multicast and broadcast are
            # not counted: their looped-back copies pass this hook too, and would be counted twice.)
            "postrouting": [f'oifname "{T.BROWSER_IF}" ip daddr != {{ 224.0.0.0/4, 255.255.255.255, '
                            f'{T.BROWSER_BROADCAST} }} counter comment "sent"', *egress],
        })

    def _nft(self, ns: str, table: str, chains: dict[str, list[str]]) -> None:
        """A table of counting rules (policy accept: it observes, it never filters)."""
        text = f"table inet {table} {{\n"
        for hook, rules in chains.items():
            priority = 300 if hook == "postrouting" else -300
            body = "\n".join(f"    {rule}" for rule in rules)
            text += (f"  chain {hook} {{\n    type filter hook {hook} priority {priority}; policy accept;\n"
                     f"{body}\n  }}\n")
        self.netns.run(ns, ["nft", "-f", "-"], input=text + "}\n")

    def counters(self, ns: str, table: str = "ewlab_watch") -> dict[str, int]:
        listing = json.loads(self.netns.run(ns, ["nft", "-j", "list", "table", "inet", table]).stdout)
        result = {}
        for item in listing.get("nftables", []):
            rule = item.get("rule")
            if not rule:
                continue
            packets = sum(e["counter"]["packets"] for e in rule["expr"] if "counter" in e)
            result[rule.get("comment", "?")] = packets
        return result

    def _start_capture(self) -> None:
        self.pcap = self.dir / "browser.pcap"
        err = self.dir / "tcpdump.stderr"
        with open(err, "wb") as stderr:
            # --immediate-mode: without it libpcap hands packets over in blocks, and the last block is
            # lost when tcpdump is stopped (seen here: 0 of 313 packets written).
            argv = [*BOUNDED, "tcpdump", "-i", T.BROWSER_IF, "-Q", "out", "-n", "--immediate-mode", "-U",
                    "-s", "256", "-w", str(self.pcap)]
            self.capture_proc = self.netns.popen(self.browser, argv, stdout=subprocess.DEVNULL, stderr=stderr)
        wait_for(lambda: "listening on" in err.read_text(errors="replace"), 15, "tcpdump", self.capture_proc, err)

    # ---- the proxy ---------------------------------------------------------------------------------------

    def start_proxy(self, policy: Path, overrides: list[str]) -> None:
        self.audit_path = self.dir / "audit.jsonl"
        self.proxy_err = self.dir / "proxy.stderr"
        code = "import sys\nfrom proxy.cli import main\nsys.exit(main(sys.argv[1:]))"
        argv = [*BOUNDED, self.python, "-c", code, "run", "--policy", str(policy), *overrides,
                "--listen", f"{T.PROXY_ADDR}:{T.PROXY_PORT}", "--admin", T.ADMIN, "--log", str(self.audit_path)]
        with open(self.proxy_err, "wb") as stderr:
            self.proxy_proc = self.netns.popen(self.proxy, argv, stdout=subprocess.DEVNULL, stderr=stderr,
                                               env=self.env)
        wait_for(lambda: "proxy on" in self.proxy_err.read_text(errors="replace"), 30, "egresswall",
                 self.proxy_proc, self.proxy_err)

    # ---- finishing ---------------------------------------------------------------------------------------

    def finish(self) -> Evidence:
        """Stop the proxy (its audit log is then complete, and the connections it closes are still
        captured), read the kernel's counters, stop the capture, then read every log."""
        if self.proxy_proc is not None:
            self.netns.stop(self.proxy_proc, grace=15)
        time.sleep(0.5)  # packets in flight; stand-ins finish logging what they accepted
        browser_counters = self.counters(self.browser)
        if self.capture_proc is not None:
            self.capture_proc.send_signal(signal.SIGINT)
            try:
                self.capture_proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.netns.stop(self.capture_proc)
        evidence = Evidence(
            audit=_jsonl(getattr(self, "audit_path", None)),
            net_events=_jsonl(self.dir / "net.jsonl"),
            proxy_loopback=_jsonl(self.dir / "proxy-loopback.jsonl"),
            browser_loopback=_jsonl(self.dir / "browser-loopback.jsonl"),
            counters=self.counters(self.net),
            browser_counters=browser_counters,
            packets=read_pcap(self.pcap),
            proxy_stderr=self.proxy_err.read_text(errors="replace") if hasattr(self, "proxy_err") else "",
        )
        return evidence


def _jsonl(path: Path | None) -> list[dict]:
    if path is None or not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
