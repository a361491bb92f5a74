"""Review round 21, "records": the text refusal's body is written as its headers are, whatever the verdict quotes.

A refusal's rule and reason may quote what a client sent: a byte mitmproxy decoded with surrogateescape (a lone
surrogate), a line end, an escape sequence. ``refusal_parts`` passed them into the text body as they were, so a
lone surrogate raised UnicodeEncodeError while the answer was being built (no answer, a traceback) and a line end
added a line of the client's to the body's four (README, *Refusals an agent can read*: the body's `rule`, `reason`
and `hint` lines). The body now writes each line as its ``X-Egresswall-*`` header writes it (``one_line``).
"""

from __future__ import annotations

import pytest

from policy.decision import Verdict
from proxy.refusals import Refusal, refusal_bytes, refusal_parts

HOSTILE = [
    "a lone surrogate \udcff from a byte mitmproxy decoded",
    "a line end\r\nX-Injected: 1\nrule: forged",
    "an escape \x1b[31m and a NUL \x00",
    "non-ASCII caf\u00e9 \u2028 and an astral \U0001f600",
]


def text_body(rule: str, reason: str) -> tuple[list[tuple[str, str]], bytes]:
    _, headers, body = refusal_parts(Refusal(400, Verdict(False, "form", rule, reason)))
    return headers, body


@pytest.mark.parametrize("reason", HOSTILE)
def test_a_hostile_reason_makes_a_four_line_ascii_body_as_its_header_has_it(reason):
    headers, body = text_body("http:malformed", reason)
    lines = body.decode("ascii").split("\n")
    assert lines[-1] == "" and len(lines) == 5, body  # four lines, each ended
    assert [line.split(":", 1)[0] for line in lines[1:4]] == ["rule", "reason", "hint"], body
    assert all(0x20 <= byte < 0x7f for line in lines for byte in line.encode()), body
    assert lines[2] == "reason: " + dict(headers)["X-Egresswall-Reason"], (body, headers)


@pytest.mark.parametrize("rule", HOSTILE)
def test_a_hostile_rule_makes_a_four_line_ascii_body_too(rule):
    headers, body = text_body(rule, "a reason")
    lines = body.decode("ascii").split("\n")
    assert len(lines) == 5 and lines[1] == "rule: " + dict(headers)["X-Egresswall-Rule"], (body, headers)


def test_a_refusal_quoting_a_lone_surrogate_has_a_size_and_bytes():
    """``Refusal.size`` is the record's bytes_down, computed before anything is sent: it must not raise either."""
    refusal = Refusal(400, Verdict(False, "form", "form:host-header", "the Host header 'a\udcffb' is refused"))
    assert refusal.size == len(refusal_bytes(refusal))
    assert b"a\\udcffb" in refusal_bytes(refusal)


def test_the_json_body_of_the_same_verdict_is_ascii_holds():
    refusal = Refusal(400, Verdict(False, "form", "http:malformed", HOSTILE[0] + HOSTILE[1]), json=True)
    _, _, body = refusal_parts(refusal)
    assert body.isascii() and body.count(b"\n") == 1, body
