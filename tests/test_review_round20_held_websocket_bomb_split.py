"""Review round 20 (a helper's review of the round's diff, what held): a permessage-deflate message over
limits.max_websocket_message whose frame arrives in
several reads, or as several fragments: it ends 1009 with one refusal record (as test_review_round20_websockets.py
holds for one read)."""

from __future__ import annotations

import socket
import time

import pytest
from labnet import PUBLIC_IP
from proxyproc import both_transports
from ws_client import await_accept, proxy_for_port, read_until_close, records_of_rule, send_deflate_handshake
from ws_echo import WsEcho
from wsproto.events import Message

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("internal_saw_nothing")]


@both_transports
@pytest.mark.parametrize("shape", ["two-reads", "many-reads", "fragments"])
def test_a_compressed_bomb_split_is_refused_as_too_big_with_its_record(lab, start_proxy, shape):
    echo = WsEcho(PUBLIC_IP, deflate=True)
    try:
        proxy = proxy_for_port(lab, start_proxy, echo.port, limits="limits:\n  max_websocket_message: 1000\n")
        ws, sock = send_deflate_handshake(proxy, f"public.lab.example:{echo.port}")
        assert await_accept(ws, sock).extensions, "permessage-deflate was not negotiated"
        data = bytes(range(256)) * 4 + bytes(5_000_000)  # a little that does not compress, then zeros
        if shape == "fragments":
            wire = b"".join(ws.send(Message(data=data[i:i + 500_000], message_finished=i + 500_000 >= len(data)))
                            for i in range(0, len(data), 500_000))
            pieces = [wire]
        else:
            wire = ws.send(Message(data=data))
            n = 2 if shape == "two-reads" else 12
            step = max(1, len(wire) // n)
            pieces = [wire[i:i + step] for i in range(0, len(wire), step)]
        for piece in pieces:
            try:
                sock.sendall(piece)
            except OSError:
                break
            time.sleep(0.15)
        closed, _ = read_until_close(ws, sock, timeout=5)
        lines = records_of_rule(proxy, "limits.max_websocket_message")
        assert closed is not None and closed.code == 1009, (closed, proxy.audit()[-3:])
        assert len(lines) == 1, proxy.audit()
    finally:
        echo.close()


import base64  # noqa: E402
import hashlib  # noqa: E402
import struct  # noqa: E402
import zlib  # noqa: E402

from listening import ConnectionServer  # noqa: E402


class BombOrigin(ConnectionServer):
    """Answers a WebSocket handshake 101 with permessage-deflate, then sends one compressed message of 5 MB of zeros
    in ``pieces`` writes."""

    def __init__(self, pieces: int) -> None:
        self.pieces = pieces
        super().__init__(PUBLIC_IP)

    def serve(self, conn: socket.socket) -> None:
        conn.settimeout(10)
        try:
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                key = next(line.split(b":", 1)[1].strip() for line in data.split(b"\r\n")
                           if line.lower().startswith(b"sec-websocket-key:"))
                accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
                conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                             b"Sec-WebSocket-Accept: " + accept + b"\r\nSec-WebSocket-Extensions: permessage-deflate"
                             b"\r\n\r\n")
                c = zlib.compressobj(9, zlib.DEFLATED, -15)
                payload = c.compress(bytes(range(256)) * 4 + bytes(5_000_000)) + c.flush(zlib.Z_SYNC_FLUSH)
                payload = payload[:-4]
                head = bytes([0xC2]) + (bytes([126]) + struct.pack("!H", len(payload)) if len(payload) < 65536
                                        else bytes([127]) + struct.pack("!Q", len(payload)))
                wire = head + payload
                step = max(1, len(wire) // self.pieces)
                for i in range(0, len(wire), step):
                    conn.sendall(wire[i:i + step])
                    time.sleep(0.15)
                time.sleep(3)
        except OSError:
            pass


@both_transports
@pytest.mark.parametrize("pieces", [1, 2, 8])
def test_a_compressed_bomb_from_the_origin_is_refused_as_too_big_with_its_record(lab, start_proxy, pieces):
    origin = BombOrigin(pieces)
    try:
        proxy = proxy_for_port(lab, start_proxy, origin.port, limits="limits:\n  max_websocket_message: 1000\n")
        ws, sock = send_deflate_handshake(proxy, f"public.lab.example:{origin.port}")
        closed, events = read_until_close(ws, sock, timeout=6)
        lines = records_of_rule(proxy, "limits.max_websocket_message")
        assert closed is not None and closed.code == 1009, (closed, events[:3], proxy.audit()[-3:])
        assert len(lines) == 1, proxy.audit()
    finally:
        origin.close()
