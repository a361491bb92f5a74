"""The containment lab itself (ci/containment/), tested with the simple Python client instead of Chromium.

These show the lab can see a leak (each weakening copied by the simple client is reported by the check
that must catch it), that it has no way out of its namespaces, that its packet filter rejects at once,
and that an interrupted run leaves nothing behind. tests/test_containment_smoke.py runs the real thing:
the probe page in the contained Chromium.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from lab_util import PREFIX, lab_skip_reason, list_namespaces

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "ci"))

from containment import topology as T  # noqa: E402
from containment.certs import make_lab_certs  # noqa: E402
from containment.lab import ContainmentLab  # noqa: E402
from containment.smoke import NEGATIVE_RUNS, POSITIVE_RUNS, Options, run_all  # noqa: E402

pytestmark = [pytest.mark.lab, pytest.mark.integration]
SMOKE = ROOT / "ci" / "containment-smoke"


@pytest.fixture(scope="module", autouse=True)
def _needs_lab():
    reason = lab_skip_reason("nft", "tcpdump")
    if reason:
        pytest.skip(reason)


def _our_namespaces(pid: int) -> list[str]:
    return [ns for ns in list_namespaces() if ns.startswith(f"{PREFIX}-{pid}-")]


@pytest.fixture(scope="module")
def simple_results():
    out = io.StringIO()
    results = run_all(POSITIVE_RUNS + NEGATIVE_RUNS, Options(client="simple", timeout=60), stream=out)
    print(out.getvalue())
    return {r.spec.name: r for r in results}


@pytest.mark.parametrize("name", [s.name for s in POSITIVE_RUNS])
def test_contained_simple_client_passes(simple_results, name):
    result = simple_results[name]
    assert result.error is None, result.error
    assert result.passed, result.judgement.failed()


@pytest.mark.parametrize("name", [s.name for s in NEGATIVE_RUNS])
def test_each_weakening_is_caught_by_its_check(simple_results, name):
    result = simple_results[name]
    assert result.error is None, result.error
    assert not result.passed
    assert result.spec.catches in result.judgement.failed(), result.judgement.failed()


def test_runs_leave_no_namespace_behind(simple_results):
    assert _our_namespaces(os.getpid()) == []


def test_lab_has_no_way_out(tmp_path):
    """No default route, no forwarding; the browser routes only lab hosts, all via the proxy's address.
    ``ip route get`` asks the kernel without sending anything."""
    certs = make_lab_certs(tmp_path / "certs", T.CERT_NAMES, [T.PUBLIC_WEB])
    with ContainmentLab(tmp_path / "run", certs, packet_filter=True, probe_dir=None) as lab:
        routes = lab.netns.run(lab.browser, ["ip", "-4", "route", "show"]).stdout.splitlines()
        via = [r for r in routes if " via " in r]
        assert sorted(r.split()[0] for r in via) == sorted(T.LAB_HOSTS_V4)
        assert all(f"via {T.PROXY_ADDR} " in r for r in via), via
        for ns in (lab.browser, lab.proxy, lab.net):
            for outside in ("192.0.2.1", "8.8.8.8"):  # never contacted: the kernel answers from its table
                probe = lab.netns.run(ns, ["ip", "route", "get", outside], check=False)
                assert probe.returncode != 0 and "unreachable" in probe.stderr, (ns, probe.stdout, probe.stderr)
            assert lab.netns.run(ns, ["sysctl", "-n", "net.ipv4.ip_forward"]).stdout.strip() == "0"
        assert "table inet egresswall_browser" in lab.netns.run(lab.browser, ["nft", "list", "ruleset"]).stdout


def test_packet_filter_rejects_at_once(tmp_path):
    """With the filter on, a direct TCP connect to a lab host is reset and a UDP send fails, both at once."""
    certs = make_lab_certs(tmp_path / "certs", T.CERT_NAMES, [T.PUBLIC_WEB])
    code = (
        "import errno, json, socket, time\n"
        "out = {}\n"
        f"for name, proto, addr in [('tcp', 'tcp', ('{T.PUBLIC_WEB}', 80)), ('udp', 'udp', ('{T.PUBLIC_STUN}', "
        f"{T.STUN_PORT}))]:\n"
        "    t = time.monotonic()\n"
        "    try:\n"
        "        if proto == 'tcp':\n"
        "            socket.create_connection(addr, timeout=3).close()\n"
        "        else:\n"
        "            socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', addr)\n"
        "        out[name] = ['sent', time.monotonic() - t]\n"
        "    except OSError as e:\n"
        "        out[name] = [errno.errorcode.get(e.errno, str(e)), time.monotonic() - t]\n"
        "print(json.dumps(out))\n"
    )
    with ContainmentLab(tmp_path / "run", certs, packet_filter=True, probe_dir=None) as lab:
        result = json.loads(lab.netns.run(lab.browser, [sys.executable, "-c", code], timeout=20).stdout)
        evidence = lab.finish()
    assert result["tcp"][0] == "ECONNREFUSED" and result["tcp"][1] < 1.5, result
    assert result["udp"][0] == "EPERM" and result["udp"][1] < 1.5, result
    assert [p for p in evidence.packets if p.kind != "ARP"] == []  # nothing left the namespace
    assert evidence.net_events == [e for e in evidence.net_events if e["kind"] == "dns"]


def test_interrupted_run_leaves_nothing_behind(tmp_path):
    """SIGTERM in the middle of a run: exit 130, no namespace, no process, no temporary file left."""
    env = {**os.environ, "EGRESSWALL_PYTHON": sys.executable, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([str(SMOKE), "--client", "simple", "--run", "contained"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not _our_namespaces(proc.pid) and proc.poll() is None:
            assert time.monotonic() < deadline, "the lab was never built"
            time.sleep(0.05)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, (proc.returncode, stdout[-2000:], stderr[-2000:])
    assert _our_namespaces(proc.pid) == []
    assert list(tmp_path.iterdir()) == [], list(tmp_path.rglob("*"))[:20]
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert leftovers == [], leftovers
