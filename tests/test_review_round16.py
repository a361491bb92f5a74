"""Review round 16 (HTTP-proxy hygiene, a helper's adversarial review): one input, one answer on both transports,
and the request that reaches the origin is the one that was decided."""

from __future__ import annotations

import socket
import ssl
import uuid

import pytest
from audit_watch import AuditWatch
from proxyproc import both_transports, parse_response, read_response
from test_review_round9 import SCRIPTS, first_then_next, origins, responses, status_lines  # noqa: F401
from test_review_round9 import proxy as scripted_proxy  # noqa: F401 (a module-scoped fixture: both transports)

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("internal_saw_nothing")]

SCRIPTS.update({  # read by test_review_round9's module-scoped origins fixture, one origin each
    "length-leading-zero": [b"HTTP/1.1 200 OK\r\nContent-Length: 005\r\n\r\nhello"],
    "length-plus": [b"HTTP/1.1 200 OK\r\nContent-Length: +5\r\n\r\nhello"],
    "length-list": [b"HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\n\r\nhello"],
    "length-twice": [b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\ncontent-length: 5\r\n\r\nhello"],
    "length-twice-after-103": [b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\nHTTP/1.1 200 OK\r\n"
                               b"Content-Length: 5\r\nContent-Length: 5\r\n\r\nhello"],
})


def _raw(running, data: bytes) -> tuple[int, dict[str, str], bytes]:
    with socket.create_connection((running.host, running.port), timeout=10) as sock:
        sock.sendall(data)
        return parse_response(read_response(sock))


@both_transports
@pytest.mark.parametrize("version", ["1.1", "1.0"])
def test_a_request_without_a_host_header_reaches_the_origin_with_the_host_it_was_decided_on(lab, start_proxy,
                                                                                            version):
    """mitmproxy forwarded an absolute-form request without a Host header as it came: a name-based virtual host
    on the allowed address then served its default site, not the host egresswall decided on (RFC 9112 3.2.2: a
    proxy generates Host from the target). The fast path hands such a request to mitmproxy's path."""
    running = start_proxy(lab.policy_text())
    authority, path = f"public.lab.example:{lab.public.port}", f"/no-host-{uuid.uuid4().hex}"
    status, _, _ = _raw(running, f"GET http://{authority}{path} HTTP/{version}\r\nConnection: close\r\n\r\n".encode())
    assert status == 200
    (headers,) = [h for _, seen, h in lab.public.requests if seen == path]
    assert headers.get("Host") == authority, headers


@both_transports
@pytest.mark.parametrize("method", ["POST", "GET"])
def test_a_content_length_with_a_leading_zero_gets_400_on_both_transports(lab, start_proxy, method):
    """The fast path relayed ``Content-Length: 003`` (as sent) where mitmproxy's path answered 400: one input
    got two answers. The fast path now leaves it to mitmproxy's, whose parser refuses it."""
    running = start_proxy(lab.policy_text())
    authority, path = f"public.lab.example:{lab.public.port}", f"/zero-{uuid.uuid4().hex}"
    status, headers, _ = _raw(running, f"{method} http://{authority}{path} HTTP/1.1\r\nHost: {authority}\r\n"
                              "Content-Length: 003\r\n\r\nabc".encode())
    assert status == 400 and "invalid content-length header" in headers["x-egresswall-reason"], headers
    assert path not in [seen for _, seen, _ in lab.public.requests]
    (record,) = [r for r in running.decisions() if r["verdict"] == "refuse"]
    assert (record["rule"], record["reason"]) == (headers["x-egresswall-rule"], headers["x-egresswall-reason"])


@both_transports
@pytest.mark.parametrize("framing", ["Content-Length: 5\r\nTransfer-Encoding: chunked", "Content-Length: -1",
                                     "Transfer-Encoding: xchunked", "Content-Length: 5, 5"])
def test_a_framing_mitmproxy_refuses_is_answered_with_the_records_rule_and_reason(lab, start_proxy, framing):
    """mitmproxy's parser reads the head and refuses its framing: the answer said ``http:malformed`` ("the request
    head cannot be parsed") while the record said ``http:invalid-request`` ("mitmproxy refused the request").
    One refusal, one rule and reason, in the answer and the record."""
    running = start_proxy(lab.policy_text())
    authority = f"public.lab.example:{lab.public.port}"
    status, headers, _ = _raw(running, f"POST http://{authority}/framing HTTP/1.1\r\nHost: {authority}\r\n"
                              f"{framing}\r\n\r\n".encode())
    assert status == 400 and headers["x-egresswall-rule"] == "http:invalid-request", headers
    (record,) = [r for r in running.decisions() if r["verdict"] == "refuse"]
    assert (record["rule"], record["reason"]) == (headers["x-egresswall-rule"], headers["x-egresswall-reason"])


@pytest.mark.parametrize("case", ["length-leading-zero", "length-plus", "length-list", "length-twice",
                                  "length-twice-after-103"])
def test_a_response_content_length_with_a_leading_zero_or_a_sign_gets_502(scripted_proxy, origins,  # noqa: F811
                                                                            case):
    """The fast path relayed ``Content-Length: 005`` as the origin sent it, and a list or two equal lengths as one
    (h11 merges them); mitmproxy's path answered 502. Both answer 502 now, and nothing of the origin's reaches
    the client."""
    audit = AuditWatch(scripted_proxy.log_path).mark()
    raw = first_then_next(scripted_proxy, origins[case].port)
    assert status_lines(raw) == [b"HTTP/1.1 502 Bad Gateway"] and b"hello" not in raw, raw
    (record,) = responses(scripted_proxy, audit, 1)
    assert record["status"] == 502 and record["bytes_down"] == 0 and record["error"], record


@both_transports
@pytest.mark.parametrize("framing", ["Transfer-Encoding: chunked", "Content-Length: 5", "Content-Length: 00",
                                     "Content-Length: 0\r\nContent-Length: 0", "Content-Length: 0, 0"])
def test_a_connect_that_declares_content_is_refused_400(lab, start_proxy, framing):
    """A CONNECT has no content (RFC 9110 9.3.6). mitmproxy's path read declared bytes as a body and dropped them
    before the tunnel; the front took them for the tunnel's first bytes (``tls:not-tls``). Both refuse it now,
    with one record: ``http:connect-content``, or mitmproxy's parser's reason for a length it cannot read."""
    running = start_proxy(lab.policy_text())
    authority = f"public.lab.example:{lab.public_tls.port}"
    body = b"0\r\n\r\n" if "chunked" in framing else b"hello" if framing.endswith("5") else b""
    with socket.create_connection((running.host, running.port), timeout=10) as sock:
        sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n{framing}\r\n\r\n".encode() + body)
        status, headers, _ = parse_response(read_response(sock))
    # mitmproxy's parser refuses a length it cannot read, or two (h11 merged those: the front hands them over)
    expected = "http:invalid-request" if framing.endswith(("00", "0, 0", "Length: 0")) else "http:connect-content"
    assert status == 400 and headers["x-egresswall-rule"] == expected, headers
    (record,) = [r for r in running.decisions() if r["verdict"] == "refuse"]
    assert record["rule"] == expected, record
    if expected == "http:connect-content":
        assert record["host"] == "public.lab.example" and "has no content" in record["reason"], record
    assert not running.outbound(), running.outbound()


@both_transports
@pytest.mark.parametrize("between", [b"", b"\r\n", b"\r\n\r\n"], ids=["none", "crlf", "two-crlf"])
@pytest.mark.parametrize("framing", ["", "Content-Length: 0\r\n"], ids=["plain", "length-0"])
def test_empty_lines_that_come_with_a_connect_are_dropped_on_both_transports(lab, start_proxy, between, framing):
    """mitmproxy's path drops empty lines that arrive with the CONNECT head (Http1Server.make_pipe); the front took
    them for the tunnel's first bytes and refused the tunnel. Both open it now; what follows must still be TLS."""
    running = start_proxy(lab.policy_text())
    authority = f"public.lab.example:{lab.public_tls.port}"
    sock = socket.create_connection((running.host, running.port), timeout=10)
    sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n{framing}\r\n".encode() + between)
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 200"), head
    context = ssl.create_default_context(cafile=str(lab.cert_file))
    with context.wrap_socket(sock, server_hostname="public.lab.example") as tls:
        tls.sendall(f"GET /after-empty-lines HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n".encode())
        status, _, _ = parse_response(read_response(tls))
    assert status == 200
    assert not [r for r in running.decisions() if r["verdict"] == "refuse"], running.decisions()
