"""The audit-log reader: the gate's records parsed strictly, everything else named with its place."""

from __future__ import annotations

import copy
import gzip
import json
from datetime import UTC, datetime, timedelta

import pytest
from audit_factory import SCHEMA, VALIDATOR, decided, request, write_log
from hypothesis import example, given, settings
from hypothesis import strategies as st

from policy.loader import parse_policy
from proxy.audit_reader import (
    AUDIT_KEYS,
    OLD_FORMAT,
    TRAFFIC_KEYS,
    AuditLine,
    Place,
    Record,
    Unreadable,
    parse_line,
    parse_since,
    read_log,
)

POLICY = parse_policy("version: 1\ndefault: allow\naddresses: {allow: [198.18.0.0/15]}\n", "p.yaml")


def good_record() -> dict:
    return decided(POLICY, request("http://docs.example.com/guide?q=1"), ("198.18.0.10",))


def parse(data: dict | str | bytes):
    line = data if isinstance(data, bytes) else (data if isinstance(data, str) else json.dumps(data)).encode()
    return parse_line(line + b"\n", Place("a.jsonl", 7))


def test_the_key_lists_are_the_schemas():
    traffic, audit = SCHEMA["$defs"]["traffic"], SCHEMA["$defs"]["audit"]
    assert list(TRAFFIC_KEYS) == traffic["required"] and set(TRAFFIC_KEYS) == set(traffic["properties"])
    assert list(AUDIT_KEYS) == audit["required"] and set(AUDIT_KEYS) == set(audit["properties"])


def test_a_record_reads_with_its_fields_typed():
    item = parse(good_record())
    assert isinstance(item, Record)
    assert item.time == datetime(2026, 12, 1, 7, 0, tzinfo=UTC) and item.time_text == "2026-12-01T07:00:00.000Z"
    assert (item.event, item.verdict, item.stage, item.host, item.port, item.path, item.method) == (
        "decision", "allow", "host", "docs.example.com", 80, "/guide", "GET")
    assert item.addresses == ("198.18.0.10",) and item.cnames == () and item.place == Place("a.jsonl", 7)


def test_an_audit_line_reads():
    line = {"time": "2026-12-01T07:00:01.500Z", "event": "audit", "failures": 3, "reason": "the log took lines again"}
    VALIDATOR.validate(line)
    item = parse(line)
    assert isinstance(item, AuditLine) and item.time.microsecond == 500000


def test_the_old_format_is_named():
    # What proxy/addon.py wrote before the gate: epoch time, "connect", no rule_id/pinned/cnames.
    old = {"time": 1764572400.123456, "event": "decision", "id": "a", "client": "127.0.0.1", "role": None,
           "method": "GET", "scheme": "http", "host": "docs.example.com", "port": 80, "path": "/",
           "addresses": ["198.18.0.10"], "connect": "198.18.0.10", "verdict": "allow", "stage": "host",
           "rule": "p.yaml:3", "reason": "r", "mode": "enforce", "status": None}
    item = parse(old)
    assert isinstance(item, Unreadable) and item.reason == OLD_FORMAT and str(item.place) == "a.jsonl:7"


@pytest.mark.parametrize(("line", "expected"), [
    (b'{"time": "2026-12-01T07:00:00.000Z", "event": "deci', "not JSON"),
    (b"", "an empty line"),
    (b"[1, 2]", "not a JSON object but a list"),
    (b"\xff\xfe{}", "not UTF-8"),
    (b'{"a": 1, "a": 2}', "the key 'a' appears twice"),
    (b'{"a": NaN}', "NaN is not a JSON number"),
    (b"[" * 100000 + b"]" * 100000, "nested too deeply"),
])
def test_corrupted_lines_are_named(line, expected):
    item = parse(line)
    assert isinstance(item, Unreadable) and expected in item.reason


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("port", True, "'port' is true"),
    ("port", 70000, "'port' is 70000"),
    ("time", "2026-12-01T07:00:00Z", "RFC 3339 UTC with milliseconds"),
    ("time", "2026-13-01T07:00:00.000Z", "not a real moment"),
    ("verdict", "maybe", "expected allow, refuse or report"),
    ("addresses", "198.18.0.10", "a list of strings"),
    ("host", 5, "a string or null"),
    ("id", "", "a non-empty string"),
    ("duration_ms", -1, "non-negative number"),
    ("verdict", [], "expected allow, refuse or report"),
    ("event", {"a": 1}, "expected one of"),
])
def test_wrong_types_are_named(key, value, expected):
    record = good_record()
    record[key] = value
    item = parse(record)
    assert isinstance(item, Unreadable) and expected in item.reason


def test_missing_and_unknown_keys_are_named():
    record = good_record()
    del record["cnames"]
    record["surprise"] = 1
    item = parse(record)
    assert isinstance(item, Unreadable)
    assert "missing 'cnames'" in item.reason and "unknown 'surprise'" in item.reason


JSON_VALUES = st.none() | st.booleans() | st.integers(-10, 70000) | st.floats(-1, 1e6, allow_nan=False) | st.text(
    max_size=5) | st.lists(st.text(max_size=3) | st.integers(), max_size=2) | st.sampled_from(
    ["allow", "refuse", "report", "enforce", "decision", "tunnel", "audit"])


@settings(max_examples=400, deadline=None)
@given(key=st.sampled_from([k for k in TRAFFIC_KEYS if k != "time"]), value=JSON_VALUES, drop=st.booleans())
def test_the_reader_accepts_exactly_what_the_schema_accepts(key, value, drop):
    # Held together so the reader cannot drift from the record's declared format. ('time' is checked
    # more strictly than the schema's pattern can say: a real calendar moment.)
    record = copy.deepcopy(good_record())
    if drop:
        del record[key]
    else:
        record[key] = value
    accepted = isinstance(parse(record), Record)
    assert accepted == VALIDATOR.is_valid(record)


def test_a_gzipped_log_reads_and_a_cut_one_says_where_it_stops(tmp_path):
    lines = [json.dumps(good_record()) for _ in range(50)]
    whole = tmp_path / "audit.jsonl.1.gz"
    whole.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    items = list(read_log(whole))
    assert len(items) == 50 and all(isinstance(i, Record) for i in items)
    cut = tmp_path / "cut.gz"
    cut.write_bytes(whole.read_bytes()[:-12])  # the trailer (and a little data) missing
    items = list(read_log(cut))
    assert isinstance(items[-1], Unreadable) and "gzip stream is damaged or ends early" in items[-1].reason
    assert items[-1].place.line == len(items)  # the line after the last one read


def test_line_numbers_count_every_line(tmp_path):
    log = write_log(tmp_path / "a.jsonl", [good_record(), "{broken", good_record()])
    items = list(read_log(log))
    assert [type(i) for i in items] == [Record, Unreadable, Record]
    assert str(items[1].place) == f"{log}:2"


def test_since_takes_moments_dates_and_durations():
    now = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    assert parse_since("2h", now) == now - timedelta(hours=2)
    assert parse_since("7d", now) == now - timedelta(days=7)
    assert parse_since("2026-12-01T07:00:00Z", now) == datetime(2026, 12, 1, 7, tzinfo=UTC)
    assert parse_since("2026-12-01T09:00:00.5+02:00", now) == datetime(2026, 12, 1, 7, 0, 0, 500000, tzinfo=UTC)
    assert parse_since("2026-11-30", now) == datetime(2026, 11, 30, tzinfo=UTC)


@pytest.mark.parametrize("text", ["2026-12-01T07:00:00", "yesterday", "2 h", "-2h", "2026-12-01T25:00:00Z", ""])
def test_since_refuses_what_it_cannot_read_exactly(text):
    with pytest.raises(ValueError, match="--since"):
        parse_since(text)


@given(st.floats(min_value=0, max_value=4e9, allow_nan=False) | st.integers(0, 4_000_000_000).map(
    lambda s: s + 0.9995) | st.integers(0, 4_000_000_000).map(lambda s: s + 0.9999996))
@example(1764572400.0)
@example(1764572399.9999995)  # rounds up into the next second, as datetime rounds it
def test_property_rfc3339_is_datetimes_own_text(epoch: float) -> None:
    """The kept second's text (proxy.audit.rfc3339) gives what formatting the datetime gives, at every instant,
    seconds on either side of a rounding included, and whatever second was formatted before."""
    from proxy.audit import rfc3339

    moment = datetime.fromtimestamp(epoch, UTC)
    expected = moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"
    assert rfc3339(epoch) == expected
    assert rfc3339(epoch + 1) != expected or epoch + 1 == epoch  # a new second is formatted, not the kept one
