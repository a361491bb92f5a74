"""Review round 22 (plainhttp): a loopback origin that logs every raw byte it receives per connection and
answers each request it reads (leniently: Content-Length, chunked, or no body) with a small 200, keeping
the connection open. Tests compare what it received with what the proxy decided and recorded."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time

from labnet import PUBLIC_IP
from listening import ConnectionServer


class RawOrigin(ConnectionServer):
    """``raw[i]`` is everything connection i sent; ``heads`` every request head it parsed (in order).
    ``answer`` (bytes) replaces the default response; ``interim`` is sent before each answer."""

    def __init__(self, answer: bytes | None = None, interim: bytes = b"") -> None:
        self.raw: list[bytearray] = []
        self.heads: list[bytes] = []
        self.answer = answer
        self.interim = interim
        self.lock = threading.Lock()
        super().__init__(PUBLIC_IP, 0)

    def accepted_one(self, conn: socket.socket) -> tuple:
        buf = bytearray()
        with self.lock:
            self.raw.append(buf)
        return (buf,)

    def serve(self, conn: socket.socket, buf: bytearray) -> None:  # type: ignore[override]
        pending = bytearray()

        def more() -> bool:
            chunk = conn.recv(65536)
            if not chunk:
                return False
            buf.extend(chunk)
            pending.extend(chunk)
            return True

        with contextlib.suppress(OSError), conn:
            conn.settimeout(15)
            while not self.closed.is_set():
                while b"\r\n\r\n" not in pending:
                    if not more():
                        return
                head, _, rest = bytes(pending).partition(b"\r\n\r\n")
                pending[:] = rest
                with self.lock:
                    self.heads.append(head)
                length = re.search(rb"(?im)^content-length:\s*(\d+)\s*$", head)
                if re.search(rb"(?im)^transfer-encoding:.*chunked", head):
                    # read chunks leniently until the 0 chunk and its blank line
                    while b"\r\n0\r\n\r\n" not in b"\r\n" + bytes(pending) and not bytes(pending).startswith(
                            b"0\r\n\r\n"):
                        if not more():
                            return
                    data = bytes(pending)
                    end = data.find(b"0\r\n\r\n") if data.startswith(b"0\r\n\r\n") else \
                        data.find(b"\r\n0\r\n\r\n") + 2
                    pending[:] = data[end + 5:]
                elif length:
                    n = int(length.group(1))
                    while len(pending) < n:
                        if not more():
                            return
                    pending[:] = bytes(pending)[n:]
                if self.interim:
                    conn.sendall(self.interim)
                conn.sendall(self.answer if self.answer is not None else
                             b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok")

    def all_raw(self) -> bytes:
        with self.lock:
            return b"".join(bytes(b) for b in self.raw)

    def mark(self) -> list[int]:
        """How much each connection has received so far (for ``since``)."""
        with self.lock:
            return [len(b) for b in self.raw]

    def since(self, mark: list[int]) -> bytes:
        """Every byte received after ``mark`` was taken, connection by connection."""
        with self.lock:
            return b"".join(bytes(b)[mark[i] if i < len(mark) else 0:] for i, b in enumerate(self.raw))

    def settle(self, wait: float = 0.4) -> None:
        time.sleep(wait)
