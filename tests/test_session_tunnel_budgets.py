"""A session's byte budgets hold inside a passed-through TLS tunnel that stays open.

Bytes are charged to a session when a response or a tunnel ends, and budgets are checked before each request.
A passed-through TLS tunnel carries no request egresswall can see, and a browser keeps one open for a whole
page and more: before this, its bytes were charged only at its close, so a session with ``request_bytes`` (the
bound on what a session may send out, its exfiltration budget) or ``response_bytes`` could move any number
of bytes through one tunnel. The gate's sweep of open session tunnels (every ``SESSION_SWEEP`` seconds, the
one that closes a tunnel whose session ended) now charges what each moved since the last look and closes the
session's open tunnels once it is past a byte budget, on both transports; the closing line says which.
"""

from __future__ import annotations

import ssl
import time

import pytest
from proxyproc import both_transports
from session_client import api, connect, create, token_file
from test_session_end_cuts_tunnels import _closed_within, _get, _tunnel_line
from test_sessions_redis import redis_server  # noqa: F401 (a fixture)

from proxy.gate import SESSION_SWEEP

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("internal_saw_nothing")]

BUDGET = 200_000


def _tunnel(lab, start_proxy, tmp_path, budgets: dict, *more: str):
    proxy = start_proxy(lab.policy_text("session: required\n"), "--admin-token-file", str(token_file(tmp_path)),
                        *more)
    session = create(proxy.admin_port, {"hosts": ["public.lab.example"]}, budgets=budgets)
    sock, status, _, body = connect(proxy, f"public.lab.example:{lab.public_tls.port}", session)
    assert status == 200, body
    tls = ssl.create_default_context(cafile=str(lab.cert_file)).wrap_socket(sock, server_hostname="public.lab.example")
    assert _get(tls, lab, "/small").startswith(b"HTTP/1.1 200")
    assert not _closed_within(tls, SESSION_SWEEP * 2)  # within its budgets: open
    return proxy, session, tls


def _upload(tls, lab, size: int) -> None:
    tls.sendall(f"POST /upload HTTP/1.1\r\nHost: public.lab.example:{lab.public_tls.port}\r\n"
                f"Content-Length: {size}\r\n\r\n".encode() + b"q" * size)
    answer = b""
    while b"bytes" not in answer:
        chunk = tls.recv(65536)
        assert chunk, answer
        answer += chunk
    assert f"got {size} bytes".encode() in answer


@both_transports
@pytest.mark.parametrize("store", ["memory", "redis"])
def test_a_tunnel_that_sends_past_the_request_bytes_budget_is_closed(lab, start_proxy, tmp_path, store, request):
    more = ("--session-store", request.getfixturevalue("redis_server").url) if store == "redis" else ()
    proxy, session, tls = _tunnel(lab, start_proxy, tmp_path, {"request_bytes": BUDGET}, *more)
    with tls:
        _upload(tls, lab, BUDGET + 50_000)
        assert _closed_within(tls, SESSION_SWEEP * 3 + 1), "the tunnel moved past its session's request_bytes"
        before = len(lab.public_tls.requests)
        time.sleep(0.3)
        assert len(lab.public_tls.requests) == before
    line = _tunnel_line(proxy, session)
    assert "session:budget-request-bytes" in line["error"] and "closed the tunnel" in line["error"], line
    assert f"its budget is {BUDGET} bytes" in line["error"]
    assert line["bytes_up"] > BUDGET
    # The next CONNECT of the session is refused by the budget, as a request would be.
    _, status, _, body = connect(proxy, f"public.lab.example:{lab.public_tls.port}", session)
    assert status == 403 and b"session:budget-request-bytes" in body


@both_transports
def test_a_tunnel_that_receives_past_the_response_bytes_budget_is_closed(lab, start_proxy, tmp_path):
    proxy, session, tls = _tunnel(lab, start_proxy, tmp_path, {"response_bytes": BUDGET})
    with tls:
        assert _get(tls, lab, f"/bytes/{BUDGET + 50_000}").startswith(b"HTTP/1.1 200")
        assert _closed_within(tls, SESSION_SWEEP * 3 + 1), "the tunnel moved past its session's response_bytes"
    line = _tunnel_line(proxy, session)
    assert "session:budget-response-bytes" in line["error"], line


@both_transports
def test_a_tunnel_within_its_budgets_stays_open_and_is_charged_once(lab, start_proxy, tmp_path):
    """Charged while open and at the close, never twice: the session's usage is the tunnel's bytes."""
    proxy, session, tls = _tunnel(lab, start_proxy, tmp_path, {"request_bytes": 10 * BUDGET})
    with tls:
        _upload(tls, lab, BUDGET)
        assert not _closed_within(tls, SESSION_SWEEP * 3)
        _upload(tls, lab, 1000)
    line = _tunnel_line(proxy, session)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        status, _, body = api(proxy.admin_port, "GET", f"/v1/sessions/{session['id']}")
        assert status == 200, body
        if body["usage"]["request_bytes"] >= line["bytes_up"]:
            break
        time.sleep(0.1)
    assert body["usage"]["request_bytes"] == line["bytes_up"], (body, line)
    assert body["usage"]["response_bytes"] == line["bytes_down"], (body, line)
