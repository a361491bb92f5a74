"""egresswall replay: decisions re-decided against an edited policy, on logs in the gate's record format."""

from __future__ import annotations

import gzip
import json
from datetime import timedelta

import pytest
from audit_factory import T0, decided, later, other_record, request, rfc3339, write_log
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policy.decision import Request
from policy.hosts import Target
from policy.loader import parse_policy
from proxy.audit_reader import read_log
from proxy.cli import main
from proxy.replay import Outcome, ReplayReport, redecide, render_text, replay

BASE = """\
version: 1
mode: {mode}
default: deny
ports: {{http: [80, 8080], connect: [443, 8443]}}
addresses: {{allow: [198.18.0.0/15]}}
hosts:
  deny:
    - "*.ads.example.com"
  allow:
    - docs.example.com
    - .shop.example.org
    - host: api.example.net
      ports: {api_ports}
{extra}roles:
  - name: ci
    clients: [10.9.0.0/16]
    hosts: {{allow: [.pypi.org]}}
"""


def policy_text(mode: str = "enforce", api_ports: str = "[443, 8443]", extra: str = "", drop: str = "") -> str:
    text = BASE.format(mode=mode, api_ports=api_ports, extra=extra)
    return text.replace(f"    - {drop}\n", "") if drop else text


def policy(**kw):
    return parse_policy(policy_text(**kw), "policy.yaml")


ADD_HOST = {"extra": "    - new.example.com\n"}
REMOVE_HOST = {"drop": "docs.example.com"}
TIGHTEN_PORTS = {"api_ports": "[443]"}
PUBLIC = ("198.18.0.10",)


def enforce_log() -> list[dict | str]:
    """Allowed, refused by host, by a deny rule, by address, by port, a failed lookup, a CNAME refusal,
    a role, and the lines that are not policy decisions (a cap, a malformed head, a TLS refusal)."""
    p = policy()
    t = iter(range(100))

    def at() -> object:
        return later(next(t))

    return [
        decided(p, request("http://docs.example.com/guide", at=at()), PUBLIC),  # 1 allow
        decided(p, request("api.example.net:8443", "CONNECT", at=at()), ("198.18.0.11",)),  # 2 allow
        decided(p, request("api.example.net:443", "CONNECT", at=at()), ("198.18.0.11",)),  # 3 allow
        decided(p, request("new.example.com:443", "CONNECT", at=at())),  # 4 refuse: default deny
        decided(p, request("http://new.example.com/x", at=at())),  # 5 refuse: default deny
        decided(p, request("x.ads.example.com:443", "CONNECT", at=at())),  # 6 refuse: deny rule
        decided(p, request("www.shop.example.org:443", "CONNECT", at=at()), ("10.0.0.5",)),  # 7 refuse: address
        decided(p, request("docs.example.com:22", "CONNECT", at=at())),  # 8 refuse: port
        decided(p, request("gone.shop.example.org:443", "CONNECT", at=at()), dns_error="nxdomain"),  # 9 refuse
        decided(p, request("alias.shop.example.org:443", "CONNECT", at=at()), ("198.18.0.13",),
                ("x.ads.example.com",)),  # 10 refuse: CNAME to a denied name
        decided(p, request("files.pypi.org:443", "CONNECT", client="10.9.0.3", at=at()), ("198.18.0.14",)),  # 11
        other_record("limits", at=at(), rule="limits.max_connections_per_client"),  # 12
        other_record("form", at=at(), rule="http:malformed", url="GET /\x00 HTTP/1.1"),  # 13
        "{\"time\": \"2026-12-01T07:13:00.000Z\", \"event\": \"decis",  # 14 truncated
        other_record("tls", at=at(), host="public.example.com", port=443, scheme="https", method="CONNECT"),  # 15
        other_record("host", at=at(), event="response", verdict="allow", status=200),  # 16 a response line
    ]


@pytest.fixture
def log(tmp_path):
    return write_log(tmp_path / "audit.jsonl", enforce_log())


def run(log_path, **policy_kw) -> ReplayReport:
    return replay(policy(**policy_kw), read_log(log_path))


def test_the_log_is_what_it_says():
    records = [r for r in enforce_log() if isinstance(r, dict)]
    assert [(r["verdict"], r["stage"]) for r in records[:11]] == [
        ("allow", "host"), ("allow", "host"), ("allow", "host"), ("refuse", "host"), ("refuse", "host"),
        ("refuse", "host"), ("refuse", "address"), ("refuse", "port"), ("refuse", "resolve"), ("refuse", "resolve"),
        ("allow", "host")]
    assert records[10]["role"] == "ci" and records[9]["cnames"] == ["x.ads.example.com"]


def test_the_unchanged_policy_changes_nothing(log):
    report = run(log)
    assert report.replayed == 11 and report.changed == 0 and not report.changes and not report.other_rule


def test_not_replayed_lines_are_counted_and_named(log):
    report = run(log)
    skipped = {reason: s.places for reason, s in report.not_replayed.items()}
    assert skipped["not a policy decision (stage limits)"] == [f"{log}:12"]
    assert skipped["not a policy decision (stage form)"] == [f"{log}:13"]
    assert skipped["not a policy decision (stage tls)"] == [f"{log}:15"]
    (corrupt,) = [reason for reason in skipped if reason.startswith("cannot read: not JSON")]
    assert skipped[corrupt] == [f"{log}:14"]
    assert report.other_events == {"response": 1}


def test_adding_a_host_lets_its_refusals_through(log):
    report = run(log, **ADD_HOST)
    assert set(report.changes) == {("refuse", "allow")}
    change = report.changes[("refuse", "allow")]
    assert change.count == 2 and dict(change.hosts) == {"new.example.com": 2}
    old_rule = enforce_log()[3]["rule_id"]
    (new_rule,) = [r for r in policy(**ADD_HOST).allow.rules if r.pattern.text == "new.example.com"]
    assert "default" in old_rule and dict(change.rules) == {(old_rule, new_rule.rule_id): 2}
    assert [e.place for e in change.examples] == [f"{log}:4", f"{log}:5"]
    first = change.examples[0]
    assert first.request == "CONNECT new.example.com:443" and first.time == rfc3339(later(3))
    assert first.old.reason.startswith("new.example.com is not on the allowlist")
    assert first.new.unresolved and first.new.reason == "new.example.com is allowed by rule new.example.com"
    assert report.fails("allow") and report.fails("any") and not report.fails("refuse")


def test_removing_a_host_refuses_it(log):
    report = run(log, **REMOVE_HOST)
    assert set(report.changes) == {("allow", "refuse")}
    change = report.changes[("allow", "refuse")]
    assert change.count == 1 and dict(change.hosts) == {"docs.example.com": 1}
    (example,) = change.examples
    assert example.place == f"{log}:1" and example.request == "GET http://docs.example.com:80/guide"
    assert "default" in example.new.rule_id and not example.new.unresolved
    # The port-22 refusal of the same host stays a port refusal.
    assert report.replayed == 11
    assert report.fails("refuse") and not report.fails("allow")


def test_tightening_ports_refuses_only_the_port_it_drops(log):
    report = run(log, **TIGHTEN_PORTS)
    assert set(report.changes) == {("allow", "refuse")}
    change = report.changes[("allow", "refuse")]
    assert change.count == 1 and dict(change.hosts) == {"api.example.net": 1}
    (example,) = change.examples
    assert example.place == f"{log}:2" and example.request == "CONNECT api.example.net:8443"
    assert "allows only ports [443]" in example.new.reason


def test_report_mode_records_replayed_in_enforce_are_refusals(tmp_path):
    report_policy = policy(mode="report")
    records = [decided(report_policy, request("new.example.com:443", "CONNECT", at=later(i)), PUBLIC, flow_id=f"r{i}")
               for i in range(3)]
    records.append(decided(report_policy, request("docs.example.com:443", "CONNECT", at=later(5)), PUBLIC))
    assert [r["verdict"] for r in records] == ["report"] * 3 + ["allow"]
    log_path = write_log(tmp_path / "report.jsonl", records)
    enforce = run(log_path)
    assert {k: c.count for k, c in enforce.changes.items()} == {("report", "refuse"): 3}
    assert enforce.fails("refuse")
    added = run(log_path, **ADD_HOST)
    assert {k: c.count for k, c in added.changes.items()} == {("report", "allow"): 3}
    assert not added.fails("refuse") and not added.fails("allow") and added.fails("any")
    # The addresses logged at the time are judged again: a narrower address rule refuses them.
    narrowed = replay(parse_policy(policy_text(**ADD_HOST).replace("198.18.0.0/15", "198.19.0.0/16"), "p.yaml"),
                      read_log(log_path))
    assert {k: c.count for k, c in narrowed.changes.items()} == {("report", "refuse"): 3, ("allow", "refuse"): 1}
    assert narrowed.changes[("allow", "refuse")].examples[0].new.stage == "address"


def test_a_failed_lookup_stays_failed_and_a_cname_is_judged_again(log):
    records = list(read_log(log))
    no_deny = parse_policy(policy_text().replace("  deny:\n    - \"*.ads.example.com\"\n", ""), "p.yaml")
    assert redecide(no_deny, records[8]).rule == "dns:nxdomain"
    alias = redecide(no_deny, records[9])
    assert alias.verdict == "allow"  # the chain led to a name no rule denies any more


def test_roles_come_from_the_client(log):
    records = list(read_log(log))
    without_role = parse_policy(policy_text().split("roles:")[0], "p.yaml")
    outcome = redecide(without_role, records[10])
    assert outcome.verdict == "refuse" and outcome.stage == "host"


def test_since_and_at(log):
    report = replay(policy(), read_log(log), since=later(5))
    assert report.before_since == 5 and report.replayed == 6
    expiry = f"{T0 + timedelta(minutes=4):%Y-%m-%dT%H:%M}Z"
    expiring = {"extra": f"    - host: new.example.com\n      expires: '{expiry}'\n"}
    report = run(log, **expiring)  # judged at each record's time: line 4 (minute 3) allowed, line 5 not
    assert report.changes[("refuse", "allow")].count == 1
    report = replay(policy(**expiring), read_log(log), at=later(60))
    assert not report.changes


def test_a_rotated_gzipped_log_replays(tmp_path, log):
    gz = tmp_path / "audit.jsonl.1.gz"
    gz.write_bytes(gzip.compress(log.read_bytes()))
    assert run(gz, **REMOVE_HOST).changes[("allow", "refuse")].count == 1


def write_policy(tmp_path, name="new.yaml", **kw):
    path = tmp_path / name
    path.write_text(policy_text(**kw))
    return path


@pytest.mark.parametrize(("edit", "fail_on", "code"), [
    ({}, "any", 0), (ADD_HOST, "refuse", 0), (ADD_HOST, "allow", 1), (ADD_HOST, "any", 1), (ADD_HOST, None, 0),
    (REMOVE_HOST, "refuse", 1), (REMOVE_HOST, "allow", 0), (TIGHTEN_PORTS, "refuse", 1), (TIGHTEN_PORTS, "any", 1),
])
def test_fail_on_exit_codes(tmp_path, log, capsys, edit, fail_on, code):
    args = ["replay", str(log), "--policy", str(write_policy(tmp_path, **edit))]
    assert main(args + (["--fail-on", fail_on] if fail_on else [])) == code


def test_text_output(tmp_path, log, capsys):
    assert main(["replay", str(log), "--policy", str(write_policy(tmp_path, **ADD_HOST))]) == 0
    out = capsys.readouterr().out
    assert "11 decision(s) replayed (2026-12-01T07:00:00.000Z .. 2026-12-01T07:10:00.000Z), 2 would change" in out
    assert "refuse -> allow: 2\n  by host: new.example.com 2\n" in out
    assert f"  e.g. {log}:4 2026-12-01T07:03:00.000Z 10.1.0.5 CONNECT new.example.com:443\n" in out
    assert "[the name was not resolved at the time" in out
    assert "cannot read: not JSON" in out and f"(at {log}:14)" in out
    assert f"not a policy decision (stage limits): 1 (at {log}:12)" in out


def test_json_output(tmp_path, log, capsys):
    assert main(["replay", str(log), "--policy", str(write_policy(tmp_path, **TIGHTEN_PORTS)), "--json",
                 "--fail-on", "refuse"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["replayed"] == 11 and out["changed"] == 1 and out["fails"] is True
    (change,) = out["changes"]
    assert change["from"] == "allow" and change["to"] == "refuse" and change["hosts"] == [
        {"host": "api.example.net", "count": 1}]
    assert change["examples"][0]["line"] == f"{log}:2" and change["examples"][0]["new"]["stage"] == "host"
    assert {"reason": "not a policy decision (stage limits)", "count": 1, "lines": [f"{log}:12"]} in out[
        "not_replayed"]


def test_errors_exit_2(tmp_path, log, capsys):
    assert main(["replay", str(tmp_path / "missing.jsonl"), "--policy", str(write_policy(tmp_path))]) == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 2\n")
    assert main(["replay", str(log), "--policy", str(bad)]) == 2
    assert main(["replay", str(log), "--policy", str(write_policy(tmp_path)), "--since", "yesterday"]) == 2
    assert "--since 'yesterday'" in capsys.readouterr().err


@pytest.mark.parametrize("fail_on", [None, "any", "refuse"])
def test_a_gate_with_nothing_replayed_fails_rather_than_pass(tmp_path, capsys, fail_on):
    """``replay EMPTY --fail-on any`` (or the policy file given as the log) exited 0: a CI gate pointed at the wrong
    file passed silently (review round 16). Without --fail-on it reports and exits 0, as before."""
    empty, policy = tmp_path / "empty.jsonl", write_policy(tmp_path)
    empty.write_text("")
    code = main(["replay", str(empty), "--policy", str(policy)] + (["--fail-on", fail_on] if fail_on else []))
    assert code == (0 if fail_on is None else 2)
    captured = capsys.readouterr()
    assert "0 decision(s) replayed" in captured.out
    assert ("checked against nothing" in captured.err) == (fail_on is not None), captured.err
    # A file of which no line could be read (the policy given as the log, a --log-format squid log) is not an
    # empty log: it fails with or without --fail-on, and says why (review round 17).
    code = main(["replay", str(policy), "--policy", str(policy)] + (["--fail-on", fail_on] if fail_on else []))
    assert code == 2
    captured = capsys.readouterr()
    assert "0 decision(s) replayed" in captured.out
    assert "no line is an egresswall audit record" in captured.err and f"{policy}:1: " in captured.err, captured.err


def test_a_line_with_a_number_of_thousands_of_digits_is_unreadable_not_a_crash(tmp_path, log, capsys):
    """Python refuses to read an integer of more than 4,300 digits (ValueError, not a JSON error): one such line
    ended replay and suggest with an internal error (review round 17). It is a line not read, at its place."""
    huge = tmp_path / "huge.jsonl"
    huge.write_bytes(log.read_bytes() + b'{"time": ' + b"9" * 5000 + b"}\n")
    policy = write_policy(tmp_path)
    assert main(["replay", str(huge), "--policy", str(policy)]) == 0
    out = capsys.readouterr().out
    assert "not an audit record (Exceeds the limit" in out and f"{huge}:" in out, out
    assert main(["suggest", str(huge), "--policy", str(policy), "-o", str(tmp_path / "s.yaml")]) == 0


@pytest.mark.parametrize("since", ["999999999w", "9999999d"])
def test_a_since_reaching_back_before_the_year_1_is_a_usage_error(tmp_path, log, capsys, since):
    assert main(["replay", str(log), "--policy", str(write_policy(tmp_path)), "--since", since]) == 2
    assert f"--since '{since}': reaches back before the year 1" in capsys.readouterr().err


# ---- properties ----------------------------------------------------------------------------------

HOSTS = ["docs.example.com", "new.example.com", "x.ads.example.com", "www.shop.example.org", "api.example.net",
         "files.pypi.org", "198.18.0.20", "10.0.0.9"]
ADDRESSES = ["198.18.0.10", "198.19.3.4", "10.0.0.5", "169.254.169.254", "2001:db8::1", "fd00::1"]


@st.composite
def logged(draw, mode: str):
    """A decision as the gate makes it, over hosts the policy's rules name; mostly the usual ports and
    public answers, so that every stage and verdict shows up."""
    p = policy(mode=mode)
    host = draw(st.sampled_from(HOSTS))
    tunnel = draw(st.booleans())
    scheme = "https" if tunnel else draw(st.sampled_from(["http", "https", "ws"]))
    usual = 443 if scheme == "https" else 80
    port = draw(st.sampled_from([usual, usual, usual, 8080, 8443, 22]))
    client = draw(st.sampled_from(["10.1.0.5", "10.9.0.3", None]))
    at = T0 + timedelta(seconds=draw(st.integers(0, 10 ** 6)))
    if tunnel:
        req = request(f"{host}:{port}", "CONNECT", client=client, at=at)
    else:
        req = Request(Target(scheme, host, port, draw(st.sampled_from(["/", "/a/b"])), _ip(host)),
                      draw(st.sampled_from(["GET", "POST"])), client, websocket=scheme == "ws", at=at)
    public = st.sampled_from(ADDRESSES[:2])
    addresses = tuple(draw(st.lists(public, min_size=1, max_size=2, unique=True) | st.lists(
        st.sampled_from(ADDRESSES), max_size=3, unique=True)))
    cnames = tuple(draw(st.just([]) | st.lists(st.sampled_from(["x.ads.example.com", "cdn.example.net",
                                                                  "db.internal"]), max_size=2, unique=True)))
    dns_error = draw(st.sampled_from([None, None, None, "timeout", "nxdomain"]))
    return decided(p, req, addresses, cnames, dns_error)


def _ip(host: str):
    import ipaddress

    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mode=st.sampled_from(["enforce", "report"]), data=st.data())
def test_replay_with_the_unchanged_policy_reports_zero_changes(tmp_path, mode, data):
    records = data.draw(st.lists(logged(mode), min_size=1, max_size=12))
    log_path = write_log(tmp_path / f"p-{mode}.jsonl", records)
    report = replay(policy(mode=mode), read_log(log_path))
    assert report.replayed == len(records) and not report.not_replayed
    assert report.changed == 0 and not report.other_rule


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), added=st.sampled_from(HOSTS[:6] + [".example.com", ".example.org"]))
def test_adding_an_allow_entry_never_refuses_what_was_let_through(tmp_path, data, added):
    records = data.draw(st.lists(logged("enforce"), min_size=1, max_size=12))
    log_path = write_log(tmp_path / "p.jsonl", records)
    report = replay(policy(extra=f"    - {json.dumps(added)}\n"), read_log(log_path))
    assert not report.fails("refuse")
    assert all(old == "refuse" for old, _ in report.changes)


def test_same_verdict_by_another_rule_is_shown_but_is_no_change(log):
    record = next(iter(read_log(log)))
    report = ReplayReport()
    old = Outcome("allow", "host", "policy.yaml:10", "hosts.allow:docs.example.com", "r")
    report.add(record, old, Outcome("allow", "host", "policy.yaml:10", "hosts.allow:.example.com", "r"))
    report.add(record, old, old)
    assert report.replayed == 2 and report.changed == 0 and not report.fails("any")
    (change,) = report.other_rule.values()
    assert dict(change.rules) == {("hosts.allow:docs.example.com", "hosts.allow:.example.com"): 1}
    text = render_text(report, ["a.jsonl"], "p.yaml")
    assert "still allow, by another rule: 1 (hosts.allow:docs.example.com -> hosts.allow:.example.com 1)" in text


TEXT = st.text(st.characters(codec="utf-8"), max_size=30)


@settings(max_examples=300, deadline=None)
@given(host=TEXT | st.sampled_from(HOSTS + ["[::1]", "::ffff:1.2.3.4", "a..b", "xn--", "EXAMPLE.com."]),
       scheme=TEXT | st.sampled_from(["http", "https", "ws", "wss", "ftp"]), method=TEXT | st.just("CONNECT"),
       client=st.none() | TEXT | st.sampled_from(["10.9.0.3", "::ffff:10.9.0.3", "fe80::1%eth0"]),
       port=st.integers(0, 65535), path=st.none() | TEXT, addresses=st.lists(TEXT | st.sampled_from(ADDRESSES)),
       cnames=st.lists(TEXT | st.sampled_from(["db.internal", "x.ads.example.com"]), max_size=3),
       stage=st.sampled_from(["scheme", "port", "host", "resolve", "address"]), verdict=st.sampled_from(
           ["allow", "refuse", "report"]), rule=TEXT | st.just("dns:timeout"))
def test_replay_and_suggest_take_any_record_the_schema_accepts(host, scheme, method, client, port, path, addresses,
                                                                cnames, stage, verdict, rule):
    from audit_factory import validated

    from proxy.audit_reader import Place, parse_line
    from proxy.suggest import Options, collect, render

    record = validated({**decided(policy(), request("http://docs.example.com/")), "host": host, "scheme": scheme,
                        "method": method, "client": client, "port": port, "path": path, "addresses": addresses,
                        "cnames": cnames, "stage": stage, "verdict": verdict, "rule": rule, "rule_id": rule})
    items = [parse_line(json.dumps(record).encode(), Place("a", 1))]
    report = replay(policy(), items)
    assert report.replayed + sum(s.count for s in report.not_replayed.values()) == 1
    found = collect(items, policy=policy(mode="report"))
    parse_policy(render(found, Options(), ["a"], "x"), "s.yaml")
    parse_policy(render(collect(items), Options(domains=True), ["a"], "x"), "s.yaml")
