"""Copy a passed-through tunnel's bytes both ways, with asyncio transports, until it is over.

The front (proxy/front.py) has already decided the tunnel, connected to the pinned address and
judged the client's first message; from here on only bytes move. Each side is a transport whose
protocol writes what it receives straight into the other side's transport: one ``recv`` and one
``send`` a chunk, with the sockets registered once (the ``loop.sock_*`` calls register and drop a
socket with the event loop on every wait, which was most of a short tunnel's relay cost).

A tunnel ends when both sides have finished, when a side fails (the other is cut at once, not at
the idle timeout), or when nothing has moved for ``idle`` seconds — ``half_closed_idle`` once one
side has said it is done, so a client that vanished cannot hold a tunnel open. Flow control: a side
whose peer cannot keep up stops being read until the peer's buffer drains; a slow reader is not an
idle one.
"""

from __future__ import annotations

import asyncio
import fcntl
import socket
import struct
import termios
import time
from dataclasses import dataclass, field

UP, DOWN = "up", "down"
CHECK_OPEN, CHECK_HALF_CLOSED = 5.0, 1.0  # how often the idle clock is read (seconds)


@dataclass
class RelayResult:
    up: int  # bytes from the client to the server, counting ``sent`` given before the relay began
    down: int
    error: str | None  # why the relay cut the tunnel (idle); None when the sides ended it, or one failed


@dataclass
class _Tunnel:
    counts: dict[str, int]
    last_moved: float = field(default_factory=time.monotonic)
    finished: set[str] = field(default_factory=set)
    cut: str | None = None  # why the relay itself ended the tunnel
    sides: list[_Side] = field(default_factory=list)
    over: asyncio.Event = field(default_factory=asyncio.Event)
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # a side finished: the watcher looks again

    def end(self, abort: bool = False, cut: str | None = None) -> None:
        """Over both ways: closed (what is buffered is still sent), or aborted (a side failed, or the
        relay cut it)."""
        if cut is not None and self.cut is None:
            self.cut = cut
        for side in self.sides:
            if side.transport is not None:
                if abort:
                    side.transport.abort()
                else:
                    side.transport.close()
        self.over.set()
        self.changed.set()


class _Side(asyncio.Protocol):
    """One socket of the tunnel; ``key`` names the direction of the bytes it receives."""

    def __init__(self, tunnel: _Tunnel, key: str) -> None:
        self.tunnel = tunnel
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        # The two transports are made one after the other: the first reads nothing until its peer
        # exists to take the bytes.
        if self.peer is None or self.peer.transport is None:
            transport.pause_reading()
        else:
            self.peer.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        self.tunnel.counts[self.key] += len(data)
        self.tunnel.last_moved = time.monotonic()
        assert self.peer is not None and self.peer.transport is not None
        self.peer.transport.write(data)

    def eof_received(self) -> bool:
        # This side is done sending: pass the half-close on and keep the other direction open.
        self.tunnel.finished.add(self.key)
        self.tunnel.changed.set()
        assert self.peer is not None and self.peer.transport is not None
        if self.peer.transport.can_write_eof() and not self.peer.transport.is_closing():
            self.peer.transport.write_eof()
        if len(self.tunnel.finished) == 2:
            self.tunnel.end()
        return True

    def pause_writing(self) -> None:  # our buffer is full: stop reading what fills it
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None and not self.peer.transport.is_closing():
            self.peer.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)
        # A side that failed (reset) ends the tunnel both ways, now, not at the idle timeout; one that
        # closed cleanly ends it too (its half-close was passed on already).
        self.tunnel.end(abort=exc is not None)


async def relay(client: socket.socket, server: socket.socket, idle: float, half_closed_idle: float,
                sent: int = 0) -> RelayResult:
    """Relay until the tunnel is over; the sockets are closed when this returns."""
    loop = asyncio.get_running_loop()
    tunnel = _Tunnel(counts={UP: sent, DOWN: 0})
    from_client, from_server = _Side(tunnel, UP), _Side(tunnel, DOWN)
    from_client.peer, from_server.peer = from_server, from_client
    tunnel.sides = [from_client, from_server]
    try:
        await loop.connect_accepted_socket(lambda: from_client, sock=client)
        await loop.create_connection(lambda: from_server, sock=server)
    except OSError:
        tunnel.end(abort=True)
    else:
        await _watch(tunnel, idle, half_closed_idle)
    finally:
        for side in tunnel.sides:
            if side.transport is None:
                continue
            if not side.transport.is_closing():
                side.transport.abort()
            try:  # a closed transport sends what it still holds first; a reader that takes none of it is cut
                await asyncio.wait_for(asyncio.shield(side.closed), half_closed_idle)
            except TimeoutError:
                side.transport.abort()
                await side.closed  # the transport closes its socket on the next loop turn: wait for it
    return RelayResult(tunnel.counts[UP], tunnel.counts[DOWN], tunnel.cut)


async def _watch(tunnel: _Tunnel, idle: float, half_closed_idle: float) -> None:
    """Wait for the end; cut the tunnel when nothing has moved for too long."""
    queued = _queued(tunnel)
    while not tunnel.over.is_set():
        allowed = min(idle, half_closed_idle) if tunnel.finished else idle
        tunnel.changed.clear()
        try:
            await asyncio.wait_for(tunnel.changed.wait(),
                                   min(allowed, CHECK_HALF_CLOSED if tunnel.finished else CHECK_OPEN))
            continue
        except TimeoutError:
            pass
        now_queued = _queued(tunnel)
        if now_queued != queued:  # a peer is still taking what was written to it
            tunnel.last_moved, queued = time.monotonic(), now_queued
        if time.monotonic() - tunnel.last_moved > allowed:
            tunnel.end(abort=True, cut=f"nothing moved for {allowed:g}s after one side finished" if tunnel.finished
                       else f"nothing moved for limits.idle_timeout ({idle:g}s)")
            return


def _queued(tunnel: _Tunnel) -> tuple[int, ...]:
    """Bytes written towards each side and not yet taken: the transport's buffer and the kernel's
    send queue (megabytes on a fast link, which a slow reader drains while nothing else moves)."""
    return tuple(_queued_on(side.transport) for side in tunnel.sides)


def _queued_on(transport: asyncio.Transport | None) -> int:
    if transport is None or transport.is_closing():
        return 0
    sock = transport.get_extra_info("socket")
    try:
        kernel = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except OSError:
        kernel = 0
    return transport.get_write_buffer_size() + kernel
