#!/usr/bin/env python3
"""The floor under egresswall's plain-HTTP fast path: its I/O skeleton with no gate (benchmark only).

    python tests/benchmarks/floor_http.py LISTEN_PORT UPSTREAM_IP UPSTREAM_PORT [--workers N]

Not a proxy anyone should run: it takes any absolute-form ``http://`` request on 127.0.0.1:LISTEN_PORT
and relays it to one fixed address, whatever host it names, with no policy, no decision, no head
classifier (``proxy/http_head.py``), no hygiene (hop-by-hop headers go through both ways), no records,
no metrics, no body budget. What it keeps is exactly what ``proxy/front.py`` and ``proxy/fast_http.py``
do with the bytes, with the same code where it is I/O: the event loop egresswall runs on
(``proxy/event_loop.py``, uvloop), the bounded head read (``proxy/head_reader.py``) for the first head
and for each kept-alive one after it, a fresh h11 server-side connection parsing each head, the connect
(``proxy/dial.py``'s ``connect_pinned``), the request re-framed by an h11 client-side connection and sent
(``send_while_moving``), the client watched for pipelined bytes while its request waits
(``ClientWatch``), the origin's response parsed by that h11 client-side connection and re-framed for the
client by the server-side one, keep-alive on both sides and the upstream connection reused under the
same rule (``Upstream.reusable_for``: same address, both sides done, nothing unasked waiting). A request
body is streamed through as fast_http streams a Content-Length one (a chunked one is not read whole
first). ``--workers N`` runs N such processes on one port (SO_REUSEPORT), as ``egresswall run --workers
N`` does; ``bench_proxy.py`` starts it with egresswall's worker count.

``bench_proxy.py`` benches it beside direct, squid and egresswall on the plain-HTTP figures: egresswall
minus this floor is what its checks, records and hygiene cost per request, and this floor against squid
is what Python, uvloop and h11 framing both ways cost before any check is made. Where the floor itself
falls short of a goal set against squid, no work on the checks reaches that goal on this design.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import h11  # noqa: E402

from policy.model import Limits  # noqa: E402
from proxy import event_loop  # noqa: E402
from proxy.dial import connect_pinned  # noqa: E402
from proxy.fast_http import READ, ClientWatch, Ended, Upstream, send_while_moving  # noqa: E402
from proxy.head_reader import HeadProblem, read_head  # noqa: E402

LIMITS = Limits()
BOTH_DONE = {h11.CLIENT: h11.DONE, h11.SERVER: h11.DONE}
FAILURES = (OSError, TimeoutError, HeadProblem, Ended, h11.RemoteProtocolError, h11.LocalProtocolError)


def origin_form(target: bytes) -> bytes | None:
    """``http://authority/path?query`` -> ``/path?query`` (what fast_http sends upstream); None when the
    target is not absolute-form http (fast_http hands such a head to mitmproxy; here the connection ends)."""
    if target[:7].lower() != b"http://":
        return None
    slash = target.find(b"/", 7)
    return b"/" if slash < 0 else target[slash:]


async def serve_connection(conn: socket.socket, key: tuple[str, int]) -> None:
    """One client connection: requests relayed until it ends (front._serve, then FastHttp.serve)."""
    loop = asyncio.get_running_loop()
    upstream: Upstream | None = None
    try:
        head, rest = await read_head(conn, LIMITS)
        while True:
            server = h11.Connection(h11.SERVER, max_incomplete_event_size=LIMITS.max_header_bytes)
            server.receive_data(head)
            request = server.next_event()
            if not isinstance(request, h11.Request):
                return
            path = origin_form(request.target)
            if path is None:
                return
            going_on, rest, upstream = await exchange(conn, server, request, path, rest, upstream, key)
            if not going_on:
                return
            await asyncio.sleep(0)  # as FastHttp.serve: an always-ready pair does not starve the others
            if not rest:
                try:
                    rest = await asyncio.wait_for(loop.sock_recv(conn, READ), LIMITS.idle_timeout)
                except (TimeoutError, OSError):
                    return
                if not rest:
                    return
            head, rest = await read_head(conn, LIMITS, data=rest, first=False)
    except FAILURES:
        pass
    finally:
        if upstream is not None:
            upstream.close()
        conn.close()


async def exchange(conn: socket.socket, server: h11.Connection, request: h11.Request, path: bytes, rest: bytes,
                   upstream: Upstream | None, key: tuple[str, int]) -> tuple[bool, bytes, Upstream | None]:
    """FastHttp._exchange without the gate: (keep the connection, bytes of the next request, the upstream kept)."""
    loop = asyncio.get_running_loop()
    idle = LIMITS.idle_timeout
    try:
        if rest:
            server.receive_data(rest)
        if upstream is not None and not upstream.reusable_for(key):
            upstream.close()
            upstream = None
        if upstream is None:
            sock, _ = await connect_pinned(key[0], key[1], LIMITS.connect_timeout)
            if sock is None:
                return False, b"", None
            upstream = Upstream(sock, key, h11.Connection(h11.CLIENT,
                                                          max_incomplete_event_size=LIMITS.max_header_bytes))
        # The request: head re-framed by h11, the body streamed as it comes (FastHttp._send_request).
        out = bytearray(upstream.parser.send(h11.Request(method=request.method, target=path,
                                                         headers=request.headers.raw_items())))
        while True:
            event = server.next_event()
            if event is h11.NEED_DATA:
                if out:
                    await send_while_moving(upstream.sock, bytes(out), idle, "")
                    out.clear()
                chunk = await asyncio.wait_for(loop.sock_recv(conn, READ), idle)
                if not chunk:
                    raise Ended("the client closed into its request body")
                server.receive_data(chunk)
                continue
            if isinstance(event, h11.EndOfMessage):
                break
            if isinstance(event, h11.Data):
                out += upstream.parser.send(h11.Data(data=event.data))
        out += upstream.parser.send(h11.EndOfMessage())
        await send_while_moving(upstream.sock, bytes(out), idle, "")
        watch = ClientWatch(conn, server.trailing_data[0], LIMITS.max_header_bytes, upstream.sock)
        try:
            tail = await relay_response(conn, server, upstream)
        finally:
            watch.stop()
        if watch.over:
            raise Ended("pipelined past the bound")
    except FAILURES:
        if upstream is not None:
            upstream.close()
        return False, b"", None
    try:
        await send_while_moving(conn, tail, idle, "")
    except (OSError, Ended):
        watch.closed = True
    keep = server.states == BOTH_DONE and not watch.closed
    if upstream.parser.states != BOTH_DONE:
        upstream.close()
        upstream = None
    return keep, bytes(watch.data), upstream


async def relay_response(conn: socket.socket, server: h11.Connection, upstream: Upstream) -> bytes:
    """The origin's response parsed by h11 and re-framed for the client (FastHttp._relay_response without
    its checks); its last bytes are returned, not yet sent."""
    loop = asyncio.get_running_loop()
    parser, out = upstream.parser, b""
    while True:
        event = parser.next_event()
        if event is h11.NEED_DATA:
            if out:
                await send_while_moving(conn, out, LIMITS.idle_timeout, "")
                out = b""
            chunk = await asyncio.wait_for(loop.sock_recv(upstream.sock, READ), LIMITS.idle_timeout)
            parser.receive_data(chunk)
        elif isinstance(event, h11.Response):
            out += server.send(h11.Response(status_code=event.status_code, reason=event.reason,
                                            headers=event.headers.raw_items()))
        elif isinstance(event, h11.Data):
            out += server.send(h11.Data(data=event.data))
        elif isinstance(event, h11.EndOfMessage):
            return out + server.send(h11.EndOfMessage())
        elif isinstance(event, h11.ConnectionClosed):
            raise Ended("the upstream closed mid-response")
        # an h11.InformationalResponse (1xx) is not passed on, as on the fast path


async def serve(port: int, upstream_ip: str, upstream_port: int) -> None:
    loop = asyncio.get_running_loop()
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(1024)
    listener.setblocking(False)
    key = (upstream_ip, upstream_port)
    while True:
        conn, _ = await loop.sock_accept(listener)
        conn.setblocking(False)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        loop.create_task(serve_connection(conn, key))


def fork_workers(count: int) -> None:
    """``count`` - 1 more processes serving the same port; each ends when this one does (PR_SET_PDEATHSIG),
    so stopping the first (as the bench's Stack does) stops them all."""
    parent = os.getpid()
    for _ in range(count - 1):
        if os.fork() == 0:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
            if os.getppid() != parent:
                os._exit(0)
            return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("listen_port", type=int)
    parser.add_argument("upstream_ip")
    parser.add_argument("upstream_port", type=int)
    parser.add_argument("--workers", type=int, default=1, help="processes on the port (SO_REUSEPORT)")
    args = parser.parse_args()
    fork_workers(args.workers)
    with contextlib.suppress(KeyboardInterrupt):
        event_loop.run(serve(args.listen_port, args.upstream_ip, args.upstream_port), use_uvloop=True)


if __name__ == "__main__":
    main()
