"""Audit records in the gate's format, built from real decisions, for the replay and suggest tests.

Each record is what the gate's Recorder (proxy/records.py on main) writes for a verdict, and every one is
validated against the record's JSON Schema (proxy/audit-record.schema.json, the gate's
until it lands) before a test may use it: a test cannot feed replay a record the gate would not write.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import jsonschema

from policy.decision import Request, Resolution, Verdict, decide, precheck, refuse_resolution
from policy.hosts import parse_authority, parse_url
from policy.model import Policy
from proxy.records import SCHEMA_PATH

SCHEMA = json.loads(SCHEMA_PATH.read_text())  # the record's one schema, shipped with proxy/records.py
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA, format_checker=jsonschema.FormatChecker())
T0 = datetime(2026, 12, 1, 7, 0, 0, tzinfo=UTC)


def rfc3339(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def validated(record: dict) -> dict:
    VALIDATOR.validate(record)
    return record


def record_of(policy: Policy, request: Request, verdict: Verdict, cnames: tuple[str, ...] = (),
              event: str = "decision", flow_id: str = "f1") -> dict:
    """The line the gate writes for this verdict (records.py's Recorder.record, then write)."""
    target = request.target
    path = None
    if target.path:
        path = target.path if policy.log_query_strings else target.path.split("?", 1)[0]
    word = "report" if verdict.report_only else ("allow" if verdict.allowed else "refuse")
    return validated({
        "time": rfc3339(request.at), "event": event, "id": flow_id, "client": request.client, "verdict": word,
        "stage": verdict.stage, "rule": verdict.rule, "rule_id": getattr(verdict, "rule_id", "") or verdict.rule,
        "reason": verdict.reason, "mode": policy.mode, "role": verdict.role, "session": None,
        "method": request.method, "scheme": target.scheme, "host": target.host, "port": target.port, "path": path,
        "url": None, "addresses": list(verdict.addresses), "cnames": list(cnames), "pinned": verdict.pinned,
        "status": None if verdict.allowed else 403, "bytes_up": None, "bytes_down": None, "duration_ms": None,
        "error": None})


def request(url: str, method: str = "GET", client: str | None = "10.1.0.5", at: datetime = T0) -> Request:
    """A plain request for an http/ws URL; a CONNECT for ``CONNECT host:port``."""
    if method == "CONNECT":
        return Request(parse_authority(url, "https"), "CONNECT", client, tunnel=True, at=at)
    target = parse_url(url)
    return Request(target, method, client, websocket=target.scheme in ("ws", "wss"), at=at)


def decided(policy: Policy, req: Request, addresses: tuple[str, ...] = (), cnames: tuple[str, ...] = (),
            dns_error: str | None = None, flow_id: str = "f1") -> dict:
    """Decide as the gate does (precheck, resolve only when allowed, decide) and return the record."""
    verdict = precheck(policy, req)
    resolved: tuple[str, ...] = ()  # the chain is recorded only when the name was looked up
    if verdict.allowed and req.target.ip is None:
        if dns_error is not None:
            verdict = refuse_resolution(dns_error, f"the lookup of {req.target.host} failed: {dns_error}", verdict)
        else:
            verdict = decide(policy, req, Resolution(req.target.host, addresses, cnames))
            resolved = cnames
    return record_of(policy, req, verdict, resolved, flow_id=flow_id)


def other_record(kind: str, at: datetime = T0, **changes) -> dict:
    """A record that is not a policy decision: a cap refusal, a malformed head, a TLS refusal."""
    record = {"time": rfc3339(at), "event": "decision", "id": "x1", "client": "10.1.0.5", "verdict": "refuse",
              "stage": kind, "rule": f"{kind}:something", "rule_id": f"{kind}:something", "reason": "a reason",
              "mode": "enforce", "role": None, "session": None, "method": None, "scheme": None, "host": None,
              "port": None, "path": None, "url": None, "addresses": [], "cnames": [], "pinned": None, "status": 400,
              "bytes_up": None, "bytes_down": None, "duration_ms": None, "error": None}
    record.update(changes)
    return validated(record)


def write_log(path: Path, records: list[dict | str]) -> Path:
    """One JSON line per record; a str is written as it is (a corrupted line)."""
    lines = [r if isinstance(r, str) else json.dumps(r, separators=(",", ":")) for r in records]
    path.write_text("".join(line + "\n" for line in lines))
    return path


def later(minutes: float) -> datetime:
    return T0 + timedelta(minutes=minutes)
