"""squid's native access-log format: our lines, real squid's lines and the real proxy's lines all
parse with one parser written from squid's documented format:

    logformat squid %ts.%03tu %6tr %>a %Ss/%03>Hs %<st %rm %ru %[un %Sh/%<a %mt
"""

from __future__ import annotations

import re
import ssl
import time

import pytest
from proxyproc import parse_response
from squid_compat.access_log import select_squid_records, squid_line

# One regular expression per field, in order, separated by single spaces (squid's %6tr pads to six).
FIELDS = [
    ("time", r"(?P<seconds>\d+)\.(?P<millis>\d{3})"),  # %ts.%03tu
    ("elapsed", r"(?P<elapsed> *\d+)"),  # %6tr: milliseconds, right-aligned in at least six columns
    ("client", r"(?P<client>[0-9A-Fa-f:.]+)"),  # %>a
    ("result", r"(?P<code>(?:TCP|UDP|NONE)(?:_[A-Z]+)*)/(?P<status>\d{3})"),  # %Ss/%03>Hs
    ("bytes", r"(?P<bytes>\d+)"),  # %<st
    ("method", r"(?P<method>[A-Z]+|-)"),  # %rm
    ("url", r"(?P<url>\S+)"),  # %ru
    ("user", r"(?P<user>\S+)"),  # %[un
    ("hierarchy", r"(?P<hierarchy>[A-Z_]+)/(?P<peer>\S+)"),  # %Sh/%<a
    ("mime", r"(?P<mime>\S+)"),  # %mt
]
LINE = re.compile("^" + " ".join(pattern for _, pattern in FIELDS) + "$")
RESULT_CODES = {"TCP_DENIED", "TCP_MISS", "TCP_TUNNEL", "TCP_HIT", "NONE_NONE", "NONE"}
SUFFIXES = {"ABORTED", "TIMEDOUT", "IGNORED"}


def parse(line: str) -> dict[str, str]:
    match = LINE.match(line)
    assert match, f"not a squid native log line: {line!r}"
    fields = match.groupdict()
    assert len(fields["elapsed"]) >= 6, f"%6tr is six columns wide: {line!r}"
    code = fields["code"]
    base = next((c for c in sorted(RESULT_CODES, key=len, reverse=True) if code.startswith(c)), None)
    assert base is not None, code
    assert all(part in SUFFIXES for part in code[len(base):].split("_") if part), code
    return fields


# Lines real squid 5.7 (Debian) wrote on this project's loopback lab.
REAL_SQUID = [
    "1795980076.868      6 127.0.0.1 TCP_MISS_ABORTED/200 239 GET http://pub.lab.test:8081/ - "
    "HIER_DIRECT/127.0.0.2 text/plain",
    "1795980076.874      0 127.0.0.1 TCP_DENIED/403 3417 GET http://trail.lab.test:8081/ - HIER_NONE/- text/html",
    "1795980076.877      0 127.0.0.1 TCP_TUNNEL/200 39 CONNECT pub.lab.test:8081 - HIER_DIRECT/127.0.0.2 -",
    "1795980356.840      0 127.0.0.1 TCP_MISS/503 3412 GET http://[::1]:8081/ - HIER_DIRECT/::1 text/html",
]


@pytest.mark.parametrize("line", REAL_SQUID)
def test_the_parser_reads_real_squid_lines(line: str) -> None:
    parse(line)


BASE = {"time": "2026-11-29T19:21:16.868Z", "id": "f1",
        "client": "10.1.2.3", "role": None, "method": "GET", "scheme": "http",
        "host": "example.com", "port": 80, "path": "/index.html", "addresses": ["93.184.216.34"],
        "pinned": None, "verdict": "refuse", "stage": "host", "rule": "p.yaml:3", "reason": "no", "mode": "enforce",
        "status": 403}


def record(**changes) -> dict:
    return {**BASE, **changes}


def test_refusal() -> None:
    line = squid_line(record(event="decision", bytes_down=93))
    assert line == ("1795980076.868      0 10.1.2.3 TCP_DENIED/403 93 GET http://example.com/index.html - "
                    "HIER_NONE/- -")
    parse(line)


@pytest.mark.parametrize("value", [None, "93", 9.5, -1, True])
def test_a_refusal_without_a_byte_count_counts_0(value) -> None:
    fields = parse(squid_line(record(event="decision", bytes_down=value)))
    assert fields["bytes"] == "0"


@pytest.mark.parametrize("status", [429, 503])
def test_refusal_for_limits_keeps_its_status(status: int) -> None:
    fields = parse(squid_line(record(event="decision", status=status, host=None, url="http://x.example/")))
    assert (fields["code"], fields["status"], fields["url"]) == ("TCP_DENIED", str(status), "http://x.example/")


def test_refusal_inside_a_tunnel_after_connect_was_answered() -> None:
    fields = parse(squid_line(record(event="decision", method="CONNECT", scheme="https", port=443, status=None,
                                     stage="tls", path=None)))
    assert (fields["code"], fields["status"], fields["url"]) == ("TCP_DENIED", "200", "example.com:443")


def test_response() -> None:
    line = squid_line(record(event="response", verdict="allow", status=200, pinned="93.184.216.34",
                             bytes_down=5120, duration_ms=234.5, port=8080, scheme="http", error=None))
    fields = parse(line)
    assert (fields["code"], fields["status"], fields["bytes"]) == ("TCP_MISS", "200", "5120")
    assert fields["elapsed"].strip() == "234" or fields["elapsed"].strip() == "235"
    assert fields["url"] == "http://example.com:8080/index.html"
    assert (fields["hierarchy"], fields["peer"]) == ("HIER_DIRECT", "93.184.216.34")
    assert (fields["user"], fields["mime"]) == ("-", "-")


@pytest.mark.parametrize("error, code", [("Client disconnected.", "TCP_MISS_ABORTED"),
                                         ("Connection killed.", "TCP_MISS_ABORTED"),
                                         ("TCP connection timed out", "TCP_MISS_TIMEDOUT"),
                                         ("read timeout", "TCP_MISS_TIMEDOUT")])
def test_response_errors(error: str, code: str) -> None:
    fields = parse(squid_line(record(event="response", verdict="allow", status=None, error=error,
                                     pinned="93.184.216.34")))
    assert (fields["code"], fields["status"]) == (code, "000")


def test_tunnel() -> None:
    line = squid_line(record(event="tunnel", verdict="allow", method="CONNECT", scheme="https", port=443, path=None,
                             status=200, pinned="93.184.216.34", bytes_up=700, bytes_down=4096, duration_ms=12500,
                             error=None))
    assert line == ("1795980076.868  12500 10.1.2.3 TCP_TUNNEL/200 4096 CONNECT example.com:443 - "
                    "HIER_DIRECT/93.184.216.34 -")
    parse(line)
    aborted = parse(squid_line(record(event="tunnel", method="CONNECT", status=200, error="connection reset",
                                      pinned="93.184.216.34")))
    assert aborted["code"] == "TCP_TUNNEL_ABORTED"


def test_connection_that_ended_before_a_request() -> None:
    line = squid_line({"time": "2026-11-29T19:21:16.500Z", "event": "connection", "client": "10.1.2.3",
                       "duration_ms": 1500,
                       "error": "client closed before sending a request"})
    assert line == ("1795980076.500   1500 10.1.2.3 NONE_NONE/000 0 - error:transaction-end-before-headers - "
                    "HIER_NONE/- -")
    parse(line)


def test_ipv6_hosts_default_ports_and_odd_urls() -> None:
    v6 = parse(squid_line(record(event="decision", host="2001:db8::1", port=80)))
    assert v6["url"] == "http://[2001:db8::1]/index.html"
    tls = parse(squid_line(record(event="decision", scheme="https", port=443, path="/")))
    assert tls["url"] == "https://example.com/"
    connect = parse(squid_line(record(event="decision", method="CONNECT", host="2001:db8::1", port=443, path=None)))
    assert connect["url"] == "[2001:db8::1]:443"
    odd = parse(squid_line(record(event="decision", host=None, url="http://exa mple.com/\tx")))
    assert odd["url"] == "http://exa%20mple.com/%09x"


def test_timestamp_rounding_carries_into_seconds() -> None:
    assert squid_line(record(event="decision", time="2026-11-29T19:21:16.9996Z")).startswith("1795980077.000 ")


def test_which_records_become_lines() -> None:
    assert select_squid_records(record(event="decision", verdict="refuse"))
    assert not select_squid_records(record(event="decision", verdict="allow"))
    assert not select_squid_records(record(event="decision", verdict="report"))
    assert select_squid_records(record(event="response"))
    assert select_squid_records(record(event="tunnel"))
    assert select_squid_records({"event": "connection"})
    assert not select_squid_records({"event": "reload"})


@pytest.mark.integration
def test_the_real_proxy_writes_squid_lines(lab, start_proxy) -> None:
    proxy = start_proxy(lab.policy_text("hosts:\n  deny:\n    - denied.lab.example\n"), "--log-format", "squid")
    port, tls_port = lab.public.port, lab.public_tls.port
    assert proxy.get(f"http://public.lab.example:{port}/hello")[0] == 200
    assert proxy.get(f"http://denied.lab.example:{port}/x")[0] == 403
    sock, status, _ = proxy.connect(f"denied.lab.example:{tls_port}")
    sock.close()
    assert status == 403
    sock, status, _ = proxy.connect(f"public.lab.example:{tls_port}")
    assert status == 200
    context = ssl.create_default_context(cafile=str(lab.cert_file))
    with context.wrap_socket(sock, server_hostname="public.lab.example") as tls:
        tls.sendall(b"GET /t HTTP/1.1\r\nHost: public.lab.example\r\nConnection: close\r\n\r\n")
        while tls.recv(65536):
            pass
    lines: list[str] = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [line for line in proxy.log_path.read_text().splitlines() if line.strip()]
        if len(lines) >= 4:
            break
        time.sleep(0.1)
    parsed = [parse(line) for line in lines]
    summary = sorted((f["code"], f["status"], f["method"], f["url"]) for f in parsed)
    assert summary == sorted([
        ("TCP_MISS", "200", "GET", f"http://public.lab.example:{port}/hello"),
        ("TCP_DENIED", "403", "GET", f"http://denied.lab.example:{port}/x"),
        ("TCP_DENIED", "403", "CONNECT", f"denied.lab.example:{tls_port}"),
        ("TCP_TUNNEL", "200", "CONNECT", f"public.lab.example:{tls_port}"),
    ]), lines
    tunnel = next(f for f in parsed if f["code"] == "TCP_TUNNEL")
    assert (tunnel["hierarchy"], tunnel["peer"]) == ("HIER_DIRECT", "127.0.0.2") and int(tunnel["bytes"]) > 0
    assert all(f["client"] == "127.0.0.1" for f in parsed)


@pytest.mark.integration
def test_the_squid_line_of_a_refusal_counts_the_bytes_sent(lab, start_proxy) -> None:
    """squid's %<st is the whole reply sent to the client, head and body."""
    proxy = start_proxy(lab.policy_text("hosts:\n  deny:\n    - denied.lab.example\n"), "--log-format", "squid")
    url = f"http://denied.lab.example:{lab.public.port}/x"
    answer = proxy.raw(f"GET {url} HTTP/1.1\r\nHost: denied.lab.example:{lab.public.port}\r\n\r\n".encode())
    status, _, body = parse_response(answer)
    assert status == 403 and body
    deadline = time.monotonic() + 10
    lines: list[str] = []
    while not lines and time.monotonic() < deadline:
        lines = [line for line in proxy.log_path.read_text().splitlines() if line.strip()]
        time.sleep(0.1)
    fields = parse(lines[0])
    assert fields["code"] == "TCP_DENIED" and int(fields["bytes"]) == len(answer), lines
