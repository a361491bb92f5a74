"""Reading the ClientHello at the start of a passed-through tunnel, strictly.

The record layer and the ClientHello structure are parsed by mitmproxy's TLS parser (the same one
its own layers use). mitmproxy's ``ClientHello.sni`` answers ``None`` for every server_name it does
not like — a trailing space, a 64-octet label, two names in the list, a name type other than
host_name — and "no SNI" is something a tunnel may carry. So the server_name extension is read here
from its raw bytes, and anything present but unreadable is a refusal, never "no SNI".

``read_client_hello`` answers one of: ``NEED_MORE`` (wait for more bytes, within the caller's
bounds), a ``ClientHelloInfo``, or raises ``HelloError`` with the rule and a reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from mitmproxy.net.tls import starts_like_tls_record
from mitmproxy.proxy.layers.tls import get_client_hello
from mitmproxy.tls import ClientHello

from policy.hosts import HostFormError, normalise_host

MAX_HELLO_BYTES: Final = 32 * 1024  # Chromium's, with post-quantum key shares, is under 2 KiB
MAX_HELLO_RECORDS: Final = 256  # browsers and TLS libraries send one (two past 16 KiB); DPI evaders split more
SERVER_NAME, ENCRYPTED_CLIENT_HELLO = 0x0000, 0xFE0D
# Every extension that carries a name the proxy cannot read: ECH (RFC 9849's code point, and drafts 08 to 12's,
# which some servers still honour) and ESNI (draft-ietf-tls-esni-02 to -06, which Firefox sent without an SNI).
ENCRYPTED_NAME_EXTENSIONS: Final = frozenset({ENCRYPTED_CLIENT_HELLO, *range(0xFE08, 0xFE0D), 0xFFCE})
HANDSHAKE_CLIENT_HELLO = 0x01
NEED_MORE: Final = None
# The answer to a refused ClientHello, on every path: a TLS 1.2 record: alert (21), version 3.3, length 2,
# level fatal (2), unrecognized_name (112).
TLS_ALERT_UNRECOGNIZED_NAME: Final = bytes([21, 3, 3, 0, 2, 2, 112])


class HelloError(ValueError):
    def __init__(self, rule: str, reason: str) -> None:
        super().__init__(reason)
        self.rule, self.reason = rule, reason


@dataclass(frozen=True)
class ClientHelloInfo:
    sni: str | None  # normalised (A-label, lower case); None when the extension is absent
    ech: bool  # carries an encrypted name: ECH (real, or Chromium's GREASE), a draft of it, or ESNI
    size: int  # bytes of records it took


class HelloScan:
    """How far the records at the start of one growing buffer have been read, so that each read goes on
    from the last whole record. Read from the start on every read, a hello dripped a byte per write in
    MAX_HELLO_RECORDS small records cost seconds of the event loop per connection (every client waits);
    read on from where it stopped, it costs its size once. One per buffer, which may only grow at its end;
    the hello starts at ``start`` in it (after a change_cipher_spec record, for a second ClientHello)."""

    def __init__(self, start: int = 0) -> None:
        self.start = start
        self.offset = start  # where the first record not yet whole starts
        self.payload = 0  # handshake bytes in the whole records before it
        self.head = b""  # the handshake message's first 4 bytes (type and length), as far as they came
        self.records = 0
        self.done = False  # the hello is whole: asked again, the answer stays

    def at(self, start: int) -> HelloScan:
        """This scan, its hello starting at ``start`` in the buffer: set before anything was read, then fixed."""
        if start != self.start:
            if self.offset != self.start:
                raise ValueError("a HelloScan's start cannot move once records were read")
            self.start = self.offset = start
        return self

    def whole(self, data: bytes | bytearray) -> bool:
        """Whether the records at the start of ``data`` hold the whole first handshake message, read from
        the record headers alone; a hello in more than MAX_HELLO_RECORDS records is refused."""
        while not self.done and self.offset + 5 <= len(data):
            header = bytes(data[self.offset:self.offset + 5])
            if not starts_like_tls_record(header):
                raise HelloError("tls:invalid-hello", "a TLS record other than a handshake record came before the "
                                                      "ClientHello was whole")
            size = int.from_bytes(header[3:5], "big")
            if size == 0:
                raise HelloError("tls:invalid-hello", "an empty TLS record came before the ClientHello was whole")
            if self.offset + 5 + size > len(data):
                return False
            self.records += 1
            if self.records > MAX_HELLO_RECORDS:
                raise HelloError("tls:hello-records", f"the ClientHello is split into more than {MAX_HELLO_RECORDS} "
                                                      "TLS records")
            if len(self.head) < 4:
                self.head += bytes(data[self.offset + 5:self.offset + 5 + min(size, 4 - len(self.head))])
            self.payload += size
            self.offset += 5 + size
            self.done = len(self.head) == 4 and self.payload >= 4 + int.from_bytes(self.head[1:4], "big")
        if self.done and self.payload > 4 + int.from_bytes(self.head[1:4], "big"):
            # A client sends nothing after its ClientHello until the server answers: what shares its record
            # would reach the server unjudged (a second hello naming another host).
            extra = self.payload - 4 - int.from_bytes(self.head[1:4], "big")
            raise HelloError("tls:invalid-hello", f"the TLS record carrying the ClientHello holds {extra} more bytes "
                                                  "after it (a client sends nothing more before the server answers)")
        return self.done


def read_client_hello(data: bytes | bytearray, scan: HelloScan | None = None) -> ClientHelloInfo | None:
    """The ClientHello at the start of ``data`` (at ``scan.start``); None while it is not whole. A transport
    that reads a hello as it comes passes its growing buffer and the same ``scan`` each time: the buffer is
    read in place, from where the last read stopped, and copied once, when the hello is whole."""
    scan = scan or HelloScan()
    start = bytes(data[scan.start:scan.start + 3])
    if len(start) < 3:
        if start and start[0] != 0x16:
            raise HelloError("tls:not-tls", "the tunnel does not start with a TLS handshake record")
        return NEED_MORE
    if not starts_like_tls_record(start):
        raise HelloError("tls:not-tls", "the tunnel does not start with a TLS handshake record")
    if not scan.whole(data):
        if len(data) - scan.start > MAX_HELLO_BYTES:
            raise HelloError("tls:hello-too-large", f"the ClientHello is larger than {MAX_HELLO_BYTES} bytes")
        return NEED_MORE
    data = bytes(data[scan.start:])  # whole: copied once, for mitmproxy's reader
    try:
        handshake = get_client_hello(data)
    except ValueError as err:
        raise HelloError("tls:invalid-hello", f"the tunnel's TLS records are malformed: {err}") from None
    if handshake is None:
        if len(data) > MAX_HELLO_BYTES:
            raise HelloError("tls:hello-too-large", f"the ClientHello is larger than {MAX_HELLO_BYTES} bytes")
        return NEED_MORE
    size = _records_length(data, len(handshake))
    if size > MAX_HELLO_BYTES:  # the same bound however the reads were cut (a hello that came whole, too)
        raise HelloError("tls:hello-too-large", f"the ClientHello is larger than {MAX_HELLO_BYTES} bytes")
    if handshake[0] != HANDSHAKE_CLIENT_HELLO:
        raise HelloError("tls:invalid-hello", f"the first handshake message is type {handshake[0]}, not a ClientHello")
    try:
        hello = ClientHello(handshake[4:])
        extensions = hello.extensions
    except (EOFError, ValueError, AttributeError, KeyError, IndexError) as err:
        raise HelloError("tls:invalid-hello", f"the ClientHello cannot be parsed ({type(err).__name__})") from None
    names = [body for kind, body in extensions if kind == SERVER_NAME]
    if len(names) > 1:
        raise HelloError("tls:sni", "the ClientHello carries the server_name extension twice")
    sni = _server_name(names[0]) if names else None
    ech = any(kind in ENCRYPTED_NAME_EXTENSIONS for kind, _ in extensions)
    return ClientHelloInfo(sni, ech, size)


def _server_name(body: bytes) -> str:
    """RFC 6066 section 3: a list of exactly one entry, of type host_name, holding an ASCII name."""
    if len(body) < 5:
        raise HelloError("tls:sni", "the server_name extension is too short to hold a name")
    list_length = int.from_bytes(body[0:2], "big")
    if list_length != len(body) - 2:
        raise HelloError("tls:sni", "the server_name list length does not match the extension")
    name_type, name_length = body[2], int.from_bytes(body[3:5], "big")
    if name_type != 0:
        raise HelloError("tls:sni", f"the server_name entry has type {name_type}, not host_name")
    if 5 + name_length != len(body):
        raise HelloError("tls:sni", "the server_name list holds more than one name, or a name of the wrong length")
    raw = body[5:]
    if not raw or not raw.isascii():
        raise HelloError("tls:sni", "the server_name is empty or not ASCII")
    text = raw.decode("ascii")
    if text != text.strip() or text.endswith("."):
        raise HelloError("tls:sni", f"the server_name {text[:80]!r} has surrounding spaces or a trailing dot")
    try:
        host, _ = normalise_host(text)
    except HostFormError as err:
        raise HelloError("tls:sni", f"the server_name {text[:80]!r} is not a valid host name: {err.reason}") from None
    return host


def _records_length(data: bytes, handshake_length: int) -> int:
    """How many bytes of ``data`` the records holding the ClientHello take (the rest is the client's next)."""
    offset, collected = 0, 0
    while collected < handshake_length and offset + 5 <= len(data):
        size = int.from_bytes(data[offset + 3:offset + 5], "big")
        offset += 5 + size
        collected += size
    return offset
