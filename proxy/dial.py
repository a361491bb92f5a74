"""Connect to one checked address, with ``limits.connect_timeout``: the fast front's only way out.

The connect is the socket's own non-blocking ``connect`` and a wait for the socket to become writable,
not ``loop.sock_connect``: that call first "resolves" the address it is given, and on uvloop's loop even
an IP literal goes through libuv's resolver thread pool (a thread hop measured at about 0.7 ms of a
tunnel's set-up). Here an address that is not an IP literal is refused before any socket exists.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import os
import socket

_IN_PROGRESS = (errno.EINPROGRESS, errno.EAGAIN, errno.EALREADY)


async def connect_pinned(address: str, port: int, timeout: float) -> tuple[socket.socket | None, str]:
    """(socket, "") connected to exactly ``address`` (an IP literal: no name is ever resolved here), or
    (None, why not) with the reason a record can carry."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    except ValueError:
        return None, f"connect to {address!r} refused: not an IP address (only checked addresses are connected to)"
    if "%" in address:
        # ipaddress accepts an IPv6 zone id ("::1%eth0", or any text after the '%'), and the socket module
        # hands such an address to getaddrinfo() rather than inet_pton(): a resolution step in the one path
        # that must have none. Checked addresses never carry one (policy/hosts.py refuses zone ids).
        return None, f"connect to {address!r} refused: an IPv6 zone id is not a checked address"
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        await asyncio.wait_for(connect_socket(sock, (address, port)), timeout)
    except TimeoutError:
        sock.close()
        return None, connect_timed_out(address, port, timeout)
    except OSError as err:
        sock.close()
        return None, connect_failed(address, port, err)
    return sock, ""


# One wording for a failed connect, whichever transport made it (mitmproxy's connects are worded here too:
# proxy/mitm_patches.py ``_open_connection``): the records and the 502's reason say the same on both paths.

def connect_failed(address: str, port: int, err: OSError) -> str:
    return f"connect to {address}:{port} failed: {err.strerror or err}"


def connect_timed_out(address: str, port: int, timeout: float) -> str:
    return f"connect to {address}:{port} timed out after {timeout:g}s (limits.connect_timeout)"


async def connect_socket(sock: socket.socket, address: tuple) -> None:
    """Connect a non-blocking socket to an address already resolved (an IP literal and a port)."""
    code = sock.connect_ex(address)
    if code in _IN_PROGRESS:
        loop = asyncio.get_running_loop()
        writable = loop.create_future()
        fd = sock.fileno()
        loop.add_writer(fd, lambda: writable.done() or writable.set_result(None))
        try:
            await writable
        finally:
            loop.remove_writer(fd)
        code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if code:
        raise OSError(code, os.strerror(code))
