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
  could connect to it directly and skip the front's first-byte bound and its record;
* a tunnel whose connect failed was recorded with status 200 while its client got 502;
* a connection reset while the front handed it to mitmproxy kept its admission slot for good (mitmproxy
  read the peer's address after the reset): a client could lock itself, or with a few addresses everyone,
  out with 429/503;
* the ids of connections mitmproxy's idle watchdog closed were kept for the life of the proxy;
* on mitmproxy's path the sixth host behind one address (a CDN's) on a kept-alive connection hung until an
  old upstream connection idled out (mitmproxy's per-address bound met the pinned IP);
* on mitmproxy's path one kept-alive client connection held an upstream socket for every host name it
  asked for (until each idled out): a few such connections could take the process's file descriptors;
  and a pin for every host it asked for, until it closed;
* on the fast path a request body that came in a later write than its head (what browsers do) was read
  as cut short: a chunked one refused 400, a Content-Length one left without an answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import subprocess
import time

import pytest
from audit_watch import AuditWatch, decisions, open_fds, refusals
from dnslab import Record
from hypothesis import given
from hypothesis import strategies as st
from labnet import PUBLIC_IP, seen_since
from mitmproxy.test import tflow
from proxyproc import TRANSPORTS, ProxyProcess, both_transports, parse_response, read_response, serve_module_proxy
from rawclient import exchange, read_all, tunnel
from test_review_uvloop import SpeakFirstUpstream, _nothing_arrives, _open_tunnel, _policy, _recv_until
from tls_build import client_hello

from policy.model import Limits, canonical_path
from proxy import mitm_patches
from proxy.addons.connections import ConnectionTable
from proxy.addons.decision import DecisionAddon
from proxy.audit import AuditLog
from proxy.gate import Gate
from proxy.metrics import Metrics
from proxy.reload import PolicyHolder

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("internal_saw_nothing")]

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
    yield from serve_module_proxy(folder, text, request.param)


@pytest.fixture
def speaker():
    server = SpeakFirstUpstream()
    yield server
    server.close()











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
        status, headers, _ = parse_response(read_all(sock, 5))
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


# ---- the tunnel record of a connect that failed ------------------------------------------------------

def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind((PUBLIC_IP, 0))
        return probe.getsockname()[1]


@both_transports
def test_a_tunnel_whose_connect_failed_is_recorded_with_the_502_its_client_got(lab, start_proxy):
    """The client's CONNECT is answered 502 when the pinned address refuses the connection; the tunnel's
    record said status 200 (the audit schema: "what the client was answered") on both transports."""
    proxy = start_proxy(_policy(lab))
    audit = AuditWatch(proxy.log_path).mark()
    port = _closed_port()
    sock, status, _ = proxy.connect(f"public.lab.example:{port}")
    sock.close()
    assert status == 502
    records = audit.wait_for(lambda r: [x for x in r if x["event"] == "tunnel"])
    (closed,) = [r for r in records if r["event"] == "tunnel"]
    assert (closed["status"], closed["port"]) == (502, port) and closed["error"].startswith("connect failed: ")


@pytest.mark.parametrize("tunnels", ["--fast-tunnels", "--no-fast-tunnels"])
def test_a_tunnel_through_an_upstream_that_is_not_there_is_recorded_as_its_client_was_answered(lab, start_proxy,
                                                                                              tunnels):
    """The front asks the upstream before it answers (502); mitmproxy's upstream mode answers 200 and
    connects when the first message comes: each record says what its client got."""
    upstream = _closed_port()
    text = lab.policy_text(f"upstream:\n  proxy: http://{PUBLIC_IP}:{upstream}\n  resolution: upstream\n")
    proxy = start_proxy(text, tunnels)
    audit = AuditWatch(proxy.log_path).mark()
    sock, status, _ = proxy.connect(f"public.lab.example:{lab.public_tls.port}")
    with sock:
        if status == 200:
            sock.sendall(client_hello(b"public.lab.example"))
            read_all(sock, 3)
    assert status == (502 if tunnels == "--fast-tunnels" else 200)
    records = audit.wait_for(lambda r: [x for x in r if x["event"] == "tunnel"])
    (closed,) = [r for r in records if r["event"] == "tunnel"]
    assert closed["status"] == status and "connect failed" in closed["error"], closed


# ---- a connection handed to mitmproxy and reset at once --------------------------------------------------

def _open_connections(proxy: ProxyProcess) -> float:
    _, body = proxy.admin("/metrics")
    (line,) = [line for line in body.splitlines() if line.startswith("egresswall_open_connections ")]
    return float(line.split()[1])


@both_transports
def test_connections_reset_as_they_are_handed_to_mitmproxy_give_their_slots_back(lab, start_proxy):
    """A head the front hands to mitmproxy (Expect: the fast path does not take it), then a reset at once.
    mitmproxy read the peer's address after the reset (none), so its admission never matched the front's
    hand-over: the front's slot was never given back. 40 such connections held a client's cap of 8 for
    good, and every later request of that client was refused 429 (a few clients could hold the total)."""
    proxy = start_proxy(lab.policy_text(limits="limits:\n  max_connections_per_client: 8\n"))
    port = lab.public.port
    head = (f"POST http://public.lab.example:{port}/reset HTTP/1.1\r\nHost: public.lab.example:{port}\r\n"
            "Expect: 100-continue\r\nContent-Length: 5\r\n\r\n").encode()
    for attempt in range(40):
        with socket.create_connection((proxy.host, proxy.port)) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = reset
            sock.sendall(head)
            time.sleep(0.001 * (attempt % 8))  # the reset lands at every moment of the hand-over
    deadline = time.monotonic() + 10
    while _open_connections(proxy) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _open_connections(proxy) == 0
    status, _, body = proxy.get(f"http://public.lab.example:{port}/after")
    assert status == 200, body


# ---- what mitmproxy's idle closes leave behind -------------------------------------------------------------

def test_the_idle_closes_remembered_for_their_records_stay_bounded():
    """proxy/mitm_patches.py remembers which client connections mitmproxy's idle watchdog closed (so the
    record says "idle timeout", not "Client disconnected."). It kept every id for the life of the proxy:
    a client that lets connections idle out made the set grow without end. Now the recent ones only."""
    state = mitm_patches.PatchState(limits=Limits, on_refusal=lambda *a: None, on_body_over_limit=lambda *a: None)
    for number in range(20_000):
        state.idle_closed.add(f"connection-{number}")
    assert len(state.idle_closed) <= 4096
    assert "connection-19999" in state.idle_closed and "connection-0" not in state.idle_closed


# ---- many names behind one address ------------------------------------------------------------------

@both_transports
def test_a_kept_alive_client_reaches_a_sixth_host_behind_the_same_address(lab, start_proxy):
    """mitmproxy bounds a client connection's upstream connections per address, five, each held while it
    stays open; pinned to the checked IP, every host behind one address (a CDN's) shared that bound, and on
    mitmproxy's path the sixth host a kept-alive client asked for hung until an old upstream connection
    idled out (limits.idle_timeout). The bound is per name again (proxy/addons/pinning.py PinnedAddress)."""
    proxy = start_proxy(lab.policy_text(limits="limits:\n  idle_timeout: 30\n"))
    port = lab.public.port
    names = [f"cdn{i}.lab.example" for i in range(7)]
    for name in names:
        lab.dns.set(name, [Record("A", PUBLIC_IP)])
    answers = []
    with socket.create_connection((proxy.host, proxy.port), timeout=5) as sock:
        for name in names:
            sock.sendall(f"GET http://{name}:{port}/{name} HTTP/1.1\r\nHost: {name}:{port}\r\n\r\n".encode())
            answers.append(parse_response(read_response(sock))[0])
    assert answers == [200] * len(names)


@both_transports
def test_a_kept_alive_client_asking_for_many_hosts_holds_a_bounded_number_of_upstream_sockets(lab, start_proxy):
    """mitmproxy kept every upstream connection a client connection opened, one per name, until the
    upstream closed it or it idled out: 150 names on one client connection held 150 sockets (a few such
    connections, the process's file descriptors). Now at most four stay open on mitmproxy's path (the
    oldest, idle, are closed first; proxy/addons/upstream_pool.py); the fast path keeps one."""
    proxy = start_proxy(lab.policy_text())
    port = lab.public.port
    names = [f"many{i}.lab.example" for i in range(150)]
    for name in names:
        lab.dns.set(name, [Record("A", PUBLIC_IP)])
    before = open_fds(proxy.process.pid)
    with socket.create_connection((proxy.host, proxy.port), timeout=5) as sock:
        for name in names + names[:3]:  # and back to the first ones: connected again, decided again
            sock.sendall(f"GET http://{name}:{port}/{name} HTTP/1.1\r\nHost: {name}:{port}\r\n\r\n".encode())
            status, _, body = parse_response(read_response(sock))
            assert (status, body) == (200, f"hello from public /{name}".encode())
        held = open_fds(proxy.process.pid) - before
    assert held <= 1 + 4 + 1, held  # the client connection, the upstream ones, a socket closing
    assert "crashed" not in proxy.stderr


def test_a_kept_alive_client_asking_for_many_hosts_leaves_one_request_pin(tmp_path):
    """In process: every plain request's pin (the checked address its connect must use) was kept under
    (client connection, host, port) until the client connection closed, one per host it ever asked for;
    a long-lived connection walking a wildcard name grew the table without end. Its connect comes before
    the next request is read, so the latest one is all a client connection needs."""
    policy = tmp_path / "policy.yaml"
    policy.write_text("version: 1\ndefault: allow\naddresses:\n  allow: [198.18.0.0/15]\n")
    gate = Gate(PolicyHolder(str(policy)), AuditLog(str(tmp_path / "audit.jsonl")), Metrics())
    table = ConnectionTable()
    addon = DecisionAddon(gate, table)
    state = mitm_patches.PatchState(limits=lambda: gate.policy.limits, on_refusal=lambda *a: None,
                                    on_body_over_limit=lambda *a: None)
    mitm_patches.install(state)
    try:
        client = tflow.tflow().client_conn
        for number in range(300):
            flow = tflow.tflow(client_conn=client)
            flow.request.url = f"http://198.18.{number // 250}.{number % 250 + 1}/page"
            flow.request.headers.clear()
            flow.request.headers["Host"] = flow.request.host
            asyncio.run(addon.requestheaders(flow))
            assert flow.response is None, flow.response
            assert table.pin_for(client.id, flow.request.host, 80) == flow.request.host  # the one its connect uses
        assert len(table.pins) + len(table.request_pins) <= 1
    finally:
        mitm_patches.uninstall()


# ---- a body that comes after its head -------------------------------------------------------------------

@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_a_body_sent_after_its_head_in_a_later_write_is_read_and_forwarded(lab, proxy, framing):
    """What browsers and many clients do: the head in one write, the body a moment later. The fast path
    handed h11 the bytes after the head even when there were none, and h11 reads b"" as the client having
    closed: a chunked body was refused 400 (http:bad-chunked, "incomplete chunked read"), a Content-Length
    one got no answer at all."""
    port = lab.public.port
    before = len(lab.public.requests)
    request = _with_body("POST", f"http://public.lab.example:{port}/later-{framing}", f"public.lab.example:{port}",
                         framing, "hello, later")
    head, _, body = request.partition(b"\r\n\r\n")
    with socket.create_connection((proxy.host, proxy.port), timeout=5) as sock:
        sock.sendall(head + b"\r\n\r\n")
        time.sleep(0.3)  # the proxy has read the head alone
        sock.sendall(body)
        status, _, answer = parse_response(read_all(sock, 5))
    assert (status, answer) == (200, b"got 12 bytes")
    assert seen_since(lab, before) == [f"/later-{framing}"]


# ---- held: kept as regression tests (coverage no other test has) ------------------------------------------

def test_a_connect_inside_a_tunnel_to_a_plain_http_port_is_refused_once(lab, proxy):
    """mitmproxy parses the HTTP inside as a transparent proxy would, and a CONNECT there is refused (400),
    with its one record naming what it asked for; nothing is connected to."""
    port = lab.public.port
    audit = AuditWatch(proxy.log_path).mark()
    with tunnel(proxy, f"public.lab.example:{port}") as sock:
        sock.sendall(f"CONNECT internal.lab.example:{port} HTTP/1.1\r\nHost: internal.lab.example:{port}\r\n\r\n"
                     .encode())
        status, _, _ = parse_response(read_all(sock, 5))
    assert status == 400
    (refused,) = refusals(audit.wait_for(lambda r: refusals(r)))
    assert refused["rule"] == "http:invalid-request" and refused["url"] == f"internal.lab.example:{port}"


def test_an_http2_preface_to_the_proxy_port_is_refused_once(proxy):
    audit = AuditWatch(proxy.log_path).mark()
    answer = exchange(proxy, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
    assert parse_response(answer)[0] == 400
    records = audit.wait_for(lambda r: refusals(r))
    assert [r["rule"] for r in decisions(records)] == ["http:invalid-request"], records


def test_two_host_headers_on_an_absolute_form_request_are_refused_once(lab, proxy):
    port = lab.public.port
    audit = AuditWatch(proxy.log_path).mark()
    before = len(lab.public.requests)
    answer = exchange(proxy, f"GET http://public.lab.example:{port}/two-hosts HTTP/1.1\r\nHost: public.lab.example:"
                             f"{port}\r\nHost: internal.lab.example:{port}\r\nConnection: close\r\n\r\n".encode())
    assert parse_response(answer)[0] == 400  # RFC 9112 3.2 (it was 403, "does not agree", until round 21)
    assert seen_since(lab, before) == []
    assert [r["rule"] for r in refusals(audit.wait_for(lambda r: refusals(r)))] == ["form:host-header"]


INTERNAL_AUTHORITIES = {
    "loopback": ("127.0.0.3:{p}", 403, "special-purpose 127.0.0.0/8"),
    "mapped": ("[::ffff:127.0.0.3]:{p}", 403, "special-purpose 127.0.0.0/8"),
    "mapped-hex": ("[::ffff:7f00:3]:{p}", 403, "special-purpose 127.0.0.0/8"),
    "mapped-long": ("[0:0:0:0:0:ffff:7f00:3]:{p}", 403, "special-purpose 127.0.0.0/8"),
    "nat64": ("[64:ff9b::7f00:3]:{p}", 403, "special-purpose 64:ff9b::/96"),
    "6to4": ("[2002:7f00:3::1]:{p}", 403, "special-purpose 2002::/16"),
    "v4-compatible": ("[::127.0.0.3]:{p}", 403, "special-purpose ::/96"),
    "hex-integer": ("0x7f000003:{p}", 403, "form:numeric-ipv4"),
    "decimal-integer": ("2130706435:{p}", 403, "form:numeric-ipv4"),
    "zone-id": ("[fe80::1%25lo]:{p}", 403, "form:zone-id"),
    "cname-to-internal": ("alias.lab.example:{p}", 403, "cname:local-suffix"),
    "aaaa-mapped": ("mapped.lab.example:{p}", 403, "special-purpose 127.0.0.0/8"),
    "one-answer-internal": ("mixed.lab.example:{p}", 403, "special-purpose 127.0.0.0/8"),
    # mitmproxy's parser refuses these itself; the answer is the core's refusal (test_host_form_parity.py)
    "userinfo": ("public.lab.example:{p}@127.0.0.3", 403, "form:userinfo"),
    "signed-port": ("public.lab.example:+{p}", 403, "form:port"),
    "two-ports": ("public.lab.example:{p}:{p}", 403, "form:ipv6"),
    "nul": ("public.lab.example%00:{p}", 403, "form:percent"),
}


@pytest.mark.parametrize("case", list(INTERNAL_AUTHORITIES))
def test_a_connect_authority_spelling_an_internal_address_opens_no_tunnel(lab, proxy, case):
    form, status, rule = INTERNAL_AUTHORITIES[case]
    audit = AuditWatch(proxy.log_path).mark()
    authority = form.format(p=lab.public_tls.port)
    answer = exchange(proxy, f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode(), timeout=3)
    got, headers, _ = parse_response(answer)
    assert got == status, answer[:200]
    if status == 403:
        assert headers["x-egresswall-rule"] == rule
    assert [r["rule"] for r in refusals(audit.wait_for(lambda r: refusals(r)))] == [rule]


@both_transports
def test_no_byte_crosses_a_tunnel_before_a_slow_hello_is_judged_on_either_transport(lab, start_proxy, speaker):
    """test_review_uvloop.py holds this for the fast relay; mitmproxy's tunnel path (--no-fast-tunnels) holds
    the upstream's first bytes and the client's until the hello is whole too."""
    proxy = start_proxy(_policy(lab))
    hello = client_hello(b"public.lab.example")
    with _open_tunnel(proxy, speaker.port) as sock:
        for i in range(12):
            sock.sendall(hello[i:i + 1])
            time.sleep(0.03)
        assert _nothing_arrives(sock, 0.5) == b""
        assert bytes(speaker.received[0]) == b""
        sock.sendall(hello[12:])
        assert _recv_until(sock, hello) == SpeakFirstUpstream.BANNER + hello


@both_transports
def test_a_refused_hello_with_bytes_behind_it_sends_the_upstream_nothing_on_either_transport(lab, start_proxy,
                                                                                             speaker):
    proxy = start_proxy(_policy(lab))
    with _open_tunnel(proxy, speaker.port) as sock:
        sock.sendall(client_hello(b"other.lab.example") + b"SMUGGLED APPLICATION DATA" * 100)
        got = _recv_until(sock, b"never")
    assert got[:1] == b"\x15" and SpeakFirstUpstream.BANNER not in got
    assert speaker.ended_all(1, 5)
    assert bytes(speaker.received[0]) == b""


def test_a_chunked_body_over_the_limit_in_tiny_chunks_and_tiny_writes_gets_413_and_reaches_nothing(lab, proxy):
    """The body limit counts the body, however it is cut: 1001 one-byte chunks (the framing alone is five
    times the limit), sent a few bytes per write with the chunk lines split; 413, and the origin sees
    nothing of it."""
    port = lab.public.port
    audit = AuditWatch(proxy.log_path).mark()
    before = len(lab.public.requests)
    head = (f"POST http://public.lab.example:{port}/tiny HTTP/1.1\r\nHost: public.lab.example:{port}\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()
    body = b"1\r\nx\r\n" * (BODY_LIMIT + 1) + b"0\r\n\r\n"
    with socket.create_connection((proxy.host, proxy.port), timeout=5) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # each write its own segment
        sock.sendall(head)
        with contextlib.suppress(OSError):  # the 413 may come, and the connection close, before the end
            for start in range(0, len(body), 3):
                sock.sendall(body[start:start + 3])
        answer = read_all(sock, 5)
    assert parse_response(answer)[0] == 413, answer[:600]
    assert seen_since(lab, before) == []
    (refused,) = refusals(audit.wait_for(lambda r: refusals(r)))
    assert refused["rule"] == "limits.max_request_body" and refused["status"] == 413
