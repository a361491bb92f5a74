"""The sidecar pod's packet filter, applied in a network-namespace lab and shown to hold.

compose/k8s/egress-lock.nft is applied, unmodified and with the init container's own command line (read
from compose/k8s/sidecar/deployment.yaml), in a namespace standing for the pod. A second namespace,
joined by a veth pair on 198.18.0.0/15 (and a ULA for IPv6), stands for "outside the pod"; it has no
route anywhere else. Listeners record every connection and datagram with the marker each probe sends.

Shown: before the ruleset, another user's probes do leave (the lab can see a leak); after it, another
user (nobody, and root too) cannot connect out by TCP nor send UDP — refused at once, and the outside
listeners saw nothing — can reach the proxy's port and the pod-local browser-server port on loopback,
and cannot reach the admin port (on loopback or the pod's address), the Playwright driver's port nor any
other loopback port; the browser's uid reaches the driver's port too, and nothing outside; the proxy's uid
can still connect out by TCP and UDP, over IPv4 and IPv6.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from lab_util import NetnsLab, lab_skip_reason

pytestmark = pytest.mark.lab

ROOT = Path(__file__).resolve().parents[1]
RULESET = ROOT / "compose" / "k8s" / "egress-lock.nft"
SIDECAR = ROOT / "compose" / "k8s" / "sidecar" / "deployment.yaml"

OTHER_UID = 65534  # nobody: stands for the browser's and the app's users
POD4, OUT4 = "198.18.77.1", "198.18.77.2"
POD6, OUT6 = "fd00:ee::1", "fd00:ee::2"
OUT_TCP_PORT, OUT_UDP_PORT = 8080, 5353
OTHER_LOOPBACK_PORT = 8081
FAST = 1.5  # seconds: a rejected attempt fails well before the probes' 3 s timeout


def ruleset_defines() -> dict[str, str]:
    return dict(re.findall(r"^define\s+(\w+)\s*=\s*(.+?)\s*$", RULESET.read_text(), re.M))


DEFINES = ruleset_defines()
PROXY_UID = int(DEFINES["proxy_uid"])
PROXY_PORT = int(DEFINES["proxy_port"])
ADMIN_PORT = int(DEFINES["admin_port"])
POD_LOCAL_PORTS = [int(p) for p in re.findall(r"\d+", DEFINES["pod_local_ports"])]
BROWSER_UID = int(DEFINES["browser_uid"])
DRIVER_PORT = int(DEFINES["driver_port"])

# Runs as root in a namespace: binds every (proto, host, port) it is given, writes "ready", then appends
# one JSON line per connection or datagram (with what the peer sent) to a log file.
LISTENER = r"""
import json, select, socket, sys, time
specs, log, ready = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
socks = {}
for spec in specs:
    family = socket.AF_INET6 if ":" in spec["host"] else socket.AF_INET
    kind = socket.SOCK_STREAM if spec["proto"] == "tcp" else socket.SOCK_DGRAM
    s = socket.socket(family, kind)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((spec["host"], spec["port"]))
    if kind == socket.SOCK_STREAM:
        s.listen(16)
    socks[s] = spec
open(ready, "w").close()
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    readable, _, _ = select.select(list(socks), [], [], 1)
    for s in readable:
        spec = socks[s]
        if spec["proto"] == "tcp":
            conn, peer = s.accept()
            conn.settimeout(1)
            try:
                data = conn.recv(200)
            except OSError:
                data = b""
            conn.close()
        else:
            data, peer = s.recvfrom(200)
        with open(log, "a") as f:
            f.write(json.dumps({"label": spec["label"], "peer": str(peer[0]), "data": data.decode()}) + "\n")
"""

# Runs as the user under test in the pod namespace: one attempt per probe, each bounded by 3 s; prints
# a JSON list of outcomes ("connected", "sent", or the errno name) with the time each took.
PROBE = r"""
import errno, json, os, socket, sys, time
results = []
for p in json.loads(sys.argv[1]):
    family = socket.AF_INET6 if ":" in p["host"] else socket.AF_INET
    start = time.monotonic()
    try:
        if p["proto"] == "tcp":
            s = socket.create_connection((p["host"], p["port"]), timeout=3)
            s.sendall(p["marker"].encode())
            s.close()
            outcome = "connected"
        else:
            s = socket.socket(family, socket.SOCK_DGRAM)
            s.settimeout(3)
            for _ in range(2):
                s.sendto(p["marker"].encode(), (p["host"], p["port"]))
                time.sleep(0.05)
            s.close()
            outcome = "sent"
    except OSError as e:
        outcome = errno.errorcode.get(e.errno, "timeout" if isinstance(e, TimeoutError) else repr(e))
    results.append({"name": p["name"], "outcome": outcome, "seconds": time.monotonic() - start,
                    "uid": os.getuid()})
print(json.dumps(results))
"""


def _interpreter_for(uids: list[int]) -> str | None:
    """A Python that the probe users can execute (the test's own may live under root's home)."""
    candidates = [os.path.realpath(sys.executable), shutil.which("python3"), "/usr/bin/python3",
                  "/usr/local/bin/python3"]
    for exe in dict.fromkeys(c for c in candidates if c):
        if not os.path.exists(exe):
            continue
        runs = [subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", exe, "-c", "pass"],
                               capture_output=True, timeout=10, cwd="/") for uid in uids]
        if all(run.returncode == 0 for run in runs):
            return exe
    return None


def init_container_command() -> list[str]:
    """The egress-lock init container's command, with the ConfigMap mount path mapped to the repo file."""
    deployment = yaml.safe_load(SIDECAR.read_text())
    (init,) = [c for c in deployment["spec"]["template"]["spec"]["initContainers"] if c["name"] == "egress-lock"]
    command = list(init["command"])
    (index,) = [i for i, arg in enumerate(command) if arg.endswith(".nft")]
    assert Path(command[index]).name == RULESET.name, "the init container must apply egress-lock.nft"
    command[index] = str(RULESET)
    return command


class Lab:
    def __init__(self, netns: NetnsLab, pod: str, out: str, python: str, logs: Path) -> None:
        self.netns, self.pod, self.out, self.python, self.logs = netns, pod, out, python, logs
        self.baseline: dict[str, dict] = {}  # the probes' outcomes before the ruleset was applied

    def probe(self, uid: int | None, probes: list[dict]) -> dict[str, dict]:
        """Run probes as ``uid`` (None: root) in the pod namespace; returns outcome by probe name."""
        call = secrets.token_hex(4)  # every call has its own markers: earlier calls never match
        for p in probes:
            p["marker"] = f"{p['name']}/uid={uid}/{call}"
        argv = [self.python, "-I", "-c", PROBE, json.dumps(probes)]
        done = self.netns.run(self.pod, argv, uid=uid, timeout=30)
        results = {r["name"]: r for r in json.loads(done.stdout)}
        for p in probes:
            results[p["name"]]["marker"] = p["marker"]
        time.sleep(0.3)  # let the listeners log what arrived
        return results

    def seen(self, result: dict) -> list[dict]:
        """What any listener (outside or on the pod's loopback) logged from the probe behind ``result``."""
        events = []
        for log in self.logs.glob("*.jsonl"):
            events += [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        return [e for e in events if e["data"].startswith(result["marker"])]

    def apply_ruleset(self) -> None:
        self.netns.run(self.pod, init_container_command(), timeout=15)


OUT_PROBES = [
    {"name": "tcp4-out", "proto": "tcp", "host": OUT4, "port": OUT_TCP_PORT},
    {"name": "tcp6-out", "proto": "tcp", "host": OUT6, "port": OUT_TCP_PORT},
    {"name": "udp4-out", "proto": "udp", "host": OUT4, "port": OUT_UDP_PORT},
    {"name": "udp6-out", "proto": "udp", "host": OUT6, "port": OUT_UDP_PORT},
]
LOOPBACK_PROBES = [
    {"name": "proxy-port", "proto": "tcp", "host": "127.0.0.1", "port": PROXY_PORT},
    {"name": "admin-loopback", "proto": "tcp", "host": "127.0.0.1", "port": ADMIN_PORT},
    {"name": "admin-pod-ip", "proto": "tcp", "host": POD4, "port": ADMIN_PORT},
    {"name": "other-loopback-port", "proto": "tcp", "host": "127.0.0.1", "port": OTHER_LOOPBACK_PORT},
    {"name": "udp-loopback", "proto": "udp", "host": "127.0.0.1", "port": OUT_UDP_PORT},
    *[{"name": f"pod-local-{port}", "proto": "tcp", "host": "127.0.0.1", "port": port} for port in POD_LOCAL_PORTS],
    {"name": "driver-port", "proto": "tcp", "host": "127.0.0.1", "port": DRIVER_PORT},
]


def _copy(probes: list[dict]) -> list[dict]:
    return [dict(p) for p in probes]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    reason = lab_skip_reason("nft", "setpriv")
    if reason:
        pytest.skip(reason)
    python = _interpreter_for([OTHER_UID, PROXY_UID, BROWSER_UID])
    if python is None:  # ci/install.sh --lab installs Debian's python3, which any uid may execute
        pytest.skip(f"no Python interpreter that uids {OTHER_UID}, {PROXY_UID} and {BROWSER_UID} may execute")
    logs = tmp_path_factory.mktemp("nft-lab")
    os.chmod(logs, 0o755)
    with NetnsLab() as netns:
        pod = netns.add_namespace("pod")
        out = netns.add_namespace("out")
        netns.add_veth(pod, "ewpod0", out, "ewout0")
        netns.add_address(pod, "ewpod0", f"{POD4}/24")
        netns.add_address(out, "ewout0", f"{OUT4}/24")
        netns.add_address(pod, "ewpod0", f"{POD6}/64")
        netns.add_address(out, "ewout0", f"{OUT6}/64")
        listeners = {
            out: [
                {"label": "out-tcp4", "proto": "tcp", "host": OUT4, "port": OUT_TCP_PORT},
                {"label": "out-tcp6", "proto": "tcp", "host": OUT6, "port": OUT_TCP_PORT},
                {"label": "out-udp4", "proto": "udp", "host": OUT4, "port": OUT_UDP_PORT},
                {"label": "out-udp6", "proto": "udp", "host": OUT6, "port": OUT_UDP_PORT},
            ],
            pod: [
                {"label": "proxy", "proto": "tcp", "host": "127.0.0.1", "port": PROXY_PORT},
                {"label": "admin", "proto": "tcp", "host": "0.0.0.0", "port": ADMIN_PORT},
                {"label": "other", "proto": "tcp", "host": "127.0.0.1", "port": OTHER_LOOPBACK_PORT},
                {"label": "udp-lo", "proto": "udp", "host": "127.0.0.1", "port": OUT_UDP_PORT},
                *[{"label": f"pod-local-{p}", "proto": "tcp", "host": "127.0.0.1", "port": p}
                  for p in POD_LOCAL_PORTS],
                {"label": "driver", "proto": "tcp", "host": "127.0.0.1", "port": DRIVER_PORT},
            ],
        }
        for i, (ns, specs) in enumerate(listeners.items()):
            ready = logs / f"ready-{i}"
            proc = netns.popen(ns, [sys.executable, "-I", "-c", LISTENER, json.dumps(specs),
                                    str(logs / f"listener-{i}.jsonl"), str(ready)])
            deadline = time.monotonic() + 10
            while not ready.exists():
                assert proc.poll() is None, f"listener in {ns} exited with {proc.returncode}"
                assert time.monotonic() < deadline, f"listener in {ns} not ready after 10 s"
                time.sleep(0.05)
        the_lab = Lab(netns, pod, out, python, logs)
        # Before the ruleset: the lab must be able to see a leak, or the checks below prove nothing.
        the_lab.baseline = the_lab.probe(OTHER_UID, _copy(OUT_PROBES) + _copy(LOOPBACK_PROBES))
        the_lab.apply_ruleset()
        yield the_lab


def test_without_the_ruleset_another_user_does_leave(lab):
    """The negative control: the same probes leave the pod when the filter is not there."""
    for name in ("tcp4-out", "tcp6-out", "admin-loopback", "other-loopback-port"):
        assert lab.baseline[name]["outcome"] == "connected", lab.baseline[name]
        assert lab.seen(lab.baseline[name]), f"{name}: the lab's listener saw nothing without the filter"
    for name in ("udp4-out", "udp6-out"):
        assert lab.baseline[name]["outcome"] == "sent", lab.baseline[name]
        assert lab.seen(lab.baseline[name]), f"{name}: the lab's listener saw nothing without the filter"


def test_ruleset_is_the_one_the_init_container_applies(lab):
    listing = lab.netns.run(lab.pod, ["nft", "list", "ruleset"]).stdout
    assert listing.count("table inet egresswall_lock") == 1
    assert f"meta skuid {PROXY_UID} accept" in listing
    # A restarted init container applies the file again: still one table, same rules.
    lab.apply_ruleset()
    assert lab.netns.run(lab.pod, ["nft", "list", "ruleset"]).stdout == listing


@pytest.mark.parametrize("uid", [OTHER_UID, None], ids=["nobody", "root"])
def test_another_user_cannot_connect_out_nor_send_udp(lab, uid):
    results = lab.probe(uid, _copy(OUT_PROBES))
    for name in ("tcp4-out", "tcp6-out"):
        assert results[name]["outcome"] == "ECONNREFUSED", results[name]
        assert results[name]["seconds"] < FAST, f"{name} was not rejected at once: {results[name]}"
    for name in ("udp4-out", "udp6-out"):
        # The rejected datagram is refused to the sender (EPERM) rather than silently lost.
        assert results[name]["outcome"] == "EPERM", results[name]
        assert results[name]["seconds"] < FAST, results[name]
    for probe in OUT_PROBES:
        assert lab.seen(results[probe["name"]]) == [], f"{probe['name']} reached the outside listener"


def test_another_user_reaches_the_proxy_port_and_pod_local_ports_on_loopback(lab):
    results = lab.probe(OTHER_UID, _copy(LOOPBACK_PROBES))
    names = ["proxy-port", *[f"pod-local-{port}" for port in POD_LOCAL_PORTS]]
    for name in names:
        assert results[name]["outcome"] == "connected", results[name]
        assert lab.seen(results[name]), f"{name}: the loopback listener saw nothing"


def test_another_user_cannot_reach_the_admin_port_nor_other_loopback_ports(lab):
    results = lab.probe(OTHER_UID, _copy(LOOPBACK_PROBES))
    for name in ("admin-loopback", "admin-pod-ip", "other-loopback-port", "driver-port"):
        assert results[name]["outcome"] == "ECONNREFUSED", results[name]
        assert results[name]["seconds"] < FAST, results[name]
        assert lab.seen(results[name]) == [], f"{name} reached its listener"
    assert results["udp-loopback"]["outcome"] == "EPERM", results["udp-loopback"]
    assert lab.seen(results["udp-loopback"]) == []


def test_the_proxy_uid_can_connect_out_and_reach_its_admin_port(lab):
    results = lab.probe(PROXY_UID, _copy(OUT_PROBES) + _copy(LOOPBACK_PROBES))
    for name in ("tcp4-out", "tcp6-out", "proxy-port", "admin-loopback", "admin-pod-ip"):
        assert results[name]["outcome"] == "connected", results[name]
        assert lab.seen(results[name]), f"{name}: the listener saw nothing from the proxy's uid"
    for name in ("udp4-out", "udp6-out"):
        assert results[name]["outcome"] == "sent", results[name]
        assert lab.seen(results[name]), f"{name}: the listener saw nothing from the proxy's uid"


def test_the_browser_uid_reaches_its_driver_port_and_nothing_more(lab):
    """The browser server's relay reaches the Playwright driver on loopback at --driver-port, as the browser
    container's user (a random port, or another user's connect, is refused: the app cannot drive the browser
    past the relay's filter, test above)."""
    results = lab.probe(BROWSER_UID, _copy(OUT_PROBES) + _copy(LOOPBACK_PROBES))
    for name in ("driver-port", "proxy-port", *[f"pod-local-{port}" for port in POD_LOCAL_PORTS]):
        assert results[name]["outcome"] == "connected", results[name]
        assert lab.seen(results[name]), f"{name}: the loopback listener saw nothing from the browser's uid"
    for name in ("tcp4-out", "tcp6-out", "admin-loopback", "other-loopback-port"):
        assert results[name]["outcome"] == "ECONNREFUSED", results[name]
        assert lab.seen(results[name]) == [], f"{name} reached its listener from the browser's uid"
