"""Review round 21 (third topic): `egresswall suggest` and `egresswall replay` on odd audit lines.

Records are built with tests/audit_factory.py (real decisions, validated against the record's schema), written
to a log file and read back with proxy.audit_reader, as the commands do. No network.
"""

from __future__ import annotations

import json
from pathlib import Path

from audit_factory import decided, request

from policy.loader import parse_policy
from proxy.audit_reader import read_logs
from proxy.replay import replay
from proxy.suggest import Options, collect, render

CONDITIONAL = """\
version: 1
default: deny
hosts:
  allow:
    - host: api.example.com
      methods: [GET]
"""


def suggested_hosts(tmp_path: Path, records: list[dict], policy=None) -> tuple[list[str], str]:
    log = tmp_path / "audit.jsonl"
    log.write_text("".join(json.dumps(record) + "\n" for record in records))
    text = render(collect(read_logs([log]), policy=policy), Options(expires=None), [str(log)], "built-in")
    return [line.split('"')[1] for line in text.splitlines() if line.startswith("    - host:")], text


def test_suggest_never_widens_a_conditional_allow_rule_whatever_the_policy_file_is_called(tmp_path: Path) -> None:
    """An allow rule for api.example.com restricted to GET refuses a POST; `suggest` must not propose a bare
    `api.example.com` entry for it ("an entry for the host would widen that rule", proxy/suggest.py; README
    "Learning an allowlist": suggestions come from names "host rules refused (by the default ...)", and
    tests/test_suggest.py's test_a_host_an_allow_rule_names_is_never_proposed_for_what_its_conditions_refused).
    Without --policy, suggest finds that allow rule by parsing the refusal's reason with _NEAR_MISS
    (proxy/suggest.py:253, ``rule (\\S+ \\([^)]*\\)) ``): a policy file whose name holds a parenthesis — "policy
    (copy).yaml", what file managers call a copy — makes the origin "(policy (copy).yaml:5)", the regex misses,
    and suggest proposes `- host: "api.example.com"`, which admits POST, PUT, DELETE... to it.
    Fix: do not parse the prose; judge by the record's rule_id/matched rule (the record could carry the
    near-miss rule id), or match the origin up to the last ") " before "allows only"/"expired"/"does not"."""
    for name in ("lab.yaml", "policy (copy).yaml"):
        policy = parse_policy(CONDITIONAL, name)
        record = decided(policy, request("http://api.example.com/x", "POST"), ("93.184.216.34",))
        assert record["verdict"] == "refuse" and "allows only methods" in record["reason"]
        hosts, text = suggested_hosts(tmp_path, [record])
        assert hosts == [], f"policy file {name!r}: suggest widened the GET-only rule:\n{text}"


def test_suggest_with_the_policy_given_never_widens_a_conditional_allow_rule_holds(tmp_path: Path) -> None:
    """Held: with --policy the rule is found by the core (verdict.matched), whatever the file name."""
    policy = parse_policy(CONDITIONAL, "policy (copy).yaml")
    record = decided(policy, request("http://api.example.com/x", "POST"), ("93.184.216.34",))
    hosts, _ = suggested_hosts(tmp_path, [record], policy=policy)
    assert hosts == []


def test_suggest_sets_apart_a_name_seen_once_internal_and_once_refused_by_default_holds(tmp_path: Path) -> None:
    """Held: one record of a name resolving inside (report mode) is enough to keep the name out, even when
    another record (enforce mode, refused by default, never resolved) would propose it."""
    report = parse_policy("version: 1\nmode: report\ndefault: deny\n", "lab.yaml")
    enforce = parse_policy("version: 1\ndefault: deny\n", "lab.yaml")
    records = [decided(enforce, request("https://db.example.com/")),
               decided(report, request("https://db.example.com/"), ("10.0.0.5",))]
    hosts, text = suggested_hosts(tmp_path, records)
    assert hosts == [], text
    assert "db.example.com: resolved to 10.0.0.5" in text


def test_suggest_never_proposes_a_public_suffix_or_an_ip_literal_holds(tmp_path: Path) -> None:
    enforce = parse_policy("version: 1\ndefault: deny\n", "lab.yaml")
    records = [decided(enforce, request(url)) for url in
               ("https://github.io/", "https://co.uk/", "http://93.184.216.34/", "https://alice.github.io/")]
    hosts, _ = suggested_hosts(tmp_path, records)
    assert hosts == ["alice.github.io"]


def test_replay_reports_an_address_rule_edit_for_a_resolved_name_holds(tmp_path: Path) -> None:
    """Held: a decision allowed with its addresses recorded is refused by a new addresses.deny (no lookup)."""
    old = parse_policy("version: 1\ndefault: allow\n", "old.yaml")
    new = parse_policy("version: 1\ndefault: allow\naddresses:\n  deny: [93.184.216.0/24]\n", "new.yaml")
    log = tmp_path / "audit.jsonl"
    log.write_text(json.dumps(decided(old, request("https://www.example.com/"), ("93.184.216.34",))) + "\n")
    report = replay(new, read_logs([log]))
    assert report.replayed == 1 and ("allow", "refuse") in report.changes


def test_replay_shows_a_logged_path_as_one_printable_line() -> None:
    """A path from the audit log (client-chosen: the core accepts format characters such as U+202E, a
    right-to-left override, and U+200B) is shown escaped in replay's lines, as suggest shows log text (the
    helper's suspicion, round 21): a terminal must not reorder or hide what an operator reads."""
    from proxy.audit_reader import Record
    from proxy.replay import describe_request

    record = Record.__new__(Record)
    for name, value in {"method": "GET", "scheme": "http", "host": "a.example.com", "port": 80,
                        "path": "/x\u202egpj.exe\u200b\n"}.items():
        object.__setattr__(record, name, value)
    line = describe_request(record)
    assert line.isprintable() and "\\u202e" in line and "\\u200b" in line and "\\x0a" in line, line
