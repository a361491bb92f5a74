"""A connection the proxy closes has its socket closed: nothing a refusal ends stays open behind it.

mitmproxy closed a connection's socket only when the cancel that ended it found the connection reading
or draining. Its master runs tasks eagerly, so events queue on its event lock whenever a hook completes
inside one; a connection cancelled while its event waited there kept its socket open for the life of the
process. A refused tunnel start closes both sides at once while an upstream that speaks first has bytes
on the way, which is where it showed: the upstream connection stayed open, the upstream never told, one
file descriptor gone for each refused tunnel (proxy/mitm_patches.py, "Every closed connection's socket
is closed"). Many tunnels refused at once make the race likely on every run; each must end both ways.
"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from audit_watch import open_fds
from mitmproxy import options as mitm_options
from mitmproxy.addons.proxyserver import Proxyserver
from mitmproxy.connection import ConnectionState, Server
from mitmproxy.proxy import mode_specs
from mitmproxy.proxy.server import ConnectionIO, SimpleConnectionHandler
from proxyproc import both_transports
from test_review_uvloop import SpeakFirstUpstream, _open_tunnel, _policy, _recv_until
from tls_build import client_hello

from policy.model import Limits
from proxy import mitm_patches

TUNNELS = 40


# ---- the patch itself, in process: mitmproxy's own connection handler, real sockets --------------------

async def _cancelled_while_its_event_waits(close_by_command: bool, cancels: int = 1) -> tuple[bytes, bool, list[str]]:
    """One upstream connection on mitmproxy's ``SimpleConnectionHandler``; the upstream sends a byte while
    the handler's event lock is taken (as a queued hook task holds it), and the connection is closed (by a
    layer's command, or its task cancelled as when the client is gone). What the upstream reads next (b""
    once the proxy's socket is closed), whether the connection is still registered, and the events the
    layers got."""
    upstream_side: list[socket.socket] = []
    accepted = asyncio.Event()

    def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_side.append(writer.get_extra_info("socket").dup())
        accepted.set()

    listener = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    client_reader, client_writer = await asyncio.open_connection("127.0.0.1", port)  # the handler's client
    await accepted.wait()
    accepted.clear()
    opts = mitm_options.Options()
    Proxyserver().load(opts)  # the options a connection handler reads (tcp_timeout)
    handler = SimpleConnectionHandler(client_reader, client_writer, opts, mode_specs.ProxyMode.parse("regular"), {})
    seen: list[str] = []

    def layers_see(event):
        seen.append(type(event).__name__)
        yield from ()

    handler.layer.handle_event = layers_see
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await accepted.wait()
    server = Server(address=("127.0.0.1", port))
    server.state = ConnectionState.OPEN
    task = asyncio.create_task(handler.handle_connection(server))
    handler.transports[server] = ConnectionIO(handler=task, reader=reader, writer=writer)
    await handler._server_event_lock.acquire()
    peer = upstream_side[1]
    peer.sendall(b"x")  # its event now waits for the lock
    for _ in range(300):
        await asyncio.sleep(0.01)
        if handler._server_event_lock._waiters:
            break
    assert handler._server_event_lock._waiters, "the upstream's event never queued for the lock"
    if close_by_command:
        handler.close_connection(server)
    else:
        task.cancel()
    for _ in range(cancels - 1):  # another cancel while the patch waits for the lock to tell the layers
        await asyncio.sleep(0.05)
        task.cancel()
    handler._server_event_lock.release()
    with pytest.raises(asyncio.CancelledError):
        await task
    peer.settimeout(3)
    try:
        after = peer.recv(10)
    except TimeoutError:
        after = b"(still open)"
    for sock in upstream_side:
        sock.close()
    client_writer.close()
    listener.close()
    return after, server in handler.transports, seen


@pytest.mark.parametrize(("close_by_command", "cancels"), [(True, 1), (False, 1), (False, 2)],
                         ids=["closed-by-a-layer", "task-cancelled", "task-cancelled-twice"])
def test_a_connection_cancelled_while_its_event_waits_for_mitmproxys_lock_has_its_socket_closed(
        close_by_command, cancels):
    mitm_patches.install(mitm_patches.PatchState(limits=Limits, on_refusal=lambda *a: None,
                                                 on_body_over_limit=lambda *a: None))
    try:
        after, registered, seen = asyncio.run(_cancelled_while_its_event_waits(close_by_command, cancels))
    finally:
        mitm_patches.uninstall()
    assert after == b"", f"the upstream read {after!r}: the proxy's socket to it was left open"
    assert not registered
    # A layer that closed the connection knows it; one whose connection went some other way is told.
    assert seen == ([] if close_by_command else ["ConnectionClosed"])


# ---- through the real proxy ----------------------------------------------------------------------------


@pytest.fixture
def speaker():
    server = SpeakFirstUpstream()
    yield server
    server.close()


def _wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.mark.integration
@pytest.mark.usefixtures("internal_saw_nothing")
@both_transports
def test_every_tunnel_refused_at_its_hello_closes_its_upstream_connection_and_frees_its_socket(
        lab, start_proxy, speaker):
    proxy = start_proxy(_policy(lab))
    fds_before = open_fds(proxy.process.pid)
    sockets: list[socket.socket] = [_open_tunnel(proxy, speaker.port) for _ in range(TUNNELS)]
    try:
        # Every hello is refused (its SNI names another host) with bytes behind it, all at once.
        refused = client_hello(b"other.lab.example") + b"SMUGGLED APPLICATION DATA" * 100
        for sock in sockets:
            sock.sendall(refused)
        answers = [_recv_until(sock, b"never") for sock in sockets]  # to the end: each is closed by the proxy
    finally:
        for sock in sockets:
            sock.close()
    assert all(answer[:1] == b"\x15" and SpeakFirstUpstream.BANNER not in answer for answer in answers)
    assert speaker.ended_all(TUNNELS, 10), (
        f"{sum(not e.is_set() for e in speaker.ended)} of {len(speaker.ended)} upstream connections are still "
        "open after their tunnels were refused")
    assert all(bytes(got) == b"" for got in speaker.received)  # not one byte of any refused hello went on
    # The proxy holds no socket for any of them (a few fds of its own may come and go: a margin of 5).
    assert _wait_until(lambda: open_fds(proxy.process.pid) <= fds_before + 5, 10), (
        f"the proxy holds {open_fds(proxy.process.pid)} fds, {fds_before} before the tunnels")
