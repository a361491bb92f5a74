"""A loopback TLS origin that really sends a HelloRetryRequest, and records every byte it got and sent.

It accepts only secp384r1, so a client whose first key share is X25519 is asked again. TLS runs over
an ssl.SSLObject (memory BIOs), so each connection's raw bytes are kept: a test can check the origin's
first answer really was a HelloRetryRequest, and that a refused second ClientHello never reached it.
After the handshake it reads one line and answers ``hello <the SNI it was given>`` and closes.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
from dataclasses import dataclass, field
from pathlib import Path

from labnet import PUBLIC_IP
from listening import ConnectionServer
from tls_flights import is_hello_retry, retrying_server_context


@dataclass
class OriginConnection:
    received: bytearray = field(default_factory=bytearray)
    sent: bytearray = field(default_factory=bytearray)
    names: list[str | None] = field(default_factory=list)  # the SNI of each ClientHello the origin processed
    completed: bool = False  # the handshake finished
    ended: threading.Event = field(default_factory=threading.Event)

    @property
    def sent_hello_retry(self) -> bool:
        return is_hello_retry(bytes(self.sent))


class RetryOrigin(ConnectionServer):
    def __init__(self, directory: str | Path | None = None) -> None:
        self.context, self.cert_file = retrying_server_context(directory)
        self.context.sni_callback = self._named
        self._by_object: dict[int, OriginConnection] = {}
        self.connections: list[OriginConnection] = []
        super().__init__(PUBLIC_IP)

    def _named(self, tls: ssl.SSLObject, name: str | None, _context: ssl.SSLContext) -> None:
        connection = self._by_object.get(id(tls))
        if connection is not None:
            connection.names.append(name)

    def accepted_one(self, conn: socket.socket) -> tuple[OriginConnection]:
        connection = OriginConnection()
        self.connections.append(connection)
        return (connection,)

    def serve(self, conn: socket.socket, connection: OriginConnection) -> None:
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = self.context.wrap_bio(incoming, outgoing, server_side=True)
        self._by_object[id(tls)] = connection
        conn.settimeout(15)

        def flush() -> None:
            out = outgoing.read()
            connection.sent += out
            conn.sendall(out)

        def receive() -> bool:
            data = conn.recv(65536)
            connection.received += data
            incoming.write(data)
            return bool(data)

        try:
            with conn, contextlib.suppress(OSError, ssl.SSLError):
                while True:
                    try:
                        tls.do_handshake()
                        break
                    except ssl.SSLWantReadError:
                        flush()
                        if not receive():
                            return
                flush()
                connection.completed = True
                line = b""
                while not line.endswith(b"\n"):
                    try:
                        line += tls.read(4096)
                    except ssl.SSLWantReadError:
                        if not receive():
                            return
                tls.write(f"hello {connection.names[-1] if connection.names else None}\n".encode())
                flush()
        finally:
            self._by_object.pop(id(tls), None)
            connection.ended.set()
