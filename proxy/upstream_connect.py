"""The front's tunnel through an upstream proxy: connect to the upstream, ask it for a CONNECT, wait for its 2xx.

The client's CONNECT is answered only once the upstream has opened the tunnel (as the front does when it
connects to a pinned address itself), so a refusal by the upstream — a 407 for egresswall's credentials,
a 403 of its own policy, a 502 when it cannot reach the origin — reaches the client as egresswall's 502
with the upstream's status in the reason, and the tunnel's record says so. The upstream is asked for the
name egresswall checked (the normalised host), never for an address: it resolves the name itself.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import h11

from policy.hosts import Target
from policy.model import Upstream

from .dial import connect_socket
from .records import parser_words, safe_text

MAX_RESPONSE_HEAD = 64 * 1024


class UnreadableAnswer(Exception):
    """The upstream's answer to the CONNECT could not be parsed: (why, for the client; the parser's words)."""


async def connect_via_upstream(upstream: Upstream, target: Target, authorization: str | None,
                               timeout: float, is_self: Callable[[str, int], bool]
                               ) -> tuple[socket.socket | None, str, str]:
    """(a socket whose tunnel to ``target`` is open, "", "") or (None, why not, the same for the record), within
    ``timeout`` seconds. The record's words may quote what the upstream sent; the client's never do.
    ``is_self``: whether an address and port is egresswall's own listener (``Gate.is_self``)."""
    try:
        sock, why = await asyncio.wait_for(_open(upstream, target, authorization, is_self), timeout)
    except TimeoutError:
        why = (f"the upstream proxy {upstream.url} did not open the tunnel within {timeout:g}s "
               "(limits.connect_timeout)")
        return None, why, why
    except UnreadableAnswer as err:
        why, words = err.args
        return None, why, f"{why}: {safe_text(words, 300)}"
    return sock, why, why


async def resolve_upstream(upstream: Upstream, is_self: Callable[[str, int], bool]
                           ) -> tuple[tuple[int, tuple] | None, str]:
    """((address family, socket address) to connect to the upstream at, "") or (None, why not). Its name (a host
    name in the policy) is the operator's, resolved as the system does (``/etc/hosts`` included), each time; a
    name that resolves to egresswall's own listener is refused as the address is (``Gate.guard_upstream``):
    ``localhost:3128`` made one CONNECT a loop of CONNECTs egresswall sent itself (review round 20)."""
    loop = asyncio.get_running_loop()
    try:
        found = await loop.getaddrinfo(upstream.host, upstream.port, type=socket.SOCK_STREAM)
    except OSError as err:
        return None, f"the upstream proxy {upstream.url} does not resolve: {err.strerror or err}"
    for _, _, _, _, address in found:
        if is_self(str(address[0]), upstream.port):
            return None, f"egresswall: the upstream proxy {upstream.url} is egresswall's own listener ({address[0]})"
    family, _, _, _, address = found[0]
    return (family, address), ""


async def _open(upstream: Upstream, target: Target, authorization: str | None, is_self: Callable[[str, int], bool]
                ) -> tuple[socket.socket | None, str]:
    loop = asyncio.get_running_loop()
    resolved, why = await resolve_upstream(upstream, is_self)
    if resolved is None:
        return None, why
    family, address = resolved
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        await connect_socket(sock, address)
        client = h11.Connection(h11.CLIENT)
        headers = [("Host", target.authority)] + ([("Proxy-Authorization", authorization)] if authorization else [])
        await loop.sock_sendall(sock, client.send(h11.Request(method="CONNECT", target=target.authority,
                                                              headers=headers)))
        status, reason = await _response(loop, sock, client)
    except h11.ProtocolError as err:
        sock.close()
        # h11's words quote the upstream's bytes: the record keeps them (``connect_via_upstream``), the client's
        # answer gets them without the quote (review round 20), as for an origin's unreadable answer.
        raise UnreadableAnswer(f"the upstream proxy {upstream.url} answered the CONNECT with a response egresswall "
                               f"cannot read ({parser_words(err)})", str(err)) from None
    except OSError as err:
        sock.close()
        return None, f"the upstream proxy {upstream.url} failed: {err.strerror or err}"
    if not 200 <= status < 300:
        sock.close()
        return None, f"the upstream proxy {upstream.url} refused the tunnel: {status} {reason}".rstrip()
    if client.trailing_data[0]:
        sock.close()  # nothing may come down a tunnel before the client's first message was judged
        return None, f"the upstream proxy {upstream.url} sent data before the tunnel carried any"
    return sock, ""


async def _response(loop: asyncio.AbstractEventLoop, sock: socket.socket, client: h11.Connection) -> tuple[int, str]:
    """The status of the upstream's final answer to the CONNECT (1xx answers are skipped)."""
    seen = 0
    while True:
        event = client.next_event()
        if event is h11.NEED_DATA:
            data = await loop.sock_recv(sock, 65536)
            seen += len(data)
            if seen > MAX_RESPONSE_HEAD:
                raise OSError(f"its answer head is over {MAX_RESPONSE_HEAD} bytes")
            client.receive_data(data)  # b"" at end of file: h11 then says the connection closed
            continue
        if isinstance(event, h11.Response):
            return event.status_code, event.reason.decode("latin-1", "replace")[:100]
        if isinstance(event, h11.ConnectionClosed):
            raise OSError("it closed the connection without answering the CONNECT")
        # h11.InformationalResponse: keep reading
