"""Review round 23 (workers): ``egresswall run --workers N`` (and the Redis session store) must enforce
exactly what one process enforces. The tests here are the findings: each fails on the tree it was written
against and says, in its docstring, what should hold and why."""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import pytest
from proxyproc import both_transports
from session_client import create, get, token_file
from test_proxy_workers import children, wait_ready
from test_sessions_redis import redis_server  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("internal_saw_nothing")]


def _closed_port() -> int:
    """A loopback port nothing listens on (an upstream proxy that is never reached: the requests are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _statuses(proxy, url: str, count: int = 16, session: dict | None = None) -> list[int]:
    """``count`` requests, each on its own connection (the kernel spreads them over the workers)."""
    return [get(proxy, url, session)[0] for _ in range(count)]


@both_transports
def test_a_restarted_worker_does_not_take_up_a_policy_the_reload_refused(lab, start_proxy):
    """README (Chaining to an upstream proxy, Limits): "A reload cannot change `upstream` (mitmproxy's mode is fixed
    at start): the reload is refused with that reason and the last good policy stays", and "`--workers N` with an
    upstream ... refused at start". The threat brief: a refused reload leaves every worker on the last good policy,
    and a worker that dies must not leave the proxy half-enforcing.

    Here the edit adds an upstream (and a deny rule for public.lab.example). Every worker refuses the reload and
    keeps the last good policy, which lets public.lab.example through. A worker that then dies is restarted by the
    supervisor, and its first load is a *start*, where a changed upstream is no reason to refuse: the restarted
    worker runs the refused policy (in upstream mode, which ``--workers`` refuses at start), while its sibling keeps
    the last good one. The same request is then answered 200 or 403 by which worker the kernel hands it to.

    Expected: the restarted worker refuses to start on a policy the pool refused (it stays down, saying why, as
    for an invalid file: ``test_a_worker_that_cannot_restart_says_why``), or starts on the last good policy; never
    a pool split between two policies. Fix: give a restarted worker the pool's rule for a first load — in
    ``proxy/reload.py`` ``PolicyHolder.__init__`` (``settled_only``/``restarted``) apply the same
    ``upstream`` comparison ``reload`` makes (against ``RunConfig``'s upstream at pool start, passed by
    ``proxy/workers.py`` ``Supervisor._supervise``), or have ``proxy/cli/worker.py`` refuse an upstream when
    ``worker_count > 1`` as ``proxy/cli/run.py:115`` does at start."""
    proxy = start_proxy(lab.policy_text(), "--workers", "2")
    wait_ready(proxy)
    url = f"http://public.lab.example:{lab.public.port}/split"
    assert _statuses(proxy, url) == [200] * 16
    proxy.policy_path.write_text(lab.policy_text(
        f"upstream:\n  proxy: http://127.0.0.1:{_closed_port()}\n  resolution: upstream\n"
        "hosts:\n  deny: [public.lab.example]\n"))
    proxy.signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and "the last reload was refused" not in proxy.admin("/readyz")[1]:
        time.sleep(0.1)
    assert "upstream" in proxy.admin("/readyz")[1]
    assert _statuses(proxy, url) == [200] * 16  # the last good policy, on every worker

    victim = children(proxy.process.pid)[0]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (victim in children(proxy.process.pid)
                                           or len(children(proxy.process.pid)) < 2
                                           or proxy.admin("/readyz")[0] != 200):
        if "exited with 2 (" in proxy.stderr:
            break  # the restarted worker refused the policy: the pool stays on the last good one
        time.sleep(0.2)
    statuses = _statuses(proxy, url, 24)
    assert statuses == [200] * 24, (
        f"the pool enforces two policies at once after a worker restart: {statuses}; "
        f"stderr: {proxy.stderr[-1500:]}")


@both_transports
@pytest.mark.parametrize("garbage", ["record", "usage"])
def test_a_store_answering_garbage_is_refused_503_with_a_reason(lab, start_proxy, tmp_path, redis_server,  # noqa: F811
                                                                garbage):
    """README (Sessions, The store): "If the store cannot be reached, requests that present a session are refused
    with `503 session:store-unavailable` (fail closed)", and `proxy/sessions/redis_store.py`: "Every Redis error is
    ``StoreUnavailable`` (fail closed)". The threat brief: a redis that answers garbage must make the proxy fail
    closed *with a readable reason*.

    The store here answers, but with what egresswall did not write: the session's record is not JSON (``record``),
    or its usage counter is not a number (``usage``). Expected: a 503 ``session:store-unavailable`` (or a 403
    naming the session) with a reason in ``X-Egresswall-Reason`` and a decision line in the audit log, as for a
    store that does not answer; the request never reaches the origin. Fix: in ``proxy/sessions/redis_store.py``
    treat a value that cannot be decoded (``session_from_record``'s ValueError/KeyError/TypeError, ``int()`` of a
    counter) as ``StoreUnavailable`` ("the session store answered a value egresswall cannot read")."""
    proxy = start_proxy(lab.policy_text("session: required\n"), "--workers", "2", "--admin-token-file",
                        str(token_file(tmp_path)), "--session-store", redis_server.url)
    wait_ready(proxy)
    session = create(proxy.admin_port, {"hosts": ["public.lab.example"]}, budgets={"requests": 100})
    url = f"http://public.lab.example:{lab.public.port}/garbage-{garbage}"
    assert get(proxy, f"http://public.lab.example:{lab.public.port}/before")[0] == 407
    assert get(proxy, f"http://public.lab.example:{lab.public.port}/before", session)[0] == 200
    if garbage == "record":
        assert redis_server.command("SET", f"egresswall:session:{session['id']}", "not json {").startswith(b"+OK")
    else:
        assert redis_server.command("HSET", f"egresswall:session:{session['id']}:usage", "requests",
                                    "many").startswith(b":")
    seen = len(lab.public.requests)
    for _ in range(4):  # on either worker
        status, headers, body = get(proxy, url, session)
        assert status in (503, 403), (status, headers.get("x-egresswall-reason"), body[:300])
        assert headers.get("x-egresswall-rule", "").startswith("session:"), (status, headers, body[:300])
        assert headers.get("x-egresswall-reason"), headers
    assert len(lab.public.requests) == seen
    time.sleep(0.3)
    lines = [r for r in proxy.decisions() if r.get("path") == f"/garbage-{garbage}"]
    assert len(lines) == 4 and all(r["verdict"] == "refuse" for r in lines), json.dumps(lines)[:800]


@both_transports
def test_a_garbage_session_record_never_lets_the_request_through(lab, start_proxy, tmp_path, redis_server):  # noqa: F811
    """The threat brief: a store that answers garbage must make the proxy fail CLOSED, never allow. README
    (Sessions): "A session only narrows: a request must pass the policy ... *and* the session".

    On mitmproxy's path the session check's exception (the record is not JSON: ``session_from_record`` raises
    ``JSONDecodeError`` inside ``SessionService.identify``) escapes ``DecisionAddon.requestheaders``
    (proxy/addons/decision.py:131); mitmproxy logs "Addon error" and carries the flow on, and the connect guard
    (proxy/addons/pinning.py:97-109, "No decision prepared this connect ... decide now") decides it as a CONNECT by
    the *policy alone*, with no session. Where the origin's port is also a CONNECT port (here
    ``connect_plain``), the policy allows it and the request reaches the origin with no decision line and no
    session check: the store's garbage opened the session's restriction. (On the fast path the connection is
    dropped without an answer or a line.)

    Expected: 503 ``session:store-unavailable`` with a reason; the origin never sees the request. Fix: make
    undecodable store values ``StoreUnavailable`` in proxy/sessions/redis_store.py (``get``, ``usage``,
    ``judge``, ``charge``), and, as defence in depth, have ``DecisionAddon.requestheaders`` (and the front's
    ``decide_request``/``decide_connect`` callers) answer an unexpected exception with a refusal (5xx, a decision
    line) instead of letting the flow go on undecided; ``pinning.server_connect``'s late decision must never
    stand in for a request that had a session to check."""
    proxy = start_proxy(lab.policy_text("session: required\n", connect_plain=True), "--workers", "2",
                        "--admin-token-file", str(token_file(tmp_path)), "--session-store", redis_server.url)
    wait_ready(proxy)
    # An ungranted host: only the session refuses it, the policy allows it.
    session = create(proxy.admin_port, {"hosts": ["other.lab.example"]})
    url = f"http://public.lab.example:{lab.public.port}/garbage-open"
    status, headers, _ = get(proxy, url, session)
    assert (status, headers.get("x-egresswall-rule")) == (403, "session:not-granted")
    assert redis_server.command("SET", f"egresswall:session:{session['id']}", "not json {").startswith(b"+OK")
    answers = [get(proxy, url, session) for _ in range(4)]
    reached = [p for _, p, _ in lab.public.requests].count("/garbage-open")
    assert reached == 0, (f"the origin got {reached} request(s) that the session does not grant: "
                          f"{[(s, h.get('x-egresswall-reason')) for s, h, _ in answers]}")
    assert all(s == 503 for s, _, _ in answers), [(s, h.get("x-egresswall-reason")) for s, h, _ in answers]
