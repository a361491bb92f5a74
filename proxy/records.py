"""The audit record, declared once, and the one writer of records.

Every decision, finished response and closed tunnel becomes one ``AuditRecord``; both transports
(the mitmproxy addons and the fast front) hand their facts to ``Recorder`` and nothing else writes
to the audit log. The JSON Schema of a line ships beside this module (``audit-record.schema.json``)
and a test holds the two together. The vocabulary is ``egresswall check --json``'s: ``verdict`` is
allow / refuse / report, ``stage`` the step that decided, ``rule`` what decided with its place in the
file, ``rule_id`` the stable id metrics are labelled with.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from policy.decision import Verdict
from policy.hosts import Target, for_logs
from policy.model import Policy

from .audit import AuditLog, rfc3339
from .metrics import Metrics

SCHEMA_PATH = Path(__file__).with_name("audit-record.schema.json")
DECISION, RESPONSE, TUNNEL, CONNECTION = "decision", "response", "tunnel", "connection"


def verdict_word(verdict: Verdict) -> str:
    return "report" if verdict.report_only else ("allow" if verdict.allowed else "refuse")


def rule_id_of(verdict: Verdict) -> str:
    """The stable id of what decided (a host rule's ``id``, policy/rule_ids.py); the verdicts the gate
    makes itself (caps, TLS, audit) carry their rule text, which is stable already."""
    return verdict.rule_id or verdict.rule


@dataclass(slots=True)
class AuditRecord:
    event: str  # decision | response | tunnel | connection
    id: str
    client: str | None
    verdict: str  # allow | refuse | report
    stage: str
    rule: str
    rule_id: str
    reason: str
    mode: str
    time: str = ""  # RFC 3339 UTC, filled when written
    role: str | None = None
    session: str | None = None
    method: str | None = None
    scheme: str | None = None
    host: str | None = None
    port: int | None = None
    path: str | None = None
    url: str | None = None  # what the client asked for, when it could not be parsed into host and port
    addresses: list[str] = field(default_factory=list)
    cnames: list[str] = field(default_factory=list)
    pinned: str | None = None  # the one checked address connected to (None through an upstream proxy)
    status: int | None = None  # what the client was answered (None: a tunnel ended inside, no HTTP status)
    bytes_up: int | None = None
    bytes_down: int | None = None
    duration_ms: float | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        # time first: the order a reader scans a line in. Built field by field, not with
        # dataclasses.asdict (a deep copy that was a tenth of a fast tunnel's CPU); the lists are copied.
        line: dict[str, Any] = {"time": self.time}
        for name in _FIELD_NAMES:
            value = getattr(self, name)
            line[name] = list(value) if isinstance(value, list) else value
        return line


_FIELD_NAMES = tuple(f.name for f in fields(AuditRecord) if f.name != "time")


class Recorder:
    """Builds records from verdicts and targets, counts them in the metrics, and writes them."""

    def __init__(self, audit: AuditLog, metrics: Metrics, policy: Callable[[], Policy],
                 on_failure: Callable[[], None] = lambda: None) -> None:
        self.audit = audit
        self.metrics = metrics
        self.policy = policy  # the policy in force, read per record (a reload may change log settings)
        self.on_failure = on_failure  # the gate starts its audit probe

    def record(self, event: str, flow_id: str, client: str | None, method: str | None, target: Target | None,
               verdict: Verdict, cnames: tuple[str, ...] = ()) -> AuditRecord:
        policy = self.policy()
        path = None
        if target is not None and target.path:
            path = target.path if policy.log_query_strings else target.path.split("?", 1)[0]
        return AuditRecord(
            event=event, id=flow_id, client=client, verdict=verdict_word(verdict), stage=verdict.stage,
            rule=verdict.rule, rule_id=rule_id_of(verdict), reason=verdict.reason, mode=policy.mode, role=verdict.role,
            session=verdict.session,
            method=method, scheme=target.scheme if target else None, host=target.host if target else None,
            port=target.port if target else None, path=path, addresses=list(verdict.addresses),
            # Through an upstream proxy nothing is pinned: the upstream connects where its own resolution says.
            cnames=list(cnames), pinned=None if policy.upstream else verdict.pinned)

    def url(self, text: str) -> str:
        """A request target the core could not read, for a record's ``url``: no user name or password, and
        its query string only where ``log.query_strings`` keeps queries (as ``path`` does)."""
        return safe_text(for_logs(text, keep_query=self.policy().log_query_strings))

    def decision(self, record: AuditRecord) -> bool:
        """Write a decision line and count it; False when the log could not take it (fail closed)."""
        self.metrics.decision(record.verdict, record.rule_id)
        return self.write(record)

    def ended(self, record: AuditRecord, started: float, up: int, down: int, error: str | None,
              status: int | None) -> bool:
        """A response or tunnel line: bytes each way, how long, how it ended."""
        self.metrics.relayed(up, down)
        record.bytes_up, record.bytes_down, record.error, record.status = up, down, error, status
        record.duration_ms = round((time.monotonic() - started) * 1000, 3)
        return self.write(record)

    def write(self, record: AuditRecord) -> bool:
        record.time = rfc3339(time.time())
        if not self.audit.write(record.as_dict()):
            self.on_failure()
            return False
        return True


def safe_text(text: str, limit: int = 300) -> str:
    """Text from a client, as a record or a reason quotes it: ASCII (other characters escaped), bounded."""
    text = text.encode("ascii", "backslashreplace").decode("ascii")
    return text if len(text) <= limit else text[:limit] + "..."


_QUOTED_BYTES = re.compile(r": (bytearray\(b|b)['\"].*", re.DOTALL)


def parser_words(error: Exception) -> str:
    """A parser's error for a reason, without the bytes it quotes: h11 writes "illegal request line:
    bytearray(b'GET /x?token=... HTTP/1.1')" or a whole header line, credentials included, and a reason goes to
    the audit log whatever log.query_strings says (review round 19)."""
    return safe_text(_QUOTED_BYTES.sub("", str(error)), 200)
