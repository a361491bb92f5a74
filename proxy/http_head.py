"""Which plain-HTTP request heads the fast path takes (proxy/fast_http.py): a pure, strict classifier.

The fast path only relays a request whose head has one reading. ``h11`` is a careful parser but a
lenient one where RFC 9112 allows a recipient to be (it unfolds an obs-fold, accepts bare LF line ends,
merges ``Content-Length: 5, 5`` and keeps Content-Length beside Transfer-Encoding), and each of those
leniencies is a place where egresswall and an origin could read two different requests. So before
h11 sees a head, ``take_head`` checks it byte by byte against a narrow grammar; anything outside it is
``NotTaken`` with the reason, and the connection goes to mitmproxy unread, where the addons refuse it
(or relay it) exactly as before. Being narrower than mitmproxy is always safe: it only costs speed.

Taken: ``METHOD SP http://authority/path SP HTTP/1.1`` (or 1.0), CRLF line ends only, visible ASCII
(and SP/HTAB inside values), token header names, exactly one Host, at most one Content-Length of
digits without a leading zero, or exactly one ``Transfer-Encoding: chunked`` (HTTP/1.1, no Content-Length), no
Upgrade, no Expect, a method from a short list, and an authority of a DNS name, a dotted IPv4 address or a bracketed
IPv6 address with an optional port. The host and port are then decided by the gate (``policy.hosts``,
the parser the Chromium agreement test holds), never by this module.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"})
_REQUEST_LINE = re.compile(rb"([A-Z]{1,16}) (http://([^/?#\s]*)((?:/[^\s#]*)?)) HTTP/(1\.[01])")
_NAME = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VALUE = re.compile(rb"[\x21-\x7e](?:[\x20-\x7e\t]*[\x21-\x7e])?|")  # no leading/trailing space (OWS is outside)
# A DNS name (letters, digits, hyphens, dots; the gate judges the form), a dotted IPv4 address or a
# bracketed IPv6 literal; an optional port of digits. Nothing else: no '@', '%', '\', no spaces.
_AUTHORITY = re.compile(rb"(?P<host>[A-Za-z0-9](?:[A-Za-z0-9.\-]{0,252}[A-Za-z0-9.])?|\[[0-9A-Fa-f:.]{2,45}\])"
                        rb"(?::(?P<port>[0-9]{1,5}))?")
_PATH = re.compile(rb"/[A-Za-z0-9\-._~!$&'()*+,;=:@/?%]*")
# Digits without a leading zero, as mitmproxy's parser takes them (``Content-Length: 003`` is 400 there): one
# input, one answer on both transports (review round 16).
_DIGITS = re.compile(rb"0|[1-9][0-9]{0,17}")
_LAST_PORT = 65535


@dataclass(frozen=True)
class PlainRequest:
    """A head the fast path takes, as it was sent: what the gate decides on and what is forwarded."""

    method: str
    host: str  # as sent (brackets removed from an IPv6 literal); policy.hosts normalises and judges it
    port: int
    path: str  # origin form, with the query
    authority: str  # the request target's authority, as sent
    version: str  # "1.1" or "1.0"
    headers: tuple[tuple[str, str], ...]  # (name as sent, value) in order
    content_length: int | None
    chunked: bool
    size: int = 0  # the head's bytes as sent (a session's request_bytes counts them)

    def values(self, name: str) -> tuple[str, ...]:
        """Every value of one header (``name`` lower case)."""
        return tuple(v for k, v in self.headers if k.lower() == name)


@dataclass(frozen=True)
class NotTaken:
    reason: str


def take_head(head: bytes) -> PlainRequest | NotTaken:
    """``head``: a whole request head, up to and including its blank line."""
    if not head.endswith(b"\r\n\r\n"):
        return NotTaken("the head does not end with CRLF CRLF")
    lines = head[:-4].split(b"\r\n")
    if any(b"\r" in line or b"\n" in line for line in lines):
        return NotTaken("a bare CR or LF")
    line = _REQUEST_LINE.fullmatch(lines[0])
    if line is None:
        return NotTaken("not an absolute-form http:// request line")
    method = line[1].decode()
    if method not in METHODS:
        return NotTaken(f"the method {method} is not one the fast path relays")
    authority = _AUTHORITY.fullmatch(line[3])
    if authority is None:
        return NotTaken("an authority the fast path does not read")
    port = int(authority["port"]) if authority["port"] is not None else 80
    if authority["port"] is not None and not 0 < port <= _LAST_PORT:
        return NotTaken("a port out of range")
    path = line[4] or b"/"
    if _PATH.fullmatch(path) is None:
        return NotTaken("a path with bytes the fast path does not relay")
    headers: list[tuple[str, str]] = []
    for raw in lines[1:]:
        name, colon, value = raw.partition(b":")
        if not colon or _NAME.fullmatch(name) is None:
            return NotTaken("a header line that is not name:value (or a folded line)")
        value = value.strip(b" \t")
        if _VALUE.fullmatch(value) is None:
            return NotTaken("a header value with bytes outside visible ASCII")
        headers.append((name.decode("ascii"), value.decode("ascii")))
    return _framed(method, authority, port, path, line, headers, len(head))


def _framed(method: str, authority: re.Match, port: int, path: bytes, line: re.Match,
            headers: list[tuple[str, str]], size: int) -> PlainRequest | NotTaken:
    counts: dict[str, list[str]] = {}
    for name, value in headers:
        counts.setdefault(name.lower(), []).append(value)
    version = line[5].decode()
    if len(counts.get("host", ())) != 1:
        return NotTaken("not exactly one Host header")
    for name in ("upgrade", "expect", "http2-settings"):
        if name in counts:
            return NotTaken(f"a {name} header (mitmproxy's path handles it)")
    lengths, codings = counts.get("content-length", []), counts.get("transfer-encoding", [])
    if len(lengths) > 1 or len(codings) > 1 or (lengths and codings):
        return NotTaken("more than one framing header")
    if lengths and _DIGITS.fullmatch(lengths[0].encode()) is None:
        return NotTaken("a Content-Length that is not digits")
    if codings and (codings[0].lower() != "chunked" or version != "1.1"):
        return NotTaken("a Transfer-Encoding other than chunked on HTTP/1.1")
    host = authority["host"].decode("ascii")
    return PlainRequest(method=method, host=host[1:-1] if host.startswith("[") else host, port=port,
                        path=path.decode("ascii"), authority=line[3].decode("ascii"), version=version,
                        headers=tuple(headers), content_length=int(lengths[0]) if lengths else None,
                        chunked=bool(codings), size=size)
