"""WebSockets relayed through mitmproxy's layer (both transports: the fast front hands every upgrade to it).

Two faults of the relay itself, each with the patch that fixes it (proxy/mitm_patches.py):

* **Backpressure by direction.** After every read mitmproxy waited until all of a connection's writers had
  drained, the writer to the peer it had just read from too. An origin that answers as it reads (this lab's
  echo origin sends each piece back before reading the next, as a thread-per-connection server does) had its
  answer left unread while the proxy waited for it to read: both ways' buffers filled and the WebSocket hung
  until the idle timeout.
* **A frame trickled in small reads.** mitmproxy's layer grew the frame it was receiving by
  ``frame_buf[-1] += data`` on bytes, which copies the whole frame so far on every read: one client trickling
  an 8 MiB frame in 1 KiB pieces kept a worker's CPU busy (4.4 s of CPU for 5 s of sending here, everyone
  else on that worker waiting). The pieces are bytearrays now and grow in place.
"""

from __future__ import annotations

import socket
import struct
import time

import pytest
from audit_watch import tree_cpu_seconds, tree_kib
from labnet import PUBLIC_IP
from proxyproc import both_transports
from ws_echo import WsEcho
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Message, Request
from wsproto.extensions import PerMessageDeflate

from proxy.mitm_patches import _FrameBuffer

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("internal_saw_nothing")]


@pytest.fixture
def echo():
    server = WsEcho(PUBLIC_IP)
    yield server
    server.close()


class Client:
    """A WebSocket client through the proxy: an absolute-form handshake, or (as Chromium sends ws://) a
    CONNECT and the handshake inside it."""

    def __init__(self, proxy, echo: WsEcho, tunnel: bool, deflate: bool = False) -> None:
        self.ws = WSConnection(ConnectionType.CLIENT)
        extensions = [PerMessageDeflate()] if deflate else []
        authority = f"public.lab.example:{echo.port}"
        self.sock = socket.create_connection((proxy.host, proxy.port), timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tunnel:
            self.sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
            head = b""
            while b"\r\n\r\n" not in head:
                head += self.sock.recv(4096)
            assert head.startswith(b"HTTP/1.1 200"), head
            request = Request(host=authority, target="/chat", extensions=extensions)
        else:
            request = Request(host=authority, target=f"http://{authority}/chat", extensions=extensions)
        self.sock.sendall(self.ws.send(request))
        self.accepted = self._next()
        assert isinstance(self.accepted, AcceptConnection)

    def _next(self):
        while True:
            for event in self.ws.events():
                return event
            data = self.sock.recv(1 << 20)
            self.ws.receive_data(data or None)
            if not data:
                return None

    def read_message(self, size: int, seconds: float) -> int:
        """Read events until ``size`` message bytes have come (or the time is up); how many came."""
        got = 0
        deadline = time.monotonic() + seconds
        self.sock.settimeout(1)
        while got < size and time.monotonic() < deadline:
            try:
                event = self._next()
            except TimeoutError:
                continue
            assert isinstance(event, Message), event
            got += len(event.data)
        return got


def _start(lab, start_proxy, echo: WsEcho, limits: str = ""):
    text = lab.policy_text(limits=limits).replace("  http: [", f"  http: [{echo.port}, ")
    return start_proxy(text.replace("  connect: [", f"  connect: [{echo.port}, "))


@both_transports
@pytest.mark.parametrize("tunnel", [False, True], ids=["absolute-form", "in-a-connect"])
def test_a_large_message_to_an_origin_that_echoes_as_it_reads(lab, start_proxy, echo, tunnel):
    """32 MiB to an origin that sends each piece back before it reads on: without backpressure by direction
    the proxy stopped reading the origin's answer while it waited for the origin to read, and the WebSocket
    hung (both sockets' buffers full, ss shows it)."""
    proxy = _start(lab, start_proxy, echo, limits="limits:\n  max_websocket_message: 40000000\n")
    client = Client(proxy, echo, tunnel)
    size = 32 << 20
    client.sock.sendall(client.ws.send(Message(data=b"e" * size)))
    got = client.read_message(size, 30)
    assert got == size, f"{got} of {size} bytes came back in 30 s: the relay is stuck"



@both_transports
def test_a_trickled_frame_costs_cpu_in_proportion(lab, start_proxy, echo):
    """One binary frame of 8 MiB, its payload sent 1 KiB at a time with a pause every 2 KiB (about 5 s), and
    its echo read back. On bytes each read recopied the frame so far: 4.4 s of the proxy's CPU here, a worker
    busy for as long as the client trickles; grown in place it is under 1 s. This is the work done, not a
    time: the bound is the CPU a slow client can make one worker spend."""
    proxy = _start(lab, start_proxy, echo)
    client = Client(proxy, echo, tunnel=False)
    size = 8 << 20
    mask = b"\x00\x00\x00\x00"  # a zero mask leaves the payload as sent
    client.sock.sendall(b"\x82\xff" + struct.pack("!Q", size) + mask)
    before = tree_cpu_seconds(proxy.process.pid)
    piece = b"t" * 1024
    for index in range(size // len(piece)):
        client.sock.sendall(piece)
        if index % 2 == 0:
            time.sleep(0.001)
    assert client.read_message(size, 30) == size
    spent = tree_cpu_seconds(proxy.process.pid) - before
    assert spent < 2.0, f"the proxy spent {spent:.2f} s of CPU on one trickled 8 MiB frame"


def test_a_frame_buffer_grows_its_pieces_in_place():
    """The mechanism, in process: what mitmproxy's layer does to frame_buf keeps one bytearray a frame."""
    frame_buf = _FrameBuffer([b""])
    first = frame_buf[-1]
    for _ in range(3):
        frame_buf[-1] += b"abc"
    frame_buf.append(b"")
    frame_buf[-1] += b"de"
    assert frame_buf[0] is first and isinstance(frame_buf[1], bytearray)
    assert b"".join(frame_buf) == b"abcabcabcde" and [len(piece) for piece in frame_buf] == [9, 2]



@both_transports
def test_an_origin_s_compressed_frame_is_bounded_as_it_inflates(lab, start_proxy):
    """The bomb from the origin's side: one permessage-deflate frame of 256 MiB of zeros (about 256 KiB on the
    wire). It is inflated no further than limits.max_websocket_message + 1 bytes a piece, the client gets close
    1009 and never a byte of it, and the worker's peak memory hardly moves."""
    origin = WsEcho(PUBLIC_IP, deflate=True)
    try:
        proxy = _start(lab, start_proxy, origin, limits="limits:\n  max_websocket_message: 1000000\n")
        client = Client(proxy, origin, tunnel=False, deflate=True)
        assert client.accepted.extensions, "permessage-deflate was not negotiated"
        before = tree_kib(proxy.process.pid, "VmHWM")
        client.sock.sendall(client.ws.send(Message(data=f"zeros:{256 << 20}".encode())))
        client.sock.settimeout(10)
        event = client._next()
        assert event is None or (isinstance(event, CloseConnection) and event.code == 1009), event
        grown = (tree_kib(proxy.process.pid, "VmHWM") - before) // 1024
        assert grown < 30, f"the proxy's peak memory grew by {grown} MiB inflating the origin's frame"
        deadline = time.monotonic() + 5  # the refusal line is written as the WebSocket ends
        while not (lines := [r for r in proxy.audit() if r.get("rule") == "limits.max_websocket_message"]):
            assert time.monotonic() < deadline, proxy.audit()
            time.sleep(0.1)
        assert "1000000 bytes" in lines[0]["reason"] and lines[0]["host"] == "public.lab.example", lines
    finally:
        origin.close()
