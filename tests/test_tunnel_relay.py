"""The fast tunnel's relay (proxy/tunnel_relay.py) on real loopback sockets: bytes both ways and
counted, half-closes passed on, a failed side ends both, silence is bounded, a slow reader is not idle.
Every test runs on both event loops the proxy can run on (proxy/event_loop.py): uvloop's and the standard one."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from socketpairs import loopback_pair

from proxy import event_loop
from proxy.tunnel_relay import relay


@pytest.fixture(params=["uvloop", "standard"])
def run(request):
    """asyncio.run on the loop under test."""
    return lambda main: event_loop.run(main, use_uvloop=request.param == "uvloop")


async def _tunnel(idle: float = 30, half_closed_idle: float = 5, sent: int = 0):
    """(client end, server end, relay task): what the client end writes reaches the server end."""
    relay_client, client = await loopback_pair()
    relay_server, server = await loopback_pair()
    task = asyncio.get_running_loop().create_task(relay(relay_client, relay_server, idle, half_closed_idle, sent))
    return client, server, task, (relay_client, relay_server)


async def _read_all(sock: socket.socket, want: int | None = None) -> bytes:
    loop, data = asyncio.get_running_loop(), b""
    while want is None or len(data) < want:
        chunk = await loop.sock_recv(sock, 65536)
        if not chunk:
            break
        data += chunk
    return data


def test_bytes_go_both_ways_half_closes_pass_on_and_the_counts_are_right(run) -> None:
    async def scenario():
        loop = asyncio.get_running_loop()
        client, server, task, _ = await _tunnel(sent=7)
        await loop.sock_sendall(client, b"hello server")
        assert await _read_all(server, 12) == b"hello server"
        client.shutdown(socket.SHUT_WR)  # the client is done sending ...
        assert await _read_all(server) == b""  # ... and the server sees its EOF
        await loop.sock_sendall(server, b"still answering")  # the other way stays open
        server.shutdown(socket.SHUT_WR)
        assert await _read_all(client) == b"still answering"
        result = await asyncio.wait_for(task, 5)
        client.close(), server.close()
        return result

    result = run(scenario())
    assert (result.up, result.down, result.error) == (7 + 12, 15, None)


def test_a_side_that_resets_ends_the_tunnel_both_ways_at_once(run) -> None:
    async def scenario():
        client, server, task, _ = await _tunnel(idle=60)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        server.close()  # RST
        started = time.monotonic()
        await asyncio.wait_for(task, 5)
        rest = await asyncio.wait_for(_read_all(client), 5)
        client.close()
        return time.monotonic() - started, rest

    took, rest = run(scenario())
    assert took < 3 and rest == b""


def test_silence_is_cut_at_the_idle_timeout_with_its_reason(run) -> None:
    async def scenario():
        client, server, task, _ = await _tunnel(idle=1.5)
        started = time.monotonic()
        result = await asyncio.wait_for(task, 15)
        client.close(), server.close()
        return time.monotonic() - started, result

    took, result = run(scenario())
    assert 1.4 <= took < 8
    assert result.error == "nothing moved for limits.idle_timeout (1.5s)"


def test_a_half_closed_tunnel_gets_only_the_short_silence(run) -> None:
    async def scenario():
        client, server, task, _ = await _tunnel(idle=60, half_closed_idle=1)
        client.shutdown(socket.SHUT_WR)
        started = time.monotonic()
        result = await asyncio.wait_for(task, 15)
        client.close(), server.close()
        return time.monotonic() - started, result

    took, result = run(scenario())
    assert took < 5
    assert result.error == "nothing moved for 1s after one side finished"


def test_a_slow_reader_is_not_idle_and_gets_every_byte(run) -> None:
    """The server sends 8 MiB at once; the client reads 64 KiB every 40 ms (5 s in all), far past the
    idle timeout of 1 s as measured by arrivals alone: flow control stops reading the server while the
    client lags, and megabytes wait in the kernel's send queue, which the relay counts as moving."""
    size = 8 * 1024 * 1024

    async def scenario():
        loop = asyncio.get_running_loop()
        client, server, task, _ = await _tunnel(idle=1, half_closed_idle=1)
        sending = loop.create_task(loop.sock_sendall(server, b"x" * size))
        got = 0
        while got < size:
            chunk = await loop.sock_recv(client, 65536)
            assert chunk, f"cut after {got} bytes"
            got += len(chunk)
            await asyncio.sleep(0.04)
        await sending
        server.shutdown(socket.SHUT_WR), client.shutdown(socket.SHUT_WR)
        result = await asyncio.wait_for(task, 10)
        client.close(), server.close()
        return got, result

    got, result = run(scenario())
    assert got == size and result.down == size and result.error is None


@pytest.mark.parametrize("end", ["clean", "reset"])
def test_the_relay_closes_its_sockets_when_it_returns(run, end: str) -> None:
    async def scenario():
        client, server, task, relay_sockets = await _tunnel()
        if end == "reset":
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            client.close()
        else:
            client.shutdown(socket.SHUT_WR), server.shutdown(socket.SHUT_WR)
        await asyncio.wait_for(task, 5)
        client.close(), server.close()
        return [sock.fileno() for sock in relay_sockets]

    assert run(scenario()) == [-1, -1]
