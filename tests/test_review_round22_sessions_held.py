"""Review round 22 (sessions): attacks on session grants and the session API that HELD (both transports)."""

from __future__ import annotations

import contextlib
import socket
import ssl
import time
import uuid

import pytest
from dnslab import Record
from labnet import PUBLIC_IP
from proxyproc import both_transports, parse_response, read_response
from session_client import api, create, token_file
from session_client import connect as session_connect

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("internal_saw_nothing")]


def _raw(proxy, data: bytes) -> tuple[int, dict[str, str], bytes]:
    with socket.create_connection((proxy.host, proxy.port), timeout=5) as sock:
        sock.sendall(data)
        return parse_response(read_response(sock))


def _fresh(lab) -> str:
    name = f"conv-{uuid.uuid4().hex[:10]}.lab.example"
    lab.dns.set(name, [Record("A", PUBLIC_IP)])
    return name


@both_transports
def test_spellings_of_a_granted_url_reach_only_that_url_holds(lab, start_proxy, tmp_path):
    """Case, a trailing dot and an escaped unreserved character are the granted URL; a fragment, ';' parameters,
    userinfo and a zero-padded port are refused and never reach the origin."""
    proxy = start_proxy(lab.policy_text("session: required\n"), "--admin-token-file", str(token_file(tmp_path)))
    port = lab.public.port
    session = create(proxy.admin_port, {"urls": [f"http://public.lab.example:{port}/page?x=1"]})
    auth = session["proxy_authorization"]
    tag = uuid.uuid4().hex[:6]
    answers = {}
    before = len(lab.public.requests)  # the session-wide origin: only this test's requests are looked at
    for target in (f"http://PUBLIC.lab.example.:{port}/page?x=1", f"http://public.lab.example:{port}/p%61ge?x=1",
                   f"http://public.lab.example:{port}/page?x=1#{tag}", f"http://public.lab.example:{port}/page;{tag}?x=1",
                   f"http://{tag}@public.lab.example:{port}/page?x=1", f"http://public.lab.example:0{port}/page?x=1",
                   f"http://public.lab.example:{port}/page?x=1&{tag}", f"http://public.lab.example:{port}/page/?x=1"):
        answers[target] = _raw(proxy, (f"GET {target} HTTP/1.1\r\nHost: public.lab.example:{port}\r\n"
                                       f"Proxy-Authorization: {auth}\r\nConnection: close\r\n\r\n").encode())[0]
    assert list(answers.values()) == [200, 200, 403, 403, 403, 403, 403, 403], answers
    assert not [p for _, p, _ in lab.public.requests[before:] if tag in p or p.startswith("/page/")]


@both_transports
def test_a_passed_through_tunnel_whose_sni_names_another_host_is_refused_unlooked_up_and_recorded_holds(
        lab, start_proxy, tmp_path):
    """CONNECT to the granted host, then a ClientHello naming a client-chosen name: refused ``tls:sni``, the name
    is never looked up (no DNS channel), and the refusal line carries the session."""
    proxy = start_proxy(lab.policy_text("session: required\n"), "--admin-token-file", str(token_file(tmp_path)))
    session = create(proxy.admin_port, {"hosts": ["public.lab.example"]})
    name = _fresh(lab)
    sock, status, _, _ = session_connect(proxy, f"public.lab.example:{lab.public_tls.port}", session)
    assert status == 200
    context = ssl.create_default_context(cafile=str(lab.cert_file))
    with contextlib.suppress(OSError), context.wrap_socket(sock, server_hostname=name) as tls:
        tls.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        tls.recv(100)
    sock.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not [r for r in proxy.audit() if r["rule"] == "tls:sni"]:
        time.sleep(0.05)
    refused = [r for r in proxy.audit() if r["rule"] == "tls:sni"]
    assert refused and all(r["session"] == session["id"] for r in refused), refused
    assert not lab.dns.queried(name)
    assert not [r for r in proxy.audit() if r["event"] == "tunnel" and r["session"] != session["id"]]


@both_transports
def test_ending_a_session_refuses_the_next_request_on_a_kept_alive_connection_holds(lab, start_proxy, tmp_path):
    proxy = start_proxy(lab.policy_text("session: required\n"), "--admin-token-file", str(token_file(tmp_path)))
    port = lab.public.port
    session = create(proxy.admin_port, {"hosts": ["public.lab.example"]})
    request = (f"GET http://public.lab.example:{port}/keep HTTP/1.1\r\nHost: public.lab.example:{port}\r\n"
               f"Proxy-Authorization: {session['proxy_authorization']}\r\n\r\n").encode()
    with socket.create_connection((proxy.host, proxy.port), timeout=5) as sock:
        sock.sendall(request)
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        assert api(proxy.admin_port, "DELETE", f"/v1/sessions/{session['id']}")[0] == 204
        sock.sendall(request)
        answer = read_response(sock)
    assert answer.startswith(b"HTTP/1.1 407"), answer[:200]


@pytest.mark.parametrize("body", [
    {"grants": {"hosts": ["a.example"]}, "budgets": {"requests": True}},
    {"grants": {"hosts": ["a.example"]}, "ttl": True},
    {"grants": {"hosts": ["a.example"]}, "budgets": {"requests": 0}},
    {"grants": {"hosts": ["a.example"]}, "budgets": {"request_bytes": -1}},
    {"grants": {"hosts": ["a.example"]}, "budgets": {"requests": 2 ** 53}},
    {"grants": {"hosts": ["a.example"]}, "budgets": {"requests": 1.0}},
    {"grants": {"hosts": ["a.example"]}, "ttl": 0},
    {"grants": {"hosts": ["a.example"]}, "ttl": 86401},
    {"grants": {"hosts": ["*"]}},
    {"grants": {"hosts": ["a.example\u0000"]}},
    {"grants": {"urls": ["http://a.example/p#f"]}},
    {"grants": {"urls": ["http://u@a.example/"]}},
    {"grants": {"urls": ["ws://a.example/"]}},
    {"grants": {}},
], ids=lambda b: str(b)[:60])
def test_session_requests_that_would_widen_or_confuse_are_refused_holds(lab, start_proxy, tmp_path, body):
    proxy = start_proxy(lab.policy_text(), "--admin-token-file", str(token_file(tmp_path)))
    status, _, answer = api(proxy.admin_port, "POST", "/v1/sessions", body)
    assert status == 400, answer


def test_the_api_refuses_raw_oddities_and_ended_sessions_holds(lab, start_proxy, tmp_path):
    proxy = start_proxy(lab.policy_text(), "--admin-token-file", str(token_file(tmp_path)))
    for raw in (b'{"grants": {"hosts": ["a.example"], "hosts": ["b.example"]}}',
                b'{"grants": {"hosts": ["a.example"]}, "budgets": {"requests": ' + b"9" * 5000 + b"}}",
                b'{"grants": {"hosts": ["a.example"]}, "ttl": NaN}',
                b'\xef\xbb\xbf{"grants": {"hosts": ["a.example"]}}',
                b'{"grants": {"hosts": ["\xff.example"]}}'):
        status, _, answer = api(proxy.admin_port, "POST", "/v1/sessions", raw=raw)
        assert status == 400, (raw[:60], answer)
    session = create(proxy.admin_port, {"hosts": ["a.example"]})
    assert api(proxy.admin_port, "DELETE", f"/v1/sessions/{session['id']}", token=None)[0] == 401
    assert api(proxy.admin_port, "DELETE", f"/v1/sessions/{session['id']}")[0] == 204
    assert api(proxy.admin_port, "PATCH", f"/v1/sessions/{session['id']}", {"ttl": 600})[0] == 404
    assert api(proxy.admin_port, "POST", f"/v1/sessions/{session['id']}/extend", {"ttl": 600})[0] == 404
    assert session["id"] not in api(proxy.admin_port, "GET", "/v1/sessions")[2]["sessions"]


@both_transports
def test_a_request_past_the_response_bytes_budget_looks_no_name_up_holds(lab, start_proxy, tmp_path):
    """Round 18's test covers requests, hosts and request_bytes; response_bytes is counted when the response
    ends (in the background): the next request, sent at once, is still refused before its name is looked up."""
    proxy = start_proxy(lab.policy_text("session: required\n"), "--admin-token-file", str(token_file(tmp_path)))
    session = create(proxy.admin_port, {"hosts": ["*.lab.example"]}, budgets={"response_bytes": 10})
    auth = {"Proxy-Authorization": session["proxy_authorization"]}
    assert proxy.get(f"http://public.lab.example:{lab.public.port}/first", auth)[0] == 200
    leaked, rules = [], []
    for _ in range(3):
        name = _fresh(lab)
        status, headers, _ = proxy.get(f"http://{name}:{lab.public.port}/x", auth)
        rules.append((status, headers.get("x-egresswall-rule")))
        if lab.dns.queried(name):
            leaked.append(name)
    assert rules == [(403, "session:budget-response-bytes")] * 3, rules
    assert not leaked, leaked
