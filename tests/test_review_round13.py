"""Review round 13: mitmproxy's backpressure by direction (``_drain_writers``, ``AnsweringWriter``), frames
grown in place (``_FrameBuffer``) and bounded inflating (``_inflate_bounded``), probed through the real proxy.

A peer that sends as fast as the proxy takes bytes and never reads must not make the proxy hold memory without
bound, on every protocol mitmproxy's path carries: the proxy's resident memory is measured while it goes on.
Relayed WebSocket messages must come through byte for byte, however they are cut.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import ssl
import struct
import time
import zlib

import pytest
from audit_watch import tree_kib
from labnet import PUBLIC_IP
from listening import ConnectionServer
from proxyproc import both_transports
from ws_echo import WsEcho

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("internal_saw_nothing")]

BLAST_SECONDS = 4.0
GROWTH_MIB = 24  # what a connection may grow the proxy by while its peer sends and never reads



def _blast(sock: socket.socket, next_piece, seconds: float = BLAST_SECONDS) -> int:
    """Send ``next_piece()`` after piece as fast as the socket takes them for ``seconds``, never reading; the
    bytes sent."""
    sock.setblocking(False)
    sent = 0
    pending = b""
    deadline = time.monotonic() + seconds
    with selectors.DefaultSelector() as selector:
        selector.register(sock, selectors.EVENT_WRITE)
        while time.monotonic() < deadline:
            if not pending:
                pending = next_piece()
            if not selector.select(0.2):
                continue
            try:
                count = sock.send(pending)
            except BlockingIOError:
                continue
            except OSError:
                break
            sent += count
            pending = pending[count:]
    return sent


def _grown_mib(proxy, before_kib: int) -> float:
    return (tree_kib(proxy.process.pid) - before_kib) / 1024


# ---- WebSockets: a client that sends and never reads -------------------------------------------------

@pytest.fixture
def echo():
    server = WsEcho(PUBLIC_IP)
    yield server
    server.close()


def _ws_proxy(lab, start_proxy, echo, limits: str = "", extra_args: tuple[str, ...] = ()):
    text = lab.policy_text(limits=limits).replace("  http: [", f"  http: [{echo.port}, ")
    return start_proxy(text.replace("  connect: [", f"  connect: [{echo.port}, "), *extra_args)


def _ws_open(proxy, port: int, tunnel: bool, extensions: str = "") -> socket.socket:
    """A raw WebSocket handshake through the proxy (absolute form, or inside a CONNECT); the socket, past the
    101 (whose head is in ``_HEADS[sock]``)."""
    authority = f"public.lab.example:{port}"
    sock = socket.create_connection((proxy.host, proxy.port), timeout=10)
    if tunnel:
        sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(1)
        assert head.startswith(b"HTTP/1.1 200"), head
        target = "/chat"
    else:
        target = f"http://{authority}/chat"
    ext = f"Sec-WebSocket-Extensions: {extensions}\r\n" if extensions else ""
    sock.sendall((f"GET {target} HTTP/1.1\r\nHost: {authority}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
                  f"{ext}\r\n").encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 101"), head
    _HEADS[sock] = head
    return sock


_HEADS: dict[socket.socket, bytes] = {}


def _frame(opcode: int, payload: bytes, fin: bool = True, rsv1: bool = False, masked: bool = True) -> bytes:
    """A frame: a client's, masked with a zero mask (the payload goes as it is), or a server's, unmasked."""
    first = (0x80 if fin else 0) | (0x40 if rsv1 else 0) | opcode
    mask = 0x80 if masked else 0
    size = len(payload)
    if size < 126:
        head = struct.pack("!BB", first, mask | size)
    elif size < 65536:
        head = struct.pack("!BBH", first, mask | 126, size)
    else:
        head = struct.pack("!BBQ", first, mask | 127, size)
    return head + (b"\x00\x00\x00\x00" if masked else b"") + payload


@both_transports
@pytest.mark.parametrize("tunnel", [False, True], ids=["absolute-form", "in-a-connect"])
@pytest.mark.parametrize("what", ["messages", "pings"])
def test_a_websocket_client_that_sends_and_never_reads_is_bounded(lab, start_proxy, echo, tunnel, what):
    """Messages (each echoed back) or pings (each answered by the origin's pong, relayed back) as fast as the
    proxy takes them, the client reading nothing: what comes back for it waits in the proxy's writer to it,
    which only the origin's read loop waits for (the client's own loop skips it: what it holds was relayed, not
    answered). So the origin must stop being read, and then the client, within the buffers."""
    proxy = _ws_proxy(lab, start_proxy, echo)
    sock = _ws_open(proxy, echo.port, tunnel)
    before = tree_kib(proxy.process.pid)
    frame = _frame(0x2, b"m" * 65536) if what == "messages" else _frame(0x9, b"p" * 125) * 512
    with sock:
        sent = _blast(sock, lambda: frame)
        grown = _grown_mib(proxy, before)
    print(f"{what}: sent {sent >> 20} MiB, proxy grew {grown:.1f} MiB")
    assert grown < GROWTH_MIB, f"the proxy grew by {grown:.0f} MiB ({sent >> 20} MiB sent, nothing read)"


# ---- HTTP/1: a client that pipelines requests and never reads the answers ------------------------------
# (A refusal closes the connection on both transports, so what a never-reading client can pile up is the
# origins' answers, relayed.)

def _requests(lab, kind: str, origin_form: bool = False) -> bytes:
    """A batch of pipelined allowed requests: with 64 KiB answers, or with short ones (many requests)."""
    authority = f"public.lab.example:{lab.public.port}"
    target = "" if origin_form else f"http://{authority}"
    path = "/bytes/65536" if kind == "big" else "/short"
    count = 1 if kind == "big" else 16
    return (f"GET {target}{path} HTTP/1.1\r\nHost: {authority}\r\n\r\n" * count).encode()


@both_transports
@pytest.mark.parametrize("kind", ["big", "short"])
def test_pipelined_requests_whose_answers_are_never_read_are_bounded(lab, start_proxy, kind):
    """Keep-alive requests pipelined as fast as the proxy takes them, no answer read: the origin's answers
    are relayed (the origin's read loop waits for the writer to the client, the client's own loop does not),
    so the origin must stop being read, then the client."""
    proxy = start_proxy(lab.policy_text())
    batch = _requests(lab, kind)
    sock = socket.create_connection((proxy.host, proxy.port), timeout=10)
    before = tree_kib(proxy.process.pid)
    with sock:
        sent = _blast(sock, lambda: batch)
        grown = _grown_mib(proxy, before)
    print(f"{kind}: sent {sent >> 10} KiB, proxy grew {grown:.1f} MiB")
    assert grown < GROWTH_MIB, f"the proxy grew by {grown:.0f} MiB ({sent >> 10} KiB sent, nothing read)"


@both_transports
@pytest.mark.parametrize("kind", ["big", "short"])
def test_pipelined_requests_inside_a_connect_to_a_plain_http_port_are_bounded(lab, start_proxy, kind):
    """The same inside a CONNECT to a plain-HTTP port (mitmproxy parses the HTTP inside on both transports)."""
    proxy = start_proxy(lab.policy_text().replace("  connect: [", f"  connect: [{lab.public.port}, "))
    sock, status, _ = proxy.connect(f"public.lab.example:{lab.public.port}")
    assert status == 200
    batch = _requests(lab, kind, origin_form=True)
    before = tree_kib(proxy.process.pid)
    with sock:
        sent = _blast(sock, lambda: batch)
        grown = _grown_mib(proxy, before)
    print(f"connect {kind}: sent {sent >> 10} KiB, proxy grew {grown:.1f} MiB")
    assert grown < GROWTH_MIB, f"the proxy grew by {grown:.0f} MiB ({sent >> 10} KiB sent, nothing read)"


# ---- TLS: intercepted (HTTP inside), and passed through -------------------------------------------------

class _TlsOverSocket:
    """TLS over a socket with memory BIOs: a handshake that reads, then records written and never read."""

    def __init__(self, sock: socket.socket, server_hostname: str) -> None:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE  # the client is the attacker: it need not trust anyone
        context.set_alpn_protocols(["http/1.1"])
        self.sock = sock
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = context.wrap_bio(self.incoming, self.outgoing, server_hostname=server_hostname)
        sock.settimeout(10)
        while True:
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                sock.sendall(self.outgoing.read())
                data = sock.recv(65536)
                assert data, "closed during the handshake"
                self.incoming.write(data)
        sock.sendall(self.outgoing.read())

    def records(self, plaintext: bytes) -> bytes:
        self.tls.write(plaintext)
        return self.outgoing.read()


@pytest.fixture
def tls_echo(tmp_path):
    from test_tunnel_echo import TlsEcho

    server = TlsEcho(str(tmp_path))
    yield server
    server.close()


@both_transports
@pytest.mark.parametrize("kind", ["big", "short"])
def test_pipelined_requests_in_an_intercepted_tunnel_whose_answers_are_never_read_are_bounded(
        lab, start_proxy, tmp_path, kind):
    """Inside an intercepted tunnel (TLS to the client made by the proxy, to the origin too), requests
    pipelined and the answers never read: the origin's answers are encrypted and written to the client by the
    origin's read loop, which must stop reading the origin."""
    policy = lab.policy_text(extra="hosts:\n  allow:\n    - host: public.lab.example\n      intercept: true\n")
    proxy = start_proxy(policy, "--confdir", str(tmp_path / "ca"), "--upstream-ca", str(lab.cert_file))
    authority = f"public.lab.example:{lab.public_tls.port}"
    sock, status, _ = proxy.connect(authority)
    assert status == 200
    tls = _TlsOverSocket(sock, "public.lab.example")
    plain = (f"GET {'/bytes/65536' if kind == 'big' else '/short'} HTTP/1.1\r\nHost: {authority}\r\n\r\n"
             * (1 if kind == "big" else 16)).encode()
    before = tree_kib(proxy.process.pid)
    with sock:
        sent = _blast(sock, lambda: tls.records(plain))
        grown = _grown_mib(proxy, before)
    print(f"intercepted {kind}: sent {sent >> 10} KiB, proxy grew {grown:.1f} MiB")
    assert grown < GROWTH_MIB, f"the proxy grew by {grown:.0f} MiB ({sent >> 10} KiB sent, nothing read)"
    path = "/bytes/65536" if kind == "big" else "/short"
    assert [r for r in proxy.audit() if r["event"] == "response" and r.get("path") == path], \
        "no request inside the tunnel was answered: it was not intercepted"


@both_transports
def test_a_passed_through_tunnel_whose_client_never_reads_is_bounded(lab, start_proxy, tls_echo):
    """A passed-through TLS tunnel to an origin that echoes as it reads, the client writing records as fast as
    they go and reading nothing: the echo waits in the writer to the client, which the origin's read loop
    waits for."""
    proxy = start_proxy(lab.policy_text().replace("  connect: [", f"  connect: [{tls_echo.port}, "))
    sock, status, _ = proxy.connect(f"public.lab.example:{tls_echo.port}")
    assert status == 200
    tls = _TlsOverSocket(sock, "public.lab.example")
    piece = b"d" * 65536
    before = tree_kib(proxy.process.pid)
    with sock:
        sent = _blast(sock, lambda: tls.records(piece))
        grown = _grown_mib(proxy, before)
    print(f"passthrough: sent {sent >> 20} MiB, proxy grew {grown:.1f} MiB")
    assert grown < GROWTH_MIB, f"the proxy grew by {grown:.0f} MiB ({sent >> 20} MiB sent, nothing read)"


class _Mute(ConnectionServer):
    """An origin on the lab's public address that accepts, reads whatever comes, and never answers."""

    def __init__(self) -> None:
        super().__init__(PUBLIC_IP)

    def serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while conn.recv(65536):
                pass


@pytest.fixture
def mute():
    server = _Mute()
    yield server
    server.close()


def _client_hello(server_hostname: str) -> bytes:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=server_hostname)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


@both_transports
def test_an_intercepted_client_sending_while_the_origin_s_handshake_waits_is_bounded(
        lab, start_proxy, tmp_path, mute):
    """Intercepted: the proxy completes the TLS handshake with the origin before the client's (connects are
    eager), and the origin never answers its ClientHello. Whatever the client sends meanwhile is not the
    client's handshake's to read yet: it must not be read and queued without end."""
    policy = lab.policy_text(extra="hosts:\n  allow:\n    - host: public.lab.example\n      intercept: true\n")
    policy = policy.replace("  connect: [", f"  connect: [{mute.port}, ")
    proxy = start_proxy(policy, "--confdir", str(tmp_path / "ca"), "--upstream-ca", str(lab.cert_file))
    sock, status, _ = proxy.connect(f"public.lab.example:{mute.port}")
    assert status == 200
    sock.sendall(_client_hello("public.lab.example"))
    junk = b"\x17\x03\x03\x40\x00" + b"j" * 16384  # an application-data record's shape
    time.sleep(0.5)
    before = tree_kib(proxy.process.pid)
    with sock:
        sent = _blast(sock, lambda: junk)
        grown = _grown_mib(proxy, before)
    print(f"waiting handshake: sent {sent >> 20} MiB, proxy grew {grown:.1f} MiB")
    assert grown < GROWTH_MIB, f"the proxy grew by {grown:.0f} MiB ({sent >> 20} MiB sent while it waited)"


# ---- WebSocket messages come through exactly, however they are cut -----------------------------------

# Text whose characters take one to four bytes in UTF-8, so cuts land inside characters.
TEXT = "".join(f"{i} aé€😀ü" for i in range(400))
PIECES = [1, 2, 3, 5, 7, 11]  # the sizes of the writes a trickled stream is cut into, in turn


def _trickle(sock: socket.socket, data: bytes, pause_every: int = 8) -> None:
    """``data`` in small writes (the sizes of PIECES in turn), pausing now and then so that they reach the
    proxy in separate reads."""
    offset = index = 0
    while offset < len(data):
        size = PIECES[index % len(PIECES)]
        sock.sendall(data[offset:offset + size])
        offset += size
        index += 1
        if index % pause_every == 0:
            time.sleep(0.001)


def _deflate_message(payload: bytes, compressor) -> bytes:
    """A permessage-deflate message body (RFC 7692 7.2.1: the flush's empty block taken off)."""
    data = compressor.compress(payload) + compressor.flush(zlib.Z_SYNC_FLUSH)
    assert data.endswith(b"\x00\x00\xff\xff")
    return data[:-4]


def _fragments(payload: bytes, opcode: int, cuts: list[int], compressed: bool = False,
               masked: bool = True) -> bytes:
    """One message as frames cut at ``cuts`` (offsets into the payload as sent: inside characters too)."""
    bounds = [0, *cuts, len(payload)]
    frames = b""
    for index in range(len(bounds) - 1):
        piece = payload[bounds[index]:bounds[index + 1]]
        first = index == 0
        last = index == len(bounds) - 2
        frames += _frame(opcode if first else 0x0, piece, fin=last, rsv1=compressed and first, masked=masked)
    return frames


def _read_messages(sock: socket.socket, count: int, deflate: bool, seconds: float = 20) -> list:
    """The next ``count`` messages a wsproto client reads on ``sock`` (past the 101)."""
    from wsproto.connection import Connection, ConnectionType
    from wsproto.events import Message
    from wsproto.extensions import PerMessageDeflate

    extensions = []
    if deflate:
        extension = PerMessageDeflate()
        extension.finalize("permessage-deflate")
        extensions.append(extension)
    ws = Connection(ConnectionType.CLIENT, extensions=extensions)
    messages, parts = [], []
    deadline = time.monotonic() + seconds
    sock.settimeout(1)
    while len(messages) < count and time.monotonic() < deadline:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue
        ws.receive_data(data or None)
        for event in ws.events():
            if isinstance(event, Message):
                parts.append(event.data)
                if event.message_finished:
                    messages.append("".join(parts) if isinstance(event.data, str) else b"".join(parts))
                    parts = []
            else:
                messages.append(event)
        if not data:
            break
    return messages


@pytest.fixture
def deflate_echo():
    server = WsEcho(PUBLIC_IP, deflate=True)
    yield server
    server.close()


@both_transports
@pytest.mark.parametrize("tunnel", [False, True], ids=["absolute-form", "in-a-connect"])
def test_a_fragmented_text_message_trickled_with_characters_cut_comes_back_exactly(
        lab, start_proxy, echo, tunnel):
    """A text message in frames cut inside multi-byte characters, the frames trickled in pieces of a few
    bytes: mitmproxy's layer decodes each frame's text as it comes and cuts the message again where the
    frames' decoded text ended; what the echo sends back must be the text sent."""
    proxy = _ws_proxy(lab, start_proxy, echo)
    payload = TEXT.encode()
    cuts = sorted({offset for offset in range(7, len(payload), 997)})
    assert any(payload[offset] & 0xC0 == 0x80 for offset in cuts), "no cut lands inside a character"
    with _ws_open(proxy, echo.port, tunnel) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _trickle(sock, _fragments(payload, 0x1, cuts))
        sock.sendall(_frame(0x2, bytes(range(256)) * 3))  # and a binary one after it, whole
        messages = _read_messages(sock, 2, deflate=False)
    assert messages == [TEXT, bytes(range(256)) * 3]


@both_transports
@pytest.mark.parametrize("opcode", [0x1, 0x2], ids=["text", "binary"])
def test_a_compressed_fragmented_message_trickled_comes_back_exactly(lab, start_proxy, deflate_echo, opcode):
    """permessage-deflate from the client: one message compressed with context kept from the one before, its
    compressed bytes cut into frames and trickled; mitmproxy inflates each piece (bounded, _inflate_bounded)
    and the origin's echo, compressed again by the proxy, must decode to what was sent."""
    proxy = _ws_proxy(lab, start_proxy, deflate_echo)
    with _ws_open(proxy, deflate_echo.port, tunnel=False, extensions="permessage-deflate") as sock:
        assert b"permessage-deflate" in _HEADS.pop(sock).lower()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        compressor = zlib.compressobj(wbits=-15)
        first = (TEXT * 2).encode() if opcode == 0x1 else os.urandom(3000) + bytes(40000)
        second = (TEXT[::-1]).encode() if opcode == 0x1 else bytes(20000) + os.urandom(2000)
        wire = b""
        for payload in (first, second):
            body = _deflate_message(payload, compressor)
            wire += _fragments(body, opcode, list(range(3, len(body), 401)), compressed=True)
        _trickle(sock, wire)
        messages = _read_messages(sock, 2, deflate=True)
    expected = [first.decode(), second.decode()] if opcode == 0x1 else [first, second]
    assert messages == expected


class _ScriptedOrigin(ConnectionServer):
    """A WebSocket origin on the lab's public address that answers the upgrade (with permessage-deflate, if
    asked) and then sends ``wire`` (unmasked frames) trickled, and reads what comes until the end."""

    def __init__(self, wire: bytes, deflate: bool = False) -> None:
        self.wire, self.deflate = wire, deflate
        super().__init__(PUBLIC_IP)

    def serve(self, conn: socket.socket) -> None:
        import base64
        import hashlib

        with contextlib.suppress(OSError):
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                head += chunk
            key = next(line.split(b":", 1)[1].strip() for line in head.split(b"\r\n")
                       if line.lower().startswith(b"sec-websocket-key:"))
            accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
            ext = "Sec-WebSocket-Extensions: permessage-deflate\r\n" if self.deflate else ""
            conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                         b"Sec-WebSocket-Accept: " + accept + b"\r\n" + ext.encode() + b"\r\n")
            _trickle(conn, self.wire)
            while conn.recv(65536):
                pass


def _origin_wire(deflate: bool) -> tuple[bytes, list]:
    """An origin's messages, cut into frames inside characters (and compressed, with context kept from one
    message to the next, when ``deflate``), and what a client must read of them."""
    text, binary = (TEXT * 2).encode(), os.urandom(2000) + bytes(30000) + os.urandom(500)
    wire = b""
    compressor = zlib.compressobj(wbits=-15)
    for payload, opcode in ((text, 0x1), (binary, 0x2), (text[::-1].decode(errors="ignore").encode(), 0x1)):
        body = _deflate_message(payload, compressor) if deflate else payload
        wire += _fragments(body, opcode, list(range(5, len(body), 613)), compressed=deflate, masked=False)
    expected = [text.decode(), binary, text[::-1].decode(errors="ignore")]
    return wire, expected


@both_transports
@pytest.mark.parametrize("deflate", [False, True], ids=["plain", "permessage-deflate"])
@pytest.mark.parametrize("tunnel", [False, True], ids=["absolute-form", "in-a-connect"])
def test_an_origin_s_messages_cut_and_trickled_reach_the_client_exactly(lab, start_proxy, deflate, tunnel):
    """From the origin's side: text and binary messages in frames cut inside characters (or inside the
    compressed stream), trickled a few bytes a write; the client must read exactly what the origin sent."""
    wire, expected = _origin_wire(deflate)
    origin = _ScriptedOrigin(wire, deflate=deflate)
    try:
        proxy = _ws_proxy(lab, start_proxy, origin)
        with _ws_open(proxy, origin.port, tunnel, extensions="permessage-deflate" if deflate else "") as sock:
            assert (b"permessage-deflate" in _HEADS.pop(sock).lower()) == deflate
            messages = _read_messages(sock, len(expected), deflate=deflate)
    finally:
        origin.close()
    assert messages == expected


@pytest.mark.parametrize(("transport", "intercept"), [("mitmproxy", False), ("mitmproxy", True), ("fast", True)],
                         ids=["passed-through", "intercepted", "intercepted-fast"], indirect=["transport"])
def test_a_client_sending_while_an_upstream_proxy_never_answers_the_connect_is_bounded(
        lab, start_proxy, tmp_path, mute, intercept):
    """mitmproxy's upstream mode answers a CONNECT itself and then asks the upstream proxy for the tunnel; one
    that accepts and never answers leaves the tunnel being made: what the client sends meanwhile must not be
    read and queued without end. (The front asks the upstream proxy before it answers: a tunnel it relays
    itself is not at issue; an intercepted one is mitmproxy's.)"""
    hosts = "hosts:\n  allow:\n    - host: public.lab.example\n      intercept: true\n" if intercept else ""
    policy = lab.policy_text(hosts + f"upstream:\n  proxy: http://{PUBLIC_IP}:{mute.port}\n  resolution: upstream\n")
    proxy = start_proxy(policy, "--confdir", str(tmp_path / "ca"), "--upstream-ca", str(lab.cert_file))
    sock, status, _ = proxy.connect(f"public.lab.example:{lab.public_tls.port}")
    assert status == 200
    sock.sendall(_client_hello("public.lab.example"))
    junk = b"\x17\x03\x03\x40\x00" + b"j" * 16384
    time.sleep(0.5)
    before = tree_kib(proxy.process.pid)
    with sock:
        sent = _blast(sock, lambda: junk)
        grown = _grown_mib(proxy, before)
    print(f"mute upstream proxy: sent {sent >> 20} MiB, proxy grew {grown:.1f} MiB")
    assert grown < GROWTH_MIB, f"the proxy grew by {grown:.0f} MiB ({sent >> 20} MiB sent while it waited)"


@both_transports
def test_a_client_sending_while_an_upstream_proxy_never_answers_an_upgrade_is_bounded(lab, start_proxy, mute):
    """Plain HTTP in upstream mode (mitmproxy's path on both transports): a WebSocket upgrade the upstream proxy
    never answers, the client sending frames on behind it (pipelined bytes behind a waiting request)."""
    upstream = f"upstream:\n  proxy: http://{PUBLIC_IP}:{mute.port}\n  resolution: upstream\n"
    proxy = start_proxy(lab.policy_text(upstream))
    authority = f"public.lab.example:{lab.public.port}"
    sock = socket.create_connection((proxy.host, proxy.port), timeout=10)
    sock.sendall((f"GET http://{authority}/chat HTTP/1.1\r\nHost: {authority}\r\nUpgrade: websocket\r\n"
                  "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                  "Sec-WebSocket-Version: 13\r\n\r\n").encode())
    piece = _frame(0x2, b"w" * 65536)
    time.sleep(0.5)
    before = tree_kib(proxy.process.pid)
    with sock:
        sent = _blast(sock, lambda: piece)
        grown = _grown_mib(proxy, before)
    print(f"mute upstream, upgrade: sent {sent >> 20} MiB, proxy grew {grown:.1f} MiB")
    assert grown < GROWTH_MIB, f"the proxy grew by {grown:.0f} MiB ({sent >> 20} MiB sent while it waited)"
