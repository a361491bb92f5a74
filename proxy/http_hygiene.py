"""HTTP-proxy hygiene that does not depend on a transport: hop-by-hop headers, upgrades, bodies where none belongs.

RFC 9110 section 7.6.1: a proxy removes ``Connection``, every header ``Connection`` names, and the
hop-by-hop headers (``Proxy-Connection``, ``Keep-Alive``, ``TE``, ``Trailer``, ``Transfer-Encoding`` is
re-framed by the transport, ``Upgrade``) before it forwards a request; ``Proxy-Authorization`` is the
client's credential for *this* proxy and must never reach an origin. An ``Upgrade`` is a request to
change protocols: only a WebSocket upgrade the policy allowed may go on; anything else is refused.

A body on a request whose method gives it no meaning (GET, HEAD; TRACE must have none) is refused: an
origin that does not read such a body — many do not — takes its bytes for the next request on the
connection, a request egresswall never decided (request smuggling, "CL.0": RFC 9110 9.3.1 warns of it).
So is one on DELETE or OPTIONS (no generally defined meaning, 9.3.5 and 9.3.7), unless the policy in force
lists the method in ``http.body_allowed_on`` (the method sets: policy/request_bodies.py).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable

from policy.request_bodies import ALWAYS_REFUSED, REFUSED_UNLESS_ALLOWED, RFC_SECTION, SETTING

# ``proxy_authorization`` too: CGI and WSGI gateways read it as the same HTTP_PROXY_AUTHORIZATION, so a client's
# credential in that spelling reached an upstream proxy that reads it so (review round 20).
ALWAYS_HOP_BY_HOP = frozenset({"connection", "proxy-connection", "keep-alive", "te", "trailer", "upgrade",
                               "proxy-authorization", "proxy_authorization", "proxy-authenticate"})
NOT_NAMED = frozenset({"transfer-encoding", "content-length", "host"})  # framing: the transport's business
WEBSOCKET, NO_UPGRADE, OTHER_UPGRADE = "websocket", "none", "other"
UNEXPECTED_BODY = "http:unexpected-body"
CONNECT_CONTENT = "http:connect-content"
# In a response head's line, its line end gone: a control byte other than HTAB (RFC 9110 5.5, RFC 9112 4), a
# bare CR or a NUL among them. A client may end the line at one: neither transport relays a head holding one.
CONTROL_BYTE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
# The largest Content-Length relayed: a client that reads one into 64 bits (unsigned, wrapping) would take
# 2**64 + 5 for 5 and read what follows as another response.
MAX_CONTENT_LENGTH = 2**63 - 1
# Headers with which a client asks a server (IIS URL Rewrite, Symfony before 3.4, frameworks' method-override
# middleware, Google's APIs) to serve another path or method than the request line's: where a rule decides by
# path or method, such a request is refused (http:override-header), as the decision was made on the line.
OVERRIDE_HEADERS = frozenset({"x-original-url", "x-rewrite-url", "x-http-method-override", "x-http-method",
                              "x-method-override"})
OVERRIDE_HEADER = "http:override-header"


def without_names(fields: tuple[tuple[bytes, bytes], ...], names: Collection[str]) -> tuple[tuple[bytes, bytes], ...]:
    """``fields`` (mitmproxy's raw header list) without every header whose name, lower case, is in ``names``: one
    pass, where a ``pop`` per name rebuilt the whole list each time — a ``Connection`` header naming thousands of
    the request's (or a response's) own headers cost seconds of the event loop (review round 23)."""
    return tuple((name, value) for name, value in fields if name.decode("latin-1").lower() not in names)


def override_headers(names: Iterable[str]) -> tuple[str, ...]:
    """The request's headers (names as sent) that ask for another path or method, lower case, each once. An
    underscore counts as a hyphen: CGI and FastCGI gateways (IIS, PHP) turn both spellings into the same
    HTTP_X_ORIGINAL_URL, which is what the applications read (review round 19)."""
    return tuple(sorted({name.lower().replace("_", "-") for name in names} & OVERRIDE_HEADERS))


def tokens(values: Iterable[str]) -> list[str]:
    """The comma-separated tokens of every occurrence of a header, lower case, empty ones dropped."""
    return [t.strip().lower() for value in values for t in value.split(",") if t.strip()]


def hop_by_hop_names(connection_values: Iterable[str], keep_upgrade: bool = False) -> set[str]:
    """Every header name to remove before forwarding (lower case)."""
    names = set(ALWAYS_HOP_BY_HOP) | (set(tokens(connection_values)) - NOT_NAMED)
    if keep_upgrade:
        names.discard("upgrade")
    return names


def upgrade_kind(upgrade_values: list[str]) -> str:
    """``websocket`` only for exactly one Upgrade header naming exactly ``websocket``; any other
    Upgrade (two headers, ``websocket, foo``, ``h2c``, ``foo``) is some other upgrade, refused."""
    if not upgrade_values:
        return NO_UPGRADE
    if len(upgrade_values) == 1 and tokens(upgrade_values) == ["websocket"]:
        return WEBSOCKET
    return OTHER_UPGRADE


def unexpected_body(method: str, content_length: int | None, chunked: bool,
                    allowed_on: Collection[str]) -> str | None:
    """Why a request's body is refused (a method that gives it no meaning), or None. An empty one
    (``Content-Length: 0``) is no body. ``allowed_on``: the policy's ``http.body_allowed_on`` (DELETE,
    OPTIONS or both; matched exactly, as methods are case-sensitive). GET, HEAD and TRACE are refused
    whatever it holds."""
    named = method.upper()
    if not (chunked or content_length) or named not in ALWAYS_REFUSED | REFUSED_UNLESS_ALLOWED:
        return None
    if named in REFUSED_UNLESS_ALLOWED and method in allowed_on:
        return None
    what = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {content_length}"
    meaning = "gives it no meaning" if named in ALWAYS_REFUSED else "defines no general meaning for it"
    article = "an" if named[0] in "AEIOU" else "a"
    why = (f"{article} {named} request carries a body ({what}); HTTP {meaning} (RFC 9110 {RFC_SECTION[named]}), and an "
           "origin that does not read it would take it for another request, one egresswall never decided; "
           "send the body with POST")
    if named in ALWAYS_REFUSED:
        return why
    if named in allowed_on:  # the policy lists DELETE, the request says 'delete': another method to HTTP
        return why + f" (methods are case-sensitive: {SETTING} lists {named}, not {method!r})"
    return why + f", or, if every origin this policy allows reads {named} bodies, list {named} in {SETTING}"


def connect_content(transfer_encodings: Collection[str], content_lengths: Collection[str]) -> str | None:
    """Why a CONNECT that declares content is refused, or None (``Content-Length: 0`` declares none). A CONNECT
    request has no content (RFC 9110 9.3.6): mitmproxy's path read declared bytes as a body and dropped them, the
    front took them for the tunnel's first bytes, so one input got two answers (review round 16)."""
    if transfer_encodings:
        return ("the CONNECT request has a Transfer-Encoding header: a CONNECT request has no content "
                "(RFC 9110 9.3.6)")
    if any(value.strip() != "0" for value in content_lengths):
        return ("the CONNECT request declares content (Content-Length other than 0): a CONNECT request has no content "
                "(RFC 9110 9.3.6)")
    return None
