"""Connect to one checked address, with ``limits.connect_timeout``: the fast front's only way out."""

from __future__ import annotations

import asyncio
import socket


async def connect_pinned(address: str, port: int, timeout: float) -> tuple[socket.socket | None, str]:
    """(socket, "") connected to exactly ``address`` (an IP literal: no name is ever resolved here), or
    (None, why not) with the reason a record can carry."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, (address, port)), timeout)
    except TimeoutError:
        sock.close()
        return None, f"connect to {address}:{port} timed out after {timeout:g}s (limits.connect_timeout)"
    except OSError as err:
        sock.close()
        return None, f"connect to {address}:{port} failed: {err.strerror or err}"
    return sock, ""
