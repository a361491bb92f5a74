"""Helpers for tests/test_r23_intercept*.py: a TLS origin on the lab's public address that records everything it
reads (decrypted), every request head, and after a 101 every WebSocket message (unmasked); and a client that opens
an intercepted tunnel (optionally under a session) and speaks raw bytes inside it."""

from __future__ import annotations

import base64
import contextlib
import re
import socket
import ssl
import struct
import threading
import time

from labnet import PUBLIC_IP
from listening import ConnectionServer
from rawclient import read_head


class RecordingOrigin(ConnectionServer):
    """TLS; records raw bytes read (``raw``, all connections joined), request heads (``heads``), bodies
    (``bodies``) and WebSocket messages after its 101 (``messages``). Answers ``200`` (keep-alive) or ``101`` to a
    WebSocket upgrade."""

    def __init__(self, context: ssl.SSLContext) -> None:
        self.context = context
        self.raw = bytearray()
        self.heads: list[bytes] = []
        self.bodies: list[bytes] = []
        self.messages: list[bytes] = []
        self.lock = threading.Lock()
        super().__init__(PUBLIC_IP)

    def seen(self) -> bytes:
        with self.lock:
            return bytes(self.raw)

    def serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError, ssl.SSLError, ValueError), conn:
            conn.settimeout(15)
            tls = self.context.wrap_socket(conn, server_side=True)
            buf = bytearray()

            def more() -> bool:
                chunk = tls.recv(65536)
                if chunk:
                    with self.lock:
                        self.raw += chunk
                    buf.extend(chunk)
                return bool(chunk)

            while True:
                while b"\r\n\r\n" not in buf:
                    if not more():
                        return
                end = buf.index(b"\r\n\r\n")
                head = bytes(buf[:end])
                del buf[:end + 4]
                self.heads.append(head)
                length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
                body = b""
                if length:
                    while len(buf) < int(length[1]):
                        if not more():
                            return
                    body = bytes(buf[:int(length[1])])
                    del buf[:int(length[1])]
                elif re.search(rb"(?im)^transfer-encoding:.*chunked", head):
                    while not re.search(rb"(^|\r\n)0\r\n(.*?\r\n)?\r\n", buf, re.S):
                        if not more():
                            return
                    match = re.search(rb"(^|\r\n)0\r\n(.*?\r\n)?\r\n", buf, re.S)
                    body = bytes(buf[:match.end()])
                    del buf[:match.end()]
                self.bodies.append(body)
                if b"upgrade: websocket" in head.lower():
                    key = re.search(rb"(?im)^sec-websocket-key:\s*(\S+)", head)
                    import hashlib
                    accept = base64.b64encode(hashlib.sha1(
                        (key[1] if key else b"") + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
                    tls.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                                b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n")
                    self._frames(tls, buf, more)
                    return
                line = head.split(b"\r\n", 1)[0]
                answer = b"origin saw: " + line
                tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: " + str(len(answer)).encode() + b"\r\n\r\n" + answer)

    def _frames(self, tls, buf: bytearray, more) -> None:
        while True:
            while len(buf) < 2:
                if not more():
                    return
            opcode, size = buf[0] & 0x0F, buf[1] & 0x7F
            masked = buf[1] & 0x80
            offset = 2
            if size == 126:
                while len(buf) < 4:
                    if not more():
                        return
                size, offset = struct.unpack("!H", buf[2:4])[0], 4
            elif size == 127:
                while len(buf) < 10:
                    if not more():
                        return
                size, offset = struct.unpack("!Q", buf[2:10])[0], 10
            need = offset + (4 if masked else 0) + size
            while len(buf) < need:
                if not more():
                    return
            mask = buf[offset:offset + 4] if masked else b"\0\0\0\0"
            start = offset + (4 if masked else 0)
            payload = bytes(b ^ mask[i % 4] for i, b in enumerate(buf[start:start + size]))
            del buf[:need]
            if opcode == 8:
                return
            if opcode in (1, 2, 0):
                self.messages.append(payload)
                # echo back as an unmasked text frame (the client then knows the message went through)
                tls.sendall(bytes([0x81, len(payload)]) + payload if len(payload) < 126 else b"")


def open_tunnel(proxy, host: str, port: int, authorization: str | None = None, alpn: list[str] | None = None,
                sni: str | None = None, timeout: float = 10) -> ssl.SSLSocket:
    """CONNECT host:port (with Proxy-Authorization when given), then TLS to the proxy's certificate."""
    sock = socket.create_connection((proxy.host, proxy.port), timeout=timeout)
    lines = [f"CONNECT {host}:{port} HTTP/1.1", f"Host: {host}:{port}"]
    if authorization:
        lines.append(f"Proxy-Authorization: {authorization}")
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    head = read_head(sock)
    assert head.startswith(b"HTTP/1.1 200"), head
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    if alpn:
        context.set_alpn_protocols(alpn)
    return context.wrap_socket(sock, server_hostname=sni or host)


def read_quiet(sock, timeout: float = 2.0) -> bytes:
    """Everything until the peer closes or stays silent for ``timeout`` seconds."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, OSError, ssl.SSLError):
        pass
    return data


def statuses(answer: bytes) -> list[int]:
    return [int(m[1]) for m in re.finditer(rb"HTTP/1\.[01] (\d{3}) ", answer)]


def wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def ws_frame(payload: bytes, opcode: int = 1) -> bytes:
    """One masked client frame."""
    mask = b"\x01\x02\x03\x04"
    size = len(payload)
    head = bytes([0x80 | opcode])
    if size < 126:
        head += bytes([0x80 | size])
    else:
        head += bytes([0x80 | 126]) + struct.pack("!H", size)
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
