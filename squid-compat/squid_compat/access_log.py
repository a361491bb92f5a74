"""squid's native access-log format for egresswall's audit records (``egresswall run --log-format squid``).

    %ts.%03tu %6tr %>a %Ss/%03>Hs %<st %rm %ru %[un %Sh/%<a %mt

time (seconds.milliseconds), elapsed milliseconds (right-aligned in six columns), client address,
result code / HTTP status, bytes sent to the client, method, URL, user ("-"), hierarchy code / the
address connected to, MIME type ("-": egresswall does not record it).

Which audit record becomes which line:

| audit record                                  | squid line                                       |
|-----------------------------------------------|--------------------------------------------------|
| ``decision``, verdict ``refuse``              | ``TCP_DENIED/<status>`` (403; 429/503 for limits) |
| ``decision`` refusing inside a tunnel (SNI)   | ``TCP_DENIED/200``: the CONNECT had been answered |
| ``decision``, verdict ``allow``/``report``    | no line: the response or tunnel record follows   |
| ``response``                                  | ``TCP_MISS/<status>``                            |
| ``tunnel``                                    | ``TCP_TUNNEL/200``                               |
| ``connection`` (ended before a request)       | ``NONE_NONE/000``, URL ``error:transaction-end-before-headers`` |

Bytes (``%<st``) are the record's ``bytes_down``: the body bytes egresswall sent the client. On a
``response`` or ``tunnel`` record that is what the upstream sent through; on a refusal (``decision``,
verdict ``refuse``) it is the size of egresswall's own refusal body. A record without the field (an
older proxy's) counts 0.

A record with an ``error`` gets squid's suffix: ``_TIMEDOUT`` when the error says it timed out,
``_ABORTED`` otherwise (``TCP_MISS_ABORTED/000``). Refusals are ``HIER_NONE/-``; forwarded requests
``HIER_DIRECT/<address connected to>``.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from policy.hosts import DEFAULT_PORTS

DENIED, MISS, TUNNEL, NONE = "TCP_DENIED", "TCP_MISS", "TCP_TUNNEL", "NONE_NONE"


def select_squid_records(record: dict[str, Any]) -> bool:
    """squid logs each transaction once, at its end: refusals, responses, tunnels, empty connections."""
    event = record.get("event")
    if event == "decision":
        return record.get("verdict") == "refuse"
    return event in ("response", "tunnel", "connection")


def squid_line(record: dict[str, Any]) -> str:
    event = record.get("event")
    error = record.get("error")
    if event == "decision":
        status = record.get("status")
        code, status = DENIED, (200 if status is None else status)
    elif event == "tunnel":
        code, status = TUNNEL, record.get("status") or 200
    elif event == "connection":
        code, status = NONE, 0
    else:
        code, status = MISS, record.get("status") or 0
    if error and code != NONE:
        code += "_TIMEDOUT" if _timed_out(str(error)) else "_ABORTED"
    forwarded = code.startswith((MISS, TUNNEL)) and record.get("pinned")
    hierarchy = f"HIER_DIRECT/{record['pinned']}" if forwarded else "HIER_NONE/-"
    method = _field(record.get("method")) if event != "connection" else "-"
    return (f"{_timestamp(record.get('time'))} {_elapsed(record.get('duration_ms')):6d} {_field(record.get('client'))} "
            f"{code}/{int(status):03d} {_bytes(record)} {method} {_url(record)} - {hierarchy} -")


def _timestamp(value: Any) -> str:
    """The record's RFC 3339 UTC time as squid's seconds.milliseconds."""
    moment = datetime.fromisoformat(str(value).replace("Z", "+00:00")) if value else datetime.fromtimestamp(0, UTC)
    milliseconds = round(moment.timestamp() * 1000)
    seconds, rest = divmod(milliseconds, 1000)
    return f"{seconds}.{rest:03d}"


def _elapsed(duration_ms: Any) -> int:
    return max(0, round(float(duration_ms or 0)))


def _bytes(record: dict[str, Any]) -> int:
    """What the client got from egresswall, refusals included (module docstring)."""
    value = record.get("bytes_down")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _timed_out(error: str) -> bool:
    lowered = error.lower()
    return "timeout" in lowered or "timed out" in lowered


def _field(value: Any) -> str:
    """One space-free token: squid's fields are separated by single spaces."""
    text = str(value) if value not in (None, "") else "-"
    return "".join(f"%{ord(c):02X}" if c.isspace() or not c.isprintable() else c for c in text)


def _url(record: dict[str, Any]) -> str:
    if record.get("event") == "connection":
        return "error:transaction-end-before-headers"
    host = record.get("host")
    if not host:
        return _field(record.get("url"))
    port = record.get("port")
    shown = f"[{host}]" if ":" in host else host
    if record.get("method") == "CONNECT":
        return _field(f"{shown}:{port}")
    scheme = record.get("scheme") or "http"
    authority = shown if port in (None, DEFAULT_PORTS.get(scheme)) else f"{shown}:{port}"
    return _field(f"{scheme}://{authority}{record.get('path') or '/'}")
