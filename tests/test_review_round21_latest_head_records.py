"""Review round 21 (second pass): a whole head mitmproxy turns down gets exactly one record, whose status and
bytes_down are what the client got (54d5a7e: ``_core_answers``, ``_refuse_whole_head``; ``_server_read_headers``
must not record it again), on both transports, also after a good request on the same connection, pipelined behind
one, and inside tunnels; odd heads do not crash the proxy.

README, the audit record: ``bytes_down`` is what the proxy sent the client; one ``decision`` record per request.
"""

from __future__ import annotations

import json
import re
import socket
import time

import pytest
from proxyproc import TRANSPORTS, ProxyProcess, parse_response, read_response
from rawclient import read_all

pytestmark = pytest.mark.integration

GOOD = b"GET http://public.lab.example:%d/ HTTP/1.1\r\nHost: public.lab.example:%d\r\n\r\n"
BAD = b"GET http://public.lab.example/ HTTP/1.1 extra\r\nHost: public.lab.example\r\nAccept: application/json\r\n\r\n"


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def proxy(lab, tmp_path_factory, request):
    folder = tmp_path_factory.mktemp("r21d-records")
    text = lab.policy_text("hosts:\n  allow:\n    - public.lab.example\n", default="deny", connect_plain=True)
    policy = folder / "policy.yaml"
    policy.write_text(text)
    process = ProxyProcess(["--policy", str(policy), *TRANSPORTS[request.param]], folder / "audit.jsonl")
    process.transport = request.param
    yield process
    process.stop()
    assert "Traceback" not in process.stderr, process.stderr[-3000:]


def settle(proxy: ProxyProcess, before: int, seconds: float = 1.0) -> list[dict]:
    """The records written after ``before`` once none came for a while."""
    deadline, seen, quiet_since = time.monotonic() + 8, -1, time.monotonic()
    while time.monotonic() < deadline:
        now = len(proxy.audit())
        if now != seen:
            seen, quiet_since = now, time.monotonic()
        elif time.monotonic() - quiet_since > seconds:
            break
        time.sleep(0.05)
    return proxy.audit()[before:]


def refusals(records: list[dict]) -> list[dict]:
    return [r for r in records if r["event"] == "decision" and r["verdict"] == "refuse"]


def split_responses(data: bytes) -> list[bytes]:
    """Responses with a Content-Length, one after another."""
    out = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if not sep:
            out.append(data)
            break
        length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
        size = int(length.group(1)) if length else len(rest)
        out.append(head + sep + rest[:size])
        data = rest[size:]
    return out


def one_refusal_matching(proxy, before: int, answer: bytes) -> dict:
    found = refusals(settle(proxy, before))
    assert len(found) == 1, (proxy.transport, found)
    record = found[0]
    status, _, _ = parse_response(answer)
    assert record["status"] == status and record["bytes_down"] == len(answer), (record, len(answer), answer[:300])
    return record


def test_a_bad_head_after_a_good_request_on_one_connection_gets_one_record_holds(lab, proxy):
    before = len(proxy.audit())
    port = lab.public.port
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(GOOD % (port, port))
        first = read_response(sock)
        assert first.startswith(b"HTTP/1.1 200"), first[:200]
        sock.sendall(BAD)
        second = read_all(sock, 3)
    status, headers, body = parse_response(second)
    assert status == 400 and headers.get("content-type") == "application/json", second[:400]
    one_refusal_matching(proxy, before, second)


def test_a_bad_head_pipelined_behind_a_good_one_gets_one_record_holds(lab, proxy):
    before = len(proxy.audit())
    port = lab.public.port
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(GOOD % (port, port) + BAD)
        data = read_all(sock, 3)
    answers = split_responses(data)
    assert answers and answers[0].startswith(b"HTTP/1.1 200"), data[:300]
    assert len(answers) == 2, answers
    one_refusal_matching(proxy, before, answers[1])


def test_two_bad_heads_pipelined_get_one_record_holds(proxy):
    """mitmproxy answers the first and closes: the second is never read, so never recorded."""
    before = len(proxy.audit())
    answer = proxy.raw(BAD + BAD)
    one_refusal_matching(proxy, before, answer)


def test_a_bad_head_inside_a_tunnel_to_a_plain_http_port_gets_one_record_holds(lab, proxy):
    authority = f"public.lab.example:{lab.public.port}"
    before = len(proxy.audit())
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        established = b""
        while b"\r\n\r\n" not in established and (piece := sock.recv(4096)):
            established += piece
        assert established.startswith(b"HTTP/1.1 200"), established
        sock.sendall(f"GET / HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        assert read_response(sock).startswith(b"HTTP/1.1 ")
        sock.sendall(b"GET / HTTP/1.1 extra\r\nHost: " + authority.encode() + b"\r\nAccept: application/json\r\n\r\n")
        answer = read_all(sock, 3)
    status, headers, body = parse_response(answer)
    assert status == 400 and json.loads(body)["rule"] == "http:malformed", answer[:300]
    one_refusal_matching(proxy, before, answer)


ODD = {
    "no-host-http11": b"GET /x HTTP/1.1\r\nAccept: application/json\r\n\r\n",
    "three-hosts": b"GET / HTTP/1.1\r\nHost: public.lab.example\r\nHost: a.example\r\nHost: b.example\r\n"
                   b"Accept: application/json\r\n\r\n",
    "empty-host": b"GET / HTTP/1.1\r\nHost:\r\nAccept: application/json\r\n\r\n",
    "empty-host-space": b"GET / HTTP/1.1\r\nHost:  \r\nAccept: application/json\r\n\r\n",
    "host-with-space": b"GET / HTTP/1.1\r\nHost: public .lab.example\r\nAccept: application/json\r\n\r\n",
    "host-obs-fold": b"GET / HTTP/1.1\r\nHost: public.lab.example\r\n  .evil\r\nAccept: application/json\r\n\r\n",
    "accept-obs-fold": b"GET / HTTP/1.1 x\r\nHost: public.lab.example\r\nAccept: text/plain\r\n"
                       b" , application/json\r\n\r\n",
    "two-hosts-one-empty": b"GET / HTTP/1.1\r\nHost: public.lab.example\r\nHost:\r\nAccept: application/json\r\n\r\n",
    "host-nul": b"GET / HTTP/1.1\r\nHost: public\x00.lab.example\r\nAccept: application/json\r\n\r\n",
    "two-hosts-http10": b"GET / HTTP/1.0\r\nHost: a\x1b[31m\r\nHost: b\r\nAccept: application/json\r\n\r\n",
    "two-hosts-latin1": b"GET / HTTP/1.1\r\nHost: \xe9\xff\r\nHost: b\r\nAccept: application/json\r\n\r\n",
}


@pytest.mark.parametrize("name", list(ODD))
def test_odd_heads_get_one_refusal_record_matching_the_answer_holds(proxy, name):
    before = len(proxy.audit())
    answer = proxy.raw(ODD[name])
    status, headers, body = parse_response(answer)
    assert 400 <= status < 500 and "x-egresswall-rule" in headers, (name, answer[:400])
    assert b"\x1b" not in answer and b"\x00" not in answer, answer
    record = one_refusal_matching(proxy, before, answer)
    if headers.get("content-type") == "application/json":
        assert json.loads(body)["rule"] == record["rule"], (body, record)


def test_one_line_output_is_one_printable_ascii_line_holds() -> None:
    """proxy/refusals.one_line (54d5a7e): whatever the text, one line of printable ASCII within the limit."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from proxy.refusals import one_line

    @settings(max_examples=500, deadline=None)
    @given(st.text(max_size=600), st.integers(min_value=10, max_value=400))
    def check(text: str, limit: int) -> None:
        out = one_line(text, limit)
        assert len(out) <= limit and out.isascii() and all(0x20 <= ord(c) < 0x7f for c in out), (text, out)

    check()
