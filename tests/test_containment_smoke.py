"""The containment smoke test, end to end: ``ci/containment-smoke --negative`` as a user runs it.

The probe page runs in the contained Chromium in the namespace lab (ci/README.md). The positive runs
(packet filter on; packet filter off, so the browser's flags alone are tested) must pass; each negative
run (the policy replaced by allow-everything; ``<-loopback>`` left out; the WebRTC policy left out; each
with the packet filter off) must be reported as a failure by the check that catches it. The whole
command must finish within five minutes and leave no namespace behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from lab_util import PREFIX, lab_skip_reason, list_namespaces

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "ci" / "containment-smoke"
sys.path.insert(0, str(ROOT / "ci"))

from containment import topology as T  # noqa: E402
from containment.smoke import NEGATIVE_RUNS, POSITIVE_RUNS, probe_routes  # noqa: E402

pytestmark = [pytest.mark.lab, pytest.mark.integration]
BUDGET = 300  # seconds, positive and negative runs together (the acceptance)


def _skip_reason() -> str | None:
    reason = lab_skip_reason("nft", "tcpdump")
    if reason:
        return reason
    if not (ROOT / "browser" / "probe" / "__main__.py").exists():
        return "the probe page (browser/probe/) is not there"
    try:
        from browser.launch import find_chromium

        find_chromium()
    except Exception as err:  # noqa: BLE001 - any reason Chromium is missing is a reason to skip
        return f"no Chromium: {err}"
    return None


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("smoke")
    env = {**os.environ, "EGRESSWALL_PYTHON": sys.executable}
    started = time.monotonic()
    proc = subprocess.Popen([str(SMOKE), "--negative", "--json", str(out / "results.json")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=2 * BUDGET)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the command tears its lab down on SIGTERM
        output, _ = proc.communicate(timeout=60)
        pytest.fail(f"the smoke test did not finish in {2 * BUDGET} s:\n{output[-5000:]}")
    seconds = time.monotonic() - started
    print(output)
    results_file = out / "results.json"
    assert results_file.exists(), output[-5000:]
    results = {r["run"]: r for r in json.loads(results_file.read_text())}
    return {"returncode": proc.returncode, "output": output, "seconds": seconds, "results": results,
            "pid": proc.pid}


def test_the_command_passes(smoke):
    assert smoke["returncode"] == 0, smoke["output"][-6000:]
    assert "containment smoke test: PASSED" in smoke["output"]


@pytest.mark.parametrize("name", [s.name for s in POSITIVE_RUNS])
def test_positive_run_passes(smoke, name):
    result = smoke["results"][name]
    assert result["error"] is None, result["error"]
    assert result["failed_checks"] == [], result["failed_checks"]


@pytest.mark.parametrize("spec", NEGATIVE_RUNS, ids=[s.name for s in NEGATIVE_RUNS])
def test_negative_run_is_reported_as_a_failure_by_its_check(smoke, spec):
    result = smoke["results"][spec.name]
    assert result["error"] is None, result["error"]
    assert spec.catches in result["failed_checks"], result["failed_checks"]
    assert result["as_expected"]


def test_table_names_every_route_and_target(smoke):
    rows = smoke["results"]["contained"]["rows"]
    routes = {row["route"] for row in rows}
    assert set(probe_routes()) <= routes, set(probe_routes()) - routes
    assert {t.url for t in T.TARGETS} <= {row["target"] for row in rows}
    for row in rows:  # every row says what the browser, the proxy, the stand-ins and the capture saw
        assert row["browser"] and row["verdict"] and row["standins"] and row["capture"], row


def test_whole_smoke_test_within_five_minutes(smoke):
    assert smoke["seconds"] < BUDGET, f"{smoke['seconds']:.0f} s"


def test_nothing_left_behind(smoke):
    assert [ns for ns in list_namespaces() if ns.startswith(f"{PREFIX}-{smoke['pid']}-")] == []
