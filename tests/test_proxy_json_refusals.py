"""Refusals an agent can read, through the real proxy on both tunnel paths: a client whose Accept
prefers JSON gets one JSON object (error, rule, rule_id, reason, host, port, hint) for every kind of
refusal; every other client gets the text body with a ``hint:`` line; and nothing an upstream says
reaches a refusal's body."""

from __future__ import annotations

import json
import socket
import time

import pytest
from hostile import _Server
from proxyproc import TRANSPORTS, parse_response, read_response

pytestmark = pytest.mark.integration

JSON_ACCEPT = "application/json"
BODY_LIMIT = 1000
FIELDS = {"error", "status", "stage", "rule", "rule_id", "reason", "host", "port", "hint"}


class HostileSwitch(_Server):
    """An upstream that answers anything with 101 and words meant for the client: a phrase, our own
    headers, and bytes after the head."""

    def handle(self, conn: socket.socket, head: bytes) -> None:
        conn.sendall(b"HTTP/1.1 101 INJECTED-PHRASE\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                     b"X-Egresswall-Reason: INJECTED-REASON\r\nX-Egresswall-Hint: INJECTED-HINT\r\n"
                     b"Content-Type: application/json\r\n\r\n{\"hint\": \"INJECTED-BODY\"}\r\n")
        time.sleep(1)


@pytest.fixture(scope="module")
def switch():
    server = HostileSwitch()
    yield server
    server.close()


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def proxy(lab, tmp_path_factory, request, switch):
    from proxyproc import ProxyProcess

    folder = tmp_path_factory.mktemp("json-refusals")
    policy = folder / "policy.yaml"
    text = lab.policy_text("hosts:\n  deny:\n    - denied.lab.example\n  allow:\n    - public.lab.example\n"
                           "    - internal.lab.example\n    - missing.lab.example\n", default="deny",
                           limits=f"limits:\n  max_request_body: {BODY_LIMIT}\n")
    text = text.replace(f"http: [80, {lab.public.port}]", f"http: [80, {lab.public.port}, {switch.port}]")
    assert str(switch.port) in text
    policy.write_text(text)
    mode = TRANSPORTS[request.param]
    process = ProxyProcess(["--policy", str(policy), *mode], folder / "audit.jsonl")
    yield process
    process.stop()


def send(proxy, head: str, body: bytes = b"") -> tuple[int, dict[str, str], bytes, bytes]:
    raw = proxy.raw(head.encode() + body)
    status, headers, payload = parse_response(raw)
    return status, headers, payload, raw


def get(proxy, url: str, accept: str | None = JSON_ACCEPT, extra: str = "") -> tuple[int, dict, bytes, bytes]:
    host = url.split("/")[2]
    accept_line = f"Accept: {accept}\r\n" if accept is not None else ""
    return send(proxy, f"GET {url} HTTP/1.1\r\nHost: {host}\r\n{accept_line}{extra}Connection: close\r\n\r\n")


def connect(proxy, authority: str, accept: str = JSON_ACCEPT) -> tuple[int, dict, bytes, bytes]:
    return send(proxy, f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\nAccept: {accept}\r\n\r\n")


def as_json(status: int, headers: dict, body: bytes, want_status: int) -> dict:
    assert status == want_status, body
    assert headers["content-type"] == "application/json", (headers, body)
    answer = json.loads(body)
    assert set(answer) == FIELDS, answer
    assert answer["status"] == want_status
    assert answer["rule"] == headers["x-egresswall-rule"] and answer["rule_id"] == headers["x-egresswall-rule-id"]
    assert answer["reason"] and answer["hint"]
    return answer


def test_default_deny_names_the_host_to_add(lab, proxy):
    answer = as_json(*get(proxy, f"http://nope.lab.example:{lab.public.port}/x")[:3], 403)
    assert (answer["error"], answer["stage"], answer["rule_id"]) == ("refused", "host", "default:deny")
    assert (answer["host"], answer["port"]) == ("nope.lab.example", lab.public.port)
    assert answer["hint"] == "add nope.lab.example to hosts.allow"
    answer = as_json(*connect(proxy, f"nope.lab.example:{lab.public_tls.port}")[:3], 403)
    assert answer["hint"] == "add nope.lab.example to hosts.allow"
    assert (answer["host"], answer["port"]) == ("nope.lab.example", lab.public_tls.port)


def test_deny_rule_is_named(lab, proxy):
    for answer in (as_json(*get(proxy, f"http://denied.lab.example:{lab.public.port}/")[:3], 403),
                   as_json(*connect(proxy, f"denied.lab.example:{lab.public_tls.port}")[:3], 403)):
        assert answer["stage"] == "host" and answer["host"] == "denied.lab.example"
        assert answer["hint"].startswith("this host is refused by deny rule denied.lab.example")


def test_port_refusal_names_the_port(lab, proxy):
    answer = as_json(*get(proxy, "http://public.lab.example:1/")[:3], 403)
    assert (answer["stage"], answer["rule"], answer["port"]) == ("port", "ports.http", 1)
    assert answer["hint"].startswith("port 1 is not in ports.connect/ports.http")
    answer = as_json(*connect(proxy, "public.lab.example:2")[:3], 403)
    assert (answer["rule"], answer["port"]) == ("ports.connect", 2)
    assert answer["hint"].startswith("port 2 is not in ports.connect/ports.http")


def test_address_refusal_says_only_an_address_rule_readmits(lab, proxy):
    for answer in (as_json(*get(proxy, f"http://internal.lab.example:{lab.public.port}/")[:3], 403),
                   as_json(*connect(proxy, f"internal.lab.example:{lab.public_tls.port}")[:3], 403)):
        assert (answer["stage"], answer["rule"]) == ("address", "special-purpose 127.0.0.0/8")
        assert "only an addresses.allow range re-admits it" in answer["hint"]
        assert answer["host"] == "internal.lab.example"


def test_resolve_refusal_says_the_name_did_not_resolve(lab, proxy):
    for answer in (as_json(*get(proxy, f"http://missing.lab.example:{lab.public.port}/")[:3], 403),
                   as_json(*connect(proxy, f"missing.lab.example:{lab.public_tls.port}")[:3], 403)):
        assert answer["stage"] == "resolve" and answer["rule"].startswith("dns:")
        assert answer["hint"].startswith(f"the name did not resolve ({answer['rule']})")


def test_form_refusal_is_json_too(lab, proxy):
    answer = as_json(*get(proxy, f"http://0x7f.1:{lab.public.port}/")[:3], 403)
    assert answer["error"] == "malformed" and answer["rule"].startswith("form:")
    assert answer["host"] is None and "no policy change admits it" in answer["hint"]
    answer = as_json(*connect(proxy, "0x7f.1:443")[:3], 403)
    assert answer["error"] == "malformed" and answer["rule"].startswith("form:")


def test_header_problems_are_json(lab, proxy):
    url = f"http://public.lab.example:{lab.public.port}/"
    status, headers, body, _ = send(proxy, f"GET {url} HTTP/1.1\r\nHost: other.lab.example\r\nAccept: "
                                           f"{JSON_ACCEPT}\r\nConnection: close\r\n\r\n")
    answer = as_json(status, headers, body, 403)
    assert answer["rule"] == "form:host-header" and answer["host"] == "public.lab.example"
    assert answer["hint"].startswith("the Host header must name the request's target")
    answer = as_json(*get(proxy, url, extra="X-Folded: one\r\n two\r\n")[:3], 400)
    assert answer["rule"] == "http:header-value" and answer["error"] == "malformed"


def test_body_limits_are_json(lab, proxy):
    url = f"http://public.lab.example:{lab.public.port}/upload"
    head = (f"POST {url} HTTP/1.1\r\nHost: public.lab.example:{lab.public.port}\r\nAccept: {JSON_ACCEPT}\r\n"
            f"Connection: close\r\n")
    answer = as_json(*send(proxy, head + f"Content-Length: {BODY_LIMIT + 1}\r\n\r\n")[:3], 413)
    assert (answer["error"], answer["rule"]) == ("limited", "limits.max_request_body")
    assert answer["host"] == "public.lab.example" and "limits.max_request_body" in answer["hint"]
    chunk = b"x" * 600
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(3)) + b"0\r\n\r\n"
    answer = as_json(*send(proxy, head + "Transfer-Encoding: chunked\r\n\r\n", chunked)[:3], 413)
    assert answer["rule"] == "limits.max_request_body" and answer["host"] == "public.lab.example"


def test_text_body_carries_the_hint_line(lab, proxy):
    browser = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"
    for accept in (None, browser, "application/json;q=0.5, text/plain", "application/json;q=2"):
        status, headers, body, _ = get(proxy, f"http://nope.lab.example:{lab.public.port}/", accept)
        assert status == 403 and headers["content-type"].startswith("text/plain")
        assert body.decode().splitlines()[-1] == "hint: add nope.lab.example to hosts.allow"
    status, headers, body, _ = connect(proxy, f"internal.lab.example:{lab.public_tls.port}", browser)
    assert status == 403 and headers["content-type"].startswith("text/plain")
    assert "\nhint: this address is not global unicast (special-purpose 127.0.0.0/8); only an addresses.allow " \
           "range re-admits it, a host allow rule cannot\n" in body.decode()


def test_bytes_down_is_the_size_of_the_body_sent(lab, proxy):
    """The record is written before the answer is sent: its bytes_down must be the JSON answer's size."""
    for fetch in (lambda: get(proxy, f"http://sized.lab.example:{lab.public.port}/json"),
                  lambda: connect(proxy, f"sized.lab.example:{lab.public_tls.port}"),
                  lambda: get(proxy, f"http://sized.lab.example:{lab.public.port}/text", accept=None)):
        *_, raw = fetch()
        time.sleep(0.2)
        record = [r for r in proxy.decisions() if r["host"] == "sized.lab.example"][-1]
        assert record["bytes_down"] == len(raw)


def test_an_upstream_cannot_put_words_in_a_refusal(lab, proxy, switch):
    url = f"http://public.lab.example:{switch.port}/plain"
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(f"GET {url} HTTP/1.1\r\nHost: public.lab.example:{switch.port}\r\nAccept: {JSON_ACCEPT}\r\n\r\n"
                     .encode())
        raw = read_response(sock)
    status, headers, body = parse_response(raw)
    assert body, raw  # the whole refusal arrives (mitmproxy must not swap in the upstream body)
    answer = as_json(status, headers, body, 502)
    assert b"INJECTED" not in raw, raw
    assert answer == {"error": "refused", "status": 502, "stage": "http", "rule": "http:unrequested-upgrade",
                      "rule_id": "http:unrequested-upgrade",
                      "reason": "the upstream answered 101 Switching Protocols to a request that was not an "
                                "allowed WebSocket upgrade",
                      "host": "public.lab.example", "port": switch.port,
                      "hint": "egresswall does not relay this (http:unrequested-upgrade); no policy change admits it"}


@pytest.mark.parametrize("mode", list(TRANSPORTS.values()), ids=list(TRANSPORTS))
def test_a_cap_refusal_says_retry_later(lab, start_proxy, mode):
    proxy = start_proxy(lab.policy_text(limits="limits:\n  max_connections_per_client: 1\n"), *mode)
    holder = socket.socket()
    holder.bind(("127.0.9.21", 0))
    holder.connect((proxy.host, proxy.port))
    try:
        time.sleep(0.3)
        for head in (f"GET http://public.lab.example:{lab.public.port}/ HTTP/1.1\r\nHost: public.lab.example\r\n",
                     f"CONNECT public.lab.example:{lab.public_tls.port} HTTP/1.1\r\n"
                     f"Host: public.lab.example:{lab.public_tls.port}\r\n"):
            with socket.socket() as second:
                second.bind(("127.0.9.21", 0))
                second.settimeout(10)
                second.connect((proxy.host, proxy.port))
                second.sendall(f"{head}Accept: {JSON_ACCEPT}\r\n\r\n".encode())
                status, headers, body = parse_response(read_response(second))
            answer = as_json(status, headers, body, 429)
            assert (answer["error"], answer["rule"], answer["hint"]) == (
                "limited", "limits.max_connections_per_client", "retry later")
            assert answer["host"] == "public.lab.example"
    finally:
        holder.close()
