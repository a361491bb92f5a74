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

from .tls_hello import MAX_HELLO_BYTES, HelloError, read_client_hello

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

    @classmethod
    def more(cls) -> FirstBytes:
        return cls(need_more=True)

    @classmethod
    def refuse(cls, rule: str, reason: str) -> FirstBytes:
        return cls(refused=True, rule=rule, reason=reason)


def classify_tunnel_start(data: bytes, connect_host: str, http_inside: bool, ech_allowed: bool,
                          max_head: int = MAX_HTTP_HEAD) -> FirstBytes:
    if not data:
        return FirstBytes.more()
    if http_inside and data[0] != 0x16:
        return _http_head(data, max_head)  # a TLS record starts 0x16; no HTTP method does
    try:
        hello = read_client_hello(data)
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
        return FirstBytes.refuse("tls:ech", "the ClientHello carries Encrypted Client Hello (extension 0xfe0d), which "
                                            "hides the real destination behind the outer name; set tls.ech: allow "
                                            "to let it through")
    return FirstBytes(kind="tls", sni=hello.sni, hello_size=hello.size)


def _http_head(data: bytes, max_head: int) -> FirstBytes:
    """A whole HTTP/1.x request head, as h11 reads it; the request itself is decided by the transport."""
    parser = h11.Connection(h11.SERVER, max_incomplete_event_size=max_head)
    try:
        parser.receive_data(data)
        event = parser.next_event()
    except h11.RemoteProtocolError as err:
        return FirstBytes.refuse("http:not-http", f"the tunnel goes to a plain-HTTP port but does not carry an "
                                                  f"HTTP/1 request: {err}")
    if event is h11.NEED_DATA:
        if len(data) > max_head:
            return FirstBytes.refuse("limits.max_header_bytes",
                                     f"the first request head in the tunnel is over {max_head} bytes")
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


__all__ = ["FirstBytes", "MAX_HELLO_BYTES", "classify_tunnel_start"]
