"""A passed-through TLS tunnel opened under a session is closed once the session ends or expires.

Requests inside a tunnel egresswall can read are each checked against the session as it is then; the bytes
of a passed-through TLS tunnel are not requests, so before this a tunnel opened under a session kept moving
after the session was ended (DELETE) or expired, for as long as it was not silent. The gate looks at the
sessions of open tunnels every ``SESSION_SWEEP`` seconds and closes those whose session is over, on both
transports, with a closing line that says why.
"""

from __future__ import annotations

import contextlib
import ssl
import time

import pytest
from proxyproc import both_transports
from session_client import api, connect, create, token_file
from test_sessions_redis import redis_server  # noqa: F401 (a fixture)

from proxy.gate import SESSION_SWEEP

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("internal_saw_nothing")]


def _get(tls: ssl.SSLSocket, lab, path: str) -> bytes:
    """One kept-alive GET inside the tunnel; its whole response (the lab origin sends a Content-Length)."""
    tls.sendall(f"GET {path} HTTP/1.1\r\nHost: public.lab.example:{lab.public_tls.port}\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = tls.recv(65536)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n") if line.lower().startswith(
        b"content-length:")))
    while len(body) < length:
        chunk = tls.recv(65536)
        assert chunk, data
        body += chunk
    return head


def _closed_within(tls: ssl.SSLSocket, seconds: float) -> bool:
    """The tunnel was closed under the client within ``seconds`` (end of stream, or a reset)."""
    tls.settimeout(seconds)
    try:
        return tls.recv(65536) == b""
    except TimeoutError:
        return False
    except (ssl.SSLError, OSError):
        return True


def _open_tunnel(lab, start_proxy, tmp_path, **spec):
    proxy = start_proxy(lab.policy_text("session: required\n"), "--admin-token-file", str(token_file(tmp_path)))
    session = create(proxy.admin_port, {"hosts": ["public.lab.example"]}, **spec)
    sock, status, _, body = connect(proxy, f"public.lab.example:{lab.public_tls.port}", session)
    assert status == 200, body
    context = ssl.create_default_context(cafile=str(lab.cert_file))
    tls = context.wrap_socket(sock, server_hostname="public.lab.example")
    assert _get(tls, lab, "/before").startswith(b"HTTP/1.1 200")
    return proxy, session, tls


def _tunnel_line(proxy, session) -> dict:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        lines = [r for r in proxy.audit() if r["event"] == "tunnel" and r.get("session") == session["id"]]
        if lines:
            return lines[0]
        time.sleep(0.1)
    raise AssertionError(proxy.audit())


@both_transports
def test_ending_a_session_closes_its_open_tls_tunnel(lab, start_proxy, tmp_path):
    proxy, session, tls = _open_tunnel(lab, start_proxy, tmp_path)
    with tls:
        assert not _closed_within(tls, SESSION_SWEEP * 2)  # open while the session holds
        assert _get(tls, lab, "/still").startswith(b"HTTP/1.1 200")
        status, _, body = api(proxy.admin_port, "DELETE", f"/v1/sessions/{session['id']}")
        assert status in (200, 204), body
        before = len(lab.public_tls.requests)
        assert _closed_within(tls, SESSION_SWEEP * 3 + 1), "the tunnel outlived its session"
        with contextlib.suppress(OSError):
            tls.sendall(f"GET /after HTTP/1.1\r\nHost: public.lab.example:{lab.public_tls.port}\r\n\r\n".encode())
        time.sleep(0.3)
        assert "/after" not in [p for _, p, _ in lab.public_tls.requests[before:]]
    line = _tunnel_line(proxy, session)
    assert "has ended" in line["error"] and "closed the tunnel" in line["error"], line


@both_transports
def test_a_session_that_expires_closes_its_open_tls_tunnel(lab, start_proxy, tmp_path):
    proxy, session, tls = _open_tunnel(lab, start_proxy, tmp_path, ttl=3)
    with tls:
        assert _closed_within(tls, 3 + SESSION_SWEEP * 3 + 1), "the tunnel outlived its session"
    line = _tunnel_line(proxy, session)
    assert "expired" in line["error"], line


@both_transports
def test_a_session_the_sweep_cannot_read_does_not_stop_it_cutting_the_others(lab, start_proxy, tmp_path,
                                                                             redis_server):  # noqa: F811
    """One session's look fails with something other than an unreachable store: here its record in the shared
    store carries a budget this egresswall does not know (written by a newer one, in a rolling upgrade). Before,
    the exception ended the sweep's task, and no tunnel of any session was cut again until another session
    tunnel opened: the next session that ended kept its tunnel moving."""
    import json

    proxy = start_proxy(lab.policy_text("session: required\n"), "--admin-token-file", str(token_file(tmp_path)),
                        "--session-store", redis_server.url)
    opened = []
    for _ in range(2):
        session = create(proxy.admin_port, {"hosts": ["public.lab.example"]})
        sock, status, _, body = connect(proxy, f"public.lab.example:{lab.public_tls.port}", session)
        assert status == 200, body
        tls = ssl.create_default_context(cafile=str(lab.cert_file)).wrap_socket(
            sock, server_hostname="public.lab.example")
        assert _get(tls, lab, "/before").startswith(b"HTTP/1.1 200")
        opened.append((session, tls))
    (unreadable, first), (ended, second) = opened
    key = f"egresswall:session:{unreadable['id']}"
    record = json.loads(redis_server.command("GET", key).split(b"\r\n")[1])
    record["spec"]["budgets"]["websocket_bytes"] = 1000
    assert redis_server.command("SET", key, json.dumps(record), "KEEPTTL").startswith(b"+OK")
    with first, second:
        assert not _closed_within(second, SESSION_SWEEP * 2)  # the sweep has looked at the unreadable one
        status, _, body = api(proxy.admin_port, "DELETE", f"/v1/sessions/{ended['id']}")
        assert status in (200, 204), body
        assert _closed_within(second, SESSION_SWEEP * 3 + 1), "the ended session's tunnel was not cut"
    line = _tunnel_line(proxy, ended)
    assert "has ended" in line["error"] and "closed the tunnel" in line["error"], line
