"""Load, shortened for the test run (``make soak`` runs 1,000 clients for a minute and prints figures):
concurrent clients on loopback mixing allowed and refused requests and CONNECT tunnels.

* every answer is the policy's answer, and the internal stand-ins see nothing;
* the audit log has exactly one well-formed decision line per request;
* file descriptors return to their idle count and memory stays near its idle level afterwards;
* caps hold: with a total and a per-client cap set, 503 and 429 appear, and the upstream never holds
  more requests at once than the caps let through;
* ``kill -9`` in the middle of it leaves a log in which every line is whole JSON.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest
from audit_watch import open_fds, rss_kib
from loadgen import CAPS, GREEDY, LoadLab, audit_matches, most_held_at_once, read_audit, run_load, wrong_answers
from metrics_page import value
from proxyproc import ProxyProcess

pytestmark = pytest.mark.integration

CLIENTS, SECONDS = 200, 10


@pytest.fixture(scope="module")
def load_lab(tmp_path_factory):
    lab = LoadLab(tmp_path_factory.mktemp("load-cert"))
    yield lab
    lab.close()


@pytest.fixture
def run_proxy(load_lab, tmp_path):
    started: list[ProxyProcess] = []

    def start(limits: str = "") -> ProxyProcess:
        policy = tmp_path / f"policy-{len(started)}.yaml"
        policy.write_text(load_lab.policy_text(limits))
        proxy = ProxyProcess(["--policy", str(policy)], tmp_path / f"audit-{len(started)}.jsonl")
        started.append(proxy)
        return proxy

    before = load_lab.internal_connections()
    yield start
    for proxy in started:
        proxy.stop()
        leaks = [e for e in proxy.outbound() if not e["host"].startswith("127.")]
        assert not leaks, f"the proxy tried to connect outside the lab: {leaks}"
        assert {e["host"] for e in proxy.outbound()} <= {"127.0.0.2"}, "a connect went to a refused address"
    assert load_lab.internal_connections() == before, "an internal stand-in received a connection"


def _idle(proxy: ProxyProcess, load_lab: LoadLab) -> tuple[int, int]:
    """fds and RSS (KiB) once the proxy has served a few requests and every connection has closed."""
    for i in range(5):
        assert proxy.get(f"http://public.lab.example:{load_lab.http.port}/warm{i}")[0] == 200
    _settle(proxy)
    return open_fds(proxy.process.pid), rss_kib(proxy.process.pid)


def _settle(proxy: ProxyProcess, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, body = proxy.admin("/metrics")
        if value(body, "egresswall_open_connections") == 0 and value(body, "egresswall_open_tunnels") == 0:
            time.sleep(0.5)  # the last sockets close just after the counters drop
            return
        time.sleep(0.1)
    gauges = [line for line in body.splitlines() if line.startswith("egresswall_open")]
    raise AssertionError(f"connections did not close after the load: {gauges}")


def test_mixed_load_enforces_logs_every_request_and_returns_to_idle(load_lab, run_proxy):
    """Two rounds of the same load. File descriptors go back to their idle count after each. RSS does
    not go back to the idle figure (CPython keeps freed memory for reuse rather than returning it), so
    "returns to idle" is judged as: the second round, as heavy as the first, does not raise it further
    (nothing accumulates), and the high-water mark stays within a bound."""
    proxy = run_proxy()
    fds_idle, rss_idle = _idle(proxy, load_lab)
    rounds = []
    for seed in (1, 2):
        result = asyncio.run(run_load((proxy.host, proxy.port), load_lab, CLIENTS, SECONDS / 2, seed=seed))
        _settle(proxy)
        rounds.append((result, open_fds(proxy.process.pid), rss_kib(proxy.process.pid)))
    result = rounds[0][0]
    result.sent += rounds[1][0].sent

    assert len(result.sent) > 300, f"only {len(result.sent)} requests in {SECONDS}s"
    assert wrong_answers(result) == []
    assert not CAPS & set(result.statuses()), "no cap is near in this run"
    unanswered = [s for s in result.sent if s.status is None]
    assert len(unanswered) <= len(result.sent) // 100, unanswered[:5]
    by_kind = result.by_kind()
    assert by_kind["http-allowed"][200] and by_kind["tunnel-allowed"][200] and by_kind["http-internal"][403]

    records, _ = read_audit(proxy.log_path)
    audit_matches(records, result)
    for _, fds_after, _ in rounds:
        assert fds_after <= fds_idle + 2, f"file descriptors: {fds_idle} idle, {fds_after} after a round"
    (_, _, rss_first), (_, _, rss_second) = rounds
    assert rss_first <= rss_idle + 96 * 1024, f"RSS: {rss_idle} KiB idle, {rss_first} KiB after the first round"
    assert rss_second <= rss_first + 16 * 1024, f"RSS grew from {rss_first} to {rss_second} KiB in round two"


def _capped_run(load_lab, run_proxy, limits: str, greedy: int):
    proxy = run_proxy(limits)
    for upstream in (load_lab.http, load_lab.tls):
        upstream.held.clear()
        # An allowed request holds its connection for 0.3 s, so 200 clients keep well over the cap open
        # whatever the machine's pace: with 0.02 s a fast proxy served them before the cap was reached
        # (a CI run saw no 503 at all).
        upstream.delay = 0.3
    try:
        result = asyncio.run(run_load((proxy.host, proxy.port), load_lab, CLIENTS, 4, greedy=greedy))
    finally:
        for upstream in (load_lab.http, load_lab.tls):
            upstream.delay = 0.02
    assert wrong_answers(result) == []
    records, _ = read_audit(proxy.log_path)
    audit_matches(records, result)  # cap refusals have their decision lines too
    return result, records


def test_total_cap_holds_under_load(load_lab, run_proxy):
    cap = 100
    result, records = _capped_run(load_lab, run_proxy, f"limits:\n  max_connections: {cap}\n", greedy=0)
    assert result.statuses()[503] and result.statuses()[200], result.statuses()
    assert 0 < most_held_at_once([load_lab.http, load_lab.tls]) <= cap
    assert sum(1 for r in records if r["event"] == "decision" and r["rule"] == "limits.max_connections") >= \
        result.statuses()[503]


def test_per_client_cap_holds_under_load(load_lab, run_proxy):
    cap = 20
    result, records = _capped_run(load_lab, run_proxy, f"limits:\n  max_connections_per_client: {cap}\n",
                                  greedy=2 * cap)
    assert result.statuses()[429] and result.statuses()[200], result.statuses()
    assert 0 < most_held_at_once([load_lab.http, load_lab.tls], GREEDY) <= cap
    capped = [r for r in records if r["event"] == "decision" and r["rule"] == "limits.max_connections_per_client"]
    assert {r["client"] for r in capped} == {GREEDY} and len(capped) >= result.statuses()[429]


def test_kill_9_mid_load_leaves_only_whole_lines(load_lab, run_proxy):
    proxy = run_proxy()
    stop = threading.Event()
    result = {}

    def load() -> None:
        result["load"] = asyncio.run(run_load((proxy.host, proxy.port), load_lab, 100, 30, timeout=5, stop=stop))

    thread = threading.Thread(target=load)
    thread.start()
    time.sleep(3)
    proxy.process.send_signal(signal.SIGKILL)
    proxy.process.wait(10)
    time.sleep(0.5)  # let clients meet the dead proxy
    stop.set()
    thread.join(30)
    records, lines = read_audit(proxy.log_path)  # raises on a line that is not whole JSON
    assert lines > 50 and len(records) == lines
    assert any(s.status is None for s in result["load"].sent), "the load did not outlive the proxy"
