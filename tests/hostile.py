"""Hostile servers and clients for the hardening tests, all on loopback and all bounded: every server
stops when closed, every loop has a count or a deadline.

Upstreams (on 127.0.0.2, "the public web" of the lab, each on its own port):
  ``EndlessHeaders``  answers a status line, then header lines forever (fast, or one per ``interval``);
  ``Silent``          reads the request and never answers;
  ``RedirectLoop``    answers every request with a redirect to the next step of a loop;
  ``Blackhole``       a listener whose accept queue is full, so a connect to it hangs (SYNs dropped);
  ``Scripted``        answers every request on a kept-alive connection with the same raw bytes (a response
                      an origin frames two ways, or one followed by bytes nobody asked for);
  ``SwitchesProtocols`` answers any request with ``101 Switching Protocols`` and then echoes bytes
                      (what an upstream does to turn a plain request into a raw relay).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from labnet import PUBLIC_IP
from listening import ConnectionServer


class _Server(ConnectionServer):
    """Reads each connection's request head and hands both to ``handle`` (on the connection's own thread)."""

    def __init__(self, host: str = PUBLIC_IP, port: int = 0) -> None:
        super().__init__(host, port)

    @property
    def connections(self) -> int:
        return len(self.accepted)

    def serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError), conn:
            conn.settimeout(30)
            self.handle(conn, read_head(conn))

    def handle(self, conn: socket.socket, head: bytes) -> None:
        raise NotImplementedError


class SwitchesProtocols(_Server):
    def __init__(self, port: int = 0) -> None:
        super().__init__(port=port)
        self.heads: list[bytes] = []
        self.echoed = 0

    def handle(self, conn: socket.socket, head: bytes) -> None:
        self.heads.append(head)
        conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                     b"Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (chunk := conn.recv(65536)):
            self.echoed += len(chunk)
            conn.sendall(chunk)


class Scripted(_Server):
    """Answers each request head on a connection with ``answer``, as it is, and keeps reading heads."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.heads: list[bytes] = []
        super().__init__()

    def handle(self, conn: socket.socket, head: bytes) -> None:
        while head and not self.closed.is_set():
            self.heads.append(head)
            conn.sendall(self.answer)
            head = read_head(conn)


def read_head(conn: socket.socket, limit: int = 1 << 20) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data and len(data) < limit:
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


class EndlessHeaders(_Server):
    """A status line, then header lines until the peer goes away (or ``max_seconds`` pass)."""

    def __init__(self, interval: float = 0.0, max_seconds: float = 60.0) -> None:
        self.interval, self.max_seconds = interval, max_seconds
        self.sent = 0
        super().__init__()

    def handle(self, conn: socket.socket, head: bytes) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\n")
        deadline = time.monotonic() + self.max_seconds
        line = b"X-Endless: " + b"a" * 1000 + b"\r\n"
        while not self.closed.is_set() and time.monotonic() < deadline:
            conn.sendall(line)
            self.sent += len(line)
            if self.interval:
                time.sleep(self.interval)


class Silent(_Server):
    """Reads the request, then holds the connection without a byte until the peer closes it."""

    def handle(self, conn: socket.socket, head: bytes) -> None:
        conn.settimeout(1)
        while not self.closed.is_set():
            try:
                if not conn.recv(4096):
                    return
            except TimeoutError:
                continue


class RedirectLoop(_Server):
    """Every request gets 302 to ``/loop/<n+1>`` on the same host: a loop only the client can end."""

    def __init__(self) -> None:
        self.requests = 0
        super().__init__()

    def handle(self, conn: socket.socket, head: bytes) -> None:
        while head:
            self.requests += 1
            path = head.split(b" ", 2)[1].decode("latin-1")
            n = int(path.rsplit("/", 1)[-1]) if path.startswith("/loop/") else 0
            host = next((line.split(b":", 1)[1].strip() for line in head.split(b"\r\n")
                         if line.lower().startswith(b"host:")), b"").decode("latin-1")
            conn.sendall(f"HTTP/1.1 302 Found\r\nLocation: http://{host}/loop/{n + 1}\r\n"
                         f"Content-Length: 0\r\n\r\n".encode())
            head = read_head(conn)


class Blackhole:
    """A listener whose accept queue is full: the kernel drops further SYNs, so connects hang until the
    connector gives up. (listen(0) queues one connection; two fillers make sure it is full.)"""

    def __init__(self, host: str = PUBLIC_IP) -> None:
        self.sock = socket.socket()
        self.sock.bind((host, 0))
        self.sock.listen(0)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.fillers = []
        for _ in range(3):
            filler = socket.socket()
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect((host, self.port))
            self.fillers.append(filler)
        time.sleep(0.2)

    def hangs(self, timeout: float = 1.0) -> bool:
        """True when a new connect does not complete within ``timeout`` (the queue is full)."""
        probe = socket.socket()
        probe.settimeout(timeout)
        try:
            probe.connect((self.host, self.port))
        except (TimeoutError, OSError):
            return True
        finally:
            probe.close()
        return False

    def close(self) -> None:
        for filler in self.fillers:
            filler.close()
        self.sock.close()


def slowloris(host: str, port: int, count: int, head: bytes, interval: float, stop: threading.Event,
              source: str = "127.0.0.1") -> list[dict]:
    """``count`` connections that each send ``head`` one byte every ``interval`` seconds, until the proxy
    closes them or ``stop`` is set. Returns per-connection results (what the proxy answered, when)."""
    results = [{"answer": b"", "closed_after": None} for _ in range(count)]
    socks = []
    for _ in range(count):
        sock = socket.socket()
        sock.bind((source, 0))
        sock.connect((host, port))
        sock.setblocking(False)
        socks.append(sock)
    started = time.monotonic()
    position = 0
    while not stop.is_set() and any(r["closed_after"] is None for r in results):
        for sock, result in zip(socks, results, strict=True):
            if result["closed_after"] is not None:
                continue
            try:
                if position < len(head):
                    sock.send(head[position:position + 1])
                data = sock.recv(65536)
                result["answer"] += data
                if not data:
                    result["closed_after"] = time.monotonic() - started
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                result["closed_after"] = time.monotonic() - started
        position += 1
        stop.wait(interval)
    for sock in socks:
        sock.close()
    return results
