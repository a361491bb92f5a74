"""The pure parts of a readable refusal: the Accept parser, the operator's hint, and both bodies."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policy.decision import Verdict
from policy.model import DENY, HostRule, Origin
from policy.patterns import HostPattern
from proxy.accept import MAX_ACCEPT, AcceptError, media_ranges, prefers_json
from proxy.hints import hint_for
from proxy.refusals import Refusal, one_line, refusal_bytes, refusal_parts

# ---- Accept -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("accept", "json_wanted"), [
    ("application/json", True),
    ("Application/JSON", True),
    ("application/problem+json", True),
    ("application/json, text/plain, */*", True),  # axios's default: JSON named, tie with text
    ("text/plain;q=0.9, application/json", True),
    ("application/json;q=0.5, */*;q=0.4", True),
    (" , application/json ;charset=utf-8 , ", True),
    ('application/json;profile="a,b";q=0.8', True),  # a comma inside a quoted parameter value
    ("text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8", False),  # a browser
    ("*/*", False),
    ("application/*", False),
    ("application/+json", False),
    ("application/json;q=0.5, text/plain", False),
    ("application/json;q=0.5, text/*;q=0.6", False),
    ("application/json;q=0", False),
    ("application/json;q=1.5", False),  # not a weight: the whole header is unreadable
    ("application/json;q=0.5;q=1", False),  # two weights
    ("application/json;q=0.1234", False),
    ("application/json garbage", False),
    ("*/json", False),
    ("", False),
])
def test_prefers_json(accept, json_wanted):
    assert prefers_json(accept) is json_wanted


def test_several_accept_headers_are_one_list():
    assert prefers_json(("text/plain;q=0.2", "application/json;q=0.3"))
    assert not prefers_json(("application/json;q=0.3", "text/plain;q=0.4"))
    assert not prefers_json(()) and not prefers_json(None)


def test_an_overlong_accept_is_not_read():
    with pytest.raises(AcceptError):
        media_ranges("application/json," + "a/b," * MAX_ACCEPT)
    assert not prefers_json("application/json," + "a/b," * MAX_ACCEPT)


TOKEN = st.text("abcdefghijklmnopqrstuvwxyz0123456789-.+", min_size=1, max_size=8)
WEIGHT = st.sampled_from(["0", "0.1", "0.5", "0.999", "1", "1.0", "1.000"])
RANGE = st.tuples(st.sampled_from(["application", "text", "image", "*"]),
                  st.one_of(TOKEN, st.sampled_from(["json", "plain", "*", "ld+json"])), st.none() | WEIGHT)


def _render(ranges) -> str:
    return ", ".join(f"{t}/{s}" + (f";q={w}" if w is not None else "") for t, s, w in ranges)


def _model(ranges) -> bool:
    """The rule of proxy/accept.py written out plainly, over ranges that are known to be valid."""
    weights = [(t, s, 1.0 if w is None else float(w)) for t, s, w in ranges]
    json_q = max((q for t, s, q in weights if t == "application" and (s == "json" or (
        s.endswith("+json") and s != "+json"))), default=0.0)
    text_q = 0.0
    for wanted in (("text", "plain"), ("text", "*"), ("*", "*")):
        found = [q for t, s, q in weights if (t, s) == wanted]
        if found:
            text_q = max(found)
            break
    return json_q > 0 and json_q >= text_q


@given(st.lists(RANGE.filter(lambda r: r[0] != "*" or r[1] == "*"), max_size=6))
def test_prefers_json_follows_the_documented_rule(ranges):
    assert prefers_json(_render(ranges)) is _model(ranges)


@given(st.lists(RANGE.filter(lambda r: r[0] != "*" or r[1] == "*"), max_size=6), st.randoms())
def test_the_order_of_ranges_does_not_matter(ranges, rnd):
    shuffled = list(ranges)
    rnd.shuffle(shuffled)
    assert prefers_json(_render(ranges)) is prefers_json(_render(shuffled))


@given(st.text(max_size=200))
def test_any_text_is_answered_without_an_error(text):
    assert prefers_json(text) in (True, False)


@given(st.lists(RANGE.filter(lambda r: r[0] != "*" or r[1] == "*"), max_size=4),
       st.sampled_from(["\x00", "application", "a/b;q=2", "a/b;=x", "a/b c", "(", '"']))
def test_one_unreadable_range_makes_the_whole_header_text(ranges, bad):
    assert not prefers_json(_render([("application", "json", None), *ranges]) + ", " + bad)


# ---- the hint -----------------------------------------------------------------------------------


def _deny_rule(pattern: str) -> HostRule:
    return HostRule(DENY, HostPattern.parse(pattern), Origin("policy.yaml", 7), id="no-paste")


@pytest.mark.parametrize(("verdict", "host", "port", "hint"), [
    (Verdict(False, "host", "default deny (policy.yaml:3)", "r", rule_id="default:deny"), "api.example.com", 443,
     "add api.example.com to hosts.allow"),
    (Verdict(False, "host", "default deny (policy.yaml:9)", "r", rule_id="roles.ci.default:deny"), "a.example", 443,
     "add a.example to hosts.allow of role ci"),
    (Verdict(False, "host", "policy.yaml:7", "r", matched=_deny_rule(".paste.example"), rule_id="no-paste"),
     "x.paste.example", 443,
     "this host is refused by deny rule .paste.example (policy.yaml:7); only editing that rule admits it"),
    (Verdict(False, "port", "ports.connect", "r"), "a.example", 8443,
     "port 8443 is not in ports.connect/ports.http (ports.connect decided); add it to ports.connect to allow it"),
    (Verdict(False, "address", "special-purpose 10.0.0.0/8", "r"), "a.example", 80,
     "this address is not global unicast (special-purpose 10.0.0.0/8); only an addresses.allow range re-admits it, a "
     "host allow rule cannot"),
    (Verdict(False, "address", "address-deny 198.18.0.0/15 (p.yaml:4)", "r", rule_id="addresses.deny:198.18.0.0/15"),
     "a.example", 80, "this address is refused by the address deny rule address-deny 198.18.0.0/15 (p.yaml:4); "
                      "only editing that rule admits it"),
    (Verdict(False, "address", "self", "r"), "a.example", 3128,
     "this is egresswall's own (a listener or its session store); a request to the proxy itself is never forwarded"),
    (Verdict(False, "resolve", "dns:nxdomain", "r"), "a.example", 443,
     "the name did not resolve (dns:nxdomain); check the name and the nameservers in resolver, or retry later"),
    (Verdict(False, "limits", "limits.max_connections_per_client", "r"), None, None, "retry later"),
    (Verdict(False, "limits", "shutdown", "r"), None, None, "retry later"),
    (Verdict(False, "limits", "limits.header_timeout", "r"), None, None, "retry later"),
    (Verdict(False, "limits", "limits.max_request_body", "r"), "a.example", 80,
     "the request is over limits.max_request_body; send less, or raise limits.max_request_body in the policy"),
    (Verdict(False, "form", "form:userinfo", "r"), None, None,
     "the request is malformed (form:userinfo); fix the client: no policy change admits it"),
    (Verdict(False, "form", "form:scheme", "r"), None, None,  # ftp:// is not malformed, just not proxied
     "only http, https, ws and wss are proxied; no policy change admits another scheme"),
])
def test_hint_for(verdict, host, port, hint):
    assert hint_for(verdict, host, port) == hint


def test_cloud_metadata_is_not_readmitted_by_addresses_allow():
    hint = hint_for(Verdict(False, "address", "cloud-metadata 169.254.169.254/32", "r"), "m.example", 80)
    assert "whatever addresses.allow says" in hint and "refuse_cloud_metadata is true" in hint


STAGES = st.sampled_from(["form", "scheme", "port", "host", "resolve", "address", "limits", "audit", "connect",
                          "http", "tls", "something-new"])


@given(STAGES, st.text(max_size=40), st.text(max_size=200), st.none() | st.text(max_size=40),
       st.none() | st.integers(0, 65535))
def test_the_hint_never_quotes_the_reason(stage, rule, reason, host, port):
    """The reason may quote the request; the hint is built from the rule and the target only."""
    marker = "\u2603REASON-ONLY\u2603"
    hint = hint_for(Verdict(False, stage, rule or "r", reason + marker), host, port)
    assert hint and marker not in hint


# ---- the bodies ---------------------------------------------------------------------------------


def test_json_body_and_text_body_say_the_same():
    verdict = Verdict(False, "host", "default deny (p.yaml:3)", "api.example.com is not on the allowlist",
                      rule_id="default:deny")
    status, headers, body = refusal_parts(Refusal(403, verdict, "api.example.com", 443, json=True))
    assert status == 403 and ("Content-Type", "application/json") in headers
    assert json.loads(body) == {"error": "refused", "status": 403, "stage": "host", "rule": "default deny (p.yaml:3)",
                                "rule_id": "default:deny", "reason": "api.example.com is not on the allowlist",
                                "host": "api.example.com", "port": 443, "hint": "add api.example.com to hosts.allow"}
    _, headers, text = refusal_parts(Refusal(403, verdict, "api.example.com", 443))
    assert ("Content-Type", "text/plain; charset=utf-8") in headers
    assert text.decode().splitlines() == ["egresswall refused this request.", "rule: default deny (p.yaml:3)",
                                          "reason: api.example.com is not on the allowlist",
                                          "hint: add api.example.com to hosts.allow"]


@given(st.text(max_size=100), st.booleans())
def test_size_is_the_bytes_written(reason, as_json):
    refusal = Refusal(403, Verdict(False, "form", "form:space", reason), None, None, json=as_json)
    assert refusal.size == len(refusal_bytes(refusal))
    body = refusal_bytes(refusal).partition(b"\r\n\r\n")[2]
    if as_json:
        assert body.isascii() and json.loads(body)["reason"] == reason


def test_a_refusal_by_an_allow_rule_s_conditions_points_at_that_rule_not_at_adding_the_host():
    """``check --method post http://api.example.com/`` where api.example.com allows only GET said "add
    api.example.com to hosts.allow": followed, lint flags the new entry as shadowed and the request is still
    refused (review round 16). The decision keeps the rule that named the host, and the hint points at it."""
    from policy.decision import Request, precheck
    from policy.hosts import parse_url
    from policy.loader import parse_policy

    policy = parse_policy("version: 1\ndefault: deny\nhosts:\n  allow:\n    - host: api.example.com\n"
                          "      methods: [GET]\n    - host: docs.example.com\n      ports: [443]\n", "live.yaml")
    for url, method, where in (("http://api.example.com/v1", "POST", "live.yaml:5"),
                               ("http://docs.example.com/", "GET", "live.yaml:7")):
        verdict = precheck(policy, Request(parse_url(url), method, "10.0.0.1"))
        assert not verdict.allowed and verdict.rule_id == "default:deny"
        host = parse_url(url).host
        assert hint_for(verdict, host, 80) == (f"rule {host} ({where}) names {host} but does not allow this request; "
                                               "change that rule's conditions to admit it")
    other = precheck(policy, Request(parse_url("http://other.example.com/"), "GET", "10.0.0.1"))
    assert hint_for(other, "other.example.com", 80) == "add other.example.com to hosts.allow"


@pytest.mark.parametrize("host, says", [
    ("169.254.169.254", "add 169.254.169.254 to hosts.allow; but 169.254.169.254 is a cloud metadata address "
                        "(cloud-metadata 169.254.169.254/32), which no host rule admits"),
    ("10.0.0.5", "add 10.0.0.5 to hosts.allow, and re-admit it with an addresses.allow range: it is not global "
                 "unicast (special-purpose 10.0.0.0/8)"),
    ("8.8.8.8", "add 8.8.8.8 to hosts.allow"),
    ("a.example", "add a.example to hosts.allow"),
])
def test_a_default_deny_hint_for_an_address_the_address_rules_refuse_says_so(host, says):
    """'add 169.254.169.254 to hosts.allow' was followed by a refusal by cloud-metadata: a hint that could never work
    (a newcomer's review, round 17)."""
    verdict = Verdict(False, "host", "default deny (p.yaml:2)", "matches no rule", rule_id="default:deny")
    assert hint_for(verdict, host, 80) == says


@given(st.text(max_size=40))
def test_one_line_is_one_printable_ascii_line(text):
    assert one_line(text).isascii() and one_line(text).isprintable()


def test_one_line_keeps_a_backslash_as_the_record_has_it():
    """The header says what the record's reason says (tests/test_host_form_parity.py compares them)."""
    assert one_line("a\x1bb") == "a\\x1bb"
    assert one_line("a\\x82b") == "a\\x82b"


def test_one_line_escapes_the_whitespace_that_is_no_ascii_space():
    """VT, FF, the separators \\x1c-\\x1f and Unicode spaces read as a space before (str.split took them in):
    escaped, so a reason quoting one does not read as one quoting a space (review round 22, second pass)."""
    assert one_line("a\x0bb\x0cc\x1cd\x85e\u2028f") == "a\\x0bb\\x0cc\\x1cd\\x85e\\u2028f"
    assert one_line("  a \t\r\n b  ") == "a b"
