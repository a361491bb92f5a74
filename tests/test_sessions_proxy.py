"""Session grants through the real proxy, on both tunnel paths (the front's relay and mitmproxy's layers):
a session narrows what one client reaches to what it was granted, and never widens the policy."""

from __future__ import annotations

import json
import ssl
import time
import uuid

import pytest
from dnslab import Record
from labnet import PUBLIC_IP
from metrics_page import value as metric_value
from proxyproc import TRANSPORTS, ProxyProcess, both_transports, read_response
from session_client import TOKEN, api, connect, create, get, token_file

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("internal_saw_nothing")]


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def proxy(lab, tmp_path_factory, request):
    folder = tmp_path_factory.mktemp("sessions")
    policy = folder / "policy.yaml"
    # Loopback clients are agents, and agents must present a session; the open web otherwise (default allow).
    policy.write_text(lab.policy_text(
        "hosts:\n  deny:\n    - denied.lab.example\n"
        "roles:\n  - name: agents\n    clients: [127.0.0.1/32]\n    session: required\n").replace(
        f"connect: [{', '.join(map(str, sorted({443, lab.public_tls.port})))}]",
        f"connect: [{', '.join(map(str, sorted({443, lab.public_tls.port, lab.public.port})))}]"))
    mode = TRANSPORTS[request.param]
    process = ProxyProcess(["--policy", str(policy), "--admin-token-file", str(token_file(folder)), *mode],
                           folder / "audit.jsonl")
    yield process
    process.stop()
    assert not [e for e in process.outbound() if e["host"] != PUBLIC_IP], process.outbound()
    assert TOKEN not in process.log_path.read_text()


def fresh_name(lab) -> str:
    """A lab name of its own (resolving to the public upstream), so a test can tell whether it was looked up."""
    name = f"n{uuid.uuid4().hex[:10]}.lab.example"
    lab.dns.set(name, [Record("A", PUBLIC_IP)])
    return name


def records_of(proxy: ProxyProcess, predicate, timeout: float = 5) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        found = [r for r in proxy.audit() if predicate(r)]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def read_tls(sock, path: str, cert_file) -> bytes:
    context = ssl.create_default_context(cafile=str(cert_file))
    with context.wrap_socket(sock, server_hostname="public.lab.example") as tls:
        tls.sendall(f"GET {path} HTTP/1.1\r\nHost: public.lab.example\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := tls.recv(4096):
            data += chunk
    return data


# ---- grants ------------------------------------------------------------------------------------

def test_a_granted_host_is_read_over_plain_http_and_a_tunnel(lab, proxy):
    session = create(proxy.admin_port, {"hosts": ["public.lab.example"]})
    status, _, body = get(proxy, f"http://public.lab.example:{lab.public.port}/granted", session)
    assert (status, body) == (200, b"hello from public /granted")
    sock, status, _, _ = connect(proxy, f"public.lab.example:{lab.public_tls.port}", session)
    assert status == 200
    assert read_tls(sock, "/granted-tls", lab.cert_file).endswith(b"/granted-tls")
    records = records_of(proxy, lambda r: r.get("session") == session["id"] and r["event"] == "tunnel")
    assert records and records[0]["host"] == "public.lab.example"
    mine = [r for r in proxy.audit() if r.get("session") == session["id"]]
    assert {r["event"] for r in mine} >= {"decision", "response", "tunnel"}


def test_an_ungranted_host_the_policy_allows_is_refused_and_never_looked_up(lab, proxy):
    session = create(proxy.admin_port, {"hosts": ["public.lab.example"]})
    name = fresh_name(lab)
    path = f"/exfil-{uuid.uuid4().hex}"
    status, headers, body = get(proxy, f"http://{name}:{lab.public.port}{path}?q=secret-conversation", session)
    assert status == 403 and headers["x-egresswall-rule"] == "session:not-granted"
    refusal = json.loads(body)
    assert refusal["rule"] == "session:not-granted" and session["id"] in refusal["reason"]
    assert "secret-conversation" not in refusal["reason"]
    before = lab.public_tls.connections
    sock, status, headers, body = connect(proxy, f"{name}:{lab.public_tls.port}", session)
    sock.close()
    assert status == 403 and json.loads(body)["rule"] == "session:not-granted"
    assert not [p for _, p, _ in lab.public.requests if p.startswith(path)]  # its stand-in saw nothing
    assert lab.public_tls.connections == before
    assert not lab.dns.queried(name)  # refused before resolving: no DNS side channel
    refused = records_of(proxy, lambda r: r["host"] == name and r["verdict"] == "refuse")
    assert len(refused) == 2 and {r["rule_id"] for r in refused} == {"session:not-granted"}
    assert all(r["session"] == session["id"] and r["stage"] == "session" for r in refused)


def test_an_exact_url_grant_admits_that_url_and_refuses_a_sibling_path(lab, proxy):
    base = f"http://public.lab.example:{lab.public.port}"
    before = len(lab.public.requests)  # the lab's origin is shared: only this test's requests count
    session = create(proxy.admin_port, {"urls": [f"{base}/docs/page?id=1"]})
    status, _, body = get(proxy, f"{base}/docs/page?id=1", session)
    assert status == 200 and body == b"hello from public /docs/page?id=1"
    for sibling in ("/docs/other", "/docs/page?id=2", "/docs/page", "/docs/x/../page?id=1"):
        status, headers, _ = get(proxy, base + sibling, session)
        assert (status, headers.get("x-egresswall-rule")) == (403, "session:not-granted"), sibling
    assert not [p for _, p, _ in lab.public.requests[before:] if p.startswith("/docs/") and p != "/docs/page?id=1"]


def test_an_exact_url_grant_holds_inside_a_tunnel_to_a_plain_http_port(lab, proxy):
    authority = f"public.lab.example:{lab.public.port}"
    session = create(proxy.admin_port, {"urls": [f"http://{authority}/in-tunnel"]})
    sock, status, _, _ = connect(proxy, authority, session)
    assert status == 200  # the tunnel: only its host and port are judged
    with sock:
        sock.sendall(f"GET /in-tunnel HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        first = read_response(sock)
        assert first.startswith(b"HTTP/1.1 200") and first.endswith(b"/in-tunnel")
        sock.sendall(f"GET /in-tunnel-sibling HTTP/1.1\r\nHost: {authority}\r\nAccept: application/json\r\n"
                     f"\r\n".encode())
        second = read_response(sock)
    assert second.startswith(b"HTTP/1.1 403") and b"session:not-granted" in second
    assert not [p for _, p, _ in lab.public.requests if p == "/in-tunnel-sibling"]


def test_a_session_never_readmits_a_non_global_address_or_a_denied_host(lab, proxy):
    session = create(proxy.admin_port, {"hosts": ["internal.lab.example", "denied.lab.example", "127.0.0.3"]})
    status, headers, body = get(proxy, f"http://internal.lab.example:{lab.public.port}/x", session)
    assert status == 403 and json.loads(body)["stage"] == "address"
    status, headers, body = get(proxy, f"http://127.0.0.3:{lab.public.port}/x", session)
    assert status == 403 and json.loads(body)["stage"] == "address"
    status, headers, body = get(proxy, f"http://denied.lab.example:{lab.public.port}/x", session)
    assert status == 403 and json.loads(body)["stage"] == "host"
    sock, status, _, body = connect(proxy, f"internal.lab.example:{lab.public_tls.port}", session)
    sock.close()
    assert status == 403 and json.loads(body)["stage"] == "address"
    refused = records_of(proxy, lambda r: r.get("session") == session["id"] and r["verdict"] == "refuse")
    assert len(refused) == 4


# ---- time and budgets --------------------------------------------------------------------------

def test_an_expired_session_is_refused(lab, proxy):
    session = create(proxy.admin_port, {"hosts": ["public.lab.example"]}, ttl=1)
    url = f"http://public.lab.example:{lab.public.port}/soon-expired"
    assert get(proxy, url, session)[0] == 200
    time.sleep(1.3)
    status, headers, body = get(proxy, url, session)
    assert status == 403 and headers["x-egresswall-rule"] == "session:expired"
    sock, status, _, body = connect(proxy, f"public.lab.example:{lab.public_tls.port}", session)
    sock.close()
    assert status == 403 and json.loads(body)["rule"] == "session:expired"


def test_an_extended_session_goes_on(lab, proxy):
    session = create(proxy.admin_port, {"hosts": ["public.lab.example"]}, ttl=1)
    status, _, body = api(proxy.admin_port, "POST", f"/v1/sessions/{session['id']}/extend", {"ttl": 600})
    assert status == 200 and body["expires"] > session["expires"]
    time.sleep(1.3)
    assert get(proxy, f"http://public.lab.example:{lab.public.port}/extended", session)[0] == 200


@pytest.mark.parametrize("call", [("POST", "/extend"), ("PATCH", "")])
def test_an_expired_session_cannot_be_extended(lab, proxy, call):
    """Expired is ended (review round 22): the store keeps an expired session an hour only to tell its requests
    session:expired; extending it then brought it back with its counters. Now 409 "expired", and its requests
    stay refused."""
    session = create(proxy.admin_port, {"hosts": ["public.lab.example"]}, ttl=1)
    time.sleep(1.3)
    method, suffix = call
    status, _, body = api(proxy.admin_port, method, f"/v1/sessions/{session['id']}{suffix}", {"ttl": 600})
    assert status == 409 and body["error"] == "expired" and "create a new one" in body["reason"], (status, body)
    status, _, answer = get(proxy, f"http://public.lab.example:{lab.public.port}/revived", session)
    assert status == 403 and json.loads(answer)["rule"] == "session:expired"


def test_an_exhausted_request_budget_is_refused(lab, proxy):
    session = create(proxy.admin_port, {"hosts": ["public.lab.example"]}, budgets={"requests": 2})
    url = f"http://public.lab.example:{lab.public.port}/budget"
    assert [get(proxy, url, session)[0] for _ in range(2)] == [200, 200]
    status, headers, _ = get(proxy, url, session)
    assert status == 403 and headers["x-egresswall-rule"] == "session:budget-requests"
    sock, status, headers, _ = connect(proxy, f"public.lab.example:{lab.public_tls.port}", session)
    sock.close()
    assert status == 403 and headers["x-egresswall-rule"] == "session:budget-requests"
    status, _, view = api(proxy.admin_port, "GET", f"/v1/sessions/{session['id']}")
    assert status == 200 and view["usage"]["requests"] == 2


def test_a_host_budget_and_a_response_byte_budget_are_refused(lab, proxy):
    session = create(proxy.admin_port, {"hosts": ["*.lab.example"]}, budgets={"hosts": 1})
    assert get(proxy, f"http://public.lab.example:{lab.public.port}/one-host", session)[0] == 200
    status, headers, _ = get(proxy, f"http://other.lab.example:{lab.public.port}/x", session)
    assert status == 403 and headers["x-egresswall-rule"] == "session:budget-hosts"
    assert get(proxy, f"http://public.lab.example:{lab.public.port}/same-host", session)[0] == 200
    session = create(proxy.admin_port, {"hosts": ["*.lab.example"]}, budgets={"response_bytes": 100})
    assert get(proxy, f"http://public.lab.example:{lab.public.port}/bytes/150", session)[0] == 200
    deadline = time.monotonic() + 5  # the bytes are counted when the response ends
    while True:
        status, headers, _ = get(proxy, f"http://public.lab.example:{lab.public.port}/bytes/1", session)
        if status == 403 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert status == 403 and headers["x-egresswall-rule"] == "session:budget-response-bytes"


# ---- identity on the wire ----------------------------------------------------------------------

def test_proxy_authorization_never_reaches_the_origin(lab, proxy):
    session = create(proxy.admin_port, {"hosts": ["public.lab.example"]})
    path = f"/echo-{uuid.uuid4().hex}"
    assert get(proxy, f"http://public.lab.example:{lab.public.port}{path}", session)[0] == 200
    authority = f"public.lab.example:{lab.public.port}"
    sock, status, _, _ = connect(proxy, authority, session)
    assert status == 200
    with sock:  # inside the tunnel too, where the header means nothing and must not travel on
        sock.sendall(f"GET {path}-tunnel HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n"
                     f"Proxy-Authorization: {session['proxy_authorization']}\r\n\r\n".encode())
        assert read_response(sock).startswith(b"HTTP/1.1 200")
    sent = [h for _, p, h in lab.public.requests if p.startswith(path)]
    assert len(sent) == 2
    for headers in sent:
        assert "proxy-authorization" not in {k.lower() for k in headers}
        assert session["secret"] not in json.dumps(headers)
    assert session["secret"] not in proxy.log_path.read_text()  # nor the audit log


def test_a_wrong_secret_or_an_unknown_session_gets_407_with_proxy_authenticate(lab, proxy):
    import base64

    session = create(proxy.admin_port, {"hosts": ["public.lab.example"]})
    wrong = "Basic " + base64.b64encode(f"{session['id']}:not-the-secret".encode()).decode()
    unknown = "Basic " + base64.b64encode(b"s000000000000000000000000:whatever").decode()
    url = f"http://public.lab.example:{lab.public.port}/wrong-secret"
    for value in (wrong, unknown, "Basic !!!", "Bearer abc"):
        status, headers, body = get(proxy, url, authorization=value)
        assert status == 407, value
        assert headers["proxy-authenticate"].startswith("Basic realm=")
        assert json.loads(body)["rule"] == "session:credentials"
        sock, status, headers, _ = connect(proxy, f"public.lab.example:{lab.public_tls.port}", authorization=value)
        sock.close()
        assert status == 407 and headers["proxy-authenticate"].startswith("Basic realm=")
    assert not [p for _, p, _ in lab.public.requests if p == "/wrong-secret"]


def test_a_role_that_requires_a_session_refuses_a_request_without_one(lab, proxy):
    status, headers, body = get(proxy, f"http://public.lab.example:{lab.public.port}/no-session")
    assert status == 407 and headers["proxy-authenticate"].startswith("Basic")
    assert json.loads(body)["rule"] == "session:required" and json.loads(body)["error"] == "unauthenticated"
    sock, status, headers, _ = connect(proxy, f"public.lab.example:{lab.public_tls.port}")
    sock.close()
    assert status == 407 and headers["x-egresswall-rule"] == "session:required"
    assert not [p for _, p, _ in lab.public.requests if p == "/no-session"]


def test_an_ended_session_is_refused(lab, proxy):
    session = create(proxy.admin_port, {"hosts": ["public.lab.example"]})
    url = f"http://public.lab.example:{lab.public.port}/ended"
    assert get(proxy, url, session)[0] == 200
    assert api(proxy.admin_port, "DELETE", f"/v1/sessions/{session['id']}")[0] == 204
    assert get(proxy, url, session)[0] == 407
    assert api(proxy.admin_port, "GET", f"/v1/sessions/{session['id']}")[0] == 404
    assert api(proxy.admin_port, "DELETE", f"/v1/sessions/{session['id']}")[0] == 404


# ---- the admin API -----------------------------------------------------------------------------

def test_the_admin_api_refuses_a_missing_or_wrong_token(proxy):
    # a byte that is not UTF-8 (sent as Latin-1) was a 500 with no reason (review round 17)
    for token in (None, "wrong-token-0123456789", TOKEN + "x", "", "\xe9", TOKEN + "\xff\xfe"):
        status, headers, body = api(proxy.admin_port, "POST", "/v1/sessions", {"grants": {"hosts": ["a.example"]}},
                                    token=token)
        assert status == 401, token
        assert body["error"] == "unauthorized" and headers["www-authenticate"].startswith("Bearer")
        assert api(proxy.admin_port, "GET", "/v1/sessions", token=token)[0] == 401
    assert api(proxy.admin_port, "GET", "/healthz", token=None)[0] == 200  # the plain routes need no token


def test_the_admin_api_refuses_malformed_json_and_invalid_grants_with_reason_and_field(proxy):
    port = proxy.admin_port
    # ... and JSON nested deeper than the decoder's stack (json.loads raised RecursionError: a 500).
    for raw in (b"{", b'{"grants": {"hosts": ["a.example"]}, "grants": {}}', b"[1,", b"\xff",
                b"[" * 30_000 + b"]" * 30_000, b'{"grants": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"):
        status, _, body = api(port, "POST", "/v1/sessions", raw=raw)
        assert status == 400 and body["error"] == "malformed", raw
    status, _, body = api(port, "POST", "/v1/sessions", raw=b'{"grants": {}}', content_type="text/plain")
    assert status == 400 and body["error"] == "malformed"
    # a body over the admin listener's bound: aiohttp's plain-text 413, now the API's JSON with a reason
    status, _, body = api(port, "POST", "/v1/sessions", raw=b'{"grants": {"hosts": ["' + b"a" * 70_000 + b'"]}}')
    assert status == 413 and body["error"] == "too-large" and "65536 bytes" in body["reason"], body
    cases = [
        ({"grants": {"hosts": ["*bad.example"]}}, "grants.hosts[0]", "'*' is allowed only"),
        ({"grants": {"urls": ["https://user@public.lab.example/"]}}, "grants.urls[0]", "userinfo"),
        ({"grants": {"urls": ["ftp://public.lab.example/"]}}, "grants.urls[0]", "an http or https URL"),
        ({"grants": {"urls": ["https://public.lab.example/a/../b"]}}, "grants.urls[0]", "dot segments"),
        ({"grants": {"hosts": ["a.example"]}, "ttl": -5}, "ttl", "expected a value > 0"),
        ({"grants": {"hosts": ["a.example"]}, "budgets": {"requests": "10"}}, "budgets.requests", "expected integer"),
        ({"grants": {"hosts": ["a.example"]}, "secret": "mine"}, "secret", "unknown key 'secret'"),
        ({"grants": {}}, "grants", "grants nothing"),
        ({}, "", "missing key"),
    ]
    for body_sent, field, words in cases:
        status, _, body = api(port, "POST", "/v1/sessions", body_sent)
        assert status == 400 and body["error"] == "invalid", body_sent
        assert body["field"] == field and words in body["reason"], body


def test_a_created_session_can_be_read_without_its_secret(proxy):
    session = create(proxy.admin_port, {"urls": ["https://public.lab.example/a"]}, budgets={"requests": 5})
    assert session["proxy"] == {"username": session["id"], "password": session["secret"]}
    status, _, view = api(proxy.admin_port, "GET", f"/v1/sessions/{session['id']}")
    assert status == 200 and view["grants"]["urls"] == ["https://public.lab.example/a"]
    assert view["budgets"] == {"requests": 5} and "secret" not in json.dumps(view)
    assert session["id"] in api(proxy.admin_port, "GET", "/v1/sessions")[2]["sessions"]


def test_metrics_count_sessions_and_refusals_by_reason_without_per_session_labels(lab, proxy):
    session = create(proxy.admin_port, {"hosts": ["public.lab.example"]})
    get(proxy, f"http://other.lab.example:{lab.public.port}/metrics-probe", session)
    status, text = proxy.admin("/metrics")
    assert status == 200
    assert metric_value(text, "egresswall_session_refusals_total", reason="session:not-granted") >= 1
    assert metric_value(text, "egresswall_sessions_created_total") >= 1
    assert metric_value(text, "egresswall_sessions_active") is not None
    assert session["id"] not in text


def test_the_admin_api_is_off_without_a_token_file(lab, start_proxy):
    proxy = start_proxy(lab.policy_text())
    status, _, _ = api(proxy.admin_port, "POST", "/v1/sessions", {"grants": {"hosts": ["a.example"]}})
    assert status == 404
    assert api(proxy.admin_port, "GET", "/v1/sessions")[0] == 404
    assert proxy.admin("/healthz")[0] == 200 and proxy.admin("/readyz")[0] == 200
    # And sessions are off: a Proxy-Authorization header is not judged (it is still stripped).
    status, _, _ = get(proxy, f"http://public.lab.example:{lab.public.port}/sessions-off",
                       authorization="Basic dXNlcjpwYXNz")
    assert status == 200


# ---- an intercepted tunnel: the exact URL holds for HTTPS too -----------------------------------

@pytest.fixture(scope="module")
def intercepting(lab, tmp_path_factory):
    folder = tmp_path_factory.mktemp("sessions-intercept")
    policy = folder / "policy.yaml"
    policy.write_text(lab.policy_text("session: required\nhosts:\n  allow:\n    - host: public.lab.example\n"
                                      "      intercept: true\n"))
    process = ProxyProcess(["--policy", str(policy), "--confdir", str(folder / "ca"), "--upstream-ca",
                            str(lab.cert_file), "--admin-token-file", str(token_file(folder))], folder / "audit.jsonl")
    yield process
    process.stop()


def _intercepted_get(proxy: ProxyProcess, lab, session: dict, path: str) -> bytes:
    sock, status, _, _ = connect(proxy, f"public.lab.example:{lab.public_tls.port}", session)
    assert status == 200
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # mitmproxy's leaf: not what is tested here
    with context.wrap_socket(sock, server_hostname="public.lab.example") as tls:
        tls.sendall(f"GET {path} HTTP/1.1\r\nHost: public.lab.example:{lab.public_tls.port}\r\nConnection: close\r\n"
                    f"Accept: application/json\r\n\r\n".encode())
        return read_response(tls)


def test_inside_an_intercepted_tunnel_the_connects_session_holds_each_request_to_its_exact_url(lab, intercepting):
    link = f"https://public.lab.example:{lab.public_tls.port}/read/this"
    session = create(intercepting.admin_port, {"urls": [link]}, budgets={"requests": 10})
    assert _intercepted_get(intercepting, lab, session, "/read/this").startswith(b"HTTP/1.1 200")
    refused = _intercepted_get(intercepting, lab, session, "/read/other?q=x")
    assert refused.startswith(b"HTTP/1.1 403") and b"session:not-granted" in refused
    assert not [p for _, p, _ in lab.public_tls.requests if p.startswith("/read/other")]
    inside = [r for r in intercepting.decisions() if r.get("session") == session["id"] and r["method"] == "GET"]
    assert [r["verdict"] for r in inside] == ["allow", "refuse"]
    # The CONNECT and each request inside it count against the session's requests.
    assert api(intercepting.admin_port, "GET", f"/v1/sessions/{session['id']}")[2]["usage"]["requests"] == 3


@both_transports
def test_where_sessions_are_optional_a_presented_session_still_narrows(lab, start_proxy, tmp_path):
    proxy = start_proxy(lab.policy_text(), "--admin-token-file", str(token_file(tmp_path)))
    session = create(proxy.admin_port, {"hosts": ["public.lab.example"]})
    assert get(proxy, f"http://other.lab.example:{lab.public.port}/optional")[0] == 200  # no session: the policy
    status, headers, _ = get(proxy, f"http://other.lab.example:{lab.public.port}/optional", session)
    assert status == 403 and headers["x-egresswall-rule"] == "session:not-granted"
    assert get(proxy, f"http://public.lab.example:{lab.public.port}/optional", session)[0] == 200
    status, headers, _ = get(proxy, f"http://public.lab.example:{lab.public.port}/optional",
                             authorization="Basic " + "czE6eA==")
    assert status == 407  # sessions are on: a header that names no session is refused, never ignored


def test_session_refusals_are_json_an_agent_can_read(lab, proxy):
    """Issue #17's refusal body for the session kinds: every field, the rule and a hint for the operator."""
    session = create(proxy.admin_port, {"hosts": ["public.lab.example"]})
    answers = {
        "session:not-granted": get(proxy, f"http://other.lab.example:{lab.public.port}/json", session),
        "session:required": get(proxy, f"http://public.lab.example:{lab.public.port}/json"),
    }
    for rule, (status, headers, body) in answers.items():
        assert status == (403 if rule == "session:not-granted" else 407), body
        assert headers["content-type"] == "application/json", (headers, body)
        answer = json.loads(body)
        assert {"error", "rule", "rule_id", "reason", "host", "port", "hint"} <= set(answer), answer
        assert answer["rule"] == rule == headers["x-egresswall-rule"], answer
        assert answer["reason"] and answer["hint"] and answer["port"] == lab.public.port
        assert session["secret"] not in body.decode()
