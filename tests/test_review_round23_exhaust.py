"""Review round 23 (exhaust): one misbehaving client (or a slow audit-log reader) must not deny service to
other clients. These tests FAIL on the tree they were written against (see each docstring)."""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import stat
import threading
import time

import pytest
from audit_watch import open_fds
from proxyproc import TRANSPORTS, ProxyProcess, both_transports, parse_response, read_response

pytestmark = pytest.mark.integration


def _silent(source: str, count: int, host: str, port: int) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        sock = socket.socket()
        sock.bind((source, 0))
        sock.settimeout(5)
        sock.connect((host, port))
        socks.append(sock)
    return socks


def _timed_get(proxy: ProxyProcess, url: str, timeout: float) -> tuple[int, float, bytes]:
    host = url.split("/")[2]
    started = time.monotonic()
    try:
        with socket.create_connection((proxy.host, proxy.port), timeout=timeout) as sock:
            sock.sendall(f"GET {url} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            data = read_response(sock)
    except OSError:
        data = b""
    status, _, body = parse_response(data)
    return status, time.monotonic() - started, body


@both_transports
def test_silent_sockets_within_every_cap_do_not_exhaust_the_descriptors_others_need(lab, start_proxy):
    """README: "A connection over limits.max_connections_per_client (429) or limits.max_connections (503) is
    refused when it is accepted ...: one client's silent sockets hold at most its own share". That only holds
    if the process can hold limits.max_connections sockets (each allowed one also takes an upstream socket and
    two DNS sockets while it resolves). egresswall never looks at RLIMIT_NOFILE: a fresh Debian login shell
    (where `make run` runs) has a soft limit of 1024 and a hard limit far above, and the default caps
    (max_connections 2000, max_connections_per_client 256) let four clients' silent sockets, each under its own
    cap, take every descriptor. Then accept() fails with EMFILE (proxy/front.py _accept_loop backs off and
    retries, silently): a well-behaved client gets no answer at all, no 503 and no record, until
    first_byte_timeout frees the silent ones. Scaled down here (soft limit 160, per-client cap 50, three
    silent clients): the well-behaved client's GET must still be answered within a few seconds."""
    proxy = start_proxy(lab.policy_text(limits="limits:\n  max_connections_per_client: 50\n"))
    url = f"http://public.lab.example:{lab.public.port}/r23-fd-before"
    assert _timed_get(proxy, url, 5)[0] == 200
    _, hard = resource.prlimit(proxy.process.pid, resource.RLIMIT_NOFILE)
    resource.prlimit(proxy.process.pid, resource.RLIMIT_NOFILE, (160, hard))
    held: list[socket.socket] = []
    try:
        for source in ("127.0.23.5", "127.0.23.6", "127.0.23.7"):
            held += _silent(source, 50, proxy.host, proxy.port)
        time.sleep(0.5)
        status, took, body = _timed_get(proxy, url.replace("before", "during"), 4)
        fds = open_fds(proxy.process.pid)
    finally:
        for sock in held:
            sock.close()
    # Fixed (proxy/open_files.py): the total cap is never more than the open-file limit holds, so the client is
    # answered — 200 if there is room, else 503 limits.max_connections saying the limit is the open-file one —
    # and never left in silence. (`egresswall run` also raises the soft limit to the hard one at start.)
    assert (status == 200 or (status == 503 and b"limits.max_connections" in body and b"RLIMIT_NOFILE" in body)) \
        and took < 3, (f"a well-behaved client got status {status} after {took:.1f}s while three clients, each "
                       f"within limits.max_connections_per_client, held silent sockets (proxy at {fds} descriptors)")
    assert fds < 160


def test_a_stalled_audit_pipe_freezes_every_client_and_the_admin_listener(lab, tmp_path):
    """README, 'When the audit log cannot be written': egresswall "fails closed": a request is refused with 503
    rule `audit`, and /readyz answers 503. The audit log is standard output by default (`audit log standard
    output`), which in production is a pipe (journald, a log shipper, `| tee`). When that pipe's reader stalls
    the pipe fills and proxy/audit.py AuditLog.write blocks in os.write on the event loop's thread: every
    client, every tunnel already open and the admin listener stop, with no 503 and no /readyz answer, and a
    SIGTERM cannot drain (its handler needs the loop). A client must get an answer (a 503 `audit` refusal, or
    its page) within a few seconds, and /readyz an answer, while the log's reader is stalled."""
    fifo = tmp_path / "audit.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    proxy = None
    try:
        policy = tmp_path / "policy.yaml"
        policy.write_text(lab.policy_text())
        proxy = ProxyProcess(["--policy", str(policy), *TRANSPORTS["fast"]], fifo)
        assert stat.S_ISFIFO(os.stat(fifo).st_mode)
        url = f"http://public.lab.example:{lab.public.port}/r23-audit"
        # Fill the pipe (64 KiB by default) with ordinary traffic's records, then stop reading.
        for i in range(400):
            status, took, _ = _timed_get(proxy, f"{url}-{i}", 3)
            if status != 200:
                break
        status, took, _ = _timed_get(proxy, f"{url}-after", 4)
        ready_started = time.monotonic()
        try:
            with socket.create_connection((proxy.host, proxy.admin_port), timeout=3) as sock:
                sock.sendall(b"GET /readyz HTTP/1.0\r\n\r\n")
                ready = parse_response(read_response(sock))[0]
        except OSError:
            ready = 0
        ready_took = time.monotonic() - ready_started
    finally:
        def drain() -> None:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                try:
                    if not os.read(reader, 65536):
                        time.sleep(0.05)
                except BlockingIOError:
                    time.sleep(0.05)
                except OSError:
                    return
        drainer = threading.Thread(target=drain, daemon=True)
        drainer.start()
        if proxy is not None:
            proxy.stop()
        with contextlib.suppress(OSError):
            os.close(reader)
    assert status in (200, 503) and took < 3 and ready in (200, 503) and ready_took < 3, (
        f"with the audit pipe's reader stalled a client got status {status} after {took:.1f}s and /readyz "
        f"{ready} after {ready_took:.1f}s (0: no answer)")


# ---- a head whose Connection header names thousands of its headers ------------------------------------------

_NAMES = [b"x%d" % i for i in range(3000)]
# About 44 KB, under the default limits.max_header_bytes (65536): every header it names is present.
_NAMED_HEADERS = b"Connection: " + b",".join(_NAMES) + b"\r\n" + b"".join(n + b": 1\r\n" for n in _NAMES)


def _concurrent_heads_then_time_a_get(proxy: ProxyProcess, heads: list[bytes], url: str) -> tuple[int, float, bytes]:
    """Send each of ``heads`` on its own connection at once (not read until the end), then time one ordinary
    GET from another connection."""
    socks = [socket.create_connection((proxy.host, proxy.port), timeout=30) for _ in heads]
    try:
        for sock, head in zip(socks, heads, strict=True):
            sock.sendall(head)
        time.sleep(0.3)  # the proxy has the heads and is working on them
        answer = _timed_get(proxy, url, 15)
        for sock in socks:
            with contextlib.suppress(OSError):
                read_response(sock)
        return answer
    finally:
        for sock in socks:
            sock.close()


@both_transports
def test_a_request_whose_connection_header_names_thousands_of_headers_does_not_stall_others(lab, start_proxy):
    """A request head within limits.max_header_bytes whose Connection header names 3,000 headers it also
    carries: removing them (RFC 9110 7.6.1) is one pass over the headers on the fast path
    (proxy/fast_http.py _forwarded_request_headers), but on mitmproxy's path proxy/addons/hop_by_hop.py
    HopByHop.requestheaders calls headers.pop(name) once per name, and each pop scans and rebuilds mitmproxy's
    whole header tuple: quadratic, about 2 s of the event loop's CPU for one 44 KB head. Four such requests
    at once from one client hold every other client's request for seconds, so long that its DNS lookup
    (resolver.timeout) times out and it is refused 403 dns:timeout. README ('Bytes a client sends ...
    are bounded by limits.max_header_bytes'; one client cannot shut others out) : a well-behaved client's GET
    must be answered within 1.5 s."""
    proxy = start_proxy(lab.policy_text())
    port = lab.public.port
    head = (f"GET http://public.lab.example:{port}/r23-named HTTP/1.1\r\nHost: public.lab.example:{port}\r\n".encode()
            + _NAMED_HEADERS + b"\r\n")
    assert len(head) < 65536
    status, took, body = _concurrent_heads_then_time_a_get(proxy, [head] * 4,
                                                           f"http://public.lab.example:{port}/r23-meanwhile")
    assert status == 200 and took < 1.5, (
        f"an ordinary GET got {status} after {took:.2f}s behind four heads naming 3,000 hop-by-hop headers "
        f"(the event loop was held so long that its DNS lookup timed out: {body[:120]!r})")


@pytest.fixture
def naming_origin():
    from hostile import Scripted

    answer = b"HTTP/1.1 200 OK\r\n" + _NAMED_HEADERS + b"Content-Length: 2\r\n\r\nok"
    server = Scripted(answer)
    yield server
    server.close()


@both_transports
def test_a_response_whose_connection_header_names_thousands_of_headers_does_not_stall_others(
        lab, tmp_path, naming_origin, transport):
    """The same from a hostile origin: its response's Connection names 3,000 headers it carries (44 KB, under
    limits.max_header_bytes). proxy/addons/response_hygiene.py ResponseHygiene.responseheaders pops each
    name from mitmproxy's headers, quadratic as above; the fast path drops them in one pass
    (proxy/fast_http.py _forwarded_response_headers). Four such responses at once hold every other client's
    request for seconds; a well-behaved client's GET must be answered within 1.5 s."""
    from proxyproc import proxy_with_origins

    proxy = proxy_with_origins(lab, tmp_path, [naming_origin.port], transport, "")
    try:
        url = f"http://public.lab.example:{naming_origin.port}/r23-named-response"
        head = f"GET {url} HTTP/1.1\r\nHost: public.lab.example:{naming_origin.port}\r\n\r\n".encode()
        status, took, body = _concurrent_heads_then_time_a_get(
            proxy, [head] * 4, f"http://public.lab.example:{lab.public.port}/r23-meanwhile")
    finally:
        proxy.stop()
    assert status == 200 and took < 1.5, (
        f"an ordinary GET got {status} after {took:.2f}s behind four responses naming 3,000 headers: {body[:120]!r}")
