"""Read one request head off a client socket, bounded in size and time (the front and its fast path).

``limits.first_byte_timeout`` for a connection that sends nothing, ``limits.header_timeout`` from the
head's first byte, ``limits.idle_timeout`` for silence inside a head, ``limits.max_header_bytes`` for its
size. A bound passed raises ``HeadProblem``: status 0 means the connection is closed without an answer.
"""

from __future__ import annotations

import asyncio
import socket

from policy.model import Limits

from .head_end import HeadEnd


class HeadProblem(Exception):
    def __init__(self, status: int, rule: str, reason: str) -> None:
        super().__init__(reason)
        self.status, self.rule, self.reason = status, rule, reason


async def read_head(conn: socket.socket, limits: Limits, first_byte: float | None = None,
                    header: float | None = None, data: bytes = b"", first: bool = True) -> tuple[bytes, bytes]:
    """The next request head and whatever came after it. ``data``: bytes already read from the
    connection (a kept-alive connection's next request may have begun in them); ``first``: this is the
    connection's first head (a TLS record there is a client speaking TLS to the proxy itself)."""
    loop = asyncio.get_running_loop()
    first_byte = limits.first_byte_timeout if first_byte is None else first_byte
    header = limits.header_timeout if header is None else header
    if not data:
        try:
            data = await asyncio.wait_for(loop.sock_recv(conn, 65536), first_byte)
        except TimeoutError:
            raise HeadProblem(0, "limits.first_byte_timeout", f"the client sent nothing for "
                                                               f"limits.first_byte_timeout ({first_byte:g}s) after "
                                                               "connecting") from None
        if not data:
            raise OSError("closed before a request")
    if first and data[:1] == b"\x16":
        raise HeadProblem(0, "http:tls-to-proxy", "the client started TLS with the proxy itself; egresswall's "
                                                  "port speaks HTTP/1.1 (send CONNECT)")
    deadline = loop.time() + header
    head_end = HeadEnd()  # each read is searched once, not the whole buffer after every read
    buffer = bytearray(data)  # grown in place: a bytes concatenation per read would copy the whole head each time
    while True:
        end = head_end.find(buffer)
        if 0 <= end <= limits.max_header_bytes:
            return bytes(buffer[:end]), bytes(buffer[end:])
        if (end < 0 and len(buffer) > limits.max_header_bytes) or end >= 0:
            raise HeadProblem(431, "limits.max_header_bytes", f"the request head is over "
                                                              f"{limits.max_header_bytes} bytes "
                                                              "(limits.max_header_bytes)")
        # Silence is bounded by limits.idle_timeout (closed unanswered, as mitmproxy would); a head that
        # keeps dripping, or stops, is bounded by limits.header_timeout from its first byte (408).
        remaining = deadline - loop.time()
        try:
            chunk = await asyncio.wait_for(loop.sock_recv(conn, 65536),
                                           max(0.0, min(remaining, limits.idle_timeout)))
        except TimeoutError:
            if remaining > limits.idle_timeout:
                raise HeadProblem(0, "limits.idle_timeout", f"the connection was closed by egresswall after "
                                                            f"limits.idle_timeout ({limits.idle_timeout:g}s) of "
                                                            f"silence into a request head that never ended "
                                                            f"({len(buffer)} bytes)") from None
            raise HeadProblem(408, "limits.header_timeout", f"the request head was not complete {header:g}s "
                                                            f"after its first byte ({len(buffer)} bytes; "
                                                            "limits.header_timeout)") from None
        if not chunk:
            raise HeadProblem(0, "http:incomplete-head", f"the connection was closed by the client into a "
                                                         f"request head that never ended ({len(buffer)} bytes)")
        buffer += chunk


# How long, and how much, what a client still sends is read and dropped before the proxy closes its connection
# (both transports: mitm_patches.AnsweringWriter too): a client may send all of a 10 MB body before it reads
# the answer it got early; reading costs some milliseconds of CPU a MiB.
LINGER_SECONDS = 2.0
LINGER_BYTES = 16 << 20


async def answer_then_drain(conn: socket.socket, answer: bytes, seconds: float = LINGER_SECONDS,
                            limit: int = LINGER_BYTES) -> None:
    """Send ``answer``, then read and drop what the client still sends (bounded by ``seconds`` and
    ``limit``) before the caller closes: closing a socket with unread bytes makes the kernel send a reset,
    which can destroy the answer before the client has read it."""
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_sendall(conn, answer)
        conn.shutdown(socket.SHUT_WR)
        deadline, drained = loop.time() + seconds, 0
        while drained < limit and (left := deadline - loop.time()) > 0:
            chunk = await asyncio.wait_for(loop.sock_recv(conn, 65536), left)
            if not chunk:
                return
            drained += len(chunk)
    except OSError:  # TimeoutError included
        return
