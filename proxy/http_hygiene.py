"""HTTP-proxy hygiene that does not depend on a transport: hop-by-hop headers and upgrades.

RFC 9110 section 7.6.1: a proxy removes ``Connection``, every header ``Connection`` names, and the
hop-by-hop headers (``Proxy-Connection``, ``Keep-Alive``, ``TE``, ``Trailer``, ``Transfer-Encoding`` is
re-framed by the transport, ``Upgrade``) before it forwards a request; ``Proxy-Authorization`` is the
client's credential for *this* proxy and must never reach an origin. An ``Upgrade`` is a request to
change protocols: only a WebSocket upgrade the policy allowed may go on; anything else is refused.

A body on a request whose method gives it no meaning (GET, HEAD; TRACE must have none) is refused: an
origin that does not read such a body — many do not — takes its bytes for the next request on the
connection, a request egresswall never decided (request smuggling, "CL.0": RFC 9110 9.3.1 warns of it).
"""

from __future__ import annotations

from collections.abc import Iterable

ALWAYS_HOP_BY_HOP = frozenset({"connection", "proxy-connection", "keep-alive", "te", "trailer", "upgrade",
                               "proxy-authorization", "proxy-authenticate"})
NOT_NAMED = frozenset({"transfer-encoding", "content-length", "host"})  # framing: the transport's business
WEBSOCKET, NO_UPGRADE, OTHER_UPGRADE = "websocket", "none", "other"
BODILESS_METHODS = frozenset({"GET", "HEAD", "TRACE"})  # content has no meaning (RFC 9110 9.3.1, 9.3.2, 9.3.8)
UNEXPECTED_BODY = "http:unexpected-body"


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


def unexpected_body(method: str, content_length: int | None, chunked: bool) -> str | None:
    """Why a request's body is refused (a method that gives it no meaning), or None. An empty one
    (``Content-Length: 0``) is no body."""
    if method.upper() not in BODILESS_METHODS or not (chunked or content_length):
        return None
    what = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {content_length}"
    return (f"a {method.upper()} request carries a body ({what}); HTTP gives it no meaning, and an origin that does "
            "not read it would take it for another request, one egresswall never decided; send the body with POST")
