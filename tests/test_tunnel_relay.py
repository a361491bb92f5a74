"""The fast tunnel's relay (proxy/tunnel_relay.py) on real loopback sockets: bytes both ways and
counted, half-closes passed on, a failed side ends both, silence is bounded, a slow reader is not idle.
Every test runs on both event loops the proxy can run on (proxy/event_loop.py): uvloop's and the standard one."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from socketpairs import loopback_pair
from tls_flights import first_hello, retry_handshake, server_first_flight

from proxy import event_loop
from proxy.tls_retry import COMPAT_CHANGE_CIPHER_SPEC, RetryWatch
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


# ---- the HelloRetryRequest question, answered inside the relay (proxy/tls_retry.py) -----------------------


async def _watched_tunnel(watch, refusals: list, timeout: float = 30):
    relay_client, client = await loopback_pair()
    relay_server, server = await loopback_pair()
    task = asyncio.get_running_loop().create_task(
        relay(relay_client, relay_server, 30, 5, 0, watch, timeout, lambda *refusal: refusals.append(refusal)))
    return client, server, task


async def _nothing_within(sock: socket.socket, seconds: float) -> bytes:
    try:
        return await asyncio.wait_for(asyncio.get_running_loop().sock_recv(sock, 65536), seconds)
    except TimeoutError:
        return b""


def test_the_client_waits_until_the_servers_first_answer_shows_it_is_not_a_retry(run) -> None:
    flight = server_first_flight()

    async def scenario():
        loop, refusals = asyncio.get_running_loop(), []
        client, server, task = await _watched_tunnel(RetryWatch("public.lab.example", False, b"held "), refusals)
        await loop.sock_sendall(client, b"early")
        assert await _nothing_within(server, 0.3) == b"", "the client's bytes crossed before the server answered"
        await loop.sock_sendall(server, flight[:30])  # not enough to tell: nothing reaches the client either
        assert await _nothing_within(client, 0.3) == b""
        await loop.sock_sendall(server, flight[30:])
        assert await _read_all(client, len(flight)) == flight
        assert await _read_all(server, 10) == b"held early"
        await loop.sock_sendall(client, b" then")  # from now on a plain relay
        assert await _read_all(server, 5) == b" then"
        client.close(), server.close()
        await asyncio.wait_for(task, 5)
        return refusals

    assert run(scenario()) == []


def test_a_changed_second_hello_after_a_retry_is_refused_once_and_never_reaches_the_server(run) -> None:
    flights = retry_handshake()
    other = COMPAT_CHANGE_CIPHER_SPEC + first_hello("other.lab.example", "secp384r1")

    async def scenario():
        loop, refusals = asyncio.get_running_loop(), []
        client, server, task = await _watched_tunnel(RetryWatch("public.lab.example", False), refusals)
        await loop.sock_sendall(server, flights.retry)
        assert await _read_all(client, len(flights.retry)) == flights.retry
        await loop.sock_sendall(client, other)
        assert (await _read_all(client))[:1] == b"\x15"  # the alert, then the end
        assert await _read_all(server) == b""  # not one byte of the second hello
        result = await asyncio.wait_for(task, 5)
        client.close(), server.close()
        return refusals, result

    refusals, result = run(scenario())
    assert [(rule, up, down) for rule, _, up, down in refusals] == [
        ("tls:retry-hello-changed", len(other), len(flights.retry))]
    assert "other.lab.example" in refusals[0][1] and result.error == refusals[0][1]


def test_the_genuine_second_hello_goes_on_and_a_silent_one_is_cut_at_the_bound(run) -> None:
    flights = retry_handshake()

    async def scenario():
        loop, refusals = asyncio.get_running_loop(), []
        client, server, task = await _watched_tunnel(RetryWatch("public.lab.example", False), refusals)
        await loop.sock_sendall(server, flights.retry)
        await _read_all(client, len(flights.retry))
        await loop.sock_sendall(client, flights.second[:9])
        assert await _nothing_within(server, 0.3) == b""
        await loop.sock_sendall(client, flights.second[9:])
        assert await _read_all(server, len(flights.second)) == flights.second
        client.close(), server.close()
        await asyncio.wait_for(task, 5)

        silent, other_server, silent_task = await _watched_tunnel(RetryWatch("public.lab.example", False), refusals,
                                                                  timeout=0.5)
        started = time.monotonic()
        await loop.sock_sendall(other_server, flights.retry)
        await _read_all(silent)  # the retry, the alert, and the end
        await asyncio.wait_for(silent_task, 5)
        silent.close(), other_server.close()
        return refusals, time.monotonic() - started

    refusals, took = run(scenario())
    assert [rule for rule, *_ in refusals] == ["limits.header_timeout"] and took < 3
