"""A connected pair of loopback TCP sockets for tests that drive the relay or the dial directly."""

from __future__ import annotations

import asyncio
import socket


async def loopback_pair(small_buffer: int | None = None) -> tuple[socket.socket, socket.socket]:
    """A connected (ours, theirs) pair over 127.0.0.1, both non-blocking. ``small_buffer``: theirs takes
    little (a tiny receive window, a tiny send buffer) and ours queues little in the kernel — a link, or a
    peer, that takes little at a time."""
    listener = socket.socket()
    if small_buffer:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, small_buffer)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    loop = asyncio.get_running_loop()
    theirs = socket.socket()
    if small_buffer:
        theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, small_buffer)
        theirs.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, small_buffer)
    theirs.setblocking(False)
    connecting = loop.create_task(loop.sock_connect(theirs, listener.getsockname()))
    ours, _ = await loop.sock_accept(listener)
    await connecting
    listener.close()
    ours.setblocking(False)
    if small_buffer:
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, small_buffer)
    return ours, theirs
