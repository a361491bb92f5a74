"""Where an HTTP/1 request head ends, in bytes that arrive read by read.

A head may come a byte at a time. Searching the whole buffer for its end after every read costs the
square of its size (a 64 KiB head written a byte at a time: seconds of the event loop per connection,
every other client waiting), so each byte is searched once: the next search starts where the last one
stopped, bar the two bytes before it, where an end split across reads (``\\r\\n`` | ``\\r\\n``) may begin.
Used by the front's head reader (proxy/head_reader.py) and by a tunnel's first head (proxy/first_bytes.py).
"""

from __future__ import annotations

import re

HEAD_END = re.compile(rb"\n\r?\n")  # what h11 and mitmproxy accept as the end of a head (bare LF too)


class HeadEnd:
    """The end of the head at the start of one growing buffer (one per head: it remembers where it stopped)."""

    def __init__(self) -> None:
        self._searched = 0  # bytes before this offset hold no end

    def find(self, data: bytes | bytearray) -> int:
        """The offset just past the head's blank line, or -1 while it has not come. ``data`` only ever grows
        (the bytes already passed to ``find`` and then more); asked again once found, the same answer."""
        found = HEAD_END.search(data, self._searched)
        if found is not None:
            return found.end()
        self._searched = max(0, len(data) - 2)  # the end ("\n\r\n" at most) may begin in the last two bytes
        return -1
