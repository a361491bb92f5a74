"""squid.conf → egresswall policy: each ACL type, http_access semantics, includes, warnings, and the
rule that an import never admits what squid refuses (checked on random configurations too)."""

from __future__ import annotations

import ipaddress
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from squid_compat import importer
from squid_compat.acls import Probe as SquidProbe
from squid_compat.conf import ConfError
from squid_compat.importer import import_conf, import_text
from squid_compat.losses import CONDITIONAL_DEFAULT, DENY_OVERLAP, HTTPS_FORM
from squid_compat.synth import admits, egress_probe

from policy.decision import Request, Resolution, decide
from policy.hosts import HostFormError, parse_authority, parse_url
from policy.lint import lint
from policy.loader import parse_policy
from policy.model import ALLOW
from proxy.policy_file import load_policy_file

PUBLIC = ("93.184.216.34",)
CLIENT = "203.0.113.50"


def allowed(result, target: str, method: str = "GET", client: str = CLIENT, addresses=PUBLIC) -> bool:
    """egresswall's decision on the imported policy, with the name resolving to ``addresses``."""
    try:
        parsed = parse_authority(target) if method == "CONNECT" else parse_url(target)
    except HostFormError:
        return False
    request = Request(parsed, method, client, tunnel=method == "CONNECT")
    resolution = None if parsed.ip is not None else Resolution(parsed.host, tuple(addresses))
    return decide(result.policy, request, resolution).allowed


def imported(text: str, **kwargs):
    return import_text(text, "squid.conf", **kwargs)


def warnings_text(result) -> str:
    return "\n".join(str(note) for note in result.warnings)


# ---- dstdomain ---------------------------------------------------------------------------------------

def test_dstdomain_leading_dot_is_domain_and_subdomains_no_dot_is_exact() -> None:
    result = imported("acl d dstdomain .example.com exact.org\nhttp_access allow d\n")
    assert allowed(result, "http://example.com/")
    assert allowed(result, "http://www.example.com/")
    assert allowed(result, "http://a.b.example.com/")
    assert not allowed(result, "http://notexample.com/")
    assert allowed(result, "http://exact.org/")
    assert not allowed(result, "http://www.exact.org/")
    assert not allowed(result, "http://other.net/")
    assert "- .example.com" in result.yaml and "- exact.org" in result.yaml


def test_dstdomain_is_case_insensitive_and_ignores_the_request_trailing_dot() -> None:
    result = imported("acl d dstdomain .Example.COM\nhttp_access allow d\n")
    assert allowed(result, "http://EXAMPLE.com/")
    assert allowed(result, "http://www.example.com./")
    assert allowed(result, "www.Example.com.:443", "CONNECT")


def test_dstdomain_value_with_trailing_dot_never_matches_in_squid_so_it_is_undecided() -> None:
    # squid 5 strips the dot from request hosts but not from ACL values: the value never matches.
    allow = imported("acl d dstdomain trail.example.\nhttp_access allow d\n")
    assert not allowed(allow, "http://trail.example/")
    assert "squid.conf:1: warning: acl d dstdomain trail.example.: squid strips the trailing dot" in \
        warnings_text(allow)
    # In a deny line the intent was to refuse it: egresswall refuses (stricter than squid, which would not).
    deny = imported("acl d dstdomain bad.example.\nhttp_access deny d\nhttp_access allow all\n")
    assert not allowed(deny, "http://bad.example/")
    assert allowed(deny, "http://good.example/")


@pytest.mark.parametrize("text, line, value", [
    ("acl good dstdomain good.test .good.test\n", 1, ".good.test"),  # measured, squid 5.7: FATAL: Bungled
    ("acl good dstdomain .good.test\nacl good dstdomain good.test\n", 2, "good.test"),
    ("acl good dstdomain www.good.test .good.test\n", 1, ".good.test"),
    ("acl good dstdomain .www.good.test .good.test\n", 1, ".good.test"),
])
def test_a_dstdomain_value_hiding_one_listed_before_it_makes_squid_refuse_to_start(
        text: str, line: int, value: str) -> None:
    # squid keeps no two overlapping values; it refuses to start (self_destruct) when the new
    # value would hide one already in the tree ("ERROR: 'www.good.test' is a subdomain of '.good.test'").
    # Before, the import kept both values: wider than squid, which runs nothing at all.
    with pytest.raises(ConfError, match=f"squid.conf:{line}: acl good dstdomain {re.escape(value)}: squid refuses "
                                        "to start"):
        imported(text + "http_access allow good\nhttp_access deny all\n")


def test_a_dstdomain_value_below_one_listed_before_it_is_ignored_as_squid_does() -> None:
    # Measured: squid starts, warning "'www.good.test' is a subdomain of '.good.test'", and allows both names.
    result = imported("acl good dstdomain .good.test www.good.test\nhttp_access allow good\nhttp_access deny all\n")
    assert allowed(result, "http://good.test/") and allowed(result, "http://www.good.test/")
    assert "squid.conf:1: note: acl good dstdomain www.good.test: squid ignores it" in "\n".join(map(str, result.notes))


def test_overlapping_dstdom_regex_values_are_all_kept() -> None:
    # squid keeps regexes in a list (RegexData), not a splay tree: nothing is dropped or refused.
    result = imported("acl good dstdom_regex ^good\\.test$ ^(.*\\.)?good\\.test$\n"
                      "http_access allow good\nhttp_access deny all\n")
    assert allowed(result, "http://good.test/") and allowed(result, "http://www.good.test/")


@pytest.mark.parametrize("values, inside, outside", [
    ("10.1.0.0/16 10.0.0.0/8", ["10.1.2.3"], ["10.2.3.4"]),  # squid ignores the WIDER one, listed second
    ("10.0.0.0/8 10.1.0.0/16", ["10.1.2.3", "10.2.3.4"], ["11.1.1.1"]),
    ("10.0.0.5-10.0.0.9 10.0.0.0/8", ["10.0.0.7"], ["10.0.0.1", "10.9.9.9"]),
])
def test_a_src_value_overlapping_one_listed_before_it_is_ignored_as_squid_does(
        values: str, inside: list[str], outside: list[str]) -> None:
    # Measured, squid 5.7 (acl c src 127.0.0.2/32 127.0.0.0/8: "because of this '127.0.0.0/8' is ignored to keep
    # splay tree searching predictable"; 127.0.0.1 refused). Before, the import allowed all of 10.0.0.0/8.
    result = imported(f"acl c src {values}\nhttp_access allow c\nhttp_access deny all\n")
    for client in inside:
        assert allowed(result, "http://example.com/", client=client), client
    for client in outside:
        assert not allowed(result, "http://example.com/", client=client), client
    if values.endswith("10.0.0.0/8"):
        assert "squid.conf:1: warning: acl c src 10.0.0.0/8: squid ignores it" in warnings_text(result)


def test_a_dst_value_overlapping_one_listed_before_it_is_ignored_as_squid_does() -> None:
    result = imported("acl d dst 93.184.216.34 93.184.216.0/24\nhttp_access deny d\nhttp_access allow all\n")
    assert not allowed(result, "http://93.184.216.34/")
    assert allowed(result, "http://93.184.216.99/")


def test_an_address_listed_after_a_name_is_undecided() -> None:
    # squid resolves gw.example at startup and drops a later value overlapping one of its addresses.
    result = imported("acl c src gw.example 10.1.0.0/16\nhttp_access allow c\nhttp_access deny all\n")
    assert not allowed(result, "http://example.com/", client="10.1.2.3")
    assert "squid.conf:1: warning: acl c src 10.1.0.0/16: listed after the name gw.example" in warnings_text(result)


def test_dstdomain_ip_values_match_ip_literal_urls_only() -> None:
    result = imported("acl d dstdomain 93.184.216.34 [2606:2800:220:1::1] 2606:2800:220:1::2\n"
                      "http_access allow d\n")
    assert allowed(result, "http://93.184.216.34/")
    assert allowed(result, "http://[2606:2800:220:1::1]/")
    assert not allowed(result, "http://[2606:2800:220:1::2]/")  # squid compares IPv6 hosts in brackets
    assert not allowed(result, "http://example.com/", addresses=("93.184.216.34",))  # a name is not its address
    assert "never matches" in warnings_text(result)


def test_names_egresswall_never_accepts_are_noted_not_dropped() -> None:
    result = imported("acl d dstdomain .example.com under_score.example.org *.wild.example\nhttp_access allow d\n")
    notes = "\n".join(map(str, result.notes))
    assert "squid.conf:1: note: acl d dstdomain under_score.example.org: no host egresswall accepts" in notes
    assert "*.wild.example: no host egresswall accepts" in notes
    assert allowed(result, "http://www.example.com/")


def test_ip_literal_urls_do_not_match_names_and_the_output_says_squid_would_try_ptr() -> None:
    result = imported("acl d dstdomain .example.com\nhttp_access deny d\nhttp_access allow all\n")
    assert allowed(result, "http://93.184.216.34/")  # squid might refuse it by its PTR name; egresswall never asks
    assert "reverse (PTR)" in result.yaml


# ---- dstdom_regex --------------------------------------------------------------------------------------

@pytest.mark.parametrize("regex, pattern", [
    (r"^(.*\.)?rx\.example$", ".rx.example"),
    (r"(^|\.)rx\.example$", ".rx.example"),
    (r"^rx\.example$", "rx.example"),
    (r"\.rx\.example$", '"*.rx.example"'),
    (r"^.*\.rx\.example$", '"*.rx.example"'),
])
def test_anchored_regexes_become_host_patterns(regex: str, pattern: str) -> None:
    result = imported(f"acl r dstdom_regex {regex}\nhttp_access allow r\n")
    assert f"- {pattern}\n" in result.yaml
    assert not result.warnings


def test_regex_case_flags() -> None:
    upper = imported("acl r dstdom_regex ^RX\\.example$\nhttp_access allow r\n")
    assert not allowed(upper, "http://rx.example/")  # squid lower-cases hosts: never matches without -i
    assert "never matches" in warnings_text(upper)
    insensitive = imported("acl r dstdom_regex -i ^RX\\.example$\nhttp_access allow r\n")
    assert allowed(insensitive, "http://rx.example/")


def test_regex_that_is_no_host_pattern_is_a_warning_and_undecided() -> None:
    text = "acl r dstdom_regex ^www[0-9]+\\.\nhttp_access deny r\nhttp_access allow all\n"
    result = imported(text)
    assert "squid.conf:1: warning: acl r dstdom_regex ^www[0-9]+\\.: not a host pattern" in warnings_text(result)
    # squid may refuse any host by it; egresswall cannot tell which, so it refuses them all (stricter).
    assert not allowed(result, "http://www1.example/")
    assert not allowed(result, "http://example.org/")


def test_regex_confined_to_a_domain_is_undecided_only_there() -> None:
    result = imported("acl r dstdom_regex ^ads[0-9]+\\.example\\.net$\nhttp_access deny r\nhttp_access allow all\n")
    assert not allowed(result, "http://ads1.example.net/")
    assert not allowed(result, "http://cdn.example.net/")  # same domain: undecided, refused
    assert allowed(result, "http://example.net/")
    assert allowed(result, "http://example.org/")


# ---- ports, methods, clients ---------------------------------------------------------------------------

DEBIAN = """\
acl localnet src 10.0.0.0/8 192.168.0.0/16
acl SSL_ports port 443
acl Safe_ports port 80 21 443 70 210 1025-65535 280 488 591 777
acl CONNECT method CONNECT
http_access deny !Safe_ports
http_access deny CONNECT !SSL_ports
http_access allow localhost manager
http_access deny manager
http_access allow localnet
http_access allow localhost
http_access deny all
http_port 3128
"""


def test_safe_ports_and_ssl_ports_idiom_becomes_the_port_lists() -> None:
    result = imported(DEBIAN)
    assert result.policy.connect_ports == frozenset({443})
    assert result.policy.http_ports == frozenset({21, 70, 80, 210, 280, 443, 488, 591, 777} | set(range(1025, 65536)))
    assert 'http: [21, 70, 80, 210, 280, 443, 488, 591, 777, "1025-65535"]' in result.yaml
    lan = "10.1.2.3"
    assert allowed(result, "example.com:443", "CONNECT", client=lan)
    assert not allowed(result, "example.com:8443", "CONNECT", client=lan)
    assert allowed(result, "http://example.com:8080/", client=lan)
    assert not allowed(result, "http://example.com:25/", client=lan)
    assert not allowed(result, "http://example.com/", client="198.51.100.7")  # not localnet, not localhost


def test_src_acls_become_roles_and_the_rest_the_global_section() -> None:
    result = imported(DEBIAN)
    roles = {role.name: role for role in result.policy.roles}
    # localhost and localnet are treated alike, so they share one role; everyone else is the global section.
    assert set(roles) == {"localhost_localnet"}
    assert result.policy.default == "deny" and roles["localhost_localnet"].default == "allow"
    assert allowed(result, "http://example.com/", client="127.0.0.1")
    assert allowed(result, "http://example.com/", client="::1")
    assert lint(result.policy) == []


def test_roles_keep_per_client_allowlists() -> None:
    result = imported("acl lan src 10.0.0.0/8\nacl ops src 10.9.0.0/16\nacl d dstdomain .docs.example\n"
                      "http_access allow ops\nhttp_access allow lan d\nhttp_access deny all\n")
    assert allowed(result, "http://anything.example/", client="10.9.1.1")
    assert allowed(result, "http://www.docs.example/", client="10.1.1.1")
    assert not allowed(result, "http://anything.example/", client="10.1.1.1")
    assert not allowed(result, "http://www.docs.example/", client="192.168.1.1")
    assert lint(result.policy) == []


def test_port_ranges_and_and_within_a_line() -> None:
    result = imported("acl p port 8000-8010\nacl d dstdomain api.example\n"
                      "http_access allow d p\nhttp_access deny all\n")
    assert allowed(result, "http://api.example:8005/")
    assert not allowed(result, "http://api.example:8011/")
    assert not allowed(result, "http://api.example:80/")
    assert not allowed(result, "http://other.example:8005/")
    assert allowed(result, "api.example:8000", "CONNECT")
    assert result.policy.connect_ports == frozenset(range(8000, 8011))


def test_methods_and_connect() -> None:
    result = imported("acl g method GET HEAD\nacl d dstdomain .example.com\n"
                      "http_access allow CONNECT d\nhttp_access allow g d\nhttp_access deny all\n")
    assert allowed(result, "http://www.example.com/", "GET")
    assert allowed(result, "http://www.example.com/", "HEAD")
    assert not allowed(result, "http://www.example.com/", "POST")
    assert not allowed(result, "http://www.example.com/", "FROBNICATE")
    assert allowed(result, "www.example.com:443", "CONNECT")
    assert not allowed(result, "other.example:443", "CONNECT")


def test_proto_acl_tells_connect_http_and_https_apart() -> None:
    result = imported("acl h proto HTTP\nacl d dstdomain .example.com\nhttp_access allow h d\nhttp_access deny all\n")
    assert allowed(result, "http://www.example.com/")
    assert not allowed(result, "www.example.com:443", "CONNECT")  # squid's proto of a CONNECT is NONE
    assert not allowed(result, "https://www.example.com/")


# ---- http_access semantics -----------------------------------------------------------------------------

def test_values_and_repeated_acl_lines_are_ored() -> None:
    result = imported("acl d dstdomain a.example\nacl d dstdomain b.example c.example\nhttp_access allow d\n")
    assert all(allowed(result, f"http://{h}.example/") for h in "abc")
    assert not allowed(result, "http://d.example/")


def test_first_match_wins_where_egresswall_can_express_it() -> None:
    result = imported("acl one dstdomain x.example\nacl whole dstdomain .example\nacl other dstdomain .org\n"
                      "http_access allow one\nhttp_access deny whole\nhttp_access allow other\n"
                      "http_access deny all\n")
    assert allowed(result, "http://x.example/")
    assert not allowed(result, "http://y.example/")
    assert allowed(result, "http://www.example.org/")
    assert not allowed(result, "http://example.net/")
    assert {loss.category for loss in result.losses} == {"host-form"}  # http://org/ itself: no dot, refused


def test_first_match_wins_and_egresswall_is_stricter_where_it_cannot() -> None:
    # squid allows x.example before refusing .example, then allows everything else. egresswall needs a deny
    # rule for .example (its default is allow) and checks deny rules first: x.example is refused, and said.
    result = imported("acl one dstdomain x.example\nacl whole dstdomain .example\n"
                      "http_access allow one\nhttp_access deny whole\nhttp_access allow all\n")
    assert not allowed(result, "http://x.example/")
    assert not allowed(result, "http://y.example/")
    assert allowed(result, "http://example.org/")
    assert {loss.category for loss in result.losses} == {DENY_OVERLAP}
    assert any(str(note.where) == "squid.conf:3" and note.category == DENY_OVERLAP for note in result.warnings)


def test_negation() -> None:
    result = imported("acl d dstdomain .example.com\nhttp_access deny !d\nhttp_access allow all\n")
    assert allowed(result, "http://www.example.com/")
    assert not allowed(result, "http://example.org/")
    flipped = imported("acl blocked dstdomain .ads.example\nhttp_access allow !blocked\n")
    assert allowed(flipped, "http://example.org/")
    assert not allowed(flipped, "http://x.ads.example/")


@pytest.mark.parametrize("text, host, expected", [
    ("acl d dstdomain a.example\nhttp_access allow d\n", "a.example", True),  # last line allow: default deny
    ("acl d dstdomain a.example\nhttp_access allow d\n", "b.example", False),
    ("acl d dstdomain a.example\nhttp_access deny d\n", "a.example", False),  # last line deny: default allow
    ("acl d dstdomain a.example\nhttp_access deny d\n", "b.example", True),
    ("acl d dstdomain a.example\n", "a.example", False),  # no http_access at all: deny
])
def test_implicit_default_is_the_opposite_of_the_last_line(text: str, host: str, expected: bool) -> None:
    assert allowed(imported(text), f"http://{host}/") is expected


def test_default_that_depends_on_method_cannot_be_expressed_and_is_refused() -> None:
    result = imported("acl post method POST\nhttp_access deny post\nhttp_access allow all\n")
    assert not allowed(result, "http://example.org/", "GET")
    assert not allowed(result, "http://example.org/", "POST")
    assert CONDITIONAL_DEFAULT in {loss.category for loss in result.losses}
    assert "default cannot depend on port, method or scheme" in warnings_text(result)


def test_absolute_form_https_is_judged_by_connect_ports() -> None:
    result = imported(DEBIAN)
    assert not allowed(result, "https://example.com:8080/", client="10.1.1.1")
    assert HTTPS_FORM in {loss.category for loss in result.losses}


# ---- dst -----------------------------------------------------------------------------------------------

def test_deny_dst_becomes_an_address_rule_and_any_matches_like_every() -> None:
    result = imported("acl bad dst 93.184.216.0/24\nacl priv dst 10.0.0.0/8\n"
                      "http_access deny bad\nhttp_access deny priv\nhttp_access allow all\n")
    assert [cidr for _, cidr, _ in result.policy.address_rules_text] == ["93.184.216.0/24"]
    assert not allowed(result, "http://example.com/", addresses=("93.184.216.34",))
    assert not allowed(result, "http://example.com/", addresses=("1.1.1.1", "93.184.216.34"))
    assert allowed(result, "http://example.com/", addresses=("1.1.1.1",))
    assert not allowed(result, "http://93.184.216.34/")
    assert "10.0.0.0/8" in result.yaml  # said in a comment: egresswall refuses it without a rule


def test_allow_dst_means_every_address_must_be_listed() -> None:
    result = imported("acl ok dst 93.184.216.0/24\nhttp_access allow ok\nhttp_access deny all\n")
    assert allowed(result, "http://example.com/", addresses=("93.184.216.34",))
    assert not allowed(result, "http://example.com/", addresses=("1.1.1.1",))
    # squid would allow this (ANY answer listed); egresswall requires EVERY answer to pass.
    assert not allowed(result, "http://example.com/", addresses=("93.184.216.34", "1.1.1.1"))
    assert "ANY address" in result.yaml and "EVERY address" in result.yaml


def test_squid_ipv6_ranges_over_mapped_space_cover_ipv4() -> None:
    # squid keeps IPv4 as ::ffff:a.b.c.d, so 'dst ::/1' refuses every IPv4 destination too (measured, squid 5.7).
    result = imported("acl v6 dst ::/1\nhttp_access deny v6\nhttp_access allow all\n")
    assert not allowed(result, "http://example.com/", addresses=("1.1.1.1",))
    assert not allowed(result, "http://1.1.1.1/")


def test_conditional_dst_is_undecided_for_names() -> None:
    result = imported("acl net dst 93.184.216.0/24\nacl d dstdomain .example.com\n"
                      "http_access deny d net\nhttp_access allow all\n")
    assert not allowed(result, "http://www.example.com/", addresses=("1.1.1.1",))  # which answers? undecided
    assert allowed(result, "http://example.org/")


def test_readmit_adds_addresses_allow() -> None:
    result = imported("http_access allow all\n", readmit=["127.0.0.2/32"])
    assert allowed(result, "http://lab.example/", addresses=("127.0.0.2",))
    assert not allowed(result, "http://lab.example/", addresses=("127.0.0.3",))


# ---- predefined ACLs, groups, unknown types ------------------------------------------------------------

def test_predefined_to_localhost_and_all() -> None:
    result = imported("http_access deny to_localhost\nhttp_access allow all\n", readmit=["127.0.0.0/8"])
    assert not allowed(result, "http://127.0.0.2/")
    assert allowed(result, "http://example.com/")


def test_any_of_and_all_of() -> None:
    text = ("acl a dstdomain a.example\nacl b dstdomain b.example\nacl g method GET\n"
            "acl either any-of a b\nacl both all-of either g\nhttp_access allow both\n")
    result = imported(text)
    assert allowed(result, "http://a.example/") and allowed(result, "http://b.example/")
    assert not allowed(result, "http://a.example/", "POST")
    assert not allowed(result, "http://c.example/")


def test_untranslatable_acl_types_are_warnings_and_refuse_where_they_decide() -> None:
    text = "acl hours time MTWHF 08:00-17:00\nacl d dstdomain .example.com\nhttp_access allow d hours\n"
    result = imported(text)
    assert "squid.conf:3: warning: http_access allow d hours: acl hours is undecided (the acl type time" in \
        warnings_text(result)
    assert not allowed(result, "http://www.example.com/")


def test_undefined_acl_is_reported() -> None:
    result = imported("http_access allow nosuch\n")
    assert "squid.conf:1: warning: http_access allow nosuch: acl nosuch is not defined" in warnings_text(result)
    assert not allowed(result, "http://example.com/")


def test_directives_that_are_not_access_control_are_noted() -> None:
    result = imported("http_port 3128\nhosts_file /etc/hosts\ncache_dir ufs /var/spool/squid 100 16 256\n"
                      "http_access allow all\n")
    notes = "\n".join(map(str, result.notes))
    assert "squid.conf:1: note: http_port: not access control" in notes
    assert "squid.conf:2: warning: hosts_file:" in notes
    assert "squid.conf:3: note: cache_dir: not access control" in notes


def test_adapted_http_access_denials_apply_too() -> None:
    result = imported("acl d dstdomain bad.example\nhttp_access allow all\nadapted_http_access deny d\n"
                      "adapted_http_access allow all\n")
    assert not allowed(result, "http://bad.example/")
    assert allowed(result, "http://good.example/")


# ---- files: include, value files, continuation ---------------------------------------------------------

def test_include_value_files_and_warnings_with_their_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "conf.d").mkdir()
    (tmp_path / "sites.txt").write_text("# allowed sites\n.example.com\ndocs.example.org   # a trailing comment\n"
                                        "trail.example.\n")
    (tmp_path / "conf.d" / "10-acl.conf").write_text(
        f'acl sites dstdomain "{tmp_path / "sites.txt"}"\n'
        "acl ports port 80 \\\n    443   # a continued line, and a comment\n")
    (tmp_path / "conf.d" / "20-access.conf").write_text("http_access allow sites ports\nacl late proxy_auth REQUIRED\n"
                                                        "http_access allow late\n")
    main = tmp_path / "squid.conf"
    main.write_text(f"include {tmp_path}/conf.d/*.conf\nhttp_access deny all\n")
    result = import_conf(main)
    assert allowed(result, "http://www.example.com/")
    assert allowed(result, "http://docs.example.org/")
    assert not allowed(result, "http://other.example.org/")
    assert result.policy.http_ports == frozenset({80, 443})
    text = warnings_text(result)
    assert f"{tmp_path / 'sites.txt'}:4: warning: acl sites dstdomain trail.example.:" in text
    assert f"{tmp_path / 'conf.d' / '20-access.conf'}:3: warning: http_access allow late" in text


def test_relative_include_and_missing_include(tmp_path: Path) -> None:
    (tmp_path / "extra.conf").write_text("acl d dstdomain a.example\nhttp_access allow d\n")
    main = tmp_path / "squid.conf"
    main.write_text("include extra.conf\n")
    assert allowed(import_conf(main), "http://a.example/")
    main.write_text("include /nonexistent/squid/extra.conf\n")
    with pytest.raises(ConfError, match="squid.conf:1: include /nonexistent/squid/extra.conf: no such file"):
        import_conf(main)


def test_conditional_sections_are_refused() -> None:
    with pytest.raises(ConfError, match="squid.conf:1: conditional sections"):
        imported("if ${process_number} = 1\nhttp_access allow all\nendif\n")


# ---- the output ----------------------------------------------------------------------------------------

def test_output_loads_lints_clean_and_carries_the_warnings_as_comments(tmp_path: Path) -> None:
    result = imported(DEBIAN)
    path = tmp_path / "policy.yaml"
    path.write_text(result.yaml)
    policy = load_policy_file(path)
    assert lint(policy) == []
    assert "# Warnings (also printed on stderr):" in result.yaml
    assert "#   squid.conf:7: warning: http_access allow localhost manager" in result.yaml


def test_cli_import_writes_yaml_and_prints_warnings(tmp_path: Path) -> None:
    conf = tmp_path / "squid.conf"
    conf.write_text("acl d dstdomain .example.com bad.example.\nhttp_access allow d\n")
    out = tmp_path / "policy.yaml"
    done = subprocess.run([sys.executable, "-m", "proxy.cli", "squid", "import", str(conf), "-o", str(out)],
                          capture_output=True, text=True, timeout=60, cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr
    assert f"{conf}:1: warning: acl d dstdomain bad.example.:" in done.stderr
    lint_run = subprocess.run([sys.executable, "-m", "proxy.cli", "lint", str(out), "--strict"],
                              capture_output=True, text=True, timeout=60, cwd=Path(__file__).parent.parent)
    assert lint_run.returncode == 0, lint_run.stdout + lint_run.stderr


# ---- never more than squid: random configurations --------------------------------------------------------

NAMES = ["a.example", "b.a.example", "example", "c.example", "x.org"]
VALUES = [".a.example", "a.example", "b.a.example", ".example", "c.example", ".x.org", "x.org"]
ACLS = {
    "d1": ("dstdomain", VALUES), "d2": ("dstdomain", VALUES), "p1": ("port", ["80", "443", "8000-8100"]),
    "m1": ("method", ["GET", "POST", "CONNECT"]), "s1": ("src", ["10.0.0.0/8", "10.1.0.0/16"]),
    "r1": ("dstdom_regex", [r"^(.*\.)?a\.example$", r"\.x\.org$", r"^www[0-9]\."]),
    "n1": ("dst", ["93.184.216.0/24", "1.1.1.0/24"]),
}
REQUESTS = [(h, m, p) for h in [*NAMES, "www.x.org", "q.b.a.example", "www1.example", "93.184.216.34"]
            for m, p in [("GET", 80), ("POST", 80), ("GET", 8050), ("CONNECT", 443), ("CONNECT", 8050),
                         ("GET", 443)]]


@st.composite
def configurations(draw):
    lines = []
    for name, (type_, values) in ACLS.items():
        chosen = draw(st.lists(st.sampled_from(values), min_size=1, max_size=3, unique=True))
        if type_ == "dstdomain":
            chosen = _squid_starts_with(chosen)
        lines.append(f"acl {name} {type_} {' '.join(chosen)}")
    for _ in range(draw(st.integers(1, 5))):
        action = draw(st.sampled_from(["allow", "deny"]))
        literals = draw(st.lists(st.sampled_from(list(ACLS) + ["all"]), min_size=1, max_size=3, unique=True))
        lines.append(f"http_access {action} " + " ".join(("!" if draw(st.booleans()) else "") + x for x in literals))
    return "\n".join(lines) + "\n"


def _squid_starts_with(values: list[str]) -> list[str]:
    """The values less each one squid 5.7 refuses to start on: a value that would hide one listed before it
    (``a.example .a.example``, ``b.a.example .a.example``, ``.a.example a.example``; measured)."""
    kept: list[str] = []
    for value in values:
        name = value.lstrip(".")
        hides = any(other.lstrip(".") == name or (value.startswith(".") and other.endswith("." + name))
                    for other in kept)
        if not hides:
            kept.append(value)
    return kept


# Found by hypothesis: c.example and a.example are alike for s1 (c.example was built as a copy of a.example) but
# not for everyone else, whose section became the global one with a deny rule for c.example alone; the check
# that the global deny rules leave the role's decisions alone skipped the copies, and the import aborted with
# "host c.example is decided unlike host a.example" (test_global_deny_rules_are_checked_against_a_roles_copies).
ROLE_COPY_HIT_BY_GLOBAL_DENY = (
    "acl d1 dstdomain c.example\nacl d2 dstdomain .a.example\nacl p1 port 80\nacl m1 method CONNECT\n"
    "acl s1 src 10.0.0.0/8\nacl r1 dstdom_regex ^(.*\\.)?a\\.example$\nacl n1 dst 93.184.216.0/24\n"
    "http_access allow d1 m1 !d2\nhttp_access allow d1 d2\nhttp_access deny !s1\n")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configurations(), st.sampled_from(["10.1.2.3", "10.9.9.9", "192.0.2.77"]),
       st.sampled_from([("93.184.216.34",), ("1.1.1.1",), ("93.184.216.34", "1.1.1.1")]))
@example(ROLE_COPY_HIT_BY_GLOBAL_DENY, "10.1.2.3", ("93.184.216.34",))
def test_an_import_never_admits_what_squid_refuses(text: str, client: str, addresses: tuple[str, ...]) -> None:
    result = imported(text)
    for host, method, port in REQUESTS:
        is_ip = host[0].isdigit()
        target = f"{host}:{port}" if method == "CONNECT" else f"{'https' if port == 443 else 'http'}://{host}:{port}/"
        if not allowed(result, target, method, client, addresses):
            continue
        kind = "connect" if method == "CONNECT" else ("https" if port == 443 else "http")
        # squid's answer for this exact request (its dst ACLs match when ANY answer of the name is listed).
        outcome = result.squid_outcome(client, kind, method, port, host, () if is_ip else addresses)
        assert outcome.allowed, f"{text}\n{target} {method} from {client} via {addresses}"


# s1 clients: squid allows everything. Everyone else: CONNECT to z.example only. For everyone else z.example
# needs a deny rule (an absolute-form https request is not a CONNECT); for s1, z.example is built as a copy of
# a.example, the fourth, past the copies the import's own check decides in full (importer.COPIES_CHECKED).
FOURTH_COPY_HIT_BY_GLOBAL_DENY = (
    "acl d1 dstdomain z.example\nacl d2 dstdomain a.example b1.example b2.example b3.example\n"
    "acl m1 method CONNECT\nacl s1 src 10.0.0.0/8\n"
    "http_access allow d1 m1\nhttp_access allow d1 d2\nhttp_access deny !s1\n")


@pytest.mark.parametrize("text, copy", [(ROLE_COPY_HIT_BY_GLOBAL_DENY, "c.example"),
                                        (FOURTH_COPY_HIT_BY_GLOBAL_DENY, "z.example")])
def test_global_deny_rules_are_checked_against_a_roles_copies(text: str, copy: str) -> None:
    # The global section's deny rules apply to every role. They were built for other clients, so they may name a
    # role's copy and not its template: a section whose deny rules would change a role's decisions for a copy
    # must not become the global one. (Before: the first case aborted the import with "host c.example is decided
    # unlike host a.example"; the second refused https://z.example/ to s1 and reported no loss.)
    result = imported(text)
    member, outsider = "10.1.2.3", "192.0.2.77"
    for target, method in [(f"{copy}:443", "CONNECT"), (f"https://{copy}/", "GET"), (f"http://{copy}/", "GET"),
                           ("a.example:443", "CONNECT"), ("https://a.example/", "GET")]:
        kind = "connect" if method == "CONNECT" else target.split(":")[0]
        host = target.split("/")[2] if "//" in target else target.split(":")[0]
        assert result.squid_outcome(member, kind, method, 443 if kind != "http" else 80, host, PUBLIC).allowed
        assert allowed(result, target, method, client=member), target
    assert allowed(result, f"{copy}:443", "CONNECT", client=outsider)
    assert not allowed(result, f"https://{copy}/", client=outsider)
    assert not allowed(result, "a.example:443", "CONNECT", client=outsider)
    assert not [loss for loss in result.losses if loss.client == "s1"]
    assert result.policy_admits["s1"] == result.squid_allows["s1"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configurations())
@example(ROLE_COPY_HIT_BY_GLOBAL_DENY)
@example(FOURTH_COPY_HIT_BY_GLOBAL_DENY)
def test_an_import_reports_every_request_class_it_refuses_that_squid_allows(text: str) -> None:
    # The import decides a few copies of each template in full and gives the others their template's answer.
    # With none decided in full, every copy takes that shortcut; the losses and counts it reports must still be
    # what deciding every (client class, region, cell) with the written policy gives.
    with mock.patch.object(importer, "COPIES_CHECKED", 0):
        result = imported(text)
    policy, space, context = result.policy, result.space, result.context
    assert context is not None
    address = importer.probe_address(policy.addresses, space, context.admissible)
    refused: set[tuple[str, str, object]] = set()
    admitted_counts: dict[str, int] = {}
    for client in space.clients:
        for region in space.regions:
            for cell in space.cells:
                outcome = result.program.evaluate(
                    SquidProbe(client.representative, cell.kind, cell.method, cell.port, region.host), context)
                admitted = admits(policy, egress_probe(region, cell, str(client.representative), address))
                assert outcome.allowed or not admitted, f"{text}\n{cell} to {region.describe()} from {client.name()}"
                if outcome.allowed and not admitted:
                    refused.add((client.name(), region.key, cell))
                if outcome.allowed or ALLOW in outcome.actions:
                    admitted_counts[client.name()] = admitted_counts.get(client.name(), 0) + admitted
    assert {(loss.client, loss.region.key, loss.cell) for loss in result.losses} == refused, text
    assert result.policy_admits == admitted_counts, text


def test_squid_outcome_helper_parses_ip_literals() -> None:
    result = imported("acl d dstdomain 93.184.216.34\nhttp_access allow d\n")
    assert result.squid_outcome(CLIENT, "http", "GET", 80, "93.184.216.34").allowed
    assert ipaddress.ip_address("93.184.216.34")


# ---- an import that stays useful (issue 14, item 5) --------------------------------------------------------

REPO = Path(__file__).parent.parent

CORPORATE = """\
acl localnet src 10.0.0.0/8
acl localnet src 192.168.0.0/16
acl buildagents src 10.20.0.0/16
acl SSL_ports port 443
acl Safe_ports port 80
acl Safe_ports port 443
acl Safe_ports port 1025-65535
acl CONNECT method CONNECT
acl build_sites dstdomain "{dir}/build-domains.txt"
acl staff_sites dstdomain "{dir}/staff-domains.txt"
acl private_nets dst 10.0.0.0/8 172.16.0.0/12 192.168.0.0/16 169.254.0.0/16
acl executables url_regex -i \\.(exe|msi|bat)$
http_access deny !Safe_ports
http_access deny CONNECT !SSL_ports
http_access deny private_nets
http_access deny executables
http_access allow buildagents build_sites
http_access deny buildagents
http_access allow localnet staff_sites
http_access deny all
cache_peer parent.corp.example parent 3128 0 no-query default
never_direct allow all
ssl_bump peek all
ssl_bump splice all
http_port 3128 ssl-bump cert=/etc/squid/ca.pem
"""


def run_import(conf: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "proxy.cli", "squid", "import", str(conf), *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO)


def test_cli_import_that_admits_nothing_squid_allows_fails(tmp_path: Path) -> None:
    conf = tmp_path / "squid.conf"
    conf.write_text("acl localnet src 10.0.0.0/8\nacl exe urlpath_regex -i \\.exe$\nhttp_access deny exe\n"
                    "http_access allow localnet\nhttp_access deny all\n")
    done = run_import(conf, "-o", str(tmp_path / "policy.yaml"))
    assert done.returncode == 1, done.stderr
    assert f"egresswall: {conf}: import FAILED: the imported policy refuses every request squid allows" in done.stderr
    assert "-: warning: clients localnet: squid allows 6 request class(es) from them, and the imported policy " \
           "admits none" in done.stderr
    assert f"{conf}:3: warning: http_access deny exe:" in done.stderr  # the line, and its effect
    assert (tmp_path / "policy.yaml").exists()  # written for reading


@pytest.mark.parametrize("conf_text, line", [
    ("acl x dst 10.0.0.0/8\nhttp_access allow x\n", "2: warning: http_access allow x"),
    ("acl x dst 10.0.0.0/8\nhttp_access deny !x\nhttp_access allow all\n", "2: warning: http_access deny !x"),
])
def test_cli_import_whose_dst_acls_reach_only_non_global_addresses_fails_and_says_why(
        tmp_path: Path, conf_text: str, line: str) -> None:
    """squid allows requests to 10.0.0.0/8 only; egresswall refuses those addresses without a rule, and a dst
    ACL admits nothing by itself, so the policy admits no request at all. It was written with 0 warnings,
    exit 0 (squid's classes are judged on addresses egresswall may reach, and there were none)."""
    conf = tmp_path / "squid.conf"
    conf.write_text(conf_text)
    done = run_import(conf, "-o", str(tmp_path / "policy.yaml"))
    assert done.returncode == 1, done.stderr
    assert (f"{conf}:{line}: squid's dst ACLs let it reach only 10.0.0.0/8, and egresswall refuses every one of "
            "these addresses without a rule (a non-global one unless addresses.allow re-admits it, cloud metadata "
            "always); a dst ACL never admits anything in egresswall (it becomes addresses.deny of every other "
            "range, and host rules still decide first), so the imported policy admits no request at all; import "
            "with --readmit CIDR for the ranges you mean to reach") in done.stderr
    assert f"egresswall: {conf}: import FAILED: the imported policy refuses every request squid allows" in done.stderr
    assert "squid's dst ACLs let it reach only 10.0.0.0/8" in (tmp_path / "policy.yaml").read_text()  # the comment
    # Re-admitted, the same squid.conf imports: the policy reaches 10.0.0.0/8 and nothing else.
    done = run_import(conf, "--readmit", "10.0.0.0/8", "-o", str(tmp_path / "readmitted.yaml"))
    assert done.returncode == 0 and "dst ACLs let it reach only" not in done.stderr, done.stderr
    result = import_text(conf_text, "squid.conf", ["10.0.0.0/8"])
    assert not result.admits_nothing and result.policy.addresses.check("10.0.0.1").allowed
    assert not result.policy.addresses.check("8.8.8.8").allowed


def test_dst_acls_of_global_ranges_import_without_that_warning() -> None:
    result = import_text("acl x dst 8.8.8.0/24\nhttp_access allow x\n")
    assert not result.admits_nothing and not result.warnings
    assert result.policy.addresses.check("8.8.8.8").allowed and not result.policy.addresses.check("8.8.4.4").allowed


def test_url_regex_deny_leaves_tunnels_to_the_other_lines(tmp_path: Path) -> None:
    # The case: one url_regex deny line used to empty the policy (connect: [], exit 0).
    conf = tmp_path / "squid.conf"
    conf.write_text("acl localnet src 10.0.0.0/8\nacl SSL_ports port 443\nacl CONNECT method CONNECT\n"
                    "acl sites dstdomain .example.com\nacl exe url_regex -i \\.(exe|msi)$\n"
                    "http_access deny CONNECT !SSL_ports\nhttp_access deny exe\n"
                    "http_access allow localnet sites\nhttp_access deny all\n")
    out = tmp_path / "policy.yaml"
    done = run_import(conf, "-o", str(out))
    assert done.returncode == 0, done.stderr
    load_policy_file(out)
    result = import_conf(conf)
    assert "connect: [443]" in out.read_text()
    assert allowed(result, "www.example.com:443", "CONNECT", client="10.1.2.3")
    assert not allowed(result, "other.org:443", "CONNECT", client="10.1.2.3")
    assert not allowed(result, "http://www.example.com/setup.exe", client="10.1.2.3")  # squid refuses it
    assert f"{conf}:5: note: acl exe url_regex \\.(exe|msi)$: cannot match a tunnel's URL" in done.stderr
    assert f"{conf}:7: warning: http_access deny exe: squid's answer depends on ACLs" in done.stderr


@pytest.mark.parametrize("regex, tunnel_safe", [
    (r"\.exe$", True), (r"\.(exe|msi)$", True), (r"/download/", True), (r"^http://", True), (r"\?id=", True),
    (r"[.]exe$", True), (r"example", False), (r":443$", False), (r"\.(exe|[0-9])$", False), (r".*", False),
    (r"(/x)?y$", True), (r"(/x)?1$", False),
])
def test_url_regex_is_decided_for_tunnels_only_when_no_authority_can_match(regex: str, tunnel_safe: bool) -> None:
    from squid_compat.urlregex import never_matches_authority
    assert never_matches_authority(regex, icase=True) is tunnel_safe


@settings(max_examples=200, deadline=None)
@given(st.from_regex(r"[a-z0-9.-]{1,20}(\.[a-z]{2,5})?", fullmatch=True), st.integers(1, 65535),
       st.sampled_from([r"\.exe$", r"/download/", r"^http://", r"(/x)?y$", r"[.]exe$", r"\?id="]))
def test_a_regex_called_tunnel_safe_never_matches_an_authority(host: str, port: int, regex: str) -> None:
    from squid_compat.urlregex import never_matches_authority
    assert never_matches_authority(regex, icase=True)
    import re as regex_module
    for authority in (f"{host}:{port}", f"[{host.replace('.', ':')}]:{port}"):
        assert regex_module.search(regex, authority, regex_module.IGNORECASE) is None


def test_cli_import_says_which_non_global_ranges_squid_allowed_and_how_to_readmit(tmp_path: Path) -> None:
    conf = tmp_path / "squid.conf"
    conf.write_text("acl private dst 10.0.0.0/8 192.168.0.0/16\nacl d dstdomain .example.com\n"
                    "http_access deny private\nhttp_access allow d\n")
    done = run_import(conf, "--quiet")
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stderr.splitlines() if "non-global ranges" in line)
    assert "100.64.0.0/10" in line and "127.0.0.0/8" in line and "172.16.0.0/12" in line
    assert "10.0.0.0/8" not in line and "192.168.0.0/16" not in line  # squid refuses these too
    assert "addresses.allow" in line and "--readmit" in line
    readmitted = run_import(conf, "--readmit", "100.64.0.0/10")
    assert "100.64.0.0/10" not in next(line for line in readmitted.stderr.splitlines() if "non-global" in line)


def test_corporate_squid_conf_keeps_each_client_class(tmp_path: Path) -> None:
    (tmp_path / "build-domains.txt").write_text(".github.com\n.pypi.org\nfiles.pythonhosted.org\n")
    (tmp_path / "staff-domains.txt").write_text(".example.com\n# a comment\n.wikipedia.org\n")
    conf = tmp_path / "squid.conf"
    conf.write_text(CORPORATE.format(dir=tmp_path))
    out = tmp_path / "policy.yaml"
    done = run_import(conf, "-o", str(out))
    assert done.returncode == 0, done.stderr
    load_policy_file(out)
    result = import_conf(conf)
    build, staff, outsider = "10.20.1.1", "10.1.1.1", "203.0.113.9"
    # For each client class, what squid admits over a tunnel, egresswall admits; what squid refuses, it refuses.
    cases = [(build, "github.com", True), (build, "api.github.com", True), (build, "files.pythonhosted.org", True),
             (build, "www.example.com", False), (build, "other.org", False),
             (staff, "www.example.com", True), (staff, "en.wikipedia.org", True), (staff, "github.com", False),
             (outsider, "www.example.com", False)]
    for client, host, squid_allows in cases:
        assert result.squid_outcome(client, "connect", "CONNECT", 443, host, PUBLIC).allowed is squid_allows
        assert allowed(result, f"{host}:443", "CONNECT", client=client) is squid_allows, (client, host)
        assert not allowed(result, f"{host}:8443", "CONNECT", client=client)
        assert not allowed(result, f"http://{host}/tool.exe", client=client)
    assert not allowed(result, "github.com:443", "CONNECT", client=build, addresses=("10.0.0.7",))  # dst deny
    # Lines it cannot translate: file:line and their effect.
    for number, text in [(16, "http_access deny executables: squid's answer depends on ACLs egresswall cannot "
                               "decide"),
                         (21, "cache_peer: squid forwards through a parent proxy; egresswall connects directly"),
                         (23, "ssl_bump: squid decrypts TLS here; egresswall passes TLS through")]:
        assert f"{conf}:{number}: warning: {text}" in done.stderr


# ---- read as squid reads it (review round 17) ----------------------------------------------------------------
# Each case was measured against real squid 5.7 (the reviewer's reproductions; tests/test_squid_differential.py's
# "squid-syntax" configuration runs the same constructs through a real squid).

def test_acl_names_are_case_insensitive_as_in_squid() -> None:
    # squid finds ACLs with strcasecmp: 'acl bad' and 'acl BAD' are one ACL, and 'deny Bad' uses it.
    result = imported("acl bad dstdomain .evil.test\nacl BAD dstdomain .evil2.test\nacl Both any-of BAD\n"
                      "http_access deny Bad\nhttp_access deny BOTH\nhttp_access allow ALL\n")
    assert not allowed(result, "http://evil.test/")
    assert not allowed(result, "http://evil2.test/")
    assert not allowed(result, "http://x.evil2.test/")
    assert allowed(result, "http://good.test/")
    assert "not defined" not in warnings_text(result)
    # 'ALL' is squid's predefined all: a dst deny with it is still an address rule.
    dst = imported("acl Bad dst 93.184.216.0/24\nhttp_access deny BAD ALL\nhttp_access allow all\n")
    assert [cidr for _, cidr, _ in dst.policy.address_rules_text] == ["93.184.216.0/24"]


def test_an_acl_used_before_it_is_defined_is_undecided() -> None:
    # squid looks the name up when it reads the line, and refuses to start when it is not defined yet.
    result = imported("http_access allow late\nacl late dstdomain .example.com\n")
    assert "squid.conf:1: warning: http_access allow late: acl late is not defined before this line" in \
        warnings_text(result)
    assert not allowed(result, "http://www.example.com/")


def test_method_values_are_case_insensitive_as_in_squid() -> None:
    result = imported("acl m method get connect\nhttp_access deny m\nhttp_access allow all\n")
    assert not allowed(result, "http://any.test/", "GET")
    assert not allowed(result, "any.test:443", "CONNECT")
    assert result.squid_outcome(CLIENT, "http", "HEAD", 80, "any.test", PUBLIC).allowed
    assert "case-sensitively" not in "\n".join(map(str, result.notes))


def test_an_extension_method_is_compared_as_written_so_it_is_undecided() -> None:
    # PATCH is not among squid 5.7's methods: 'acl m method PATCH' matches "PATCH" only, not "patch", which
    # egresswall (comparing methods upper-cased) cannot tell apart.
    result = imported("acl m method PATCH\nhttp_access allow m\nhttp_access deny all\n")
    assert not allowed(result, "http://any.test/", "PATCH")
    assert "squid matches only a request whose method is written exactly 'PATCH'" in \
        "\n".join(map(str, result.notes))


def test_an_access_line_without_acls_is_skipped_as_squid_does() -> None:
    text = ("acl good dstdomain .good.test\nhttp_access allow good\nhttp_access allow   # TODO: add the build farm\n"
            "http_access deny all\n")
    result = imported(text)
    assert not allowed(result, "http://other.test/")
    assert allowed(result, "http://www.good.test/")
    assert "squid.conf:3: warning: http_access allow   # TODO: add the build farm: no ACL on the line: squid " \
           "skips it" in warnings_text(result)
    # Skipped, it is not the last line either: the implicit default stays the opposite of 'allow good'.
    assert not allowed(imported("acl good dstdomain .good.test\nhttp_access allow good\nhttp_access deny\n"),
                       "http://other.test/")


@pytest.mark.parametrize("text", [
    "acl bad dstdomain .evil.test \\\n# .old.test\n    .evil2.test\nhttp_access deny bad\nhttp_access allow all\n",
    "acl bad dstdomain .evil.test \\\n\n    .evil2.test\nhttp_access deny bad\nhttp_access allow all\n",
    "acl bad dstdomain .evil.test \\\n  \t\n\\\n    .evil2.test\nhttp_access deny bad\nhttp_access allow all\n",
])
def test_comments_and_blank_lines_inside_a_continuation_are_skipped(text: str) -> None:
    result = imported(text)
    assert not allowed(result, "http://evil.test/")
    assert not allowed(result, "http://evil2.test/")
    assert allowed(result, "http://good.test/")


def test_a_continuation_joins_without_a_space_and_one_left_open_at_the_end_is_dropped() -> None:
    joined = imported("acl good dstdomain .good.test\\\n    .other.test\nhttp_access allow good\n")
    assert not allowed(joined, "http://good.test/")  # one value, .good.test.other.test
    assert allowed(joined, "http://good.test.other.test/")
    dropped = imported("acl bad dstdomain .evil.test\nhttp_access allow all\nhttp_access deny bad \\")
    assert allowed(dropped, "http://evil.test/")  # squid never processes the last line
    assert "ends with a '\\' continuation and no line follows: squid ignores it" in warnings_text(dropped)


@pytest.mark.parametrize("regex, host", [(r"tracker|\.evil\.test$", "tracker.other.test"),
                                         (r"^ads\.|\.evil\.test$", "ads.other.test")])
def test_a_regex_with_alternation_is_not_confined_to_one_domain(regex: str, host: str) -> None:
    result = imported(f"acl bad dstdom_regex {regex}\nhttp_access deny bad\nhttp_access allow all\n")
    assert not result.squid_outcome(CLIENT, "http", "GET", 80, host, PUBLIC).allowed  # squid refuses it
    assert not allowed(result, f"http://{host}/")
    assert "undecided for every host" in warnings_text(result)


@pytest.mark.parametrize("separator", ["\u00a0", "\x0b", "\x0c", "\x1c", "\x1f", "\u2028", "\x85"])
def test_only_squids_whitespace_separates_values(separator: str) -> None:
    # squid separates tokens at space, tab, CR and LF only: '.corp.test<sep>.test' is one value, never matching.
    result = imported(f"acl good dstdomain .corp.test{separator}.test\nhttp_access allow good\n")
    assert not allowed(result, "http://anything.test/")
    assert not allowed(result, "http://corp.test/")


def test_only_squids_whitespace_separates_values_in_a_value_file_too(tmp_path: Path) -> None:
    (tmp_path / "allow.txt").write_bytes(b".corp.test\x0c.test\n.corp.test\xe2\x80\xa8.test\n")
    result = imported(f'acl good dstdomain "{tmp_path / "allow.txt"}"\nhttp_access allow good\n')
    assert not allowed(result, "http://anything.test/")


def test_a_carriage_return_ends_squids_line() -> None:
    # squid cuts a line at its first CR: the rule after it, in a comment line, is part of the comment.
    result = imported("acl bad dstdomain .evil.test\n# old rule\rhttp_access allow all\nhttp_access deny bad\n"
                      "http_access allow all\n")
    assert not allowed(result, "http://evil.test/")
    assert allowed(result, "http://good.test/")


def test_a_nul_byte_ends_squids_line() -> None:
    result = imported("acl good dstdomain .good.test\0.evil\nhttp_access allow good\n")
    assert allowed(result, "http://www.good.test/")
    assert not allowed(result, "http://x.evil/")


def test_a_value_file_line_is_one_value_up_to_a_comment(tmp_path: Path) -> None:
    # squid 5.7 takes a value file's whole line, words and the spaces between them, up to a word starting with #.
    (tmp_path / "allow.txt").write_text(".good.test .other.test\n   # comment .commented.test\n"
                                        "\t.third.test # trailing\r\n.fourth.test#x\n")
    result = imported(f'acl good dstdomain "{tmp_path / "allow.txt"}"\nhttp_access allow good\nhttp_access deny all\n')
    assert not allowed(result, "http://good.test/")
    assert not allowed(result, "http://other.test/")
    assert not allowed(result, "http://commented.test/")
    assert allowed(result, "http://third.test/")
    assert not allowed(result, "http://fourth.test/")  # '.fourth.test#x' is the value


@pytest.mark.parametrize("acl_type, value", [("dst", "8.8.0.0/255.0.255.0"), ("dst", "8.0.0.0/255.0.0.0")])
def test_a_dotted_netmask_counts_its_leading_ones_as_squid_does(acl_type: str, value: str) -> None:
    # squid: "WARNING: For now we will assume you meant to write /8" (measured: 8.9.9.9 refused).
    result = imported(f"acl p {acl_type} {value}\nhttp_access deny p\nhttp_access allow all\n")
    for address in ("8.9.9.9", "8.200.1.1", "8.8.0.1"):
        assert not allowed(result, f"http://{address}/"), address
    assert allowed(result, "http://9.9.9.9/")


def test_src_netmasks_are_read_the_same_way() -> None:
    result = imported("acl lan src 10.0.0.0/255.0.255.0\nhttp_access deny lan\nhttp_access allow all\n")
    assert not allowed(result, "http://example.com/", client="10.9.9.9")
    assert allowed(result, "http://example.com/", client="11.9.9.9")


def test_a_zero_prefix_is_one_address_in_squid_except_its_spellings_of_all() -> None:
    # Measured, squid 5.7: 8.8.8.8/0 and ::/0 match that one address; 0.0.0.0/0 is 'all' (IPv6 included).
    lan = imported("acl lan src 10.0.0.1/0\nhttp_access allow lan\nhttp_access deny all\n")
    assert allowed(lan, "http://example.com/", client="10.0.0.1")
    assert not allowed(lan, "http://example.com/", client="10.0.0.2")
    every = imported("acl every src 0.0.0.0/0\nhttp_access deny every\nhttp_access allow all\n")
    assert not allowed(every, "http://example.com/", client="2001:db8::1")
    odd = imported("acl s dst ::1/255.255.255.0 10/8\nhttp_access allow s\nhttp_access deny all\n")
    assert "is not an address or range" in warnings_text(odd)


def test_a_file_name_cannot_write_into_the_policy(tmp_path: Path) -> None:
    # An included file whose name holds newlines and YAML: the warning quoting it went into the top comment block
    # unescaped, after the check, and re-admitted every address.
    (tmp_path / "conf.d").mkdir()
    name = 'x\naddresses:\n  allow: ["0.0.0.0\\x2f0", "::\\x2f0"]\n#.conf'
    (tmp_path / "conf.d" / name).write_text("hosts_file /etc/hosts\n")
    (tmp_path / "squid.conf").write_text(f"acl good dstdomain .good.test\ninclude {tmp_path}/conf.d/*.conf\n"
                                         "http_access allow good\n")
    result = import_conf(tmp_path / "squid.conf")
    assert "x\\x0aaddresses:" in result.yaml
    assert all(line.startswith("#") for line in result.yaml.split("version: 1")[0].splitlines())
    policy = load_policy_file_text(tmp_path, result.yaml)
    assert not policy.addresses.check("10.0.0.1").allowed
    assert [cidr for _, cidr, _ in policy.address_rules_text] == []


@pytest.mark.parametrize("character", ["\x0b", "\x85", "\u2028", "\x1b", "\udcff"])
def test_text_quoted_in_comments_is_escaped(character: str) -> None:
    result = imported(f"acl d dstdomain bad{character}.example. good.example\nhttp_access allow d\n")
    policy = parse_policy(result.yaml, "imported.yaml")  # a NEL or a line separator would end the comment
    assert policy.allow.rules[0].pattern.text == "good.example"
    assert character not in result.yaml


def test_the_commented_policy_must_say_what_was_checked() -> None:
    checked = "version: 1\ndefault: deny\n"
    importer.same_document("# a comment\n" + checked, checked, "p.yaml")
    with pytest.raises(RuntimeError, match="changed what it says"):
        importer.same_document("default: allow\n# a comment\nversion: 1\n", checked, "p.yaml")


@pytest.mark.parametrize("regex, tunnel_safe", [
    (r"\x2fdl", False), (r"\d/", False), (r"[\.]exe$", False), (r"(?i)\.exe$", False),
    (r"a{99999999999999999999}/", False),
])
def test_url_regex_is_proved_only_when_python_reads_it_as_squid_does(regex: str, tunnel_safe: bool) -> None:
    from squid_compat.urlregex import never_matches_authority
    assert never_matches_authority(regex, icase=False) is tunnel_safe


def test_url_regex_with_a_python_only_escape_leaves_tunnels_undecided() -> None:
    # squid reads \x2f as the letters x2f: 'x2fdl' matches CONNECT x2fdl.test:443 (measured), which squid refuses.
    result = imported("acl bad url_regex \\x2fdl\nacl good dstdomain .x2fdl.test\nhttp_access deny bad\n"
                      "http_access allow good\nhttp_access deny all\n")
    assert not allowed(result, "x2fdl.test:443", "CONNECT")
    assert "'\\x' means different things to Python and to squid's POSIX regex" in warnings_text(result)


@pytest.mark.parametrize("line", [
    "acl r dstdom_regex a{99999999999999999999}",
    "acl r url_regex a{99999999999999999999}",
    "acl r dstdom_regex " + "(" * 4000 + "a" + ")" * 4000,
    "acl r url_regex " + "(" * 4000 + "a" + ")" * 4000,
    "acl r dstdom_regex a{2,1}",
])
def test_regexes_python_cannot_take_are_warnings_not_crashes(line: str) -> None:
    result = imported(f"{line}\nhttp_access deny r\nhttp_access allow all\n")
    assert "squid.conf:1: warning: acl r" in warnings_text(result)
    assert not allowed(result, "http://example.org/")


def test_an_unknown_directive_stops_the_import_as_it_stops_squid() -> None:
    with pytest.raises(ConfError, match="squid.conf:2: unrecognized directive 'http_acess'"):
        imported("acl bad dstdomain .evil.test\nhttp_acess deny bad\nhttp_access allow all\n")
    with pytest.raises(ConfError, match="squid.conf:1: unrecognized directive 'version:'"):
        imported("version: 1\ndefault: allow\n")  # a policy, not a squid.conf
    # Directives squid knows and the import does not translate are notes.
    result = imported("visible_hostname proxy\nhttp_access2 deny all\nhttp_access allow all\n")
    assert "squid.conf:1: note: visible_hostname: not access control" in "\n".join(map(str, result.notes))
    assert not allowed(result, "http://example.org/")  # http_access2 is adapted_http_access


def test_an_include_that_matches_nothing_stops_the_import(tmp_path: Path) -> None:
    (tmp_path / "squid.conf").write_text(f"include {tmp_path}/conf.d/*.conf\nhttp_access allow all\n")
    with pytest.raises(ConfError, match="squid refuses to start"):
        import_conf(tmp_path / "squid.conf")


@pytest.mark.parametrize("text, status, message", [
    ("acl bad dstdomain .evil.test\nhttp_acess deny bad\nhttp_access allow all\n", 2,
     "squid.conf:2: unrecognized directive 'http_acess'"),
    ("version: 1\ndefault: allow\n", 2, "squid.conf:1: unrecognized directive 'version:'"),
    ("", 1, "import FAILED: it has no http_access line (squid then refuses every request)"),
    ("# only comments\nacl d dstdomain .example.com\n", 1, "import FAILED: it has no http_access line"),
])
def test_cli_import_of_what_is_no_squid_conf_fails(tmp_path: Path, text: str, status: int, message: str) -> None:
    conf = tmp_path / "squid.conf"
    conf.write_text(text)
    done = run_import(conf, "-o", str(tmp_path / "policy.yaml"))
    assert done.returncode == status, done.stderr
    assert message in done.stderr


def test_cli_readmit_that_is_no_range_is_a_usage_error(tmp_path: Path) -> None:
    conf = tmp_path / "squid.conf"
    conf.write_text("http_access allow all\n")
    done = run_import(conf, "--readmit", "bogus")
    assert done.returncode == 2
    assert "usage:" in done.stderr and "argument --readmit: 'bogus' is not an address range" in done.stderr
    assert "internal error" not in done.stderr


def load_policy_file_text(tmp_path: Path, text: str):
    path = tmp_path / "written.yaml"
    path.write_text(text)
    return load_policy_file(path)


def test_relaxed_header_parser_off_makes_every_method_case_sensitive() -> None:
    # squid then compares GET as written too: egresswall (methods upper-cased) cannot tell GET from get.
    text = ("relaxed_header_parser off\nacl m method GET\nacl d dstdomain .example.com\nhttp_access allow m d\n"
            "http_access deny all\n")
    assert not allowed(imported(text), "http://www.example.com/", "GET")
    assert allowed(imported(text.replace("off", "on")), "http://www.example.com/", "GET")


def test_quoted_values_on_is_refused() -> None:
    # squid then reads "..." as a quoted value and parameters("...") as a file: another language.
    with pytest.raises(ConfError, match="squid.conf:1: configuration_includes_quoted_values on"):
        imported('configuration_includes_quoted_values on\nacl d dstdomain "/etc/sites"\nhttp_access allow d\n')


def test_parameters_is_a_value_like_any_other_with_quoted_values_off(tmp_path: Path) -> None:
    # squid 5.7 (measured with squid -k parse): parameters("/nonexistent") is no file, it is the value itself.
    (tmp_path / "sites.txt").write_text(".example.com\n")
    result = imported(f'acl d dstdomain parameters("{tmp_path / "sites.txt"}")\nhttp_access allow d\n')
    assert not allowed(result, "http://www.example.com/")
