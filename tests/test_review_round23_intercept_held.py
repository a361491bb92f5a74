"""Review round 23 (intercepted TLS): what held. Inside an intercepted tunnel every request is decided —
path rules, methods, session URL grants (with queries), body limits, header hygiene, WebSocket upgrades — and
everything refused gets exactly one refusal record with a readable reason and reaches the origin with none of its
bytes. A loopback TLS origin records everything it reads (decrypted).

HTTP/2 is never offered to a client or an origin (``proxy/addons/options.py``; ``tests/test_review_round20.py``
covers the h2 preface and ``tests/test_intercept_alpn.py`` the origin's ALPN), so the h2 shapes of the brief
(several streams, :authority, CONTINUATION, push, RFC 8441) reduce to "the preface is refused"; what is tried
here is HTTP/1.1 inside the decrypted tunnel, on both transports (the front hands an intercepted CONNECT to
mitmproxy; with --no-fast-tunnels mitmproxy takes the CONNECT itself).
"""

from __future__ import annotations

import contextlib
import time

import pytest
from labnet import PUBLIC_IP, self_signed
from proxyproc import TRANSPORTS, ProxyProcess
from review_round23_intercept_origin import RecordingOrigin, open_tunnel, read_quiet, statuses, wait_for, ws_frame
from session_client import api, create, token_file

pytestmark = pytest.mark.integration

HOST = "public.lab.example"
OTHER = "other.lab.example"


@pytest.fixture(scope="module")
def origin(tmp_path_factory):
    context, cert = self_signed([HOST, OTHER], str(tmp_path_factory.mktemp("r23icert")))
    server = RecordingOrigin(context)
    server.cert = cert
    yield server
    server.close()


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def proxy(lab, origin, tmp_path_factory, request):
    folder = tmp_path_factory.mktemp("r23i")
    policy = folder / "policy.yaml"
    policy.write_text(
        "version: 1\nmode: enforce\ndefault: deny\nsession: optional\n"
        f"hosts:\n  deny:\n    - host: {HOST}\n      paths: ['/ok/secret']\n"
        f"  allow:\n    - host: {HOST}\n      intercept: true\n      methods: [GET, POST]\n"
        "      paths: ['/ok/', '/ws/']\n"
        f"    - host: {OTHER}\n      intercept: true\n      websocket: false\n"
        f"ports:\n  http: [{lab.public.port}]\n  connect: [{origin.port}]\n"
        f"addresses:\n  allow: [{PUBLIC_IP}/32]\n"
        f"resolver:\n  nameservers: ['{lab.dns.address}']\n  timeout: 1\n"
        "limits:\n  idle_timeout: 4\n  header_timeout: 4\n  max_request_body: 1000\n")
    process = ProxyProcess(["--policy", str(policy), "--confdir", str(folder / "ca"), "--upstream-ca",
                            str(origin.cert), "--admin-token-file", str(token_file(folder)),
                            *TRANSPORTS[request.param]], folder / "audit.jsonl")
    process.transport = request.param
    yield process
    process.stop()
    assert "Traceback" not in process.stderr, process.stderr[-2000:]
    assert not [e for e in process.outbound() if e["host"] != PUBLIC_IP], process.outbound()


def _exchange(proxy, origin, data: bytes, host: str = HOST, authorization: str | None = None,
              quiet: float = 1.5) -> bytes:
    tls = open_tunnel(proxy, host, origin.port, authorization)
    with contextlib.closing(tls):
        tls.sendall(data.replace(b"PORT", str(origin.port).encode()))
        return read_quiet(tls, quiet)


def _refusals_since(proxy, before: int) -> list[dict]:
    time.sleep(0.3)
    return [r for r in proxy.audit()[before:] if r["verdict"] == "refuse"]


def _one_refusal(proxy, before: int) -> dict:
    refused = _refusals_since(proxy, before)
    assert len(refused) == 1, [(r["rule"], r["reason"], r.get("path"), r.get("url")) for r in refused]
    record = refused[0]
    assert record["reason"] and record["rule"], record
    return record


def _req(method: str, target: str, extra: str = "", host: str = f"{HOST}:PORT", body: bytes = b"") -> bytes:
    return (f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n{extra}".encode() + b"\r\n" + body)


# ---- pipelining: the denied request in the middle never reaches the origin -----------------------------------------

def test_pipelined_requests_are_each_decided_holds(proxy, origin):
    seen = len(origin.seen())
    before = len(proxy.audit())
    answer = _exchange(proxy, origin, _req("GET", "/ok/pipe-a") + _req("GET", "/admin/pipe-b")
                       + _req("GET", "/ok/pipe-c", "Connection: close\r\n"))
    got = origin.seen()[seen:]
    assert b"/admin/pipe-b" not in got, got
    assert b"/ok/pipe-a" in got, (statuses(answer), got)
    assert statuses(answer)[:2] == [200, 403], answer[:400]
    record = _one_refusal(proxy, before)
    assert record["path"] == "/admin/pipe-b"


def test_a_pipelined_body_over_the_limit_is_refused_before_the_origin_holds(proxy, origin):
    seen = len(origin.seen())
    before = len(proxy.audit())
    big = b"BIGBODY-" * 200  # 1600 bytes, limit 1000
    answer = _exchange(proxy, origin, _req("GET", "/ok/first") + _req(
        "POST", "/ok/big", f"Content-Length: {len(big)}\r\n", body=big))
    got = origin.seen()[seen:]
    assert b"BIGBODY" not in got and b"/ok/big" not in got, got
    assert 413 in statuses(answer), answer[:400]
    assert _one_refusal(proxy, before)["rule"] == "limits.max_request_body"


def test_a_chunked_body_over_the_limit_never_reaches_the_origin_holds(proxy, origin):
    seen = len(origin.seen())
    before = len(proxy.audit())
    chunks = b"".join(b"40\r\n" + b"CHUNKLEAK-" * 6 + b"abcd\r\n" for _ in range(20)) + b"0\r\n\r\n"
    answer = _exchange(proxy, origin, _req("POST", "/ok/chunked", "Transfer-Encoding: chunked\r\n", body=chunks))
    got = origin.seen()[seen:]
    assert b"CHUNKLEAK" not in got and b"/ok/chunked" not in got, got
    assert statuses(answer) == [413], answer[:400]
    assert _one_refusal(proxy, before)["rule"] == "limits.max_request_body"


def test_trailers_inside_the_tunnel_are_refused_holds(proxy, origin):
    seen = len(origin.seen())
    before = len(proxy.audit())
    body = b"5\r\nhello\r\n0\r\nX-Leak: TRAILERLEAK\r\n\r\n"
    answer = _exchange(proxy, origin, _req("POST", "/ok/trailer", "Transfer-Encoding: chunked\r\n", body=body))
    got = origin.seen()[seen:]
    assert b"TRAILERLEAK" not in got, got
    assert statuses(answer) == [400], answer[:400]
    assert _one_refusal(proxy, before)["rule"] == "http:trailers"


# ---- upgrades ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "data", "rule"), [
    ("h2c", _req("GET", "/ok/h2c", "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
                 "HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"), "http:upgrade"),
    ("ws-denied-path", _req("GET", "/admin/ws", "Connection: Upgrade\r\nUpgrade: websocket\r\n"
                            "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"), None),
    ("ws-deny-rule-path", _req("GET", "/ok/secret", "Connection: Upgrade\r\nUpgrade: websocket\r\n"
                               "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"), None),
    ("ws-tls-in-tls", _req("GET", "/ok/ws", "Connection: Upgrade\r\nUpgrade: TLS/1.2\r\n"), "http:upgrade"),
])
def test_upgrades_inside_the_tunnel_are_decided_holds(proxy, origin, name, data, rule):
    seen = len(origin.seen())
    before = len(proxy.audit())
    answer = _exchange(proxy, origin, data)
    got = origin.seen()[seen:]
    assert got == b"", got
    assert statuses(answer) and statuses(answer)[0] == 403, answer[:400]
    record = _one_refusal(proxy, before)
    if rule:
        assert record["rule"] == rule


def test_a_websocket_to_a_host_with_websocket_false_is_refused_holds(proxy, origin):
    seen = len(origin.seen())
    before = len(proxy.audit())
    upgrade = "Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n" \
              "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    answer = _exchange(proxy, origin, _req("GET", "/chat", upgrade, host=f"{OTHER}:PORT"), host=OTHER)
    assert origin.seen()[seen:] == b""
    assert statuses(answer) == [403], answer[:300]
    _one_refusal(proxy, before)


# ---- a CONNECT inside the decrypted tunnel ------------------------------------------------------------------------

@pytest.mark.parametrize("authority", [f"{OTHER}:PORT", f"{HOST}:PORT", "127.0.0.3:443"])
def test_a_connect_inside_an_intercepted_tunnel_is_refused_with_one_record_holds(proxy, origin, authority):
    """A CONNECT sent inside the decrypted TLS (mitmproxy's transparent HTTP layer refuses it as a misconfiguration):
    refused, one record, nothing to the origin (the reason's words are test_r23_intercept_connect.py's finding)."""
    seen = len(origin.seen())
    before = len(proxy.audit())
    answer = _exchange(proxy, origin, f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    assert origin.seen()[seen:] == b""
    assert statuses(answer) and statuses(answer)[0] >= 400, answer[:300]
    _one_refusal(proxy, before)  # its words: tests/test_r23_intercept_connect.py


# ---- the target and Host must name the tunnel's host; odd paths match no allow rule --------------------------------

@pytest.mark.parametrize("data", [
    _req("GET", "/ok/x", host=f"{OTHER}:PORT"),
    _req("GET", "/ok/x", host=HOST),  # default port 443, not the tunnel's
    _req("GET", f"https://{OTHER}:PORT/ok/x"),
    _req("GET", "https://127.0.0.3:PORT/ok/x", host="127.0.0.3:PORT"),
    _req("GET", "/ok/x", host=f"{HOST}:PORT\r\nHost: {OTHER}:PORT"),
    _req("GET", "/ok/x", host=f"user@{OTHER}:PORT"),
    _req("GET", "/ok/x", host=f"{OTHER}:PORT, {HOST}:PORT"),
], ids=["other-host", "port-differs", "absolute-other", "absolute-ip", "two-hosts", "userinfo", "host-list"])
def test_a_request_naming_another_host_is_refused_holds(proxy, origin, data):
    seen = len(origin.seen())
    before = len(proxy.audit())
    answer = _exchange(proxy, origin, data)
    assert origin.seen()[seen:] == b"", origin.seen()[seen:]
    assert statuses(answer) and 400 <= statuses(answer)[0] < 500, answer[:300]
    _one_refusal(proxy, before)


ODD_PATHS = ["/ok/../admin", "/ok/%2e%2e/admin", "/ok/..%2fadmin", "/ok/.%2e/admin", "/ok;x/../admin",
             "/ok/..;/admin", "/ok\\..\\admin", "//ok/../admin", "/ok//../admin", "/ok/%2fadmin", "/ok/%5cadmin",
             "/OK/secret", "/ok/SECRET", "/ok/secret;x", "/ok/secr%65t", "/ok/./secret", "/ok//secret",
             "/ok/secret/", "/ok/%73ecret", "?/ok/", "*", "http:/ok/", "/ok/x#frag"]


@pytest.mark.parametrize("path", ODD_PATHS)
def test_odd_paths_match_no_allow_and_every_deny_holds(proxy, origin, path):
    seen = len(origin.seen())
    before = len(proxy.audit())
    answer = _exchange(proxy, origin, _req("GET", path, "Connection: close\r\n"))
    got = origin.seen()[seen:]
    assert got == b"", (path, got)
    assert statuses(answer) and 400 <= statuses(answer)[0] < 500, answer[:300]
    _one_refusal(proxy, before)


# ---- methods, bodies, header hygiene -------------------------------------------------------------------------------

@pytest.mark.parametrize("data", [
    _req("PUT", "/ok/put", "Content-Length: 9\r\n", body=b"PUTSECRET"),
    _req("POST", "/admin/post", "Content-Length: 10\r\nExpect: 100-continue\r\n", body=b"POSTSECRET"),
    _req("GET", "/ok/get", "Content-Length: 9\r\n", body=b"GETSECRET"),
    _req("POST", "/ok/both", "Content-Length: 9\r\nTransfer-Encoding: chunked\r\n",
         body=b"9\r\nBOTHLEAKS\r\n0\r\n\r\n"),
    _req("POST", "/ok/twolen", "Content-Length: 9\r\nContent-Length: 10\r\n", body=b"TWOLENSEC"),
    _req("GET", "/ok/over", "X-Original-URL: /admin\r\n"),
    _req("POST", "/ok/over2", "X-HTTP-Method-Override: DELETE\r\nContent-Length: 0\r\n"),
], ids=["put-method", "post-denied-path-expect", "get-body", "cl-and-te", "two-lengths", "x-original-url",
        "method-override"])
def test_methods_bodies_and_overrides_are_refused_before_the_origin_holds(proxy, origin, data):
    seen = len(origin.seen())
    before = len(proxy.audit())
    answer = _exchange(proxy, origin, data)
    got = origin.seen()[seen:]
    assert got == b"", got
    assert statuses(answer) and 400 <= statuses(answer)[-1] < 500, answer[:300]
    _one_refusal(proxy, before)


def test_hop_by_hop_headers_inside_the_tunnel_are_removed_holds(proxy, origin):
    seen = len(origin.seen())
    answer = _exchange(proxy, origin, _req(
        "GET", "/ok/hygiene", "Connection: X-Hop, close\r\nX-Hop: HOPLEAK\r\n"
        "Proxy-Authorization: Basic UFJPWFlMRUFL\r\n"
        "Proxy_Authorization: Basic UFJPWFkyTEVBSw==\r\nTE: trailers\r\nKeep-Alive: timeout=KALEAK\r\n"
        "Proxy-Connection: keep-alive\r\nTrailer: X-T\r\n"))
    assert statuses(answer) == [200], answer[:300]
    got = origin.seen()[seen:]
    for leak in (b"HOPLEAK", b"UFJPWFlMRUFL", b"UFJPWFkyTEVBSw", b"KALEAK", b"Proxy-Connection", b"X-T"):
        assert leak not in got, (leak, got)


# ---- sessions: URL grants with queries, an end inside an open tunnel ----------------------------------------------

GRANTED = "/ok/page?q=1&lang=en"


@pytest.mark.parametrize("target", [
    "/ok/page?q=1&lang=en&x=LEAK", "/ok/page?q=1", "/ok/page", "/ok/page?lang=en&q=1", "/ok/page?q=1&lang=en;LEAK",
    "/ok/page;LEAK?q=1&lang=en", "/ok/page/?q=1&lang=en", "/ok/page/LEAK?q=1&lang=en", "/ok/Page?q=1&lang=en",
    "/ok/page?q=1&lang=en&", "/ok/page?q=1%26lang=en", "/ok/page%3Fq=1&lang=en", "/ok//page?q=1&lang=en",
    "/ok/x/../page?q=1&lang=en", "/ok/page?q=1&lang=en#LEAK", "/ok/page?q=1&LANG=en",
])
def test_a_url_grant_holds_each_request_to_its_exact_url_and_query_holds(proxy, origin, target):
    session = create(proxy.admin_port, {"urls": [f"https://{HOST}:{origin.port}{GRANTED}"]})
    auth = session["proxy_authorization"]
    seen = len(origin.seen())
    before = len(proxy.audit())
    answer = _exchange(proxy, origin, _req("GET", target, "Connection: close\r\n"), authorization=auth)
    got = origin.seen()[seen:]
    assert got == b"", got
    assert statuses(answer) and 400 <= statuses(answer)[0] < 500, answer[:300]
    _one_refusal(proxy, before)
    # the granted URL itself passes (control)
    ok = _exchange(proxy, origin, _req("GET", GRANTED, "Connection: close\r\n"), authorization=auth)
    assert statuses(ok) == [200], ok[:300]


def test_a_request_inside_a_tunnel_after_its_session_ended_is_refused_holds(proxy, origin):
    session = create(proxy.admin_port, {"hosts": [HOST]})
    tls = open_tunnel(proxy, HOST, origin.port, session["proxy_authorization"])
    with contextlib.closing(tls):
        tls.sendall(_req("GET", "/ok/before-end").replace(b"PORT", str(origin.port).encode()))
        first = read_quiet(tls, 1.0)
        assert statuses(first) == [200], first[:200]
        assert api(proxy.admin_port, "DELETE", f"/v1/sessions/{session['id']}")[0] == 204
        seen = len(origin.seen())
        before = len(proxy.audit())
        tls.sendall(_req("GET", "/ok/after-end-LEAK").replace(b"PORT", str(origin.port).encode()))
        answer = read_quiet(tls, 1.5)
    assert b"after-end-LEAK" not in origin.seen()[seen:]
    assert statuses(answer)[:1] == [403], answer[:300]
    record = _one_refusal(proxy, before)
    assert record["rule"] == "session:ended", record


def test_a_websocket_in_an_intercepted_tunnel_is_cut_when_its_session_ends_holds(proxy, origin):
    """README: an allowed WebSocket opened under a session is closed once the session has ended; a message sent
    after that must not reach the origin."""
    session = create(proxy.admin_port, {"hosts": [HOST]})
    tls = open_tunnel(proxy, HOST, origin.port, session["proxy_authorization"])
    with contextlib.closing(tls):
        tls.sendall(_req("GET", "/ws/chat", "Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
                         "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n").replace(b"PORT", str(origin.port).encode()))
        head = b""
        tls.settimeout(5)
        while b"\r\n\r\n" not in head:
            head += tls.recv(4096)
        assert head.startswith(b"HTTP/1.1 101"), head[:200]
        tls.sendall(ws_frame(b"before-end"))
        assert wait_for(lambda: b"before-end" in origin.messages, 5), origin.messages
        assert api(proxy.admin_port, "DELETE", f"/v1/sessions/{session['id']}")[0] == 204
        time.sleep(2.5)  # the sweep looks every second
        with contextlib.suppress(OSError):
            tls.sendall(ws_frame(b"AFTER-END-LEAK"))
        read_quiet(tls, 1.0)
    time.sleep(0.3)
    assert b"AFTER-END-LEAK" not in origin.messages, origin.messages
    closing = [r for r in proxy.audit() if r.get("session") == session["id"] and r["rule"] == "session:ended"]
    assert closing, [r for r in proxy.audit() if r.get("session") == session["id"]]


# ---- header names mitmproxy's reader would split differently --------------------------------------------------------

@pytest.mark.parametrize("extra", [
    f"Host : {OTHER}:PORT\r\n", "X-Original-URL : /admin\r\n", "Transfer-Encoding : chunked\r\n",
    "X-Original-URL\t: /admin\r\n", " X-Folded: x\r\n",
], ids=["host-space", "override-space", "te-space", "override-tab", "leading-fold"])
def test_header_names_with_whitespace_are_refused_holds(proxy, origin, extra):
    seen = len(origin.seen())
    before = len(proxy.audit())
    answer = _exchange(proxy, origin, b"GET /ok/ws-name HTTP/1.1\r\n" + extra.encode() + b"Host: "
                       + f"{HOST}:PORT".encode() + b"\r\n\r\n")
    assert origin.seen()[seen:] == b"", origin.seen()[seen:]
    assert statuses(answer) and 400 <= statuses(answer)[0] < 500, answer[:300]
    _one_refusal(proxy, before)


# ---- a session's tunnel: another session's credentials inside change nothing; its byte budget holds -------------

def test_another_sessions_credentials_inside_the_tunnel_do_not_widen_it_holds(proxy, origin):
    narrow = create(proxy.admin_port, {"urls": [f"https://{HOST}:{origin.port}/ok/only"]})
    wide = create(proxy.admin_port, {"hosts": [HOST]})
    seen = len(origin.seen())
    before = len(proxy.audit())
    answer = _exchange(proxy, origin, _req("GET", "/ok/widened", f"Proxy-Authorization: {wide['proxy_authorization']}"
                                           "\r\nConnection: close\r\n"), authorization=narrow["proxy_authorization"])
    assert b"/ok/widened" not in origin.seen()[seen:]
    assert statuses(answer) == [403], answer[:300]
    record = _one_refusal(proxy, before)
    assert record["rule"] == "session:not-granted" and record["session"] == narrow["id"], record


def test_a_chunked_body_past_the_sessions_request_bytes_never_reaches_the_origin_holds(proxy, origin):
    session = create(proxy.admin_port, {"hosts": [HOST]}, budgets={"request_bytes": 1500})
    auth = session["proxy_authorization"]
    first = _exchange(proxy, origin, _req("POST", "/ok/b1", "Content-Length: 600\r\nConnection: close\r\n",
                                          body=b"a" * 600), authorization=auth)
    assert statuses(first) == [200], first[:300]
    seen = len(origin.seen())
    before = len(proxy.audit())
    body = b"384\r\n" + b"BUDGETLEAK" * 90 + b"\r\n0\r\n\r\n"  # 900 bytes of data, chunked
    answer = _exchange(proxy, origin, _req("POST", "/ok/b2", "Transfer-Encoding: chunked\r\nConnection: close\r\n",
                                           body=body), authorization=auth)
    assert b"BUDGETLEAK" not in origin.seen()[seen:]
    assert statuses(answer) == [403], answer[:300]
    assert _one_refusal(proxy, before)["rule"] == "session:budget-request-bytes"
