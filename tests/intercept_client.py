"""Helpers for tests/test_review_round19_intercept.py: a TLS origin on the lab's public address that records
every request head it reads (raw bytes), and a client that opens an intercepted tunnel through the proxy and
speaks inside it."""

from __future__ import annotations

import contextlib
import re
import socket
import ssl
import time

from labnet import PUBLIC_IP
from listening import ConnectionServer
from rawclient import read_head


class RecordingTlsOrigin(ConnectionServer):
    """TLS on PUBLIC_IP; each request head read is recorded raw (``heads``), its body read by Content-Length or
    chunked framing, and answered ``200`` with the request line as body; keep-alive. ``alpn``: protocols the
    origin offers (what it negotiated is recorded in ``negotiated``)."""

    def __init__(self, context: ssl.SSLContext) -> None:
        self.context = context
        self.heads: list[bytes] = []
        self.raw: list[bytes] = []  # everything read, per connection
        self.negotiated: list[str | None] = []
        super().__init__(PUBLIC_IP)

    def serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError, ssl.SSLError), conn:
            conn.settimeout(10)
            tls = self.context.wrap_socket(conn, server_side=True)
            self.negotiated.append(tls.selected_alpn_protocol())
            buf = b""
            index = len(self.raw)
            self.raw.append(b"")
            while True:
                while b"\r\n\r\n" not in buf:
                    chunk = tls.recv(65536)
                    if not chunk:
                        return
                    self.raw[index] += chunk
                    buf += chunk
                head, _, buf = buf.partition(b"\r\n\r\n")
                self.heads.append(head)
                length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
                if length:
                    need = int(length[1])
                    while len(buf) < need:
                        chunk = tls.recv(65536)
                        if not chunk:
                            return
                        self.raw[index] += chunk
                        buf += chunk
                    buf = buf[need:]
                elif re.search(rb"(?im)^transfer-encoding:.*chunked", head):
                    while not re.search(rb"(^|\r\n)0\r\n(.*\r\n)?\r\n", buf, re.S):
                        chunk = tls.recv(65536)
                        if not chunk:
                            return
                        self.raw[index] += chunk
                        buf += chunk
                    buf = buf[re.search(rb"(^|\r\n)0\r\n(.*?\r\n)?\r\n", buf, re.S).end():]
                line = head.split(b"\r\n", 1)[0]
                if b"upgrade: websocket" in head.lower():
                    tls.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                                b"Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n")
                    continue
                body = b"origin saw: " + line
                if b"/idleclose" in line:  # a keep-alive answer, then the origin closes (its idle timeout)
                    tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
                    time.sleep(0.2)
                    with contextlib.suppress(OSError, ssl.SSLError):
                        tls.unwrap()
                    return
                if b"/close" in line:
                    tls.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: " + str(len(body)).encode()
                                + b"\r\n\r\n" + body)
                    with contextlib.suppress(OSError, ssl.SSLError):
                        tls.unwrap()
                    return
                tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)

    def lines(self) -> list[bytes]:
        time.sleep(0.2)
        return [h.split(b"\r\n", 1)[0] for h in self.heads]


def open_intercepted(proxy, host: str, port: int, alpn: list[str] | None = None,
                     timeout: float = 10) -> tuple[ssl.SSLSocket, bytes]:
    """CONNECT host:port, then TLS to the proxy's own certificate (not verified). Returns the TLS socket and the
    CONNECT answer head; raises AssertionError when the CONNECT was refused."""
    sock = socket.create_connection((proxy.host, proxy.port), timeout=timeout)
    sock.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
    head = read_head(sock)
    assert head.startswith(b"HTTP/1.1 200"), head
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    if alpn:
        context.set_alpn_protocols(alpn)
    return context.wrap_socket(sock, server_hostname=host), head


def read_until_quiet(sock, timeout: float = 3.0) -> bytes:
    """Everything until the peer closes or stays silent for ``timeout`` seconds."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionResetError, ssl.SSLError, OSError):
        pass
    return data


def statuses(answer: bytes) -> list[int]:
    return [int(m[1]) for m in re.finditer(rb"HTTP/1\.[01] (\d{3}) ", answer)]
