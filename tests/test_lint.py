"""``lint``: expired and expiring entries, rules that can never match, shadowed rules, overlapping
ranges and roles; and the exit codes of ``egresswall lint``."""

from __future__ import annotations

import re
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from policy.lint import lint
from policy.loader import parse_policy
from proxy.policy_file import DEFAULT_POLICY, load_policy_file

NOW = datetime(2030, 1, 1, tzinfo=UTC)
EXAMPLE = Path(DEFAULT_POLICY).parent / "examples" / "allowlist.yaml"
REPO = Path(__file__).resolve().parent.parent


def warnings(body: str, now: datetime = NOW) -> list[str]:
    return [str(w) for w in lint(parse_policy("version: 1\n" + body, "p.yaml"), now=now)]


def only(body: str, now: datetime = NOW) -> str:
    found = warnings(body, now)
    assert len(found) == 1, found
    return found[0]


def test_clean_policies_have_no_warnings() -> None:
    assert lint(load_policy_file(), now=NOW) == []
    assert lint(load_policy_file(EXAMPLE), now=datetime(2026, 1, 1, tzinfo=UTC)) == []
    body = """\
default: deny
hosts:
  deny: [.ads.example.com]
  allow:
    - host: a.example.com
      ports: [443]
    - a.example.com
    - host: api.example.com
      paths: [/v1/]
      intercept: true
    - host: later.example.com
      expires: '2031-01-01'
addresses:
  allow: [198.18.0.0/15]
  deny: [203.0.113.0/24]
roles:
  - name: a
    clients: [10.0.0.0/16]
  - name: b
    clients: [10.1.0.0/16]
"""
    assert warnings(body) == []


def test_expired_entry() -> None:
    body = "hosts:\n  allow:\n    - host: old.example.com\n      expires: '2029-12-31T23:59:59Z'\n"
    assert only(body) == ("p.yaml:4:7: hosts.allow[0]: allow old.example.com expired at 2029-12-31 23:59 UTC "
                          "and no longer matches")


def test_expired_exactly_now() -> None:
    # A bare date is the whole day (UTC): '2029-12-31' stops matching at 2030-01-01 00:00, which is NOW.
    body = "hosts:\n  deny:\n    - host: old.example.com\n      expires: '2029-12-31'\n"
    assert "expired at 2030-01-01 00:00 UTC" in only(body)
    today = "hosts:\n  deny:\n    - host: old.example.com\n      expires: '2030-01-01'\n"
    assert "stops matching at 2030-01-02 00:00 UTC" in only(today)  # still matches today


def test_soon_expiring_entry() -> None:
    body = "hosts:\n  allow:\n    - host: soon.example.com\n      expires: '2030-01-10'\n"
    assert only(body) == "p.yaml:4:7: hosts.allow[0]: allow soon.example.com stops matching at 2030-01-11 00:00 UTC"
    later = "hosts:\n  allow:\n    - host: later.example.com\n      expires: '2030-03-01'\n"
    assert warnings(later) == []


def test_rule_port_not_in_port_lists() -> None:
    body = ("ports:\n  connect: [443]\n  http: [80]\n"
            "hosts:\n  allow:\n    - host: p.example.com\n      ports: [80, 8443]\n")
    message = only(body)
    assert message.startswith("p.yaml:7:7: hosts.allow[0]: p.example.com: port(s) [8443] are in neither")


def test_path_rule_without_intercept() -> None:
    body = "hosts:\n  allow:\n    - host: path.example.com\n      paths: [/x/]\n"
    assert only(body).endswith("methods/paths cannot be checked inside a TLS tunnel without intercept: true; "
                               "it matches only plain-HTTP requests")
    tls_only = "hosts:\n  allow:\n    - host: m.example.com\n      methods: [GET]\n      schemes: [https]\n"
    assert only(tls_only).endswith("with only https/wss schemes it can never match")
    intercepted = "hosts:\n  allow:\n    - host: p.example.com\n      paths: [/x/]\n      intercept: true\n"
    assert warnings(intercepted) == []


@pytest.mark.parametrize("earlier, later", [
    (".example.com", "a.example.com"),
    (".example.com", "example.com"),
    (".example.com", "*.example.com"),
    (".example.com", ".a.example.com"),
    ("*.example.com", "a.b.example.com"),
    ("*.example.com", "*.a.example.com"),
    ("a.example.com", "A.example.com."),
])
def test_shadowed_rule(earlier: str, later: str) -> None:
    body = f"hosts:\n  allow:\n    - '{earlier}'\n    - '{later}'\n"
    assert only(body) == (f"p.yaml:5:7: hosts.allow[1]: {later} is shadowed by the earlier rule {earlier} "
                          "(p.yaml:4), which matches every request it would")


@pytest.mark.parametrize("earlier, later", [
    ("*.example.com", "example.com"),  # the apex is not below itself
    ("a.example.com", ".a.example.com"),
    ("example.com", "a.example.com"),
    (".example.org", "a.example.com"),
    (".ample.com", "example.com"),  # a suffix, not at a label boundary
])
def test_not_shadowed(earlier: str, later: str) -> None:
    assert warnings(f"hosts:\n  allow:\n    - '{earlier}'\n    - '{later}'\n") == []


def test_later_rule_does_not_shadow_an_earlier_one() -> None:
    assert warnings("hosts:\n  allow:\n    - a.example.com\n    - .example.com\n") == []


@pytest.mark.parametrize("condition", ["ports: [443]", "schemes: [https]", "methods: [GET]", "paths: [/x/]",
                                       "websocket: false", "expires: '2031-01-01'"])
def test_conditional_earlier_rule_does_not_shadow(condition: str) -> None:
    body = (f"hosts:\n  allow:\n    - host: .example.com\n      {condition}\n      intercept: true\n"
            "    - a.example.com\n")
    assert not any("shadowed" in w for w in warnings(body)), warnings(body)


def test_shadowing_in_deny_list_and_in_roles() -> None:
    deny = "hosts:\n  deny:\n    - .example.com\n    - a.example.com\n"
    assert only(deny).startswith("p.yaml:5:7: hosts.deny[1]: a.example.com is shadowed by the earlier rule")
    role = ("roles:\n  - name: ci\n    clients: [10.0.0.0/8]\n    hosts:\n      allow:\n"
            "        - .pypi.org\n        - files.pypi.org\n")
    assert only(role).startswith("p.yaml:8:11: roles[0].hosts.allow[1]: role ci: files.pypi.org is shadowed")


def test_allow_rule_blocked_by_unconditional_deny() -> None:
    body = "hosts:\n  deny:\n    - .blocked.example.com\n  allow:\n    - x.blocked.example.com\n"
    assert only(body) == ("p.yaml:6:7: hosts.allow[0]: allow x.blocked.example.com can never match: deny rule "
                          ".blocked.example.com (p.yaml:4) refuses every host it names")


def test_allow_rule_not_blocked_by_conditional_deny() -> None:
    body = ("hosts:\n  deny:\n    - host: .blocked.example.com\n      ports: [80]\n"
            "  allow:\n    - x.blocked.example.com\n")
    assert warnings(body) == []


def test_role_allow_rule_blocked_by_global_deny() -> None:
    body = ("hosts:\n  deny: [.blocked.example.com]\nroles:\n  - name: ci\n    clients: [10.0.0.0/8]\n"
            "    hosts:\n      allow: [a.blocked.example.com]\n")
    assert "role ci: allow a.blocked.example.com can never match: deny rule .blocked.example.com (p.yaml:3)" in only(
        body)


def test_overlapping_cidrs_in_one_list() -> None:
    body = "addresses:\n  allow:\n    - 198.18.0.0/15\n    - 198.18.4.0/24\n"
    assert only(body) == "p.yaml:5:7: addresses.allow[1]: addresses.allow 198.18.4.0/24 overlaps 198.18.0.0/15"


def test_overlapping_cidrs_allow_and_deny() -> None:
    body = "addresses:\n  allow: [198.18.0.0/15]\n  deny: [198.19.0.0/16]\n"
    assert only(body) == ("p.yaml:4:10: addresses.deny[0]: 198.19.0.0/16 is in both addresses.allow and "
                          "addresses.deny (with 198.18.0.0/15); deny wins")


def test_disjoint_and_cross_family_cidrs_do_not_overlap() -> None:
    body = "addresses:\n  allow: [198.18.0.0/16, 198.19.0.0/16, 'fd00::/8']\n  deny: ['2001:db8::/32']\n"
    assert warnings(body) == []


def test_overlapping_role_clients() -> None:
    body = ("roles:\n  - name: wide\n    clients: [10.0.0.0/8]\n  - name: narrow\n"
            "    clients: ['10.1.0.0/16', '192.168.0.0/16']\n")
    assert only(body) == ("p.yaml:5:5: roles[1]: role narrow's clients overlap role wide's (10.1.0.0/16); "
                          "the first role, wide, wins")


# --- the command ---------------------------------------------------------------------------------------

def run_lint(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "proxy.cli", "lint", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=60)


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    clean = tmp_path / "clean.yaml"
    clean.write_text("version: 1\ndefault: deny\nhosts:\n  allow: [.example.com]\n")
    warned = tmp_path / "warned.yaml"
    warned.write_text("version: 1\ndefault: deny\nhosts:\n  allow:\n    - .example.com\n    - a.example.com\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\ndefault: deny\nhosts:\n  allow:\n    - a.*.example.com\n")
    return {"clean": clean, "warned": warned, "bad": bad}


@pytest.mark.parametrize("name, strict, code", [
    ("clean", False, 0), ("clean", True, 0),
    ("warned", False, 0), ("warned", True, 1),
    ("bad", False, 2), ("bad", True, 2),
])
def test_lint_exit_codes(files: dict[str, Path], name: str, strict: bool, code: int) -> None:
    result = run_lint(str(files[name]), *(["--strict"] if strict else []))
    assert result.returncode == code, result.stdout + result.stderr
    path = files[name]
    if name == "bad":
        assert result.stderr.startswith(f"egresswall: {path}:5:7: hosts.allow[0]: host pattern 'a.*.example.com'")
        assert result.stdout == ""
    elif name == "warned":
        assert f"warning: {path}:6:7: hosts.allow[1]: a.example.com is shadowed" in result.stdout
        assert result.stdout.rstrip().endswith("valid; 2 host rule(s), 0 role(s), 1 warning(s)")
    else:
        assert result.stdout == f"{path}: valid; 1 host rule(s), 0 role(s), 0 warning(s)\n"


def test_lint_missing_file(tmp_path: Path) -> None:
    result = run_lint(str(tmp_path / "nope.yaml"))
    assert result.returncode == 2
    assert result.stderr == f"egresswall: {tmp_path / 'nope.yaml'}: no such file\n"


def test_deny_rule_with_paths_on_a_host_that_is_not_intercepted_is_flagged() -> None:
    from policy.lint import lint
    from policy.loader import parse_policy

    text = "version: 1\ndefault: allow\nhosts:\n  deny:\n    - host: a.example.com\n      paths: [/admin]\n"
    messages = [w.message for w in lint(parse_policy(text, "p.yaml"))]
    assert any("checked only in plain HTTP" in m for m in messages)
    intercepted = text + "  allow:\n    - host: a.example.com\n      intercept: true\n"
    assert not any("checked only in plain HTTP" in w.message for w in lint(parse_policy(intercepted, "p.yaml")))


# --- every error at once -------------------------------------------------------------------------------

MANY_ERRORS = """version: 1
default: nope
hosts:
  allow:
    - user@example.com
    - good.example.com
    - host: a.example.com
      prots: [443]
  deny:
    - a..b.example.com
addresses:
  allow: [10.0.0.1/8]
roles:
  - name: ci
    clients: [10.20.0.0/16]
    hosts:
      allow: [localhost]
resolver:
  ttl_floor: 600
  ttl_ceiling: 60
mode: enforce
mode: report
"""


def test_lint_shows_every_error_in_file_order_with_positions(tmp_path: Path) -> None:
    path = tmp_path / "many.yaml"
    path.write_text(MANY_ERRORS)
    result = run_lint(str(path))
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.splitlines()
    expected = [
        (2, 10, "default: got 'nope'"),
        (5, 7, "hosts.allow[0]: host pattern 'user@example.com': userinfo"),
        (8, 7, "hosts.allow[2].prots: unknown key 'prots'"),
        (10, 7, "hosts.deny[0]: host pattern 'a..b.example.com': empty-label"),
        (12, 11, "addresses.allow[0]: got '10.0.0.1/8'; expected an address or CIDR range (host bits are set"),
        (17, 15, "roles[0].hosts.allow[0]: host pattern 'localhost'"),
        (19, 14, "resolver.ttl_floor: ttl_floor is greater than ttl_ceiling"),
        (22, 1, "mode: duplicate key (first written on line 21)"),
    ]
    assert len(lines) == len(expected), result.stderr
    for line, (row, column, words) in zip(lines, expected, strict=True):
        assert line.startswith(f"egresswall: {path}:{row}:{column}: {words}"), line


# --- host allow rules naming an address the address rules refuse ----------------------------------------

def test_allow_rule_naming_a_private_address_is_flagged() -> None:
    message = only("hosts:\n  allow:\n    - 10.0.0.5\n")
    assert message.startswith("p.yaml:4:7: hosts.allow[0]: allow 10.0.0.5 can never be reached: 10.0.0.5 is in "
                              "10.0.0.0/8 (Private-Use, RFC 1918)"), message
    assert message.endswith("which is not global unicast; only an addresses.allow range re-admits it (e.g. "
                            "10.0.0.5/32), a host allow rule cannot"), message  # said once, not twice


EVERY_KIND = """\
version: 1
default: deny
hosts:
  deny:
    - "*.ads.example.com"
    - host: d.example.com
      paths: ["/x"]
  allow:
    - 10.0.0.5
    - 169.254.169.254
    - 8.8.8.8
    - .example.org
    - a.example.org
    - x.ads.example.com
    - host: old.example.com
      expires: 2020-01-01
    - host: soon.example.com
      expires: 2026-12-10
    - host: p.example.com
      ports: [22]
    - host: m.example.com
      methods: [GET]
addresses:
  allow: [198.18.0.0/15, 198.18.0.0/16]
  deny: [198.18.1.0/24, 8.8.8.0/24]
roles:
  - name: a
    clients: [10.0.0.0/8]
  - name: b
    clients: [10.1.0.0/16]
"""


def test_every_warning_is_one_line_worded_alike() -> None:
    """Each warning is one clause after its place: no second sentence, no final full stop (the address
    literal's warning once ended '... cannot. A host allow rule does not re-admit an address; ...')."""
    warnings = [str(w) for w in lint(parse_policy(EVERY_KIND, "p.yaml"), now=datetime(2026, 12, 1, tzinfo=UTC))]
    assert len(warnings) == 14, "\n".join(warnings)
    for warning in warnings:
        assert re.match(r"p\.yaml:\d+:\d+: [\w.\[\]]+: [a-z0-9.*\[]", warning), warning
        assert "\n" not in warning and not warning.endswith("."), warning
        assert not re.search(r"\.\s+[A-Z]", warning), warning  # one sentence


@pytest.mark.parametrize("body, words", [
    ("hosts:\n  allow:\n    - '[fd00::1]'\n", "fd00::1 is in fc00::/7"),
    ("hosts:\n  allow:\n    - 169.254.169.254\naddresses:\n  allow: [169.254.0.0/16]\n", "cloud metadata"),
    ("roles:\n  - name: ci\n    clients: [10.20.0.0/16]\n    hosts:\n      allow: ['127.0.0.1']\n",
     "role ci: allow 127.0.0.1 can never be reached"),
])
def test_other_unreachable_address_literals(body: str, words: str) -> None:
    assert words in only(body)


@pytest.mark.parametrize("body", [
    "hosts:\n  allow:\n    - 10.0.0.5\naddresses:\n  allow: [10.0.0.0/24]\n",  # re-admitted: fine
    "hosts:\n  allow:\n    - 93.184.216.34\n",  # global
    "hosts:\n  deny:\n    - 10.0.0.5\n",  # a deny rule narrows; nothing to say
    "hosts:\n  allow:\n    - a10.example.com\n",
])
def test_address_literals_that_can_work_are_not_flagged(body: str) -> None:
    assert warnings(body) == []


@pytest.mark.parametrize("text, warned", [
    ("default: allow\nsession: required\n", True),
    ("default: allow\nroles:\n  - name: agents\n    clients: [10.0.0.0/8]\n    session: required\n", True),
    ("default: allow\nsession: required\ntls:\n  ech: refuse\n", False),
    ("default: allow\nsession: required\ntls:\n  ech: allow\n", False),  # said outright: accepted
    ("default: allow\nsession: required\nhosts:\n  deny: [ads.example]\n", False),  # ECH refused already
    ("default: deny\nsession: required\nhosts:\n  allow: [a.example]\n", False),
    ("default: allow\n", False),  # no session to dodge
])
def test_sessions_on_an_open_web_policy_that_lets_ech_through_are_warned_of(text, warned):
    """A session's grants are dodged by ECH where the policy lets it through unset; lint says so and how to close
    it (tls.ech: refuse), and says nothing once tls.ech is set or ECH is refused anyway."""
    found = [w for w in lint(parse_policy("version: 1\n" + text, "p.yaml")) if "Encrypted Client Hello" in w.message]
    assert bool(found) is warned, found
    if warned:
        assert "tls: {ech: refuse}" in found[0].message and found[0].origin.line == 2


# --- review round 16 (a newcomer's review): rules that cannot do what they seem to ---------------------------

def test_a_single_label_name_can_never_match() -> None:
    message = only("hosts:\n  allow:\n    - intranet\n    - .intranet\n    - '*.corp'\n")
    assert message == ("p.yaml:4:7: hosts.allow[0]: allow intranet can never match: egresswall refuses a host name "
                       "of one label (form:no-dot) before any host rule; name the host in full"), message


@pytest.mark.parametrize("written, words", [
    ("http://x.example.com/", "a host pattern is a name, not a URL"),
    ("x.example.com:443", "a host pattern has no port; write the host alone and put the port in the rule's ports:"),
])
def test_a_url_or_a_port_in_a_host_list_is_named_as_such(tmp_path: Path, written: str, words: str) -> None:
    """Any ':' was read as the start of an IPv6 literal: "ipv6: not a valid IPv6 literal"."""
    path = tmp_path / "p.yaml"
    path.write_text(f"version: 1\ndefault: deny\nhosts:\n  allow:\n    - '{written}'\n")
    result = run_lint(str(path))
    assert result.returncode == 2 and words in result.stderr and "IPv6" not in result.stderr, result.stderr
    assert result.stderr.startswith(f"egresswall: {path}:5:7: hosts.allow[0]: host pattern {written!r}")


def test_lint_warns_of_an_allow_rule_that_takes_in_a_whole_public_suffix(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("version: 1\ndefault: deny\nhosts:\n  allow: [.com, '*.co.uk', .github.io, github.io, "
                    "docs.example.com]\n  deny: [.net]\n")
    result = run_lint("--strict", str(path))
    assert result.returncode == 1, result
    warned = [line for line in result.stdout.splitlines() if "public suffix" in line]
    assert [w.split(": ", 3)[2] for w in warned] == ["hosts.allow[0]", "hosts.allow[1]", "hosts.allow[2]"], warned
    assert "allow .com takes in every name under the public suffix com" in warned[0]
    assert "public suffix github.io" in warned[2] and "example.github.io" in warned[2]


@pytest.mark.parametrize("written, read_as", [("ⓐ.example.com", "a.example.com"),
                                              ("exa\u200bmple.com", "example.com"),
                                              ("*.ｅｘａｍｐｌｅ.com", "*.example.com")])
def test_a_pattern_that_idna_maps_to_another_host_is_said(written: str, read_as: str) -> None:
    """``ⓐ.com`` allowed a.com with no word; its rule id and metric label kept the written form (review round 16)."""
    message = only(f"hosts:\n  allow:\n    - '{written}'\n")
    assert f"is read as {read_as!r}" in message and message.startswith("p.yaml:4:7: hosts.allow[0]: "), message


def test_an_idn_written_as_a_browser_reads_it_is_no_warning() -> None:
    assert warnings("hosts:\n  allow:\n    - bücher.example\n    - Bücher.example.org\n") == []


@pytest.mark.parametrize("written, family", [("0.0.0.0/0", "IPv4"), ("'::ffff:0:0/96'", "IPv4"), ("'::/0'", "IPv6")])
def test_an_allow_range_of_a_whole_address_family_is_said(written: str, family: str) -> None:
    """``::ffff:0:0/96`` is read as the IPv4 it maps, all of it: loopback and private ranges are re-admitted with
    no word (review round 22, a helper's note). Warned, for each spelling of a whole family."""
    message = only(f"addresses:\n  allow: [{written}]\n")
    assert f"re-admits every {family} address" in message and "addresses.allow[0]" in message, message


def test_an_allow_range_short_of_a_whole_family_is_no_such_warning() -> None:
    assert not [w for w in warnings("addresses:\n  allow: [10.0.0.0/8, '::/96']\n") if "re-admits every" in w]
