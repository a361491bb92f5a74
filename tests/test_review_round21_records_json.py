"""Review round 21, "records": a client whose Accept prefers JSON gets JSON for every refusal made after its head
was whole — also the ones mitmproxy makes on egresswall's behalf (a request line it cannot parse, a request
with no or two Host headers).

README, *Refusals an agent can read*: "A client whose `Accept` header prefers JSON gets the refusal as one JSON
object ... Every answer the proxy makes itself has this form, on both transports: the ones mitmproxy makes on
egresswall's behalf too (a head it cannot parse, an origin-form request whose `Host` it cannot read, a connect
that failed)", and only "A refusal made before any request head was whole (`408`, `431`) is always text, since
there is no `Accept` to read."
"""

from __future__ import annotations

import json
import socket
import time

import pytest
from proxyproc import TRANSPORTS, ProxyProcess, parse_response, read_response

pytestmark = pytest.mark.integration

HEADS = {
    "extra-word-in-request-line": b"GET http://public.lab.example/ HTTP/1.1 extra\r\nHost: public.lab.example\r\n"
                                  b"Accept: application/json\r\n\r\n",
    "no-host-http10": b"GET /no-host HTTP/1.0\r\nAccept: application/json\r\n\r\n",
    "two-host-headers": b"GET / HTTP/1.1\r\nHost: public.lab.example\r\nHost: denied.lab.example\r\n"
                        b"Accept: application/json\r\n\r\n",
    "asterisk-options": b"OPTIONS * HTTP/1.1\r\nHost: public.lab.example\r\nAccept: application/json\r\n\r\n",
}


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def proxy(lab, tmp_path_factory, request):
    folder = tmp_path_factory.mktemp("r21json")
    policy = folder / "policy.yaml"
    policy.write_text(lab.policy_text("hosts:\n  deny:\n    - denied.lab.example\n  allow:\n    - public.lab.example\n",
                                      default="deny"))
    process = ProxyProcess(["--policy", str(policy), *TRANSPORTS[request.param]], folder / "audit.jsonl")
    yield process
    process.stop()


@pytest.mark.parametrize("name", list(HEADS))
def test_a_whole_head_refused_as_malformed_is_answered_in_json_when_json_is_preferred(proxy, name):
    status, headers, body = parse_response(proxy.raw(HEADS[name]))
    assert 400 <= status < 500 and "x-egresswall-rule-id" in headers, (status, headers, body)
    assert headers.get("content-type") == "application/json", (
        f"{name}: Accept: application/json, whole head, answered {headers.get('content-type')}: {body!r}")
    answer = json.loads(body)
    assert answer["error"] == "malformed" and answer["status"] == status


def test_the_record_of_two_host_headers_does_not_say_there_was_none(proxy):
    """A request with two Host headers is refused (right), but its record and answer say "HTTP request has no
    host header" (mitmproxy's words for ``get_all('host') != 1``): the record misstates what the client sent.
    The README's record has a `reason`, "the sentence that explains it"; it should say there were two."""
    before = len(proxy.audit())
    status, headers, body = parse_response(proxy.raw(HEADS["two-host-headers"]))
    (record,) = [r for r in proxy.audit()[before:] if r["event"] == "decision"]
    assert record["verdict"] == "refuse" and record["status"] == status
    assert "no host header" not in record["reason"].lower(), record["reason"]


# ---- after the fix: the records, the words, the text answers and the tunnel -------------------------------------

def decisions_after(proxy: ProxyProcess, before: int, count: int = 1) -> list[dict]:
    deadline = time.monotonic() + 5
    while len(proxy.audit()) < before + count and time.monotonic() < deadline:
        time.sleep(0.05)
    return [r for r in proxy.audit()[before:] if r["event"] == "decision"]


def test_two_host_headers_get_the_cores_host_header_refusal_in_answer_and_record(proxy):
    """Two Host headers in origin form: 400 (RFC 9112 3.2), the core's rule for a Host header that cannot name the
    target (``form:host-header``, as an absolute-form request with two gets), one record, and the answer's reason,
    header and JSON field are the record's (README: `reason` is "the same as `X-Egresswall-Reason`")."""
    before = len(proxy.audit())
    status, headers, body = parse_response(proxy.raw(HEADS["two-host-headers"]))
    (record,) = decisions_after(proxy, before)
    answer = json.loads(body)
    assert status == 400 and record["status"] == 400
    assert record["rule"] == answer["rule"] == headers["x-egresswall-rule"] == "form:host-header", record
    assert "2 Host headers" in record["reason"] and "denied.lab.example" in record["reason"], record
    assert answer["reason"] == headers["x-egresswall-reason"] == record["reason"]
    assert answer["hint"].startswith("the Host header must name the request's target"), answer


def test_two_host_headers_in_absolute_form_get_the_same_rule_holds(proxy):
    """Two Host headers beside an absolute URL (the fast path hands the head over, so both transports reach the
    same addon): 400 ``form:host-header`` with the words of the origin-form case (README: "more than one `Host`
    header (400 `form:host-header`, in either form)"; it was 403, "the Host header 'a, b' does not agree", until a
    newcomer's reading of round 21), two identical ones too."""
    for second in (b"denied.lab.example", b"public.lab.example"):
        before = len(proxy.audit())
        status, headers, body = parse_response(proxy.raw(
            b"GET http://public.lab.example/ HTTP/1.1\r\nHost: public.lab.example\r\nHost: " + second + b"\r\n"
            b"Accept: application/json\r\n\r\n"))
        (record,) = decisions_after(proxy, before)
        assert status == 400 and record["rule"] == json.loads(body)["rule"] == "form:host-header", (record, body)
        assert record["reason"].startswith("the request has 2 Host headers"), record


@pytest.mark.parametrize("name", [name for name in HEADS if name != "asterisk-options"])
def test_without_json_in_accept_the_answer_stays_text_and_the_record_counts_it(proxy, name):
    """No JSON in Accept: the text refusal, as before, and the record's bytes_down is what was sent."""
    before = len(proxy.audit())
    raw = proxy.raw(HEADS[name].replace(b"Accept: application/json\r\n", b"Accept: text/html, */*;q=0.8\r\n"))
    status, headers, body = parse_response(raw)
    (record,) = decisions_after(proxy, before)
    assert headers.get("content-type", "").startswith("text/plain"), (name, raw)
    assert body.startswith(b"egresswall refused this request.\nrule: " + record["rule"].encode()), body
    assert record["status"] == status and record["bytes_down"] == len(raw), (record, len(raw))


@pytest.mark.parametrize("name", [name for name in HEADS if name != "asterisk-options"])
def test_a_json_answer_made_on_mitmproxys_behalf_is_counted_as_sent(proxy, name):
    """README, *Refusals an agent can read* and the record: its bytes_down is the size of the answer sent (the
    JSON one here), as test_proxy_json_refusals.py::test_bytes_down_is_the_size_of_the_body_sent has it for the
    gate's own refusals."""
    before = len(proxy.audit())
    raw = proxy.raw(HEADS[name])
    (record,) = decisions_after(proxy, before)
    assert record["bytes_down"] == len(raw), (record, len(raw))


@pytest.mark.parametrize("accept, json_wanted", [
    (b"Accept: text/plain;q=0.5\r\nAccept: application/json\r\n", True),  # two fields: one list (RFC 9110 5.3)
    (b"Accept: application/json\r\nAccept: text/plain\r\n", True),  # a tie goes to JSON, as for one field
    (b"Accept: application/json;q=0.5\r\nAccept: text/plain\r\n", False),
    (b"Accept : application/json\r\n", False),  # a space before the colon: no field h11 or the fast path reads
    (b"X-Note: a\r\n Accept: application/json\r\n", False),  # a folded line continues X-Note; it names no field
    (b"Accept: application/json\x01\r\n", False),  # a value that does not parse is no preference
])
def test_the_accept_of_a_head_mitmproxy_cannot_parse_is_read_strictly(proxy, accept, json_wanted):
    head = b"GET http://public.lab.example/ HTTP/1.1 extra\r\nHost: public.lab.example\r\n" + accept + b"\r\n"
    status, headers, body = parse_response(proxy.raw(head))
    assert status == 400 and headers["x-egresswall-rule"] == "http:malformed", (status, headers, body)
    assert (headers["content-type"] == "application/json") is json_wanted, (accept, headers, body)


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def tunnel_proxy(lab, tmp_path_factory, request):
    """A proxy whose policy lets a CONNECT reach the lab's plain-HTTP origin (as ws:// from a browser does)."""
    folder = tmp_path_factory.mktemp("r21jsontunnel")
    text = lab.policy_text("hosts:\n  allow:\n    - public.lab.example\n", default="deny", connect_plain=True)
    assert str(lab.public.port) in text.split("connect:")[1].split("\n")[0]
    policy = folder / "policy.yaml"
    policy.write_text(text)
    process = ProxyProcess(["--policy", str(policy), *TRANSPORTS[request.param]], folder / "audit.jsonl")
    yield process
    process.stop()


def test_a_head_mitmproxy_cannot_parse_inside_a_tunnel_is_answered_in_json_too(lab, tunnel_proxy):
    """Inside a CONNECT to a plain-HTTP port the head is mitmproxy's to read as well: the same promise holds."""
    authority = f"public.lab.example:{lab.public.port}"
    with socket.create_connection((tunnel_proxy.host, tunnel_proxy.port), timeout=10) as sock:
        sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        established = b""
        while b"\r\n\r\n" not in established and (piece := sock.recv(4096)):  # no length: read the head only
            established += piece
        assert established.startswith(b"HTTP/1.1 200"), established
        # A tunnel's first message is judged before mitmproxy reads it (not HTTP/1: closed, http:not-http), so a
        # request it relays comes first and the head it cannot parse second.
        sock.sendall(f"GET / HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        assert read_response(sock).startswith(b"HTTP/1.1 ")
        sock.sendall(b"GET / HTTP/1.1 extra\r\nHost: " + authority.encode() + b"\r\nAccept: application/json\r\n\r\n")
        status, headers, body = parse_response(read_response(sock))
    assert status == 400 and headers.get("content-type") == "application/json", (status, headers, body)
    assert json.loads(body)["rule"] == "http:malformed"
