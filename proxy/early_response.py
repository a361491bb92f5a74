"""An origin's answer that begins while the request body is still going up (the fast path, proxy/fast_http.py).

RFC 9110 15 lets a server answer before it has read a request's content (a 413, a 401, a redirect) and stop
reading. The fast path sends the whole body before it reads the response, so such an answer waited behind a
body the origin no longer took until limits.idle_timeout, and the client got a reset instead of the answer
(mitmproxy's path relayed it at once). While a body goes up, the upstream socket is listened to: what it
sends is given to its h11 parser (the relay reads it from there), and once that is the start of a final
response the relay starts beside the body, which goes on while the origin takes it (a full-duplex origin gets
all of it) and is dropped once the response is over. An interim response (``100 Continue`` sent unasked)
starts nothing: its bytes wait in the parser for the relay, which drops them as it drops every interim one.
"""

from __future__ import annotations

import asyncio
import re
import socket

import h11

# What tells the status apart: "HTTP/1.1 100" is 12 bytes.
_STATUS_PREFIX = 12
_INTERIM = re.compile(rb"HTTP/1\.[01] 1[0-9]{2}")


class UpstreamListener:
    """Reads what the upstream sends while the request body goes up, into its parser; ``answered`` is done
    once that is the start of a final response, or the upstream's close (the relay then says what it was)."""

    def __init__(self, sock: socket.socket, parser: h11.Connection, read: int) -> None:
        self.sock, self.parser, self.read = sock, parser, read
        self.start = b""
        self._loop = asyncio.get_running_loop()
        self.answered: asyncio.Future[None] = self._loop.create_future()
        self._listening = True
        self._loop.add_reader(sock.fileno(), self._readable)

    def _readable(self) -> None:
        try:
            chunk = self.sock.recv(self.read)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        self.parser.receive_data(chunk)  # h11 takes b"" as the upstream's close
        self.start += chunk[: _STATUS_PREFIX - len(self.start)]
        if chunk and len(self.start) < _STATUS_PREFIX:
            return  # not yet enough to tell an interim response from a final one
        self.stop()
        if not chunk or not _INTERIM.match(self.start):
            self.answered.set_result(None)
        # An interim response: listening ends (its bytes wait in the parser); the body goes on.

    def stop(self) -> None:
        if self._listening:
            self._listening = False
            self._loop.remove_reader(self.sock.fileno())
