"""After a passed-through tunnel's first ClientHello: did the server ask for a second one, and is it the same?

In TLS 1.3 a server that wants another key share answers the first ClientHello with a HelloRetryRequest
— a ServerHello whose random is SHA-256("HelloRetryRequest") (RFC 8446 section 4.1.3) — and the client
sends a second ClientHello, often after one dummy change_cipher_spec record (middlebox compatibility,
RFC 8446 appendix D.4). The first ClientHello is judged by the gate; a tunnel that then relayed the
second one unseen would let a client name another server (or add ECH) in it. So the relay keeps the
question open, bounded, until it has an answer:

* the server's first answer is read just far enough to tell a ServerHello from a HelloRetryRequest
  (its first handshake bytes: type, legacy_version and random; ``classify_server_first``). Until then
  nothing goes either way (a TLS server answers a whole ClientHello without waiting for more);
* after a HelloRetryRequest the client's next handshake (at most one change_cipher_spec before it) is
  read whole with the same strict ClientHello reader (``read_retry_hello``) and must name the same
  server, and obey the same ECH rule, as the first one (``judge_retry_hello``).

``RetryWatch`` is the state of that question for one tunnel, without I/O: both transports feed it what
each side sent and forward what it releases. mitmproxy's record parser wants whole records; a TLS 1.2
server's first record can be 16 KiB, and only its first 43 bytes matter here, so the server's records
are read by hand (their headers checked with mitmproxy's ``starts_like_tls_record``).
"""

from __future__ import annotations

import hashlib
from typing import Final, NamedTuple

from mitmproxy.net.tls import starts_like_tls_record

from .tls_hello import MAX_HELLO_BYTES, ClientHelloInfo, HelloError, HelloScan, read_client_hello

HELLO_RETRY_RANDOM: Final = hashlib.sha256(b"HelloRetryRequest").digest()
NEED_MORE, HELLO_RETRY, NOT_RETRY = "need-more", "hello-retry", "not-retry"
HANDSHAKE, CHANGE_CIPHER_SPEC, ALERT = 0x16, 0x14, 0x15
HANDSHAKE_SERVER_HELLO = 0x02
# A ServerHello's first bytes: type (1), length (3), legacy_version (2), random (32).
SERVER_HELLO_PREFIX: Final = 4 + 2 + 32
MIN_SERVER_HELLO_BODY: Final = 2 + 32 + 1 + 2 + 1  # version, random, empty session id, cipher suite, compression
MAX_PLAINTEXT_RECORD: Final = 2 ** 14  # RFC 8446 5.1 / RFC 5246 6.2.1
# Every record holds at least one byte of the prefix (empty handshake records are refused), so this many bytes
# always give an answer: the classifier never waits for more than this.
MAX_SERVER_FIRST_BYTES: Final = SERVER_HELLO_PREFIX * 6
# RFC 8446 D.4: the compatibility change_cipher_spec is one record holding the single byte 1.
COMPAT_CHANGE_CIPHER_SPEC: Final = bytes([CHANGE_CIPHER_SPEC, 3, 3, 0, 1, 1])
SERVER_RULE, RETRY_CHANGED, RETRY_INVALID = "tls:server-hello", "tls:retry-hello-changed", "tls:retry-hello-invalid"


def classify_server_first(data: bytes) -> str:
    """``NEED_MORE``, ``HELLO_RETRY`` or ``NOT_RETRY`` for the server's first bytes; HelloError when they start
    a TLS handshake record that cannot be read (so whether it is a HelloRetryRequest cannot be told).

    A HelloRetryRequest is a ServerHello in a handshake record. An alert, or a handshake whose first message is
    not a ServerHello, is not one: nothing is asked again, and the tunnel goes on as the first ClientHello was
    judged. An answer that is no TLS record at all is refused: a TLS server answers a ClientHello with a
    handshake record or an alert, and a service that answers garbage and reads on (SMTP, memcached, IRC) would
    otherwise be driven in its own protocol through a tunnel egresswall passes as TLS (review round 19)."""
    if not data:
        return NEED_MORE
    if data[0] not in (HANDSHAKE, ALERT) or (data[0] == ALERT and len(data) > 1 and data[1] != 3):
        raise HelloError(SERVER_RULE, f"the server's first answer is not TLS (it starts {data[:2].hex()}, not a "
                                      "handshake or alert record): egresswall passes only TLS through this tunnel")
    if data[0] == ALERT:
        return NOT_RETRY if len(data) > 1 else NEED_MORE  # its version byte decides whether it is TLS at all
    prefix = _handshake_prefix(data)
    if prefix[:1] and prefix[0] != HANDSHAKE_SERVER_HELLO:
        return NOT_RETRY
    if len(prefix) >= 4 and int.from_bytes(prefix[1:4], "big") < MIN_SERVER_HELLO_BODY:
        raise HelloError(SERVER_RULE, "the server's ServerHello is too short to be one")
    if len(prefix) >= 6 and not (prefix[4] == 3 and prefix[5] <= 3):
        raise HelloError(SERVER_RULE, f"the server's ServerHello has legacy_version {prefix[4:6].hex()}, not a TLS "
                                      f"version")
    if len(prefix) < SERVER_HELLO_PREFIX:
        return NEED_MORE
    if prefix[6:] != HELLO_RETRY_RANDOM:
        return NOT_RETRY
    if prefix[4:6] != b"\x03\x03":
        raise HelloError(SERVER_RULE, "the server's HelloRetryRequest has a legacy_version other than TLS 1.2's")
    return HELLO_RETRY


def _handshake_prefix(data: bytes) -> bytes:
    """The first SERVER_HELLO_PREFIX bytes of the handshake data in ``data``'s records (fewer, while they are
    not all here), each record header checked."""
    size = int.from_bytes(data[3:5], "big")
    if SERVER_HELLO_PREFIX <= size <= MAX_PLAINTEXT_RECORD and len(data) >= 5 + SERVER_HELLO_PREFIX \
            and starts_like_tls_record(data):
        return data[5:5 + SERVER_HELLO_PREFIX]  # all in the first record: the usual case, read in one slice
    prefix, offset = b"", 0
    while len(prefix) < SERVER_HELLO_PREFIX:
        header = data[offset:offset + 5]
        if len(header) < 5:
            if header and (header[0] != HANDSHAKE or (len(header) > 1 and header[1] != 3)):
                raise HelloError(SERVER_RULE, "the server's ServerHello continues in a record that is not a TLS "
                                              "handshake record")
            break  # the next record's header is not all here: judge what is
        if not starts_like_tls_record(header):
            raise HelloError(SERVER_RULE, f"the server's answer starts a record {header[:3].hex()} that is not a TLS "
                                          f"handshake record")
        size = int.from_bytes(header[3:5], "big")
        if size == 0 or size > MAX_PLAINTEXT_RECORD:
            raise HelloError(SERVER_RULE, f"the server's handshake record has length {size}, outside 1 to "
                                          f"{MAX_PLAINTEXT_RECORD}")
        body = data[offset + 5:offset + 5 + size]
        prefix += body[:SERVER_HELLO_PREFIX - len(prefix)]
        if len(body) < size:
            break  # the record is not all here: what is, is all there is to read
        offset += 5 + size
    return prefix


def read_retry_hello(data: bytes | bytearray, scan: HelloScan | None = None) -> ClientHelloInfo | None:
    """The client's second ClientHello (after at most one compatibility change_cipher_spec), read as strictly
    as the first; None while it is not whole. A caller that reads it as it comes passes its growing buffer
    and the same ``scan`` each time (proxy/tls_hello.py: read on from where the last read stopped)."""
    rest = 0  # where the second ClientHello starts in ``data``
    if data[:1] == bytes([CHANGE_CIPHER_SPEC]):
        if len(data) < len(COMPAT_CHANGE_CIPHER_SPEC):
            if not COMPAT_CHANGE_CIPHER_SPEC.startswith(data):
                raise HelloError(RETRY_INVALID, "the client's change_cipher_spec record before its second "
                                                "ClientHello is not the one-byte record TLS 1.3 allows")
            return None
        if not data.startswith(COMPAT_CHANGE_CIPHER_SPEC):
            raise HelloError(RETRY_INVALID, "the client's change_cipher_spec record before its second ClientHello "
                                            "is not the one-byte record TLS 1.3 allows")
        rest = len(COMPAT_CHANGE_CIPHER_SPEC)
    if len(data) == rest:
        return None
    if data[rest] != HANDSHAKE:
        raise HelloError(RETRY_INVALID, f"after the server's HelloRetryRequest the client sent a record of type "
                                        f"{data[rest]}, not its second ClientHello (at most one change_cipher_spec "
                                        f"may come first)")
    try:
        hello = read_client_hello(data, (scan or HelloScan()).at(rest))
    except HelloError as err:
        raise HelloError(err.rule if err.rule != "tls:not-tls" else RETRY_INVALID,
                         f"the second ClientHello (after the server's HelloRetryRequest): {err.reason}") from None
    if hello is None:
        return None
    return ClientHelloInfo(hello.sni, hello.ech, hello.size + rest)


def judge_retry_hello(first_sni: str | None, second: ClientHelloInfo, ech_allowed: bool) -> HelloError | None:
    """The second ClientHello must name exactly the server the first named (or none, as the first did), and
    carry ECH only where the first could have."""
    if second.sni != first_sni:
        return HelloError(RETRY_CHANGED, f"the second ClientHello (after the server's HelloRetryRequest) names "
                                         f"{_named(second.sni)}, the first named {_named(first_sni)}")
    if second.ech and not ech_allowed:
        return HelloError("tls:ech", "the second ClientHello (after the server's HelloRetryRequest) carries "
                                     "Encrypted Client Hello (extension 0xfe0d, a draft's code point or ESNI's), "
                                     "which hides the real destination behind the outer name; set tls.ech: allow "
                                     "to let it through")
    return None


def _named(sni: str | None) -> str:
    return f"server {sni}" if sni is not None else "no server"


class Released(NamedTuple):  # (a tuple: made once per tunnel on the common path, and cheap to make)
    """What one step of the watch lets go: bytes to forward each way, or the refusal that ends the tunnel."""

    to_client: bytes = b""
    to_server: bytes = b""
    refused: HelloError | None = None


NOTHING: Final = Released()
AWAIT_SERVER, AWAIT_RETRY, DONE = "await-server", "await-retry", "done"


class RetryWatch:
    """One tunnel from its first ClientHello (already judged and forwarded) until the question is answered.

    Feed it each side's bytes (``from_server``, ``from_client``) and forward what it releases. While it
    waits for the server's first answer, nothing is released either way; after a HelloRetryRequest the
    server's bytes flow and the client's are held until its second ClientHello is judged. ``done`` once
    answered: from then on the transport relays without it."""

    def __init__(self, first_sni: str | None, ech_allowed: bool, held_client: bytes = b"") -> None:
        self.first_sni, self.ech_allowed = first_sni, ech_allowed
        self.phase = AWAIT_SERVER
        self.server_held = b""
        # Sent after the first ClientHello, before the question was answered (grown in place: it may come a
        # byte per write), and how far the second ClientHello in it has been read.
        self.client_held = bytearray(held_client)
        self._retry_scan = HelloScan()

    @property
    def done(self) -> bool:
        return self.phase == DONE

    def from_server(self, data: bytes) -> Released:
        if self.phase != AWAIT_SERVER:
            return Released(to_client=data)
        if self.server_held:
            data = self.server_held + data
        try:
            answer = classify_server_first(data)
        except HelloError as err:
            return self._refuse(err)
        if answer == NEED_MORE:
            self.server_held = data
            return NOTHING
        to_client, self.server_held = data, b""
        if answer == NOT_RETRY:
            self.phase = DONE
            to_server, self.client_held = bytes(self.client_held), bytearray()
            return Released(to_client, to_server)
        self.phase = AWAIT_RETRY
        step = self._judge_retry()
        return Released(to_client, step.to_server, step.refused)

    def from_client(self, data: bytes) -> Released:
        if self.phase == DONE:
            return Released(to_server=data)
        self.client_held += data
        if self.phase == AWAIT_SERVER:
            if len(self.client_held) > MAX_HELLO_BYTES:
                return self._refuse(HelloError("tls:hello-too-large", f"the client sent more than {MAX_HELLO_BYTES} "
                                                                      f"bytes after its ClientHello before the server "
                                                                      f"answered it"))
            return NOTHING
        return self._judge_retry()

    def timed_out(self, seconds: float) -> HelloError:
        """The refusal when the question is still open ``seconds`` after the step that started the wait."""
        if self.phase == AWAIT_SERVER:
            err = HelloError(SERVER_RULE, f"the server's first answer (its ServerHello) was not complete {seconds:g}s "
                                          f"after its first byte (limits.header_timeout)")
        else:
            err = HelloError("limits.header_timeout", f"the second ClientHello (after the server's HelloRetryRequest) "
                                                      f"was not complete {seconds:g}s after the request "
                                                      f"(limits.header_timeout)")
        self._refuse(err)
        return err

    def ended(self) -> str:
        """Why a tunnel that one side closed while the question was open ends (no refusal: nobody broke a rule)."""
        waited_for_server = self.phase == AWAIT_SERVER
        self._refuse(HelloError("", ""))
        return ("the tunnel closed before the server's first answer to the ClientHello was complete"
                if waited_for_server else
                "the tunnel closed before the second ClientHello (after a HelloRetryRequest) was complete")

    def _judge_retry(self) -> Released:
        if not self.client_held:
            return NOTHING
        try:
            second = read_retry_hello(self.client_held, self._retry_scan)
        except HelloError as err:
            return self._refuse(err)
        if second is None:
            return NOTHING
        problem = judge_retry_hello(self.first_sni, second, self.ech_allowed)
        if problem is not None:
            return self._refuse(problem)
        self.phase = DONE
        to_server, self.client_held = bytes(self.client_held), bytearray()
        return Released(to_server=to_server)

    def _refuse(self, err: HelloError) -> Released:
        self.phase, self.server_held, self.client_held = DONE, b"", bytearray()
        return Released(refused=err)
