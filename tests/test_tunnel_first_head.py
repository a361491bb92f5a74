"""A request head that starts a tunnel to a plain-HTTP port (``CONNECT host:80``, as Chromium sends ``ws://``) is
a request like any other: one that is malformed gets the answer and the rule the same head gets outside a tunnel,
and nothing of it reaches the origin. Before, a head h11 refused (VT, FF or NUL in a value, a framing it does not
take) closed the tunnel with no HTTP answer and the rule ``http:not-http``."""

from __future__ import annotations

import pytest
from audit_watch import AuditWatch, decisions
from proxyproc import TRANSPORTS, ProxyProcess, parse_response
from rawclient import read_all, tunnel
from test_hardening_adversarial import SMUGGLING_IDS, _smuggling_cases

pytestmark = pytest.mark.integration
NAME = "public.lab.example"


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def proxy(lab, tmp_path_factory, request):
    folder = tmp_path_factory.mktemp("first-head")
    policy = folder / "policy.yaml"
    policy.write_text(lab.policy_text(limits="limits:\n  max_header_bytes: 4096\n", connect_plain=True))
    process = ProxyProcess(["--policy", str(policy), *TRANSPORTS[request.param]], folder / "audit.jsonl")
    yield process
    process.stop()


def _inside(proxy, authority: str, data: bytes) -> tuple[bytes, list[dict]]:
    """``data`` sent as the first bytes of a tunnel to ``authority``; what came back, and the records after the
    CONNECT's own decision."""
    watch = AuditWatch(proxy.log_path).mark()
    with tunnel(proxy, authority) as sock:
        sock.sendall(data)
        answer = read_all(sock, 10)
    records = watch.wait_for(lambda r: any(x["event"] == "tunnel" for x in r))
    return answer, [r for r in decisions(records) if r["method"] != "CONNECT" or r["verdict"] == "refuse"]


@pytest.mark.parametrize("case", SMUGGLING_IDS)
def test_a_malformed_first_head_in_a_tunnel_is_answered_as_outside_one(lab, proxy, case):
    authority = f"{NAME}:{lab.public.port}"
    _, data, rule = next(c for c in _smuggling_cases(authority) if c[0] == case)
    data = data.replace(f"http://{authority}", "", 1)  # origin-form, as a client inside a tunnel writes it
    before = len(lab.public.requests)
    answer, refused = _inside(proxy, authority, data.encode("latin-1"))
    status, headers, _ = parse_response(answer)
    assert status == 400, answer[:200]
    assert [r["rule"] for r in refused] == [rule], refused
    assert refused[0]["verdict"] == "refuse" and refused[0]["reason"]
    assert headers.get("x-egresswall-rule") == rule, headers
    assert len(lab.public.requests) == before, "a malformed request reached the origin"


def test_an_oversized_first_head_in_a_tunnel_is_answered_431(lab, proxy):
    authority = f"{NAME}:{lab.public.port}"
    before = len(lab.public.requests)
    answer, refused = _inside(proxy, authority, f"GET / HTTP/1.1\r\nHost: {authority}\r\nX-Pad: {'a' * 5000}\r\n\r\n"
                              .encode())
    status, headers, _ = parse_response(answer)
    assert status == 431 and headers.get("x-egresswall-rule") == "limits.max_header_bytes", answer[:200]
    assert [r["rule"] for r in refused] == ["limits.max_header_bytes"], refused
    assert len(lab.public.requests) == before


@pytest.mark.parametrize("data", [b"\x00\x01 not http\r\n\r\n", b"\x16\x03\x01\x00\x04\x99\x00\x00\x00"],
                         ids=["binary", "tls-not-a-hello"])
def test_bytes_that_are_not_a_request_close_the_tunnel_unanswered_by_http(lab, proxy, data):
    """Bytes that never began an HTTP request get no HTTP answer (nothing there reads one)."""
    answer, refused = _inside(proxy, f"{NAME}:{lab.public.port}", data)
    assert not answer.startswith(b"HTTP/"), answer[:200]
    assert len(refused) == 1 and refused[0]["verdict"] == "refuse", refused
