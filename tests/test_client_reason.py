"""What a client reads of an address refusal (policy/wire.py client_reason): the rule, never the address its name
resolved to (review round 23: a page could read internal addresses off its own refusals); the decision itself,
and what the audit record keeps, are unchanged."""

from __future__ import annotations

import ipaddress

from hypothesis import given
from hypothesis import strategies as st

from policy.decision import Request, decide_addresses, precheck
from policy.hosts import parse_url
from policy.loader import parse_policy
from policy.wire import client_reason

POLICY = parse_policy("version: 1\ndefault: allow\naddresses:\n  deny:\n    - 203.0.113.0/24\n", "policy.yaml")
ADDRESSES = st.one_of(st.ip_addresses(v=4), st.ip_addresses(v=6)).map(str)


@given(address=ADDRESSES)
def test_an_address_refusal_of_a_name_never_says_the_address(address):
    request = Request(parse_url("http://leak.example/"), "GET", "127.0.0.1")
    verdict = decide_addresses(POLICY, precheck(POLICY, request), [address], [])
    shown = client_reason(verdict.stage, verdict.rule, verdict.reason, "leak.example")
    if verdict.stage == "address":
        # (The rule may name a well-known block of one address — 0.0.0.0/32, a cloud metadata address — which is
        # what refused it; the address the name resolved to is said nowhere else.)
        rest = shown.replace(verdict.rule, "")
        assert address not in rest and str(ipaddress.ip_address(address).exploded) not in rest
        assert verdict.rule in shown and "leak.example" in shown
    else:
        assert shown == verdict.reason


def test_a_literal_address_the_client_sent_is_said_as_it_is():
    for host in ("10.0.0.5", "[::1]", "::1"):
        assert client_reason("address", "special-purpose 10.0.0.0/8", "10.0.0.5 is in 10.0.0.0/8", host) == (
            "10.0.0.5 is in 10.0.0.0/8")


def test_other_stages_are_said_whole():
    reason = "api.example.com is not on the allowlist (the policy denies by default)"
    assert client_reason("host", "default deny (policy.yaml:3)", reason, "api.example.com") == reason


def test_the_refusal_the_proxy_sends_carries_the_client_reason():
    from proxy.refusals import Refusal, refusal_parts

    request = Request(parse_url("http://leak.example/"), "GET", "127.0.0.1")
    verdict = decide_addresses(POLICY, precheck(POLICY, request), ["10.1.2.3"], [])
    assert "10.1.2.3" in verdict.reason  # the record's
    for json in (False, True):
        _, headers, body = refusal_parts(Refusal(403, verdict, "leak.example", 80, json=json))
        assert b"10.1.2.3" not in body and all("10.1.2.3" not in value for _, value in headers)


@given(address=ADDRESSES, port=st.integers(1, 65535), bracketed=st.booleans())
def test_any_other_reason_of_a_name_has_its_addresses_written_as_address(address, port, bracketed):
    """A failed connect's reason ("connect to 10.1.2.3:443 failed: Connection refused", the front's and mitmproxy's
    words) names the address the name resolved to: the client reads ``[address]`` in its place (review round 23b)."""
    shown_address = f"[{address}]" if bracketed or ":" in address else address
    reason = f"connect to {shown_address}:{port} failed: Connection refused"
    shown = client_reason("connect", "connect", reason, "leak.example")
    assert address not in shown and "[address]" in shown and f":{port} failed" in shown
    assert client_reason("connect", "connect", reason, address) == reason  # a literal the client sent: as it is


def test_times_and_words_with_colons_are_left_alone():
    for reason in ("the upstream answered at 12:30:45", "session:budget-requests", "tls:sni does not match a:b"):
        assert client_reason("connect", "connect", reason, "leak.example") == reason


def test_a_refused_alias_is_named_by_its_rule_not_its_name():
    """A CNAME chain an internal resolver answers may name internal hosts: the client reads the rule that refused
    the alias, not the alias (review round 23b); a DNS failure's own reason is said whole."""
    policy = parse_policy("version: 1\ndefault: allow\nhosts:\n  deny:\n    - '*.corp.example'\n", "policy.yaml")
    request = Request(parse_url("http://leak.example/"), "GET", "127.0.0.1")
    verdict = decide_addresses(policy, precheck(policy, request), ["198.51.100.7"], ["db7.corp.example."])
    assert verdict.stage == "resolve" and "db7.corp.example" in verdict.reason  # the record's
    shown = client_reason(verdict.stage, verdict.rule, verdict.reason, "leak.example")
    assert "db7" not in shown and verdict.rule in shown and "alias (CNAME)" in shown
    timeout = "DNS lookup of leak.example timed out after 1s"
    assert client_reason("resolve", "dns:timeout", timeout, "leak.example") == timeout


def test_the_upstream_proxys_own_failure_names_it():
    """In upstream mode the failure is the operator's upstream proxy's (README: "the reason names it"), never the
    target name's address (egresswall does not connect to that): said whole."""
    reason = "the upstream proxy http://127.0.0.1:3129 did not open the tunnel within 1s"
    assert client_reason("connect", "connect:upstream", reason, "public.example") == reason
