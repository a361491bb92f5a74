"""The decision function: order of checks, host patterns, rule conditions, roles, report mode, and the
rule that every resolved address must pass. Pure: no DNS, no sockets."""

from __future__ import annotations

import ipaddress
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from policy.addresses import CLOUD_METADATA, SPECIAL_PURPOSE_V4, SPECIAL_PURPOSE_V6
from policy.decision import (
    ADDRESS,
    FORM,
    HOST,
    PORT,
    RESOLVE,
    SCHEME,
    Request,
    Resolution,
    Verdict,
    decide,
    decide_addresses,
    precheck,
    refuse_form,
)
from policy.hosts import HostFormError, Target, parse_authority, parse_url
from policy.loader import Overrides, parse_policy
from policy.model import Policy
from policy.patterns import HostIndex, HostPattern

PUBLIC_V4, PUBLIC_V4_B, PUBLIC_V6 = "93.184.216.34", "1.1.1.1", "2606:2800:220:1:248:1893:25c8:1946"


def policy(text: str, source: str = "p.yaml", **overrides) -> Policy:
    return parse_policy("version: 1\n" + text, source, Overrides(**overrides) if overrides else None)


def url(text: str, **kwargs) -> Request:
    return Request(parse_url(text), **kwargs)


def connect(authority: str, **kwargs) -> Request:
    return Request(parse_authority(authority), method="CONNECT", tunnel=True, **kwargs)


def check(pol: Policy, text: str, addresses: tuple[str, ...] = (PUBLIC_V4,), cnames: tuple[str, ...] = (),
          **kwargs):
    """The whole path as the proxy runs it: parse, precheck, (resolve), decide."""
    try:
        request = url(text, **kwargs)
    except HostFormError as err:
        return refuse_form(err)
    return decide(pol, request, Resolution(request.target.host, addresses, cnames))


# --- order of checks -----------------------------------------------------------------------------------

ORDER = """\
default: deny
hosts:
  deny:
    - bad.example.com
  allow:
    - .example.com
    - bad.example.com
ports:
  http: [80]
  connect: [443]
"""


def test_form_is_checked_first() -> None:
    # userinfo on a denied host on a bad port: the form refusal wins.
    verdict = check(policy(ORDER), "http://user@bad.example.com:9999/")
    assert (verdict.allowed, verdict.stage, verdict.rule) == (False, FORM, "form:userinfo")


def test_scheme_before_port_and_host() -> None:
    verdict = precheck(policy(ORDER), Request(Target("ftp", "bad.example.com", 21, "/")))
    assert (verdict.allowed, verdict.stage, verdict.rule) == (False, SCHEME, "scheme")
    assert "'ftp'" in verdict.reason


def test_port_before_host_deny() -> None:
    verdict = check(policy(ORDER), "http://bad.example.com:8080/")
    assert (verdict.allowed, verdict.stage, verdict.rule) == (False, PORT, "ports.http")
    assert verdict.reason == "port 8080 is not an allowed plain-HTTP port (allowed: 80)"
    tunnel = precheck(policy(ORDER), connect("bad.example.com:8443"))
    assert (tunnel.stage, tunnel.rule) == (PORT, "ports.connect")
    assert "not an allowed CONNECT port (allowed: 443)" in tunnel.reason


def test_plain_http_to_443_is_not_a_connect_port() -> None:
    verdict = check(policy(ORDER), "http://a.example.com:443/")
    assert (verdict.allowed, verdict.stage) == (False, PORT)


def test_host_deny_before_allow() -> None:
    pol = policy(ORDER)
    verdict = check(pol, "http://bad.example.com/")
    assert (verdict.allowed, verdict.stage, verdict.rule) == (False, HOST, "p.yaml:5")
    assert verdict.reason == "bad.example.com is refused by deny rule bad.example.com"


def test_host_refusal_before_addresses() -> None:
    verdict = check(policy(ORDER), "http://bad.example.com/", addresses=("10.0.0.1",))
    assert verdict.stage == HOST and verdict.addresses == ()


def test_address_check_last() -> None:
    verdict = check(policy(ORDER), "http://a.example.com/", addresses=("10.0.0.1",))
    assert (verdict.allowed, verdict.stage, verdict.rule) == (False, ADDRESS, "special-purpose 10.0.0.0/8")


def test_refused_name_needs_no_resolution() -> None:
    pol = policy(ORDER)
    for request in (url("http://bad.example.com/"), url("http://elsewhere.example.org/"),
                    url("http://a.example.com:8080/"), connect("bad.example.com:443")):
        verdict = precheck(pol, request)
        assert not verdict.allowed
        assert verdict.needs_resolution is False
    allowed = precheck(pol, url("http://a.example.com/"))
    assert allowed.allowed and allowed.needs_resolution is True


def test_ip_literal_is_decided_without_resolution() -> None:
    pol = policy("default: allow\n")
    public = precheck(pol, url(f"http://{PUBLIC_V4}/"))
    assert public.allowed and public.needs_resolution is False
    assert public.addresses == (PUBLIC_V4,) and public.pinned == PUBLIC_V4
    private = precheck(pol, url("http://[::ffff:127.0.0.1]/"))
    assert not private.allowed and private.stage == ADDRESS and "127.0.0.0/8" in private.rule
    # decide() needs no Resolution for a literal
    assert decide(pol, url("http://10.1.2.3/")).stage == ADDRESS


def test_name_without_resolution_is_refused() -> None:
    verdict = decide(policy("default: allow\n"), url("http://a.example.com/"))
    assert (verdict.allowed, verdict.stage, verdict.rule) == (False, RESOLVE, "dns:unresolved")


def test_empty_answer_is_refused() -> None:
    verdict = check(policy("default: allow\n"), "http://a.example.com/", addresses=())
    assert (verdict.allowed, verdict.stage, verdict.rule) == (False, RESOLVE, "dns:empty")


# --- default allow and deny ----------------------------------------------------------------------------

def test_default_allow() -> None:
    body = "default: allow\nhosts:\n  deny: [blocked.example.com]\n"
    verdict = check(policy(body), "https://anything.example.org/")
    assert verdict.allowed and verdict.stage == HOST
    assert verdict.rule == "default allow (p.yaml:2)"
    assert verdict.reason == "anything.example.org matches no rule and the policy allows by default"
    assert verdict.pinned == PUBLIC_V4
    assert not check(policy(body), "https://blocked.example.com/").allowed


def test_default_deny() -> None:
    body = "default: deny\nhosts:\n  allow: [ok.example.com]\n"
    refused = check(policy(body), "https://other.example.com/")
    assert (refused.allowed, refused.rule) == (False, "default deny (p.yaml:2)")
    assert refused.reason == "other.example.com is not on the allowlist (the policy denies by default)"
    assert check(policy(body), "https://ok.example.com/").allowed


def test_missing_default_is_deny() -> None:
    verdict = check(policy("hosts:\n  allow: [ok.example.com]\n"), "https://other.example.com/")
    assert not verdict.allowed and verdict.rule == "default deny (p.yaml (built-in default))"


def test_default_override_names_the_flag() -> None:
    verdict = check(policy("default: allow\n", default="deny"), "https://a.example.com/")
    assert not verdict.allowed and verdict.rule == "default deny (--default)"


# --- host patterns -------------------------------------------------------------------------------------

@pytest.mark.parametrize("pattern, host, matches", [
    ("example.com", "example.com", True),
    ("example.com", "www.example.com", False),
    ("*.example.com", "example.com", False),
    ("*.example.com", "www.example.com", True),
    ("*.example.com", "a.b.example.com", True),
    (".example.com", "example.com", True),
    (".example.com", "www.example.com", True),
    (".example.com", "a.b.example.com", True),
    (".example.com", "badexample.com", False),  # a suffix, but not at a label boundary
    ("*.example.com", "badexample.com", False),
    ("example.com", "example.com.evil.net", False),
    (".example.com", "example.com.evil.net", False),
    ("EXAMPLE.com.", "example.com", True),  # patterns are normalised like hosts
    ("bücher.example", "xn--bcher-kva.example", True),
    (".com", "example.com", True),
])
def test_pattern_semantics(pattern: str, host: str, matches: bool) -> None:
    pol = policy(f"default: deny\nhosts:\n  allow:\n    - '{pattern}'\n")
    assert HostPattern.parse(pattern).matches(host) is matches
    assert check(pol, f"https://{host}/").allowed is matches


def test_ip_pattern_is_exact() -> None:
    pol = policy("default: deny\nhosts:\n  allow: ['93.184.216.34']\n")
    assert precheck(pol, url(f"http://{PUBLIC_V4}/")).allowed
    assert not precheck(pol, url(f"http://{PUBLIC_V4_B}/")).allowed


# --- rule conditions -----------------------------------------------------------------------------------

CONDITIONS = """\
default: deny
ports:
  http: [80, 8080]
  connect: [443, 8443]
hosts:
  allow:
    - host: ports.example.com
      ports: [8080, 8443]
    - host: schemes.example.com
      schemes: [https]
    - host: methods.example.com
      methods: [GET, HEAD]
    - host: prefix.example.com
      paths: [/docs/, /static/]
    - host: glob.example.com
      paths: ['/api/*/read']
    - host: nows.example.com
      websocket: false
    - host: ws.example.com
      schemes: [ws, wss]
"""


@pytest.fixture(scope="module")
def conditions() -> Policy:
    return policy(CONDITIONS)


@pytest.mark.parametrize("target, allowed", [
    ("http://ports.example.com:8080/", True),
    ("http://ports.example.com/", False),
    ("https://ports.example.com:8443/", True),
    ("https://schemes.example.com/", True),
    ("http://schemes.example.com/", False),
    ("http://prefix.example.com/docs/a/b", True),
    ("http://prefix.example.com/docs/", True),
    ("http://prefix.example.com/docs", False),
    ("http://prefix.example.com/docs/?q=1", True),
    ("http://prefix.example.com/static/x.css", True),
    ("http://prefix.example.com/admin", False),
    ("http://prefix.example.com/?/docs/", False),  # the query is not the path
    ("http://glob.example.com/api/v1/read", True),
    ("http://glob.example.com/api/v1/write", False),
    ("http://glob.example.com/api/v1/read/more", False),  # a glob spans the whole path
    ("http://glob.example.com/api/read", False),
])
def test_ports_schemes_paths(conditions: Policy, target: str, allowed: bool) -> None:
    verdict = check(conditions, target)
    assert verdict.allowed is allowed, verdict.reason


@pytest.mark.parametrize("path", [
    "/docs/../admin", "/docs/%2e%2e/admin", "/docs/%2E%2e/admin", "/docs/..;/admin", "/docs/./../admin",
    "/docs/..%2fadmin", "/docs/..%5cadmin", "/docs/a/..",
])
def test_path_rules_are_not_fooled_by_dot_segments(path: str) -> None:
    allow = policy("default: deny\nhosts:\n  allow:\n    - host: a.example.com\n      paths: [/docs/]\n")
    assert not check(allow, f"http://a.example.com{path}").allowed
    deny = policy("default: allow\nhosts:\n  deny:\n    - host: a.example.com\n      paths: [/admin]\n")
    verdict = check(deny, f"http://a.example.com{path}")
    assert not verdict.allowed and verdict.rule == "p.yaml:5"


def test_path_rules_decode_unreserved_escapes() -> None:
    deny = policy("default: allow\nhosts:\n  deny:\n    - host: a.example.com\n      paths: [/admin]\n")
    assert not check(deny, "http://a.example.com/%61dmin").allowed
    assert check(deny, "http://a.example.com/public").allowed


def test_methods(conditions: Policy) -> None:
    assert check(conditions, "http://methods.example.com/", method="GET").allowed
    assert check(conditions, "http://methods.example.com/", method="head").allowed
    refused = check(conditions, "http://methods.example.com/", method="POST")
    assert not refused.allowed
    assert "allows only methods ['GET', 'HEAD']" in refused.reason


def test_websocket(conditions: Policy) -> None:
    assert check(conditions, "http://nows.example.com/").allowed
    refused = check(conditions, "ws://nows.example.com/", websocket=True)
    assert not refused.allowed and "does not allow WebSocket" in refused.reason
    assert check(conditions, "wss://ws.example.com/", websocket=True).allowed
    assert not check(conditions, "https://ws.example.com/").allowed


@pytest.mark.parametrize("target, words", [
    ("http://ports.example.com/", "rule ports.example.com (p.yaml:8) allows only ports [8080, 8443]"),
    ("http://schemes.example.com/", "rule schemes.example.com (p.yaml:10) allows only ['https']"),
    ("http://prefix.example.com/admin", "rule prefix.example.com (p.yaml:14) allows only paths ['/docs/', '/static/']"),
])
def test_near_miss_reasons(conditions: Policy, target: str, words: str) -> None:
    verdict = check(conditions, target)
    assert not verdict.allowed and verdict.rule == "default deny (p.yaml:2)"
    assert verdict.reason.endswith(words), verdict.reason


EXPIRY = "default: deny\nhosts:\n  allow:\n    - host: trial.example.com\n      expires: '2030-01-01T12:00:00Z'\n"


def test_expiry_to_the_second() -> None:
    pol = policy(EXPIRY)
    moment = datetime(2030, 1, 1, 12, 0, 0, tzinfo=UTC)
    before = check(pol, "https://trial.example.com/", at=moment - timedelta(seconds=1))
    assert before.allowed and before.rule == "p.yaml:5"
    at = check(pol, "https://trial.example.com/", at=moment)
    assert not at.allowed
    assert at.reason == ("trial.example.com is not on the allowlist (the policy denies by default); "
                         "rule trial.example.com (p.yaml:5) expired 2030-01-01 12:00 UTC")
    assert not check(pol, "https://trial.example.com/", at=moment + timedelta(days=400)).allowed


def test_expired_deny_rule_stops_refusing() -> None:
    # A bare date is the whole day, UTC: the rule refuses through 2030-01-01 and stops at 2030-01-02T00:00Z.
    pol = policy("default: allow\nhosts:\n  deny:\n    - host: x.example.com\n      expires: '2030-01-01'\n")
    assert not check(pol, "https://x.example.com/", at=datetime(2030, 1, 1, 23, 59, 59, tzinfo=UTC)).allowed
    assert check(pol, "https://x.example.com/", at=datetime(2030, 1, 2, tzinfo=UTC)).allowed
    timed = policy("default: allow\nhosts:\n  deny:\n    - host: x.example.com\n      expires: '2030-01-01T12:00Z'\n")
    assert not check(timed, "https://x.example.com/", at=datetime(2030, 1, 1, 11, 59, 59, tzinfo=UTC)).allowed
    assert check(timed, "https://x.example.com/", at=datetime(2030, 1, 1, 12, tzinfo=UTC)).allowed


def test_expired_rule_falls_through_to_a_later_one() -> None:
    body = ("default: deny\nhosts:\n  allow:\n    - host: a.example.com\n      expires: '2020-01-01'\n"
            "    - .example.com\n")
    verdict = check(policy(body), "https://a.example.com/")
    assert verdict.allowed and verdict.rule == "p.yaml:7"


# --- CONNECT and path rules ----------------------------------------------------------------------------

PATHS = """\
default: deny
hosts:
  allow:
    - host: seen.example.com
      paths: [/v1/]
      methods: [GET]
      intercept: true
    - host: blind.example.com
      paths: [/v1/]
"""


def test_connect_with_path_rule_needs_intercept() -> None:
    pol = policy(PATHS)
    opened = precheck(pol, connect("seen.example.com:443"))
    assert opened.allowed and opened.rule == "p.yaml:5"
    blind = precheck(pol, connect("blind.example.com:443"))
    assert not blind.allowed
    assert "allows only paths ['/v1/']" in blind.reason


def test_plain_http_path_rule_without_intercept_applies() -> None:
    pol = policy(PATHS)
    assert check(pol, "http://blind.example.com/v1/x").allowed
    assert not check(pol, "http://blind.example.com/v2/x").allowed


def test_intercepted_request_inside_tunnel_is_checked() -> None:
    pol = policy(PATHS)
    assert check(pol, "https://seen.example.com/v1/x", method="GET").allowed
    assert not check(pol, "https://seen.example.com/v1/x", method="POST").allowed
    assert not check(pol, "https://seen.example.com/v2/x", method="GET").allowed


def test_deny_rule_with_path_does_not_refuse_a_tunnel_it_cannot_see_into() -> None:
    pol = policy("default: allow\nhosts:\n  deny:\n    - host: a.example.com\n      paths: [/admin]\n")
    assert precheck(pol, connect("a.example.com:443")).allowed
    assert not check(pol, "http://a.example.com/admin").allowed


# --- roles ---------------------------------------------------------------------------------------------

ROLES = """\
default: deny
hosts:
  deny: [blocked.example.com]
  allow: [global.example.com]
roles:
  - name: ci
    clients: [10.20.0.0/16, 'fd00:20::/32']
    default: deny
    hosts:
      allow: [.pypi.org, blocked.example.com]
      deny: [evil.pypi.org]
  - name: open
    clients: [10.30.0.0/16]
    default: allow
  - name: inherit
    clients: [10.40.0.0/16]
    hosts:
      allow: [inherit.example.com]
"""


@pytest.fixture(scope="module")
def roles() -> Policy:
    return policy(ROLES)


@pytest.mark.parametrize("client", ["10.20.1.1", "::ffff:10.20.1.1", "fd00:20::5"])
def test_role_chosen_by_client(roles: Policy, client: str) -> None:
    verdict = check(roles, "https://files.pypi.org/", client=client)
    assert verdict.allowed and verdict.role == "ci" and verdict.rule == "p.yaml:11"


def test_role_has_its_own_lists_and_default(roles: Policy) -> None:
    verdict = check(roles, "https://global.example.com/", client="10.20.1.1")
    assert not verdict.allowed and verdict.role == "ci"
    assert verdict.rule == "default deny (p.yaml:7)"
    assert "role ci denies by default" in verdict.reason
    assert not check(roles, "https://evil.pypi.org/", client="10.20.1.1").allowed
    opened = check(roles, "https://anything.example.net/", client="10.30.0.9")
    assert opened.allowed and opened.role == "open" and "role open allows by default" in opened.reason


def test_role_without_default_inherits_the_policy_default(roles: Policy) -> None:
    assert check(roles, "https://inherit.example.com/", client="10.40.0.1").allowed
    verdict = check(roles, "https://global.example.com/", client="10.40.0.1")
    assert not verdict.allowed and verdict.rule == "default deny (p.yaml:2)" and verdict.role == "inherit"


def test_clients_outside_every_role_get_the_global_lists(roles: Policy) -> None:
    for client in ("10.99.0.1", None, "not-an-ip"):
        verdict = check(roles, "https://global.example.com/", client=client)
        assert verdict.allowed and verdict.role is None
        assert not check(roles, "https://files.pypi.org/", client=client).allowed


def test_global_deny_applies_to_roles(roles: Policy) -> None:
    for client in ("10.20.1.1", "10.30.0.9"):
        verdict = check(roles, "https://blocked.example.com/", client=client)
        assert not verdict.allowed and verdict.rule == "p.yaml:4", client


def test_role_addresses_still_checked(roles: Policy) -> None:
    verdict = check(roles, "https://x.example.net/", addresses=("169.254.169.254",), client="10.30.0.9")
    assert not verdict.allowed and verdict.stage == ADDRESS and verdict.role == "open"


def test_cname_to_a_host_the_role_denies(roles: Policy) -> None:
    verdict = check(roles, "https://mirror.pypi.org/", cnames=("evil.pypi.org",), client="10.20.1.1")
    assert not verdict.allowed and verdict.stage == RESOLVE and verdict.rule == "p.yaml:12"
    # the same alias is fine for a client outside the role
    assert check(roles, "https://global.example.com/", cnames=("evil.pypi.org",)).allowed


# --- report mode ---------------------------------------------------------------------------------------

REPORT = "mode: report\ndefault: deny\nhosts:\n  deny: [bad.example.com]\n  allow: [ok.example.com]\n"


def test_report_mode_lets_host_refusals_through() -> None:
    pol = policy(REPORT)
    for target, rule in (("https://bad.example.com/", "p.yaml:5"),
                         ("https://unknown.example.com/", "default deny (p.yaml:3)")):
        verdict = check(pol, target)
        assert verdict.allowed and verdict.report_only, target
        assert verdict.rule == rule and verdict.reason.startswith("report mode: would refuse: ")
        assert verdict.pinned == PUBLIC_V4
        assert precheck(pol, url(target)).needs_resolution
    fine = check(pol, "https://ok.example.com/")
    assert fine.allowed and not fine.report_only


@pytest.mark.parametrize("address", ["10.0.0.1", "169.254.169.254", "::1", "64:ff9b::a9fe:a9fe"])
def test_report_mode_never_passes_address_refusals(address: str) -> None:
    pol = policy(REPORT)
    for target in ("https://bad.example.com/", "https://ok.example.com/"):
        verdict = check(pol, target, addresses=(PUBLIC_V4, address))
        assert not verdict.allowed and not verdict.report_only and verdict.stage == ADDRESS


def test_report_mode_never_passes_port_or_scheme_refusals() -> None:
    pol = policy(REPORT)
    port = check(pol, "http://bad.example.com:8080/")
    assert not port.allowed and not port.report_only and port.stage == PORT
    scheme = precheck(pol, Request(Target("gopher", "ok.example.com", 70, "/")))
    assert not scheme.allowed and not scheme.report_only and scheme.stage == SCHEME


def test_report_mode_lets_an_alias_of_a_denied_host_through_as_it_lets_the_host() -> None:
    """The deny rule reached through a CNAME is a host rule: report mode relaxes it as it relaxes the same rule
    asked for by name (before, the alias was refused while the denied name itself was let through). An alias
    that is no name egresswall accepts, and the addresses, stay enforced."""
    pol = policy(REPORT)
    alias = check(pol, "https://ok.example.com/", cnames=("bad.example.com",))
    assert alias.allowed and alias.report_only and alias.stage == RESOLVE
    assert alias.rule == "p.yaml:5" and alias.rule_id == "hosts.deny:bad.example.com"
    assert alias.reason == ("report mode: would refuse: the name is an alias (CNAME) of bad.example.com, refused by "
                            "deny rule bad.example.com")
    assert alias.pinned == PUBLIC_V4
    enforced = policy(REPORT.replace("mode: report", "mode: enforce"))
    assert not check(enforced, "https://ok.example.com/", cnames=("bad.example.com",)).allowed
    # reported in place of the host's own report: allowing the name would not let it through
    both = check(pol, "https://unknown.example.com/", cnames=("bad.example.com",))
    assert both.report_only and both.stage == RESOLVE and both.rule == "p.yaml:5"
    internal = check(pol, "https://ok.example.com/", cnames=("db.internal",))
    assert not internal.allowed and internal.rule == "cname:local-suffix"
    bad_address = check(pol, "https://ok.example.com/", addresses=("10.0.0.1",), cnames=("bad.example.com",))
    assert not bad_address.allowed and bad_address.stage == ADDRESS


def test_report_mode_ip_literal_still_checked() -> None:
    verdict = precheck(policy(REPORT), url("http://127.0.0.1/"))
    assert not verdict.allowed and verdict.stage == ADDRESS


# --- every address must pass ---------------------------------------------------------------------------

OPEN = "default: allow\n"


@pytest.mark.parametrize("position", [0, 1, 2])
def test_one_private_address_among_public_refuses(position: int) -> None:
    addresses = [PUBLIC_V4, PUBLIC_V6, PUBLIC_V4_B]
    addresses[position] = "192.168.1.20"
    verdict = check(policy(OPEN), "https://a.example.com/", addresses=tuple(addresses))
    assert not verdict.allowed and verdict.stage == ADDRESS
    assert verdict.rule == "special-purpose 192.168.0.0/16"
    assert "192.168.1.20" in verdict.reason
    assert verdict.pinned is None and verdict.addresses == tuple(addresses)


def test_all_public_addresses_allow_and_pin_one_of_them() -> None:
    addresses = (PUBLIC_V6, PUBLIC_V4, PUBLIC_V4_B)
    verdict = check(policy(OPEN), "https://a.example.com/", addresses=addresses)
    assert verdict.allowed and verdict.addresses == addresses
    assert verdict.pinned in addresses
    assert verdict.pinned == PUBLIC_V4  # IPv4 preferred
    v6_only = check(policy(OPEN), "https://a.example.com/", addresses=(PUBLIC_V6,))
    assert v6_only.pinned == PUBLIC_V6


def test_mapped_address_is_judged_as_its_ipv4() -> None:
    verdict = check(policy(OPEN), "https://a.example.com/", addresses=(PUBLIC_V4, "::ffff:10.0.0.1"))
    assert not verdict.allowed and "10.0.0.0/8" in verdict.rule


@pytest.mark.parametrize("alias, rule", [
    ("db.internal", "cname:local-suffix"),
    ("printer.local", "cname:local-suffix"),
    ("localhost", "cname:localhost"),
    ("intranet", "cname:no-dot"),
    ("bad.example.com.", "p.yaml:5"),
    ("x.evil.example.net", "p.yaml:6"),
])
def test_cname_to_a_refused_name(alias: str, rule: str) -> None:
    pol = policy("default: allow\nhosts:\n  deny:\n    - bad.example.com\n    - .evil.example.net\n")
    verdict = check(pol, "https://alias.example.org/", cnames=("cdn.example.org", alias))
    assert not verdict.allowed and verdict.stage == RESOLVE and verdict.rule == rule
    assert "alias (CNAME)" in verdict.reason
    assert check(pol, "https://alias.example.org/", cnames=("cdn.example.org",)).allowed


def test_address_allow_rule_readmits_benchmarking_range() -> None:
    body = "default: deny\nhosts:\n  allow: [lab.example.com]\naddresses:\n  allow: [198.18.0.0/15]\n"
    pol = policy(body)
    verdict = check(pol, "https://lab.example.com/", addresses=("198.18.0.10", "198.19.255.255"))
    assert verdict.allowed and verdict.rule == "p.yaml:4" and verdict.pinned == "198.18.0.10"
    outside = check(pol, "https://lab.example.com/", addresses=("198.18.0.10", "10.0.0.1"))
    assert not outside.allowed
    # the same range without the address rule is refused
    assert not check(policy("default: allow\n"), "https://lab.example.com/", addresses=("198.18.0.10",)).allowed


def test_address_rule_from_the_command_line_is_named() -> None:
    pol = policy("default: allow\n", deny_ranges=["93.184.216.0/24"])
    verdict = check(pol, "https://a.example.com/")
    assert not verdict.allowed
    assert verdict.rule == "address-deny 93.184.216.0/24 (command line --deny-range 93.184.216.0/24)"


def test_address_deny_rule_names_its_line() -> None:
    pol = policy("default: allow\naddresses:\n  deny:\n    - 93.184.216.0/24\n")
    verdict = check(pol, "https://a.example.com/")
    assert not verdict.allowed and verdict.rule == "address-deny 93.184.216.0/24 (p.yaml:5)"


@pytest.mark.parametrize("address", ["10.0.0.1", "127.0.0.1", "169.254.169.254", "fd00::1", "::1",
                                     "198.18.0.1", "100.64.0.1"])
def test_host_allow_rule_never_readmits_a_non_global_address(address: str) -> None:
    literal = f"[{address}]" if ":" in address else address
    pol = policy(f"default: deny\nhosts:\n  allow:\n    - internal.example.com\n    - '{literal}'\n")
    assert pol.allow.rules[1].pattern.matches(address)
    named = check(pol, "https://internal.example.com/", addresses=(address,))
    assert not named.allowed and named.stage == ADDRESS
    direct = precheck(pol, url(f"https://{literal}/"))
    assert not direct.allowed and direct.stage == ADDRESS


def test_address_deny_beats_address_allow() -> None:
    pol = policy("default: allow\naddresses:\n  allow: [198.18.0.0/15]\n  deny: [198.18.5.0/24]\n")
    assert check(pol, "https://a.example.com/", addresses=("198.18.4.1",)).allowed
    verdict = check(pol, "https://a.example.com/", addresses=("198.18.5.1",))
    assert not verdict.allowed and verdict.rule == "address-deny 198.18.5.0/24 (p.yaml:5)"


def test_cloud_metadata_not_readmitted_by_range() -> None:
    pol = policy("default: allow\naddresses:\n  allow: [169.254.0.0/16, 168.63.129.0/24]\n")
    for address in ("169.254.169.254", "168.63.129.16"):
        verdict = check(pol, "https://a.example.com/", addresses=(address,))
        assert not verdict.allowed and verdict.rule.startswith("cloud-metadata"), address
    assert check(pol, "https://a.example.com/", addresses=("169.254.1.1",)).allowed


def test_verdict_rule_names_file_and_line() -> None:
    text = "default: deny\nhosts:\n  deny:\n    - x.example.com\n  allow:\n    - y.example.com\n"
    pol = policy(text, source="/etc/egresswall/policy.yaml")
    assert check(pol, "https://x.example.com/").rule == "/etc/egresswall/policy.yaml:5"
    assert check(pol, "https://y.example.com/").rule == "/etc/egresswall/policy.yaml:7"
    assert check(pol, "https://z.example.com/").rule == "default deny (/etc/egresswall/policy.yaml:2)"
    added = policy(text, allow_hosts=["z.example.com"])
    assert check(added, "https://z.example.com/").rule == "command line --allow-host z.example.com"


def test_decide_addresses_keeps_the_host_verdict() -> None:
    pol = policy(OPEN)
    first = precheck(pol, url("https://a.example.com/"))
    verdict = decide_addresses(pol, first, [PUBLIC_V4], [])
    assert verdict.rule == first.rule and verdict.reason == first.reason and verdict.pinned == PUBLIC_V4


# --- properties ----------------------------------------------------------------------------------------

LABELS = st.sampled_from(["a", "b", "ab", "com", "xn--bcher-kva", "x-y"])


@st.composite
def patterns(draw: st.DrawFn) -> HostPattern:
    prefix = draw(st.sampled_from(["", "*.", "."]))
    return HostPattern.parse(prefix + ".".join(draw(st.lists(LABELS, min_size=1, max_size=3))))


hosts = st.lists(LABELS, min_size=1, max_size=5).map(".".join)


@settings(max_examples=300)
@given(st.lists(patterns(), max_size=25), st.lists(hosts, min_size=1, max_size=10))
def test_host_index_equals_brute_force(pattern_list: list[HostPattern], host_list: list[str]) -> None:
    one_by_one = HostIndex((pattern, i) for i, pattern in enumerate(pattern_list))
    bulk = HostIndex.of(pattern_list, range(len(pattern_list)))  # how a policy's table is built
    half = len(pattern_list) // 2
    extended = HostIndex.of(pattern_list[:half], range(half))  # and added to afterwards
    extended.extend((pattern, half + i) for i, pattern in enumerate(pattern_list[half:]))
    for index in (one_by_one, bulk, extended):
        assert len(index) == len(pattern_list)
        for host in host_list:
            expected = [i for i, pattern in enumerate(pattern_list) if pattern.matches(host)]
            assert list(index.candidates(host)) == expected, host


def test_host_index_of_wants_a_pattern_per_item() -> None:
    with pytest.raises(ValueError):
        HostIndex.of([HostPattern.parse("a.example")], [1, 2])


@given(patterns(), patterns(), hosts)
def test_covers_implies_matches(outer: HostPattern, inner: HostPattern, host: str) -> None:
    if outer.covers(inner) and inner.matches(host):
        assert outer.matches(host)


def _blocks_refused_whole():
    # A mapped address is judged by the IPv4 inside, so ::ffff:0:0/96 is not refused as a block.
    for block in SPECIAL_PURPOSE_V4 + SPECIAL_PURPOSE_V6 + CLOUD_METADATA:
        if block.cidr != "::ffff:0:0/96":
            yield ipaddress.ip_network(block.cidr)


REFUSED_NETWORKS = sorted(set(_blocks_refused_whole()), key=lambda n: (n.version, n))


@st.composite
def refused_addresses(draw: st.DrawFn) -> str:
    net = draw(st.sampled_from(REFUSED_NETWORKS))
    address = net[draw(st.integers(0, net.num_addresses - 1))]
    if address.version == 4 and draw(st.booleans()):
        return f"::ffff:{address}"  # the same address, IPv4-mapped
    return str(address)


DECISION_POLICIES = [
    policy("default: allow\n"),
    policy("mode: report\ndefault: deny\n"),
    policy("default: deny\nhosts:\n  allow: [.example.com, '*.example.org']\n"),
    policy("mode: report\ndefault: allow\nhosts:\n  deny: [.example.com]\n"),
    policy("default: allow\naddresses:\n  allow: [203.0.113.0/24]\n  deny: [192.0.2.0/24]\n"),
]
READMITTED = ipaddress.ip_network("203.0.113.0/24")
PUBLIC = [PUBLIC_V4, PUBLIC_V4_B, PUBLIC_V6, "8.8.8.8", "2001:4860:4860::8888"]


@settings(max_examples=500)
@given(st.sampled_from(DECISION_POLICIES), st.sampled_from(["a.example.com", "www.example.org", "x.example.net"]),
       refused_addresses(), st.lists(st.sampled_from(PUBLIC), max_size=4), st.data())
def test_decide_never_allows_a_refused_address(pol: Policy, host: str, bad: str, public: list[str],
                                               data: st.DataObject) -> None:
    judged = ipaddress.ip_address(bad.removeprefix("::ffff:") if "." in bad else bad)
    assume(judged not in READMITTED)  # the last policy re-admits it on purpose
    position = data.draw(st.integers(0, len(public)))
    addresses = (*public[:position], bad, *public[position:])
    verdict = decide(pol, url(f"https://{host}/"), Resolution(host, addresses))
    assert not verdict.allowed, (bad, verdict)
    assert verdict.pinned is None


def test_cname_to_a_host_denied_only_on_some_ports_is_refused_on_those_ports() -> None:
    from policy.decision import Request, Resolution, decide
    from policy.hosts import parse_url
    from policy.loader import parse_policy

    policy = parse_policy("version: 1\ndefault: allow\nports: {connect: [443, 8443]}\n"
                          "hosts:\n  deny:\n    - host: accounts.example.com\n      ports: [443]\n")
    alias = Resolution("alias.example.net", ("93.184.216.34",), cnames=("accounts.example.com",))
    on_443 = decide(policy, Request(parse_url("https://alias.example.net/"), "CONNECT", tunnel=True), alias)
    assert not on_443.allowed and "accounts.example.com" in on_443.reason
    on_8443 = decide(policy, Request(parse_url("https://alias.example.net:8443/"), "CONNECT", tunnel=True), alias)
    assert on_8443.allowed


# --- stable rule ids -----------------------------------------------------------------------------------

IDS = """\
default: deny
hosts:
  deny:
    - "*.ads.example.com"
  allow:
    - docs.python.org
    - host: api.example.com
      ports: [443]
    - host: api.example.com
      ports: [8443]
    - host: vendor.example.net
      id: vendor-trial
roles:
  - name: ci-runners
    clients: [10.20.0.0/16]
    hosts:
      allow: [.pypi.org]
  - name: builders
    clients: [10.30.0.0/16]
    default: allow
addresses:
  allow: [198.18.0.0/15]
  deny: [8.8.8.0/24]
ports: {connect: [443, 8443], http: [80]}
"""


def _ids(pol: Policy) -> dict[str, str]:
    return {f"{r.pattern.text}:{sorted(r.ports or [])}": r.rule_id for r in pol.all_host_rules()}


def test_every_host_rule_has_a_derived_or_written_id() -> None:
    pol = policy(IDS)
    assert _ids(pol) == {
        "*.ads.example.com:[]": "hosts.deny:*.ads.example.com",
        "docs.python.org:[]": "hosts.allow:docs.python.org",
        "api.example.com:[443]": "hosts.allow:api.example.com",
        "api.example.com:[8443]": "hosts.allow:api.example.com#2",  # the same pattern twice in one list
        "vendor.example.net:[]": "vendor-trial",
        ".pypi.org:[]": "roles.ci-runners.allow:.pypi.org",
    }


def test_ids_do_not_move_when_lines_above_change() -> None:
    before = policy(IDS)
    after = policy("# a comment\nmode: enforce\n" + IDS.replace("    - docs.python.org\n",
                                                                  "    - new.example.org\n    - docs.python.org\n"))
    for host in ("https://docs.python.org/", "https://x.ads.example.com/", "https://vendor.example.net/"):
        old, new = check(before, host), check(after, host)
        assert old.rule_id == new.rule_id and old.rule != new.rule, (old, new)  # rule keeps file:line
    assert check(after, "https://docs.python.org/").rule == "p.yaml:10"


@pytest.mark.parametrize("request_, client, rule_id", [
    ("https://docs.python.org/", None, "hosts.allow:docs.python.org"),
    ("https://a.ads.example.com/", None, "hosts.deny:*.ads.example.com"),
    ("https://api.example.com:8443/", None, "hosts.allow:api.example.com#2"),
    ("https://unlisted.example.org/", None, "default:deny"),
    ("https://files.pypi.org/", "10.20.1.1", "roles.ci-runners.allow:.pypi.org"),
    ("https://unlisted.example.org/", "10.20.1.1", "default:deny"),  # the role has no default of its own
    ("https://unlisted.example.org/", "10.30.1.1", "roles.builders.default:allow"),
    ("https://a.ads.example.com/", "10.30.1.1", "hosts.deny:*.ads.example.com"),  # global deny rules apply
])
def test_verdicts_carry_the_stable_id(request_: str, client: str | None, rule_id: str) -> None:
    verdict = check(policy(IDS), request_, client=client)
    assert verdict.rule_id == rule_id, verdict
    assert verdict.rule != rule_id  # the human text names file:line or the default's origin


def test_every_other_stage_uses_its_rule_text_as_id() -> None:
    pol = policy(IDS.replace("default: deny", "default: allow"))
    cases = {
        "http://user@a.example.com/": FORM,
        "ftp://a.example.com/": FORM,
        "http://a.example.com:8080/": PORT,
    }
    for text, stage in cases.items():
        verdict = check(pol, text)
        assert verdict.stage == stage and verdict.rule_id == verdict.rule and verdict.rule_id, verdict
    scheme = precheck(pol, Request(Target("gopher", "a.example.com", 80)))
    assert scheme.stage == SCHEME and scheme.rule_id == scheme.rule == "scheme"
    special = check(pol, "https://a.example.com/", addresses=("10.0.0.5",))
    assert special.stage == ADDRESS and special.rule_id == special.rule == "special-purpose 10.0.0.0/8"
    unresolved = decide(pol, url("https://a.example.com/"))
    assert unresolved.stage == RESOLVE and unresolved.rule_id == "dns:unresolved"
    cname = check(pol, "https://a.example.com/", cnames=("db.internal",))
    assert cname.stage == RESOLVE and cname.rule_id == cname.rule == "cname:local-suffix"


def test_address_rules_have_ids_without_positions() -> None:
    pol = policy(IDS.replace("default: deny", "default: allow"))
    denied = check(pol, "https://a.example.com/", addresses=("8.8.8.8",))
    assert denied.rule == "address-deny 8.8.8.0/24 (p.yaml:24)" and denied.rule_id == "addresses.deny:8.8.8.0/24"


def test_a_cname_to_a_denied_name_carries_the_deny_rules_id() -> None:
    pol = policy(IDS.replace("default: deny", "default: allow"))
    verdict = check(pol, "https://a.example.com/", cnames=("x.ads.example.com",))
    assert verdict.stage == RESOLVE and verdict.rule == "p.yaml:5"
    assert verdict.rule_id == "hosts.deny:*.ads.example.com"


@pytest.mark.parametrize("written", ["Vendor", "a b", "-x", "a:b", "x" * 65, "ü"])
def test_a_written_id_must_be_a_short_slug(written: str) -> None:
    from policy.loader import PolicyError

    with pytest.raises(PolicyError) as info:
        policy(f"hosts:\n  allow:\n    - host: a.example.com\n      id: '{written}'\n")
    assert (info.value.line, info.value.column, info.value.key) == (5, 11, "hosts.allow[0].id")
    assert "lower-case letters" in info.value.message


def test_a_written_id_used_twice_is_an_error_naming_both_places() -> None:
    from policy.loader import PolicyError

    text = ("hosts:\n  allow:\n    - host: a.example.com\n      id: same\n"
            "roles:\n  - name: r\n    clients: [10.0.0.0/8]\n    hosts:\n      deny:\n"
            "        - host: b.example.com\n          id: same\n")
    with pytest.raises(PolicyError) as info:
        policy(text)
    assert str(info.value) == ("p.yaml:12:15: roles[0].hosts.deny[0].id: duplicate rule id 'same' "
                               "(first used at p.yaml:5:11); ids must be unique")


# --- the verdict's own constructor ---------------------------------------------------------------------


def test_verdict_constructor_takes_every_field_with_its_default() -> None:
    """Verdict writes its fields itself (faster than the frozen dataclass's generated __init__): the same
    parameters, in the same order, with the same defaults, and as frozen afterwards."""
    import dataclasses
    import inspect

    parameters = list(inspect.signature(Verdict.__init__).parameters.values())[1:]
    fields = dataclasses.fields(Verdict)
    assert [p.name for p in parameters] == [f.name for f in fields]
    assert [p.default for p in parameters] == [inspect.Parameter.empty if f.default is dataclasses.MISSING
                                               else f.default for f in fields]
    verdict = Verdict(True, "host", "policy.yaml:3", "allowed")
    assert verdict.rule_id == "policy.yaml:3"  # no id given: the rule text is the id
    assert Verdict(True, "host", "policy.yaml:3", "allowed", rule_id="hosts.allow:a.example").rule_id == (
        "hosts.allow:a.example")
    with pytest.raises(dataclasses.FrozenInstanceError):
        verdict.allowed = False  # type: ignore[misc]
    changed = dataclasses.replace(verdict, session="s1", addresses=("192.0.2.1",))
    assert (changed.session, changed.addresses, changed.rule, verdict.session) == ("s1", ("192.0.2.1",),
                                                                                  "policy.yaml:3", None)
    assert changed == Verdict(True, "host", "policy.yaml:3", "allowed", addresses=("192.0.2.1",), session="s1")
    assert hash(changed) == hash(Verdict(True, "host", "policy.yaml:3", "allowed", addresses=("192.0.2.1",),
                                         session="s1"))
    assert repr(verdict).startswith("Verdict(allowed=True, stage='host', rule='policy.yaml:3'")
