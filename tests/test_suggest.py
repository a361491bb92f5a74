"""egresswall suggest: a hosts.allow block from an audit log in the gate's record format."""

from __future__ import annotations

import json
from datetime import date

import pytest
import yaml
from audit_factory import decided, later, request, write_log
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from policy.loader import parse_policy
from proxy.audit_reader import Place, parse_line, read_log
from proxy.cli import main
from proxy.replay import redecide, replay
from proxy.suggest import (
    Options,
    collect,
    expiry_date,
    has_public_suffix_below,
    is_public_suffix,
    registrable_domain,
    render,
)

LAB = """\
version: 1
mode: {mode}
default: deny
addresses: {{allow: [198.18.0.0/15]}}
hosts:
  deny: ["*.ads.example.com"]
  allow: [docs.example.com{extra}]
roles:
  - name: ci
    clients: [10.9.0.0/16]
"""
OPTIONS = Options(expires="2099-01-01")


def lab_policy(mode: str = "report", extra: str = ""):
    return parse_policy(LAB.format(mode=mode, extra=extra), "lab.yaml")


# A page load as report mode logs it: the page and its assets on public lab addresses, a tracker on an
# internal address, a name that resolves to both, one whose CNAME leads inside, cloud metadata, public
# suffixes asked for themselves, a denied ad host, a host already allowed.
PAGE_LOAD = [
    ("www.example.com:443", ("198.18.0.10",), ()),
    ("www.example.com:443", ("198.18.0.10",), ()),
    ("cdn.example.com:443", ("198.18.0.11", "198.18.0.21"), ()),
    ("static.example.net:443", ("198.18.0.12",), ()),
    ("alice.github.io:443", ("198.18.0.13",), ()),
    ("www.bbc.co.uk:443", ("198.18.0.14",), ()),
    ("tracker.example.com:443", ("10.0.0.5",), ()),
    ("mixed.example.net:443", ("198.18.0.15", "10.0.0.6"), ()),
    ("alias.example.org:443", ("198.18.0.16",), ("db.internal",)),
    ("meta.example.org:443", ("169.254.169.254",), ()),
    ("github.io:443", ("198.18.0.17",), ()),
    ("co.uk:443", ("198.18.0.18",), ()),
    ("x.ads.example.com:443", ("198.18.0.19",), ()),
    ("docs.example.com:443", ("198.18.0.20",), ()),
    ("adalias.example.org:443", ("198.18.0.22",), ("x.ads.example.com",)),  # an alias of a denied host
]
SUGGESTED = {"www.example.com", "cdn.example.com", "static.example.net", "alice.github.io", "www.bbc.co.uk"}
APART = {"tracker.example.com", "mixed.example.net", "alias.example.org", "meta.example.org", "github.io", "co.uk",
         "x.ads.example.com", "adalias.example.org"}


def page_load_records(policy, client: str = "10.1.0.5") -> list[dict]:
    return [decided(policy, request(authority, "CONNECT", client=client, at=later(i)), addresses, cnames,
                    flow_id=f"f{i}") for i, (authority, addresses, cnames) in enumerate(PAGE_LOAD)]


def suggested_entries(text: str) -> list[dict]:
    return yaml.safe_load(text)["hosts"]["allow"]


def suggest_text(records: list[dict], policy=None, options: Options = OPTIONS) -> tuple[str, object]:
    items = [parse_line(json.dumps(r).encode() + b"\n", Place("audit.jsonl", i + 1)) for i, r in enumerate(records)]
    found = collect(items, policy=policy)
    source = "the address rules of lab.yaml" if policy else "the built-in rules (global unicast only)"
    return render(found, options, ["audit.jsonl"], source), found


def test_the_page_load_is_what_it_says():
    records = page_load_records(lab_policy())
    assert [r["verdict"] for r in records] == ["report"] * 6 + ["refuse"] * 3 + ["refuse", "report", "report",
                                                                                 "report", "allow", "report"]
    assert records[-1]["stage"] == "resolve" and records[-1]["rule_id"] == "hosts.deny:*.ads.example.com"
    assert [r["stage"] for r in records[6:10]] == ["address", "address", "resolve", "address"]


def test_a_report_mode_log_gives_a_block_that_lets_the_same_load_through(tmp_path):
    records = page_load_records(lab_policy())
    text, found = suggest_text(records, lab_policy())
    entries = suggested_entries(text)
    assert {e["host"] for e in entries} == SUGGESTED
    assert all(e["owner"] == "TODO" and e["expires"] == "2099-01-01" for e in entries)
    assert set(found.listed_apart()) == APART
    # Once added (and the policy switched to enforce), the same requests meet no host refusal but those
    # of the names left out, re-decided from the same records.
    extra = "".join(f", {e['host']}" for e in entries)
    enforced = lab_policy("enforce", extra)
    outcomes: dict[str, set[tuple[str, str]]] = {}
    for record in read_log(write_log(tmp_path / "audit.jsonl", records)):
        outcome = redecide(enforced, record)
        outcomes.setdefault(record.host, set()).add((outcome.verdict, outcome.stage))
    assert all(outcomes[host] == {("allow", "host")} for host in SUGGESTED)
    refused_by_host = {host for host, seen in outcomes.items() if ("refuse", "host") in seen}
    assert refused_by_host == APART  # only the names left out, which enforce mode now refuses by name
    second = replay(enforced, read_log(tmp_path / "audit.jsonl"))
    assert second.changes[("report", "allow")].count == 6 and set(second.changes[("report", "allow")].hosts) == (
        SUGGESTED)


def test_the_block_lints_clean(tmp_path, capsys):
    text, _ = suggest_text(page_load_records(lab_policy()), lab_policy(), Options())  # the default expiry: 90d
    out = tmp_path / "suggested.yaml"
    out.write_text(text)
    assert main(["lint", str(out), "--strict"]) == 0
    assert "0 warning(s)" in capsys.readouterr().out


def test_names_left_out_are_listed_with_the_reason():
    text, found = suggest_text(page_load_records(lab_policy()), lab_policy())
    apart = found.listed_apart()
    assert "10.0.0.5 is in 10.0.0.0/8 (Private-Use" in next(iter(apart["tracker.example.com"]))
    assert any("10.0.0.6" in reason for reason in apart["mixed.example.net"])  # one bad answer is enough
    assert any("CNAME" in reason and "db.internal" in reason for reason in apart["alias.example.org"])
    assert any("cloud metadata" in reason for reason in apart["meta.example.org"])
    assert any("deny rule" in reason for reason in apart["x.ads.example.com"])
    assert any("public suffix" in reason for reason in apart["github.io"])
    assert "#   tracker.example.com: resolved to 10.0.0.5, which the address rules refuse" in text
    assert "(first at audit.jsonl:7)" in text


def test_names_the_policy_given_already_allows_are_left_out():
    text, _ = suggest_text(page_load_records(lab_policy()), lab_policy(extra=", www.example.com"))
    assert {e["host"] for e in suggested_entries(text)} == SUGGESTED - {"www.example.com"}
    assert "# Already allowed by the policy given, so left out: www.example.com" in text


def test_without_a_policy_only_global_addresses_count():
    # The lab's re-admitted range is not global: judged by the built-in rules every lab name is left out.
    text, found = suggest_text(page_load_records(lab_policy()))
    assert suggested_entries(text) == []
    assert "  allow: []" in text and set(found.listed_apart()) >= SUGGESTED
    assert "198.18.0.10 is in 198.18.0.0/15 (Benchmarking" in next(iter(found.listed_apart()["www.example.com"]))


def test_the_comments_count_requests_and_first_and_last_seen():
    text, _ = suggest_text(page_load_records(lab_policy()), lab_policy())
    assert ("    # www.example.com: 2 request(s), first 2026-12-01T07:00:00.000Z, last 2026-12-01T07:01:00.000Z, "
            "port(s) 443; resolved to 198.18.0.10\n    - host: \"www.example.com\"\n") in text
    assert "    # example.com: 2 name(s), 3 request(s)\n" in text
    assert "# read: audit.jsonl (15 decision line(s), 2026-12-01T07:00:00.000Z .. 2026-12-01T07:14:00.000Z)" in text


def test_an_enforce_log_suggests_the_names_refused_by_default():
    policy = lab_policy("enforce")
    records = page_load_records(policy) + [
        decided(policy, request("files.pypi.org:443", "CONNECT", client="10.9.0.3", at=later(30)))]
    text, found = suggest_text(records)
    entries = {e["host"] for e in suggested_entries(text)}
    # Refused before any lookup, so no address is known: suggested, and the comment says so.
    assert entries == SUGGESTED | {"tracker.example.com", "mixed.example.net", "alias.example.org",
                                   "meta.example.org", "adalias.example.org"}
    assert "not resolved at the time" in text
    assert set(found.listed_apart()) == {"github.io", "co.uk", "x.ads.example.com"}
    assert "refused by deny rule" in next(iter(found.listed_apart()["x.ads.example.com"]))
    # A role's client is judged by the role's own lists: its names are shown for that role, as comments.
    assert "# Clients in role ci are judged by that role's own host lists" in text
    assert '#   - host: "files.pypi.org"' in text and "files.pypi.org" not in entries


def test_public_suffixes_as_the_list_has_them():
    assert is_public_suffix("github.io") and is_public_suffix("co.uk") and not is_public_suffix("alice.github.io")
    assert registrable_domain("alice.github.io") == "alice.github.io"
    assert registrable_domain("www.bbc.co.uk") == "bbc.co.uk"
    assert registrable_domain("github.io") is None
    assert has_public_suffix_below("amazonaws.com") and not has_public_suffix_below("bbc.co.uk")


def test_domains_mode():
    policy = lab_policy()
    records = page_load_records(policy) + [
        decided(policy, request(f"{name}:443", "CONNECT", at=later(20 + i)), ("198.18.1.1",))
        for i, name in enumerate(["a.s3.amazonaws.com", "x.amazonaws.com", "img.bbc.co.uk"])]
    text, _ = suggest_text(records, policy, Options(expires="2099-01-01", domains=True))
    hosts = {e["host"] for e in suggested_entries(text)}
    assert ".alice.github.io" in hosts and ".bbc.co.uk" in hosts  # www and img under one entry
    assert "img.bbc.co.uk" not in hosts and "    # bbc.co.uk: 2 name(s), 2 request(s)\n" in text
    assert ".github.io" not in hosts and ".co.uk" not in hosts
    # example.com holds a name left out (tracker, internal): exact names, and the comment says why.
    assert {"www.example.com", "cdn.example.com", "static.example.net"} <= hosts
    assert ".example.com" not in hosts and ".example.net" not in hosts
    assert "(exact names: .example.com would also cover tracker.example.com" in text
    # Public suffixes lie under amazonaws.com: .amazonaws.com would speak for every bucket.
    assert "x.amazonaws.com" in hosts and ".amazonaws.com" not in hosts and ".a.s3.amazonaws.com" in hosts


def test_text_from_the_log_cannot_leave_its_comment():
    policy = lab_policy("enforce")
    record = decided(policy, request("new.example.com:443", "CONNECT", client="10.9.0.3"))
    record["role"] = "ci\nhosts:\n  deny: ['*']"
    text, _ = suggest_text([record])
    loaded = parse_policy(text, "s.yaml")
    assert len(loaded.deny) == 0 and len(loaded.allow) == 0
    assert "# Clients in role ci\\x0ahosts:\\x0a  deny: ['*'] are judged" in text


def test_lines_not_read_are_named(tmp_path, capsys):
    records = page_load_records(lab_policy())[:2]
    log_path = write_log(tmp_path / "audit.jsonl", [records[0], '{"time": 17', records[1]])
    out = tmp_path / "s.yaml"
    policy_path = tmp_path / "lab.yaml"
    policy_path.write_text(LAB.format(mode="report", extra=""))
    assert main(["suggest", str(log_path), "--policy", str(policy_path), "-o", str(out), "--expires", "30d"]) == 0
    text = out.read_text()
    assert "# not read: 1 line(s): not JSON" in text and f"(at {log_path}:2)" in text
    assert suggested_entries(text) == [{"host": "www.example.com", "owner": "TODO",
                                        "expires": expiry_date("30d")}]
    assert "1 name(s) suggested, 0 listed apart, 1 line(s) not read" in capsys.readouterr().err


def test_a_log_of_which_no_line_could_be_read_fails(tmp_path, capsys):
    """Pointed at a --log-format squid log, every line was unreadable and suggest still exited 0 with an empty
    block (review round 17): a block suggested from nothing is no answer. An empty log is not an error."""
    squid_log = tmp_path / "access.log"
    squid_log.write_text("1765000000.000      1 10.0.0.3 TCP_DENIED/403 0 CONNECT a.example:443 - HIER_NONE/- -\n")
    policy_path = tmp_path / "lab.yaml"
    policy_path.write_text(LAB.format(mode="report", extra=""))
    assert main(["suggest", str(squid_log), "--policy", str(policy_path), "-o", str(tmp_path / "s.yaml")]) == 2
    err = capsys.readouterr().err
    assert "no line is an egresswall audit record (1 line(s) not read; the first, " in err
    assert f"{squid_log}:1: not JSON" in err and "not a --log-format squid log" in err, err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["suggest", str(empty), "--policy", str(policy_path), "-o", str(tmp_path / "e.yaml")]) == 0


def test_expiry_dates():
    today = date(2026, 12, 1)
    assert expiry_date("90d", today) == "2027-03-01"
    assert expiry_date("2027-01-15", today) == "2027-01-15"
    assert expiry_date("never", today) is None
    for bad in ("2026-11-30", "2026-12-01", "soon", "0d", "2027-1-5", "90"):
        with pytest.raises(ValueError, match="--expires"):
            expiry_date(bad, today)


# ---- properties ----------------------------------------------------------------------------------

# Suffixes of every kind the list has: ICANN, private-section (github.io, blogspot.com), wildcard rules
# (*.kawasaki.jp, *.ck) and their exceptions (city.kawasaki.jp, www.ck), IDN, and one the list lacks.
SUFFIXES = ["com", "co.uk", "github.io", "blogspot.com", "kawasaki.jp", "city.kawasaki.jp", "ck", "www.ck",
            "s3.amazonaws.com", "amazonaws.com", "xn--fiqs8s", "example", "uk"]
LABEL = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,8}[a-z0-9])?", fullmatch=True)


@settings(max_examples=150, deadline=None)
@given(names=st.lists(st.tuples(st.lists(LABEL, max_size=3), st.sampled_from(SUFFIXES)), min_size=1, max_size=8),
       domains=st.booleans())
def test_suggest_never_proposes_a_public_suffix(names, domains):
    policy = lab_policy()
    hosts = sorted({".".join([*labels, suffix]) for labels, suffix in names} - {"com", "ck", "example", "uk",
                                                                                "xn--fiqs8s"})  # no dot: no request
    assume(hosts)
    records = [decided(policy, request(f"{host}:443", "CONNECT", at=later(i)), ("198.18.0.10",))
               for i, host in enumerate(hosts)]
    text, found = suggest_text(records, policy, Options(expires="2099-01-01", domains=domains))
    for entry in suggested_entries(text):
        name = entry["host"].removeprefix(".")
        assert not is_public_suffix(name)
        if entry["host"].startswith("."):
            assert not has_public_suffix_below(name)
    # Every name is either suggested (covered by an entry) or listed apart as a public suffix.
    loaded = parse_policy(text, "s.yaml")
    for host in hosts:
        covered = any(rule.pattern.matches(host) for rule in loaded.allow.rules)
        assert covered != is_public_suffix(host)
        assert covered or "public suffix" in next(iter(found.listed_apart()[host]))


RESTRICTED = """\
version: 1
mode: enforce
default: deny
hosts:
  allow:
    - host: api.example.com
      methods: [GET]
    - host: docs.example.com
      ports: [443]
"""


@pytest.mark.parametrize("policy_given", [True, False], ids=["with-the-policy", "from-the-log-alone"])
def test_a_host_an_allow_rule_names_is_never_proposed_for_what_its_conditions_refused(policy_given):
    """A POST to a host whose rule allows only GET, and port 80 of a host whose rule allows only 443: a bare entry
    for either host would have widened that rule to every method and port (review round 16)."""
    policy = parse_policy(RESTRICTED, "live.yaml")
    records = [decided(policy, request("http://api.example.com/v1", "POST", at=later(0)), flow_id="p1"),
               decided(policy, request("http://docs.example.com/", "GET", at=later(1)), flow_id="p2"),
               decided(policy, request("https://other.example.com/", "GET", at=later(2)), flow_id="p3")]
    assert all(r["rule_id"] == "default:deny" for r in records)
    text, found = suggest_text(records, policy if policy_given else None)
    if policy_given:  # the policy's own answer for the name (without it, the built-in address rules judge)
        assert {e["host"] for e in suggested_entries(text)} == {"other.example.com"}
    assert "api.example.com" not in {e["host"] for e in suggested_entries(text)}
    apart = found.listed_apart()
    assert any("named by allow rule api.example.com (live.yaml:6)" in reason for reason in apart["api.example.com"])
    assert any("named by allow rule docs.example.com (live.yaml:8)" in reason for reason in apart["docs.example.com"])
