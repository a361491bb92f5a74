"""replay and suggest on logs the real proxy wrote in the loopback lab (tests/conftest.py).

These need the gate's audit record (proxy/records.py: rule_id, pinned, cnames...). Until it is on the
branch the proxy writes the older record, and each test skips as soon as it has seen the log's first
line: replay and suggest refuse the old format by design (tests/test_replay.py, test_suggest.py and
test_audit_reader.py cover them on records of the new format built from real decisions).
"""

from __future__ import annotations

import json

import pytest
import yaml

from proxy.cli import main

pytestmark = pytest.mark.integration


def require_gate_record(proxy) -> None:
    lines = proxy.log_path.read_text().splitlines()
    assert lines, "the proxy wrote no audit line"
    assert "pinned" in json.loads(lines[0]), "the audit record is not the gate's (proxy/records.py)"


def policy_yaml(lab, allow: str, deny: str = "", mode: str = "enforce") -> str:
    hosts = "hosts:\n" + (f"  deny:\n{deny}" if deny else "") + (f"  allow:\n{allow}" if allow else "")
    return lab.policy_text(hosts, default="deny", mode=mode)


def both_ports(lab) -> str:
    return f"[{lab.public.port}, {lab.public_tls.port}]"


def base_allow(lab, public_ports: str | None = None, extra: str = "", drop_public: bool = False) -> str:
    ports = public_ports or both_ports(lab)
    public = "" if drop_public else f"    - host: public.lab.example\n      ports: {ports}\n"
    return public + "    - internal.lab.example\n    - mixed.lab.example\n" + extra


DENY = "    - denied.lab.example\n"


def send_traffic(lab, proxy) -> None:
    """Allowed (plain and a tunnel), refused by host (default and a deny rule), by address, by port."""
    web = lab.public.port
    proxy.get(f"http://public.lab.example:{web}/page")  # 1
    require_gate_record(proxy)
    sock, status, _ = proxy.connect(f"public.lab.example:{lab.public_tls.port}")  # 2
    sock.close()
    assert status == 200
    proxy.get(f"http://other.lab.example:{web}/x")  # 3: not on the allowlist
    proxy.get(f"http://denied.lab.example:{web}/")  # 4: a deny rule
    proxy.get(f"http://internal.lab.example:{web}/")  # 5: resolves inside
    proxy.get(f"http://mixed.lab.example:{web}/")  # 6: one answer inside
    sock, status, _ = proxy.connect("public.lab.example:22")  # 7: a port not allowed
    sock.close()
    assert status == 403


def decision_lines(proxy) -> list[tuple[int, dict]]:
    lines = proxy.log_path.read_text().splitlines()
    return [(n, r) for n, r in ((n, json.loads(line)) for n, line in enumerate(lines, 1)) if r["event"] == "decision"]


def replay_json(capsys, log, policy_path, *extra: str) -> tuple[int, dict]:
    code = main(["replay", str(log), "--policy", str(policy_path), "--json", *extra])
    return code, json.loads(capsys.readouterr().out)


def counts(report: dict) -> dict[tuple[str, str], int]:
    return {(c["from"], c["to"]): c["count"] for c in report["changes"]}


def test_replay_of_a_real_log_for_three_edits(lab, start_proxy, tmp_path, capsys):
    proxy = start_proxy(policy_yaml(lab, base_allow(lab), DENY))
    send_traffic(lab, proxy)
    decisions = decision_lines(proxy)
    by_host = {}
    for n, record in decisions:
        by_host.setdefault((record["host"], record["port"]), []).append((n, record))
    assert [r["verdict"] for _, r in decisions] == ["allow", "allow"] + ["refuse"] * 5
    assert [r["stage"] for _, r in decisions] == ["host", "host", "host", "host", "address", "address", "port"]
    with proxy.log_path.open("a") as log:
        log.write('{"time": "2026-12-01T07:00:00.000Z", "event": "decis\n')  # a corrupted line
    corrupt_line = len(proxy.log_path.read_text().splitlines())

    same = tmp_path / "same.yaml"
    same.write_text(policy_yaml(lab, base_allow(lab), DENY))
    code, report = replay_json(capsys, proxy.log_path, same, "--fail-on", "any")
    assert code == 0 and report["replayed"] == 7 and report["changed"] == 0
    (corrupt,) = [s for s in report["not_replayed"] if s["reason"].startswith("cannot read: not JSON")]
    assert corrupt["lines"] == [f"{proxy.log_path}:{corrupt_line}"]

    added = tmp_path / "added.yaml"  # edit 1: add a host
    added.write_text(policy_yaml(lab, base_allow(lab, extra="    - other.lab.example\n"), DENY))
    code, report = replay_json(capsys, proxy.log_path, added, "--fail-on", "allow")
    assert code == 1 and counts(report) == {("refuse", "allow"): 1}
    (change,) = report["changes"]
    (line, _), = by_host[("other.lab.example", lab.public.port)]
    assert change["hosts"] == [{"host": "other.lab.example", "count": 1}]
    assert change["examples"][0]["line"] == f"{proxy.log_path}:{line}"
    assert change["examples"][0]["new"]["unresolved"] is True
    assert main(["replay", str(proxy.log_path), "--policy", str(added), "--fail-on", "refuse"]) == 0
    assert "refuse -> allow: 1\n  by host: other.lab.example 1\n" in capsys.readouterr().out

    removed = tmp_path / "removed.yaml"  # edit 2: remove a host
    removed.write_text(policy_yaml(lab, base_allow(lab, drop_public=True), DENY))
    code, report = replay_json(capsys, proxy.log_path, removed, "--fail-on", "refuse")
    assert code == 1 and counts(report) == {("allow", "refuse"): 2}
    assert report["changes"][0]["hosts"] == [{"host": "public.lab.example", "count": 2}]
    assert [e["line"] for e in report["changes"][0]["examples"]] == [
        f"{proxy.log_path}:{decisions[0][0]}", f"{proxy.log_path}:{decisions[1][0]}"]

    tightened = tmp_path / "tightened.yaml"  # edit 3: tighten ports
    tightened.write_text(policy_yaml(lab, base_allow(lab, public_ports=f"[{lab.public.port}]"), DENY))
    code, report = replay_json(capsys, proxy.log_path, tightened, "--fail-on", "refuse")
    assert code == 1 and counts(report) == {("allow", "refuse"): 1}
    (example,) = report["changes"][0]["examples"]
    assert example["request"] == f"CONNECT public.lab.example:{lab.public_tls.port}"
    assert f"allows only ports [{lab.public.port}]" in example["new"]["reason"]


def test_replay_of_a_real_report_mode_log(lab, start_proxy, tmp_path, capsys):
    proxy = start_proxy(policy_yaml(lab, base_allow(lab), DENY, mode="report"))
    send_traffic(lab, proxy)
    verdicts = {r["host"]: r["verdict"] for _, r in decision_lines(proxy)}
    assert verdicts["other.lab.example"] == "report" and verdicts["denied.lab.example"] == "report"
    enforce = tmp_path / "enforce.yaml"
    enforce.write_text(policy_yaml(lab, base_allow(lab), DENY))
    code, report = replay_json(capsys, proxy.log_path, enforce, "--fail-on", "refuse")
    assert code == 1 and counts(report) == {("report", "refuse"): 2}
    added = tmp_path / "added.yaml"
    added.write_text(policy_yaml(lab, base_allow(lab, extra="    - other.lab.example\n"), DENY))
    code, report = replay_json(capsys, proxy.log_path, added)
    assert counts(report) == {("report", "refuse"): 1, ("report", "allow"): 1}
    assert {c["hosts"][0]["host"] for c in report["changes"]} == {"denied.lab.example", "other.lab.example"}


def page_load(lab, proxy) -> None:
    """What a lab page asks for: the page and an asset host, and names that lead inside."""
    web = lab.public.port
    proxy.get(f"http://public.lab.example:{web}/")
    require_gate_record(proxy)
    proxy.get(f"http://other.lab.example:{web}/asset.js")
    sock, _, _ = proxy.connect(f"public.lab.example:{lab.public_tls.port}")
    sock.close()
    for name in ("internal.lab.example", "mixed.lab.example", "alias.lab.example", "alias2.lab.example"):
        proxy.get(f"http://{name}:{web}/")


def test_suggest_from_a_real_report_mode_log(lab, start_proxy, tmp_path, capsys):
    # The lab is shared by the session, and some tests (the weakened-browser probes) reach the internal
    # stand-in on purpose: what counts is that THIS test added no connection there.
    internal_before = len(lab.internal.connections)
    first = start_proxy(lab.policy_text(default="deny", mode="report"), name="report.yaml")
    page_load(lab, first)
    out = tmp_path / "suggested.yaml"
    assert main(["suggest", str(first.log_path), "--policy", str(first.policy_path), "-o", str(out)]) == 0
    capsys.readouterr()
    text = out.read_text()
    entries = yaml.safe_load(text)["hosts"]["allow"]
    assert {e["host"] for e in entries} == {"public.lab.example", "other.lab.example"}
    for name in ("internal.lab.example", "mixed.lab.example", "alias.lab.example", "alias2.lab.example"):
        assert f"#   {name}: " in text
    assert main(["lint", str(out), "--strict"]) == 0
    capsys.readouterr()

    # The block added, enforce mode: the same load meets no host refusal for the names suggested.
    allow = "".join(f"    - host: {e['host']}\n      owner: {e['owner']}\n      expires: '{e['expires']}'\n"
                    for e in entries)
    second = start_proxy(policy_yaml(lab, allow), name="enforce.yaml")
    page_load(lab, second)
    decisions = [r for _, r in decision_lines(second)]
    suggested = {e["host"] for e in entries}
    assert all(r["verdict"] == "allow" for r in decisions if r["host"] in suggested)
    assert not [r for r in decisions if r["stage"] == "host" and r["verdict"] == "refuse" and r["host"] in suggested]
    assert all(r["verdict"] == "refuse" for r in decisions if r["host"] not in suggested)
    assert lab.internal.connections[internal_before:] == []
