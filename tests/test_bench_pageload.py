"""The page-load benchmark (``make bench-pageload``) measures complete loads: one round against each target
(no proxy, squid, egresswall) loads every subresource, and each proxy saw exactly the tunnels the
benchmark counts as the browser's connections. No timing is asserted: the figures are the benchmark's."""

from __future__ import annotations

import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "benchmarks"))

import bench_pageload as bench  # noqa: E402
from pagelab import HOSTS, RESOURCES  # noqa: E402

from browser.launch import plan_launch  # noqa: E402

NAMES = {host.name for host in HOSTS}


def test_the_page_has_sixty_subresources_from_twelve_names_on_both_protocols():
    assert len(NAMES) == 12 and len({host.address for host in HOSTS}) == 12
    assert len(RESOURCES) + 1 == 60  # and the WebSocket
    assert {r.kind for r in RESOURCES} == {"css", "js", "png", "font", "xhr"}
    assert {host.http2 for host in HOSTS} == {True, False}


def test_the_direct_browser_keeps_every_containment_switch_but_the_proxy():
    plan = plan_launch("127.0.0.1:9", sandbox=False)
    try:
        options = bench.direct_launch_options(plan, "MAP a.example 127.0.0.110, MAP * ~NOTFOUND")
    finally:
        plan.cleanup()
    assert "proxy" not in options and options["ignore_default_args"] is True
    removed = [a for a in plan.args if a not in options["args"]]
    assert sorted(removed) == ["--proxy-bypass-list=<-loopback>", "--proxy-server=http://127.0.0.1:9"]
    assert options["args"][-2:] == ["--no-proxy-server", "--host-resolver-rules=MAP a.example 127.0.0.110, MAP * "
                                                         "~NOTFOUND"]


def test_nearest_rank_p90():
    assert bench.p90([5.0]) == 5.0
    assert bench.p90([float(i) for i in range(1, 11)]) == 9.0
    assert bench.p90([float(i) for i in range(1, 12)]) == 10.0


def _wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.integration
@pytest.mark.skipif(not (shutil.which("nginx") and shutil.which("squid")), reason="needs nginx-light and squid")
def test_one_round_loads_every_subresource_through_each_target():
    # not pytest's tmp_path: squid drops to its own user and cannot reach a folder under /tmp/pytest-of-root (0700)
    work = tempfile.TemporaryDirectory(prefix="ew-pageload-test-")
    stack = bench.PageLoadStack(Path(work.name))
    try:
        stack.start()
        with bench.Browsers(stack) as browsers:
            loads = bench.run_loads(stack, browsers, rounds=1, warmup=0)
        by_target = {load.target: load for load in loads}
        assert sorted(by_target) == sorted(bench.TARGETS)
        for load in loads:
            assert load.problems(stack.lab) == [], load.target
            assert load.load_ms > 0 and load.connections_opened >= load.connections_used >= 12, load
            assert load.protocols["h2"] > 0 and load.protocols["http/1.1"] > 0, load.protocols
            assert math.isnan(load.proxy_cpu_ms) == (load.target == "direct"), load

        # egresswall decided one CONNECT per connection nginx counted, all allowed, for all twelve names
        decisions = stack.egresswall_decisions()
        assert [d for d in decisions if d["verdict"] != "allow"] == []
        assert {d["host"] for d in decisions} == NAMES
        assert len(decisions) == by_target["egresswall"].connections_opened
        # squid logs a tunnel when it closes: one CONNECT line per connection through it
        squid = by_target["squid"].connections_opened
        assert _wait_for(lambda: sum(" CONNECT " in line for line in stack.squid_log()) == squid), stack.squid_log()
        # (the one other line is the start-up probe that waited for squid's port: connected and closed)
        assert {line.split(" CONNECT ")[1].split(":")[0] for line in stack.squid_log() if " CONNECT " in line} == NAMES
    finally:
        stack.stop()
        work.cleanup()
