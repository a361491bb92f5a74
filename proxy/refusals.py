"""The answer egresswall sends instead of forwarding: always with a reason a human can read.

One rendering for both transports: ``refusal_parts`` gives the status, headers and body; the fast
front writes ``refusal_bytes``, the mitmproxy addons wrap the same parts in an ``http.Response``.

Two bodies: plain text (the default) and, for a client whose ``Accept`` prefers JSON
(``proxy/accept.py``), one JSON object with the fields the README documents (*Refusals an agent can
read*). Which one is chosen when the Refusal is built (``json``), not when it is written: the gate
records ``Refusal.size`` as the record's ``bytes_down`` before a transport sends anything, so the size
and the body sent must come from the same choice. Every word of either body comes from the verdict,
the target egresswall parsed and the hint (``proxy/hints.py``) — nothing an upstream server said.
"""

from __future__ import annotations

import json as jsonlib
import re
from dataclasses import dataclass
from http import HTTPStatus

from policy.decision import Verdict
from policy.wire import OWN_HEADER_PREFIX, REASON_HEADER, RULE_HEADER, RULE_ID_HEADER, UPSTREAM_PROXY_RULE
from policy.wire import client_reason as wire_client_reason

from .hints import hint_for
from .records import rule_id_of

__all__ = ["OWN_HEADER_PREFIX", "UNRELAYABLE_RESPONSE", "Refusal", "refusal_bytes", "refusal_parts"]


@dataclass(frozen=True)
class Refusal:
    """What the client is answered instead of being forwarded; its record is already written."""

    status: int
    verdict: Verdict
    host: str | None = None  # the target, when egresswall parsed one (None: a refusal before any target)
    port: int | None = None
    json: bool = False  # the client's Accept prefers JSON: the body is the JSON object, else plain text

    @property
    def hint(self) -> str:
        return hint_for(self.verdict, self.host, self.port)

    @property
    def size(self) -> int:
        """The bytes the answer takes on the wire (the record's ``bytes_down``)."""
        return len(refusal_bytes(self))


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# The whitespace a line's runs are made of: ASCII's own (str.split's would take in VT, FF, \x1c-\x1f and Unicode
# spaces too, and a reason quoting one would read as one quoting a space; those are escaped instead).
_SPACES = re.compile(r"[ \t\r\n]+")


def one_line(text: str, limit: int = 400) -> str:
    """Text for a refusal's header or body line: one line of printable ASCII (whitespace runs become one space,
    other characters escaped, a control byte too: a NUL or an escape sequence a verdict quotes stays inert). A
    backslash stays as it is: a header says what the record's reason says, and a reason quotes client bytes as
    Python's repr does (a backslash they hold is doubled there already)."""
    text = _SPACES.sub(" ", text).strip(" ")
    text = text.encode("ascii", "backslashreplace").decode("ascii")
    text = _CONTROL.sub(lambda found: f"\\x{ord(found.group()):02x}", text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# The reason a response that cannot be read is refused with, on both transports: its parser's words quote the
# upstream's bytes, so they go to the record only (nothing an upstream sent reaches a refusal).
CONNECT_UPSTREAM = UPSTREAM_PROXY_RULE  # a connect through the policy's upstream proxy failed (its own hint)


def failed_connect(reason: str, role: str | None = None, via_upstream: bool = False) -> Verdict:
    """The verdict of a connect that failed: to the checked address (``connect``), or, where the policy names an
    upstream proxy, to that proxy (``connect:upstream``: no checked address was connected to, and the hint says so)."""
    return Verdict(False, "connect", CONNECT_UPSTREAM if via_upstream else "connect", reason, role=role)


UNRELAYABLE_RESPONSE = "egresswall could not relay the upstream's response (the audit record's error says why)"
ERROR_CODES = {"form": "malformed", "limits": "limited", "audit": "unavailable", "connect": "unavailable",
               "internal": "unavailable"}
PROXY_AUTHENTICATE = 'Basic realm="egresswall", charset="UTF-8"'  # with every 407: present a session


def error_code(refusal: Refusal) -> str:
    """The JSON body's ``error``: ``refused`` for a policy or session decision; ``malformed``, ``limited`` (a
    cap, a timeout, a size bound), ``unavailable`` (the audit log, a failed connect, the session store) or
    ``unauthenticated`` (407: no session, or not this one) for the rest."""
    if refusal.verdict.stage == "session" and refusal.status in (407, 503):
        return "unauthenticated" if refusal.status == 407 else "unavailable"
    return ERROR_CODES.get(refusal.verdict.stage, "refused")


def client_reason(refusal: Refusal) -> str:
    """The reason the client reads (``policy.wire.client_reason``: an address refusal of a name does not say the
    address)."""
    verdict = refusal.verdict
    return wire_client_reason(verdict.stage, verdict.rule, verdict.reason, refusal.host)


def refusal_json(refusal: Refusal) -> dict[str, object]:
    verdict = refusal.verdict
    return {"error": error_code(refusal), "status": refusal.status, "stage": verdict.stage, "rule": verdict.rule,
            "rule_id": rule_id_of(verdict), "reason": client_reason(refusal), "host": refusal.host,
            "port": refusal.port, "hint": refusal.hint}


def refusal_parts(refusal: Refusal) -> tuple[int, list[tuple[str, str]], bytes]:
    verdict = refusal.verdict
    if refusal.json:
        # ensure_ascii: any byte the verdict quotes from the request arrives escaped, never raw.
        body = (jsonlib.dumps(refusal_json(refusal), ensure_ascii=True) + "\n").encode()
        kind = "application/json"
    else:
        # Each line as its header has it (``one_line``): the rule and reason may quote what a client sent (a line
        # end would add a line of its own, a lone surrogate of a byte mitmproxy decoded could not be encoded).
        lines = ("egresswall refused this request.", f"rule: {one_line(verdict.rule, 200)}",
                 f"reason: {one_line(client_reason(refusal))}", f"hint: {one_line(refusal.hint)}")
        body = "".join(f"{line}\n" for line in lines).encode("ascii", "backslashreplace")
        kind = "text/plain; charset=utf-8"
    # (No X-Content-Type-Options: nosniff: Chromium's opaque-response blocking then drops a refused subresource's
    # answer before a page reader sees its X-Egresswall headers — browse lost its refused requests' reasons.)
    headers = [("Content-Type", kind), ("Cache-Control", "no-store"),
               ("Connection", "close"), (REASON_HEADER, one_line(client_reason(refusal))),
               (RULE_HEADER, one_line(verdict.rule, 200)), (RULE_ID_HEADER, one_line(rule_id_of(verdict), 200))]
    if refusal.status == 407:
        headers.append(("Proxy-Authenticate", PROXY_AUTHENTICATE))
    return refusal.status, headers, body


def refusal_bytes(refusal: Refusal) -> bytes:
    status, headers, body = refusal_parts(refusal)
    phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "Refused"
    head = f"HTTP/1.1 {status} {phrase}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers)
    return (head + f"Content-Length: {len(body)}\r\n\r\n").encode("latin-1") + body
