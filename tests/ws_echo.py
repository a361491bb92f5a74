"""A WebSocket echo origin for the lab: wsproto's server side over a loopback socket, a thread a connection."""

from __future__ import annotations

import contextlib
import socket

from listening import ConnectionServer
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Message, Ping, Request
from wsproto.extensions import PerMessageDeflate
from wsproto.utilities import LocalProtocolError, RemoteProtocolError


def _head(data: bytes | str, size: int) -> bytes:
    """A message's first bytes, for its commands (a text message's too: it is echoed like any other)."""
    head = data[:size]
    return head.encode() if isinstance(head, str) else bytes(head)


class WsEcho(ConnectionServer):
    def __init__(self, host: str, deflate: bool = False) -> None:
        self.deflate = deflate  # accept permessage-deflate when the client offers it
        super().__init__(host)

    def serve(self, conn: socket.socket) -> None:
        ws = WSConnection(ConnectionType.SERVER)
        # A client the proxy cut off mid-handshake or mid-frame ends its connection, not the thread with a trace; so
        # does a connection the lab shut down (wsproto then asks to answer a close it can no longer send).
        with contextlib.suppress(OSError, RemoteProtocolError, LocalProtocolError), conn:
            while True:
                data = conn.recv(65536)
                ws.receive_data(data or None)
                for event in ws.events():
                    if isinstance(event, Request):
                        extensions = [PerMessageDeflate()] if self.deflate else []
                        conn.sendall(ws.send(AcceptConnection(extensions=extensions)))
                    elif isinstance(event, Message) and _head(event.data, 4) == b"big:":
                        # "big:N": N bytes back in one message, in 64 KiB fragments
                        size = int(event.data[4:])
                        for start in range(0, size, 65536):
                            piece = b"b" * min(65536, size - start)
                            conn.sendall(ws.send(Message(data=piece, message_finished=start + 65536 >= size)))
                    elif isinstance(event, Message) and _head(event.data, 6) == b"zeros:":
                        # "zeros:N": N zero bytes back in one frame (compressed, if permessage-deflate is on)
                        conn.sendall(ws.send(Message(data=bytes(int(event.data[6:])))))
                    elif isinstance(event, Message):
                        conn.sendall(ws.send(Message(data=event.data, message_finished=event.message_finished)))
                    elif isinstance(event, Ping):
                        conn.sendall(ws.send(event.response()))
                    elif isinstance(event, CloseConnection):
                        conn.sendall(ws.send(event.response()))
                        return
                if not data:
                    return
