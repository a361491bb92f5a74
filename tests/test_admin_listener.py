"""The admin listener (proxy/admin.py, aiohttp) bounds its connections: how long each may live and how
many may be open, so a client that drips a request head holds neither memory nor the port."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from proxy import admin
from proxy.admin import AdminServer


def _server() -> AdminServer:
    return AdminServer({"/healthz": lambda: (200, "text/plain", "ok\n")})


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(65536), seconds) == b""
    except TimeoutError:
        return False
    except ConnectionError:
        return True


def test_a_head_that_drips_is_closed_at_the_connection_lifetime(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admin, "CONNECTION_LIFETIME", 1.0)

    async def scenario() -> tuple[float, bytes]:
        server = _server()
        host, port = await server.start("127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            started = time.monotonic()
            while not reader.at_eof() and time.monotonic() - started < 10:
                writer.write(b"X-Slow: 1\r\n")
                if await _closed_within(reader, 0.2):
                    break
            took = time.monotonic() - started
            # A well-behaved client is still answered (on a new connection).
            reader2, writer2 = await asyncio.open_connection(host, port)
            writer2.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = await asyncio.wait_for(reader2.read(), 5)
            writer.close(), writer2.close()
            return took, answer
        finally:
            await server.stop()

    took, answer = asyncio.run(scenario())
    assert took < 5
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"ok\n")


def test_connections_past_the_cap_are_closed_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admin, "MAX_CONNECTIONS", 5)

    async def scenario() -> tuple[list[bool], int]:
        server = _server()
        host, port = await server.start("127.0.0.1", 0)
        try:
            held = [await asyncio.open_connection(host, port) for _ in range(8)]
            closed = [await _closed_within(reader, 0.5) for reader, _ in held]
            for _, writer in held:
                writer.close()
            await asyncio.sleep(0.3)
            return closed, server.open_connections
        finally:
            await server.stop()

    closed, still_open = asyncio.run(scenario())
    assert closed == [False] * 5 + [True] * 3
    assert still_open == 0  # every connection, refused or not, is counted out again


def test_a_client_that_never_reads_its_answers_is_ended_at_the_connection_lifetime(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The lifetime closed a connection politely, which waits until what is queued for it has been sent: a client
    that pipelined many requests with a tiny receive buffer and never read held its slot for as long as it kept
    the socket, and 64 such held the listener (review round 17). It is ended at the lifetime now."""
    monkeypatch.setattr(admin, "CONNECTION_LIFETIME", 1.0)

    async def scenario() -> tuple[int, int, bytes]:
        server = AdminServer({"/healthz": lambda: (200, "text/plain", "ok\n" + "x" * 60_000)})
        host, port = await server.start("127.0.0.1", 0)
        held = []
        try:
            for _ in range(4):
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
                sock.connect((host, port))
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" * 200)
                held.append(sock)
            await asyncio.sleep(0.5)
            before = server.open_connections
            await asyncio.sleep(2.0)
            after = server.open_connections
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            return before, after, answer
        finally:
            for sock in held:
                sock.close()
            await server.stop()

    before, after, answer = asyncio.run(scenario())
    assert (before, after) == (4, 0)
    assert answer.startswith(b"HTTP/1.1 200")
