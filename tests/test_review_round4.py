"""Adversarial review of the proxy layer, round 4: attacks through the real proxy, on both transports (the
fast front with its plain-HTTP path, and mitmproxy's path: ``proxyproc.TRANSPORTS``).

What must never pass: a request or connection the policy refuses (a path a deny rule names included), a
request an origin reads that egresswall never decided, a refusal without its one record, and a way into
the proxy that skips the front's bounds. Each attack that succeeded when this review was made comes with
its fix (the test failed before it); the ones that held are kept where they cover what no other test does.

Defects found and fixed:

* a GET (or HEAD) carrying a body: an origin that does not read a GET's body (Python's http.server, many
  frameworks) takes the body for the next request on the connection — a request egresswall never decided
  (a path a deny rule refuses, a method a rule does not allow). Now refused, 400 ``http:unexpected-body``;
* an empty path segment (``//admin/``) slipped past a path deny rule, though servers read it as
  ``/admin/`` (http.server strips leading slashes, nginx merges them);
* mitmproxy's internal listener (127.0.0.1, a random port) stayed open beside the front: a local client
  could connect to it directly and skip the front's first-byte bound and its record.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time

import pytest
from audit_watch import AuditWatch
from hypothesis import given
from hypothesis import strategies as st
from labnet import PUBLIC_IP
from proxyproc import TRANSPORTS, ProxyProcess, parse_response

from policy.model import canonical_path

pytestmark = pytest.mark.integration

HEADER_TIMEOUT, FIRST_BYTE_TIMEOUT, IDLE_TIMEOUT, BODY_LIMIT = 2, 2, 6, 1000
DENIED_PATH = "/admin/"


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def proxy(lab, tmp_path_factory, request):
    """Default allow, a deny rule for public.lab.example's /admin/, and CONNECT allowed to the public
    plain-HTTP port too (a tunnel there carries HTTP, decided request by request)."""
    folder = tmp_path_factory.mktemp("round4")
    text = lab.policy_text(
        f"hosts:\n  deny:\n    - host: public.lab.example\n      paths: [{DENIED_PATH}]\n",
        limits=f"limits:\n  header_timeout: {HEADER_TIMEOUT}\n  first_byte_timeout: {FIRST_BYTE_TIMEOUT}\n"
               f"  idle_timeout: {IDLE_TIMEOUT}\n  max_request_body: {BODY_LIMIT}\n")
    tls_ports = sorted({443, lab.public_tls.port})
    text = text.replace(f"  connect: {tls_ports}", f"  connect: {sorted({*tls_ports, lab.public.port})}")
    policy = folder / "policy.yaml"
    policy.write_text(text)
    process = ProxyProcess(["--policy", str(policy), *TRANSPORTS[request.param]], folder / "audit.jsonl")
    process.transport = request.param
    yield process
    process.stop()
    assert not [e for e in process.outbound() if e["host"] != PUBLIC_IP], process.outbound()


@pytest.fixture(autouse=True)
def internal_saw_nothing(lab):
    before = len(lab.internal.connections) + len(lab.internal_tls.connections)
    yield
    assert len(lab.internal.connections) + len(lab.internal_tls.connections) == before, \
        "an internal stand-in received a connection"


def exchange(proxy: ProxyProcess, data: bytes, timeout: float = 5) -> bytes:
    with socket.create_connection((proxy.host, proxy.port), timeout=timeout) as sock:
        sock.sendall(data)
        return read_all(sock, timeout)


def read_all(sock: socket.socket, timeout: float = 5) -> bytes:
    sock.settimeout(timeout)
    got = b""
    with contextlib.suppress(TimeoutError, ConnectionResetError):
        while chunk := sock.recv(65536):
            got += chunk
    return got


def tunnel(proxy: ProxyProcess, authority: str) -> socket.socket:
    sock = socket.create_connection((proxy.host, proxy.port), timeout=5)
    sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(1)
        assert chunk, head
        head += chunk
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock


def seen_since(lab, before: int) -> list[str]:
    time.sleep(0.3)  # the origin's handler thread records the request
    return [path for _, path, _ in lab.public.requests[before:]]


def refusals(records: list[dict]) -> list[dict]:
    return [r for r in records if r["verdict"] == "refuse"]


# ---- a body on a GET: the origin reads it as a request egresswall never decided ------------------------

def _hidden(port: int) -> str:
    """A whole request for the path the deny rule refuses, in origin form (as it sits on the origin's
    connection once the outer request's head is read)."""
    return f"GET {DENIED_PATH}secret HTTP/1.1\r\nHost: public.lab.example:{port}\r\n\r\n"


def _with_body(method: str, target: str, host: str, framing: str, body: str, close: bool = True) -> bytes:
    framed = (f"Content-Length: {len(body)}\r\n\r\n{body}" if framing == "length"
              else f"Transfer-Encoding: chunked\r\n\r\n{len(body):x}\r\n{body}\r\n0\r\n\r\n")
    return (f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n" + ("Connection: close\r\n" if close else "")
            + framed).encode()


@pytest.mark.parametrize("method", ["GET", "HEAD"])
@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_a_get_or_head_with_a_body_is_refused_before_the_origin_can_read_a_request_in_it(lab, proxy, method,
                                                                                         framing):
    """CL.0 desync. The lab's origin (http.server) does not read a GET's body: before the fix it served
    the hidden GET /admin/secret — a path the deny rule refuses, with no record — as the next request."""
    port = lab.public.port
    authority = f"public.lab.example:{port}"
    audit = AuditWatch(proxy.log_path).mark()
    before = len(lab.public.requests)
    answer = exchange(proxy, _with_body(method, f"http://{authority}/ok-{framing}", authority, framing,
                                        _hidden(port)))
    status, headers, _ = parse_response(answer)
    assert status == 400, answer[:300]
    assert headers["x-egresswall-rule"] == "http:unexpected-body"
    assert seen_since(lab, before) == []  # neither the request nor the one hidden in its body
    records = audit.wait_for(lambda r: refusals(r))
    (refused,) = refusals(records)
    assert (refused["event"], refused["method"], refused["host"], refused["port"], refused["status"]) == (
        "decision", method, "public.lab.example", port, 400)
    assert refused["rule"] == "http:unexpected-body" and f"a {method} request carries a body" in refused["reason"]


def test_a_get_with_a_body_inside_a_tunnel_to_a_plain_http_port_is_refused_too(lab, proxy):
    port = lab.public.port
    authority = f"public.lab.example:{port}"
    before = len(lab.public.requests)
    with tunnel(proxy, authority) as sock:
        sock.sendall(_with_body("GET", "/in-tunnel", authority, "length", _hidden(port)))
        status, headers, _ = parse_response(read_all(sock))
    assert status == 400 and headers["x-egresswall-rule"] == "http:unexpected-body"
    assert seen_since(lab, before) == []


def test_a_get_with_an_empty_body_and_a_post_with_a_body_still_go_through(lab, proxy):
    port = lab.public.port
    authority = f"public.lab.example:{port}"
    before = len(lab.public.requests)
    empty = exchange(proxy, f"GET http://{authority}/empty HTTP/1.1\r\nHost: {authority}\r\nContent-Length: 0\r\n"
                            "Connection: close\r\n\r\n".encode())
    posted = exchange(proxy, _with_body("POST", f"http://{authority}/posted", authority, "chunked", "hello"))
    assert parse_response(empty)[0] == 200 and parse_response(posted)[2] == b"got 5 bytes"
    assert seen_since(lab, before) == ["/empty", "/posted"]


# ---- a path deny rule and empty segments --------------------------------------------------------------

@pytest.mark.parametrize("path", ["//admin/x", "///admin/x", "/;x/admin/x", "/%2F/admin/x", "/admin//x",
                                  "/a/..//admin/x"])
def test_a_path_deny_rule_holds_for_a_path_with_an_empty_segment(lab, proxy, path):
    """http.server answers GET //admin/x as /admin/x (it strips leading slashes), nginx merges slashes,
    Tomcat drops a segment of ';' parameters: before the fix the first three reached the origin past the
    deny rule for /admin/ (the others were refused already: an encoded slash, a dot segment, the prefix)."""
    port = lab.public.port
    audit = AuditWatch(proxy.log_path).mark()
    before = len(lab.public.requests)
    answer = exchange(proxy, f"GET http://public.lab.example:{port}{path} HTTP/1.1\r\nHost: public.lab.example:{port}"
                             "\r\nConnection: close\r\n\r\n".encode())
    status, headers, _ = parse_response(answer)
    assert status == 403, answer[:300]
    assert seen_since(lab, before) == []
    (refused,) = refusals(audit.wait_for(lambda r: refusals(r)))
    assert refused["stage"] == "host" and refused["path"] == path and "deny rule" in refused["reason"]


@pytest.mark.parametrize("path", ["//admin", "/a//b", "/a/b//", "//", "/;x/admin/", "/a/;/b"])
def test_a_path_with_an_empty_segment_has_no_canonical_form(path):
    assert canonical_path(path) is None


@pytest.mark.parametrize("path", ["/", "/docs/", "/docs/a;v=1", "/admin/;x"])
def test_a_trailing_slash_or_parameters_leave_a_path_canonical(path):
    assert canonical_path(path) == path


@given(st.text(alphabet="/a.%2EeFf;", max_size=16))
def test_a_canonical_path_never_has_an_empty_or_dot_segment(path):
    canonical = canonical_path("/" + path)
    if canonical is not None:
        segments = canonical.split("/")[1:]
        assert all(s.split(";", 1)[0] not in ("", ".", "..") for s in segments[:-1]), canonical
        assert segments[-1].split(";", 1)[0] not in (".", ".."), canonical


# ---- mitmproxy's internal listener --------------------------------------------------------------------

def _listening_ports(pid: int) -> set[int]:
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return {int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines() if f"pid={pid}," in line}


def test_the_proxy_listens_on_its_proxy_and_admin_ports_only(proxy):
    """mitmproxy's own listener (on 127.0.0.1) took connections beside the front's: a silent one was
    held for limits.idle_timeout, not limits.first_byte_timeout, and closed without a record. Every
    connection now comes through the front."""
    assert _listening_ports(proxy.process.pid) == {proxy.port, proxy.admin_port}
