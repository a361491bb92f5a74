"""Review round 23 (workers): what held. ``egresswall run --workers 2`` with the session store in a
redis-server of the test's own (loopback) enforces what one process enforces: an end through the supervisor's API
reaches every worker (new requests and open tunnels), expiry is not revived, a hot reload reaches every worker and
a refused one leaves every worker on the last good policy, a stopped (hung) store fails closed with a reason
and /readyz says so, and the byte budget of tunnels spread over the workers is passed by at most the
documented N - 1 times what was left."""

from __future__ import annotations

import contextlib
import os
import signal
import ssl
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from metrics_page import value
from proxyproc import both_transports
from session_client import api, connect, create, get, token_file
from test_proxy_workers import wait_ready
from test_session_end_cuts_tunnels import _closed_within, _get
from test_sessions_redis import redis_server  # noqa: F401 (a fixture)

from proxy.gate import SESSION_SWEEP
from proxy.sessions.redis_store import TIMEOUT

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("internal_saw_nothing")]


def _pool(lab, start_proxy, tmp_path, redis, extra: str = "session: required\n"):
    proxy = start_proxy(lab.policy_text(extra), "--workers", "2", "--admin-token-file", str(token_file(tmp_path)),
                        "--session-store", redis.url)
    wait_ready(proxy)
    return proxy


def _tls_tunnel(proxy, lab, session) -> ssl.SSLSocket:
    sock, status, _, body = connect(proxy, f"public.lab.example:{lab.public_tls.port}", session)
    assert status == 200, body
    return ssl.create_default_context(cafile=str(lab.cert_file)).wrap_socket(sock, server_hostname="public.lab.example")


@both_transports
def test_an_end_through_the_supervisor_reaches_every_worker_holds(lab, start_proxy, tmp_path, redis_server):  # noqa: F811
    """Six tunnels (the kernel spreads them over both workers) and kept requests: after DELETE every tunnel is
    closed within the sweep, and every new request, on either worker, gets 407."""
    proxy = _pool(lab, start_proxy, tmp_path, redis_server)
    session = create(proxy.admin_port, {"hosts": ["public.lab.example"]})
    url = f"http://public.lab.example:{lab.public.port}/end"
    tunnels = [_tls_tunnel(proxy, lab, session) for _ in range(6)]
    try:
        for tls in tunnels:
            assert _get(tls, lab, "/before").startswith(b"HTTP/1.1 200")
        assert api(proxy.admin_port, "DELETE", f"/v1/sessions/{session['id']}")[0] == 204
        started = time.monotonic()
        for tls in tunnels:
            assert _closed_within(tls, max(0.1, 3 * SESSION_SWEEP + TIMEOUT - (time.monotonic() - started)))
    finally:
        for tls in tunnels:
            tls.close()
    assert [get(proxy, url, session)[0] for _ in range(12)] == [407] * 12
    text = proxy.admin("/metrics")[1]
    assert value(text, "egresswall_sessions_ended_total") == 1
    assert value(text, "egresswall_session_refusals_total", reason="session:credentials") >= 12


@both_transports
def test_an_expired_session_stays_expired_on_every_worker_holds(lab, start_proxy, tmp_path, redis_server):  # noqa: F811
    """ttl 2: before, both workers admit it; after, both refuse it (session:expired) and the API will not extend it;
    a request counted on one worker after expiry does not bring the counters or the record back."""
    proxy = _pool(lab, start_proxy, tmp_path, redis_server)
    session = create(proxy.admin_port, {"hosts": ["public.lab.example"]}, ttl=2, budgets={"requests": 100})
    url = f"http://public.lab.example:{lab.public.port}/expiry"
    assert [get(proxy, url, session)[0] for _ in range(4)] == [200] * 4
    time.sleep(2.2)
    answers = [get(proxy, url, session) for _ in range(8)]
    assert [(s, h.get("x-egresswall-rule")) for s, h, _ in answers] == [(403, "session:expired")] * 8
    status, _, body = api(proxy.admin_port, "PATCH", f"/v1/sessions/{session['id']}", {"ttl": 600})
    assert status == 409 and body["error"] == "expired"
    assert [get(proxy, url, session)[0] for _ in range(4)] == [403] * 4
    assert api(proxy.admin_port, "GET", "/v1/sessions")[2]["sessions"] == []
    assert api(proxy.admin_port, "GET", f"/v1/sessions/{session['id']}")[2]["usage"]["requests"] == 4


@both_transports
def test_a_reload_reaches_every_worker_and_a_refused_one_leaves_each_on_the_last_good_policy_holds(
        lab, start_proxy, tmp_path, redis_server):  # noqa: F811
    """Sessions on but not required; a reload that requires them reaches both workers (16 connections, all 407),
    one that is refused leaves both on it, and the metrics count one success and one failure per worker."""
    proxy = _pool(lab, start_proxy, tmp_path, redis_server, extra="")
    url = f"http://public.lab.example:{lab.public.port}/reload"
    assert [get(proxy, url)[0] for _ in range(8)] == [200] * 8
    proxy.policy_path.write_text(lab.policy_text("session: required\n"))
    proxy.signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and value(proxy.admin("/metrics")[1], "egresswall_policy_reloads_total",
                                                result="success") < 2:
        time.sleep(0.1)
    assert [get(proxy, url)[0] for _ in range(16)] == [407] * 16
    proxy.policy_path.write_text(lab.policy_text("hosts:\n  allwo: []\n"))
    proxy.signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and value(proxy.admin("/metrics")[1], "egresswall_policy_reloads_total",
                                                result="failure") < 2:
        time.sleep(0.1)
    text = proxy.admin("/metrics")[1]
    assert value(text, "egresswall_policy_reloads_total", result="failure") == 2
    assert value(text, "egresswall_policy_loaded") == 1
    assert [get(proxy, url)[0] for _ in range(16)] == [407] * 16
    session = create(proxy.admin_port, {"hosts": ["public.lab.example"]})
    assert [get(proxy, url, session)[0] for _ in range(8)] == [200] * 8


@both_transports
def test_a_hung_store_fails_closed_on_every_worker_with_a_reason_holds(lab, start_proxy, tmp_path,
                                                                       redis_server):  # noqa: F811
    """redis-server stopped (SIGSTOP: it accepts, answers nothing): each request under a session is refused 503
    session:store-unavailable within about the store's timeout, the API answers 503, /readyz says so, and all
    comes back when the store does."""
    proxy = _pool(lab, start_proxy, tmp_path, redis_server)
    session = create(proxy.admin_port, {"hosts": ["public.lab.example"]})
    url = f"http://public.lab.example:{lab.public.port}/hung"
    seen = len(lab.public.requests)
    os.kill(redis_server.process.pid, signal.SIGSTOP)
    try:
        for _ in range(6):
            asked = time.monotonic()
            status, headers, _ = get(proxy, url, session)
            assert time.monotonic() - asked < 4 * TIMEOUT + 1
            assert (status, headers.get("x-egresswall-rule")) == (503, "session:store-unavailable"), headers
            assert "cannot be reached" in headers.get("x-egresswall-reason", ""), headers
        status, _, body = api(proxy.admin_port, "POST", "/v1/sessions", {"grants": {"hosts": ["public.lab.example"]}})
        assert status == 503 and body["error"] == "unavailable"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proxy.admin("/readyz")[0] != 503:
            time.sleep(0.2)
        status, text = proxy.admin("/readyz")
        assert status == 503 and "session store" in text, text
    finally:
        os.kill(redis_server.process.pid, signal.SIGCONT)
    assert len(lab.public.requests) == seen
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and proxy.admin("/readyz")[0] != 200:
        time.sleep(0.2)
    assert proxy.admin("/readyz")[0] == 200
    assert [get(proxy, url, session)[0] for _ in range(4)] == [200] * 4


BUDGET = 200_000


@both_transports
def test_tunnels_on_both_workers_pass_a_byte_budget_by_at_most_n_minus_one_times_it_holds(
        lab, start_proxy, tmp_path, redis_server):  # noqa: F811
    """README: "each worker (and replica) keeps its own, so N of them together can pass a budget by at most N - 1
    times what was left at their last looks". Six tunnels spread over two workers each try to send 90% of the
    budget at once: what they relayed together is at most 2 x the budget."""
    proxy = _pool(lab, start_proxy, tmp_path, redis_server)
    session = create(proxy.admin_port, {"hosts": ["public.lab.example"]}, budgets={"request_bytes": BUDGET})
    tunnels = [_tls_tunnel(proxy, lab, session) for _ in range(6)]

    def send(tls: ssl.SSLSocket) -> None:
        size = BUDGET * 9 // 10
        with contextlib.suppress(OSError):
            tls.sendall(f"POST /upload HTTP/1.1\r\nHost: public.lab.example:{lab.public_tls.port}\r\n"
                        f"Content-Length: {size}\r\n\r\n".encode() + b"q" * size)
            _closed_within(tls, 3 * SESSION_SWEEP + 2)

    try:
        with ThreadPoolExecutor(max_workers=6) as pool:
            list(pool.map(send, tunnels))
    finally:
        for tls in tunnels:
            tls.close()
    deadline = time.monotonic() + 5
    lines: list[dict] = []
    while time.monotonic() < deadline:
        lines = [r for r in proxy.audit() if r["event"] == "tunnel" and r.get("session") == session["id"]]
        if len(lines) == 6:
            break
        time.sleep(0.1)
    assert len(lines) == 6, lines
    assert sum(r["bytes_up"] or 0 for r in lines) <= 2 * BUDGET, [r["bytes_up"] for r in lines]
    assert any("session:budget-request-bytes" in (r["error"] or "") for r in lines), lines
