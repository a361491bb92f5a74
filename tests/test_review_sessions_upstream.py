"""Adversarial review of session grants (issue 16), upstream chaining (issue 17 item 3) and the fast relay.

Each test is an attack through the real proxy (or, for the pure parsers, on the pure code): what must never
pass is a request the session did not grant, a session outliving its end or expiry, a budget exceeded, or a
secret (the session's, the upstream's, the admin token) reaching anyone but its owner. The ones that held
when the review was made are kept as regression tests; the ones that did not come with their fix.
"""

from __future__ import annotations

import base64
import socket
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from labnet import PUBLIC_IP
from listening import stop_serving
from proxyproc import ProxyProcess, parse_response, read_response
from rawclient import read_all
from session_client import TOKEN, api, connect, create, get, token_file
from test_upstream_proxy import (
    PASSWORD,
    USER,
    access_log,
    credentials_file,
    squid,  # noqa: F401 (a fixture: the tests that name it say noqa: F811)
    upstream_policy,
    wait_for_line,
)

from policy.credentials import CredentialsError, basic_value, parse_proxy_authorization
from policy.hosts import parse_url
from policy.sessions import Grants, parse_url_grant

# ---- pure: the URL grant and the credentials parser ---------------------------------------------

GRANTED = "https://public.lab.example/read/this?x=1"


@pytest.mark.parametrize("url", [
    "https://public.lab.example/read/this",  # no query
    "https://public.lab.example/read/this?",  # an empty query is another request target
    "https://public.lab.example/read/this?x=1&q=secret",
    "https://public.lab.example/read/this?x=2",
    "https://public.lab.example/read/this/?x=1",
    "https://public.lab.example/read/this;q=secret?x=1",
    "https://public.lab.example/read/./this?x=1",
    "https://public.lab.example/read/%2e/this?x=1",
    "https://public.lab.example/read/x/../this?x=1",
    "https://public.lab.example/read/x/%2e%2e/this?x=1",
    "https://public.lab.example/read%2fthis?x=1",
    "https://public.lab.example/read//this?x=1",
    "https://public.lab.example/Read/this?x=1",
    "https://public.lab.example/read/this%3Fx=1",
    "https://public.lab.example/read/this?X=1",
    "http://public.lab.example/read/this?x=1",  # another scheme
    "https://public.lab.example:8443/read/this?x=1",  # another port
    "https://other.lab.example/read/this?x=1",
    "https://public.lab.example.evil.example/read/this?x=1",
    "https://evilpublic.lab.example/read/this?x=1",
])
def test_a_url_grant_admits_no_other_request_target(url: str) -> None:
    grants = Grants(urls=(parse_url_grant(GRANTED),))
    assert not grants.admit(parse_url(url), visible=True), url


@pytest.mark.parametrize("url", [
    "https://PUBLIC.Lab.Example/read/this?x=1",
    "https://public.lab.example./read/this?x=1",
    "https://public.lab.example:443/read/this?x=1",
    "https://public.lab.example/read/%74his?x=1",  # an escaped unreserved character is the same path
])
def test_spellings_of_the_granted_url_are_the_granted_url(url: str) -> None:
    grants = Grants(urls=(parse_url_grant(GRANTED),))
    assert grants.admit(parse_url(url), visible=True), url


@pytest.mark.parametrize("text", ["https://public.lab.example/a#frag", "https://u:p@public.lab.example/a",
                                  "https://public.lab.example/a/../b", "ftp://public.lab.example/a",
                                  "https://public.lab.example/a%2fb"])
def test_a_url_grant_that_servers_could_read_differently_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_url_grant(text)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@pytest.mark.parametrize("values", [
    [basic_value("s1", "good-secret"), "Basic " + _b64("s2:other")],  # one valid among two
    [basic_value("s1", "good-secret"), basic_value("s1", "good-secret")],  # even the same one twice
    ["Basic " + _b64("s1:")],  # empty secret
    ["Basic " + _b64(":secret")],  # empty id
    ["Basic " + _b64("s1:sec ret")],
    ["Basic " + _b64("s1:s\u00e9cret")],  # non-ASCII secret
    ["Basic " + _b64("s\u00e91:secret")],
    ["Basic " + _b64("s1\x00:secret")],
    ["Basic\t" + _b64("s1:secret")],
    ["Bearer " + _b64("s1:secret")],
    ["Basic " + _b64("s1:secret") + " x"],
    ["Basic " + _b64("s1:secret1").rstrip("=")],  # missing padding
    ["Basic " + _b64("s1:secret") + "=="],
    ["Basic s1:secret"],
    ["Basic " + _b64("s1:secret\n")],  # "$" in a pattern matches before a trailing newline
    ["Basic " + _b64("s1\n:secret")],
])
def test_credentials_are_parsed_strictly(values: list[str]) -> None:
    with pytest.raises(CredentialsError):
        parse_proxy_authorization(values)


@given(st.text(min_size=0, max_size=80))
def test_any_header_value_is_credentials_that_round_trip_or_a_credentials_error(value: str) -> None:
    try:
        found = parse_proxy_authorization([value])
    except CredentialsError:
        return
    assert found is not None
    assert basic_value(found.session_id, found.secret) == "Basic " + value.strip(" \t").split(" ")[-1]


# ---- through the real proxy --------------------------------------------------------------------

def _policy(lab, required: bool = True, extra: str = "") -> str:
    """The lab policy, with CONNECT to the plain-HTTP stand-in allowed too (HTTP inside a tunnel)."""
    text = lab.policy_text(("session: required\n" if required else "") + extra)
    return text.replace(f"connect: [{', '.join(map(str, sorted({443, lab.public_tls.port})))}]",
                        f"connect: [{', '.join(map(str, sorted({443, lab.public_tls.port, lab.public.port})))}]")


def _session_proxy(lab, start_proxy, tmp_path, required: bool = True, extra: str = "", *args: str) -> ProxyProcess:
    return start_proxy(_policy(lab, required, extra), "--admin-token-file", str(token_file(tmp_path)), *args)


def _ask(sock: socket.socket, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """One request on an open connection (keep-alive): the answer, read to its Content-Length."""
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return 0, {}, data
        data += chunk
    status, headers, body = parse_response(data)
    while len(body) < int(headers.get("content-length", "0")):
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, headers, body


def _inside(lab, path: str, host: str = "public.lab.example", extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: {host}:{lab.public.port}\r\nAccept: application/json\r\n{extra}\r\n".encode()


def _origin_paths(lab) -> list[str]:
    return [p for _, p, _ in lab.public.requests]


class ClosingOrigin:
    """An origin on the public stand-in's address that answers one request per connection (a keep-alive
    answer), then closes it: what an origin's keep-alive timeout does to a connection egresswall holds."""

    def __init__(self) -> None:
        self.sock = socket.create_server((PUBLIC_IP, 0))
        self.port = self.sock.getsockname()[1]
        self.requests: list[bytes] = []  # each request head as received
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                if data:
                    self.requests.append(data)
                    # Keep-alive as far as HTTP goes; then closed, as an origin's keep-alive timeout does.
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    time.sleep(0.1)

    def paths(self) -> list[str]:
        return [r.split(b" ", 2)[1].decode("latin-1") for r in self.requests]

    def close(self) -> None:
        stop_serving(self.sock, self._thread)


@pytest.fixture
def closing_origin():
    origin = ClosingOrigin()
    yield origin
    origin.close()


def _with_port(policy: str, port: int) -> str:
    """The policy with ``port`` a plain-HTTP port, and a CONNECT port too."""
    return policy.replace("  http: [", f"  http: [{port}, ", 1).replace("  connect: [", f"  connect: [{port}, ", 1)


@pytest.mark.parametrize("required", [True, False], ids=["session-required", "session-optional"])
def test_a_tunnel_whose_origin_connection_closed_still_holds_its_session(lab, start_proxy, tmp_path, required,
                                                                         closing_origin):
    """mitmproxy opens a new connection to the origin when the tunnel's first one has closed (an origin's
    keep-alive timeout does that all the time); the requests after it are still inside the CONNECT's tunnel,
    under its session, its target and its checks."""
    port = closing_origin.port
    proxy = start_proxy(_with_port(_policy(lab, required), port), "--admin-token-file", str(token_file(tmp_path)))
    session = create(proxy.admin_port, {"urls": [f"http://public.lab.example:{port}/read/this"]})
    sock, status, _, _ = connect(proxy, f"public.lab.example:{port}", session)
    assert status == 200
    inside = "GET {} HTTP/1.1\r\nHost: public.lab.example:{}\r\nAccept: application/json\r\n\r\n"
    with sock:
        for _ in range(2):  # the second on a new connection to the origin, under the same session
            assert _ask(sock, inside.format("/read/this", port).encode())[:1] == (200,)
            time.sleep(0.3)  # the origin has closed its side; the client's tunnel is open
        status, headers, body = _ask(sock, inside.format("/read/other?q=exfiltrated", port).encode())
        assert (status, headers.get("x-egresswall-rule")) == (403, "session:not-granted"), (status, body)
    assert closing_origin.paths() == ["/read/this", "/read/this"]


def test_the_upstreams_credentials_never_reach_an_origin_after_its_connection_closed(
        lab, squid, start_proxy, tmp_path, closing_origin):  # noqa: F811
    """HTTP inside a CONNECT to a plain-HTTP port, through squid: egresswall's credentials for squid go on the
    CONNECT only. After the origin closed the tunnel's first connection, an absolute-form request inside the
    tunnel must still be a request inside the tunnel — not a plain one that is handed squid's password."""
    port = closing_origin.port
    proxy = start_proxy(_with_port(upstream_policy(lab, squid, credentials_file(tmp_path)), port),
                        "--no-fast-tunnels")
    sock, status, _ = proxy.connect(f"public.lab.example:{port}")
    assert status == 200
    with sock:
        first = f"GET /first HTTP/1.1\r\nHost: public.lab.example:{port}\r\n\r\n".encode()
        assert _ask(sock, first)[:1] == (200,)
        time.sleep(0.3)
        second = f"GET http://public.lab.example:{port}/second HTTP/1.1\r\nHost: public.lab.example:{port}\r\n\r\n"
        _ask(sock, second.encode())
    secret = base64.b64encode(f"{USER}:{PASSWORD}".encode())
    assert closing_origin.paths() == ["/first", "/second"]  # the second in origin form, to the origin
    assert not [r for r in closing_origin.requests if secret in r or b"proxy-" in r.lower()]


# ---- an ended, expired or shortened session on a connection or tunnel already open --------------

@pytest.fixture(scope="module")
def sessions_proxy(lab, tmp_path_factory):
    """Sessions required for loopback clients, CONNECT to the plain-HTTP stand-in allowed (HTTP inside)."""
    folder = tmp_path_factory.mktemp("review-sessions")
    policy = folder / "policy.yaml"
    policy.write_text(_policy(lab, extra="hosts:\n  deny: [denied.lab.example]\n"))
    process = ProxyProcess(["--policy", str(policy), "--admin-token-file", str(token_file(folder))],
                           folder / "audit.jsonl")
    yield process
    process.stop()
    assert not [e for e in process.outbound() if e["host"] != PUBLIC_IP], process.outbound()


def _plain(lab, path: str, session: dict | None, host: str = "public.lab.example", extra: str = "") -> bytes:
    auth = f"Proxy-Authorization: {session['proxy_authorization']}\r\n" if session else ""
    return (f"GET http://{host}:{lab.public.port}{path} HTTP/1.1\r\nHost: {host}:{lab.public.port}\r\n"
            f"Accept: application/json\r\n{auth}{extra}\r\n").encode()


def _tunnel(proxy: ProxyProcess, lab, session: dict) -> socket.socket:
    sock, status, _, body = connect(proxy, f"public.lab.example:{lab.public.port}", session)
    assert status == 200, body
    return sock


def _patch(proxy: ProxyProcess, session: dict, ttl: float) -> None:
    status, _, body = api(proxy.admin_port, "PATCH", f"/v1/sessions/{session['id']}", {"ttl": ttl})
    assert status == 200, body


@pytest.mark.parametrize("where", ["keep-alive", "tunnel"])
def test_an_ended_session_is_refused_on_a_connection_already_open(lab, sessions_proxy, where):
    link = f"http://public.lab.example:{lab.public.port}/read/ended-{where}"
    session = create(sessions_proxy.admin_port, {"urls": [link]})
    path = f"/read/ended-{where}"
    with (socket.create_connection((sessions_proxy.host, sessions_proxy.port), timeout=10) if where == "keep-alive"
          else _tunnel(sessions_proxy, lab, session)) as sock:
        ask = _plain(lab, path, session) if where == "keep-alive" else _inside(lab, path)
        assert _ask(sock, ask)[0] == 200
        assert api(sessions_proxy.admin_port, "DELETE", f"/v1/sessions/{session['id']}")[0] == 204
        status, headers, _ = _ask(sock, ask)
    expected = "session:credentials" if where == "keep-alive" else "session:ended"
    assert status in (403, 407) and headers.get("x-egresswall-rule") == expected
    assert _origin_paths(lab).count(path) == 1


@pytest.mark.parametrize("where", ["keep-alive", "tunnel"])
def test_a_shortened_session_expires_on_a_connection_already_open(lab, sessions_proxy, where):
    """PATCH with a short ttl is how a platform cuts a turn short: it holds inside a tunnel opened before."""
    path = f"/read/shortened-{where}"
    session = create(sessions_proxy.admin_port, {"urls": [f"http://public.lab.example:{lab.public.port}{path}"]},
                     ttl=600)
    with (socket.create_connection((sessions_proxy.host, sessions_proxy.port), timeout=10) if where == "keep-alive"
          else _tunnel(sessions_proxy, lab, session)) as sock:
        ask = _plain(lab, path, session) if where == "keep-alive" else _inside(lab, path)
        assert _ask(sock, ask)[0] == 200
        _patch(sessions_proxy, session, 0.2)
        time.sleep(0.5)
        status, headers, body = _ask(sock, ask)
    assert (status, headers.get("x-egresswall-rule")) == (403, "session:expired"), body
    assert _origin_paths(lab).count(path) == 1


def test_an_extended_session_goes_on_inside_a_tunnel_opened_before(lab, sessions_proxy):
    path = "/read/extended-tunnel"
    session = create(sessions_proxy.admin_port, {"urls": [f"http://public.lab.example:{lab.public.port}{path}"]},
                     ttl=1.5)
    with _tunnel(sessions_proxy, lab, session) as sock:
        assert _ask(sock, _inside(lab, path))[0] == 200
        _patch(sessions_proxy, session, 600)
        time.sleep(2)
        status, headers, body = _ask(sock, _inside(lab, path))
    assert status == 200, body


# ---- budgets: pipelined, concurrent, inside a tunnel ---------------------------------------------

def test_pipelined_requests_before_the_first_answer_never_exceed_the_request_budget(lab, sessions_proxy):
    path = "/budget/pipelined"
    session = create(sessions_proxy.admin_port, {"hosts": ["public.lab.example"]}, budgets={"requests": 2})
    with socket.create_connection((sessions_proxy.host, sessions_proxy.port), timeout=10) as sock:
        sock.sendall(b"".join(_plain(lab, f"{path}?n={n}", session) for n in range(6)))  # one write
        answers = read_all(sock, 5)
    assert answers.count(b"HTTP/1.1 200") == 2 and b"session:budget-requests" in answers
    assert len([p for p in _origin_paths(lab) if p.startswith(path)]) == 2


def test_pipelined_requests_inside_a_tunnel_count_against_the_budget(lab, sessions_proxy):
    """The CONNECT counts one, and each request inside it one: a budget of 3 lets two through."""
    path = "/budget/in-tunnel"
    session = create(sessions_proxy.admin_port, {"hosts": ["public.lab.example"]}, budgets={"requests": 3})
    with _tunnel(sessions_proxy, lab, session) as sock:
        sock.sendall(b"".join(_inside(lab, f"{path}?n={n}") for n in range(6)))
        answers = read_all(sock, 5)
    assert answers.count(b"HTTP/1.1 200") == 2 and b"session:budget-requests" in answers
    assert len([p for p in _origin_paths(lab) if p.startswith(path)]) == 2


def test_concurrent_requests_never_exceed_the_request_budget(lab, sessions_proxy):
    path = "/budget/concurrent"
    session = create(sessions_proxy.admin_port, {"hosts": ["public.lab.example"]}, budgets={"requests": 5})
    statuses: list[int] = []
    barrier = threading.Barrier(24)

    def one(n: int) -> None:
        barrier.wait()
        statuses.append(get(sessions_proxy, f"http://public.lab.example:{lab.public.port}{path}?n={n}", session)[0])

    threads = [threading.Thread(target=one, args=(n,)) for n in range(24)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(statuses) == [200] * 5 + [403] * 19
    assert len([p for p in _origin_paths(lab) if p.startswith(path)]) == 5


def test_a_host_budget_holds_for_spellings_of_one_host_and_refuses_another(lab, sessions_proxy):
    """Case, a trailing dot and the default port are one host: they count once; another host is refused."""
    session = create(sessions_proxy.admin_port, {"hosts": ["*.lab.example"]}, budgets={"hosts": 1})
    port = lab.public.port
    for host in ("public.lab.example", "PUBLIC.lab.example", "public.lab.example."):
        assert get(sessions_proxy, f"http://{host}:{port}/budget/host", session)[0] == 200, host
    status, headers, _ = get(sessions_proxy, f"http://other.lab.example:{port}/budget/host", session)
    assert (status, headers.get("x-egresswall-rule")) == (403, "session:budget-hosts")
    sock, status, _, _ = connect(sessions_proxy, f"other.lab.example:{lab.public_tls.port}", session)
    sock.close()
    assert status == 403


# ---- a session never widens the policy ----------------------------------------------------------

def test_a_session_never_admits_a_port_the_admin_listener_or_a_host_the_policy_refuses(lab, sessions_proxy):
    session = create(sessions_proxy.admin_port, {"hosts": ["*.lab.example", "127.0.0.1"],
                                                 "urls": ["http://public.lab.example:25/",
                                                          f"http://127.0.0.1:{sessions_proxy.admin_port}/"]})
    refused = ["http://public.lab.example:25/", f"http://127.0.0.1:{sessions_proxy.admin_port}/v1/sessions",
               f"http://localhost:{sessions_proxy.admin_port}/v1/sessions",
               f"http://denied.lab.example:{lab.public.port}/", f"http://internal.lab.example:{lab.public.port}/"]
    for url in refused:
        status, headers, _ = get(sessions_proxy, url, session, headers={"Authorization": f"Bearer {TOKEN}"})
        assert status == 403 and not headers.get("x-egresswall-rule", "").startswith("session:"), (url, headers)
    for authority in (f"127.0.0.1:{sessions_proxy.admin_port}", f"internal.lab.example:{lab.public_tls.port}",
                      "public.lab.example:25"):
        sock, status, _, _ = connect(sessions_proxy, authority, session)
        sock.close()
        assert status == 403, authority


# ---- secrets: the session's, in every place egresswall writes or answers -------------------------

def test_the_session_secret_is_never_written_or_answered(lab, sessions_proxy):
    session = create(sessions_proxy.admin_port, {"urls": [f"http://public.lab.example:{lab.public.port}/s/ok"]})
    secret, header = session["secret"], session["proxy_authorization"].split(" ", 1)[1]
    wrong = basic_value(session["id"], secret[:-1] + ("A" if secret[-1] != "A" else "B"))
    answers = [get(sessions_proxy, f"http://public.lab.example:{lab.public.port}/s/ok", session),
               get(sessions_proxy, f"http://public.lab.example:{lab.public.port}/s/not-granted", session),
               get(sessions_proxy, f"http://public.lab.example:{lab.public.port}/s/ok", authorization=wrong),
               get(sessions_proxy, f"http://public.lab.example:{lab.public.port}/s/ok",
                   headers={"Proxy-Authorization": session["proxy_authorization"] + "x"})]
    assert [a[0] for a in answers] == [200, 403, 407, 407]
    sock, status, _, body = connect(sessions_proxy, f"other.lab.example:{lab.public_tls.port}", session)
    sock.close()
    assert status == 403
    views = [api(sessions_proxy.admin_port, "GET", f"/v1/sessions/{session['id']}"),
             api(sessions_proxy.admin_port, "GET", "/v1/sessions")]
    assert api(sessions_proxy.admin_port, "DELETE", f"/v1/sessions/{session['id']}")[0] == 204
    answers.append(get(sessions_proxy, f"http://public.lab.example:{lab.public.port}/s/ok", session))
    time.sleep(0.5)
    written = "\n".join([sessions_proxy.log_path.read_text(), sessions_proxy.stderr,
                         sessions_proxy.admin("/metrics")[1], repr(views), body.decode(errors="replace")]
                        + [f"{a[1]}{a[2].decode(errors='replace')}" for a in answers])
    for needle in (secret, header, TOKEN, wrong.split(" ", 1)[1]):
        assert needle not in written
    assert session["id"] in sessions_proxy.log_path.read_text()  # the id is there, in the records


@pytest.mark.parametrize("name", ["Proxy-Authorization", "proxy-authorization", "PROXY-AUTHORIZATION"])
def test_proxy_authorization_in_any_case_never_reaches_an_origin_plain_or_inside_a_tunnel(lab, sessions_proxy, name):
    session = create(sessions_proxy.admin_port, {"hosts": ["public.lab.example"]})
    value = session["proxy_authorization"]
    before = len(lab.public.requests)
    status, _, _ = sessions_proxy.get(f"http://public.lab.example:{lab.public.port}/pa/plain", {name: value})
    assert status == 200
    with _tunnel(sessions_proxy, lab, session) as sock:
        # Inside the tunnel a client may send it too (the CONNECT's session applies; this one is only stripped).
        assert _ask(sock, _inside(lab, "/pa/inside", extra=f"{name}: {value}\r\n{name}: Basic eDp5\r\n"))[0] == 200
    seen = lab.public.requests[before:]
    assert [p for _, p, _ in seen] == ["/pa/plain", "/pa/inside"]
    for _, path, headers in seen:
        assert not [k for k in headers if k.lower() == "proxy-authorization"], (path, headers)
        assert session["secret"] not in repr(headers) and value.split(" ", 1)[1] not in repr(headers)


def test_duplicate_or_folded_proxy_authorization_is_refused_and_reaches_no_origin(lab, sessions_proxy):
    session = create(sessions_proxy.admin_port, {"hosts": ["public.lab.example"]})
    value, url = session["proxy_authorization"], f"http://public.lab.example:{lab.public.port}/pa/dup"
    before = len(lab.public.requests)
    two = (f"GET {url} HTTP/1.1\r\nHost: public.lab.example:{lab.public.port}\r\nProxy-Authorization: {value}\r\n"
           f"Proxy-Authorization: Basic eDp5\r\nConnection: close\r\n\r\n").encode()
    assert parse_response(sessions_proxy.raw(two))[0] == 407
    folded = (f"GET {url} HTTP/1.1\r\nHost: public.lab.example:{lab.public.port}\r\nProxy-Authorization: Basic\r\n"
              f" {value.split(' ', 1)[1]}\r\nConnection: close\r\n\r\n").encode()
    assert parse_response(sessions_proxy.raw(folded))[0] in (400, 407)
    sock, status, _, _ = connect(sessions_proxy, f"public.lab.example:{lab.public_tls.port}",
                                 authorization=f"{value}\r\nProxy-Authorization: Basic eDp5")
    sock.close()
    assert status == 407
    assert len(lab.public.requests) == before


# ---- the admin API ------------------------------------------------------------------------------

@pytest.mark.parametrize("authorization", [None, "", "Bearer", "Bearer ", f"Bearer {TOKEN[:-1]}", f"Bearer {TOKEN}x",
                                           f"Bearer {TOKEN[:16]}", f"Basic {TOKEN}", f"Token {TOKEN}",
                                           f"Bearer {TOKEN.upper()}", f"Bearer {TOKEN} {TOKEN}",
                                           f"Bearer\t{TOKEN}"])
def test_the_admin_api_refuses_every_token_but_the_token(sessions_proxy, authorization):
    conn = socket.create_connection((sessions_proxy.host, sessions_proxy.admin_port), timeout=10)
    auth = f"Authorization: {authorization}\r\n" if authorization is not None else ""
    body = b'{"grants": {"hosts": ["public.lab.example"]}}'
    with conn:
        conn.sendall(f"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        status = parse_response(read_response(conn))[0]
    assert status == 401


def test_two_authorization_headers_are_refused_even_when_one_is_right(sessions_proxy):
    with socket.create_connection((sessions_proxy.host, sessions_proxy.admin_port), timeout=10) as conn:
        conn.sendall(f"GET /v1/sessions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                     f"Authorization: Bearer wrong\r\nConnection: close\r\n\r\n".encode())
        assert parse_response(read_response(conn))[0] == 401


@pytest.mark.parametrize("path", ["/v1/sessions", "/v1/sessions/", "//v1/sessions", "/v1//sessions",
                                  "/v1/%73essions", "/%761/sessions", "/v1/sessions/../sessions",
                                  "/healthz/../v1/sessions", "/./v1/sessions", "/V1/sessions", "/v1/sessions?x=1",
                                  "/v1/sessions#x", "/v1/sessions%2F", "/v1/sessions/x/../", "/v1\\sessions"])
def test_no_spelling_of_a_session_route_is_served_without_the_token(sessions_proxy, path):
    with socket.create_connection((sessions_proxy.host, sessions_proxy.admin_port), timeout=10) as conn:
        conn.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        status, _, body = parse_response(read_response(conn))
    assert status in (400, 401, 404), (path, status, body)
    assert b'"sessions"' not in body


def test_an_admin_body_over_the_bound_is_refused_unread(sessions_proxy):
    body = b'{"grants": {"hosts": [' + b'"a.example", ' * 10000 + b'"b.example"]}}'
    status, _, _ = api(sessions_proxy.admin_port, "POST", "/v1/sessions", raw=body)
    assert status == 413


def test_the_admin_listener_closes_a_request_head_that_never_ends(sessions_proxy):
    """A slow-loris on the admin port (the session API's): a head that never ends must not hold a connection
    (and its memory) for ever."""
    with socket.create_connection((sessions_proxy.host, sessions_proxy.admin_port), timeout=30) as conn:
        conn.sendall(b"GET /v1/sessions HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        closed = False
        while time.monotonic() - started < 25:
            try:
                conn.sendall(b"X-Slow: 1\r\n")
                conn.settimeout(2)
                if conn.recv(65536) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except OSError:
                closed = True
                break
            break  # it answered (a 4xx for the head): not held either
        assert closed or time.monotonic() - started < 25


# ---- one tunnel, one host; one request, one target -----------------------------------------------

@pytest.mark.parametrize("request_text", [
    "GET http://other.lab.example:{port}/t/abs HTTP/1.1\r\nHost: other.lab.example:{port}\r\n\r\n",
    "GET http://other.lab.example:{port}/t/abs HTTP/1.1\r\nHost: public.lab.example:{port}\r\n\r\n",
    "GET /t/host HTTP/1.1\r\nHost: other.lab.example:{port}\r\n\r\n",
    "GET /t/host HTTP/1.1\r\nHost: public.lab.example:1{port}\r\n\r\n",
    "GET /t/host HTTP/1.1\r\nHost: public.lab.example:{port}\r\nHost: other.lab.example:{port}\r\n\r\n",
    "GET /t/host HTTP/1.1\r\nHost: public.lab.example:{port}@other.lab.example\r\n\r\n",
    "GET //other.lab.example:{port}/t/host HTTP/1.1\r\nHost: other.lab.example:{port}\r\n\r\n",
], ids=["absolute-form", "absolute-form-host-agrees", "host-header", "host-port", "two-hosts", "userinfo",
        "network-path"])
def test_a_second_host_inside_one_tunnel_is_refused_and_never_reached(lab, sessions_proxy, request_text):
    session = create(sessions_proxy.admin_port, {"hosts": ["public.lab.example", "other.lab.example"]})
    before = len(lab.public.requests)
    with _tunnel(sessions_proxy, lab, session) as sock:
        # The first request is the tunnel's own (judged as its first message); the second the attack.
        assert _ask(sock, _inside(lab, "/t/first"))[0] == 200
        status, _, body = _ask(sock, request_text.format(port=lab.public.port).encode())
    assert status in (0, 400, 403), body
    seen = lab.public.requests[before:]
    assert [p for _, p, _ in seen] == ["/t/first"] and all(
        h.get("Host", "").startswith("public.lab.example") for _, _, h in seen)


@pytest.mark.parametrize("host_header", ["other.lab.example:{port}", "public.lab.example:1{port}",
                                         "public.lab.example", "public.lab.example:{port}, other.lab.example"])
def test_a_host_header_that_disagrees_with_a_granted_absolute_url_is_refused(lab, sessions_proxy, host_header):
    session = create(sessions_proxy.admin_port, {"urls": [f"http://public.lab.example:{lab.public.port}/h/ok"]})
    before = len(lab.public.requests)
    request = (f"GET http://public.lab.example:{lab.public.port}/h/ok HTTP/1.1\r\n"
               f"Host: {host_header.format(port=lab.public.port)}\r\n"
               f"Proxy-Authorization: {session['proxy_authorization']}\r\nConnection: close\r\n\r\n")
    assert parse_response(sessions_proxy.raw(request.encode()))[0] in (400, 403)
    assert len(lab.public.requests) == before


# ---- a session through the upstream ------------------------------------------------------------

@pytest.mark.parametrize("tunnels", ["--fast-tunnels", "--no-fast-tunnels"])
def test_a_session_narrows_through_the_upstream_and_its_secret_never_reaches_it(
        lab, squid, start_proxy, tmp_path, tunnels):  # noqa: F811
    """squid's access log names the user each request authenticated as: egresswall's, never the session's
    id (which it would be, had the client's Proxy-Authorization been passed on)."""
    policy = upstream_policy(lab, squid, credentials_file(tmp_path)).replace("default: allow",
                                                                             "default: allow\nsession: required")
    proxy = start_proxy(policy, tunnels, "--admin-token-file", str(token_file(tmp_path)))
    session = create(proxy.admin_port, {"urls": [f"http://public.lab.example:{lab.public.port}/up/ok",
                                                 f"https://public.lab.example:{lab.public_tls.port}/"]})
    before = len(lab.public.requests)
    assert get(proxy, f"http://public.lab.example:{lab.public.port}/up/ok", session)[0] == 200
    status, headers, _ = get(proxy, f"http://public.lab.example:{lab.public.port}/up/other?q=x", session)
    assert (status, headers.get("x-egresswall-rule")) == (403, "session:not-granted")
    status, headers, _ = get(proxy, f"http://other.lab.example:{lab.public.port}/up/ok", session)
    assert (status, headers.get("x-egresswall-rule")) == (403, "session:not-granted")
    sock, status, _, _ = connect(proxy, f"public.lab.example:{lab.public_tls.port}", session)
    sock.close()
    assert status == 200
    sock, status, _, _ = connect(proxy, f"other.lab.example:{lab.public_tls.port}", session)
    sock.close()
    assert status == 403
    wait_for_line(squid, f"CONNECT public.lab.example:{lab.public_tls.port}")
    log = "\n".join(access_log(squid))
    assert "/up/other" not in log and "other.lab.example" not in log
    assert session["id"] not in log and f" {USER} " in wait_for_line(squid, "/up/ok")
    assert [p for _, p, _ in lab.public.requests[before:]] == ["/up/ok"]
    assert not [h for _, _, h in lab.public.requests[before:] if any(k.lower() == "proxy-authorization" for k in h)]


def test_requests_pipelined_behind_the_connect_before_its_answer_are_each_judged(lab, sessions_proxy):
    """CONNECT, a granted request and a sibling, in one write before the 200: the sibling never reaches the
    origin (the first message is judged, and so is every request after it)."""
    port = lab.public.port
    session = create(sessions_proxy.admin_port, {"urls": [f"http://public.lab.example:{port}/pipe/ok"]})
    before = len(lab.public.requests)
    connect_head = (f"CONNECT public.lab.example:{port} HTTP/1.1\r\nHost: public.lab.example:{port}\r\n"
                    f"Proxy-Authorization: {session['proxy_authorization']}\r\n\r\n").encode()
    with socket.create_connection((sessions_proxy.host, sessions_proxy.port), timeout=10) as sock:
        sock.sendall(connect_head + _inside(lab, "/pipe/ok") + _inside(lab, "/pipe/other?q=exfiltrated")
                     + _inside(lab, "/pipe/ok"))
        answers = read_all(sock, 5)
    assert answers.startswith(b"HTTP/1.1 200") and b"session:not-granted" in answers
    assert [p for _, p, _ in lab.public.requests[before:]] in (["/pipe/ok"], ["/pipe/ok", "/pipe/ok"])
