"""The policy loader: the bundled files load and agree with schema.json; every bad file fails with
``file:line:column``, the key and what was expected; overrides add (or replace) with their origin."""

from __future__ import annotations

import json
import os
import re
from datetime import UTC, datetime
from pathlib import Path

import jsonschema
import pytest
import yaml

from policy.loader import Overrides, PolicyError, parse_policy
from policy.model import ALLOW, DENY, ENFORCE
from policy.patterns import PatternKind
from proxy.policy_file import DEFAULT_POLICY, load_policy_file

POLICY_DIR = Path(DEFAULT_POLICY).parent
EXAMPLE = POLICY_DIR / "examples" / "allowlist.yaml"
SCHEMA = json.loads((POLICY_DIR / "schema.json").read_text())


class EditorLoader(yaml.SafeLoader):
    """How an editor's YAML language server reads the file: YAML 1.2 core, so dates, yes/no and 0443
    are text. Independent of policy.loader on purpose."""


EditorLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers
            if tag not in ("tag:yaml.org,2002:timestamp", "tag:yaml.org,2002:bool", "tag:yaml.org,2002:int")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
EditorLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|false)$"), list("tf"))
EditorLoader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^[-+]?(?:0|[1-9][0-9]*)$"),
                                   list("-+0123456789"))


def editor_errors(text: str) -> list[str]:
    validator = jsonschema.Draft202012Validator(SCHEMA)
    return [e.message for e in validator.iter_errors(yaml.load(text, Loader=EditorLoader))]


def load_error(text: str, source: str = "p.yaml", overrides: Overrides | None = None) -> PolicyError:
    with pytest.raises(PolicyError) as info:
        parse_policy(text, source, overrides)
    return info.value


# --- the bundled files --------------------------------------------------------------------------------

def test_schema_is_a_valid_draft_2020_12_schema() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


@pytest.mark.parametrize("path", [DEFAULT_POLICY, EXAMPLE], ids=["default.yaml", "allowlist.yaml"])
def test_bundled_policies_load_and_validate_in_an_editor(path: Path) -> None:
    text = Path(path).read_text()
    assert editor_errors(text) == []
    policy = load_policy_file(path)
    assert policy.source == str(path)
    assert policy.mode == ENFORCE


def test_default_policy_is_open_web_with_cloud_metadata_refused() -> None:
    policy = load_policy_file()  # None: the bundled default
    assert policy.default == ALLOW
    assert policy.connect_ports == {443, 80} and policy.http_ports == {80}  # 80: ws:// from a browser
    assert policy.addresses.refuse_cloud_metadata is True
    assert {r.pattern.text for r in policy.deny.rules} == {"update.googleapis.com", "accounts.google.com"}
    assert not policy.addresses.check("169.254.169.254").allowed
    assert not policy.addresses.check("168.63.129.16").allowed
    assert not policy.addresses.check("10.0.0.1").allowed
    assert policy.addresses.check("93.184.216.34").allowed


def test_example_allowlist_contents() -> None:
    policy = load_policy_file(EXAMPLE)
    assert policy.default == DENY
    kinds = {r.pattern.text: r.pattern.kind for r in policy.allow.rules}
    assert kinds[".wikipedia.org"] is PatternKind.DOMAIN
    assert kinds["*.cdn.example.com"] is PatternKind.SUBDOMAINS
    assert kinds["docs.python.org"] is PatternKind.EXACT
    api = next(r for r in policy.allow.rules if r.pattern.text == "api.example.com")
    assert api.intercept and api.methods == {"GET"} and api.paths == ("/v1/public/",)
    vendor = next(r for r in policy.allow.rules if r.pattern.text == "vendor.example.net")
    assert vendor.expires == datetime(2027, 7, 1, tzinfo=UTC)  # "expires: 2027-06-30": through the end of 30 June
    assert [role.name for role in policy.roles] == ["ci-runners"]
    # Each rule knows the line it was written on.
    lines = EXAMPLE.read_text().splitlines()
    for rule in policy.all_host_rules():
        assert rule.origin.source == str(EXAMPLE)
        assert rule.pattern.text.strip('"') in lines[rule.origin.line - 1]


def test_editor_and_loader_agree_on_bad_files() -> None:
    """Whatever the schema refuses in an editor, the loader refuses too."""
    for text in (
        "version: 1\nfoo: 1\n",
        "version: 1\ndefault: no\n",
        "version: 1\nports:\n  connect: [0443]\n",
        "version: 1\nhosts:\n  allow:\n    - host: a.example.com\n      websocket: yes\n",
        "version: 2\n",
    ):
        assert editor_errors(text), text
        load_error(text)


# --- bad files: each names file:line:column, the key and what was expected -----------------------------

BAD = [
    # id, text, (line, column), key, expected words
    ("unknown top-level key", "version: 1\nmode: enforce\nfoo: 1\n", (3, 1), "foo",
     "unknown key 'foo'; expected one of: addresses, default, hosts"),
    ("unknown key in host entry",
     "version: 1\nhosts:\n  allow:\n    - host: a.example.com\n      ports: [443]\n      prots: [443]\n",
     (6, 7), "hosts.allow[0].prots", "unknown key 'prots'; expected one of: expires, host, id, intercept"),
    ("unknown key in a role's host entry",
     "version: 1\nroles:\n  - name: ci\n    clients: [10.0.0.0/8]\n    hosts:\n      deny:\n"
     "        - host: a.example.com\n          bogus: 1\n",
     (8, 11), "roles[0].hosts.deny[0].bogus", "unknown key 'bogus'"),
    ("wrong enum", "version: 1\nmode: enforcing\n", (2, 7), "mode",
     "got 'enforcing'; expected one of: enforce, report"),
    ("wrong type", "version: 1\nports:\n  connect: 443\n", (3, 12), "ports.connect", "got int 443; expected array"),
    ("wrong item type", "version: 1\nports:\n  http: ['80']\n", (3, 10), "ports.http[0]",
     "got text '80'; expected a port number (no quotes) or a range such as 1025-65535 (no spaces)"),
    ("port out of range", "version: 1\nports:\n  connect: [70000]\n", (3, 13), "ports.connect[0]",
     "expected a value <= 65535"),
    ("wrong version", "version: 2\n", (1, 10), "version", "got 2; expected 1"),
    ("missing version", "mode: enforce\n", (1, 1), "", "missing key; expected 'version'"),
    ("duplicate key", "version: 1\ndefault: allow\nmode: enforce\ndefault: deny\n", (4, 1), "default",
     "duplicate key (first written on line 2)"),
    ("duplicate key in host entry",
     "version: 1\nhosts:\n  allow:\n    - host: a.example.com\n      host: b.example.com\n", (5, 7), "host",
     "duplicate key"),
    ("CIDR with host bits", "version: 1\naddresses:\n  allow:\n    - 10.0.0.1/8\n", (4, 7), "addresses.allow[0]",
     "host bits are set; did you mean 10.0.0.0/8?"),
    ("legacy numeric CIDR 10.1 (YAML float)", "version: 1\naddresses:\n  deny:\n    - 10.1\n", (4, 7),
     "addresses.deny[0]", "got float 10.1; expected string"),
    ("legacy numeric CIDR '10.1/16'", "version: 1\naddresses:\n  deny:\n    - '10.1/16'\n", (4, 7),
     "addresses.deny[0]", "got '10.1/16'; expected an address or CIDR range"),
    ("legacy octal CIDR", "version: 1\naddresses:\n  deny:\n    - '0177.0.0.1'\n", (4, 7),
     "addresses.deny[0]", "got '0177.0.0.1'; expected an address or CIDR range"),
    ("prefix with a leading zero", "version: 1\naddresses:\n  deny:\n    - 10.0.0.0/08\n", (4, 7),
     "addresses.deny[0]", "expected an address or CIDR range"),
    ("role client with host bits", "version: 1\nroles:\n  - name: ci\n    clients: [10.0.0.1/8]\n", (4, 15),
     "roles[0].clients[0]", "host bits are set"),
    ("pattern with userinfo", "version: 1\nhosts:\n  allow:\n    - user@example.com\n", (4, 7), "hosts.allow[0]",
     "userinfo"),
    ("pattern with * in the middle", "version: 1\nhosts:\n  allow:\n    - a.*.example.com\n", (4, 7),
     "hosts.allow[0]", "'*' is allowed only as a leading '*.' label"),
    ("pattern with a bare *", "version: 1\nhosts:\n  deny:\n    - '*'\n", (4, 7), "hosts.deny[0]",
     "'*' is allowed only as a leading '*.' label"),
    ("IP pattern with *.", "version: 1\nhosts:\n  allow:\n    - '*.10.0.0.1'\n", (4, 7), "hosts.allow[0]",
     "an IP address cannot have subdomains"),
    ("IP pattern with leading dot", "version: 1\nhosts:\n  allow:\n    - host: .10.0.0.1\n", (4, 13),
     "hosts.allow[0].host", "an IP address cannot have subdomains"),
    ("pattern naming localhost", "version: 1\nhosts:\n  allow:\n    - localhost\n", (4, 7), "hosts.allow[0]",
     "localhost"),
    ("pattern with an empty label", "version: 1\nhosts:\n  allow:\n    - a..example.com\n", (4, 7),
     "hosts.allow[0]", "empty-label"),
    ("impossible date", "version: 1\nhosts:\n  allow:\n    - host: a.example.com\n      expires: 2025-13-45\n",
     (5, 16), "hosts.allow[0].expires", "got '2025-13-45'; expected a date"),
    ("day out of range", "version: 1\nhosts:\n  allow:\n    - host: a.example.com\n      expires: 2027-02-30\n",
     (5, 16), "hosts.allow[0].expires", "expected a date (day is out of range for month)"),
    ("date in words", "version: 1\nhosts:\n  allow:\n    - host: a.example.com\n      expires: next week\n",
     (5, 16), "hosts.allow[0].expires", "got 'next week'; expected text matching"),
    ("role defined twice",
     "version: 1\nroles:\n  - name: ci\n    clients: [10.0.0.0/8]\n  - name: ci\n    clients: [10.1.0.0/16]\n",
     (5, 11), "roles[1].name", "role 'ci' is defined twice"),
    ("ttl_floor above ttl_ceiling", "version: 1\nresolver:\n  ttl_ceiling: 60\n  ttl_floor: 600\n", (4, 14),
     "resolver.ttl_floor", "ttl_floor is greater than ttl_ceiling"),
    ("bad nameserver", "version: 1\nresolver:\n  nameservers: ['127.0.0.1:0']\n", (3, 17),
     "resolver.nameservers[0]", "port must be 1-65535"),
    ("empty role clients", "version: 1\nroles:\n  - name: ci\n    clients: []\n", (4, 14), "roles[0].clients",
     "should be non-empty"),
    ("lower-case method", "version: 1\nhosts:\n  allow:\n    - host: a.example.com\n      methods: [get]\n",
     (5, 17), "hosts.allow[0].methods[0]", "got 'get'; expected text matching"),
    ("path without a leading /", "version: 1\nhosts:\n  allow:\n    - host: a.example.com\n      paths: [docs]\n",
     (5, 15), "hosts.allow[0].paths[0]", "got 'docs'; expected text matching ^/"),
    ("empty section", "version: 1\nhosts:\n", (2, 7), "hosts", "got NoneType None; expected object"),
    ("a list, not a mapping", "- a\n- b\n", (1, 1), "", "expected object"),
]


@pytest.mark.parametrize("text, where, key, expected", [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_file_names_position_key_and_expectation(text: str, where: tuple[int, int], key: str,
                                                     expected: str) -> None:
    err = load_error(text, "bad.yaml")
    assert (err.line, err.column) == where, str(err)
    assert err.key == key, str(err)
    assert expected in err.message, str(err)
    prefix = f"bad.yaml:{where[0]}:{where[1]}: " + (f"{key}: " if key else "")
    assert str(err).startswith(prefix), str(err)


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n", "---\n"], ids=repr)
def test_empty_file(text: str) -> None:
    err = load_error(text, "empty.yaml")
    assert str(err) == "empty.yaml:1:1: the file is empty; expected a mapping with 'version: 1'"


@pytest.mark.parametrize("text, where, words", [
    ("version: 1\nhosts: [unclosed\n", (3, 1), "expected ',' or ']'"),
    ("\tversion: 1\n", (1, 1), "found character '\\t' that cannot start any token"),
    ("version: 1\nmode: 'enforce\n", (3, 1), "found unexpected end of stream"),
    ("version: 1\n? [a, b]\n: 1\n", (2, 3), "found unhashable key"),
])
def test_not_yaml(text: str, where: tuple[int, int], words: str) -> None:
    err = load_error(text, "broken.yaml")
    assert (err.line, err.column) == where, str(err)
    assert "not valid" in err.message and words in err.message, str(err)
    assert str(err).startswith(f"broken.yaml:{where[0]}:{where[1]}: not valid")


def test_python_tags_are_refused_not_executed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    text = f"version: 1\nhosts: !!python/object/apply:os.system ['touch {marker}']\n"
    err = load_error(text)
    assert (err.line, err.column) == (2, 8)
    assert "could not determine a constructor" in err.message
    assert not marker.exists()


def test_directory(tmp_path: Path) -> None:
    with pytest.raises(PolicyError) as info:
        load_policy_file(tmp_path)
    assert str(info.value) == f"{tmp_path}: is a directory, not a policy file"


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(PolicyError) as info:
        load_policy_file(tmp_path / "nope.yaml")
    assert str(info.value) == f"{tmp_path / 'nope.yaml'}: no such file"


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("version: 1\n# caf\xe9\n".encode("latin-1"))
    with pytest.raises(PolicyError) as info:
        load_policy_file(path)
    assert str(info.value).startswith(f"{path}: cannot be read:")


def test_unreadable_file(tmp_path: Path) -> None:
    """Root reads a mode-000 file anyway; without CAP_DAC_OVERRIDE (dropped from the bounding set of
    a child process) it cannot, so the child sees exactly what an unprivileged operator would."""
    import shutil
    import subprocess
    import sys

    path = tmp_path / "secret.yaml"
    path.write_text("version: 1\n")
    path.chmod(0)
    command = [sys.executable, "-m", "proxy.cli", "lint", str(path)]
    if os.geteuid() == 0:
        assert shutil.which("setpriv"), "setpriv (util-linux) is needed to drop root's file-access override"
        command = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *command]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=60,
                                cwd=Path(__file__).resolve().parent.parent)
    finally:
        path.chmod(0o600)
    assert result.returncode == 2
    assert f"{path}: cannot be read:" in result.stderr and "Permission denied" in result.stderr


# --- YAML 1.1 traps ------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["no", "off", "yes", "on", "n", "false", "true"])
def test_default_yaml11_boolean_words_are_errors(value: str) -> None:
    err = load_error(f"version: 1\ndefault: {value}\n")
    assert err.key == "default"
    assert "expected one of: allow, deny" in err.message
    assert "False" not in str(err) or value == "false"


def test_default_no_says_what_it_read() -> None:
    err = load_error("version: 1\ndefault: no\n", "p.yaml")
    assert str(err) == "p.yaml:2:10: default: got 'no'; expected one of: allow, deny"


def test_dates_stay_text() -> None:
    text = ("version: 1\nhosts:\n  allow:\n    - host: a.example.com\n      expires: 2030-01-02\n"
            "      owner: 2027-06-30\n      reason: 2027-06-30T10:00:00Z\n")
    policy = parse_policy(text, "p.yaml")
    rule = policy.allow.rules[0]
    assert rule.owner == "2027-06-30" and isinstance(rule.owner, str)
    assert rule.reason == "2027-06-30T10:00:00Z"
    assert rule.expires == datetime(2030, 1, 3, tzinfo=UTC)  # a bare date: the whole day


@pytest.mark.parametrize("written, expires", [
    ("2030-01-02", datetime(2030, 1, 3, tzinfo=UTC)),  # a bare date is the whole day, UTC
    ("2030-12-31", datetime(2031, 1, 1, tzinfo=UTC)),
    ("2028-02-29", datetime(2028, 3, 1, tzinfo=UTC)),
    ("2030-01-02T10:30", datetime(2030, 1, 2, 10, 30, tzinfo=UTC)),
    ("2030-01-02 10:30:15Z", datetime(2030, 1, 2, 10, 30, 15, tzinfo=UTC)),
    ("2030-01-02T12:00:00+02:00", datetime(2030, 1, 2, 10, 0, tzinfo=UTC)),
])
def test_expiry_forms(written: str, expires: datetime) -> None:
    policy = parse_policy(f"version: 1\nhosts:\n  allow:\n    - host: a.example.com\n      expires: '{written}'\n")
    assert policy.allow.rules[0].expires == expires


@pytest.mark.parametrize("text, key", [
    ("version: 1\nports:\n  connect: [0443]\n", "ports.connect[0]"),  # YAML 1.1: octal 291
    ("version: 1\nresolver:\n  ttl_ceiling: 1:30\n", "resolver.ttl_ceiling"),  # YAML 1.1: sexagesimal 90
    ("version: 1\nhosts:\n  allow:\n    - host: a.example.com\n      websocket: no\n", "hosts.allow[0].websocket"),
])
def test_yaml11_numbers_and_booleans_are_not_reinterpreted(text: str, key: str) -> None:
    err = load_error(text)
    assert err.key == key
    assert "got str" in err.message or "got text" in err.message or "without a leading zero" in err.message


# --- overrides -----------------------------------------------------------------------------------------

BASE = "version: 1\ndefault: allow\nhosts:\n  allow:\n    - a.example.com\n  deny:\n    - d.example.com\n"


def test_overrides_add_rules_marked_with_their_flag() -> None:
    policy = parse_policy(BASE, "p.yaml", Overrides(allow_hosts=["b.example.com", ".c.example.com"],
                                                    deny_hosts=["e.example.com"],
                                                    allow_ranges=["198.18.0.0/15"], deny_ranges=["8.8.8.0/24"]))
    assert [(r.pattern.text, str(r.origin)) for r in policy.allow.rules] == [
        ("a.example.com", "p.yaml:5"),
        ("b.example.com", "command line --allow-host b.example.com"),
        (".c.example.com", "command line --allow-host .c.example.com"),
    ]
    assert [(r.pattern.text, str(r.origin)) for r in policy.deny.rules] == [
        ("d.example.com", "p.yaml:7"), ("e.example.com", "command line --deny-host e.example.com")]
    assert [(a, c, str(o)) for a, c, o in policy.address_rules_text] == [
        ("allow", "198.18.0.0/15", "command line --allow-range 198.18.0.0/15"),
        ("deny", "8.8.8.0/24", "command line --deny-range 8.8.8.0/24"),
    ]
    checked = policy.addresses.check("198.18.0.9")
    assert checked.allowed and "--allow-range 198.18.0.0/15" in checked.rule
    denied = policy.addresses.check("8.8.8.8")
    assert not denied.allowed and "--deny-range 8.8.8.0/24" in denied.rule


def test_override_creates_missing_sections() -> None:
    policy = parse_policy("version: 1\n", "p.yaml", Overrides(allow_hosts=["b.example.com"],
                                                              allow_ranges=["198.18.0.0/15"]))
    assert [r.pattern.name for r in policy.allow.rules] == ["b.example.com"]


def test_default_override_replaces() -> None:
    policy = parse_policy(BASE, "p.yaml", Overrides(default="deny"))
    assert policy.default == DENY
    assert str(policy.default_origin) == "--default"
    assert parse_policy(BASE, "p.yaml").default == ALLOW
    assert str(parse_policy(BASE, "p.yaml").default_origin) == "p.yaml:2"


def test_nameserver_override_replaces() -> None:
    text = "version: 1\nresolver:\n  nameservers: ['192.0.2.53', '[2001:db8::53]:5353']\n"
    assert parse_policy(text).resolver.nameservers == (("192.0.2.53", 53), ("2001:db8::53", 5353))
    policy = parse_policy(text, "p.yaml", Overrides(nameservers=["127.0.0.1:5300", "127.0.0.2"]))
    assert policy.resolver.nameservers == (("127.0.0.1", 5300), ("127.0.0.2", 53))


def test_nameserver_override_with_an_empty_resolver_section() -> None:
    err = load_error("version: 1\nresolver:\n", "p.yaml", Overrides(nameservers=["127.0.0.1:53"]))
    assert err.key == "resolver" and "expected object" in err.message


@pytest.mark.parametrize("overrides, flag", [
    (Overrides(allow_ranges=["10.0.0.1/8"]), "command line --allow-range 10.0.0.1/8"),
    (Overrides(deny_ranges=["127.1"]), "command line --deny-range 127.1"),
    (Overrides(allow_hosts=["user@x.example.com"]), "command line --allow-host user@x.example.com"),
    (Overrides(deny_hosts=["a.*.example.com"]), "command line --deny-host a.*.example.com"),
    (Overrides(nameservers=["localhost"]), "command line --nameserver"),
])
def test_bad_override_names_the_flag(overrides: Overrides, flag: str) -> None:
    err = load_error(BASE, "p.yaml", overrides)
    assert str(err).startswith(flag + ": "), str(err)


def test_mode_override() -> None:
    assert parse_policy(BASE, "p.yaml", Overrides(mode="report")).mode == "report"


@pytest.mark.parametrize("written, name", [
    ("'[2606:4700::1111]'", "2606:4700::1111"),
    ("'2606:4700::1111'", "2606:4700::1111"),
    ("'[::ffff:93.184.216.34]'", "93.184.216.34"),
    ("93.184.216.34", "93.184.216.34"),
])
def test_ip_literal_patterns(written: str, name: str) -> None:
    pattern = parse_policy(f"version: 1\nhosts:\n  allow:\n    - {written}\n").allow.rules[0].pattern
    assert pattern.kind is PatternKind.EXACT and pattern.name == name


# --- every problem at once -----------------------------------------------------------------------------

def test_every_problem_is_collected_in_file_order() -> None:
    text = ("version: 1\nhosts:\n  deny:\n    - a..example.com\n  allow:\n    - host: a.example.com\n"
            "      ports: [0]\n    - b@example.com\n    - c.example.com\n    - host: d.example.com\n"
            "      expires: 2027-02-30\nports:\n  connect: [443, '9-1']\n")
    err = load_error(text, "p.yaml")
    where = [(p.line, p.column, p.key) for p in err.problems]
    assert where == [(4, 7, "hosts.deny[0]"), (7, 15, "hosts.allow[0].ports[0]"), (8, 7, "hosts.allow[1]"),
                     (11, 16, "hosts.allow[3].expires"), (13, 18, "ports.connect[1]")], str(err)
    # The first problem is the error's own; str() lists every one, a line each; summary is one line.
    assert (err.line, err.column, err.key) == (4, 7, "hosts.deny[0]")
    assert str(err).splitlines() == [str(p) for p in err.problems]
    assert err.summary == f"{err.problems[0]} (and 4 more errors)"


def test_a_value_the_schema_refuses_is_reported_once() -> None:
    """A role whose clients are not a list is one problem, not also 'no clients' or a broken role."""
    err = load_error("version: 1\nroles:\n  - name: ci\n    clients: 10.0.0.0/8\n"
                     "    hosts:\n      allow: [localhost]\n", "p.yaml")
    assert [(p.line, p.key) for p in err.problems] == [(4, "roles[0].clients"), (6, "roles[0].hosts.allow[0]")]


def test_a_single_problem_keeps_its_shape() -> None:
    err = load_error("version: 1\nmode: enforcing\n", "p.yaml")
    assert len(err.problems) == 1 and str(err) == "p.yaml:2:7: mode: got 'enforcing'; expected one of: enforce, report"
    assert err.summary == str(err)


def test_policy_error_pickles_with_every_problem() -> None:
    import pickle

    err = load_error("version: 1\nmode: x\ndefault: y\n", "p.yaml")
    again = pickle.loads(pickle.dumps(err))
    assert again.problems == err.problems and str(again) == str(err)


def test_a_bare_expiry_date_means_the_same_in_code_example_schema_and_readme() -> None:
    """``expires: 2027-06-30`` is the whole of that day in UTC: the rule stops at 2027-07-01T00:00Z."""
    vendor = next(r for r in load_policy_file(EXAMPLE).allow.rules if r.pattern.text == "vendor.example.net")
    stops = vendor.expires
    assert stops == datetime(2027, 7, 1, tzinfo=UTC)
    assert not vendor.expired(datetime(2027, 6, 30, 23, 59, 59, tzinfo=UTC)) and vendor.expired(stops)
    said = f"{stops:%Y-%m-%dT%H:%MZ}"
    example_line = next(line for line in EXAMPLE.read_text().splitlines() if "expires:" in line)
    assert "2027-06-30" in example_line and said in example_line, example_line
    schema_words = SCHEMA["$defs"]["hostEntry"]["oneOf"][1]["properties"]["expires"]["description"]
    assert "2027-06-30" in schema_words and said in schema_words
    readme = (POLICY_DIR.parent / "README.md").read_text()
    assert f"expires: 2027-06-30            # a bare date is the whole day (UTC): matches until {said}" in readme


def test_the_policy_package_reads_no_files() -> None:
    """policy/ is the pure core: the loader takes text (proxy/policy_file.py reads files). The one read is
    schema.py's own package data at import; resolver.py does DNS, no files."""
    import ast

    calls = {"open", "read_text", "read_bytes", "fdopen", "stat", "fstat", "listdir", "scandir"}
    found = []
    for path in sorted(POLICY_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if name in calls and not (path.name == "schema.py" and name == "read_text"):
                    found.append(f"{path.name}:{node.lineno}: {name}()")
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                found += [f"{path.name}:{node.lineno}: imports {n}" for n in names if n in ("os", "pathlib", "stat")]
    assert found == []
    import policy.loader

    assert not hasattr(policy.loader, "load_policy") and not hasattr(policy.loader, "DEFAULT_POLICY")


# --- a big allowlist is built in bulk: the same objects as one at a time -------------------------

BULK = """version: 1
hosts:
  allow:
    - docs.example.com
    - '*.cdn.example.com'
    - .example.org
    - &shared api.example.net
    - *shared
    - !!str tagged.example.com
    - {host: conditional.example.com, ports: [8443]}
  deny:
    - ads.example.com
"""


def test_bulk_built_rules_equal_rules_built_one_at_a_time() -> None:
    from policy.model import HostRule, Origin
    from policy.patterns import HostPattern

    # HostRule.plain fills the conditions with the fields' own defaults.
    assert HostRule.plain(ALLOW, HostPattern.parse("a.example"), Origin("x"), "i") == HostRule(
        ALLOW, HostPattern.parse("a.example"), Origin("x"), "i")
    policy = parse_policy(BULK, "bulk.yaml")
    texts = [rule.pattern.text for rule in policy.allow.rules]
    assert texts == ["docs.example.com", "*.cdn.example.com", ".example.org", "api.example.net", "api.example.net",
                     "tagged.example.com", "conditional.example.com"]
    for i, rule in enumerate(policy.allow.rules[:6]):
        line = 7 if i == 4 else 4 + i  # an alias is the node it names: it points where the anchor was written
        origin = Origin("bulk.yaml", line, 7, f"hosts.allow[{i}]")
        pattern = HostPattern(rule.pattern.kind, rule.pattern.text.lstrip("*."), rule.pattern.text)
        # A first entry of hosts.allow leaves its id to rule_id (no id string per rule); a repeat carries its #n.
        expected = HostRule(ALLOW, pattern, origin, "hosts.allow:api.example.net#2" if i == 4 else "")
        assert rule.rule_id == f"hosts.allow:{rule.pattern.text}" + ("#2" if i == 4 else "")
        assert type(rule) is HostRule and type(rule.origin) is Origin and type(rule.pattern) is HostPattern
        assert rule == expected and hash(rule) == hash(expected) and repr(rule) == repr(expected)
        assert rule.origin == origin and hash(rule.origin) == hash(origin) and str(rule.origin) == f"bulk.yaml:{line}"
        assert rule._replace(id="x") == expected._replace(id="x")
        # Rules, patterns and origins are named tuples (built a million times): immutable.
        with pytest.raises(AttributeError):
            rule.id = "changed"  # type: ignore[misc]
        with pytest.raises(AttributeError):
            rule.pattern.name = "changed"  # type: ignore[misc]
        with pytest.raises(AttributeError):
            rule.origin.line = 1  # type: ignore[misc]
    assert policy.allow.rules[6].ports == frozenset({8443})
    assert [rule.rule_id for rule in policy.deny.rules] == ["hosts.deny:ads.example.com"]


def test_the_collector_is_paused_only_while_a_policy_loads() -> None:
    import gc

    assert gc.isenabled()
    parse_policy(BULK, "bulk.yaml")
    assert gc.isenabled()
    with pytest.raises(PolicyError):
        parse_policy("version: 1\nhosts:\n  allow: ['bad host.example']\n", "bad.yaml")
    assert gc.isenabled()
    gc.disable()
    try:
        parse_policy(BULK, "bulk.yaml")
        assert not gc.isenabled()  # a caller that had it off keeps it off
    finally:
        gc.enable()


def test_a_bad_entry_in_a_long_list_is_reported_at_its_line() -> None:
    entries = [f"    - n{i}.example.com\n" for i in range(2000)]
    entries[1234] = "    - n1234..example.com\n"
    with pytest.raises(PolicyError) as caught:
        parse_policy("version: 1\nhosts:\n  allow:\n" + "".join(entries), "long.yaml")
    text = str(caught.value)
    assert text.startswith("long.yaml:1238:7: hosts.allow[1234]:"), text
    assert "empty label" in text


def test_derived_ids_number_each_repeat_of_a_text_across_bare_and_mapping_entries() -> None:
    policy = parse_policy("""version: 1
hosts:
  allow:
    - a.example.com
    - b.example.com
    - host: a.example.com
      ports: [8443]
    - host: a.example.com
      id: named
    - a.example.com
    - b.example.com
  deny:
    - a.example.com
""", "ids.yaml")
    assert [rule.rule_id for rule in policy.allow.rules] == [
        "hosts.allow:a.example.com", "hosts.allow:b.example.com", "hosts.allow:a.example.com#2", "named",
        "hosts.allow:a.example.com#3", "hosts.allow:b.example.com#2"]
    assert [rule.id for rule in policy.allow.rules] == [  # what rule_id cannot derive from action and pattern
        "", "", "hosts.allow:a.example.com#2", "named", "hosts.allow:a.example.com#3", "hosts.allow:b.example.com#2"]
    assert [rule.rule_id for rule in policy.deny.rules] == ["hosts.deny:a.example.com"]  # each list counts its own


def test_a_list_built_in_bulk_equals_the_same_list_built_entry_by_entry() -> None:
    """A list of plainly normal bare patterns is built in bulk; one entry that is not (a mapping, a text to
    judge alone) sends the list through the loop, entry by entry. Both give the same rules."""
    entries = ["a.example.com", "*.a.example.com", ".b.example.org", "a.example.com", "c.example.net.",
               ".b.example.org", "d.example.com"]
    head = "version: 1\nhosts:\n  allow:\n" + "".join(f"    - '{e}'\n" for e in entries)
    bulk = parse_policy(head, "p.yaml").allow.rules
    for tail in ("    - {host: e.example.com}\n", "    - E.example.com\n", "    - xn--p1ai.example\n"):
        assert parse_policy(head + tail, "p.yaml").allow.rules[:len(entries)] == bulk, tail
    assert [rule.rule_id for rule in bulk] == [
        "hosts.allow:a.example.com", "hosts.allow:*.a.example.com", "hosts.allow:.b.example.org",
        "hosts.allow:a.example.com#2", "hosts.allow:c.example.net.", "hosts.allow:.b.example.org#2",
        "hosts.allow:d.example.com"]
    shared = parse_policy("version: 1\nhosts:\n  allow: [a.example.com, '*.a.example.com', .a.example.com]\n",
                          "p.yaml").allow.rules  # one name, three texts: no #n
    assert [(rule.id, rule.rule_id) for rule in shared] == [
        ("", "hosts.allow:a.example.com"), ("", "hosts.allow:*.a.example.com"), ("", "hosts.allow:.a.example.com")]
    in_role = parse_policy(head.replace("hosts:\n  allow:", "roles:\n  - name: r\n    clients: [10.0.0.0/8]\n"
                                        "    hosts:\n      allow:").replace("    - '", "        - '"), "p.yaml")
    assert [rule.id for rule in in_role.roles[0].allow.rules] == [  # a role's list names the role: written out
        rule.rule_id.replace("hosts.allow:", "roles.r.allow:") for rule in bulk]
    assert [(rule.origin.line, rule.origin.column, rule.origin.path) for rule in bulk] == [
        (4 + i, 7, f"hosts.allow[{i}]") for i in range(len(entries))]
    assert [rule.pattern.kind for rule in bulk] == [PatternKind.EXACT, PatternKind.SUBDOMAINS, PatternKind.DOMAIN,
                                                    PatternKind.EXACT, PatternKind.EXACT, PatternKind.DOMAIN,
                                                    PatternKind.EXACT]


def test_derived_ids_for_a_list_number_repeats() -> None:
    from policy.rule_ids import derived, derived_for_list, given_id, host_list, implied

    texts = ["a.example", "b.example", "a.example", "a.example", "c.example", "b.example"]
    written = [derived("hosts.allow", "a.example"), derived("hosts.allow", "b.example"), "hosts.allow:a.example#2",
               "hosts.allow:a.example#3", "hosts.allow:c.example", "hosts.allow:b.example#2"]
    assert derived_for_list("hosts.allow", texts) == written
    assert derived_for_list("hosts.allow", texts, implied=True) == ["", ""] + written[2:4] + ["", written[5]]
    counts = [1, 1, 2, 3, 1, 2]
    for first_implied in (False, True):
        assert [given_id("hosts.allow", text, count, first_implied)
                for text, count in zip(texts, counts, strict=True)] == derived_for_list("hosts.allow", texts,
                                                                                        first_implied)
    assert derived_for_list("roles.ci.deny", []) == []
    assert [implied(host_list(action, role)) for action in ("allow", "deny") for role in (None, "ci")] == [
        True, False, True, False]


@pytest.mark.parametrize("misplaced", [
    "[" + ", ".join(f"n{i}.example" for i in range(100_000)) + "]",  # a whole list where one name goes
    "'" + "a" * 200_000 + "'",  # a long text where a mapping goes
])
def test_a_value_in_the_wrong_place_is_named_by_its_start_not_written_out(misplaced: str) -> None:
    """The error says what was found, shortened: a list of a hundred thousand names (or a long text) in the
    wrong place is named by its first few, and the message stays a line an operator can read."""
    field = "allow" if misplaced.startswith("[") else "deny"
    text = f"version: 1\nhosts:\n  {field}:\n    - {misplaced}\n" if field == "allow" else (
        f"version: 1\nroles:\n  - {misplaced}\n")
    with pytest.raises(PolicyError) as refused:
        parse_policy(text, "big.yaml")
    message = str(refused.value)
    assert len(message) < 1000, message[:2000]
    assert "big.yaml:4:7:" in message or "big.yaml:3:5:" in message, message
    assert ("n0.example" in message and "..." in message) if field == "allow" else "aaaa" in message, message


def test_every_error_of_a_host_rule_is_shown_at_once() -> None:
    """A rule with bad methods, ports, schemes and paths showed only its deepest error; the operator fixed and
    re-ran once per error (review round 16)."""
    text = ("version: 1\ndefault: deny\nhosts:\n  allow:\n    - host: a.example\n      methods: [get]\n"
            "      ports: [0]\n      schemes: [ftp]\n      paths: [x]\n")
    keys = [problem.key for problem in load_error(text).problems]
    assert keys == ["hosts.allow[0].methods[0]", "hosts.allow[0].ports[0]", "hosts.allow[0].schemes[0]",
                    "hosts.allow[0].paths[0]"], keys


@pytest.mark.parametrize("text, words", [
    ('version: "1"\n', 'version: got text \'1\'; expected number 1'),
    ("version: 1\nports:\n  http: ['80 - 90']\n",
     "got text '80 - 90'; expected a port number (no quotes) or a range such as 1025-65535 (no spaces)"),
])
def test_a_value_of_the_wrong_form_says_which_form(text: str, words: str) -> None:
    assert words in str(load_error(text))
