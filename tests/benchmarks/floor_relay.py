#!/usr/bin/env python3
"""The floor under egresswall's fast tunnel: the front's I/O skeleton with no gate (benchmark only).

    python tests/benchmarks/floor_relay.py LISTEN_PORT UPSTREAM_IP UPSTREAM_PORT

Not a proxy anyone should run: it takes any CONNECT on 127.0.0.1:LISTEN_PORT and relays it to one fixed
address, with no policy, no decision, no ClientHello judgment, no records, no metrics. What it keeps is
exactly what ``proxy/front.py`` does with the bytes, with the same code: the event loop egresswall runs
on (``proxy/event_loop.py``, uvloop), the bounded head read (``proxy/head_reader.py``), the head parsed
by h11 as the front parses it, the connect (``proxy/dial.py``), the 200, the first message read and
passed on, and the relay (``proxy/tunnel_relay.py``). ``bench_tunnel_cpu.py`` measures the CPU a tunnel
costs here beside squid and egresswall: egresswall minus this floor is what its checks cost, and this
floor minus squid is what Python and the event loop cost before any check is made.
"""

from __future__ import annotations

import asyncio
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import h11  # noqa: E402

from policy.model import Limits  # noqa: E402
from proxy import event_loop  # noqa: E402
from proxy.dial import connect_pinned  # noqa: E402
from proxy.head_reader import HeadProblem, read_head  # noqa: E402
from proxy.tunnel_relay import relay  # noqa: E402

LIMITS = Limits()
OK = b"HTTP/1.1 200 Connection established\r\n\r\n"


async def tunnel(conn: socket.socket, upstream_ip: str, upstream_port: int) -> None:
    loop = asyncio.get_running_loop()
    upstream = None
    try:
        head, rest = await read_head(conn, LIMITS)
        parser = h11.Connection(h11.SERVER)
        parser.receive_data(head)
        if not isinstance(parser.next_event(), h11.Request):
            return
        upstream, _ = await connect_pinned(upstream_ip, upstream_port, LIMITS.connect_timeout)
        if upstream is None:
            return
        await loop.sock_sendall(conn, OK)
        first = rest or await asyncio.wait_for(loop.sock_recv(conn, 65536), LIMITS.header_timeout)
        await loop.sock_sendall(upstream, first)
        await relay(conn, upstream, LIMITS.idle_timeout, 5.0, len(first))
    except (OSError, TimeoutError, HeadProblem, h11.RemoteProtocolError):
        pass
    finally:
        conn.close()
        if upstream is not None:
            upstream.close()


async def serve(port: int, upstream_ip: str, upstream_port: int) -> None:
    loop = asyncio.get_running_loop()
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(1024)
    listener.setblocking(False)
    while True:
        conn, _ = await loop.sock_accept(listener)
        conn.setblocking(False)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        loop.create_task(tunnel(conn, upstream_ip, upstream_port))


if __name__ == "__main__":
    event_loop.run(serve(int(sys.argv[1]), sys.argv[2], int(sys.argv[3])), use_uvloop=True)
