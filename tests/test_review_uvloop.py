"""Adversarial review of the fast tunnel path on uvloop (proxy/event_loop.py, proxy/tunnel_relay.py,
proxy/dial.py, the test guard in tests/proxyproc.py): a client that floods, half-closes or resets at odd
moments, an upstream that speaks first or never reads. Every test runs on both event loops the proxy can
run on; the relay tests on real loopback sockets, the rest through the real proxy process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from labnet import PUBLIC_IP
from listening import ConnectionServer
from proxyproc import GUARD_PRELUDE, ROOT
from socketpairs import loopback_pair
from tls_build import client_hello

from proxy import event_loop
from proxy.dial import connect_pinned
from proxy.tunnel_relay import relay

LOOP_NAMES = ["uvloop", "standard"]
LOOP_OPTIONS = {"uvloop": (), "standard": ("--no-uvloop",)}
SMALL = 4096  # a socket buffer as small as the kernel allows: a link (or a peer) that takes little at a time


@pytest.fixture(params=LOOP_NAMES)
def run(request):
    """asyncio.run on the loop under test."""
    return lambda main: event_loop.run(main, use_uvloop=request.param == "uvloop")


def _open_fds() -> int:
    """Sockets this process holds (not every fd: libuv keeps a /dev/null of its own from first use)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return count


async def _read_all(sock: socket.socket, want: int | None = None) -> bytes:
    loop, data = asyncio.get_running_loop(), b""
    while want is None or len(data) < want:
        try:
            chunk = await loop.sock_recv(sock, 65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data


# The byte stream a flooding client sends: byte k is k % 251, so a lost, doubled or reordered chunk shows.
_PATTERN = bytes(range(251)) * (65536 // 251 + 2)


def _stream_at(offset: int, size: int = 65536) -> memoryview:
    start = offset % 251
    return memoryview(_PATTERN)[start:start + size]


# ---- the relay: bytes read before the upstream side exists ------------------------------------------------


def test_a_client_flooding_before_the_upstream_side_exists_stays_flow_controlled(run) -> None:
    """DEFECT (fixed in proxy/tunnel_relay.py, _Side.connection_made). On uvloop the client's transport
    reads once before the upstream's transport exists; those bytes are written to the upstream when its
    transport is made. If that write fills the upstream transport's buffer, pause_writing pauses the
    client — and connection_made then resumed it unconditionally, and pause_writing is not called again
    while the buffer stays full: the client's reading was never paused again, and everything it sent
    piled up in the proxy's memory while the upstream read nothing (64 MiB in 3 s here). Now the client
    gets in only what the kernel's buffers and the transport's high-water mark hold, and once the
    upstream reads, every byte arrives, in order."""
    flood_limit, bound = 64 * 2**20, 16 * 2**20

    async def scenario() -> tuple[int, int | None]:
        loop = asyncio.get_running_loop()
        relay_client, client = await loopback_pair()
        relay_server, server = await loopback_pair(SMALL)  # an upstream that reads nothing, over a thin link
        sent = 0
        while sent < 320_000:  # waiting in the kernel when the relay starts: uvloop's first read takes it
            sent += client.send(_stream_at(sent))
        task = loop.create_task(relay(relay_client, relay_server, 30, 5))
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and sent < flood_limit:
            try:
                sent += client.send(_stream_at(sent))
            except BlockingIOError:
                await asyncio.sleep(0.01)
        if sent > bound:  # held in the proxy's memory: stop here rather than read it all through 4 KiB
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            client.close(), server.close()
            await asyncio.wait_for(task, 10)
            return sent, None
        client.shutdown(socket.SHUT_WR)
        got = 0
        while chunk := await loop.sock_recv(server, 65536):
            assert chunk == _stream_at(got, len(chunk)), f"the stream differs at byte {got}"
            got += len(chunk)
        server.shutdown(socket.SHUT_WR)
        result = await asyncio.wait_for(task, 10)
        client.close(), server.close()
        assert result.up == sent and result.error is None
        return sent, got

    sent, got = run(scenario())
    assert sent <= bound, f"the client got {sent} bytes into the proxy while the upstream read none"
    assert got == sent


def test_bytes_and_a_half_close_sent_before_the_relay_starts_arrive_in_order(run) -> None:
    """The client's data and EOF both wait in the kernel when the relay starts (on uvloop the data is
    read before the upstream side exists and held; the EOF must follow it, not overtake it or be lost)."""
    async def scenario():
        loop = asyncio.get_running_loop()
        relay_client, client = await loopback_pair()
        relay_server, server = await loopback_pair()
        await loop.sock_sendall(client, b"early bytes")
        client.shutdown(socket.SHUT_WR)
        await asyncio.sleep(0.05)
        task = loop.create_task(relay(relay_client, relay_server, 30, 5))
        got = await asyncio.wait_for(_read_all(server), 5)  # ends at the EOF passed on
        await loop.sock_sendall(server, b"the answer")  # the other way is still open
        server.shutdown(socket.SHUT_WR)
        answer = await asyncio.wait_for(_read_all(client), 5)
        result = await asyncio.wait_for(task, 5)
        client.close(), server.close()
        return got, answer, result

    got, answer, result = run(scenario())
    assert (got, answer) == (b"early bytes", b"the answer")
    assert (result.up, result.down, result.error) == (11, 10, None)


def test_an_eof_alone_before_the_relay_starts_is_passed_on(run) -> None:
    async def scenario():
        loop = asyncio.get_running_loop()
        relay_client, client = await loopback_pair()
        relay_server, server = await loopback_pair()
        client.shutdown(socket.SHUT_WR)
        await asyncio.sleep(0.05)
        task = loop.create_task(relay(relay_client, relay_server, 60, 60))
        got = await asyncio.wait_for(_read_all(server), 5)
        server.shutdown(socket.SHUT_WR)
        result = await asyncio.wait_for(task, 5)
        client.close(), server.close()
        return got, result

    got, result = run(scenario())
    assert got == b"" and (result.up, result.down, result.error) == (0, 0, None)


def test_a_client_reset_before_the_relay_starts_ends_it_at_once_and_leaves_no_socket(run) -> None:
    async def scenario():
        loop = asyncio.get_running_loop()
        before = _open_fds()
        relay_client, client = await loopback_pair()
        relay_server, server = await loopback_pair()
        await loop.sock_sendall(client, b"x" * 100_000)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        client.close()  # RST, with bytes the relay has not read yet
        await asyncio.sleep(0.05)
        started = time.monotonic()
        await asyncio.wait_for(relay(relay_client, relay_server, 60, 60), 5)
        took = time.monotonic() - started
        await asyncio.wait_for(_read_all(server), 5)  # the upstream side is ended too (EOF or reset)
        server.close()
        return took, [relay_client.fileno(), relay_server.fileno()], _open_fds() - before

    took, filenos, leaked = run(scenario())
    assert took < 2 and filenos == [-1, -1] and leaked == 0


# ---- the relay: tunnels that must end ---------------------------------------------------------------------


def test_both_sides_finished_with_a_reader_that_never_reads_ends_after_the_grace(run) -> None:
    """The upstream sends a little more than the client's thin link holds and finishes; the client
    finishes without reading. Both are done, but a closed transport still holds bytes for a reader that
    takes none: it is cut after the grace (half_closed_idle), not kept for ever."""
    async def scenario():
        loop = asyncio.get_running_loop()
        before = _open_fds()
        relay_client, client = await loopback_pair(SMALL)
        relay_server, server = await loopback_pair()
        task = loop.create_task(relay(relay_client, relay_server, 60, 1))
        await loop.sock_sendall(server, b"y" * 48_000)  # under the transport's high-water mark: no pause
        server.shutdown(socket.SHUT_WR)
        await asyncio.sleep(0.2)
        client.shutdown(socket.SHUT_WR)
        started = time.monotonic()
        result = await asyncio.wait_for(task, 15)
        took = time.monotonic() - started
        client.close(), server.close()
        return took, result, _open_fds() - before

    took, result, leaked = run(scenario())
    assert took < 4, f"the relay held a finished tunnel for {took:.1f}s"
    assert result.down == 48_000 and leaked == 0


def test_the_idle_timer_rearms_after_traffic_and_still_cuts_the_silence(run) -> None:
    """A byte every 0.4 s for 3 s keeps a 1.2 s idle limit from cutting; the silence after it is cut."""
    async def scenario():
        loop = asyncio.get_running_loop()
        relay_client, client = await loopback_pair()
        relay_server, server = await loopback_pair()
        task = loop.create_task(relay(relay_client, relay_server, 1.2, 1.2))
        started = time.monotonic()
        got = b""
        while time.monotonic() - started < 3:
            await loop.sock_sendall(client, b".")
            got += await asyncio.wait_for(loop.sock_recv(server, 10), 2)
            await asyncio.sleep(0.4)
        assert not task.done(), "cut while bytes were moving"
        quiet = time.monotonic()
        result = await asyncio.wait_for(task, 10)
        took = time.monotonic() - quiet
        client.close(), server.close()
        return got, took, result

    got, took, result = run(scenario())
    assert got and set(got) == {ord(".")} and result.up == len(got)
    assert 1.0 <= took < 4 and result.error == "nothing moved for limits.idle_timeout (1.2s)"


def test_a_client_that_half_closes_while_the_upstream_streams_still_gets_every_byte(run) -> None:
    """The short half-closed silence is for silence: a client that said it is done and reads a stream
    at full speed is not cut."""
    size = 6 * 2**20

    async def scenario():
        loop = asyncio.get_running_loop()
        relay_client, client = await loopback_pair()
        relay_server, server = await loopback_pair()
        task = loop.create_task(relay(relay_client, relay_server, 60, 1))
        client.shutdown(socket.SHUT_WR)
        sending = loop.create_task(loop.sock_sendall(server, b"z" * size))
        got = 0
        while got < size:
            chunk = await asyncio.wait_for(loop.sock_recv(client, 65536), 5)
            assert chunk, f"cut after {got} bytes"
            got += len(chunk)
            if got % (1 << 20) < 65536:
                await asyncio.sleep(0.3)  # pauses under the 1 s limit, with the kernel's queue full
        await sending
        server.shutdown(socket.SHUT_WR)
        result = await asyncio.wait_for(task, 5)
        client.close(), server.close()
        return got, result

    got, result = run(scenario())
    assert got == size and result.down == size and result.error is None


# ---- the dial path --------------------------------------------------------------------------------------


@pytest.mark.parametrize("address", ["::1%lo", "::1%evil.example.com", "fe80::1%1"])
def test_an_ipv6_zone_id_is_refused_before_a_socket_exists(run, address) -> None:
    """Hardening (proxy/dial.py): ipaddress takes any text after '%' as a zone id, and the socket module
    sends a zone-id address through getaddrinfo() — a resolution step in the path that must have none.
    (Checked addresses never carry one: policy/hosts.py refuses zone ids; this is the last line.)"""
    before = _open_fds()
    sock, error = run(connect_pinned(address, 9, 2))
    assert sock is None and "zone id" in error and _open_fds() == before


@pytest.mark.parametrize("name", LOOP_NAMES)
@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet=st.characters(codec="utf-8"), max_size=40)
       | st.from_regex(r"\A[0-9a-fA-F:.% x\[\]]{0,40}\Z"))
@example(text="::1%lo")  # a zone id: an IP address to ipaddress, a getaddrinfo() call to the socket module
@example(text="127.0.0.1%lo")
@example(text="[::1]")
@example(text="localhost")
def test_only_a_plain_ip_literal_is_ever_dialled(name, text) -> None:
    """Whatever text reaches the dial: anything but a plain IP literal is refused with a reason before a
    socket exists (no socket, so no connect and no resolution)."""
    import ipaddress

    try:
        ipaddress.ip_address(text)
        plain = "%" not in text
    except ValueError:
        plain = False
    if plain:
        return  # an IP literal: what test_dial.py connects to on loopback
    sockets: list[socket.socket] = []
    real_socket = socket.socket

    class _Counted(real_socket):  # counts sockets made; the real class does the work
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            sockets.append(self)

    async def attempt() -> tuple[socket.socket | None, str]:
        socket.socket = _Counted  # only around the dial: the loop makes sockets of its own
        try:
            return await connect_pinned(text, 443, 1)
        finally:
            socket.socket = real_socket

    sock, error = event_loop.run(attempt(), use_uvloop=name == "uvloop")
    assert sock is None and "refused" in error and sockets == []


def test_an_unanswered_connect_times_out_with_its_reason_and_leaves_no_socket(run) -> None:
    """A listener whose accept queue is full drops further SYNs: the connect hangs until
    limits.connect_timeout, and the socket it made is closed (the writer callback removed with it)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]

    async def scenario():
        before = _open_fds()
        held, errors = [], []
        for _ in range(8):
            sock, error = await connect_pinned("127.0.0.1", port, 0.4)
            if sock is None:
                errors.append(error)
                break
            held.append(sock)
        for sock in held:
            sock.close()
        await asyncio.sleep(0)
        return errors, _open_fds() - before

    errors, leaked = run(scenario())
    listener.close()
    assert errors == [f"connect to 127.0.0.1:{port} timed out after 0.4s (limits.connect_timeout)"]
    assert leaked == 0


# ---- the test guard ---------------------------------------------------------------------------------------

GUARD_UDP_TEST = """
import asyncio, socket, sys
from proxy import event_loop
receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
receiver.bind(("127.0.0.1", 0))
port = receiver.getsockname()[1]
async def main():
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(asyncio.DatagramProtocol, remote_addr=("127.0.0.1", port))
    transport.close()
    try:
        await loop.create_datagram_endpoint(asyncio.DatagramProtocol, remote_addr=("localhost", port))
    except OSError as err:
        print("refused:", err)
event_loop.run(main(), use_uvloop=sys.argv[1] == "uvloop")
"""


@pytest.mark.parametrize("name", LOOP_NAMES)
def test_the_guard_sees_and_refuses_udp_connects_on_either_loop(tmp_path, name):
    """Gap in the guard (fixed in tests/proxyproc.py): a UDP endpoint with remote_addr is connected in C
    on uvloop, where the guard saw and refused nothing (the standard loop's went through the patched
    sock_connect, after resolving the name with the system's resolver). Now both refuse a name unresolved
    and record a loopback connect. Only loopback and "localhost" are used: nothing can leave either way."""
    guard = tmp_path / "guard.jsonl"
    prelude = GUARD_PRELUDE.replace("GUARD_PATH", repr(str(guard)))
    done = subprocess.run([sys.executable, "-c", prelude + GUARD_UDP_TEST, name], cwd=ROOT, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "refused: test guard: refusing a connect to a non-loopback address localhost" in done.stdout, done.stdout
    events = [json.loads(line) for line in guard.read_text().splitlines()] if guard.exists() else []
    assert ("connect", "127.0.0.1") in [(e["kind"], e["host"]) for e in events]


# ---- through the real proxy -------------------------------------------------------------------------------


class SpeakFirstUpstream(ConnectionServer):
    """A loopback upstream on the lab's public address that sends a banner the moment it accepts, then
    echoes and records everything it receives, per connection."""

    # A TLS alert record (level warning, close_notify), then text: a server's first answer must be TLS, a handshake
    # or an alert record, for a tunnel egresswall passes as TLS (a service that answers otherwise is refused).
    BANNER = b"\x15\x03\x03\x00\x02\x01\x00UPSTREAM-SPOKE-FIRST"

    def __init__(self) -> None:
        self.received: list[bytearray] = []
        self.ended: list[threading.Event] = []
        super().__init__(PUBLIC_IP)

    def accepted_one(self, conn: socket.socket) -> tuple[bytearray, threading.Event]:
        got, ended = bytearray(), threading.Event()
        self.received.append(got)
        self.ended.append(ended)
        return got, ended

    def serve(self, conn: socket.socket, got: bytearray, ended: threading.Event) -> None:
        with conn, contextlib.suppress(OSError):
            conn.sendall(self.BANNER)
            while chunk := conn.recv(65536):
                got += chunk
                conn.sendall(chunk)
        ended.set()

    def ended_all(self, count: int, timeout: float) -> bool:
        """Within ``timeout``: ``count`` connections came (the accepting thread may run well after the
        proxy's connect has completed) and every one has ended."""
        deadline = time.monotonic() + timeout
        while len(self.ended) < count or not all(ended.is_set() for ended in self.ended):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return len(self.ended) == count


@pytest.fixture
def upstream():
    server = SpeakFirstUpstream()
    yield server
    server.close()


def _policy(lab, limits: str = "") -> str:
    text = lab.policy_text(limits=limits)
    return text.replace(f"  connect: {sorted({443, lab.public_tls.port})}", "  connect: [443, '1024-65535']")


def _open_tunnel(proxy, port: int) -> socket.socket:
    sock, status, _ = proxy.connect(f"public.lab.example:{port}")
    assert status == 200
    return sock


def _nothing_arrives(sock: socket.socket, wait: float) -> bytes:
    sock.settimeout(wait)
    try:
        return sock.recv(65536)
    except TimeoutError:
        return b""
    finally:
        sock.settimeout(10)


def _recv_until(sock: socket.socket, want: bytes) -> bytes:
    data = b""
    while want not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


@pytest.mark.integration
@pytest.mark.parametrize("name", LOOP_NAMES)
def test_no_byte_crosses_a_tunnel_either_way_before_a_slow_hello_is_judged(lab, start_proxy, upstream, name):
    """The upstream speaks first; the client sends its ClientHello a byte at a time. Until the hello is
    whole and judged, the upstream gets nothing from the client and the client nothing from the
    upstream; then the hello arrives as sent and the banner follows. A silent tunnel is then cut."""
    proxy = start_proxy(_policy(lab, "limits:\n  idle_timeout: 1.5\n"), *LOOP_OPTIONS[name])
    hello = client_hello(b"public.lab.example")
    sock = _open_tunnel(proxy, upstream.port)
    for i in range(12):
        sock.sendall(hello[i:i + 1])
        time.sleep(0.03)
    assert _nothing_arrives(sock, 0.5) == b"", "the upstream's bytes reached the client before the hello was judged"
    assert len(upstream.received) == 1 and bytes(upstream.received[0]) == b""
    sock.sendall(hello[12:])
    got = _recv_until(sock, hello)
    assert got == SpeakFirstUpstream.BANNER + hello  # the banner, then the echo of the whole hello
    assert bytes(upstream.received[0]) == hello
    started = time.monotonic()
    assert _recv_until(sock, b"never") == b""  # nothing moves: the proxy ends the tunnel
    assert time.monotonic() - started < 8
    sock.close()
    assert upstream.ended_all(1, 5)


@pytest.mark.integration
@pytest.mark.parametrize("name", LOOP_NAMES)
def test_a_refused_hello_with_bytes_behind_it_sends_the_upstream_nothing(lab, start_proxy, upstream, name):
    """A hello naming another host (refused by SNI) with application bytes in the same write: the client
    gets the TLS alert and the end, never the upstream's banner; the upstream gets not one byte."""
    proxy = start_proxy(_policy(lab), *LOOP_OPTIONS[name])
    sock = _open_tunnel(proxy, upstream.port)
    sock.sendall(client_hello(b"other.lab.example") + b"SMUGGLED APPLICATION DATA" * 100)
    got = _recv_until(sock, b"never")
    sock.close()
    assert got[:1] == b"\x15" and SpeakFirstUpstream.BANNER not in got  # an alert record, nothing relayed
    assert upstream.ended_all(1, 5)
    assert bytes(upstream.received[0]) == b""


@pytest.mark.integration
@pytest.mark.parametrize("name", LOOP_NAMES)
def test_signals_reload_reopen_and_drain_the_same_on_either_loop(lab, start_proxy, upstream, tmp_path, name):
    """SIGHUP applies a new policy, SIGUSR1 reopens the audit log, SIGTERM drains: an open tunnel keeps
    relaying inside limits.tunnel_grace, no new connection is taken, and the proxy exits once it ends."""
    proxy = start_proxy(_policy(lab, "limits:\n  tunnel_grace: 20\n"), *LOOP_OPTIONS[name])
    hello = client_hello(b"public.lab.example")
    tunnel = _open_tunnel(proxy, upstream.port)
    tunnel.sendall(hello)
    assert _recv_until(tunnel, hello).endswith(hello)

    proxy.policy_path.write_text(_policy(lab, "hosts:\n  deny: [public.lab.example]\n"))
    proxy.signal(signal.SIGHUP)
    deadline, status = time.monotonic() + 10, 200
    while status == 200 and time.monotonic() < deadline:
        time.sleep(0.2)
        sock, status, _ = proxy.connect(f"public.lab.example:{upstream.port}")
        sock.close()
    assert status == 403, "SIGHUP did not apply the new policy"

    rotated = proxy.log_path.with_suffix(".old")
    proxy.log_path.rename(rotated)
    proxy.signal(signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while not proxy.log_path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
        sock, _, _ = proxy.connect(f"denied-after-reopen.lab.example:{upstream.port}")
        sock.close()
    assert proxy.log_path.exists(), "SIGUSR1 did not reopen the audit log"

    proxy.signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(OSError):  # draining: the listener is closed
        socket.create_connection((proxy.host, proxy.port), timeout=2).close()
    tunnel.sendall(b"still open while draining")  # the tunnel taken before the signal keeps relaying
    assert _recv_until(tunnel, b"draining").endswith(b"still open while draining")
    assert proxy.process.poll() is None
    tunnel.close()
    started = time.monotonic()
    assert proxy.process.wait(10) == 0
    assert time.monotonic() - started < 5, "the proxy waited out the grace after its last tunnel ended"
