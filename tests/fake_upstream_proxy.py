"""A hostile upstream proxy on loopback that records everything egresswall sends it (review round 20, a
helper's: upstream proxy).

Each accepted connection gets a number; every request head read on it is recorded as (connection number,
head). The answer is chosen by ``answer(head, inside)`` (``inside``: after a CONNECT on this connection was
answered 2xx). By default a CONNECT is answered ``200`` and a plain request ``200`` with a small body; with
``relay_to`` set, an answered CONNECT becomes a byte relay to that loopback address (a working proxy whose
tunnel bytes are recorded as well).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable

from listening import ConnectionServer

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok"
ESTABLISHED = b"HTTP/1.1 200 Connection established\r\n\r\n"


def _read_head(conn: socket.socket, pending: bytearray, limit: int = 1 << 20) -> bytes:
    while b"\r\n\r\n" not in pending and len(pending) < limit:
        chunk = conn.recv(65536)
        if not chunk:
            return b""
        pending += chunk
    head, sep, rest = bytes(pending).partition(b"\r\n\r\n")
    pending[:] = rest
    return head + sep


def header(head: bytes, name: str) -> list[str]:
    out = []
    for line in head.split(b"\r\n")[1:]:
        key, colon, value = line.partition(b":")
        if colon and key.strip().lower() == name.lower().encode():
            out.append(value.strip().decode("latin-1"))
    return out


class FakeUpstream(ConnectionServer):
    def __init__(self, answer: Callable[[bytes, bool], bytes | None] | None = None,
                 relay_to: tuple[str, int] | None = None, host: str = "127.0.0.1") -> None:
        self.answer = answer or self.default_answer
        self.relay_to = relay_to
        self.heads: list[tuple[int, bytes]] = []
        self.raw: dict[int, bytearray] = {}
        self.tunnel_bytes: dict[int, bytearray] = {}  # what came down a relayed tunnel from egresswall
        self.lock = threading.Lock()
        self.count = 0
        super().__init__(host)

    @staticmethod
    def default_answer(head: bytes, inside: bool) -> bytes | None:
        if head.startswith(b"CONNECT ") and not inside:
            return ESTABLISHED
        return OK

    def accepted_one(self, conn: socket.socket) -> tuple:
        with self.lock:
            number = self.count
            self.count += 1
            self.raw[number] = bytearray()
        return (number,)

    def serve(self, conn: socket.socket, number: int) -> None:  # type: ignore[override]
        pending = bytearray()
        inside = False
        with contextlib.suppress(OSError), conn:
            conn.settimeout(15)
            while not self.closed.is_set():
                head = _read_head(conn, pending)
                if not head:
                    return
                self.raw[number] += head
                self.heads.append((number, head))
                length = header(head, "content-length")
                if length and length[0].isdigit():
                    while len(pending) < int(length[0]):
                        chunk = conn.recv(65536)
                        if not chunk:
                            return
                        pending += chunk
                    del pending[:int(length[0])]
                reply = self.answer(head, inside)
                if reply is None:
                    time.sleep(30)
                    return
                conn.sendall(reply)
                if head.startswith(b"CONNECT ") and reply.startswith(ESTABLISHED[:12]) and not inside:
                    inside = True
                    if self.relay_to is not None:
                        self._relay(conn, number, bytes(pending))
                        return

    def _relay(self, conn: socket.socket, number: int, first: bytes) -> None:
        out = socket.create_connection(self.relay_to, timeout=15)
        self.tunnel_bytes[number] = bytearray(first)
        if first:
            out.sendall(first)

        def down() -> None:
            with contextlib.suppress(OSError):
                while chunk := out.recv(65536):
                    conn.sendall(chunk)
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_WR)

        thread = threading.Thread(target=down, daemon=True)
        thread.start()
        with contextlib.suppress(OSError), out:
            while chunk := conn.recv(65536):
                self.tunnel_bytes[number] += chunk
                out.sendall(chunk)
            out.shutdown(socket.SHUT_WR)
            thread.join(10)

    def request_lines(self) -> list[str]:
        return [head.split(b"\r\n", 1)[0].decode("latin-1") for _, head in self.heads]


def upstream_policy(lab, up: FakeUpstream, extra: str = "", creds=None) -> str:
    """The lab policy through ``up`` (CONNECT to the plain-HTTP stand-in allowed too)."""
    text = lab.policy_text(extra + f"upstream:\n  proxy: http://127.0.0.1:{up.port}\n  resolution: upstream\n"
                           + (f"  credentials_file: {creds}\n" if creds else ""))
    return text.replace("connect: [", f"connect: [80, {lab.public.port}, ", 1)


def creds_file(tmp_path):
    path = tmp_path / "creds"
    path.write_text("egress:s3cret-pw\n")
    path.chmod(0o600)
    return path


def client_hello(name: str) -> bytes:
    import contextlib
    import ssl
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ssl.create_default_context().wrap_bio(incoming, outgoing, server_hostname=name)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()
