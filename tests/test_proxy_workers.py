"""``egresswall run --workers N``: one port, one audit log, summed metrics, restarts, clean stop."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.integration


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def decisions_total(proxy) -> float:
    _, body = proxy.admin("/metrics")
    family = {f.name: f for f in text_string_to_metric_families(body)}["egresswall_decisions"]
    return sum(s.value for s in family.samples)


def wait_ready(proxy, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proxy.admin("/readyz")[0] == 200:
            return
        time.sleep(0.2)
    raise AssertionError("the worker pool did not become ready")


def test_workers_share_one_port_one_log_and_summed_metrics(lab, start_proxy):
    proxy = start_proxy(lab.policy_text(), "--workers", "2")
    wait_ready(proxy)
    assert len(children(proxy.process.pid)) == 2
    statuses = [proxy.get(f"http://{host}:{lab.public.port}/w{i}")[0]
                for i, host in enumerate(["public.lab.example", "internal.lab.example"] * 10)]
    assert statuses == [200, 403] * 10
    time.sleep(0.3)
    records = proxy.audit()
    assert sorted(r["path"] for r in records if r["event"] == "decision") == sorted(f"/w{i}" for i in range(20))
    assert decisions_total(proxy) == 20

    # A worker that dies is restarted, and the counters it had do not vanish from the sum.
    os.kill(children(proxy.process.pid)[0], signal.SIGKILL)
    time.sleep(1.0)
    wait_ready(proxy)
    assert len(children(proxy.process.pid)) == 2
    assert decisions_total(proxy) >= 20
    assert proxy.get(f"http://public.lab.example:{lab.public.port}/after")[0] == 200

    pids = children(proxy.process.pid)
    proxy.signal(signal.SIGTERM)
    assert proxy.process.wait(20) == 0
    for pid in pids:  # no worker outlives the supervisor
        status = Path(f"/proc/{pid}/status")
        assert not status.exists() or "zombie" in status.read_text()


def test_abbreviated_options_are_refused(tmp_path):
    import sys

    result = subprocess.run([sys.executable, "-m", "proxy.cli", "run", "--no-adm"], capture_output=True, text=True,
                            timeout=60, cwd=Path(__file__).resolve().parent.parent)
    assert result.returncode == 2 and "unrecognized arguments: --no-adm" in result.stderr
