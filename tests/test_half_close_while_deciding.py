"""A client that sends its whole request and half-closes while the request is still being decided.

Some clients shut their sending side once a request is out (``nc -N``, scripts, some agents' HTTP stacks).
The decision waits for the name's DNS answer — here a nameserver of the test's own that answers late — and
the answer must still come: a refusal with its rule and reason, or the origin's response. On mitmproxy's
path a chunked body refused for its framing (or over the limit) was met with a closed connection and no
answer when the end came before the decision (mitmproxy's reader took it for a body cut short). Both
transports; each case in one write, then ``shutdown(SHUT_WR)``.
"""

from __future__ import annotations

import re
import socket
import time

import dns.name
import pytest
from labnet import INTERNAL_IP, PUBLIC_IP
from proxyproc import TRANSPORTS, ProxyProcess, serve_module_proxy
from test_body_while_deciding import LateNameserver, late_policy
from test_review_round7 import BAD_BODIES

LIMIT = 4096
ANSWER_AFTER = 0.6


class SplitNameserver(LateNameserver):
    """Late answers; names that begin with ``inside`` resolve to the internal stand-in (refused by address)."""

    def address_of(self, name: dns.name.Name) -> str:
        return INTERNAL_IP if name.to_text().startswith("inside") else PUBLIC_IP


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def proxy(lab, tmp_path_factory, request):
    nameserver = SplitNameserver(ANSWER_AFTER)
    yield from serve_module_proxy(tmp_path_factory.mktemp("halfclose"), late_policy(lab, nameserver, 3, LIMIT),
                                  request.param)
    nameserver.close()


def _send_and_half_close(proxy: ProxyProcess, lab, prefix: str, head: str, body: bytes) -> tuple[bytes, str, str]:
    """One request (head and body in one write) to a fresh name, then the sending side shut: what came back
    until the proxy closed, the name and the path."""
    name = f"{prefix}{time.monotonic_ns()}.lab.example"
    authority = f"{name}:{lab.public.port}"
    path = f"/hc/{time.monotonic_ns()}"
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(f"POST http://{authority}{path} HTTP/1.1\r\nHost: {authority}\r\n{head}\r\n".encode() + body)
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer, name, path


def _statuses(answer: bytes) -> list[int]:
    return [int(m[1]) for m in re.finditer(rb"HTTP/1\.[01] (\d{3}) ", answer)]


def _refused_once(proxy: ProxyProcess, path: str, status: int, rule: str) -> None:
    time.sleep(0.3)
    mine = [r for r in proxy.audit() if r.get("path") == path]
    refusals = [r for r in mine if r.get("verdict") == "refuse"]
    assert len(refusals) == 1 and refusals[0]["status"] == status and refusals[0]["rule"] == rule, mine
    assert refusals[0].get("reason"), mine


@pytest.mark.parametrize("shape", list(BAD_BODIES))
def test_a_bad_body_then_a_half_close_is_answered(proxy, lab, shape):
    answer, _, path = _send_and_half_close(proxy, lab, "bad", "Transfer-Encoding: chunked\r\n", BAD_BODIES[shape])
    assert _statuses(answer) == [400], answer[:300]
    rule = "http:trailers" if shape == "trailers" else "http:bad-chunked"
    _refused_once(proxy, path, 400, rule)
    assert not [p for _, p, _ in lab.public.requests if p == path]


def test_a_body_over_the_limit_then_a_half_close_is_answered_413(proxy, lab):
    body = b"".join(b"400\r\n" + b"z" * 1024 + b"\r\n" for _ in range(8)) + b"0\r\n\r\n"
    answer, _, path = _send_and_half_close(proxy, lab, "over", "Transfer-Encoding: chunked\r\n", body)
    assert _statuses(answer) == [413], answer[:300]
    _refused_once(proxy, path, 413, "limits.max_request_body")
    assert not [p for _, p, _ in lab.public.requests if p == path]


@pytest.mark.parametrize("framing", ["chunked", "length", "length-cut-short"])
def test_a_request_refused_by_address_then_a_half_close_is_answered_403(proxy, lab, framing):
    data = b"secret=1"
    head, body = {
        "chunked": ("Transfer-Encoding: chunked\r\n", b"8\r\n" + data + b"\r\n0\r\n\r\n"),
        "length": (f"Content-Length: {len(data)}\r\n", data),
        "length-cut-short": (f"Content-Length: {len(data) * 4}\r\n", data),
    }[framing]
    answer, _, path = _send_and_half_close(proxy, lab, "inside", head, body)
    assert _statuses(answer) == [403], answer[:300]
    time.sleep(0.3)
    mine = [r for r in proxy.audit() if r.get("path") == path and r.get("verdict") == "refuse"]
    assert len(mine) == 1 and mine[0]["status"] == 403 and mine[0]["stage"] == "address", mine


@pytest.mark.parametrize("framing", ["chunked", "length"])
def test_an_allowed_request_then_a_half_close_gets_the_origins_answer(proxy, lab, framing):
    data = b"hello body"
    head, body = {
        "chunked": ("Transfer-Encoding: chunked\r\n", b"a\r\n" + data + b"\r\n0\r\n\r\n"),
        "length": (f"Content-Length: {len(data)}\r\n", data),
    }[framing]
    answer, _, path = _send_and_half_close(proxy, lab, "open", head, body)
    assert _statuses(answer) == [200] and answer.endswith(f"got {len(data)} bytes".encode()), answer[:300]
    assert [p for _, p, _ in lab.public.requests if p == path] == [path]
