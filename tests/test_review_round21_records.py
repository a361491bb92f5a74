"""Review round 21, "records": what egresswall writes and shows when a hostile client chooses the bytes.

A battery of hostile requests (control bytes, ANSI escapes, invalid UTF-8, CR/LF tricks, huge values, two Host
headers, a Host that differs from the absolute URI, odd CONNECT authorities) is sent through the real proxy on
both transports. For every one:

- every audit line is one JSON object that validates against the shipped schema
  (``proxy/audit-record.schema.json``), and whose strings encode as strict UTF-8 (no lone surrogates);
- a refusal has exactly one refusing ``decision`` record (README: "every refusal has exactly one");
- the answer's head is ASCII printable only (no header injection through ``X-Egresswall-*``), the text body has
  exactly its four lines (``egresswall refused...``, ``rule:``, ``reason:``, ``hint:``), the JSON body parses;
- with ``--log-format squid`` each line has exactly squid's ten fields and no control byte;
- ``egresswall_decisions_total`` does not gain a series per host a client names.
"""

from __future__ import annotations

import json
import re
import socket
import time

import jsonschema
import pytest
from metrics_page import families
from proxyproc import TRANSPORTS, ProxyProcess, read_response

from proxy.records import SCHEMA_PATH

pytestmark = pytest.mark.integration

SCHEMA = json.loads(SCHEMA_PATH.read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
ESC = b"\x1b[31m"


def hostile_requests(port: int, tls_port: int) -> list[tuple[str, bytes]]:
    """(name, raw request) pairs; each is refused, or at most allowed to the lab's public host."""
    h = f"public.lab.example:{port}".encode()
    return [
        ("esc-in-host", b"GET http://den" + ESC + b"ied.lab.example/ HTTP/1.1\r\nHost: den" + ESC
         + b"ied.lab.example\r\n\r\n"),
        ("encoded-crlf-path", f"GET http://nope.lab.example:{port}/a%0d%0aX-Injected:%201 HTTP/1.1\r\n"
         f"Host: nope.lab.example:{port}\r\n\r\n".encode()),
        ("raw-ff-path", f"GET http://nope.lab.example:{port}/".encode() + b"\xff\xfe\x1b HTTP/1.1\r\nHost: "
         + f"nope.lab.example:{port}".encode() + b"\r\n\r\n"),
        ("host-del-mismatch", b"GET http://" + h + b"/ HTTP/1.1\r\nHost: other\x7f.lab.example\r\n\r\n"),
        ("host-esc-mismatch", b"GET http://" + h + b"/ HTTP/1.1\r\nHost: x" + ESC + b"\xff\xc3\x28.example\r\n\r\n"),
        ("host-u2028", b"GET / HTTP/1.1\r\nHost: a\xe2\x80\xa8b.example\r\n\r\n"),
        ("two-hosts", b"GET / HTTP/1.1\r\nHost: " + h + b"\r\nHost: denied.lab.example\r\n\r\n"),
        ("host-differs", b"GET http://" + h + b"/ HTTP/1.1\r\nHost: denied.lab.example\r\n\r\n"),
        ("bare-lf-host", b"GET / HTTP/1.1\r\nHost: nope.lab.example\nX-Egresswall-Reason: forged\r\n\r\n"),
        ("connect-esc", b"CONNECT den" + ESC + b"ied:443 HTTP/1.1\r\nHost: den" + ESC + b"ied:443\r\n\r\n"),
        ("connect-ff", b"CONNECT \xff\xfe.example:443 HTTP/1.1\r\n\r\n"),
        ("connect-host-differs", f"CONNECT public.lab.example:{tls_port} HTTP/1.1\r\n".encode()
         + b"Host: denied.lab.example:443\r\n\r\n"),
        ("connect-huge", b"CONNECT " + b"a" * 3000 + b".example:443 HTTP/1.1\r\n\r\n"),
        ("method-esc", b"G" + ESC + b"T http://nope.lab.example/ HTTP/1.1\r\nHost: nope.lab.example\r\n\r\n"),
        ("huge-host", b"GET http://" + b"b" * 5000 + b".example/ HTTP/1.1\r\nHost: " + b"b" * 5000
         + b".example\r\n\r\n"),
        ("userinfo-esc", b"GET http://u" + ESC + b":p\xff@nope.lab.example/ HTTP/1.1\r\n"
         b"Host: nope.lab.example\r\n\r\n"),
        ("scheme-esc", b"GET f" + ESC + b"tp://nope.lab.example/ HTTP/1.1\r\nHost: nope.lab.example\r\n\r\n"),
        ("ws-upgrade-odd", f"GET http://public.lab.example:{port}/ HTTP/1.1\r\nHost: public.lab.example:{port}\r\n"
         .encode() + b"Connection: Upgrade\r\nUpgrade: h2c\xff\x1b[0m, websocket\xc3\x28\r\n\r\n"),
        ("ws-upgrade-post", f"POST http://public.lab.example:{port}/ HTTP/1.1\r\nHost: public.lab.example:{port}\r\n"
         .encode() + b"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
         b"Sec-WebSocket-Version: 13\r\nContent-Length: 0\r\n\r\n"),
        ("ipv6-zone", b"GET http://[fe80::1%25" + ESC + b"eth0]/ HTTP/1.1\r\nHost: [fe80::1%25" + ESC
         + b"eth0]\r\n\r\n"),
        ("absolute-asterisk", b"OPTIONS * HTTP/1.1\r\nHost: nope\x1b.example\r\n\r\n"),
    ]


def _policy(lab) -> str:
    return lab.policy_text("hosts:\n  deny:\n    - denied.lab.example\n  allow:\n    - public.lab.example\n",
                           default="deny")


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def proxy(lab, tmp_path_factory, request):
    folder = tmp_path_factory.mktemp("r21records")
    policy = folder / "policy.yaml"
    policy.write_text(_policy(lab))
    process = ProxyProcess(["--policy", str(policy), *TRANSPORTS[request.param]], folder / "audit.jsonl")
    process.transport = request.param
    yield process
    process.stop()
    assert "Traceback" not in process.stderr, process.stderr[-3000:]


def send(proxy, data: bytes, accept_json: bool = False, timeout: float = 5) -> bytes:
    if accept_json:
        head, sep, rest = data.partition(b"\r\n")
        data = head + sep + b"Accept: application/json\r\n" + rest
    with socket.create_connection((proxy.host, proxy.port), timeout=timeout) as sock:
        sock.sendall(data)
        return read_response(sock)


def lines(proxy) -> list[str]:
    return [line for line in proxy.log_path.read_text(encoding="utf-8", errors="strict").split("\n")[:-1] if line]


def settle(proxy, count: int, timeout: float = 5) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = lines(proxy)
        if len(got) >= count:
            break
        time.sleep(0.05)
    time.sleep(0.3)
    return [json.loads(line) for line in lines(proxy)]


def strict_utf8(value) -> None:
    if isinstance(value, str):
        value.encode("utf-8")  # raises on a lone surrogate
    elif isinstance(value, list):
        for item in value:
            strict_utf8(item)
    elif isinstance(value, dict):
        for item in value.values():
            strict_utf8(item)


PRINTABLE_HEAD = re.compile(rb"^[\x20-\x7e\r\n]*$")


def check_answer(name: str, raw: bytes) -> list[str]:
    problems = []
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not raw.startswith(b"HTTP/1.1 "):
        return [f"{name}: no HTTP answer: {raw[:200]!r}"]
    if not PRINTABLE_HEAD.match(head):
        problems.append(f"{name}: head has a byte outside printable ASCII: {head!r}")
    head_lines = head.split(b"\r\n")
    if any(b"\n" in line or b"\r" in line for line in head_lines):
        problems.append(f"{name}: bare CR/LF in the head: {head!r}")
    names = [line.split(b":", 1)[0].lower() for line in head_lines[1:]]
    if names.count(b"x-egresswall-reason") > 1 or b"x-injected" in names:
        problems.append(f"{name}: injected header: {head!r}")
    status = int(head_lines[0].split()[1])
    if status < 400:
        return problems
    if b"x-egresswall-rule-id" not in names:
        return problems  # not egresswall's own refusal (relayed from the origin)
    if b"content-type: application/json" in head.lower():
        try:
            answer = json.loads(body)
            assert isinstance(answer, dict) and set(answer) >= {"error", "rule", "reason", "hint"}
            assert body.isascii()
        except (ValueError, AssertionError):
            problems.append(f"{name}: JSON body does not parse or is not ASCII: {body!r}")
    else:
        text = body.decode("utf-8", "replace").split("\n")
        if text[-1] == "":
            text = text[:-1]
        prefixes = ["egresswall refused this request.", "rule: ", "reason: ", "hint: "]
        if len(text) != 4 or not all(line.startswith(p) for line, p in zip(text, prefixes, strict=True)):
            problems.append(f"{name}: text body is not its four lines: {body!r}")
        if any(ord(c) < 0x20 or ord(c) == 0x7f or 0x80 <= ord(c) < 0xa0 for c in "".join(text)):
            problems.append(f"{name}: text body carries a control character: {body!r}")
    return problems


@pytest.mark.parametrize("want_json", [False, True], ids=["text", "json"])
def test_hostile_requests_give_schema_valid_records_and_clean_answers_holds(lab, proxy, want_json):
    """Every record a hostile request produces is the declared one (README: "The record is declared once
    (proxy/records.py) with a JSON Schema shipped beside it"), every refusal has exactly one refusing decision
    ("every refusal has exactly one"), and the refusal's head and body carry none of the client's control bytes
    and no line the client wrote."""
    problems: list[str] = []
    for name, data in hostile_requests(lab.public.port, lab.public_tls.port):
        before = len(lines(proxy))
        raw = send(proxy, data, accept_json=want_json)
        problems += check_answer(name, raw)
        records = settle(proxy, before + 1)[before:]
        for record in records:
            errors = [e.message for e in VALIDATOR.iter_errors(record)]
            if errors:
                problems.append(f"{name}: record violates the schema: {errors} {record}")
            try:
                strict_utf8(record)
            except UnicodeEncodeError:
                problems.append(f"{name}: record carries a lone surrogate: {record}")
        status = int(raw.split()[1]) if raw.startswith(b"HTTP/1.1 ") else None
        refusing = [r for r in records if r["event"] == "decision" and r["verdict"] == "refuse"]
        if status is not None and status >= 400 and b"x-egresswall-rule-id" in raw.lower():
            if len(refusing) != 1:
                problems.append(f"{name}: {len(refusing)} refusing decisions for one refusal: {records}")
            elif refusing[0]["status"] != status:
                problems.append(f"{name}: record says {refusing[0]['status']}, client got {status}")
    assert not problems, "\n".join(problems)


def test_two_host_headers_record_no_allowed_host_holds(lab, proxy):
    """Two Host headers naming an allowed and a denied host: the request is not forwarded as the allowed one
    (RFC 9112 3.2: a request with more than one Host is answered 400), and no record says it was allowed."""
    port = lab.public.port
    before = len(lines(proxy))
    raw = send(proxy, f"GET /hello HTTP/1.1\r\nHost: public.lab.example:{port}\r\nHost: denied.lab.example\r\n"
                      "Connection: close\r\n\r\n".encode())
    records = settle(proxy, before + 1)[before:]
    assert raw.startswith(b"HTTP/1.1 400"), raw
    assert [r["verdict"] for r in records if r["event"] == "decision"] == ["refuse"], records


def test_a_host_differing_from_the_absolute_uri_is_refused_and_recorded_as_such_holds(lab, proxy):
    port = lab.public.port
    before = len(lines(proxy))
    raw = send(proxy, f"GET http://public.lab.example:{port}/hello HTTP/1.1\r\nHost: denied.lab.example\r\n"
                      "Connection: close\r\n\r\n".encode())
    records = settle(proxy, before + 1)[before:]
    assert raw.startswith(b"HTTP/1.1 4"), raw
    (decision,) = [r for r in records if r["event"] == "decision"]
    assert decision["verdict"] == "refuse" and decision["rule"] == "form:host-header", decision
    assert not [r for r in records if r["event"] == "response"], records


def test_decision_series_do_not_grow_with_hosts_a_client_names_holds(lab, proxy):
    """README *Metrics*: "Every label has a bounded set of values ... never by the host a client asked for"."""
    def series() -> set[tuple]:
        _, body = proxy.admin("/metrics")
        return {tuple(sorted(s.labels.items())) for s in families(body)["egresswall_decisions"][1]
                if s.name == "egresswall_decisions_total"}

    for i in range(3):
        send(proxy, f"GET http://warm{i}.lab.example/ HTTP/1.1\r\nHost: warm{i}.lab.example\r\n\r\n".encode())
        send(proxy, f"GET http://10.0.0.{i}/ HTTP/1.1\r\nHost: 10.0.0.{i}\r\n\r\n".encode())
        send(proxy, f"CONNECT [::ffff:10.0.0.{i}]:443 HTTP/1.1\r\n\r\n".encode())
    first = series()
    for i in range(40):
        send(proxy, f"GET http://h{i}.lab.example/p{i} HTTP/1.1\r\nHost: h{i}.lab.example\r\n\r\n".encode())
        send(proxy, f"GET http://10.0.{i}.{i}/ HTTP/1.1\r\nHost: 10.0.{i}.{i}\r\n\r\n".encode())
        send(proxy, f"CONNECT [::ffff:10.0.{i}.{i}]:443 HTTP/1.1\r\n\r\n".encode())
        send(proxy, f"CONNECT h{i}\x1b.example:443 HTTP/1.1\r\n\r\n".encode())
        send(proxy, f"GET http://[64:ff9b::10.0.{i}.1]/ HTTP/1.1\r\nHost: [64:ff9b::10.0.{i}.1]\r\n\r\n".encode())
    grown = series() - first
    assert not grown, grown


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def squid_proxy(lab, tmp_path_factory, request):
    folder = tmp_path_factory.mktemp("r21squid")
    policy = folder / "policy.yaml"
    policy.write_text(_policy(lab))
    process = ProxyProcess(["--policy", str(policy), "--log-format", "squid", *TRANSPORTS[request.param]],
                           folder / "access.log")
    yield process
    process.stop()
    assert "Traceback" not in process.stderr, process.stderr[-3000:]


SQUID_FIELD = re.compile(r"^[\x21-\x7e]+$")


def test_squid_lines_keep_their_ten_fields_holds(lab, squid_proxy):
    """README: `--log-format squid` writes squid's native access-log format: every line has the ten fields of
    ``%ts.%03tu %6tr %>a %Ss/%03>Hs %<st %rm %ru %[un %Sh/%<a %mt`` (the elapsed one right-aligned), whatever the
    client sent, and one line per refusal."""
    problems = []
    for name, data in hostile_requests(lab.public.port, lab.public_tls.port):
        before = len(lines(squid_proxy))
        raw = send(squid_proxy, data)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(lines(squid_proxy)) <= before:
            time.sleep(0.05)
        time.sleep(0.3)
        new = lines(squid_proxy)[before:]
        refused = raw.startswith(b"HTTP/1.1 4") and b"x-egresswall-rule-id" in raw.lower()
        denied = [line for line in new if " TCP_DENIED/" in line]
        if refused and len(denied) != 1:
            problems.append(f"{name}: {len(denied)} TCP_DENIED lines for one refusal: {new}")
        for line in new:
            fields = line.lstrip(" ").split()
            rebuilt = " ".join(fields)
            if len(fields) != 10 or not all(SQUID_FIELD.match(f) for f in fields) or \
                    re.sub(r"^(\S+) +", r"\1 ", line) != rebuilt:
                problems.append(f"{name}: squid line does not have ten clean fields: {line!r}")
    assert not problems, "\n".join(problems)
