"""Adversarial clients and servers against the real proxy. Each case ends refused or bounded, and
the audit log says which and why; no case reaches the internal stand-ins, and nothing is forwarded
that the proxy refused."""

from __future__ import annotations

import socket
import ssl
import threading
import time

import pytest
from audit_watch import AuditWatch, decisions, rss_kib, rules
from hostile import Blackhole, EndlessHeaders, RedirectLoop, Silent, slowloris
from labnet import PUBLIC_IP
from proxyproc import TRANSPORTS, both_transports, parse_response, read_response

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("internal_saw_nothing")]

HEADER_TIMEOUT, IDLE_TIMEOUT, CONNECT_TIMEOUT = 2, 4, 1


@pytest.fixture(scope="module")
def hostile():
    servers = {"endless": EndlessHeaders(), "drip": EndlessHeaders(interval=0.2), "silent": Silent(),
               "loop": RedirectLoop(), "blackhole": Blackhole()}
    yield servers
    for server in servers.values():
        server.close()


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def proxy(lab, hostile, tmp_path_factory, request):
    from proxyproc import ProxyProcess

    folder = tmp_path_factory.mktemp("adversarial")
    ports = sorted({80, lab.public.port, *(s.port for s in hostile.values())})
    text = lab.policy_text(limits=f"limits:\n  header_timeout: {HEADER_TIMEOUT}\n  idle_timeout: {IDLE_TIMEOUT}\n"
                                  f"  connect_timeout: {CONNECT_TIMEOUT}\n")
    text = text.replace(f"  http: {sorted({80, lab.public.port})}", f"  http: {ports}")
    policy = folder / "policy.yaml"
    policy.write_text(text)
    process = ProxyProcess(["--policy", str(policy), *TRANSPORTS[request.param]], folder / "audit.jsonl")
    yield process
    process.stop()
    assert not [e for e in process.outbound() if e["host"] != PUBLIC_IP], process.outbound()


@pytest.fixture
def audit(proxy):
    return AuditWatch(proxy.log_path).mark()


def send(proxy, data: bytes, timeout: float = 10) -> bytes:
    with socket.create_connection((proxy.host, proxy.port), timeout=timeout) as sock:
        sock.sendall(data)
        return read_all(sock)


def read_all(sock: socket.socket) -> bytes:
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            return data
        if not chunk:
            return data
        data += chunk


# ---- request smuggling shapes ------------------------------------------------------------------------

INVALID = "http:invalid-request"


def _smuggling_cases(authority: str) -> list[tuple[str, str, str]]:
    start = f"POST http://{authority}/smuggle HTTP/1.1\r\nHost: {authority}\r\n"
    get = f"GET http://{authority}/smuggle HTTP/1.1\r\nHost: {authority}\r\n"
    # mitmproxy itself refuses these framings (400); egresswall's decision line gives its reason.
    return [
        ("cl-and-te", start + "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", INVALID),
        ("te-and-cl", start + "Transfer-Encoding: chunked\r\nContent-Length: 40\r\n\r\n0\r\n\r\n", INVALID),
        ("duplicate-cl", start + "Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello!", INVALID),
        ("duplicate-cl-same", start + "Content-Length: 5\r\nContent-Length: 5\r\n\r\nhello", INVALID),
        ("cl-list", start + "Content-Length: 5, 5\r\n\r\nhello", INVALID),
        ("duplicate-te", start + "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
         INVALID),
        ("unknown-te", start + "Transfer-Encoding: xchunked\r\n\r\n0\r\n\r\n", INVALID),
        ("te-identity", start + "Transfer-Encoding: identity\r\nContent-Length: 5\r\n\r\nhello", INVALID),
        ("space-before-colon", start + "Transfer-Encoding : chunked\r\n\r\n0\r\n\r\n", INVALID),
        ("negative-cl", start + "Content-Length: -1\r\n\r\n", INVALID),
        ("te-on-http10", start.replace("HTTP/1.1", "HTTP/1.0") + "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
         INVALID),
        ("obs-fold", get + "X-Folded: a\r\n b\r\n\r\n", "http:header-value"),
        ("obs-fold-te", get + "X-Folded: a\r\n Transfer-Encoding: chunked\r\n\r\n", "http:header-value"),
        ("obs-fold-host", get.replace(f"Host: {authority}\r\n", f"Host: {authority}\r\n internal.lab.example\r\n")
         + "\r\n", "http:header-value"),
        ("bare-cr-in-value", get + "X-A: a\rTransfer-Encoding: chunked\r\n\r\n", "http:header-value"),
        ("nul-in-value", get + "X-A: a\x00b\r\n\r\n", "http:header-value"),
        # Any other control byte but HTAB (RFC 9110 5.5), as a response's (review round 22: VT and FF went on).
        ("vt-in-value", get + "X-A: a\x0bb\r\n\r\n", "http:header-value"),
        ("ff-in-value", get + "X-A: a\x0cb\r\n\r\n", "http:header-value"),
        ("esc-in-value", get + "X-A: a\x1b[31mb\r\n\r\n", "http:header-value"),
        ("del-in-value", get + "X-A: a\x7fb\r\n\r\n", "http:header-value"),
        ("bad-request-line", "GET http://" + authority + "/ HTTP/1.1 extra\r\n\r\n", "http:malformed"),
        ("header-without-colon", get + "NoColonHere\r\n\r\n", "http:malformed"),
    ]


SMUGGLING_IDS = [case[0] for case in _smuggling_cases("x:1")]


@pytest.mark.parametrize("case", SMUGGLING_IDS)
def test_request_smuggling_shapes_are_refused_and_not_forwarded(lab, proxy, audit, case):
    authority = f"public.lab.example:{lab.public.port}"
    _, data, rule = next(c for c in _smuggling_cases(authority) if c[0] == case)
    forwarded = len(lab.public.requests)
    status, _, _ = parse_response(send(proxy, data.encode("latin-1")))
    assert status == 400
    records = audit.wait_for(lambda r: decisions(r))
    assert rules(records) == [rule], records
    refusal = decisions(records)[0]
    assert refusal["verdict"] == "refuse" and refusal["status"] == 400 and refusal["reason"]
    assert len(lab.public.requests) == forwarded, "a malformed request reached the upstream"


def test_pipelined_request_behind_a_body_is_decided_on_its_own(lab, proxy, audit):
    """CL: 0 then a second request to an internal host in the same packet: two decisions, one refusal."""
    port = lab.public.port
    data = (f"POST http://public.lab.example:{port}/first HTTP/1.1\r\nHost: public.lab.example:{port}\r\n"
            f"Content-Length: 0\r\n\r\nGET http://internal.lab.example:{port}/second HTTP/1.1\r\n"
            f"Host: internal.lab.example:{port}\r\nConnection: close\r\n\r\n").encode()
    answer = send(proxy, data)
    assert answer.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 403" in answer
    records = audit.wait_for(lambda r: len(decisions(r)) == 2)
    assert [(d["host"], d["verdict"]) for d in decisions(records)] == [
        ("public.lab.example", "allow"), ("internal.lab.example", "refuse")]


def test_bare_lf_line_ends_are_one_request_decided_once(lab, proxy, audit):
    """RFC 9112 lets a recipient accept bare LF; mitmproxy does, and forwards its own CRLF framing, so the
    upstream reads exactly the request that was decided (no second reading to smuggle through)."""
    port = lab.public.port
    before = len(lab.public.requests)
    data = f"GET http://public.lab.example:{port}/lf HTTP/1.1\nHost: public.lab.example:{port}\nConnection: close\n\n"
    status, _, body = parse_response(send(proxy, data.encode()))
    assert status == 200 and body.endswith(b"/lf")
    assert [d["verdict"] for d in decisions(audit.wait_for(lambda r: decisions(r)))] == ["allow"]
    assert [r[1] for r in lab.public.requests[before:]] == ["/lf"]


def test_head_that_never_ends_is_closed_and_logged(lab, proxy, audit):
    """Bare CR only: no line ever ends, so no head ever completes. The head is cut off with 408 once
    limits.header_timeout has passed since its first byte, although nothing more arrives (a client
    that sends half a head and waits is not left to the idle timeout), and the audit log says so."""
    port = lab.public.port
    started = time.monotonic()
    answer = send(proxy, f"GET http://public.lab.example:{port}/ HTTP/1.1\rHost: x\r\r".encode(),
                  timeout=IDLE_TIMEOUT + 10)
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert HEADER_TIMEOUT - 0.5 < time.monotonic() - started < IDLE_TIMEOUT
    records = audit.wait_for(lambda r: decisions(r))
    assert rules(records) == ["limits.header_timeout"]


# ---- targets that disagree with themselves ----------------------------------------------------------

def test_absolute_form_with_host_header_for_another_host_is_refused(lab, proxy, audit):
    port = lab.public.port
    for host_header in (f"internal.lab.example:{port}", "public.lab.example:1", "127.0.0.3", f"[::1]:{port}"):
        status, headers, _ = proxy.get(f"http://public.lab.example:{port}/", {"Host": host_header})
        assert status == 403 and headers["x-egresswall-rule"] == "form:host-header"
    records = audit.wait_for(lambda r: len(decisions(r)) == 4)
    assert rules(records) == ["form:host-header"] * 4
    assert all("does not agree" in d["reason"] for d in decisions(records))


def test_origin_form_is_decided_by_its_host_header(lab, proxy, audit):
    status, _, _ = parse_response(send(proxy, f"GET / HTTP/1.1\r\nHost: internal.lab.example:{lab.public.port}\r\n"
                                              "Connection: close\r\n\r\n".encode()))
    assert status == 403
    assert [d["host"] for d in decisions(audit.wait_for(lambda r: decisions(r)))] == ["internal.lab.example"]


def test_connect_to_allowed_name_on_forbidden_port_is_refused(lab, proxy, audit):
    for port in (22, 25, 6379, lab.public.port):  # the plain-HTTP port is not a CONNECT port either
        sock, status, headers = proxy.connect(f"public.lab.example:{port}")
        sock.close()
        assert status == 403 and headers["x-egresswall-rule"] == "ports.connect"
    records = audit.wait_for(lambda r: len(decisions(r)) == 4)
    assert rules(records) == ["ports.connect"] * 4


def test_connect_whose_sni_names_another_host_is_closed(lab, proxy, audit):
    served = len(lab.public_tls.requests)
    sock, status, _ = proxy.connect(f"public.lab.example:{lab.public_tls.port}")
    assert status == 200
    context = ssl.create_default_context(cafile=str(lab.cert_file))
    with pytest.raises((ssl.SSLError, ConnectionError)):
        context.wrap_socket(sock, server_hostname="other.lab.example")
    sock.close()
    records = audit.wait_for(lambda r: "tls:sni" in rules(r))
    refusal = next(d for d in decisions(records) if d["rule"] == "tls:sni")
    assert "other.lab.example" in refusal["reason"] and refusal["verdict"] == "refuse"
    assert len(lab.public_tls.requests) == served


def test_websocket_upgrade_to_internal_address_is_refused(lab, proxy, audit):
    port = lab.public.port
    upgrade = {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
               "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}
    for host in ("127.0.0.3", "internal.lab.example", "[::ffff:127.0.0.3]", "alias.lab.example"):
        status, _, _ = proxy.get(f"http://{host}:{port}/socket", upgrade)
        assert status == 403
    # Chromium sends ws:// as CONNECT host:80-style; refused the same way.
    sock, status, _ = proxy.connect(f"internal.lab.example:{lab.public_tls.port}")
    sock.close()
    assert status == 403
    records = audit.wait_for(lambda r: len(decisions(r)) == 5)
    assert [d["verdict"] for d in decisions(records)] == ["refuse"] * 5
    # Refused for where they lead (an internal address, or a CNAME into .internal), not for their form.
    assert [d["stage"] for d in decisions(records)] == ["address", "address", "address", "resolve", "address"]


# ---- oversized and slow heads --------------------------------------------------------------------------

def test_oversized_header_block_is_refused_431(lab, proxy, audit):
    port = lab.public.port
    forwarded = len(lab.public.requests)
    head = (f"GET http://public.lab.example:{port}/big HTTP/1.1\r\nHost: public.lab.example:{port}\r\n".encode()
            + b"".join(b"X-Pad-%d: %s\r\n" % (i, b"a" * 1000) for i in range(100)) + b"\r\n")
    status, headers, _ = parse_response(send(proxy, head))
    assert status == 431 and headers["x-egresswall-rule"] == "limits.max_header_bytes"
    assert rules(audit.wait_for(lambda r: decisions(r))) == ["limits.max_header_bytes"]
    assert len(lab.public.requests) == forwarded


def test_header_stream_that_never_ends_is_cut_off_and_memory_stays_bounded(lab, proxy, audit):
    """20 MB of header lines, as fast as the socket takes them: the proxy stops reading at the limit."""
    rss_before = rss_kib(proxy.process.pid)
    port = lab.public.port
    sent = 0
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(f"GET http://public.lab.example:{port}/ HTTP/1.1\r\nHost: public.lab.example:{port}\r\n".encode())
        line = b"X-Endless: " + b"a" * 8000 + b"\r\n"
        try:
            while sent < 20 << 20:
                sock.sendall(line)
                sent += len(line)
        except OSError:
            pass
        answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 431")
    assert sent < 20 << 20, "the proxy kept reading a header block that never ends"
    assert rss_kib(proxy.process.pid) - rss_before < 10 * 1024
    assert rules(audit.wait_for(lambda r: decisions(r))) == ["limits.max_header_bytes"]


def test_bytes_pipelined_behind_a_waiting_request_are_bounded(hostile, proxy, audit):
    """A request to an upstream that never answers, then 200 MB more on the same connection: mitmproxy
    would buffer all of it until the response comes. The proxy closes the connection instead."""
    rss_before = rss_kib(proxy.process.pid)
    port = hostile["silent"].port
    sent = 0
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(f"GET http://public.lab.example:{port}/ HTTP/1.1\r\nHost: public.lab.example:{port}\r\n\r\n"
                     .encode())
        time.sleep(0.3)
        try:
            while sent < 200 << 20:
                sock.sendall(b"x" * 65536)
                sent += 65536
        except OSError:
            pass
    assert sent < 200 << 20, "the proxy kept buffering bytes behind a waiting request"
    assert rss_kib(proxy.process.pid) - rss_before < 16 * 1024
    records = audit.wait_for(lambda r: "limits.max_header_bytes" in rules(r) and any(
        x["event"] == "response" for x in r))
    assert [d["verdict"] for d in decisions(records)] == ["allow", "refuse"]
    assert "after a request that is still waiting" in next(x for x in records if x["event"] == "response")["error"]


@both_transports
def test_slowloris_does_not_starve_other_clients(lab, start_proxy):
    """50 connections send their headers a byte at a time from another client address. While all of
    them are open, a normal client's requests complete promptly (well inside the header timeout that
    would free a starved server); then each slow connection is cut off with 408 after
    limits.header_timeout, and the audit log names each."""
    header_timeout = 5
    proxy = start_proxy(lab.policy_text(limits=f"limits:\n  header_timeout: {header_timeout}\n"))
    audit = AuditWatch(proxy.log_path).mark()
    port = lab.public.port
    head = (f"GET http://public.lab.example:{port}/ HTTP/1.1\r\nHost: public.lab.example:{port}\r\nX-Slow: "
            ).encode() + b"a" * 100_000
    stop = threading.Event()
    result: dict[str, list] = {}
    attacker = threading.Thread(target=lambda: result.update(
        slow=slowloris(proxy.host, proxy.port, 50, head, 0.1, stop, source="127.0.0.5")))
    started = time.monotonic()
    attacker.start()
    try:
        time.sleep(0.5)
        latencies = []
        for i in range(20):
            before = time.monotonic()
            status, _, body = proxy.get(f"http://public.lab.example:{port}/meanwhile{i}")
            latencies.append(time.monotonic() - before)
            assert status == 200 and body.endswith(f"/meanwhile{i}".encode())
            time.sleep(0.05)
        normal_done = time.monotonic() - started
        attacker.join(header_timeout + 15)
    finally:
        stop.set()
        attacker.join(10)
    slow = result["slow"]
    assert all(r["closed_after"] is not None for r in slow)
    assert normal_done < min(r["closed_after"] for r in slow), "the slow connections were gone before the test"
    assert max(latencies) < 1.5, f"a normal request waited {max(latencies):.2f}s behind slowloris"
    assert all(r["answer"].startswith(b"HTTP/1.1 408") for r in slow)
    assert all(header_timeout - 0.5 < r["closed_after"] < header_timeout + 4 for r in slow)
    records = audit.wait_for(lambda r: rules(r).count("limits.header_timeout") == 50)
    cut = [d for d in decisions(records) if d["rule"] == "limits.header_timeout"]
    assert len(cut) == 50 and {d["client"] for d in cut} == {"127.0.0.5"} and all(d["status"] == 408 for d in cut)
    assert [d["verdict"] for d in decisions(records) if d["rule"] != "limits.header_timeout"] == ["allow"] * 20


# ---- hostile upstreams ----------------------------------------------------------------------------------

def _fetch(proxy, port: int, path: str = "/", timeout: float = 30) -> tuple[int, float]:
    started = time.monotonic()
    with socket.create_connection((proxy.host, proxy.port), timeout=timeout) as sock:
        sock.sendall(f"GET http://public.lab.example:{port}{path} HTTP/1.1\r\nHost: public.lab.example:{port}\r\n"
                     "Connection: close\r\n\r\n".encode())
        status, _, _ = parse_response(read_response(sock))
    return status, time.monotonic() - started


def _ended_with(audit: AuditWatch) -> dict:
    records = audit.wait_for(lambda r: any(x["event"] == "response" for x in r))
    assert [d["verdict"] for d in decisions(records)] == ["allow"]
    return next(x for x in records if x["event"] == "response")


def test_upstream_sending_endless_headers_is_cut_off(hostile, proxy, audit):
    status, _ = _fetch(proxy, hostile["endless"].port)
    assert status == 502
    assert "limits.max_header_bytes" in _ended_with(audit)["error"]


def test_upstream_dripping_headers_is_cut_off_after_the_header_timeout(hostile, proxy, audit):
    status, took = _fetch(proxy, hostile["drip"].port)
    assert status == 502 and HEADER_TIMEOUT - 0.5 < took < HEADER_TIMEOUT + 4
    assert "limits.header_timeout" in _ended_with(audit)["error"]


def test_upstream_that_never_answers_is_closed_after_the_idle_timeout(hostile, proxy, audit):
    status, took = _fetch(proxy, hostile["silent"].port)
    assert status == 0 and took < IDLE_TIMEOUT + 5  # closed without a response
    assert "limits.idle_timeout" in _ended_with(audit)["error"]


def test_upstream_connect_that_hangs_times_out(hostile, proxy, audit):
    assert hostile["blackhole"].hangs(), "the blackhole's accept queue is not full; the test proves nothing"
    status, took = _fetch(proxy, hostile["blackhole"].port)
    assert status == 502 and took < CONNECT_TIMEOUT + 4
    assert "limits.connect_timeout" in _ended_with(audit)["error"]


def test_redirect_loop_is_the_clients_to_end_and_each_hop_is_decided(hostile, proxy, audit):
    """The proxy never follows redirects: each hop is a request of its own, decided and logged; a client
    that gives up after 20 hops (as browsers do) ends the loop."""
    loop = hostile["loop"]
    before = loop.requests
    url = f"http://public.lab.example:{loop.port}/loop/0"
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        for _ in range(20):
            authority = url.split("/")[2]
            sock.sendall(f"GET {url} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
            status, headers, _ = parse_response(read_response(sock))
            assert status == 302
            url = headers["location"]
    assert url.endswith("/loop/20") and loop.requests - before == 20
    records = audit.wait_for(lambda r: len(decisions(r)) == 20)
    assert [d["path"] for d in decisions(records)] == [f"/loop/{i}" for i in range(20)]


def test_client_that_disconnects_mid_upload_ends_the_upstream_request(lab, proxy, audit):
    port = lab.public.port
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(f"POST http://public.lab.example:{port}/upload HTTP/1.1\r\nHost: public.lab.example:{port}\r\n"
                     "Content-Length: 1000000\r\n\r\n".encode() + b"x" * 100_000)
        time.sleep(0.3)
    records = audit.wait_for(lambda r: any(x["event"] == "response" for x in r))
    assert [d["verdict"] for d in decisions(records)] == ["allow"]
    ended = next(x for x in records if x["event"] == "response")
    assert ended["error"] and ended["status"] is None
    status, _, _ = proxy.get(f"http://public.lab.example:{port}/after-upload")
    assert status == 200
