"""Review round 20 (a helper's: WebSockets and what origins answer). Each test here failed before its fix.

A hostile origin on the lab's public address (a raw socket server, 127.0.0.2) and a hostile client, on both
transports (upgrades are mitmproxy's on both: the fast front hands every upgrade to it).

* An origin's 101 whose ``Sec-WebSocket-Extensions: permessage-deflate`` carries a window-bits parameter
  wsproto cannot take (``server_max_window_bits=abc``, ``=7``, ``=99``, or none) crashed mitmproxy's WebSocket
  layer at its start ("mitmproxy has crashed!" and a traceback, twice a connection): the client had the 101, then
  a dead connection until limits.idle_timeout, and the record said 101 with no error. Now 502
  ``http:websocket-extension`` (proxy/addons/audit_trail.py).
* A POST upgrade with ``Transfer-Encoding: chunked`` that the origin answered 101 before the body: after it, the
  WebSocket frames egresswall wrote to the origin were wrapped as chunks of the request body
  (``b\\r\\n<frame>\\r\\n``), one byte stream read two ways. A handshake is a GET without a body with
  Sec-WebSocket-Version 13, else 400 ``http:websocket-handshake`` (proxy/addons/decision.py).
* A permessage-deflate message whose whole frame arrived in one read and inflated past
  limits.max_websocket_message: the bounded inflate left zlib's input tail unread, the frame's end then failed to
  inflate, and the WebSocket was closed 1007 "error in extension", with no refusal record (proxy/mitm_patches.py
  ``_inflate_complete``).
* A WebSocket's traffic was in no record: the response record was written at the 101 with bytes_up 0 and
  bytes_down 0, whatever the WebSocket then carried. It is written when the WebSocket ends, with what it carried.
"""

from __future__ import annotations

import base64
import hashlib
import os
import socket
import time

import pytest
from labnet import PUBLIC_IP
from listening import ConnectionServer
from proxyproc import both_transports
from rawclient import read_head
from ws_client import await_accept, proxy_for_port, read_until_close, records_of_rule, send_deflate_handshake
from ws_echo import WsEcho
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Message, Request

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("internal_saw_nothing")]


class RawOrigin(ConnectionServer):
    """Runs ``script(conn, recv)`` on each connection; ``got``: every byte each connection received."""

    def __init__(self, script) -> None:
        self.script = script
        self.got: list[bytes] = []
        super().__init__(PUBLIC_IP)

    def serve(self, conn: socket.socket) -> None:
        index = len(self.got)
        self.got.append(b"")
        conn.settimeout(10)

        def recv(size: int = 65536) -> bytes:
            data = conn.recv(size)
            self.got[index] += data
            return data

        try:
            with conn:
                self.script(conn, recv)
        except OSError:
            pass


def _accept(key: str) -> str:
    return base64.b64encode(hashlib.sha1(key.encode() + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest()).decode()


def _read_until(recv, marker: bytes, data: bytes = b"") -> bytes:
    while marker not in data:
        chunk = recv()
        if not chunk:
            break
        data += chunk
    return data


def _ws_origin(extension: bytes = b"", chunked_body: bool = False, hold: float = 10.0, early: bool = False):
    """Answers a WebSocket handshake 101 with a valid Sec-WebSocket-Accept (and ``extension``) once the head
    (and, with ``chunked_body``, the request's chunked body) is in, then reads for ``hold`` seconds."""
    def script(conn, recv):
        data = _read_until(recv, b"\r\n\r\n")
        if chunked_body and not early:
            _read_until(recv, b"0\r\n\r\n", data.partition(b"\r\n\r\n")[2])
        key = next((line.split(b":", 1)[1].strip().decode() for line in data.split(b"\r\n")
                    if line.lower().startswith(b"sec-websocket-key:")), None)
        if key is None:
            return  # no handshake came (egresswall refused it, or the connection closed first)
        conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                     b"Sec-WebSocket-Accept: " + _accept(key).encode() + b"\r\n" + extension + b"\r\n")
        deadline = time.monotonic() + hold
        while time.monotonic() < deadline:
            try:
                if not recv():
                    return
            except TimeoutError:
                return
    return script


def _handshake(proxy, port: int, carrier: str, method: str = "GET", extra: str = "", body: bytes = b""):
    authority = f"public.lab.example:{port}"
    sock = socket.create_connection((proxy.host, proxy.port), timeout=10)
    if carrier == "in-a-connect":
        sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        assert read_head(sock).startswith(b"HTTP/1.1 200")
        target = "/chat"
    else:
        target = f"http://{authority}/chat"
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(f"{method} {target} HTTP/1.1\r\nHost: {authority}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n{extra}\r\n".encode() + body)
    return sock


def _frame(opcode: int, payload: bytes) -> bytes:
    """One final, masked client frame (payload under 126 bytes)."""
    mask = os.urandom(4)
    return bytes([0x80 | opcode, 0x80 | len(payload)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


@both_transports
@pytest.mark.parametrize("carrier", ["absolute-form", "in-a-connect"])
@pytest.mark.parametrize("parameter", ["server_max_window_bits=abc", "server_max_window_bits=7",
                                       "server_max_window_bits=99", "client_max_window_bits"])
def test_an_origins_bad_deflate_parameter_does_not_crash_the_websocket_layer(lab, start_proxy, carrier, parameter):
    """The origin's 101 names permessage-deflate with a window size wsproto refuses. mitmproxy's WebsocketLayer.start
    calls PerMessageDeflate.finalize on it unguarded: ValueError, "mitmproxy has crashed!" (and again when a side
    closes: the layer is left at its start), the client holds a 101 and a connection that carries nothing until
    limits.idle_timeout (30 s here), and the response record says 101, no error."""
    extension = f"Sec-WebSocket-Extensions: permessage-deflate; {parameter}\r\n".encode()
    origin = RawOrigin(_ws_origin(extension, hold=15))
    proxy = proxy_for_port(lab, start_proxy, origin.port, limits="limits:\n  idle_timeout: 30\n")
    sock = _handshake(proxy, origin.port, carrier)
    head = read_head(sock)
    assert head.startswith(b"HTTP/1.1 502") and b"X-Egresswall-Rule: http:websocket-extension" in head, head
    assert parameter.encode() not in head  # the upstream's words are not quoted back
    sock.sendall(_frame(2, b"hello"))
    sock.settimeout(5)
    try:
        while sock.recv(65536):
            pass
        ended = True
    except TimeoutError:
        ended = False
    except ConnectionResetError:
        ended = True
    sock.close()
    time.sleep(0.5)
    assert "mitmproxy has crashed" not in proxy.stderr, proxy.stderr[-1500:]
    assert ended, "the client connection still open 5 s after a WebSocket egresswall could not start"


@both_transports
@pytest.mark.parametrize("carrier", ["absolute-form", "in-a-connect"])
def test_websocket_frames_after_a_chunked_upgrade_request_are_not_chunk_wrapped(lab, start_proxy, carrier):
    """POST with Upgrade: websocket and Transfer-Encoding: chunked; the origin answers 101 as soon as it has the
    head (a WebSocket server does not wait for a body); the client then sends its chunked body (one 10-byte
    chunk and the last chunk), gets the 101 (egresswall holds it until the body is done) and sends one
    WebSocket frame. The origin must get the frame as a WebSocket frame (or
    never get such a request): today it gets ``<hex size>\r\n<frame>\r\n`` after the body's last chunk, a
    chunk of a request body that had ended: egresswall wrote a frame, the origin reads a frame header of
    ``b\\r`` (0x62 0x0d: RSV bits set, unmasked, 13 bytes of payload). mitmproxy's Http1Client.send chunk-frames
    every RequestData of a request whose Transfer-Encoding is chunked, and after a 101 the WebSocket layer's
    bytes to the origin go out as RequestData."""
    origin = RawOrigin(_ws_origin(chunked_body=True, early=True))
    proxy = proxy_for_port(lab, start_proxy, origin.port)
    sock = _handshake(proxy, origin.port, carrier, method="POST", extra="Transfer-Encoding: chunked\r\n")
    time.sleep(1)  # the origin has answered 101 meanwhile (egresswall holds it until the body is done)
    sock.sendall(b"a\r\nAAAAAAAAAA\r\n0\r\n\r\n")
    head = read_head(sock)
    assert head.startswith(b"HTTP/1.1 400") and b"X-Egresswall-Rule: http:websocket-handshake" in head, head
    sock.close()
    time.sleep(0.3)
    got = b"".join(origin.got)
    after_body = got.partition(b"0\r\n\r\n")[2] if b"0\r\n\r\n" in got else b""
    assert not after_body or after_body[0] == 0x82, (
        f"the origin read {after_body[:24]!r} after the body: the frame went up wrapped as a body chunk")


@both_transports
@pytest.mark.parametrize("size", [5_000_000, 20_000_000])
def test_a_compressed_message_in_one_read_over_the_limit_is_refused_as_too_big(lab, start_proxy, size):
    """permessage-deflate negotiated as usual (the client offers it, the echo origin accepts); one message of
    2 MB of zeros, about 2 KB on the wire, in one write, with limits.max_websocket_message 1000. The inflate is
    cut at 1001 bytes with zlib's input left in its unconsumed tail, which the frame's end never feeds back, so
    the end fails to inflate: the client gets close 1007 "error in extension" and no refusal line is written.
    The limit's own close (1009) and its refusal record are what the README promises. (2 MB of zeros happens to
    get 1009 and the record; the outcome depends on where zlib stops in the input.)"""
    echo = WsEcho(PUBLIC_IP, deflate=True)
    try:
        proxy = proxy_for_port(lab, start_proxy, echo.port, limits="limits:\n  max_websocket_message: 1000\n")
        ws, sock = send_deflate_handshake(proxy, f"public.lab.example:{echo.port}")
        assert await_accept(ws, sock).extensions, "permessage-deflate was not negotiated"
        sock.sendall(ws.send(Message(data=bytes(size))))
        closed, _ = read_until_close(ws, sock, timeout=5)
        lines = records_of_rule(proxy, "limits.max_websocket_message")
        assert closed is not None and closed.code == 1009, closed
        assert len(lines) == 1, proxy.audit()
    finally:
        echo.close()


@both_transports
@pytest.mark.parametrize("carrier", ["absolute-form", "in-a-connect"])
def test_a_websockets_bytes_are_recorded(lab, start_proxy, carrier):
    """1 MiB each way over an allowed WebSocket (no session). The only record of the exchange is the response
    record, written at the 101 with bytes_up 0 and bytes_down 0; nothing is written when the WebSocket ends (the
    CONNECT's tunnel record, for the second carrier, says 0 and 0 too). A passed-through tunnel's record counts
    what it carried; a WebSocket's bytes are in no record unless a session is charged them."""
    echo = WsEcho(PUBLIC_IP)
    try:
        proxy = proxy_for_port(lab, start_proxy, echo.port)
        authority = f"public.lab.example:{echo.port}"
        ws = WSConnection(ConnectionType.CLIENT)
        sock = socket.create_connection((proxy.host, proxy.port), timeout=10)
        if carrier == "in-a-connect":
            sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
            assert read_head(sock).startswith(b"HTTP/1.1 200")
            sock.sendall(ws.send(Request(host=authority, target="/chat")))
        else:
            sock.sendall(ws.send(Request(host=authority, target=f"http://{authority}/chat")))
        size, got, sent = 1 << 20, 0, False
        while got < size:
            ws.receive_data(sock.recv(1 << 20))
            for event in ws.events():
                if isinstance(event, AcceptConnection) and not sent:
                    sock.sendall(ws.send(Message(data=b"x" * size)))
                    sent = True
                elif isinstance(event, Message):
                    got += len(event.data)
        sock.sendall(ws.send(CloseConnection(code=1000)))
        time.sleep(0.5)
        sock.close()
        time.sleep(1)
        records = [r for r in proxy.audit() if r["event"] != "decision"]
        assert any((r["bytes_up"] or 0) >= size and (r["bytes_down"] or 0) >= size for r in records), [
            (r["event"], r["status"], r["bytes_up"], r["bytes_down"]) for r in records]
    finally:
        echo.close()


@both_transports
@pytest.mark.parametrize(("method", "extra", "why"), [
    ("GET", "Content-Length: 5\r\n", b"carries no body"),
    ("PUT", "", b"is a GET"),
    ("GET", "Sec-WebSocket-Version: 8\r\n", b"Sec-WebSocket-Version: 13"),
])
def test_a_handshake_that_is_not_a_bodyless_get_of_version_13_is_refused_before_the_origin(lab, start_proxy, method,
                                                                                            extra, why):
    """A second Sec-WebSocket-Version (8 beside 13) is one mitmproxy cannot relay either: it sent the 101 on and
    then cut the connection ("no protocol is enabled to upgrade to"), recorded as a WebSocket answered."""
    origin = RawOrigin(_ws_origin())
    proxy = proxy_for_port(lab, start_proxy, origin.port)
    sock = _handshake(proxy, origin.port, "absolute-form", method=method, extra=extra,
                      body=b"hello" if "Content-Length" in extra else b"")
    head = read_head(sock)
    sock.close()
    assert head.startswith(b"HTTP/1.1 400") and why in head, head
    assert not b"".join(origin.got), origin.got
