"""Reading egresswall's audit log back, for the operator commands (``replay``, ``suggest``).

A log is JSON lines, plain or gzipped (a rotated ``audit.jsonl.1.gz``; told apart by the gzip magic,
not the file name). Each line is parsed strictly into the record the gate writes (``proxy/records.py``,
whose JSON Schema ships beside it): every key present, each of its type, none unknown. A line that is not
such a record — an old-format line, a truncated or corrupted line, a damaged gzip stream — comes back as
an ``Unreadable`` with its place (``file:line``) and why: a reader never drops a line silently.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

GZIP_MAGIC = b"\x1f\x8b"

# The record's keys, as the schema requires them (a test holds this list to the schema).
TRAFFIC_KEYS = ("time", "event", "id", "client", "verdict", "stage", "rule", "rule_id", "reason", "mode", "role",
                "session", "method", "scheme", "host", "port", "path", "url", "addresses", "cnames", "pinned",
                "status", "bytes_up", "bytes_down", "duration_ms", "error")
AUDIT_KEYS = ("time", "event", "failures", "reason")
TRAFFIC_EVENTS = frozenset({"decision", "response", "tunnel", "connection"})
VERDICTS = frozenset({"allow", "refuse", "report"})
MODES = frozenset({"enforce", "report"})

_STRINGS = ("id", "stage", "rule", "rule_id", "reason")
_NULLABLE_STRINGS = ("client", "role", "session", "method", "scheme", "host", "path", "url", "pinned", "error")
_TIME = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{3}Z")
_RFC3339 = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}(?:[Tt ][0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]+)?"
                      r"(?:[Zz]|[+-][0-9]{2}:[0-9]{2}))?")
_DURATION = re.compile(r"([0-9]{1,9})([smhdw])")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}

OLD_FORMAT = ("old format: written before the audit record carried pinned, rule_id and cnames "
              "(replay and suggest need the gate's record)")


@dataclass(frozen=True, order=True)
class Place:
    """Where a line is: the file as the operator named it and the 1-based line number."""

    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass(frozen=True)
class Unreadable:
    place: Place
    reason: str


@dataclass(frozen=True)
class AuditLine:
    """The log's own line after it could not be written for a while (``"event": "audit"``)."""

    place: Place
    time: datetime
    event: str = "audit"


@dataclass(frozen=True)
class Record:
    """One traffic line (decision, response, tunnel, connection), with the fields a decision needs typed."""

    place: Place
    time: datetime
    time_text: str
    event: str
    client: str | None
    verdict: str
    stage: str
    rule: str
    rule_id: str
    reason: str
    mode: str
    role: str | None
    session: str | None
    method: str | None
    scheme: str | None
    host: str | None
    port: int | None
    path: str | None
    url: str | None
    addresses: tuple[str, ...]
    cnames: tuple[str, ...]


LogItem = Record | AuditLine | Unreadable


class RecordError(ValueError):
    """Why one line is not a record (the reader turns it into an ``Unreadable``)."""


class Tally:
    """The items of a reader, passed on as they come, counted: records read, lines not read (and the first of
    those, to say why), so a command can tell a log it could not read at all from an empty one."""

    def __init__(self, items: Iterable[LogItem]) -> None:
        self.items = items
        self.read = self.unreadable = 0
        self.first_unreadable: Unreadable | None = None

    def __iter__(self) -> Iterator[LogItem]:
        for item in self.items:
            if isinstance(item, Unreadable):
                self.unreadable += 1
                self.first_unreadable = self.first_unreadable or item
            else:
                self.read += 1
            yield item

    def nothing_read(self) -> str | None:
        """Why no line was read, when there were lines and none was a record; else None."""
        if self.read or self.first_unreadable is None:
            return None
        first = self.first_unreadable
        return (f"no line is an egresswall audit record ({self.unreadable} line(s) not read; the first, "
                f"{first.place}: {first.reason}); egresswall reads its own JSON audit log, not a --log-format "
                "squid log")


def read_logs(paths: Iterable[str | Path]) -> Iterator[LogItem]:
    """Every line of every file, in order. Opening a file that is not there raises OSError."""
    for path in paths:
        yield from read_log(path)


def read_log(path: str | Path) -> Iterator[LogItem]:
    name = str(path)
    with open(path, "rb") as raw:
        gzipped = raw.read(2) == GZIP_MAGIC
        raw.seek(0)
        stream = gzip.GzipFile(fileobj=raw, mode="rb") if gzipped else raw
        number = 0
        try:
            for number, line in enumerate(stream, 1):  # noqa: B007 - the number is read after the loop
                yield parse_line(line, Place(name, number))
        except (EOFError, gzip.BadGzipFile, zlib.error) as err:
            # A rotated file cut short (copied while written, a disk that filled): say where it stops.
            yield Unreadable(Place(name, number + 1), f"the gzip stream is damaged or ends early ({err})")


def parse_line(line: bytes, place: Place) -> LogItem:
    try:
        return parse_record(_json_object(line), place)
    except RecordError as err:
        return Unreadable(place, str(err))


def _json_object(line: bytes) -> dict[str, Any]:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        raise RecordError("not UTF-8 text (a corrupted line)") from None
    if not text.strip():
        raise RecordError("an empty line")
    try:
        value = json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constants)
    except RecursionError:
        raise RecordError("not an audit record (JSON nested too deeply)") from None
    except json.JSONDecodeError as err:
        end = "" if text.endswith("\n") else ", and the line has no newline"
        raise RecordError(f"not JSON ({err.msg.removesuffix(' at')} at column {err.colno}{end}): a truncated or "
                          "corrupted line") from None
    except ValueError as err:  # Python's bound on an integer's digits (4,300): no record holds such a number
        raise RecordError(f"not an audit record ({err})") from None
    if not isinstance(value, dict):
        raise RecordError(f"not a JSON object but a {type(value).__name__}")
    return value


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise RecordError(f"the key {key!r} appears twice")
        out[key] = value
    return out


def _no_constants(name: str) -> Any:
    raise RecordError(f"{name} is not a JSON number")


def parse_record(data: dict[str, Any], place: Place) -> Record | AuditLine:
    if "pinned" not in data and ("connect" in data or isinstance(data.get("time"), int | float)):
        raise RecordError(OLD_FORMAT)
    if data.get("event") == "audit":
        _exact_keys(data, AUDIT_KEYS)
        if not _is_int(data["failures"]) or data["failures"] < 0 or not isinstance(data["reason"], str):
            raise RecordError("an audit line whose failures or reason is not what the schema says")
        return AuditLine(place, parse_record_time(data["time"]))
    _exact_keys(data, TRAFFIC_KEYS)
    _check_types(data)
    return Record(
        place=place, time=parse_record_time(data["time"]), time_text=data["time"], event=data["event"],
        client=data["client"], verdict=data["verdict"], stage=data["stage"], rule=data["rule"],
        rule_id=data["rule_id"], reason=data["reason"], mode=data["mode"], role=data["role"],
        session=data["session"], method=data["method"], scheme=data["scheme"], host=data["host"],
        port=None if data["port"] is None else int(data["port"]),
        path=data["path"], url=data["url"], addresses=tuple(data["addresses"]), cnames=tuple(data["cnames"]))


def _exact_keys(data: dict[str, Any], keys: tuple[str, ...]) -> None:
    missing = [key for key in keys if key not in data]
    unknown = sorted(key for key in data if key not in keys)
    if missing or unknown:
        parts = []
        if missing:
            parts.append("missing " + ", ".join(map(repr, missing)))
        if unknown:
            parts.append("unknown " + ", ".join(repr(key[:40]) for key in unknown[:5]))
        raise RecordError(f"not an audit record of this format ({'; '.join(parts)})")


def _check_types(data: dict[str, Any]) -> None:
    def bad(key: str, expected: str) -> RecordError:
        return RecordError(f"{key!r} is {_shown(data[key])}, expected {expected}")

    def one_of(key: str, words: frozenset[str]) -> bool:
        return isinstance(data[key], str) and data[key] in words  # a list or object is no word (nor hashable)

    if not one_of("event", TRAFFIC_EVENTS):
        raise bad("event", "one of " + ", ".join(sorted(TRAFFIC_EVENTS | {"audit"})))
    if not one_of("verdict", VERDICTS):
        raise bad("verdict", "allow, refuse or report")
    if not one_of("mode", MODES):
        raise bad("mode", "enforce or report")
    for key in _STRINGS:
        if not isinstance(data[key], str):
            raise bad(key, "a string")
    if not data["id"]:
        raise bad("id", "a non-empty string")
    for key in _NULLABLE_STRINGS:
        if data[key] is not None and not isinstance(data[key], str):
            raise bad(key, "a string or null")
    port = data["port"]
    if port is not None and not (_is_int(port) and 0 <= port <= 65535):
        raise bad("port", "an integer 0-65535 or null")
    for key in ("addresses", "cnames"):
        if not isinstance(data[key], list) or not all(isinstance(item, str) for item in data[key]):
            raise bad(key, "a list of strings")
    if data["status"] is not None and not _is_int(data["status"]):
        raise bad("status", "an integer or null")
    for key in ("bytes_up", "bytes_down"):
        if data[key] is not None and not (_is_int(data[key]) and data[key] >= 0):
            raise bad(key, "a non-negative integer or null")
    duration = data["duration_ms"]
    if duration is not None and not (isinstance(duration, int | float) and not isinstance(duration, bool)
                                     and duration >= 0):
        raise bad("duration_ms", "a non-negative number or null")


def _is_int(value: Any) -> bool:
    """JSON Schema's integer: 443 and 443.0 are the same JSON number (a boolean is none)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:60] + "..."


def parse_record_time(value: Any) -> datetime:
    """The record's ``time``: RFC 3339 in UTC with milliseconds and a Z, as the gate writes it."""
    if not isinstance(value, str) or not _TIME.fullmatch(value):
        raise RecordError(f"'time' is {_shown(value)}, expected RFC 3339 UTC with milliseconds "
                          "(2026-12-01T07:12:03.042Z)")
    try:
        return datetime.fromisoformat(value)
    except ValueError as err:
        raise RecordError(f"'time' is {_shown(value)}, which is not a real moment ({err})") from None


def parse_since(text: str, now: datetime | None = None, option: str = "--since", moment_only: bool = False
                ) -> datetime:
    """``--since``: an RFC 3339 moment with its zone (``2026-12-01T07:00:00Z``, or a date for its
    midnight UTC) or a duration back from now (``90s``, ``30m``, ``2h``, ``7d``, ``2w``). ``moment_only``
    (``replay --at``): a moment or ``now``, no duration (whether one would count forward or back is not
    obvious there)."""
    now = now or datetime.now(UTC)
    if moment_only and text == "now":
        return now
    duration = None if moment_only else _DURATION.fullmatch(text)
    if duration:
        try:
            return now - timedelta(**{_UNITS[duration.group(2)]: int(duration.group(1))})
        except OverflowError:
            raise ValueError(f"{option} {text!r}: reaches back before the year 1") from None
    if not _RFC3339.fullmatch(text):
        others = "or now" if moment_only else "or a duration (90s, 30m, 2h, 7d, 2w)"
        raise ValueError(f"{option} {text!r}: expected an RFC 3339 time with its zone (2026-12-01T07:00:00Z), "
                         f"a date (2026-12-01), {others}")
    try:
        moment = datetime.fromisoformat(text.upper().replace(" ", "T").replace("Z", "+00:00"))
    except ValueError as err:
        raise ValueError(f"{option} {text!r}: {err}") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)  # only a bare date has no zone


def shown(text: str, limit: int = 200) -> str:
    """Text from the log (a path, a rule id, a reason) as a command shows it: one printable line (a control or
    format character, such as a right-to-left override, escaped), at most ``limit`` characters and "..."."""
    out = "".join(ch if ch.isprintable() else f"\\x{ord(ch):02x}" if ord(ch) < 256 else f"\\u{ord(ch):04x}"
                  for ch in text[:limit])
    return out + ("..." if len(text) > limit else "")
