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

import h11

from policy.hosts import Target
from policy.model import Upstream

from .dial import connect_socket

MAX_RESPONSE_HEAD = 64 * 1024


async def connect_via_upstream(upstream: Upstream, target: Target, authorization: str | None,
                               timeout: float) -> tuple[socket.socket | None, str]:
    """(a socket whose tunnel to ``target`` is open, "") or (None, why not), within ``timeout`` seconds."""
    try:
        return await asyncio.wait_for(_open(upstream, target, authorization), timeout)
    except TimeoutError:
        return None, (f"the upstream proxy {upstream.url} did not open the tunnel within {timeout:g}s "
                      "(limits.connect_timeout)")


async def _open(upstream: Upstream, target: Target, authorization: str | None) -> tuple[socket.socket | None, str]:
    loop = asyncio.get_running_loop()
    try:
        # The upstream's own name (a host name in the policy) is the operator's, resolved as the system does.
        found = await loop.getaddrinfo(upstream.host, upstream.port, type=socket.SOCK_STREAM)
    except OSError as err:
        return None, f"the upstream proxy {upstream.url} does not resolve: {err.strerror or err}"
    family, _, _, _, address = found[0]
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
    except (OSError, h11.ProtocolError) as err:
        sock.close()
        return None, f"the upstream proxy {upstream.url} failed: {getattr(err, 'strerror', None) or err}"
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
