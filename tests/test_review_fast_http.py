"""Adversarial review of the plain-HTTP fast path (proxy/fast_http.py, proxy/http_head.py), through the
real proxy on both transports: the fast path must be at least as strict as mitmproxy's path.

The invariant most of these check: every request an origin sees was decided (a decision record that
allowed exactly that path), and nothing reaches the internal stand-in (127.0.0.3, a wrong connect).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import pytest
from dnslab import Record
from hostile import Scripted, _Server
from labnet import INTERNAL_IP, PUBLIC_IP
from proxyproc import TRANSPORTS, ProxyProcess, parse_response, proxy_with_origins, read_response
from session_client import create, token_file

from proxy.fast_http import Ended, send_while_moving

pytestmark = pytest.mark.integration

IDLE = 2.0
OWN_HEADERS = (b"HTTP/1.1 200 OK\r\nX-Egresswall-Rule: allow:everything\r\nX-EGRESSWALL-Reason: forged\r\n"
               b"Connection: X-Hop\r\nX-Hop: 1\r\nProxy-Authenticate: Basic\r\nContent-Length: 2\r\n\r\nok")


class Flood(_Server):
    """Answers with a huge Content-Length and writes its body as fast as the proxy takes it; ``ended`` is
    when a write failed (the proxy closed the connection)."""

    def __init__(self) -> None:
        self.ended: list[float] = []
        super().__init__()

    def handle(self, conn: socket.socket, head: bytes) -> None:
        conn.settimeout(1)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000000\r\n\r\n")
        deadline = time.monotonic() + 60
        piece = b"x" * 65536
        while time.monotonic() < deadline and not self.closed.is_set():
            try:
                conn.send(piece)
            except TimeoutError:
                continue  # the proxy is not reading: keep offering
            except OSError:
                self.ended.append(time.monotonic())
                return


NO_CONTENT_WITH_LENGTH = b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\nhello"


@pytest.fixture(scope="module")
def origins():
    servers = {"own": Scripted(OWN_HEADERS), "flood": Flood(), "204": Scripted(NO_CONTENT_WITH_LENGTH)}
    yield servers
    for server in servers.values():
        server.close()


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def proxy(lab, origins, tmp_path_factory, request):
    folder = tmp_path_factory.mktemp("review-fast-http")
    process = proxy_with_origins(lab, folder, (s.port for s in origins.values()), request.param,
                                 f"limits:\n  max_request_body: 1000\n  idle_timeout: {IDLE}\n")
    yield process
    process.stop()
    assert not [e for e in process.outbound() if e["host"] != PUBLIC_IP], process.outbound()


def _public(lab) -> str:
    return f"public.lab.example:{lab.public.port}"


def _exchange(proxy: ProxyProcess, data: bytes, timeout: float = 6) -> bytes:
    with socket.create_connection((proxy.host, proxy.port), timeout=timeout) as sock:
        sock.sendall(data)
        got = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := sock.recv(65536):
                got += chunk
        return got


def _statuses(raw: bytes) -> list[int]:
    return [int(line.split()[1]) for line in raw.split(b"\r\n") if line.startswith(b"HTTP/1.") and
            len(line.split()) > 1 and line.split()[1].isdigit()]


def _all_seen_were_decided(lab, proxy: ProxyProcess, before: int) -> None:
    """Every request the public origin saw since ``before`` has an allowing decision for its path."""
    time.sleep(0.3)
    seen = [path for _, path, _ in lab.public.requests[before:]]
    allowed = [d["path"] for d in proxy.decisions() if d["verdict"] == "allow"]
    for path in seen:
        assert path in allowed, (path, allowed[-5:])


# ---- framing: a request the fast path could read differently from the origin ---------------------------

SMUGGLE_FRAMINGS = {
    "cl-and-te": "Content-Length: {n}\r\nTransfer-Encoding: chunked\r\n",
    "te-chunked-identity": "Transfer-Encoding: chunked, identity\r\nContent-Length: {n}\r\n",
    "te-xchunked": "Transfer-Encoding: xchunked\r\nContent-Length: {n}\r\n",
    "te-tab": "Transfer-Encoding:\tchunked\r\nContent-Length: {n}\r\n",
    "te-upper": "Transfer-Encoding: CHUNKED\r\nContent-Length: {n}\r\n",
    "two-te": "Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\nContent-Length: {n}\r\n",
    "te-space-before-colon": "Transfer-Encoding : chunked\r\nContent-Length: {n}\r\n",
    "te-folded": "X-A: b\r\n Transfer-Encoding: chunked\r\nContent-Length: {n}\r\n",
    "cl-plus": "Content-Length: +{n}\r\n",
    "cl-two": "Content-Length: {n}\r\nContent-Length: 5\r\n",
    "cl-list": "Content-Length: {n}, 5\r\n",
    "te-http10": "Transfer-Encoding: chunked\r\n",
}


@pytest.mark.parametrize("framing", list(SMUGGLE_FRAMINGS))
def test_a_request_framed_two_ways_never_lets_an_undecided_request_reach_an_origin(lab, proxy, framing):
    """The body, read by Content-Length, hides a whole request to the internal stand-in after a chunked
    terminator: whichever way a reader frames it, the internal host is never reached and every request
    the public origin sees was decided."""
    before, internal_before = len(lab.public.requests), len(lab.internal.connections)
    hidden = (f"GET http://internal.lab.example:{lab.public.port}/hidden HTTP/1.1\r\n"
              f"Host: internal.lab.example:{lab.public.port}\r\n\r\n")
    body = "0\r\n\r\n" + hidden
    version = "1.0" if framing == "te-http10" else "1.1"
    head = (f"POST http://{_public(lab)}/framed-{framing} HTTP/{version}\r\nHost: {_public(lab)}\r\n"
            + SMUGGLE_FRAMINGS[framing].format(n=len(body)) + "\r\n")
    _exchange(proxy, (head + body).encode())
    assert len(lab.internal.connections) == internal_before
    assert "/hidden" not in [p for _, p, _ in lab.public.requests[before:]]
    _all_seen_were_decided(lab, proxy, before)


@pytest.mark.parametrize("line_end", [b"\n", b"\r"])
def test_bare_line_ends_do_not_hide_a_header(lab, proxy, line_end):
    """A bare LF or CR inside the head: the internal stand-in is never reached."""
    internal_before = len(lab.internal.connections)
    data = (f"GET http://{_public(lab)}/bare HTTP/1.1\r\nHost: {_public(lab)}".encode() + line_end
            + f"Host: internal.lab.example:{lab.public.port}\r\nConnection: close\r\n\r\n".encode())
    _exchange(proxy, data)
    assert len(lab.internal.connections) == internal_before


def test_a_request_pipelined_inside_a_content_length_body_is_body(lab, proxy):
    before = len(lab.public.requests)
    hidden = f"GET http://{_public(lab)}/inside HTTP/1.1\r\nHost: {_public(lab)}\r\n\r\n"
    data = (f"POST http://{_public(lab)}/outer HTTP/1.1\r\nHost: {_public(lab)}\r\nConnection: close\r\n"
            f"Content-Length: {len(hidden)}\r\n\r\n{hidden}").encode()
    raw = _exchange(proxy, data)
    assert _statuses(raw)[:1] == [200]
    paths = [p for _, p, _ in lab.public.requests[before:]]
    assert paths == ["/outer"]


CHUNKED_BODIES = {
    "negative": b"-1\r\nhello\r\n0\r\n\r\n",
    "hex-prefix": b"0x5\r\nhello\r\n0\r\n\r\n",
    "lf-only": b"5\nhello\n0\n\n",
    "no-crlf-after-data": b"5\r\nhelloXX0\r\n\r\n",
    "overflow": b"ffffffffffffffffffffffff\r\nhello\r\n0\r\n\r\n",
    "space-before-size": b" 5\r\nhello\r\n0\r\n\r\n",
}


@pytest.mark.parametrize("shape", list(CHUNKED_BODIES))
def test_a_malformed_chunked_body_is_never_forwarded_in_any_reading(lab, proxy, shape):
    """Chunk sizes and line ends parsers disagree on: nothing of the body reaches the origin, and the
    hidden request after it is never sent anywhere."""
    before, internal_before = len(lab.public.requests), len(lab.internal.connections)
    hidden = (f"GET http://internal.lab.example:{lab.public.port}/hidden HTTP/1.1\r\n"
              f"Host: internal.lab.example:{lab.public.port}\r\n\r\n").encode()
    head = (f"POST http://{_public(lab)}/chunk-{shape} HTTP/1.1\r\nHost: {_public(lab)}\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()
    _exchange(proxy, head + CHUNKED_BODIES[shape] + hidden)
    time.sleep(0.3)
    assert len(lab.internal.connections) == internal_before
    assert f"/chunk-{shape}" not in [p for _, p, _ in lab.public.requests[before:]]


def test_a_chunk_extension_is_dropped_and_the_body_reframed(lab, proxy):
    before = len(lab.public.requests)
    raw = _exchange(proxy, (f"POST http://{_public(lab)}/ext HTTP/1.1\r\nHost: {_public(lab)}\r\n"
                            "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                            "5;name=\"v\"\r\nhello\r\n0\r\n\r\n").encode())
    assert _statuses(raw)[:1] == [200]
    assert [p for _, p, _ in lab.public.requests[before:]] == ["/ext"]


def test_a_204_with_a_content_length_reaches_the_client_without_one(proxy, origins):
    """RFC 9110 8.6: no Content-Length in a 204. Relayed, a client that believes it would read the first
    bytes of the next response on its kept-alive connection (maybe another origin's) as this one's body."""
    port = origins["204"].port
    raw = _exchange(proxy, f"GET http://public.lab.example:{port}/nc HTTP/1.1\r\nHost: public.lab.example:{port}"
                           "\r\nConnection: close\r\n\r\n".encode())
    status, headers, body = parse_response(raw)
    assert status == 204 and body == b"", raw
    assert "content-length" not in headers, raw


# ---- where a request goes ---------------------------------------------------------------------------------

@pytest.mark.parametrize("target", [
    "http://public.lab.example@internal.lab.example:{p}/",
    "http://internal.lab.example:{p}#@public.lab.example:{p}/",
    "http://internal.lab.example:{p}\\@public.lab.example:{p}/",
    "http://internal%2elab.example:{p}/",
    "http://[::ffff:127.0.0.3%25lo]:{p}/",
    "http://internal.lab.example.:{p}/",
    "http://public.lab.example:0/",
    "http://public.lab.example:65616/",
    "http://127.0.0.3:{p}/",
])
def test_a_target_that_could_name_the_internal_host_never_reaches_it(lab, proxy, target):
    internal_before = len(lab.internal.connections)
    url = target.format(p=lab.public.port)
    authority = url.split("/")[2]
    raw = _exchange(proxy, f"GET {url} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n".encode())
    assert len(lab.internal.connections) == internal_before
    assert 200 not in _statuses(raw)


def test_a_host_header_naming_another_host_is_refused_once_with_its_reason(lab, proxy):
    before = len(lab.public.requests)
    records_before = len(proxy.decisions())
    raw = _exchange(proxy, f"GET http://{_public(lab)}/vhost HTTP/1.1\r\nHost: other.lab.example:{lab.public.port}"
                           "\r\nConnection: close\r\n\r\n".encode())
    assert _statuses(raw)[:1] == [403]
    time.sleep(0.3)
    refused = [d for d in proxy.decisions()[records_before:] if d.get("rule") == "form:host-header"]
    assert len(refused) == 1 and refused[0].get("reason"), proxy.decisions()[records_before:]
    assert len(lab.public.requests) == before


def test_a_kept_alive_connection_that_rebinds_is_decided_again(lab, proxy):
    """The name answers the public address, then (TTL 0) the internal one: the second request on the same
    client connection is resolved and decided again and refused, never sent down the upstream connection
    already open to the first address."""
    name = f"rebind-{proxy.transport}.lab.example"
    port = lab.public.port
    internal_before = len(lab.internal.connections)
    request = f"GET http://{name}:{port}/r{{}} HTTP/1.1\r\nHost: {name}:{port}\r\n\r\n"
    lab.dns.set(name, [Record("A", PUBLIC_IP, ttl=0)])
    with socket.create_connection((proxy.host, proxy.port), timeout=8) as sock:
        sock.sendall(request.format(0).encode())
        first = read_response(sock)
        lab.dns.set(name, [Record("A", INTERNAL_IP, ttl=0)])
        sock.sendall(request.format(1).encode())
        second = read_response(sock)
    assert parse_response(first)[0] == 200, first[:200]
    assert parse_response(second)[0] == 403, second[:300]
    assert len(lab.internal.connections) == internal_before
    assert [p for _, p, _ in lab.public.requests].count("/r1") == 0


# ---- hop-by-hop, both ways ---------------------------------------------------------------------------------

def test_hop_by_hop_and_proxy_credentials_never_reach_the_origin(lab, proxy):
    before = len(lab.public.requests)
    data = (f"GET http://{_public(lab)}/hop HTTP/1.1\r\nHost: {_public(lab)}\r\n"
            "Proxy-Authorization: Basic c2VjcmV0OnNlY3JldA==\r\nConnection: close, X-Secret\r\nX-Secret: 1\r\n"
            "Keep-Alive: timeout=5\r\nProxy-Connection: keep-alive\r\nTE: trailers\r\nTrailer: X-T\r\n\r\n").encode()
    raw = _exchange(proxy, data)
    assert _statuses(raw)[:1] == [200]
    (_, path, headers), = lab.public.requests[before:]
    names = {k.lower() for k in headers}
    assert path == "/hop"
    assert not names & {"proxy-authorization", "x-secret", "keep-alive", "proxy-connection", "te", "trailer"}, names


def test_an_origin_cannot_forge_egresswall_headers(proxy, origins):
    port = origins["own"].port
    raw = _exchange(proxy, f"GET http://public.lab.example:{port}/own HTTP/1.1\r\nHost: public.lab.example:{port}"
                           "\r\nConnection: close\r\n\r\n".encode())
    status, headers, body = parse_response(raw)
    assert status == 200 and body == b"ok"
    assert "x-egresswall-rule" not in headers and "x-egresswall-reason" not in headers, headers
    if proxy.transport == "fast":  # stricter than mitmproxy's path, which relays these as they came
        assert "x-hop" not in headers and "proxy-authenticate" not in headers, headers


# ---- limits --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_limit_is_refused_with_413(lab, proxy, chunked):
    before = len(lab.public.requests)
    body = b"a" * 1500
    framing = (b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n") if chunked \
        else b"Content-Length: %d\r\n\r\n" % len(body) + body
    raw = _exchange(proxy, f"POST http://{_public(lab)}/big HTTP/1.1\r\nHost: {_public(lab)}\r\n".encode() + framing)
    assert _statuses(raw)[:1] == [413]
    time.sleep(0.3)
    assert "/big" not in [p for _, p, _ in lab.public.requests[before:]] or not chunked


def test_a_client_that_never_reads_its_response_is_closed_after_the_idle_timeout(proxy, origins):
    """A slow reader (the response side of slowloris): the proxy's writes to the client stop moving, and
    after limits.idle_timeout of that it must let the connection (and the upstream one) go."""
    flood = origins["flood"]
    ended_before = len(flood.ended)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((proxy.host, proxy.port))
    try:
        sock.sendall(f"GET http://public.lab.example:{flood.port}/flood HTTP/1.1\r\n"
                     f"Host: public.lab.example:{flood.port}\r\n\r\n".encode())
        deadline = time.monotonic() + IDLE * 6 + 10
        while time.monotonic() < deadline and len(flood.ended) == ended_before:
            time.sleep(0.2)
        assert len(flood.ended) > ended_before, "the upstream of a client that never reads was held open"
    finally:
        sock.close()
    time.sleep(0.5)
    closing = [r for r in proxy.audit() if r["event"] == "response" and r.get("path") == "/flood"]
    assert len(closing) == 1 and closing[0]["error"], closing  # one record, saying how it ended
    if proxy.transport == "fast":
        assert "stopped reading its response" in closing[0]["error"], closing



# ---- sessions: every request of a kept-alive connection is checked against its grant -----------------------

@pytest.fixture(scope="module", params=list(TRANSPORTS))
def session_proxy(lab, tmp_path_factory, request):
    folder = tmp_path_factory.mktemp("review-sessions")
    policy = folder / "policy.yaml"
    policy.write_text(lab.policy_text("roles:\n  - name: agents\n    clients: [127.0.0.1/32]\n    session: required\n"))
    process = ProxyProcess(["--policy", str(policy), "--admin-token-file", str(token_file(folder)),
                            *TRANSPORTS[request.param]], folder / "audit.jsonl")
    yield process
    process.stop()


def test_a_kept_alive_connection_cannot_ride_an_exact_url_grant_to_a_sibling(lab, session_proxy):
    """The granted URL first, then its siblings on the SAME client connection (and so the same upstream
    connection, were it reused): each is checked against the grant, and the siblings never reach the origin."""
    base = f"public.lab.example:{lab.public.port}"
    session = create(session_proxy.admin_port, {"urls": [f"http://{base}/kept/page?id=1"]})
    auth = session["proxy_authorization"]
    before = len(lab.public.requests)
    answers = []
    with socket.create_connection((session_proxy.host, session_proxy.port), timeout=8) as sock:
        for path in ("/kept/page?id=1", "/kept/page?id=2"):
            sock.sendall(f"GET http://{base}{path} HTTP/1.1\r\nHost: {base}\r\nProxy-Authorization: {auth}\r\n\r\n"
                         .encode())
            answers.append(parse_response(read_response(sock))[0])
    with socket.create_connection((session_proxy.host, session_proxy.port), timeout=8) as sock:
        # Credentials on the first request only: the second, without any, must not inherit them.
        sock.sendall(f"GET http://{base}/kept/page?id=1 HTTP/1.1\r\nHost: {base}\r\nProxy-Authorization: {auth}"
                     f"\r\n\r\n".encode())
        answers.append(parse_response(read_response(sock))[0])
        sock.sendall(f"GET http://{base}/kept/bare HTTP/1.1\r\nHost: {base}\r\n\r\n".encode())
        answers.append(parse_response(read_response(sock))[0])
    assert answers[0] == 200 and answers[2] == 200, answers
    assert answers[1] in (403, 0) and answers[3] in (403, 407, 0), answers
    assert [p for _, p, _ in lab.public.requests[before:]] == ["/kept/page?id=1", "/kept/page?id=1"]


@pytest.mark.parametrize("shape", ["negative", "hex-prefix", "no-crlf-after-data"])
def test_a_malformed_chunked_body_is_answered_400_with_a_reason_and_recorded(lab, proxy, shape):
    """Refused, not just dropped: the client is told why (400), and the record says so too — on both
    transports (mitmproxy's path closed the connection without a word)."""
    head = (f"POST http://{_public(lab)}/bad-{shape} HTTP/1.1\r\nHost: {_public(lab)}\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()
    raw = _exchange(proxy, head + CHUNKED_BODIES[shape])
    assert _statuses(raw)[:1] == [400], raw[:300]
    time.sleep(0.3)
    mine = [r for r in proxy.audit() if r.get("path") == f"/bad-{shape}" and r["event"] == "response"]
    assert len(mine) == 1 and mine[0]["rule"] == "http:bad-chunked" and mine[0]["status"] == 400, mine
    assert mine[0]["reason"].startswith("egresswall: the request body cannot be parsed: "), mine  # h11's words follow


# ---- the bounded write itself (real sockets, no proxy) -------------------------------------------------------

def test_a_write_to_a_peer_that_never_reads_ends_after_the_idle_bound():
    async def run() -> float:
        mine, theirs = socket.socketpair()
        mine.setblocking(False)
        try:
            started = time.monotonic()
            with pytest.raises(Ended) as ended:
                await send_while_moving(mine, b"x" * (64 << 20), 0.5, "stalled")
            assert ended.value.error == "stalled"
            return time.monotonic() - started
        finally:
            mine.close()
            theirs.close()

    assert asyncio.run(run()) < 5


def test_a_write_to_a_slow_but_steady_reader_is_not_cut_off():
    async def run() -> int:
        mine, theirs = socket.socketpair()
        mine.setblocking(False)
        theirs.setblocking(False)
        data = b"y" * (8 << 20)
        got = 0

        async def read_slowly() -> None:
            nonlocal got
            while got < len(data):
                await asyncio.sleep(0.05)  # far less than the bound between reads, but steady
                with contextlib.suppress(BlockingIOError):
                    got += len(theirs.recv(1 << 20))

        try:
            reader = asyncio.create_task(read_slowly())
            await send_while_moving(mine, data, 0.5, "stalled")
            await asyncio.wait_for(reader, 10)
            return got
        finally:
            mine.close()
            theirs.close()

    assert asyncio.run(run()) == 8 << 20


def test_a_kept_upstream_connection_is_not_reused_for_another_name_at_the_same_address(lab, proxy):
    """Two allowed names answer the same address: the second request on the client's connection gets an
    upstream connection of its own, as on mitmproxy's path (which keys a kept connection by name and port)
    and squid (by address and domain). A connection opened for one name never carries another name's
    request, so an origin's per-connection state (a virtual host chosen at the first request) is never
    shared between names the policy decided apart."""
    port = lab.public.port
    names = [f"{which}-{proxy.transport}-shared.lab.example" for which in ("first", "second")]
    for name in names:
        lab.dns.set(name, [Record("A", PUBLIC_IP, ttl=60)])
    before = lab.public.connections
    with socket.create_connection((proxy.host, proxy.port), timeout=8) as sock:
        for name in (names[0], names[0], names[1]):
            sock.sendall(f"GET http://{name}:{port}/shared HTTP/1.1\r\nHost: {name}:{port}\r\n\r\n".encode())
            assert parse_response(read_response(sock))[0] == 200
    # the first name's connection is kept for its second request; the other name opens its own
    assert lab.public.connections - before == 2
