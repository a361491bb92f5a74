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

A tunnel whose first ClientHello is judged still has one question open: whether the server asks for a
second ClientHello (a TLS 1.3 HelloRetryRequest), which must name the same server. ``relay`` takes the
tunnel's ``RetryWatch`` (proxy/tls_retry.py) and answers it inline, in the sides' own reads — no task, and
on the common path (a plain ServerHello in the server's first read) nothing more than reading its first
43 bytes: the client is not read while the server's answer is awaited (it has nothing to send that the
server needs first), and its next handshake is held after a HelloRetryRequest until it is judged.
"""

from __future__ import annotations

import asyncio
import fcntl
import socket
import struct
import termios
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .byte_allowance import BUDGET_CUT, DOWN, UP, ByteAllowance
from .tls_hello import TLS_ALERT_UNRECOGNIZED_NAME
from .tls_retry import AWAIT_SERVER, Released, RetryWatch

CHECK_OPEN, CHECK_HALF_CLOSED = 5.0, 1.0  # how often the idle clock is read (seconds)
Refused = Callable[[str, str, int, int], None]  # (rule, reason, bytes up, bytes down): the tunnel's refusal record


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
    over: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    watch: _IdleWatch | None = None
    question: _Question | None = None  # the HelloRetryRequest question, while it is open
    allowance: ByteAllowance | None = None  # its session's bytes left (proxy/byte_allowance.py)

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
        if not self.over.done():
            self.over.set_result(None)
        if self.watch is not None:
            self.watch.stop()
        if self.question is not None:
            self.question.finish()


class _Side(asyncio.Protocol):
    """One socket of the tunnel; ``key`` names the direction of the bytes it receives."""

    def __init__(self, tunnel: _Tunnel, key: str) -> None:
        self.tunnel = tunnel
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.pending = b""  # read before the peer's transport existed (at most one read: reading then pauses)
        self.writing_paused = False  # our transport's buffer is over its high-water mark: the peer is not read
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports do not subclass asyncio's
        # The two transports are made one after the other: the first should read nothing until its peer
        # exists to take the bytes. It is paused; a loop that reads anyway (uvloop starts reading after
        # connection_made) has what it read kept in ``pending`` until the peer is made.
        peer = self.peer
        assert peer is not None
        if peer.transport is None:
            transport.pause_reading()  # type: ignore[attr-defined]
            return
        if peer.pending:
            self.transport.write(peer.pending)
            peer.pending = b""
        if peer.key in self.tunnel.finished and self.transport.can_write_eof():
            self.transport.write_eof()
        # Writing the pending bytes may already have filled our buffer (a peer that reads slowly or not at
        # all): pause_writing was called inside that write and paused the peer. Resuming the peer now would
        # undo it for good — pause_writing is only called again once the buffer has drained below the mark —
        # and a client could then pour unbounded bytes into the proxy's memory. resume_writing resumes it.
        if not peer.transport.is_closing() and not self.writing_paused and not _client_held(self.tunnel):
            peer.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        allowance = self.tunnel.allowance
        if allowance is not None and not allowance.take(self.key, len(data)):
            # Past its session's byte budget: not relayed, and the tunnel ends (the gate says why).
            self.tunnel.end(abort=True, cut=BUDGET_CUT)
            return
        self.tunnel.counts[self.key] += len(data)
        self.tunnel.last_moved = time.monotonic()
        if self.tunnel.question is not None:
            self.tunnel.question.take(self.key, data)
            return
        assert self.peer is not None and self.transport is not None
        if self.peer.transport is None:  # read before the peer was made (see connection_made): held, bounded
            self.pending += data
            self.transport.pause_reading()
            return
        self.peer.transport.write(data)

    def eof_received(self) -> bool:
        # This side is done sending: pass the half-close on and keep the other direction open.
        if self.tunnel.question is not None:  # mid-handshake: what it held can never be judged whole
            self.tunnel.end(cut=self.tunnel.question.watch.ended())
            return True
        self.tunnel.finished.add(self.key)
        if self.tunnel.watch is not None:
            self.tunnel.watch.arm()  # the shorter silence applies from now
        assert self.peer is not None
        peer_transport = self.peer.transport
        if peer_transport is not None and peer_transport.can_write_eof() and not peer_transport.is_closing():
            peer_transport.write_eof()  # (a peer not made yet passes it on when it is: connection_made)
        if len(self.tunnel.finished) == 2:
            self.tunnel.end()
        return True

    def pause_writing(self) -> None:  # our buffer is full: stop reading what fills it
        self.writing_paused = True
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        self.writing_paused = False
        if (self.peer is not None and self.peer.transport is not None and not self.peer.transport.is_closing()
                and not (self.key == UP and _client_held(self.tunnel))):
            self.peer.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)
        # A side that failed (reset) ends the tunnel both ways, now, not at the idle timeout; one that
        # closed cleanly ends it too (its half-close was passed on already).
        self.tunnel.end(abort=exc is not None)


async def relay(client: socket.socket, server: socket.socket, idle: float, half_closed_idle: float,
                sent: int = 0, retry: RetryWatch | None = None, retry_timeout: float = 30.0,
                refused: Refused | None = None, counts: dict[str, int] | None = None,
                allowance: ByteAllowance | None = None) -> RelayResult:
    """Relay until the tunnel is over; the sockets are closed when this returns. With ``retry``, the server's
    first answer is watched for a HelloRetryRequest (see the module's docstring): each of its waits is bounded
    by ``retry_timeout`` and a refusal is given to ``refused`` before both sides are closed. ``counts``: the
    caller's ``{UP: 0, DOWN: 0}``, counted in as the bytes move (a session's byte budgets read it while the
    tunnel is open). ``allowance``: what the tunnel's session may still move; each chunk is taken from it
    before it is relayed (``sent`` was taken by the caller before it went), and the first it cannot take ends
    the tunnel."""
    loop = asyncio.get_running_loop()
    counts = {UP: 0, DOWN: 0} if counts is None else counts
    counts[UP] += sent
    tunnel = _Tunnel(counts=counts, allowance=allowance)
    from_client, from_server = _Side(tunnel, UP), _Side(tunnel, DOWN)
    from_client.peer, from_server.peer = from_server, from_client
    tunnel.sides = [from_client, from_server]
    if retry is not None and not retry.done:
        tunnel.question = _Question(tunnel, retry, retry_timeout, refused)
    try:
        await loop.connect_accepted_socket(lambda: from_client, sock=client)
        await loop.create_connection(lambda: from_server, sock=server)
    except OSError:
        tunnel.end(abort=True)
    else:
        if not tunnel.over.done():
            tunnel.watch = _IdleWatch(tunnel, idle, half_closed_idle)
            await tunnel.over
    finally:
        if tunnel.watch is not None:
            tunnel.watch.stop()
        await _closed(tunnel, half_closed_idle)
    return RelayResult(tunnel.counts[UP], tunnel.counts[DOWN], tunnel.cut)


async def _closed(tunnel: _Tunnel, grace: float) -> None:
    """Close both transports; a closed transport sends what it still holds first, and a reader that takes
    none of it for ``grace`` seconds is cut."""
    sides = [side for side in tunnel.sides if side.transport is not None]
    for side in sides:
        if not side.transport.is_closing():  # type: ignore[union-attr]
            side.transport.abort()  # type: ignore[union-attr]
    waiting = [side.closed for side in sides if not side.closed.done()]
    if not waiting:
        return
    await asyncio.wait(waiting, timeout=grace)
    for side in sides:
        if not side.closed.done():
            side.transport.abort()  # type: ignore[union-attr]
            await side.closed  # the transport closes its socket on the next loop turn: wait for it


def _client_held(tunnel: _Tunnel) -> bool:
    """The client is not read while the server's first answer is awaited."""
    return tunnel.question is not None and tunnel.question.watch.phase == AWAIT_SERVER


class _Question:
    """A tunnel's open HelloRetryRequest question: its RetryWatch, tied to the relay's transports, and the
    timer that bounds each wait (armed only when a wait outlasts one read)."""

    def __init__(self, tunnel: _Tunnel, watch: RetryWatch, timeout: float, refused: Refused | None) -> None:
        self.tunnel, self.watch, self.timeout, self.refused = tunnel, watch, timeout, refused
        self.timer: asyncio.TimerHandle | None = None
        self.timed_phase: str | None = None  # the phase the timer bounds

    def take(self, key: str, data: bytes) -> None:
        self.apply(self.watch.from_server(data) if key == DOWN else self.watch.from_client(data))

    def apply(self, released: Released) -> None:
        tunnel = self.tunnel
        client, server = tunnel.sides
        if released.refused is not None:
            self.finish()
            if self.refused is not None:
                self.refused(released.refused.rule, released.refused.reason, tunnel.counts[UP], tunnel.counts[DOWN])
            if client.transport is not None and not client.transport.is_closing():
                client.transport.write(TLS_ALERT_UNRECOGNIZED_NAME)
            if server.transport is not None:
                server.transport.abort()  # nothing it held reaches the server
            tunnel.end(cut=released.refused.reason)
            return
        if released.to_client and client.transport is not None:
            client.transport.write(released.to_client)
        if released.to_server:
            if server.transport is not None:
                server.transport.write(released.to_server)
            else:
                client.pending += released.to_server  # written when the server's transport is made
        if self.watch.done:
            self.finish()
        elif self.timed_phase != self.watch.phase and (self.watch.phase != AWAIT_SERVER or self.watch.server_held):
            self._arm()
        if client.transport is None or client.transport.is_closing():
            return
        if _client_held(tunnel):
            client.transport.pause_reading()  # (a loop that read anyway, uvloop after connection_made, stops here)
        elif server.transport is not None and not server.writing_paused:
            client.transport.resume_reading()

    def _arm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timed_phase = self.watch.phase
        self.timer = asyncio.get_running_loop().call_later(self.timeout, self._expired)

    def _expired(self) -> None:
        self.timer = None
        if self.tunnel.question is self and not self.watch.done:
            self.apply(Released(refused=self.watch.timed_out(self.timeout)))

    def finish(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.tunnel.question is self:
            self.tunnel.question = None


class _IdleWatch:
    """Cuts the tunnel when nothing has moved for too long. A timer, not a task: it looks every few
    seconds (every second once a side has finished) and costs nothing in between."""

    def __init__(self, tunnel: _Tunnel, idle: float, half_closed_idle: float) -> None:
        self.tunnel, self.idle, self.half_closed_idle = tunnel, idle, half_closed_idle
        self.queued = _queued(tunnel)
        self.timer: asyncio.TimerHandle | None = None
        self.arm()

    def allowed(self) -> float:
        return min(self.idle, self.half_closed_idle) if self.tunnel.finished else self.idle

    def arm(self) -> None:
        self.stop()
        if self.tunnel.over.done():
            return
        period = CHECK_HALF_CLOSED if self.tunnel.finished else CHECK_OPEN
        self.timer = asyncio.get_running_loop().call_later(min(self.allowed(), period), self.look)

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def look(self) -> None:
        self.timer = None
        tunnel = self.tunnel
        if tunnel.over.done():
            return
        now_queued = _queued(tunnel)
        if now_queued != self.queued:  # a peer is still taking what was written to it
            tunnel.last_moved, self.queued = time.monotonic(), now_queued
        allowed = self.allowed()
        if time.monotonic() - tunnel.last_moved > allowed:
            tunnel.end(abort=True, cut=f"nothing moved for {allowed:g}s after one side finished" if tunnel.finished
                       else f"nothing moved for limits.idle_timeout ({self.idle:g}s)")
            return
        self.arm()


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
