"""``Proxy-Authorization: Basic`` parsed strictly: the session id and secret a client presents. Pure.

RFC 9110 11.6.2 and RFC 7617: ``Basic`` (any case), one or more spaces, then the base64 of
``user-id ":" password``. Here the user id is a session id (``policy/sessions.py``) and the password its
secret. Anything else is refused with a reason, never guessed at: two headers, another scheme, base64
with stray characters or missing padding, bytes that are not UTF-8, no colon, an id of other characters.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Sequence
from dataclasses import dataclass

from .sessions import SESSION_ID

MAX_VALUE = 1024
_VALUE = re.compile(r"\A([A-Za-z]+) +([A-Za-z0-9+/]+={0,2})\Z")
# \Z, not "$": "$" also matches before a trailing newline, which would be let into the secret.
_SECRET = re.compile(r"\A[\x21-\x7e]{1,256}\Z")  # printable ASCII, no spaces: what the API hands out and more


@dataclass(frozen=True)
class Credentials:
    session_id: str
    secret: str

    def __repr__(self) -> str:  # a secret never ends up in a log by way of a repr
        return f"Credentials(session_id={self.session_id!r}, secret=<hidden>)"


class CredentialsError(ValueError):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def parse_proxy_authorization(values: Sequence[str]) -> Credentials | None:
    """The credentials in the request's Proxy-Authorization header values; None when there is none."""
    if not values:
        return None
    if len(values) > 1:
        raise CredentialsError(f"the request carries {len(values)} Proxy-Authorization headers; send one")
    value = values[0].strip(" \t")
    if len(value) > MAX_VALUE:
        raise CredentialsError(f"the Proxy-Authorization header is over {MAX_VALUE} characters")
    match = _VALUE.match(value)
    if match is None:
        raise CredentialsError("the Proxy-Authorization header is not 'Basic <base64 of session-id:secret>'")
    if match.group(1).lower() != "basic":
        raise CredentialsError(f"the Proxy-Authorization scheme {match.group(1)[:20]!r} is not Basic; egresswall "
                               "takes 'Basic <base64 of session-id:secret>'")
    token = match.group(2)
    try:
        decoded = base64.b64decode(token, validate=True)
    except (binascii.Error, ValueError):
        raise CredentialsError("the Proxy-Authorization credentials are not valid base64") from None
    if base64.b64encode(decoded).decode("ascii") != token:  # non-canonical padding bits: two texts, one value
        raise CredentialsError("the Proxy-Authorization credentials are not canonical base64")
    try:
        text = decoded.decode("utf-8")
    except UnicodeDecodeError:
        raise CredentialsError("the Proxy-Authorization credentials are not UTF-8") from None
    session_id, colon, secret = text.partition(":")
    if not colon:
        raise CredentialsError("the Proxy-Authorization credentials have no ':' between session id and secret")
    return session_credentials(session_id, secret, "the Proxy-Authorization user", "the Proxy-Authorization secret")


def session_credentials(session_id: str, secret: str, id_name: str = "the session id",
                        secret_name: str = "the session secret") -> Credentials:
    """A session id and secret checked by the rules the proxy reads them with (wherever they came from: a
    Proxy-Authorization header, a browser server's session URL); CredentialsError names what is wrong."""
    if not SESSION_ID.match(session_id):
        raise CredentialsError(f"{id_name} is not a session id (1-64 letters, digits, '_', '-')")
    if not _SECRET.match(secret):
        raise CredentialsError(f"{secret_name} is empty, too long or holds spaces or control characters")
    return Credentials(session_id, secret)


def basic_value(session_id: str, secret: str) -> str:
    """The header value a client sends for a session (the admin API hands it out ready to use)."""
    return "Basic " + base64.b64encode(f"{session_id}:{secret}".encode()).decode("ascii")
