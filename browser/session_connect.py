"""Which session a browser-server client connection runs as: read from its WebSocket handshake. Pure.

A client names a session in one of two ways (never both):

* the path ``/session/<id>?secret=<secret>`` (``chromium.connect("ws://host:3000/session/ID?secret=S")``);
* the header ``X-Egresswall-Session: <id>:<secret>`` on any path (``chromium.connect(endpoint,
  headers={...})``), which keeps the secret out of URLs that proxies and logs in between may record.

Every context the connection opens then gets a proxy the *server* sets, carrying those credentials
(``session_proxy``, added to ``Browser.newContext`` by the relay after the protocol filter, which still
refuses any proxy a client sends). Whether the session exists and the secret is right is the proxy's
to judge (it may be another host: the browser server cannot read its store); what is malformed here
is refused at the handshake, with a reason that never repeats what the client sent.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from policy.credentials import Credentials, CredentialsError, session_credentials

SESSION_HEADER = "X-Egresswall-Session"
SESSION_SEGMENT = "session"
# A query value as a URL carries it: unreserved characters and %XX escapes (RFC 3986); no '+', whose
# meaning (a space, or a plus) depends on who reads it.
_QUERY_VALUE = re.compile(r"^(?:[A-Za-z0-9._~-]|%[0-9A-Fa-f]{2})+$")
_ESCAPE = re.compile(r"%([0-9A-Fa-f]{2})")
USAGE = ("connect to /session/<id>?secret=<secret>, or send the header X-Egresswall-Session: <id>:<secret>")


@dataclass(frozen=True)
class HandshakeRefusal:
    status: int
    reason: str


def is_session_path(path: str) -> bool:
    """The path's first segment is ``session``: the client meant a session, so it must be well formed."""
    base = path.split("?", 1)[0]
    return base == "/" + SESSION_SEGMENT or base.startswith("/" + SESSION_SEGMENT + "/")


def session_of_handshake(path: str, header_values: Sequence[str]) -> Credentials | HandshakeRefusal | None:
    """The session a handshake names (None: none, the connection runs as today), or why it is refused."""
    in_path = is_session_path(path)
    if in_path and header_values:
        return HandshakeRefusal(400, f"the session is given twice (in the path and in {SESSION_HEADER}); give it once")
    try:
        if in_path:
            return _from_path(path)
        if header_values:
            return _from_header(header_values)
    except CredentialsError as err:
        return HandshakeRefusal(400, f"{err.reason}; {USAGE}")
    return None


def _from_path(path: str) -> Credentials:
    base, _, query = path.partition("?")
    segments = base.split("/")[1:]  # ["session", id]
    if len(segments) != 2 or not segments[1]:
        raise CredentialsError("a session path is /session/<id> with nothing after the id")
    if not query:
        raise CredentialsError("the session path has no ?secret=")
    params = query.split("&")
    names = [p.partition("=")[0] for p in params]
    if names != ["secret"] or "=" not in params[0]:
        raise CredentialsError("the session path's query must be exactly secret=<secret> (once, nothing else)")
    value = params[0].partition("=")[2]
    if not _QUERY_VALUE.match(value):
        raise CredentialsError("the secret in the session path must be URL-encoded (letters, digits, '-', '.', "
                               "'_', '~' and %XX escapes)")
    return session_credentials(segments[1], _unescape(value), "the session path's id", "the session path's secret")


def _unescape(value: str) -> str:
    """%XX escapes decoded; an escape of a byte outside ASCII is refused (a secret is printable ASCII, and
    keeping the escape as text would make it another secret than the client meant)."""
    if any(int(code, 16) >= 0x80 for code in _ESCAPE.findall(value)):
        raise CredentialsError("the session path's secret holds an escape of a byte outside ASCII; a secret is "
                               "printable ASCII without spaces or control characters")
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), value)


def _from_header(values: Sequence[str]) -> Credentials:
    if len(values) != 1:
        raise CredentialsError(f"the handshake carries {len(values)} {SESSION_HEADER} headers; send one")
    session_id, colon, secret = values[0].strip(" \t").partition(":")
    if not colon:
        raise CredentialsError(f"{SESSION_HEADER} has no ':' between the session id and its secret")
    return session_credentials(session_id, secret, f"the session id in {SESSION_HEADER}",
                               f"the secret in {SESSION_HEADER}")


def session_proxy(proxy_server: str, credentials: Credentials) -> dict[str, str]:
    """A context's proxy option (Playwright's protocol): the browser's own proxy, with the session's
    credentials, which Chromium sends when the proxy's 407 asks for them. No ``bypass``: Playwright
    then adds ``<-loopback>`` itself, so loopback still goes through the proxy."""
    return {"server": proxy_server, "username": credentials.session_id, "password": credentials.secret}


def with_context_proxy(message: dict[str, Any], proxy: dict[str, str]) -> dict[str, Any]:
    """A ``Browser.newContext`` call with the server's proxy option set. The protocol filter has refused
    any ``proxy`` the client sent, so this is the only one."""
    params = message.get("params")
    return {**message, "params": {**(params if isinstance(params, dict) else {}), "proxy": dict(proxy)}}
