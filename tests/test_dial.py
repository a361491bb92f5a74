"""proxy/dial.py: the front's one way out connects to exactly the IP literal it is given, on either event
loop, never resolving a name; failures come back as reasons a record can carry."""

from __future__ import annotations

import asyncio
import socket

import pytest

from proxy import event_loop
from proxy.dial import connect_pinned


@pytest.fixture(params=["uvloop", "standard"])
def run(request):
    return lambda main: event_loop.run(main, use_uvloop=request.param == "uvloop")


def test_a_pinned_address_is_connected_to_exactly(run) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    async def main() -> tuple[str, tuple[str, int], bytes]:
        sock, error = await connect_pinned("127.0.0.1", port, 5)
        assert sock is not None
        accepted, _ = listener.accept()
        await asyncio.get_running_loop().sock_sendall(sock, b"ping")
        got = accepted.recv(4)
        peer = sock.getpeername()
        sock.close(), accepted.close()
        return error, peer, got

    assert run(main()) == ("", ("127.0.0.1", port), b"ping")
    listener.close()


@pytest.mark.parametrize("address", ["localhost", "public.lab.example", "127.1", "0x7f.0.0.1", "", "::ffff:zz",
                                     "127.0.0.1 "])
def test_anything_but_an_ip_literal_is_refused_before_a_socket_exists(run, address) -> None:
    sock, error = run(connect_pinned(address, 80, 5))
    assert sock is None and "not an IP address" in error


def test_a_refused_connect_is_a_reason(run) -> None:
    unused = socket.socket()
    unused.bind(("127.0.0.1", 0))  # bound, never listening: a connect to it is refused at once
    port = unused.getsockname()[1]
    sock, error = run(connect_pinned("127.0.0.1", port, 5))
    unused.close()
    assert sock is None and error == f"connect to 127.0.0.1:{port} failed: Connection refused"


def test_an_ipv6_literal_connects_over_ipv6(run) -> None:
    try:
        listener = socket.create_server(("::1", 0), family=socket.AF_INET6)
    except OSError:
        pytest.skip("no IPv6 loopback here")
    port = listener.getsockname()[1]

    async def main() -> int:
        sock, error = await connect_pinned("::1", port, 5)
        assert sock is not None, error
        family = sock.family
        sock.close()
        return family

    assert run(main()) == socket.AF_INET6
    listener.close()
