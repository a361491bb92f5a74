"""Stopping a lab server's threads before its descriptor is freed.

Closing a socket does not wake a thread blocked in ``accept`` or ``recvfrom`` on it (Linux keeps the
listener alive for the blocked call), and the descriptor number is free at once for the next socket the
test process opens. Whole runs piled up such threads (48 by ``test_fast_http.py``), and in them a
connection meant for the session's public origin was taken off its listener and closed unanswered, at
once or after 2 s: what a closed stand-in's thread or a closed DNS server's (its read timeout) does with
one. ``shutdown`` does wake the blocked call (``accept`` fails with EINVAL, ``recvfrom`` returns nothing),
so every lab server stops this way: shut down, join the thread, and only then close.
"""

from __future__ import annotations

import contextlib
import socket
import threading


def stop_serving(sock: socket.socket, *threads: threading.Thread, timeout: float = 5.0) -> None:
    """Wake every thread blocked on ``sock``, wait for them to end, then free the descriptor."""
    with contextlib.suppress(OSError):  # an unconnected UDP socket says ENOTCONN, and is woken all the same
        sock.shutdown(socket.SHUT_RDWR)
    for thread in threads:
        if thread.is_alive():  # a server that was never entered has threads never started
            thread.join(timeout)
    sock.close()


class ConnectionServer:
    """A TCP listener on ``host`` that hands each connection it accepts to ``serve`` on a thread of its own, with
    what ``accepted_one`` made of it on the accepting thread (so per-connection records keep the order of
    accepts). ``close`` stops accepting as above, then ends every connection it accepted."""

    def __init__(self, host: str, port: int = 0) -> None:
        self.sock = socket.create_server((host, port), backlog=64)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self.closed = threading.Event()
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)
            threading.Thread(target=self.serve, args=(conn, *self.accepted_one(conn)), daemon=True).start()

    def accepted_one(self, conn: socket.socket) -> tuple:
        """Extra arguments for ``serve``, made before its thread starts."""
        return ()

    def serve(self, conn: socket.socket, *extra) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.closed.set()
        stop_serving(self.sock, self._acceptor)
        for conn in self.accepted:
            with contextlib.suppress(OSError):  # wakes a serving thread blocked in recv on it
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
