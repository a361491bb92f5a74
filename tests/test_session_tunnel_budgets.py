"""A session's byte budgets hold inside a passed-through TLS tunnel that stays open.

Bytes are charged to a session when a response or a tunnel ends, and budgets are checked before each request.
A passed-through TLS tunnel carries no request egresswall can see, and a browser keeps one open for a whole
page and more: before this, its bytes were charged only at its close, so a session with ``request_bytes`` (the
bound on what a session may send out, its exfiltration budget) or ``response_bytes`` could move any number
of bytes through one tunnel. The gate's sweep of open session tunnels (every ``SESSION_SWEEP`` seconds, the
one that closes a tunnel whose session ended) now charges what each moved since the last look and closes the
session's open tunnels once it is past a byte budget, on both transports; the closing line says which. Between
its looks each relay takes every chunk from the session's allowance (proxy/byte_allowance.py) before relaying
it, so no chunk that would pass a budget is relayed at all.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import time

import pytest
from hostile import _Server
from proxyproc import both_transports
from session_client import api, connect, create, get, token_file
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


def _send_upload(tls, lab, size: int) -> None:
    """An upload of ``size`` bytes that the proxy may cut short (a reset mid-send is its answer)."""
    with contextlib.suppress(OSError):
        tls.sendall(f"POST /upload HTTP/1.1\r\nHost: public.lab.example:{lab.public_tls.port}\r\n"
                    f"Content-Length: {size}\r\n\r\n".encode() + b"q" * size)


def _usage(proxy, session, settled: int) -> dict:
    """The session's usage once the store holds ``settled`` request bytes or more (the close's charge lands
    just after the closing line), or as it is after 5 s."""
    deadline = time.monotonic() + 5
    while True:
        status, _, body = api(proxy.admin_port, "GET", f"/v1/sessions/{session['id']}")
        assert status == 200, body
        if body["usage"]["request_bytes"] >= settled or time.monotonic() > deadline:
            return body["usage"]
        time.sleep(0.1)


def _tunnel_lines(proxy, session, count: int) -> list[dict]:
    """The session's ``count`` tunnel closing lines, in the order written (waited for up to 5 s)."""
    deadline = time.monotonic() + 5
    while True:
        lines = [r for r in proxy.audit() if r["event"] == "tunnel" and r.get("session") == session["id"]]
        if len(lines) >= count or time.monotonic() > deadline:
            assert len(lines) == count, lines
            return lines
        time.sleep(0.1)


@both_transports
@pytest.mark.parametrize("store", ["memory", "redis"])
def test_a_tunnel_never_relays_past_its_request_bytes_budget(lab, start_proxy, tmp_path, store, request):
    """The chunk that would carry the session past ``request_bytes`` is not relayed and the tunnel ends at once.
    The sweep alone charged and looked once a second, and a tunnel moved a second of bytes past the budget
    (its closing line counted 250,000 bytes up against a budget of 200,000)."""
    more = ("--session-store", request.getfixturevalue("redis_server").url) if store == "redis" else ()
    proxy, session, tls = _tunnel(lab, start_proxy, tmp_path, {"request_bytes": BUDGET}, *more)
    with tls:
        _send_upload(tls, lab, BUDGET + 50_000)
        assert _closed_within(tls, SESSION_SWEEP * 3 + 1), "the tunnel moved past its session's request_bytes"
    line = _tunnel_line(proxy, session)
    assert "session:budget-request-bytes" in line["error"] and "closed the tunnel" in line["error"], line
    assert "would have sent" in line["error"] and f"its budget is {BUDGET} bytes" in line["error"], line
    assert 0 < line["bytes_up"] <= BUDGET, line
    assert _usage(proxy, session, line["bytes_up"])["request_bytes"] == line["bytes_up"]


@both_transports
def test_a_tunnel_never_relays_past_its_response_bytes_budget(lab, start_proxy, tmp_path):
    proxy, session, tls = _tunnel(lab, start_proxy, tmp_path, {"response_bytes": BUDGET})
    received = 0
    with tls:
        tls.sendall(f"GET /bytes/{BUDGET + 50_000} HTTP/1.1\r\nHost: public.lab.example:{lab.public_tls.port}"
                    "\r\n\r\n".encode())
        tls.settimeout(SESSION_SWEEP * 3 + 1)
        with contextlib.suppress(OSError):
            while chunk := tls.recv(65536):
                received += len(chunk)
    assert received < BUDGET, f"the client was sent {received} bytes of the response"
    line = _tunnel_line(proxy, session)
    assert "session:budget-response-bytes" in line["error"] and "would have received" in line["error"], line
    assert 0 < line["bytes_down"] <= BUDGET, line


@both_transports
def test_tunnels_open_under_one_session_share_its_budget(lab, start_proxy, tmp_path):
    """Two tunnels at once, each sending less than the budget and together more: what they relayed together stays
    within it, and both end when the second would pass it."""
    proxy, session, first = _tunnel(lab, start_proxy, tmp_path, {"request_bytes": BUDGET})
    sock, status, _, body = connect(proxy, f"public.lab.example:{lab.public_tls.port}", session)
    assert status == 200, body
    second = ssl.create_default_context(cafile=str(lab.cert_file)).wrap_socket(sock,
                                                                              server_hostname="public.lab.example")
    with first, second:
        _upload(first, lab, BUDGET * 6 // 10)
        _send_upload(second, lab, BUDGET * 6 // 10)
        assert _closed_within(second, SESSION_SWEEP * 3 + 1) and _closed_within(first, SESSION_SWEEP * 3 + 1)
    lines = _tunnel_lines(proxy, session, 2)
    assert all("session:budget-request-bytes" in r["error"] for r in lines), lines
    assert sum(r["bytes_up"] for r in lines) <= BUDGET, lines


@both_transports
def test_a_later_tunnel_gets_only_what_the_earlier_ones_left(lab, start_proxy, tmp_path):
    """The allowance is read from the store (what closed tunnels were charged), not the whole budget again."""
    proxy, session, first = _tunnel(lab, start_proxy, tmp_path, {"request_bytes": BUDGET})
    with first:
        _upload(first, lab, BUDGET * 7 // 10)
    earlier = _tunnel_line(proxy, session)["bytes_up"]
    assert _usage(proxy, session, earlier)["request_bytes"] == earlier
    sock, status, _, body = connect(proxy, f"public.lab.example:{lab.public_tls.port}", session)
    assert status == 200, body
    with ssl.create_default_context(cafile=str(lab.cert_file)).wrap_socket(
            sock, server_hostname="public.lab.example") as second:
        assert _get(second, lab, "/small").startswith(b"HTTP/1.1 200")
        _send_upload(second, lab, BUDGET // 2)
        assert _closed_within(second, SESSION_SWEEP * 3 + 1), "the second tunnel moved past what was left"
    lines = _tunnel_lines(proxy, session, 2)
    assert "session:budget-request-bytes" in lines[1]["error"], lines
    assert earlier + lines[1]["bytes_up"] <= BUDGET, lines


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


# ---- review round 16 (a helper's review of the allowance) ------------------------------------------------------

def _session_proxy(lab, start_proxy, tmp_path, budgets: dict):
    proxy = start_proxy(lab.policy_text("session: required\n"), "--admin-token-file", str(token_file(tmp_path)))
    return proxy, create(proxy.admin_port, {"hosts": ["public.lab.example"]}, budgets=budgets)


def _handshake_fails(lab, sock) -> bool:
    context = ssl.create_default_context(cafile=str(lab.cert_file))
    try:
        context.wrap_socket(sock, server_hostname="public.lab.example").close()
    except (ssl.SSLError, OSError):
        return True
    return False


@both_transports
def test_a_client_hello_past_the_budget_never_reaches_the_origin(lab, start_proxy, tmp_path):
    """The front sent the judged ClientHello upstream before taking it from the allowance: four tunnels opened at
    once under request_bytes 100 moved 13,240 bytes to the origin (review round 16). Nothing goes now."""
    proxy, session = _session_proxy(lab, start_proxy, tmp_path, {"request_bytes": 100})
    sock, status, _, body = connect(proxy, f"public.lab.example:{lab.public_tls.port}", session)
    assert status == 200, body
    assert _handshake_fails(lab, sock)
    line = _tunnel_line(proxy, session)
    assert "session:budget-request-bytes" in line["error"] and line["bytes_up"] == 0, line
    assert _usage(proxy, session, 0)["request_bytes"] == 0


@both_transports
def test_a_tunnel_not_yet_relaying_ends_with_the_crossing_and_says_why(lab, start_proxy, tmp_path):
    """A tunnel still waiting for its first message had no cut yet: it stayed open after its session crossed a
    budget, and its closing line named no rule (review round 16)."""
    proxy, session = _session_proxy(lab, start_proxy, tmp_path, {"request_bytes": 100})
    waiting, status, _, body = connect(proxy, f"public.lab.example:{lab.public_tls.port}", session)
    assert status == 200, body
    crossing, status, _, body = connect(proxy, f"public.lab.example:{lab.public_tls.port}", session)
    assert status == 200, body
    assert _handshake_fails(lab, crossing)
    waiting.settimeout(5)
    with waiting, contextlib.suppress(ConnectionResetError):
        assert waiting.recv(1) == b""  # closed by the proxy, well before limits.header_timeout
    lines = _tunnel_lines(proxy, session, 2)
    assert all("session:budget-request-bytes" in line["error"] for line in lines), lines


@both_transports
def test_a_plain_upload_and_an_open_tunnel_together_stay_within_the_budget(lab, start_proxy, tmp_path):
    """The plain request was judged against the store, which the tunnel's bytes reach only at the sweep's next
    look: 80,000 bytes in a tunnel and at once 80,000 in a POST both went, under request_bytes 100,000."""
    proxy, session, tls = _tunnel(lab, start_proxy, tmp_path, {"request_bytes": 100_000})
    with tls:
        _upload(tls, lab, 80_000)
        status, headers, _ = _post(proxy, lab, session, 80_000)
    assert status == 403 and headers["x-egresswall-rule"] == "session:budget-request-bytes", headers


def _post(proxy, lab, session, size: int, path: str = "/plain-upload", port: int | None = None):
    from proxyproc import parse_response, read_response

    authority = f"public.lab.example:{port or lab.public.port}"
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(f"POST http://{authority}{path} HTTP/1.1\r\nHost: {authority}\r\n"
                     f"Proxy-Authorization: {session['proxy_authorization']}\r\nContent-Length: {size}\r\n"
                     "Connection: close\r\n\r\n".encode() + b"p" * size)
        return parse_response(read_response(sock))


@both_transports
def test_request_heads_count_toward_request_bytes(lab, start_proxy, tmp_path):
    """A URL and headers carry data out as a body does (``?q=<conversation>``): five GETs with 12 KB heads moved
    60,385 bytes under request_bytes 100 and the session's usage stayed 0 (review round 16)."""
    proxy, session = _session_proxy(lab, start_proxy, tmp_path, {"request_bytes": 10_000})
    authority = f"public.lab.example:{lab.public.port}"
    answers = [get(proxy, f"http://{authority}/q?d={'x' * 3000}&n={n}", session)[0] for n in range(4)]
    assert answers == [200, 200, 200, 403], answers
    assert 9_000 <= _usage(proxy, session, 9_000)["request_bytes"] <= 10_000


@both_transports
def test_a_chunked_upload_past_request_bytes_is_refused_before_the_origin_sees_it(lab, start_proxy, tmp_path):
    """A chunked body declares no length, and its admission judged it as none: 50,000 bytes went under
    request_bytes 1,000 where the same body with Content-Length was refused (review round 16). It is read whole
    before anything goes upstream, and judged then; one that fits still goes."""
    from proxyproc import parse_response, read_response

    proxy, session = _session_proxy(lab, start_proxy, tmp_path, {"request_bytes": 1_000})
    authority = f"public.lab.example:{lab.public.port}"

    def chunked(path: str, size: int) -> tuple[int, dict[str, str]]:
        with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
            sock.sendall(f"POST http://{authority}{path} HTTP/1.1\r\nHost: {authority}\r\nProxy-Authorization: "
                         f"{session['proxy_authorization']}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                         f"{size:x}\r\n".encode() + b"c" * size + b"\r\n0\r\n\r\n")
            status, headers, _ = parse_response(read_response(sock))
            return status, headers

    status, headers = chunked("/chunked-big", 50_000)
    assert status == 403 and headers["x-egresswall-rule"] == "session:budget-request-bytes", headers
    assert "/chunked-big" not in [path for _, path, _ in lab.public.requests]
    assert chunked("/chunked-small", 100)[0] == 200


@both_transports
@pytest.mark.parametrize("store", ["memory", "redis"])
def test_uploads_admitted_at_once_are_judged_on_each_other_s_bytes(lab, start_proxy, tmp_path, store, request):
    """Each request was judged against what the store had counted, and a body was counted only when its exchange
    ended: 20 POSTs of 5,000 bytes sent together under request_bytes 10,000 all went, 101,570 bytes to the origin
    (review round 16). A request's head and declared body are charged with it at admission now, atomically."""
    import threading

    more = ("--session-store", request.getfixturevalue("redis_server").url) if store == "redis" else ()
    proxy = start_proxy(lab.policy_text("session: required\n"), "--admin-token-file", str(token_file(tmp_path)),
                        *more)
    session = create(proxy.admin_port, {"hosts": ["public.lab.example"]}, budgets={"request_bytes": 10_000})
    tag = f"together-{store}-{proxy.port}"
    start, answers = threading.Barrier(20), []

    def upload(n: int) -> None:
        start.wait(10)
        answers.append(_post(proxy, lab, session, 5_000, f"/{tag}/{n}")[0])

    threads = [threading.Thread(target=upload, args=(n,)) for n in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    reached = [path for method, path, _ in lab.public.requests if path.startswith(f"/{tag}/")]
    assert sorted(answers) == [200] + [403] * 19 and len(reached) == 1, (answers, reached)
    assert _usage(proxy, session, 5_000)["request_bytes"] <= 10_000


class _Answers101(_Server):
    """Answers every request 101 (an upgrade nobody asked for), and closes."""

    def handle(self, conn: socket.socket, head: bytes) -> None:
        conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")


@both_transports
def test_a_body_answered_101_is_charged_all_the_same(lab, start_proxy, tmp_path):
    """An origin that read a POST's body and answered 101 got its client a 502 and its session no charge: ten
    8,000-byte bodies went under request_bytes 10,000 (review round 16). The declared body is charged at
    admission, whatever the answer."""
    origin = _Answers101()
    try:
        text = lab.policy_text("session: required\n").replace("  http: [", f"  http: [{origin.port}, ")
        proxy = start_proxy(text, "--admin-token-file", str(token_file(tmp_path)))
        session = create(proxy.admin_port, {"hosts": ["public.lab.example"]}, budgets={"request_bytes": 10_000})
        answers = [_post(proxy, lab, session, 8_000, f"/up-{n}", port=origin.port)[0] for n in range(4)]
        assert answers[0] in (0, 502) and answers[1:] == [403, 403, 403], answers  # 0: closed (the 101 refused)
        assert 8_000 <= _usage(proxy, session, 8_000)["request_bytes"] <= 10_000
    finally:
        origin.close()
