"""The answer egresswall sends instead of forwarding: always with a reason a human can read.

One rendering for both transports: ``refusal_parts`` gives the status, headers and body; the fast
front writes ``refusal_bytes``, the mitmproxy addons wrap the same parts in an ``http.Response``.
"""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus

from policy.decision import Verdict
from policy.wire import OWN_HEADER_PREFIX, REASON_HEADER, RULE_HEADER, RULE_ID_HEADER

from .records import rule_id_of

__all__ = ["OWN_HEADER_PREFIX", "Refusal", "refusal_bytes", "refusal_parts"]


@dataclass(frozen=True)
class Refusal:
    """What the client is answered instead of being forwarded; its record is already written."""

    status: int
    verdict: Verdict

    @property
    def size(self) -> int:
        """The bytes the answer takes on the wire (the record's ``bytes_down``)."""
        return len(refusal_bytes(self))


def one_line(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())
    text = text.encode("ascii", "backslashreplace").decode("ascii")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def refusal_parts(refusal: Refusal) -> tuple[int, list[tuple[str, str]], bytes]:
    verdict = refusal.verdict
    body = f"egresswall refused this request.\nrule: {verdict.rule}\nreason: {verdict.reason}\n".encode()
    headers = [("Content-Type", "text/plain; charset=utf-8"), ("Cache-Control", "no-store"),
               ("Connection", "close"), (REASON_HEADER, one_line(verdict.reason)),
               (RULE_HEADER, one_line(verdict.rule, 200)), (RULE_ID_HEADER, one_line(rule_id_of(verdict), 200))]
    return refusal.status, headers, body


def refusal_bytes(refusal: Refusal) -> bytes:
    status, headers, body = refusal_parts(refusal)
    phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "Refused"
    head = f"HTTP/1.1 {status} {phrase}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers)
    return (head + f"Content-Length: {len(body)}\r\n\r\n").encode("latin-1") + body
