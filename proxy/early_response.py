"""An origin's answer that begins while the request body is still going up (the fast path, proxy/fast_http.py).

RFC 9110 15 lets a server answer before it has read a request's content (a 413, a 401, a redirect) and stop
reading. The fast path sends the whole body before it reads the response, so such an answer waited behind a
body the origin no longer took until limits.idle_timeout, and the client got a reset instead of the answer
(mitmproxy's path relayed it at once). While a body goes up, the upstream socket is listened to: what it
sends is given to its h11 parser (the relay reads it from there), and once that is the start of a final
response the relay starts beside the body, which goes on while the origin takes it (a full-duplex origin gets
all of it) and is dropped once the response is over. An interim response (``100 Continue`` sent unasked, a
``103``) starts nothing: its bytes wait in the parser for the relay, which drops them as it drops every interim
one, and listening goes on past its head, for a final response after it (an origin that sends ``100`` and
then its ``413`` and reads no more). A ``101`` is not an interim response here: the relay refuses it at once.
"""

from __future__ import annotations

import asyncio
import re
import socket

import h11

# What tells the status apart: "HTTP/1.1 100" is 12 bytes.
_STATUS_PREFIX = 12
_INTERIM = re.compile(rb"HTTP/1\.[01] 1(?!01)[0-9]{2}")
_HEAD_END = re.compile(rb"\n\r?\n")  # where h11 ends a head (a bare LF ends lines too)


class UpstreamListener:
    """Reads what the upstream sends while the request body goes up, into its parser; ``answered`` is done
    once that is the start of a final response, or the upstream's close (the relay then says what it was)."""

    def __init__(self, sock: socket.socket, parser: h11.Connection, read: int, limit: int) -> None:
        """``limit``: the bytes listened to before the relay takes over whatever they are (it bounds each
        head; the parser is not read while listening, so it would hold endless interim responses)."""
        self.sock, self.parser, self.read, self.limit = sock, parser, read, limit
        self.start = b""  # the current response's first bytes
        self._interim = False  # inside an interim response's head, whose end is looked for
        self._tail = b""  # its last bytes read, for an end split between reads
        self._fed = 0
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
        if chunk:  # the upstream's close is left for the relay to read itself (and name: "closed without a response")
            self.parser.receive_data(chunk)
        self._fed += len(chunk)
        if not chunk or self._fed > self.limit or self._final_begins(chunk):
            self.stop()
            self.answered.set_result(None)
        # Else the start of a response, or interim ones only (their bytes wait in the parser): the body goes on.

    def _final_begins(self, data: bytes) -> bool:
        """Whether ``data``, the next bytes read, begins a final response, told from interim ones by status."""
        while data:
            if self._interim:  # what follows its head is the next response
                seen = self._tail + data
                end = _HEAD_END.search(seen)
                if end is None:
                    self._tail = seen[-2:]
                    return False
                self._interim, self._tail, self.start, data = False, b"", b"", seen[end.end():]
                continue
            taken = _STATUS_PREFIX - len(self.start)
            self.start, data = self.start + data[:taken], data[taken:]
            if len(self.start) < _STATUS_PREFIX:
                return False  # not yet enough to tell an interim response from a final one
            if not _INTERIM.match(self.start):
                return True
            self._interim = True  # its head's end is after these 12 bytes, which hold no line end
        return False

    def stop(self) -> None:
        if self._listening:
            self._listening = False
            self._loop.remove_reader(self.sock.fileno())
