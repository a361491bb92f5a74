"""Backpressure by direction (proxy/mitm_patches.py, ``_drain_writers`` and ``AnsweringWriter``), in process.

mitmproxy's own connection handler over real loopback sockets, its layer replaced by a script of commands. An
upstream that never reads has a full writer behind it; what matters is whether the upstream's own read loop
still reads it:

* bytes relayed to the upstream from the client fill that writer: the upstream is still read (mitmproxy
  waited, under one lock, for every writer after every read, and stopped reading it: the deadlock
  test_websocket_relay.py shows through the proxy);
* answers the proxy itself wrote to the upstream because of what the upstream sent fill it: its reads wait, as
  before, so a peer that sends and never reads cannot have answers queued without bound;
* the client's read loop still waits for the upstream's writer it filled (the backpressure that protects the
  proxy's memory).
"""

from __future__ import annotations

import asyncio
import socket

from mitmproxy import options as mitm_options
from mitmproxy.addons.proxyserver import Proxyserver
from mitmproxy.connection import ConnectionState, Server
from mitmproxy.proxy import commands, events, mode_specs
from mitmproxy.proxy.server import ConnectionIO, SimpleConnectionHandler

from policy.model import Limits
from proxy import mitm_patches

FILL = 8 << 20  # far past what the kernel's buffers hold: the writer stays full while nobody reads


async def _scenario(upstream_answers_itself: bool) -> tuple[int, int, bool]:
    """The client sends one byte, relayed to the upstream as FILL bytes (or not, when the upstream's own reads
    are answered instead); the upstream, which never reads, then sends a byte five times. How many of the
    upstream's reads the layers saw, how many of the client's, and whether the client's loop was still
    waiting on the full writer."""
    peers: list[socket.socket] = []
    accepted = asyncio.Event()

    def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peers.append(writer.get_extra_info("socket").dup())
        accepted.set()

    listener = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    client_reader, client_writer = await asyncio.open_connection("127.0.0.1", port)
    await accepted.wait()
    accepted.clear()
    opts = mitm_options.Options()
    Proxyserver().load(opts)
    handler = SimpleConnectionHandler(client_reader, client_writer, opts, mode_specs.ProxyMode.parse("regular"), {})
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await accepted.wait()
    server = Server(address=("127.0.0.1", port))
    server.state = ConnectionState.OPEN
    seen = {"client": 0, "server": 0}

    def layers(event):
        if isinstance(event, events.DataReceived):
            side = "client" if event.connection is handler.client else "server"
            seen[side] += 1
            if side == "client" and not upstream_answers_itself:
                yield commands.SendData(server, b"r" * FILL)  # relayed from the client
            if side == "server" and upstream_answers_itself:
                yield commands.SendData(server, b"a" * FILL)  # the proxy's own answer to the upstream
        yield from ()

    handler.layer.handle_event = layers
    handler.transports[server] = ConnectionIO(handler=None, reader=reader, writer=writer)
    server_task = asyncio.create_task(handler.handle_connection(server))
    handler.transports[server].handler = server_task
    client_task = asyncio.create_task(handler.handle_connection(handler.client))
    client_peer, upstream_peer = peers
    client_peer.setblocking(False)
    upstream_peer.setblocking(False)
    client_peer.send(b"c")
    await asyncio.sleep(0.2)
    for _ in range(5):
        upstream_peer.send(b"u")
        await asyncio.sleep(0.1)
    client_peer.send(b"c")  # a second client read, which waits if the client's loop is blocked
    await asyncio.sleep(0.2)
    client_blocked = seen["client"] == 1
    result = (seen["server"], seen["client"], client_blocked)
    for task in (server_task, client_task):
        task.cancel()
    await asyncio.gather(server_task, client_task, return_exceptions=True)
    for sock in peers:
        sock.close()
    listener.close()
    return result


def _run(upstream_answers_itself: bool) -> tuple[int, int, bool]:
    mitm_patches.install(mitm_patches.PatchState(limits=Limits, on_refusal=lambda *a: None,
                                                 on_body_over_limit=lambda *a: None))
    try:
        return asyncio.run(_scenario(upstream_answers_itself))
    finally:
        mitm_patches.uninstall()


def test_a_peer_whose_writer_is_full_of_relayed_bytes_is_still_read():
    server_reads, client_reads, client_blocked = _run(upstream_answers_itself=False)
    assert server_reads >= 2, "the upstream was not read again while the bytes relayed to it waited"
    assert client_blocked and client_reads == 1, "the client was read on past a full upstream writer"


def test_a_peer_that_never_reads_the_proxy_s_own_answers_is_not_read_on():
    server_reads, _, _ = _run(upstream_answers_itself=True)
    assert server_reads == 1, f"the upstream was read {server_reads} times with its answers piling up unread"
