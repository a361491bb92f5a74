"""What the first bytes of an allowed tunnel may be, judged on whole messages only.

A CONNECT must carry a TLS ClientHello whose SNI (when present) names the CONNECT host; a CONNECT
to a port that is also a plain-HTTP port (Chromium sends ``ws://host/`` as ``CONNECT host:80``) may
carry an HTTP/1.1 request head instead, which is then parsed and decided request by request. Anything
else is refused. Nothing is judged on a fragment: a first byte that arrives alone is only the start of a
message, so the answer is "need more" until the whole ClientHello or head is in (the transports
bound that in bytes and in time).
"""

from __future__ import annotations

from dataclasses import dataclass

import h11

from .head_end import HeadEnd
from .records import parser_words
from .tls_hello import MAX_HELLO_BYTES, HelloError, HelloScan, read_client_hello

MAX_HTTP_HEAD = 64 * 1024


@dataclass(frozen=True)
class FirstBytes:
    need_more: bool = False
    refused: bool = False
    rule: str = ""
    reason: str = ""
    kind: str = ""  # "tls" or "http" once judged
    sni: str | None = None
    hello_size: int = 0  # bytes of records the ClientHello took; what follows is the client's next (held back)
    # A refused head that began an HTTP request (inside a tunnel to a plain-HTTP port): the HTTP status its client
    # is answered with before the tunnel closes, as a request outside a tunnel would be; 0 for bytes that are not
    # HTTP (closed unanswered) and for TLS (a fatal alert).
    status: int = 0
    answer: bytes = b""  # what the transport writes to the client before it closes a refused tunnel (the gate's)

    @classmethod
    def more(cls) -> FirstBytes:
        return cls(need_more=True)

    @classmethod
    def refuse(cls, rule: str, reason: str, status: int = 0) -> FirstBytes:
        return cls(refused=True, rule=rule, reason=reason, status=status)


class FirstMessage:
    """One tunnel's first bytes, gathered read by read until they can be judged. One per tunnel, held by its
    transport (``TunnelStart`` on mitmproxy's path, the front's tunnel on the fast one) and fed each read.

    A head may be dripped a byte at a time: its end is searched for in each read's new bytes only
    (proxy/head_end.py) and h11 parses it once, when it is whole — never the whole buffer again per read,
    which cost the square of the head's size on the event loop. A ClientHello likewise: its records are
    read on from where the last read stopped (``HelloScan``, proxy/tls_hello.py) and it is parsed once."""

    def __init__(self, connect_host: str, http_inside: bool, max_head: int = MAX_HTTP_HEAD) -> None:
        self.connect_host, self.http_inside, self.max_head = connect_host, http_inside, max_head
        self.data = bytearray()  # every byte so far, grown in place (the transport hands it on once judged)
        self._head_end = HeadEnd()
        self._start_asked = False  # h11 has judged the head's first byte
        self._hello_scan = HelloScan()  # how far the ClientHello's records have been read

    def feed(self, chunk: bytes, ech_allowed: bool) -> FirstBytes:
        """The judgement of everything fed so far, ``chunk`` the newest read."""
        self.data += chunk
        if not self.data:
            return FirstBytes.more()
        if self.http_inside and self.data[0] != 0x16:
            return self._http_head()  # a TLS record starts 0x16; no HTTP method does
        return _tls_hello(self.data, self._hello_scan, self.connect_host, ech_allowed)

    def _http_head(self) -> FirstBytes:
        if not self._start_asked:
            # h11 refuses a head by its first byte already (one below 0x21 begins no request line), so a client
            # that sends no HTTP is told at once rather than at a bound. Asked of that byte alone, once: the answer
            # is then the same however the bytes are split into reads.
            self._start_asked = True
            start = _parse_http_head(bytes(self.data[:1]), self.max_head)
            if start.refused:
                return start
        end = self._head_end.find(self.data)
        if end > self.max_head or (end < 0 and len(self.data) > self.max_head):
            return FirstBytes.refuse("limits.max_header_bytes",
                                     f"the first request head in the tunnel is over {self.max_head} bytes", 431)
        if end < 0:
            return FirstBytes.more()
        return _parse_http_head(bytes(self.data[:end]), self.max_head, whole=True)  # parsed once


def classify_tunnel_start(data: bytes, connect_host: str, http_inside: bool, ech_allowed: bool,
                          max_head: int = MAX_HTTP_HEAD) -> FirstBytes:
    """The judgement of first bytes that are all in hand (a transport feeds a ``FirstMessage`` instead)."""
    return FirstMessage(connect_host, http_inside, max_head).feed(data, ech_allowed)


def _tls_hello(data: bytes | bytearray, scan: HelloScan, connect_host: str, ech_allowed: bool) -> FirstBytes:
    try:
        hello = read_client_hello(data, scan)
    except HelloError as err:
        if err.rule == "tls:not-tls":
            return FirstBytes.refuse(err.rule, "the tunnel does not start with a TLS ClientHello; egresswall passes "
                                               "only TLS through CONNECT to this port")
        return FirstBytes.refuse(err.rule, err.reason)
    if hello is None:
        return FirstBytes.more()
    if hello.sni is not None and hello.sni != connect_host:
        return FirstBytes.refuse("tls:sni", f"TLS SNI {hello.sni} does not match the CONNECT host {connect_host}")
    if hello.ech and not ech_allowed:
        return FirstBytes.refuse("tls:ech", "the ClientHello carries Encrypted Client Hello (extension 0xfe0d, a "
                                            "draft's code point or ESNI's), which hides the real destination behind "
                                            "the outer name; set tls.ech: allow to let it through")
    return FirstBytes(kind="tls", sni=hello.sni, hello_size=hello.size)


def _parse_http_head(data: bytes, max_head: int, whole: bool = False) -> FirstBytes:
    """An HTTP/1.x request head as h11 reads it (``whole``, or its first byte, which h11 may refuse already); the
    request itself is decided by the transport. A whole head that h11 refuses began a request (h11 took its first
    byte) and ended within the bound: it goes to mitmproxy's HTTP layer like the tunnel's later heads and like
    such a head outside a tunnel, which refuses it with the same answer and rule (a framing h11 refuses is not
    always one mitmproxy does: VT in a value is refused by the decision, a double Content-Length by the parser)."""
    parser = h11.Connection(h11.SERVER, max_incomplete_event_size=max_head)
    try:
        parser.receive_data(data)
        event = parser.next_event()
    except h11.RemoteProtocolError as err:
        if whole:
            return FirstBytes(kind="http")
        return FirstBytes.refuse("http:not-http", f"the tunnel goes to a plain-HTTP port but does not carry an "
                                                  f"HTTP/1 request: {parser_words(err)}")
    if event is h11.NEED_DATA:
        return FirstBytes.more()
    if not isinstance(event, h11.Request):
        return FirstBytes.refuse("http:not-http", "the tunnel does not start with an HTTP request")
    if event.http_version not in (b"1.0", b"1.1") or event.method == b"PRI":
        # h11 reads the HTTP/2 connection preface ("PRI * HTTP/2.0") as a request head; what follows it is
        # HTTP/2 frames, which nothing here reads request by request.
        return FirstBytes.refuse("http:not-http", f"the tunnel goes to a plain-HTTP port but starts with an HTTP/"
                                                  f"{event.http_version.decode('ascii', 'replace')} "
                                                  f"{'connection preface' if event.method == b'PRI' else 'request'}; "
                                                  "egresswall reads only HTTP/1.0 and HTTP/1.1 inside a tunnel")
    return FirstBytes(kind="http")


__all__ = ["FirstBytes", "FirstMessage", "MAX_HELLO_BYTES", "classify_tunnel_start"]
