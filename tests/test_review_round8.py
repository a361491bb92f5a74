"""Adversarial review, round 8: the client's reads held while a blocking hook of its connection runs
(``HeldReader``, proxy/mitm_patches.py) and the half-closed client answered, through the real proxy on both
transports, each decision made slow by a nameserver of the test's own that answers late.

What must hold: no connection hangs (a hook never waits for client bytes that the hold keeps unread: a
CONNECT with its ClientHello pipelined or in pieces, TLS interception, HTTP/2 with several streams,
WebSocket frames after an upgrade, Expect: 100-continue, keep-alive), a half-closed client gets its answer
and then the close (or limits.idle_timeout's close when the upstream never answers), every refusal the
client is said to have been sent is one it saw, both transports answer and record alike, and the proxy's
descriptors return to where they were.

Defects found and fixed (proxy/mitm_patches.py ``_server_mark_done``):

* a request pipelined behind one the client half-closed after (two GETs and a FIN in one write): on
  mitmproxy's path the second was parsed when the first's answer was out, decided (the policy refused it)
  and recorded ``403``, 799 bytes sent, on a connection then closed: the client never saw it. The fast
  path drops it unparsed (the client's end came before its answer); mitmproxy's path now does the same;
* a CONNECT and a FIN: mitmproxy's path sent the 200 and then held the connection until
  limits.idle_timeout (120 s by default; 3.5 s here against the fast path's 0.5 s), the tunnel's layer never
  told that the client was done — with nothing in the tunnel, with its ClientHello in the same write, and
  (on both transports, HTTP inside a tunnel being mitmproxy's) with a request inside a CONNECT to a
  plain-HTTP port, whose answer came and then nothing until the idle close. The end the half-close patch
  held back for the CONNECT's answer now goes to the tunnel once the 200 is out.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import re
import socket
import ssl
import threading
import time

import h2.config
import h2.connection
import h2.events
import pytest
from hostile import Silent, _Server
from labnet import PUBLIC_IP
from proxyproc import TRANSPORTS, ProxyProcess
from rawclient import read_head
from test_half_close_while_deciding import SplitNameserver

pytestmark = pytest.mark.integration

ANSWER_AFTER = 0.5  # every A answer this late: each decision waits, so every hold is a long one
IDLE = 3.0
LIMIT = 100_000


class WebSocketEcho(_Server):
    """A WebSocket origin: answers the upgrade with the right accept key, then echoes every (small, masked)
    client frame back as an unmasked one, until a close frame."""

    def __init__(self) -> None:
        super().__init__()
        self.echoed: list[bytes] = []

    def handle(self, conn: socket.socket, head: bytes) -> None:
        key = re.search(rb"(?im)^sec-websocket-key:\s*(\S+)", head)[1]
        accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
        conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                     b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n")
        buf = b""
        while chunk := conn.recv(65536):
            buf += chunk
            while len(buf) >= 6 and len(buf) >= 6 + (buf[1] & 0x7F):
                opcode, size = buf[0] & 0x0F, buf[1] & 0x7F
                mask, payload = buf[2:6], buf[6:6 + size]
                buf = buf[6 + size:]
                data = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
                conn.sendall(bytes([0x80 | opcode, len(data)]) + data)
                if opcode == 8:
                    return
                self.echoed.append(data)


def _ws_frame(data: bytes, opcode: int = 1) -> bytes:
    mask = os.urandom(4)
    return bytes([0x80 | opcode, 0x80 | len(data)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data))


class TlsClient:
    """TLS over a raw socket by memory BIOs, so the test decides what goes in which write: the CONNECT head
    pipelined with the ClientHello, the ClientHello in pieces."""

    def __init__(self, sock: socket.socket, server_hostname: str, alpn: list[str] | None = None) -> None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        if alpn:
            context.set_alpn_protocols(alpn)
        self.sock, self.incoming, self.outgoing = sock, ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = context.wrap_bio(self.incoming, self.outgoing, server_hostname=server_hostname)
        self.connect_answer = b""

    def handshake(self, before: bytes = b"", pieces: int = 1, gap: float = 0.0, expect_head: bool = False) -> None:
        """``before`` (a CONNECT head) goes in the ClientHello's first write; the ClientHello in ``pieces``
        writes ``gap`` seconds apart; with ``expect_head`` the proxy's answer head is read off first."""
        first = True
        while True:
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                data = self.outgoing.read()
                if first:
                    step = max(1, -(-len(data) // pieces))
                    parts = [data[i:i + step] for i in range(0, len(data), step)]
                    parts[0] = before + parts[0]
                    for index, part in enumerate(parts):
                        if index:
                            time.sleep(gap)
                        self.sock.sendall(part)
                    first = False
                else:
                    self.sock.sendall(data)
                chunk = self.sock.recv(65536)
                assert chunk, "closed during the handshake"
                if expect_head:
                    while b"\r\n\r\n" not in self.connect_answer + chunk:
                        more = self.sock.recv(65536)
                        assert more, chunk
                        chunk += more
                    head, _, chunk = (self.connect_answer + chunk).partition(b"\r\n\r\n")
                    self.connect_answer, expect_head = head + b"\r\n\r\n", False
                    assert self.connect_answer.startswith(b"HTTP/1.1 200"), self.connect_answer
                    if not chunk:
                        chunk = self.sock.recv(65536)
                self.incoming.write(chunk)
        self.sock.sendall(self.outgoing.read())

    def send(self, data: bytes) -> None:
        self.tls.write(data)
        self.sock.sendall(self.outgoing.read())

    def recv(self) -> bytes:
        """The next decrypted bytes (b"" at the end)."""
        while True:
            try:
                return self.tls.read(65536)
            except ssl.SSLWantReadError:
                chunk = self.sock.recv(65536)
                if not chunk:
                    return b""
                self.incoming.write(chunk)
            except ssl.SSLZeroReturnError:
                return b""


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture(scope="module")
def silent():
    server = Silent()
    yield server
    server.close()


@pytest.fixture(scope="module")
def ws_echo():
    server = WebSocketEcho()
    yield server
    server.close()


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def proxy(lab, tmp_path_factory, request, silent, ws_echo):
    nameserver = SplitNameserver(ANSWER_AFTER)
    folder = tmp_path_factory.mktemp("round8")
    policy = folder / "policy.yaml"
    policy.write_text(
        "version: 1\ndefault: allow\n"
        "hosts:\n  allow:\n    - host: public.lab.example\n      intercept: true\n"
        f"ports:\n  http: [{lab.public.port}, {silent.port}, {ws_echo.port}]\n"
        f"  connect: [{lab.public_tls.port}, {lab.public.port}]\n"
        f"addresses:\n  allow: [{PUBLIC_IP}/32]\n"
        f"resolver:\n  nameservers: ['{nameserver.address}']\n  timeout: 3\n"
        f"limits:\n  idle_timeout: {IDLE}\n  header_timeout: 5\n  max_request_body: {LIMIT}\n")
    process = ProxyProcess(["--policy", str(policy), "--confdir", str(folder / "ca"), "--upstream-ca",
                            str(lab.cert_file), *TRANSPORTS[request.param]], folder / "audit.jsonl")
    process.transport = request.param
    process.baseline_fds = _fds(process.process.pid)
    internal_before = len(lab.internal.connections) + len(lab.internal_tls.connections)
    yield process
    process.stop()
    nameserver.close()
    assert not [e for e in process.outbound() if e["host"] != PUBLIC_IP], process.outbound()
    assert len(lab.internal.connections) + len(lab.internal_tls.connections) == internal_before
    assert "has crashed" not in process.stderr


def _name(prefix: str) -> str:
    return f"{prefix}{time.monotonic_ns()}.lab.example"


def _path(tag: str) -> str:
    return f"/r8/{tag}/{time.monotonic_ns()}"


def _read_all(sock: socket.socket, timeout: float = 10) -> tuple[bytes, float]:
    """Everything until the proxy closes, and how long that took; a silence of ``timeout`` fails."""
    sock.settimeout(timeout)
    started, data = time.monotonic(), b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the connection was still open after {timeout}s: {data[:200]!r}")
    return data, time.monotonic() - started


def _connect_and_half_close(proxy: ProxyProcess, authority: str) -> tuple[bytes, float]:
    """A CONNECT to ``authority`` and nothing after it but the end of the client's sending side: what came
    back until the proxy closed, and how long that took."""
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        sock.shutdown(socket.SHUT_WR)
        return _read_all(sock)


def _statuses(answer: bytes) -> list[int]:
    return [int(m[1]) for m in re.finditer(rb"HTTP/1\.[01] (\d{3}) ", answer)]


def _records(proxy: ProxyProcess, key: str, value: str, settle: float = 0.0) -> list[dict]:
    time.sleep(settle)
    return [r for r in proxy.audit() if r.get(key) == value]


def _origin_paths(lab) -> list[str]:
    return [p for _, p, _ in lab.public.requests]


# ---- a half-closed client --------------------------------------------------------------------------

def test_a_request_pipelined_behind_a_half_closed_one_is_neither_answered_nor_recorded(proxy, lab):
    """Two GETs and the FIN in one write, the second to a name the policy refuses by address: the first is
    answered, then the connection closes; the second is never decided, so no record says a refusal was
    sent (mitmproxy's path recorded a 403 the client never saw)."""
    first, second = _name("open"), _name("inside")
    path_a, path_b = _path("pipe-a"), _path("pipe-b")
    port = lab.public.port
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(f"GET http://{first}:{port}{path_a} HTTP/1.1\r\nHost: {first}:{port}\r\n\r\n"
                     f"GET http://{second}:{port}{path_b} HTTP/1.1\r\nHost: {second}:{port}\r\n\r\n".encode())
        sock.shutdown(socket.SHUT_WR)
        answer, _ = _read_all(sock)
    assert _statuses(answer) == [200], answer[:300]
    assert [r["status"] for r in _records(proxy, "path", path_a, settle=ANSWER_AFTER * 3)
            if r["event"] == "response"] == [200]
    assert _records(proxy, "path", path_b) == []
    assert _origin_paths(lab).count(path_a) == 1 and path_b not in _origin_paths(lab)


def test_a_half_closed_connect_ends_when_its_answer_is_out(proxy, lab):
    """A CONNECT and a FIN, nothing in the tunnel: the 200, then the close — not limits.idle_timeout later
    (mitmproxy's path held it open that long)."""
    name = _name("open")
    authority = f"{name}:{lab.public_tls.port}"
    answer, took = _connect_and_half_close(proxy, authority)
    assert answer == b"HTTP/1.1 200 Connection established\r\n\r\n" and took < ANSWER_AFTER + 1.5, (answer, took)
    tunnels = [r for r in _records(proxy, "host", name, settle=0.3) if r["event"] == "tunnel"]
    assert len(tunnels) == 1 and tunnels[0]["status"] == 200 and tunnels[0]["bytes_up"] == 0, tunnels


def test_a_half_closed_refused_connect_is_answered_403(proxy, lab):
    name = _name("inside")
    authority = f"{name}:{lab.public_tls.port}"
    answer, _ = _connect_and_half_close(proxy, authority)
    assert _statuses(answer) == [403], answer[:200]
    refused = [r for r in _records(proxy, "host", name, settle=0.3) if r["verdict"] == "refuse"]
    assert len(refused) == 1 and refused[0]["status"] == 403 and refused[0]["bytes_down"], refused


def test_a_half_closed_request_whose_upstream_never_answers_is_closed_at_the_idle_timeout(proxy, silent):
    name, path = _name("open"), _path("silent")
    authority = f"{name}:{silent.port}"
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(f"GET http://{authority}{path} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        sock.shutdown(socket.SHUT_WR)
        answer, took = _read_all(sock, IDLE + 5)
    assert answer == b"" and IDLE - 0.5 < took < IDLE + ANSWER_AFTER + 2, (answer, took)
    closing = [r for r in _records(proxy, "path", path, settle=0.3) if r["event"] == "response"]
    assert len(closing) == 1 and "limits.idle_timeout" in (closing[0]["error"] or ""), closing


@pytest.mark.parametrize("refused", [True, False], ids=["refused", "allowed"])
def test_a_half_closed_websocket_upgrade_ends(proxy, ws_echo, refused):
    """An Upgrade: websocket request and a FIN: refused, the 403 is seen; allowed, the connection ends
    without a relay to a client that sends nothing more (both transports alike)."""
    name, path = _name("inside" if refused else "open"), _path("ws-fin")
    authority = f"{name}:{ws_echo.port}"
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(f"GET http://{authority}{path} HTTP/1.1\r\nHost: {authority}\r\nConnection: Upgrade\r\n"
                     "Upgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                     "Sec-WebSocket-Version: 13\r\n\r\n".encode())
        sock.shutdown(socket.SHUT_WR)
        answer, took = _read_all(sock)
    mine = _records(proxy, "path", path, settle=0.3)
    if refused:
        assert _statuses(answer) == [403], answer[:200]
        assert [(r["verdict"], r["status"]) for r in mine] == [("refuse", 403)], mine
    else:
        assert answer == b"" and took < ANSWER_AFTER + 1.5, (answer[:200], took)
        assert [r["event"] for r in mine] == ["decision", "response"] and mine[1]["status"] is None, mine


@pytest.mark.parametrize("inner", ["allowed", "other-host"])
def test_http_inside_a_connect_then_a_half_close_is_answered_then_closed(proxy, lab, inner):
    """A CONNECT to the plain-HTTP port, a request inside it and the FIN, in one write (HTTP inside a
    tunnel is mitmproxy's on both transports): the tunnel's 200, the inner answer, then the close — the
    end reaches the tunnel's own HTTP layer (it stayed open until limits.idle_timeout)."""
    name, path = _name("open"), _path(f"inner-{inner}")
    authority = f"{name}:{lab.public.port}"
    host = authority if inner == "allowed" else f"other{time.monotonic_ns()}.lab.example:{lab.public.port}"
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n"
                     f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        sock.shutdown(socket.SHUT_WR)
        answer, took = _read_all(sock)
    statuses = _statuses(answer)
    assert statuses[0] == 200 and len(statuses) == 2 and took < 2 * ANSWER_AFTER + 2, (answer[:400], took)
    mine = [r for r in _records(proxy, "path", path, settle=0.3) if r["event"] in ("decision", "response")]
    if inner == "allowed":
        assert statuses[1] == 200 and _origin_paths(lab).count(path) == 1, answer[:400]
    else:  # a Host that is not the tunnel's: refused, and the refusal is the one the client saw
        refused = [r for r in mine if r["verdict"] == "refuse"]
        assert len(refused) == 1 and refused[0]["status"] == statuses[1] >= 400, (mine, answer[:400])
        assert path not in _origin_paths(lab)


@pytest.mark.parametrize("ending", ["fin", "close-notify"])
def test_an_intercepted_request_then_a_half_close_is_answered(proxy, lab, ending):
    """Inside an intercepted tunnel, a request and the end of the client's sending side (a bare FIN, or
    TLS close_notify and a FIN) while its decision waits: the answer, then the close."""
    authority = f"public.lab.example:{lab.public_tls.port}"
    path = _path(f"icpt-{ending}")
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        client = TlsClient(sock, "public.lab.example")
        client.handshake(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode(), expect_head=True)
        client.send(f"GET {path} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        if ending == "close-notify":
            with contextlib.suppress(ssl.SSLWantReadError):
                client.tls.unwrap()
            sock.sendall(client.outgoing.read())
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(ANSWER_AFTER + 5)
        answer = b""
        with contextlib.suppress(ssl.SSLError, ConnectionResetError):
            while chunk := client.recv():
                answer += chunk
    assert _statuses(answer) == [200] and answer.endswith(path.encode()), answer[:300]


def test_a_connect_with_its_client_hello_and_a_fin_ends(proxy, lab):
    """CONNECT, the ClientHello and the FIN in one write (a handshake that can never finish): the tunnel
    ends promptly on both transports, with one closing record."""
    name = _name("open")
    authority = f"{name}:{lab.public_tls.port}"
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    outgoing = ssl.MemoryBIO()
    tls = context.wrap_bio(ssl.MemoryBIO(), outgoing, server_hostname=name)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode() + outgoing.read())
        sock.shutdown(socket.SHUT_WR)
        answer, took = _read_all(sock)
    assert answer.startswith(b"HTTP/1.1 200") and took < ANSWER_AFTER + 2, (answer[:100], took)
    tunnels = [r for r in _records(proxy, "host", name, settle=0.5) if r["event"] == "tunnel"]
    assert len(tunnels) == 1, tunnels


# ---- the reads held while deciding: nothing that needs more of the client's bytes waits for them -----

def test_expect_100_continue_while_the_decision_waits(proxy, lab):
    name, path = _name("open"), _path("expect")
    authority = f"{name}:{lab.public.port}"
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(f"POST http://{authority}{path} HTTP/1.1\r\nHost: {authority}\r\nContent-Length: 5\r\n"
                     "Expect: 100-continue\r\nConnection: close\r\n\r\n".encode())
        sock.settimeout(5)
        interim = sock.recv(65536)
        sock.sendall(b"hel")
        time.sleep(0.1)
        sock.sendall(b"lo")
        answer, _ = _read_all(sock)
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n", interim
    assert _statuses(answer) == [200] and answer.endswith(b"got 5 bytes"), answer[:300]


def test_a_kept_alive_connection_sends_bodies_in_pieces_while_each_decision_waits(proxy, lab):
    name, port = _name("open"), lab.public.port
    answers = []
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        for index in range(3):
            sock.sendall(f"POST http://{name}:{port}/ka{index} HTTP/1.1\r\nHost: {name}:{port}\r\n"
                         "Content-Length: 5\r\n\r\nhe".encode())
            time.sleep(0.1 if index else ANSWER_AFTER + 0.2)  # before, then after, the decision
            sock.sendall(b"llo")
            got = b""
            while not got.endswith(b"got 5 bytes"):
                chunk = sock.recv(65536)
                assert chunk, got
                got += chunk
            answers.append(_statuses(got))
    assert answers == [[200]] * 3


def test_pipelined_requests_are_each_answered_in_order_while_their_decisions_wait(proxy, lab):
    """Three requests in one write (a chunked POST, a GET, a POST with a length whose body comes later),
    no FIN: each is decided in turn and answered, in order."""
    name, port = _name("open"), lab.public.port
    paths = [_path(f"pl{index}") for index in range(3)]
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(f"POST http://{name}:{port}{paths[0]} HTTP/1.1\r\nHost: {name}:{port}\r\n"
                     "Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
                     f"GET http://{name}:{port}{paths[1]} HTTP/1.1\r\nHost: {name}:{port}\r\n\r\n"
                     f"POST http://{name}:{port}{paths[2]} HTTP/1.1\r\nHost: {name}:{port}\r\n"
                     "Content-Length: 4\r\nConnection: close\r\n\r\nwx".encode())
        time.sleep(ANSWER_AFTER * 2)
        sock.sendall(b"yz")
        answer, _ = _read_all(sock)
    assert _statuses(answer) == [200, 200, 200] and answer.endswith(b"got 4 bytes"), answer[:600]
    assert b"got 3 bytes" in answer and f"hello from public {paths[1]}".encode() in answer, answer[:600]


def test_a_passed_through_tunnel_with_its_client_hello_pipelined(proxy, lab):
    """The CONNECT head and the ClientHello in one write, the decision slow: the handshake completes and a
    request inside is answered (TLS passed through to the origin)."""
    name = _name("open")
    authority = f"{name}:{lab.public_tls.port}"
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        client = TlsClient(sock, name)
        client.handshake(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode(), expect_head=True)
        client.send(f"GET /pass HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n".encode())
        answer = b""
        while chunk := client.recv():
            answer += chunk
    assert _statuses(answer) == [200] and answer.endswith(b"hello from public-tls /pass"), answer[:300]


@pytest.mark.parametrize("pieces", [1, 4])
def test_an_intercepted_tunnel_with_its_client_hello_pipelined_or_in_pieces(proxy, lab, pieces):
    """Interception, each request inside decided (slowly) on its own: the handshake completes whichever way
    the ClientHello comes, and two kept-alive requests, the second's body in two writes, are answered."""
    authority = f"public.lab.example:{lab.public_tls.port}"
    path = _path(f"icpt{pieces}")
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        client = TlsClient(sock, "public.lab.example")
        client.handshake(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode(), pieces=pieces,
                         gap=0.15, expect_head=True)
        client.send(f"GET {path} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        got = b""
        while not got.endswith(path.encode()):
            chunk = client.recv()
            assert chunk, got
            got += chunk
        client.send(f"POST {path} HTTP/1.1\r\nHost: {authority}\r\nContent-Length: 6\r\nConnection: close"
                    "\r\n\r\nabc".encode())
        time.sleep(0.2)
        client.send(b"def")
        while chunk := client.recv():
            got += chunk
    assert _statuses(got) == [200, 200] and got.endswith(b"got 6 bytes"), got[:400]


def test_http2_inside_an_intercepted_tunnel_is_not_offered_and_its_preface_ends_the_connection(proxy, lab):
    """HTTP/2 is not offered to clients (proxy/addons/options.py): a client offering h2 gets HTTP/1.1, and
    one that sends the HTTP/2 preface and three streams anyway (prior knowledge) while the tunnel's
    decision is slow is answered 505 and closed, not left hanging."""
    authority = f"public.lab.example:{lab.public_tls.port}"
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        client = TlsClient(sock, "public.lab.example", alpn=["h2", "http/1.1"])
        client.handshake(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode(), expect_head=True)
        assert client.tls.selected_alpn_protocol() in (None, "http/1.1")
        h2c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        h2c.initiate_connection()
        for stream in (1, 3, 5):
            h2c.send_headers(stream, [(":method", "GET"), (":scheme", "https"), (":authority", authority),
                                      (":path", f"/h2/{stream}")], end_stream=True)
        client.send(h2c.data_to_send())
        sock.settimeout(ANSWER_AFTER + 5)
        answer = b""
        while chunk := client.recv():
            answer += chunk
    assert _statuses(answer) == [505], answer[:300]  # egresswall's refusal, which its record names (round 20)
    assert not [p for _, p, _ in lab.public_tls.requests if p.startswith("/h2/")]


def test_websocket_frames_after_an_upgrade_while_messages_are_decided(proxy, ws_echo):
    """After a (slowly decided) upgrade, frames sent in pieces and back to back are each echoed."""
    name = _name("open")
    authority = f"{name}:{ws_echo.port}"
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(f"GET http://{authority}/ws HTTP/1.1\r\nHost: {authority}\r\nConnection: Upgrade\r\n"
                     "Upgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                     "Sec-WebSocket-Version: 13\r\n\r\n".encode() + _ws_frame(b"early"))
        head = read_head(sock)
        assert head.startswith(b"HTTP/1.1 101"), head
        frames = _ws_frame(b"one") + _ws_frame(b"two") + _ws_frame(b"three")
        for index in range(0, len(frames), 5):
            sock.sendall(frames[index:index + 5])
            time.sleep(0.02)
        sock.sendall(_ws_frame(b"", opcode=8))
        answer, _ = _read_all(sock)
    texts = []
    while len(answer) >= 2 and len(answer) >= 2 + (answer[1] & 0x7F):
        size = answer[1] & 0x7F
        texts.append((answer[0] & 0x0F, answer[2:2 + size]))
        answer = answer[2 + size:]
    assert [t for op, t in texts if op == 1] == [b"early", b"one", b"two", b"three"], texts


def test_many_slow_decisions_at_once_all_end(proxy, lab):
    """Twelve connections at once, each a different way to stop short (a FIN after the head, after half a
    body, a full close during the decision): every connection ends, none is left to the idle timeout."""
    port = lab.public.port
    took: list[float] = []

    def one(index: int) -> None:
        name = _name(f"open{index}x")
        with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
            head = f"POST http://{name}:{port}/many HTTP/1.1\r\nHost: {name}:{port}\r\nContent-Length: 10\r\n\r\n"
            kind = index % 3
            sock.sendall(head.encode() + (b"12345" if kind == 1 else b""))
            if kind == 2:
                time.sleep(0.1)
                return  # closed whole while the decision waits
            sock.shutdown(socket.SHUT_WR)
            took.append(_read_all(sock)[1])

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(15)
    assert len(took) == 8 and max(took) < ANSWER_AFTER + 2, took


def test_zz_the_proxys_descriptors_return_to_where_they_were(proxy):
    """After every connection above has ended (module-scoped proxy: this runs last)."""
    deadline = time.monotonic() + IDLE + 3
    while (now := _fds(proxy.process.pid)) > proxy.baseline_fds + 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert now <= proxy.baseline_fds + 2, (proxy.baseline_fds, now, os.listdir(f"/proc/{proxy.process.pid}/fd"))
