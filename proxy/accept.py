"""Whether a client prefers a JSON answer, from its ``Accept`` header (RFC 9110, 12.5.1), strictly.

Only refusals use this: egresswall answers JSON when the client names JSON explicitly and weighs it
at least as high as plain text, and plain text otherwise. The rules, in full:

* a JSON range is ``application/json`` or ``application/<anything>+json`` named explicitly;
  ``*/*`` and ``application/*`` do not count (a browser's default Accept gets text);
* its weight is its ``q`` (1 when absent); text's weight is the ``q`` of the most specific range that
  matches ``text/plain`` (``text/plain``, else ``text/*``, else ``*/*``; 0 when none does);
* JSON is preferred when its best weight is above 0 and not below text's: a tie goes to JSON, since
  naming it is a stronger wish than ``*/*`` (``application/json, text/plain, */*`` gets JSON);
* an Accept that does not parse as RFC 9110 media ranges with valid weights, or is longer than
  ``MAX_ACCEPT`` characters, counts as no preference at all (text): a header egresswall cannot read
  is never guessed at.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from policy.wire import TCHAR

MAX_ACCEPT = 4096
_TOKEN = TCHAR + "+"
_QUOTED = r'"(?:[\t !#-\[\]-~\x80-\xff]|\\[\t -~\x80-\xff])*"'
_PARAM = re.compile(rf"[ \t]*;[ \t]*({_TOKEN})=({_TOKEN}|{_QUOTED})")
_RANGE = re.compile(rf"({_TOKEN})/({_TOKEN})")
_LEAD = re.compile(r"[ \t,]*")  # optional whitespace and empty list elements (RFC 9110, 5.6.1)
_AFTER = re.compile(r"[ \t]*(?:,[ \t,]*|\Z)")
_WEIGHT = re.compile(r"0(?:\.[0-9]{0,3})?|1(?:\.0{0,3})?")


class AcceptError(ValueError):
    """The Accept value is not a list of media ranges egresswall can read."""


def media_ranges(accept: str) -> list[tuple[str, str, float]]:
    """(type, subtype, q) of each media range, lower-cased; AcceptError when anything does not parse."""
    if len(accept) > MAX_ACCEPT:
        raise AcceptError(f"the Accept header is over {MAX_ACCEPT} characters")
    ranges: list[tuple[str, str, float]] = []
    pos = _LEAD.match(accept).end()  # type: ignore[union-attr]  # always matches
    while pos < len(accept):
        found = _RANGE.match(accept, pos)
        if found is None:
            raise AcceptError(f"no media range at character {pos}")
        kind, sub = found.group(1).lower(), found.group(2).lower()
        if kind == "*" and sub != "*":
            raise AcceptError(f"{kind}/{sub} is not a media range")
        pos, q, seen_q = found.end(), 1.0, False
        while (param := _PARAM.match(accept, pos)) is not None:
            pos = param.end()
            if param.group(1).lower() == "q":
                if seen_q or not _WEIGHT.fullmatch(param.group(2)):
                    raise AcceptError(f"the weight q={param.group(2)[:20]} is not valid")
                q, seen_q = float(param.group(2)), True
        ranges.append((kind, sub, q))
        after = _AFTER.match(accept, pos)
        if after is None:
            raise AcceptError(f"unexpected text at character {pos}")
        pos = after.end()
    return ranges


def _is_json(kind: str, sub: str) -> bool:
    return kind == "application" and (sub == "json" or (sub.endswith("+json") and len(sub) > len("+json")))


def prefers_json(accept_values: Iterable[str] | str | None) -> bool:
    """True when the client's Accept (one value, or each Accept header of the request) prefers JSON."""
    if accept_values is None:
        return False
    values = [accept_values] if isinstance(accept_values, str) else list(accept_values)
    if not values:
        return False
    try:
        ranges = media_ranges(",".join(values))
    except AcceptError:
        return False
    json_q = max((q for kind, sub, q in ranges if _is_json(kind, sub)), default=0.0)
    text_q = 0.0
    for wanted in (("text", "plain"), ("text", "*"), ("*", "*")):
        weights = [q for kind, sub, q in ranges if (kind, sub) == wanted]
        if weights:
            text_q = max(weights)
            break
    return json_q > 0 and json_q >= text_q
