"""Build TLS ClientHello records byte by byte, so tests can send exactly the malformed ones they mean.

``real_client_hello`` asks Python's own TLS stack for a genuine one; ``client_hello`` assembles one from
parts (RFC 8446 section 4.1.2) with any server_name extension body, extra extensions, and record split;
``padded_hello`` makes a large one. ``counted_record_headers`` counts the record headers egresswall's
ClientHello reader looks at (the work of reading a hello, counted, never timed).
"""

from __future__ import annotations

import contextlib
import ssl
import struct

ECH = 0xFE0D


def server_name_body(*names: bytes, name_type: int = 0) -> bytes:
    entries = b"".join(bytes([name_type]) + struct.pack("!H", len(n)) + n for n in names)
    return struct.pack("!H", len(entries)) + entries


def extension(kind: int, body: bytes) -> bytes:
    return struct.pack("!HH", kind, len(body)) + body


def client_hello(sni: bytes | None = b"example.com", *, sni_body: bytes | None = None,
                 extra: tuple[bytes, ...] = (), record_size: int | None = None) -> bytes:
    """A TLS 1.2-shaped ClientHello in one or more handshake records (``record_size`` splits it)."""
    extensions = b""
    if sni_body is not None:
        extensions += extension(0, sni_body)
    elif sni is not None:
        extensions += extension(0, server_name_body(sni))
    extensions += extension(0x000D, b"\x00\x02\x04\x03")  # signature_algorithms
    for ext in extra:
        extensions += ext
    body = (b"\x03\x03" + bytes(32) + b"\x00" + b"\x00\x02\x13\x01" + b"\x01\x00"
            + struct.pack("!H", len(extensions)) + extensions)
    handshake = b"\x01" + len(body).to_bytes(3, "big") + body
    size = record_size or len(handshake)
    return b"".join(b"\x16\x03\x01" + struct.pack("!H", len(handshake[i:i + size])) + handshake[i:i + size]
                    for i in range(0, len(handshake), size))


def real_client_hello(server_hostname: str | None) -> bytes:
    """The first flight of Python's TLS client for ``server_hostname`` (None: no SNI)."""
    context = ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=server_hostname) if server_hostname else \
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).wrap_bio(incoming, outgoing)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def padded_hello(name: bytes, record_size: int, padding: int = 30_000) -> bytes:
    """A ClientHello for ``name`` of about ``padding`` bytes (a padding extension), in records of
    ``record_size`` bytes."""
    return client_hello(name, extra=(extension(21, b"\0" * padding),), record_size=record_size)


def counted_record_headers(monkeypatch) -> list[int]:
    """How many TLS record headers proxy/tls_hello.py looks at from now on, in a one-item list."""
    from proxy import tls_hello

    seen = [0]
    real = tls_hello.starts_like_tls_record

    def counting(data) -> bool:
        seen[0] += 1
        return real(data)

    monkeypatch.setattr(tls_hello, "starts_like_tls_record", counting)
    return seen
