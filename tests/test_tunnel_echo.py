"""A passed-through TLS tunnel to an origin that answers as it reads, both ways at once, on both transports.

The origin (a thread per connection, blocking writes) sends each piece back before it reads the next, and the
client writes as fast as the socket takes bytes while it reads what comes back, as a full-duplex protocol
inside TLS may. Each relay must keep both directions moving: 32 MiB each way gets through. (The WebSocket layer,
which holds a whole message and writes it at once, did hang on such an origin: test_websocket_relay.py. A raw
relay's own backpressure keeps what it queues for the origin small, so this passed before that fix too; it
guards both tunnel paths against a relay that couples its directions.)
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import ssl
import time

import pytest
from labnet import PUBLIC_IP, self_signed
from listening import ConnectionServer
from proxyproc import both_transports

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("internal_saw_nothing")]

SIZE = 32 << 20


class TlsEcho(ConnectionServer):
    """A TLS origin on the lab's public address that sends back each piece as it reads it."""

    def __init__(self, directory: str) -> None:
        self.context, self.cert_file = self_signed(["public.lab.example"], directory)
        super().__init__(PUBLIC_IP)

    def serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError, ssl.SSLError), self.context.wrap_socket(conn, server_side=True) as tls:
            while data := tls.recv(65536):
                tls.sendall(data)


@pytest.fixture
def tls_echo(tmp_path):
    server = TlsEcho(str(tmp_path))
    yield server
    server.close()


@both_transports
def test_a_tunnel_echoing_32_mib_each_way_at_once_gets_through(lab, start_proxy, tls_echo):
    policy = lab.policy_text().replace("  connect: [", f"  connect: [{tls_echo.port}, ")
    proxy = start_proxy(policy)
    sock = socket.create_connection((proxy.host, proxy.port), timeout=10)
    authority = f"public.lab.example:{tls_echo.port}"
    sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 200"), head
    context = ssl.create_default_context(cafile=str(tls_echo.cert_file))
    sent, got = _full_duplex(sock, context, SIZE, seconds=30)
    assert (sent, got) == (SIZE, SIZE), f"sent {sent} and got {got} of {SIZE} bytes in 30 s: the tunnel is stuck"


def _full_duplex(sock: socket.socket, context: ssl.SSLContext, size: int, seconds: float) -> tuple[int, int]:
    """TLS over ``sock`` (memory BIOs, one thread), writing ``size`` bytes as fast as the socket takes them
    while reading whatever comes back; the plaintext bytes sent and received when all came back or time ran
    out."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname="public.lab.example")
    sock.setblocking(False)
    pending = b""  # TLS bytes for the socket
    sent = got = 0
    handshaken = False
    piece = b"d" * 65536
    deadline = time.monotonic() + seconds
    with selectors.DefaultSelector() as selector:
        selector.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
        while got < size and time.monotonic() < deadline:
            if not handshaken:
                with contextlib.suppress(ssl.SSLWantReadError):
                    tls.do_handshake()
                    handshaken = True
            elif sent < size and len(pending) < 262144:
                sent += tls.write(piece[: size - sent])
            pending += outgoing.read()
            for _, mask in selector.select(0.5):
                if mask & selectors.EVENT_WRITE and pending:
                    with contextlib.suppress(BlockingIOError):
                        pending = pending[sock.send(pending):]
                if mask & selectors.EVENT_READ:
                    with contextlib.suppress(BlockingIOError):
                        data = sock.recv(1 << 20)
                        if not data:
                            return sent, got
                        incoming.write(data)
            if handshaken:
                with contextlib.suppress(ssl.SSLWantReadError):
                    while chunk := tls.read(1 << 20):
                        got += len(chunk)
    return sent, got
