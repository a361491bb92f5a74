"""Real TLS flights from Python's own TLS stack, in memory (ssl.MemoryBIO): ClientHellos, a server's first
answer, and a handshake in which the server sends a HelloRetryRequest.

A server that accepts only secp384r1 answers a first ClientHello whose key share is X25519 (Python's
client's first, as OpenSSL's) with a HelloRetryRequest; ``is_hello_retry`` checks that it really did.
"""

from __future__ import annotations

import contextlib
import hashlib
import ssl
from dataclasses import dataclass
from pathlib import Path

from labnet import self_signed

HELLO_RETRY_RANDOM = hashlib.sha256(b"HelloRetryRequest").digest()
NAMES = ["public.lab.example", "other.lab.example"]


def is_hello_retry(flight: bytes) -> bool:
    """The flight starts with a handshake record holding a ServerHello whose random is the HelloRetryRequest
    value (RFC 8446 4.1.3)."""
    return flight[:1] == b"\x16" and flight[5:6] == b"\x02" and flight[11:43] == HELLO_RETRY_RANDOM


def retrying_server_context(directory: str | Path | None = None) -> tuple[ssl.SSLContext, Path]:
    """A server context (certificate for NAMES) that accepts only secp384r1: it asks X25519 clients again."""
    context, cert_file = self_signed(NAMES, None if directory is None else str(directory))
    context.set_ecdh_curve("secp384r1")
    return context, cert_file


def _step(tls: ssl.SSLObject) -> bool:
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:
        return False
    return True


@dataclass
class Pair:
    """A client and a server SSLObject wired by hand: every flight can be read, kept and changed."""

    client: ssl.SSLObject
    server: ssl.SSLObject
    to_client: ssl.MemoryBIO
    from_client: ssl.MemoryBIO
    to_server: ssl.MemoryBIO
    from_server: ssl.MemoryBIO

    def client_flight(self, answer: bytes = b"") -> bytes:
        if answer:
            self.to_client.write(answer)
        _step(self.client)
        return self.from_client.read()

    def server_flight(self, hello: bytes) -> bytes:
        self.to_server.write(hello)
        _step(self.server)
        return self.from_server.read()


def pair(server_context: ssl.SSLContext, server_hostname: str | None, cert_file: Path,
         client_context: ssl.SSLContext | None = None) -> Pair:
    client_context = client_context or ssl.create_default_context(cafile=str(cert_file))
    if server_hostname is None:
        client_context.check_hostname = False
    to_client, from_client, to_server, from_server = (ssl.MemoryBIO() for _ in range(4))
    client = client_context.wrap_bio(to_client, from_client, server_hostname=server_hostname)
    server = server_context.wrap_bio(to_server, from_server, server_side=True)
    return Pair(client, server, to_client, from_client, to_server, from_server)


def first_hello(server_hostname: str | None, groups: str | None = None) -> bytes:
    """A genuine first ClientHello (``groups``: the one group a client context offers, e.g. secp384r1)."""
    context = ssl.create_default_context()
    if server_hostname is None:
        context.check_hostname = False
    if groups:
        context.set_ecdh_curve(groups)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=server_hostname)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


@dataclass(frozen=True)
class RetryHandshake:
    first: bytes  # the client's first ClientHello
    retry: bytes  # the server's answer: a HelloRetryRequest (and its change_cipher_spec, if any)
    second: bytes  # the client's next flight: (change_cipher_spec and) the second ClientHello
    answer: bytes  # the server's answer to that: ServerHello and the rest of its flight


def retry_handshake(server_hostname: str | None = "public.lab.example") -> RetryHandshake:
    server_context, cert_file = retrying_server_context()
    wired = pair(server_context, server_hostname, cert_file)
    first = wired.client_flight()
    retry = wired.server_flight(first)
    second = wired.client_flight(retry)
    answer = wired.server_flight(second)
    return RetryHandshake(first, retry, second, answer)


def server_first_flight(maximum: ssl.TLSVersion | None = None) -> bytes:
    """A server's first answer that is not a HelloRetryRequest (``maximum``: cap the server's version)."""
    server_context, cert_file = self_signed(NAMES)
    if maximum is not None:
        server_context.maximum_version = maximum
    wired = pair(server_context, NAMES[0], cert_file)
    return wired.server_flight(wired.client_flight())
