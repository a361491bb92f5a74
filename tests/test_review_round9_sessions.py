"""Adversarial review of session grants, round 9 (r9a): what a grant for one thing must never be used for.

Each test is an attack through the real proxy (both transports where the case reaches both) or, for the
Redis store, on a real redis-server: a grant used for another scheme, a session's counters outlived by
the session, a request inside a session's tunnel recorded as no session's.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import ssl
import time

import pytest
import rawclient
from labnet import PUBLIC_IP, Upstream, self_signed
from proxyproc import both_transports, read_response
from session_client import api, connect, create, get, token_file

from policy.hosts import parse_authority
from policy.sessions import Grants, Session, parse_session_spec, parse_url_grant, secret_digest

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("internal_saw_nothing")]


def _policy(lab, extra: str = "") -> str:
    """Sessions required; CONNECT to the plain-HTTP stand-in allowed (HTTP inside a tunnel)."""
    text = lab.policy_text("session: required\n" + extra)
    return text.replace(f"connect: [{', '.join(map(str, sorted({443, lab.public_tls.port})))}]",
                        f"connect: [{', '.join(map(str, sorted({443, lab.public_tls.port, lab.public.port})))}]")


def _tls_get(sock: socket.socket, lab, path: str) -> bytes:
    context = ssl.create_default_context(cafile=str(lab.cert_file))
    with context.wrap_socket(sock, server_hostname="public.lab.example") as tls:
        tls.sendall(f"GET {path} HTTP/1.1\r\nHost: public.lab.example:{lab.public_tls.port}\r\n"
                    "Connection: close\r\n\r\n".encode())
        return read_response(tls)


# ---- an http URL grant is not an https one ------------------------------------------------------

def test_a_tunnel_that_may_carry_tls_is_granted_by_an_https_url_only() -> None:
    target = parse_authority("public.lab.example:8080", "https")
    http, https = (Grants(urls=(parse_url_grant(f"{s}://public.lab.example:8080/page"),)) for s in ("http", "https"))
    assert http.admit(target, visible=False) and not http.admit(target, visible=False, tls=True)
    assert https.admit(target, visible=False) and https.admit(target, visible=False, tls=True)


@both_transports
def test_an_http_url_grant_opens_no_tls_tunnel_to_its_host_and_port(lab, start_proxy, tmp_path):
    """``http://host:P/page`` grants that exact URL. A passed-through TLS tunnel to host:P would carry
    https to any path there: a scheme the grant never named, and a path egresswall never sees."""
    proxy = start_proxy(_policy(lab), "--admin-token-file", str(token_file(tmp_path)))
    port = lab.public_tls.port
    session = create(proxy.admin_port, {"urls": [f"http://public.lab.example:{port}/page"]})
    before = len(lab.public_tls.requests)
    sock, status, headers, body = connect(proxy, f"public.lab.example:{port}", session)
    with sock:
        if status == 200:
            answer = _tls_get(sock, lab, "/exfil?q=the-conversation")
            assert not answer, answer
    assert (status, headers.get("x-egresswall-rule")) == (403, "session:not-granted"), body
    assert [p for _, p, _ in lab.public_tls.requests[before:]] == []


@both_transports
def test_an_https_url_grant_still_opens_its_tls_tunnel(lab, start_proxy, tmp_path):
    """The README's passed-through tunnel: an https URL grants its host and port (any path there)."""
    proxy = start_proxy(_policy(lab), "--admin-token-file", str(token_file(tmp_path)))
    session = create(proxy.admin_port, {"urls": [f"https://public.lab.example:{lab.public_tls.port}/page"]})
    sock, status, _, body = connect(proxy, f"public.lab.example:{lab.public_tls.port}", session)
    assert status == 200, body
    with sock:
        assert _tls_get(sock, lab, "/page").startswith(b"HTTP/1.1 200")


@pytest.fixture
def tls_on_http_port(tmp_path):
    """A TLS origin on a port the policy lists as plain HTTP (and CONNECT): a tunnel there may carry either."""
    context, cert_file = self_signed(["public.lab.example"], str(tmp_path))
    origin = Upstream(PUBLIC_IP, "tls-on-http-port", tls=context)
    origin.cert_file = cert_file
    yield origin
    origin.close()


@both_transports
def test_an_http_url_grant_lets_http_inside_a_tunnel_to_its_port_but_no_tls(lab, start_proxy, tmp_path,
                                                                             tls_on_http_port):
    """A CONNECT to a plain-HTTP port is admitted for an http URL's host and port, since each request inside
    is held to the exact URL. A ClientHello there instead would be passed through to any https path."""
    port = tls_on_http_port.port
    policy = _policy(lab).replace("  http: [", f"  http: [{port}, ", 1).replace("  connect: [", f"  connect: [{port}, ",
                                                                                 1)
    proxy = start_proxy(policy, "--admin-token-file", str(token_file(tmp_path)))
    session = create(proxy.admin_port, {"urls": [f"http://public.lab.example:{port}/page"]})
    sock, status, _, body = connect(proxy, f"public.lab.example:{port}", session)
    assert status == 200, body  # HTTP inside would be judged request by request
    context = ssl.create_default_context(cafile=str(tls_on_http_port.cert_file))
    answer = b""
    # ssl.SSLError is an OSError: a refused tunnel ends the handshake.
    with sock, contextlib.suppress(OSError), context.wrap_socket(sock, server_hostname="public.lab.example") as tls:
        tls.sendall(f"GET /exfil?q=x HTTP/1.1\r\nHost: public.lab.example:{port}\r\nConnection: close"
                    "\r\n\r\n".encode())
        answer = read_response(tls)
    assert b"hello from" not in answer and tls_on_http_port.requests == []
    refused = [r for r in proxy.decisions() if r.get("rule") == "session:not-granted"]
    assert refused and refused[-1]["session"] == session["id"], proxy.decisions()


# ---- the audit record names the session of every request made under it ---------------------------

def _ask(sock: socket.socket, request: bytes) -> tuple[int, bytes]:
    """One request on an open connection: its status and the whole answer (to its Content-Length)."""
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return 0, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length and (chunk := sock.recv(65536)):
        body += chunk
    return int(head.split(b" ", 2)[1]), data


@both_transports
def test_a_request_refused_inside_a_sessions_tunnel_is_recorded_under_that_session(lab, start_proxy, tmp_path):
    """Inside a tunnel the CONNECT's session applies to every request (README): a request there that the
    form checks refuse — the one that names another host, the exfiltration attempt itself — is that
    session's too, and its record must say so, as the records of the tunnel's other requests do."""
    proxy = start_proxy(_policy(lab, "limits:\n  max_request_body: 100\n"), "--admin-token-file",
                        str(token_file(tmp_path)))
    session = create(proxy.admin_port, {"hosts": ["public.lab.example"]})
    port = lab.public.port
    attempts = [f"GET /r9/other HTTP/1.1\r\nHost: other.lab.example:{port}\r\n\r\n",
                f"GET http://other.lab.example:{port}/r9/abs HTTP/1.1\r\nHost: other.lab.example:{port}\r\n\r\n",
                f"POST /r9/big HTTP/1.1\r\nHost: public.lab.example:{port}\r\nContent-Length: 1000\r\n\r\n",
                f"GET /r9/h2c HTTP/1.1\r\nHost: public.lab.example:{port}\r\nUpgrade: h2c\r\n"
                "Connection: Upgrade\r\n\r\n",
                f"GET /r9/nul HTTP/1.1\r\nHost: public.lab.example:{port}\r\nX-A: a\rb\r\n\r\n"]
    for attempt in attempts:  # each in a tunnel of its own, after a request the tunnel's session admits
        sock, status, _, body = connect(proxy, f"public.lab.example:{port}", session)
        assert status == 200, body
        with sock:
            first = f"GET /r9/first HTTP/1.1\r\nHost: public.lab.example:{port}\r\n\r\n"
            assert _ask(sock, first.encode())[0] == 200
            assert _ask(sock, attempt.encode())[0] in (400, 403, 413)
    inside = [r for r in proxy.decisions() if r["method"] in ("GET", "POST")]
    assert [r["rule"] for r in inside[1::2]] == ["form:host-header", "form:authority", "limits.max_request_body",
                                                 "http:upgrade", "http:header-value"]
    assert [r["session"] for r in inside] == [session["id"]] * 10, inside


@both_transports
def test_an_admitted_requests_body_refused_midway_is_recorded_under_its_session(lab, start_proxy, tmp_path):
    """A chunked body over limits.max_request_body is refused while it is read, after the request was
    admitted under its session: that refusal is the flow's closing record, and it is the session's."""
    proxy = start_proxy(_policy(lab, "limits:\n  max_request_body: 100\n"), "--admin-token-file",
                        str(token_file(tmp_path)))
    session = create(proxy.admin_port, {"hosts": ["public.lab.example"]})
    port = lab.public.port
    chunk = b"c8\r\n" + b"x" * 200 + b"\r\n0\r\n\r\n"
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        status, _ = _ask(sock, f"POST http://public.lab.example:{port}/r9/chunked HTTP/1.1\r\n"
                               f"Host: public.lab.example:{port}\r\nTransfer-Encoding: chunked\r\n"
                               f"Proxy-Authorization: {session['proxy_authorization']}\r\n\r\n".encode() + chunk)
    assert status == 413
    lines = [r for r in proxy.audit() if r["method"] == "POST"]
    assert [r["rule"] for r in lines][-1] == "limits.max_request_body", lines
    assert [r["session"] for r in lines] == [session["id"]] * len(lines), lines


# ---- the Redis store keeps a session's counters as long as the session ----------------------------

@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs Debian's redis-server (ci/install.sh --redis)")
def test_a_charge_judged_on_the_session_read_before_its_extension_keeps_its_counters_for_the_extension(tmp_path):
    """A request reads its session, the platform extends it (PATCH), then the request is counted. The
    counters must live as long as the session record (the memory store keeps them with the session): were
    they to expire at the old expiry, the budgets would start again from nothing while the session lives on."""
    from test_sessions_redis import RedisServer

    from proxy.sessions.redis_store import RedisStore

    server = RedisServer(tmp_path)
    try:
        asyncio.run(_charge_after_extension(RedisStore(server.url)))
    finally:
        server.stop()


async def _charge_after_extension(store) -> None:
    now = time.time()
    spec = parse_session_spec({"grants": {"hosts": ["public.lab.example"]}, "ttl": 60, "budgets": {"requests": 5}})
    session = Session("sr9a", secret_digest("secret"), now, now + 60, spec)
    try:
        await store.put(session)
        assert await store.charge(session, "public.lab.example", None) is None
        assert await store.set_expiry(session.id, now + 80000) is not None  # extended after the read below
        assert await store.charge(session, "public.lab.example", None) is None  # judged on the session as read
        record = await store.client.pexpiretime(store._key(session.id))
        for part in ("usage", "hosts"):
            assert await store.client.pexpiretime(store._key(session.id, part)) >= record, part
        assert (await store.usage(session.id)).requests == 2
    finally:
        await store.close()


# ---- one connection, several sessions: each request is its own -----------------------------------

@both_transports
def test_requests_on_one_connection_each_go_as_the_session_they_present_and_none_carries_it_on(
        lab, start_proxy, tmp_path):
    """Kept alive and pipelined, with sessions optional: a request goes as the session it presents (never
    the previous request's), one without credentials goes as none, and no Proxy-Authorization reaches the
    origin; the records name each request's own session."""
    policy = _policy(lab).replace("session: required\n", "")
    proxy = start_proxy(policy, "--admin-token-file", str(token_file(tmp_path)))
    first = create(proxy.admin_port, {"hosts": ["public.lab.example"]})
    second = create(proxy.admin_port, {"hosts": ["other.lab.example"]})
    port = lab.public.port

    def plain(host: str, path: str, session: dict | None) -> bytes:
        auth = f"Proxy-Authorization: {session['proxy_authorization']}\r\n" if session else ""
        return (f"GET http://{host}:{port}{path} HTTP/1.1\r\nHost: {host}:{port}\r\nAccept: application/json\r\n"
                f"{auth}\r\n").encode()

    sequence = [("public.lab.example", "/ka/1", first), ("other.lab.example", "/ka/2", second),
                ("public.lab.example", "/ka/3", None), ("public.lab.example", "/ka/4", first)]
    before = len(lab.public.requests)
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        assert [_ask(sock, plain(*step))[0] for step in sequence] == [200] * 4
        # Pipelined in one write: the first session's request, then the second's host under the first.
        sock.sendall(plain("public.lab.example", "/ka/5", first) + plain("other.lab.example", "/ka/6", first))
        answers = rawclient.read_all(sock, 5)
    assert answers.count(b"HTTP/1.1 200") == 1 and b"session:not-granted" in answers
    seen = lab.public.requests[before:]
    assert [p for _, p, _ in seen] == ["/ka/1", "/ka/2", "/ka/3", "/ka/4", "/ka/5"]
    assert not [h for _, _, h in seen if any("authorization" in k.lower() for k in h)]
    decided = {r["path"]: r["session"] for r in proxy.decisions() if r["method"] == "GET"}
    assert decided == {"/ka/1": first["id"], "/ka/2": second["id"], "/ka/3": None, "/ka/4": first["id"],
                       "/ka/5": first["id"], "/ka/6": first["id"]}


# ---- a link with characters outside ASCII grants the request a browser sends for it --------------

@both_transports
def test_a_url_grant_with_characters_outside_ascii_grants_the_percent_encoded_request(lab, start_proxy, tmp_path):
    """A user's link ``/wiki/Café`` is requested as ``/wiki/Caf%C3%A9`` (a request target is ASCII; the raw
    bytes are refused on both transports): the grant must admit that, and only that. Before, it was taken
    (201) and admitted no request at all. A path that is no Unicode (a lone surrogate) is a 400."""
    proxy = start_proxy(_policy(lab), "--admin-token-file", str(token_file(tmp_path)))
    port = lab.public.port
    session = create(proxy.admin_port, {"urls": [f"http://public.lab.example:{port}/wiki/Café?lang=dé"]})
    assert session["grants"]["urls"] == [f"http://public.lab.example:{port}/wiki/Café?lang=dé"]  # as given
    for path, expected in (("/wiki/Caf%C3%A9?lang=d%C3%A9", 200), ("/wiki/Caf%C3%A9?lang=de", 403),
                           ("/wiki/Cafe?lang=d%C3%A9", 403)):
        status, headers, body = get(proxy, f"http://public.lab.example:{port}{path}", session)
        assert status == expected, (path, status, body)
    raw = b'{"grants": {"urls": ["http://public.lab.example/wiki/\\ud800"]}}'
    status, _, body = api(proxy.admin_port, "POST", "/v1/sessions", raw=raw)
    assert status == 400 and body["field"] == "grants.urls[0]" and "surrogate" in body["reason"], body
