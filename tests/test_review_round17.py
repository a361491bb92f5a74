"""Review round 17: what the two transports still did differently, and what the helpers' reviews found."""

from __future__ import annotations

import contextlib
import socket
import time
import uuid

import pytest
from audit_watch import AuditWatch
from proxyproc import both_transports, parse_response, read_response
from test_review_round9 import SCRIPTS, Close, first_then_next, origins, responses, status_lines  # noqa: F401
from test_review_round9 import proxy as scripted_proxy  # noqa: F401 (a module-scoped fixture: both transports)

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("internal_saw_nothing")]

SCRIPTS.update({  # read by test_review_round9's module-scoped origins fixture, one origin each
    "version-1.2": [b"HTTP/1.2 200 OK\r\nContent-Length: 5\r\n\r\nhello"],
    "version-0.9": [b"HTTP/0.9 200 OK\r\nContent-Length: 5\r\n\r\nhello"],
    "version-1.0": [b"HTTP/1.0 200 OK\r\nContent-Length: 5\r\n\r\nhello"],
    "version-1.0-until-close": [b"HTTP/1.0 200 OK\r\n\r\nhello", 0.2, Close()],
})


@pytest.mark.parametrize("case", ["version-1.2", "version-0.9", "version-1.0", "version-1.0-until-close"])
def test_the_status_line_carries_the_proxys_own_http_version(scripted_proxy, origins, case):  # noqa: F811
    """mitmproxy's path wrote ``HTTP/1.2 200`` and ``HTTP/0.9 200`` to the client as the origin sent them, where
    the fast path answers in its own version, HTTP/1.1 (RFC 9110 6.2: an intermediary sends its own version in
    what it forwards). Both send HTTP/1.1 now, and the body arrives whole."""
    audit = AuditWatch(scripted_proxy.log_path).mark()
    raw = first_then_next(scripted_proxy, origins[case].port)
    assert raw.startswith(b"HTTP/1.1 200 OK\r\n"), raw
    head, _, body = raw.partition(b"\r\n\r\n")
    # a body read until the origin closed is re-framed by the fast path (chunked) and kept alive
    assert body.startswith((b"hello", b"5\r\nhello\r\n0\r\n\r\n")), raw
    assert b"HTTP/1.2" not in raw and b"HTTP/0.9" not in raw, raw
    for line in status_lines(raw):
        assert line.startswith(b"HTTP/1.1 200"), raw
    (record,) = responses(scripted_proxy, audit, 1)[:1]
    assert record["status"] == 200 and record["bytes_down"] == 5, record


# ---- a tunnel whose client sends nothing (the tunnel helper's review) ------------------------------------

def _silent_tunnel(proxy, authority: str, host_header: bool) -> float:
    """A CONNECT answered 200, then nothing from the client: how long until the proxy ended the tunnel."""
    with socket.create_connection((proxy.host, proxy.port), timeout=30) as sock:
        host = f"Host: {authority}\r\n" if host_header else ""
        sock.sendall(f"CONNECT {authority} HTTP/1.1\r\n{host}\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(1)
        assert head.startswith(b"HTTP/1.1 200"), head
        started = time.monotonic()
        with contextlib.suppress(OSError):
            sock.recv(100)  # the proxy's end of the tunnel
        return time.monotonic() - started


@pytest.mark.parametrize("transport, case", [("fast", "tls-port"), ("mitmproxy", "tls-port"),
                                             ("fast", "tls-port-no-host"), ("fast", "http-port")],
                         indirect=["transport"])
def test_a_silent_tunnel_ends_at_the_header_timeout_with_its_refusal(lab, start_proxy, transport, case):
    """mitmproxy asks for a tunnel's layer at the client's first byte only: a tunnel on its path (--no-fast-tunnels;
    and by default, a CONNECT to a port in ports.http, or an HTTP/1.1 CONNECT without Host, which the front hands
    over) whose client sent nothing stayed open until the idle timeout, and its line said the client had closed it.
    It ends at limits.header_timeout now, with that refusal, on every path."""
    port = lab.public.port if case == "http-port" else lab.public_tls.port
    connect = f"  connect: [443, {lab.public_tls.port}, {lab.public.port}]"
    text = lab.policy_text(limits="limits:\n  header_timeout: 2\n  idle_timeout: 15\n").replace(
        f"  connect: {sorted({443, lab.public_tls.port})}", connect)
    proxy = start_proxy(text)
    took = _silent_tunnel(proxy, f"public.lab.example:{port}", host_header=case != "tls-port-no-host")
    assert 1.5 < took < 6, f"the tunnel was held {took:.1f}s"
    time.sleep(0.3)
    refusals = [r for r in proxy.audit() if r.get("rule") == "limits.header_timeout"]
    assert len(refusals) == 1 and "nothing had come" in refusals[0]["reason"], proxy.audit()
    assert not [r for r in proxy.audit() if "client closed the tunnel" in (r.get("error") or "")], proxy.audit()


# ---- request lines of other HTTP versions (the tunnel helper's review) -----------------------------------

def _refused_for_its_version(running, raw: socket.socket, path: str, version: str) -> None:
    status, headers, _ = parse_response(read_response(raw))
    assert status == 505 and headers["x-egresswall-rule"] == "http:version", headers
    assert f"'HTTP/{version}'" in headers["x-egresswall-reason"], headers
    time.sleep(0.2)
    (record,) = [r for r in running.decisions() if r["verdict"] == "refuse"]
    assert (record["rule"], record["status"]) == ("http:version", 505), record


@both_transports
@pytest.mark.parametrize("version", ["1.2", "2.0", "1.9"])
def test_a_request_line_of_another_http_version_is_refused(lab, start_proxy, version):
    """mitmproxy reads any HTTP/d.d request line: 'HTTP/1.2' without a Host reached the origin without one (the Host
    round 16 adds is for HTTP/1.0 and 1.1), so a name-based virtual host served its default site. The fast path hands
    such lines to mitmproxy's path, which now answers 505 (rule http:version) and forwards nothing."""
    running = start_proxy(lab.policy_text())
    authority, path = f"public.lab.example:{lab.public.port}", f"/version-{uuid.uuid4().hex}"
    with socket.create_connection((running.host, running.port), timeout=10) as sock:
        sock.sendall(f"GET http://{authority}{path} HTTP/{version}\r\n\r\n".encode())
        _refused_for_its_version(running, sock, path, version)
    assert path not in [seen for _, seen, _ in lab.public.requests]


@both_transports
@pytest.mark.parametrize("version", ["1.2", "2.0"])
def test_a_request_of_another_http_version_inside_a_tunnel_is_refused(lab, start_proxy, version):
    """The same inside a tunnel to a plain-HTTP port, after a first request: 'GET /x HTTP/2.0' without a Host was
    rewritten to HTTP/1.1 and sent without one."""
    running = start_proxy(lab.policy_text().replace(f"  connect: {sorted({443, lab.public_tls.port})}",
                                                    f"  connect: [443, {lab.public.port}]"))
    authority, path = f"public.lab.example:{lab.public.port}", f"/version-{uuid.uuid4().hex}"
    with socket.create_connection((running.host, running.port), timeout=10) as sock:
        sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(1)
        assert head.startswith(b"HTTP/1.1 200"), head
        sock.sendall(f"GET /first HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        sock.sendall(f"GET {path} HTTP/{version}\r\n\r\n".encode())
        _refused_for_its_version(running, sock, path, version)
    assert path not in [seen for _, seen, _ in lab.public.requests]


@both_transports
def test_an_idle_timeout_under_a_second_still_lets_requests_through(lab, start_proxy):
    """mitmproxy's timeout counts whole seconds and was given int(limits.idle_timeout): 0.5 made it 0, and mitmproxy's
    path closed every connection it carried at once, unanswered. It is rounded up now."""
    running = start_proxy(lab.policy_text(limits="limits:\n  idle_timeout: 0.5\n"))
    authority = f"public.lab.example:{lab.public.port}"
    with socket.create_connection((running.host, running.port), timeout=10) as sock:
        sock.sendall(f"GET http://{authority}/frac HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n".encode())
        assert read_response(sock).startswith(b"HTTP/1.1 200")
