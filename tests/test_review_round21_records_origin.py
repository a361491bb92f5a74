"""Review round 21, "records": a hostile ORIGIN chooses the bytes of its status line, reason phrase and headers.
Every record stays the declared one (the shipped JSON Schema), every squid line keeps its ten fields, and the
client's answer carries no egresswall header the origin wrote."""

from __future__ import annotations

import json
import re
import socket
import time

import jsonschema
import pytest
from hostile import _Server
from proxyproc import TRANSPORTS, ProxyProcess, read_response

from proxy.records import SCHEMA_PATH

pytestmark = pytest.mark.integration

VALIDATOR = jsonschema.Draft202012Validator(json.loads(SCHEMA_PATH.read_text()))

ANSWERS = {
    "/esc-phrase": b"HTTP/1.1 200 OK\x1b[31m\nX-Egresswall-Reason: forged\r\nContent-Length: 2\r\n\r\nok",
    "/ctl-header": b"HTTP/1.1 200 OK\r\nX-Evil: a\x1b[2J\x00b\r\nContent-Length: 2\r\n\r\nok",
    "/status-0": b"HTTP/1.1 000 Zero\r\nContent-Length: 2\r\n\r\nok",
    "/status-999": b"HTTP/1.1 999 Nine\r\nContent-Length: 2\r\n\r\nok",
    "/status-huge": b"HTTP/1.1 99999 Big\r\nContent-Length: 2\r\n\r\nok",
    "/status-neg": b"HTTP/1.1 -12 Neg\r\nContent-Length: 2\r\n\r\nok",
    "/ff-phrase": b"HTTP/1.1 200 \xff\xfe\xed\xa0\x80\r\nContent-Length: 2\r\n\r\nok",
    "/garbage": b"\x1b[31mHELLO \xff\r\n\r\n",
    "/huge-phrase": b"HTTP/1.1 200 " + b"x" * 60000 + b"\r\nContent-Length: 2\r\n\r\nok",
    "/bare-lf": b"HTTP/1.1 200 OK\nX-Egresswall-Rule: forged\nContent-Length: 2\n\nok",
}


class HostileOrigin(_Server):
    def handle(self, conn: socket.socket, head: bytes) -> None:
        path = head.split(b" ", 2)[1].decode("latin-1")
        path = "/" + path.split("/", 3)[-1] if path.startswith("http") else path
        conn.sendall(ANSWERS.get(path, b"HTTP/1.1 404 Nope\r\nContent-Length: 0\r\n\r\n"))
        time.sleep(0.2)


@pytest.fixture(scope="module")
def origin():
    server = HostileOrigin()
    yield server
    server.close()


@pytest.fixture(scope="module", params=[(t, f) for t in TRANSPORTS for f in ("json", "squid")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def proxy(lab, origin, tmp_path_factory, request):
    transport, log_format = request.param
    folder = tmp_path_factory.mktemp("r21origin")
    text = lab.policy_text("hosts:\n  allow:\n    - public.lab.example\n", default="deny")
    text = text.replace(f"http: [80, {lab.public.port}]", f"http: [80, {lab.public.port}, {origin.port}]")
    assert str(origin.port) in text
    policy = folder / "policy.yaml"
    policy.write_text(text)
    process = ProxyProcess(["--policy", str(policy), "--log-format", log_format, *TRANSPORTS[transport]],
                           folder / "audit.log")
    process.log_format = log_format
    yield process
    process.stop()
    assert "Traceback" not in process.stderr, process.stderr[-3000:]


def _lines(proxy) -> list[str]:
    return [line for line in proxy.log_path.read_text(encoding="utf-8").split("\n")[:-1] if line]


def test_a_hostile_origin_cannot_break_records_or_answers_holds(lab, origin, proxy):
    problems = []
    for path in ANSWERS:
        before = len(_lines(proxy))
        with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
            sock.sendall(f"GET http://public.lab.example:{origin.port}{path} HTTP/1.1\r\n"
                         f"Host: public.lab.example:{origin.port}\r\nConnection: close\r\n\r\n".encode())
            raw = read_response(sock)
        head = raw.partition(b"\r\n\r\n")[0]
        if re.search(rb"(?im)^x-egresswall-(reason|rule): forged", head):
            problems.append(f"{path}: the origin's X-Egresswall header reached the client: {head!r}")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(_lines(proxy)) < before + 1:
            time.sleep(0.05)
        time.sleep(0.4)
        for line in _lines(proxy)[before:]:
            if proxy.log_format == "json":
                record = json.loads(line)
                errors = [e.message for e in VALIDATOR.iter_errors(record)]
                if errors:
                    problems.append(f"{path}: record violates the schema: {errors} {record}")
                if record.get("status") is not None and not 0 <= record["status"] <= 999:
                    problems.append(f"{path}: status {record['status']} is no HTTP status: {record}")
            else:
                fields = line.split()
                if len(fields) != 10 or not all(re.fullmatch(r"[\x21-\x7e]+", f) for f in fields):
                    problems.append(f"{path}: squid line lost its shape: {line!r}")
                elif not re.fullmatch(r"[A-Z_]+/\d{3}", fields[3]):
                    problems.append(f"{path}: squid result field is not CODE/NNN: {line!r}")
    assert not problems, "\n".join(problems)
