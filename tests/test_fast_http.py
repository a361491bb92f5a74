"""The plain-HTTP fast path through the real proxy, where it differs from a relay of bytes: origins that
frame a response two ways or send bytes after it, a kept-alive connection that moves to mitmproxy at the
first request the fast path does not take, an upstream connection that serves one pinned address only,
and trailers. The framing cases run on both transports (what the client reads is the same safe thing)."""

from __future__ import annotations

import socket
import time

import h11
import pytest
from hostile import Scripted
from labnet import PUBLIC_IP
from proxyproc import TRANSPORTS, ProxyProcess, proxy_with_origins, read_response

from proxy.body_reasons import TRAILERS_REASON

pytestmark = pytest.mark.integration

BOTH_WAYS = b"HTTP/1.1 200 OK\r\nContent-Length: 40\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
AFTERWARDS = (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"
              b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\nX-Smuggled: 1\r\n\r\nsmuggled")
FOLDED = b"HTTP/1.1 200 OK\r\nX-Folded: a\r\n b\r\nContent-Length: 5\r\n\r\nhello"
HOP_BY_HOP = (b"HTTP/1.1 200 OK\r\nConnection: X-Origin-Hop, keep-alive\r\nX-Origin-Hop: secret\r\n"
              b"Keep-Alive: timeout=5\r\nProxy-Authenticate: Basic realm=origin\r\nX-End-To-End: kept\r\n"
              b"Content-Length: 5\r\n\r\nhello")
TRAILERS = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-Trailer\r\n\r\n"
            b"5\r\nhello\r\n0\r\nX-Trailer: secret\r\n\r\n")
DIFFERENT_LENGTHS = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 3\r\n\r\nhello"


@pytest.fixture(scope="module")
def origins():
    servers = {"both": Scripted(BOTH_WAYS), "after": Scripted(AFTERWARDS), "folded": Scripted(FOLDED),
               "lengths": Scripted(DIFFERENT_LENGTHS), "hop": Scripted(HOP_BY_HOP), "trailers": Scripted(TRAILERS)}
    yield servers
    for server in servers.values():
        server.close()


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def proxy(lab, origins, tmp_path_factory, request):
    folder = tmp_path_factory.mktemp("fast-http")
    process = proxy_with_origins(lab, folder, (s.port for s in origins.values()), request.param,
                                 "limits:\n  max_request_body: 1000\n")
    yield process
    process.stop()
    assert not [e for e in process.outbound() if e["host"] != PUBLIC_IP], process.outbound()


def _get(port: int, path: str, extra: str = "") -> bytes:
    authority = f"public.lab.example:{port}"
    return f"GET http://{authority}{path} HTTP/1.1\r\nHost: {authority}\r\n{extra}\r\n".encode()


def _responses(sock: socket.socket, count: int, timeout: float = 5) -> list[tuple[int, dict[bytes, bytes], bytes]]:
    """Up to ``count`` responses read off ``sock`` by a strict parser (h11): what a careful client sees."""
    parser = h11.Connection(h11.CLIENT)
    sock.settimeout(timeout)
    got: list[tuple[int, dict[bytes, bytes], bytes]] = []
    for _ in range(count):
        parser.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
        parser.send(h11.EndOfMessage())
        status, headers, body = 0, {}, b""
        while True:
            try:
                event = parser.next_event()
            except h11.RemoteProtocolError:
                return got  # closed early, or a framing h11 will not read: no response
            if event is h11.NEED_DATA:
                try:
                    parser.receive_data(sock.recv(65536))
                except (TimeoutError, ConnectionResetError):
                    return got
                continue
            if isinstance(event, h11.Response):
                status, headers = event.status_code, dict(event.headers)
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                got.append((status, headers, body))
                break
            elif isinstance(event, h11.ConnectionClosed):
                return got
        if parser.our_state is h11.MUST_CLOSE or parser.their_state is h11.MUST_CLOSE:
            return got
        parser.start_next_cycle()
    return got


def _fast_count(proxy: ProxyProcess) -> float:
    _, body = proxy.admin("/metrics")
    return float(next(line for line in body.splitlines()
                      if line.startswith("egresswall_fast_http_requests_total")).split()[-1])


# ---- origins that frame a response two ways ----------------------------------------------------------

def test_a_response_framed_two_ways_is_refused_with_502(proxy, origins):
    """Content-Length and chunked at once (RFC 9112 6.3: never both): a 502, and nothing of the origin's
    bytes reaches the client to be read as the start of another response."""
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(_get(origins["both"].port, "/a") + _get(origins["both"].port, "/b"))
        answered = _responses(sock, 2)
        rest = sock.recv(65536)
    assert [status for status, _, _ in answered] == [502]
    assert b"hello" not in answered[0][2] and rest == b""


def test_an_origins_response_trailers_are_dropped_and_the_response_ends(proxy, origins):
    """Trailer fields after a chunked response body: the client gets the body, whole and ended, without them,
    and the connection serves the next request — on both transports (mitmproxy's reader raised on them and
    its client was left with a body that never ended)."""
    port = origins["trailers"].port
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(_get(port, "/t1"))
        first = _responses(sock, 1)
        sock.sendall(_get(port, "/t2"))
        second = _responses(sock, 1)
    assert [(status, body) for status, _, body in first + second] == [(200, b"hello")] * 2
    assert all(b"x-trailer" not in headers for _, headers, _ in first + second)
    assert "Traceback" not in proxy.stderr


def test_bytes_an_origin_sends_after_its_response_never_answer_the_next_request(proxy, origins):
    before = len(origins["after"].heads)
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        answers = []
        for i in range(3):
            sock.sendall(_get(origins["after"].port, f"/n{i}"))
            answers += _responses(sock, 1)
    assert [(status, body) for status, _, body in answers] == [(200, b"hello")] * 3
    assert all(b"x-smuggled" not in headers for _, headers, _ in answers)
    assert len(origins["after"].heads) - before == 3  # each request reached the origin as itself


def test_an_origin_s_hop_by_hop_headers_never_reach_the_client(proxy, origins):
    """RFC 9110 7.6.1 holds for responses too: what the origin's Connection names, Keep-Alive and
    Proxy-Authenticate belong to egresswall's connection to it, not to the client's."""
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        answers = []
        for i in range(2):  # kept alive: the second response comes on the same connection
            sock.sendall(_get(origins["hop"].port, f"/hop{i}"))
            answers += _responses(sock, 1)
    assert [(status, body) for status, _, body in answers] == [(200, b"hello")] * 2
    for _, headers, _ in answers:
        assert not {b"x-origin-hop", b"keep-alive", b"proxy-authenticate"} & set(headers), headers
        assert headers[b"x-end-to-end"] == b"kept"


def test_a_folded_response_header_reaches_the_client_unfolded_or_not_at_all(proxy, origins):
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(_get(origins["folded"].port, "/f", "Connection: close\r\n"))
        raw = read_response(sock)
    head = raw.split(b"\r\n\r\n", 1)[0]
    assert not [line for line in head.split(b"\r\n")[1:] if line[:1] in (b" ", b"\t")], head
    assert head.startswith((b"HTTP/1.1 200", b"HTTP/1.1 502"))


def test_a_response_with_two_lengths_gets_502(proxy, origins):
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(_get(origins["lengths"].port, "/l", "Connection: close\r\n"))
        answered = _responses(sock, 1)
    assert answered and answered[0][0] == 502


# ---- where the fast path hands over, and what it reuses -------------------------------------------------

def test_a_kept_alive_connection_moves_to_mitmproxy_at_a_request_the_fast_path_does_not_take(lab, proxy):
    port = lab.public.port
    fast_before = _fast_count(proxy)
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(_get(port, "/first"))
        first = _responses(sock, 1)
        # Bare LF line ends: RFC 9112 lets a recipient accept them, the fast path does not take them.
        sock.sendall(f"GET http://public.lab.example:{port}/second HTTP/1.1\nHost: public.lab.example:{port}\n\n"
                     .encode())
        second = _responses(sock, 1)
        sock.sendall(_get(port, "/third", "Connection: close\r\n"))
        third = _responses(sock, 1)
    assert [(s, b) for s, _, b in first + second + third] == [
        (200, b"hello from public /first"), (200, b"hello from public /second"), (200, b"hello from public /third")]
    relayed = _fast_count(proxy) - fast_before
    assert relayed == (1 if proxy.transport == "fast" else 0)  # after the hand-over, mitmproxy has the connection


def test_one_client_connection_alternating_two_origins_gets_each_ones_answer(lab, proxy, origins):
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        bodies = []
        for i in range(4):
            port = lab.public.port if i % 2 == 0 else origins["after"].port
            sock.sendall(_get(port, f"/alt{i}"))
            bodies += [body for _, _, body in _responses(sock, 1)]
    assert bodies == [b"hello from public /alt0", b"hello", b"hello from public /alt2", b"hello"]


def test_a_refused_request_on_a_kept_alive_connection_ends_it_and_is_not_forwarded(lab, proxy):
    port = lab.public.port
    before = len(lab.internal.connections)
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(_get(port, "/ok") + f"GET http://internal.lab.example:{port}/no HTTP/1.1\r\n"
                                          f"Host: internal.lab.example:{port}\r\n\r\n".encode() + _get(port, "/never"))
        answers = _responses(sock, 3)
    assert [s for s, _, _ in answers] == [200, 403]
    assert len(lab.internal.connections) == before
    assert "/never" not in [p for _, p, _ in lab.public.requests]


def test_chunked_trailers_are_refused_before_the_origin_sees_anything(lab, proxy):
    """Trailer fields would reach the origin past every check of the head: 400 on both transports, in the
    same words (mitmproxy's reader raised on them, and its client got nothing at all)."""
    port = lab.public.port
    forwarded = len(lab.public.requests)
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(f"POST http://public.lab.example:{port}/t HTTP/1.1\r\nHost: public.lab.example:{port}\r\n"
                     "Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nX-Trailer: 1\r\n\r\n".encode())
        answered = _responses(sock, 1)
    assert answered[0][0] == 400 and answered[0][1][b"x-egresswall-rule"] == b"http:trailers"
    assert answered[0][1][b"x-egresswall-reason"] == TRAILERS_REASON.encode()
    time.sleep(0.2)
    assert len(lab.public.requests) == forwarded
