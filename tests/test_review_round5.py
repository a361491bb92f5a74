"""Adversarial review of the proxy layer, round 5: attacks through the real proxy, on both transports (the
fast front with its plain-HTTP path, and mitmproxy's path: ``proxyproc.TRANSPORTS``). Rounds 1-4 are in
test_hardening_*.py, test_review_fast_http.py, test_review_uvloop.py and test_review_round4.py; what they
hold is not repeated here.

Defects found and fixed:

* a path deny rule was passed by a ``;`` parameter inside a segment: ``/admin;x/secret`` (or
  ``/api/x/delete;y`` for a glob) reached the origin, and Tomcat, Jetty and Spring drop path parameters
  and serve ``/admin/secret``. A deny rule now matches the path with or without its parameters, an allow
  rule only when both readings match (policy/model.py ``HostRule.path_matches``);
* on mitmproxy's path an origin's interim response (``100 Continue``, ``103 Early Hints``) was taken as
  the final one: the client got ``100 Continue`` as the answer to its GET, the record said status 100, and
  the real response was thrown away. Interim heads are now dropped as the fast path drops them, and the
  final head is due within limits.header_timeout of the first (a flood of 1xx gets 502 on both paths);
* an HTTP/2 connection preface as the first message of a tunnel to a plain-HTTP port passed the tunnel's
  first-message check (h11 reads ``PRI * HTTP/2.0`` as a request head): mitmproxy then decided and allowed
  a request ``PRI *``. Only HTTP/1.0 and 1.1 heads may start such a tunnel (``http:not-http``);
* a ClientHello in thousands of one-byte TLS records, written a few bytes at a time, cost about a minute
  of the event loop per connection (both transports judge the bytes again on every read, and mitmproxy's
  reassembly walked and copied every record each time). More than 256 records is refused
  (``tls:hello-records``), judged on the record headers alone;
* ``OPTIONS *`` was refused with the reason "port: the port is not decimal"; now ``form:asterisk``, with a
  reason that names the asterisk form.
* the front searched a request head's whole buffer for its end after every read: a 64 KiB head written a
  byte at a time cost seconds of the event loop per connection; each byte is searched once now;
* the admin listener registered only its first socket as egresswall's own, though ``--admin NAME:PORT``
  binds every address the name resolves to (``localhost``: 127.0.0.1 and ::1 on most systems): a name
  resolving to the other one, under a policy that re-admits it, reached the admin port through the proxy.

* a request hidden in the body of a DELETE or OPTIONS reached an origin that does not read such bodies
  (CL.0 as round 4 fixed it for GET, HEAD and TRACE). Such a body is now refused (400
  ``http:unexpected-body``) unless the policy lists the method in ``http.body_allowed_on``
  (test_request_bodies.py).

Held (kept as regression tests where no other test covers the case): CONNECT to an IP literal with the
SNI of an allowed name, the bytes an origin sends after a HEAD response, a denied request pipelined
between allowed ones, Proxy-Authorization inside a tunnel to a plain-HTTP port, a WebSocket upgrade to a
denied path (absolute form and inside a tunnel), ``Connection`` naming Host or Content-Length, and CONNECT
request lines that are not an authority.
"""

from __future__ import annotations

import asyncio
import re
import socket
import time

import pytest
from audit_watch import AuditWatch, refusals
from hostile import Scripted, _Server
from labnet import PUBLIC_IP, seen_since
from proxyproc import TRANSPORTS, parse_response, serve_module_proxy
from rawclient import exchange, read_all, tunnel
from tls_build import client_hello

from policy.model import HostRule, Limits, without_parameters
from proxy import head_end, head_reader
from proxy.admin import AdminServer
from proxy.first_bytes import classify_tunnel_start
from proxy.tls_hello import MAX_HELLO_RECORDS

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("internal_saw_nothing")]

HEADER_TIMEOUT, IDLE_TIMEOUT = 2, 6


class InterimFlood(_Server):
    """Answers with ``100 Continue`` heads, one every ``interval`` seconds, and never a final response."""

    def __init__(self, interval: float = 0.3, max_seconds: float = 30) -> None:
        self.interval, self.max_seconds = interval, max_seconds
        self.ended: list[float] = []
        super().__init__()

    def handle(self, conn: socket.socket, head: bytes) -> None:
        deadline = time.monotonic() + self.max_seconds
        while not self.closed.is_set() and time.monotonic() < deadline:
            try:
                conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            except OSError:
                self.ended.append(time.monotonic())
                return
            time.sleep(self.interval)


class IgnoresBodies(_Server):
    """An origin that answers every request head at once and never reads a body (what many frameworks do
    for a method whose body they do not expect, e.g. DELETE, OPTIONS, or any 404): whatever follows a head is
    read as the next request. ``lines`` are the request lines it served."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        super().__init__()

    def handle(self, conn: socket.socket, head: bytes) -> None:
        data = head
        while not self.closed.is_set():
            while b"\r\n\r\n" in data:
                one, data = data.split(b"\r\n\r\n", 1)
                self.lines.append(one.split(b"\r\n", 1)[0].decode("latin-1"))
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            chunk = conn.recv(65536)
            if not chunk:
                return
            data += chunk


ANSWERS = {
    "continue": b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfinal",
    "early-hints": b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"
                   b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfinal",
    "two-interim": b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 102 Processing\r\n\r\n"
                   b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfinal",
    # 60 bytes after a HEAD response: a second response in disguise if anyone read them as the next one
    "head-body": b"HTTP/1.1 200 OK\r\nContent-Length: 60\r\n\r\n"
                 b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\nX-Smuggled: 1\r\n\r\nsmuggle" + b"x" * 8,
}


@pytest.fixture(scope="module")
def origins():
    servers: dict[str, _Server] = {name: Scripted(answer) for name, answer in ANSWERS.items()}
    servers["flood"] = InterimFlood()
    servers["ignores-bodies"] = IgnoresBodies()
    yield servers
    for server in servers.values():
        server.close()


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def proxy(lab, origins, tmp_path_factory, request):
    """Default allow; deny rules for public.lab.example's /admin/ and /api/*/delete; every port above 1023
    open to plain HTTP and CONNECT (a tunnel to a plain-HTTP port carries HTTP, decided request by request)."""
    folder = tmp_path_factory.mktemp("round5")
    text = lab.policy_text("hosts:\n  deny:\n    - host: public.lab.example\n      paths: [/admin/, '/api/*/delete']\n",
                           limits=f"limits:\n  header_timeout: {HEADER_TIMEOUT}\n  first_byte_timeout: 2\n"
                                  f"  idle_timeout: {IDLE_TIMEOUT}\n  max_request_body: 1000\n")
    text = text.replace(f"  http: {sorted({80, lab.public.port})}", "  http: [80, '1024-65535']")
    text = text.replace(f"  connect: {sorted({443, lab.public_tls.port})}", "  connect: [443, '1024-65535']")
    yield from serve_module_proxy(folder, text, request.param)








def get(authority: str, path: str, extra: str = "", close: bool = True) -> str:
    return (f"GET http://{authority}{path} HTTP/1.1\r\nHost: {authority}\r\n{extra}"
            + ("Connection: close\r\n" if close else "") + "\r\n")


def statuses(raw: bytes) -> list[int]:
    """The status of every status line in ``raw`` (the bodies these tests get hold none)."""
    return [int(status) for status in re.findall(rb"HTTP/1\.[01] ([0-9]{3}) ", raw)]


# ---- a ';' parameter inside a path segment -----------------------------------------------------------

@pytest.mark.parametrize("path", ["/admin;x/secret", "/admin;jsessionid=0123/secret", "/api/x/delete;y",
                                  "/api;v=1/x/delete"])
def test_a_path_parameter_does_not_slip_past_a_path_deny_rule(lab, proxy, path):
    """Tomcat, Jetty and Spring drop each segment's ';' parameters: /admin;x/secret is /admin/secret to
    them. Before the fix the deny rule for /admin/ (and the glob /api/*/delete) did not match, and the
    request reached the origin with a record that allowed it."""
    authority = f"public.lab.example:{lab.public.port}"
    audit = AuditWatch(proxy.log_path).mark()
    before = len(lab.public.requests)
    status, headers, _ = parse_response(exchange(proxy, get(authority, path).encode()))
    assert status == 403, headers
    assert seen_since(lab, before) == []
    (refused,) = refusals(audit.wait_for(lambda r: refusals(r)))
    assert refused["stage"] == "host" and refused["path"] == path and "deny rule" in refused["reason"]


@pytest.mark.parametrize("path", ["/docs;v=1/page", "/docs/a;v=1", "/admin-tools;x/"])
def test_a_path_parameter_outside_a_denied_path_still_goes_through(lab, proxy, path):
    authority = f"public.lab.example:{lab.public.port}"
    before = len(lab.public.requests)
    status, _, _ = parse_response(exchange(proxy, get(authority, path).encode()))
    assert status == 200
    assert seen_since(lab, before) == [path]


def _rule(action: str, paths: tuple[str, ...]) -> HostRule:
    return HostRule.plain(action, None, None, "")._replace(paths=paths)


@pytest.mark.parametrize(("path", "deny", "allow"), [
    ("/admin;x/secret", True, False),  # a server that drops parameters serves /admin/secret
    ("/admin/;x", True, True),  # /admin/ either way
    ("/docs;v=1/page", False, False),  # /docs/page to some servers, /docs;v=1/page to others
    ("/admin/a;v=1", True, True),
    ("/other;admin/", False, False),
])
def test_a_deny_rule_matches_either_reading_of_path_parameters_and_an_allow_rule_both(path, deny, allow):
    assert _rule("deny", ("/admin/",)).path_matches(path) is deny
    assert _rule("allow", ("/admin/",)).path_matches(path) is allow


@pytest.mark.parametrize(("path", "stripped"), [("/a;x/b;y", "/a/b"), ("/a/b", "/a/b"), ("/;x/", "//"),
                                                ("/a;/b", "/a/b")])
def test_without_parameters_drops_every_segments_parameters(path, stripped):
    assert without_parameters(path) == stripped


# ---- an origin's interim (1xx) responses ---------------------------------------------------------------

@pytest.mark.parametrize("answer", ["continue", "early-hints", "two-interim"])
def test_an_origins_interim_response_is_not_the_answer(lab, proxy, origins, answer):
    """mitmproxy read an origin's 100 Continue or 103 Early Hints as the final response: the client was
    answered "HTTP/1.1 100 Continue" to a GET (and to the next GET on the connection too), the record
    said status 100 and the origin's real response was dropped as unexpected data. The fast path drops
    interim responses; now mitmproxy's path does the same."""
    port = origins[answer].port
    authority = f"public.lab.example:{port}"
    audit = AuditWatch(proxy.log_path).mark()
    with socket.create_connection((proxy.host, proxy.port), timeout=5) as sock:
        sock.sendall(get(authority, "/first", close=False).encode())
        time.sleep(0.5)  # the first answer is back before the second request
        sock.sendall(get(authority, "/second").encode())
        raw = read_all(sock, 5)
    assert statuses(raw) == [200, 200], raw[:400]
    assert raw.count(b"final") == 2
    records = audit.wait_for(lambda r: len([x for x in r if x["event"] == "response"]) == 2)
    assert [r["status"] for r in records if r["event"] == "response"] == [200, 200]


def test_a_flood_of_interim_responses_is_cut_off_at_the_header_timeout(lab, proxy, origins):
    """An origin that sends 100 Continue every 0.3 s and never a final response: on both paths the client
    gets 502 once limits.header_timeout has passed since the first one (before the fix, mitmproxy's path
    passed the first 100 on as the answer)."""
    authority = f"public.lab.example:{origins['flood'].port}"
    started = time.monotonic()
    raw = exchange(proxy, get(authority, "/flood").encode(), timeout=IDLE_TIMEOUT + 4)
    took = time.monotonic() - started
    assert statuses(raw) == [502], raw[:400]
    assert took < HEADER_TIMEOUT + 2.5, took
    assert b"header_timeout" in raw


# ---- an HTTP/2 preface inside a tunnel to a plain-HTTP port ---------------------------------------------

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
H2_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def test_an_http2_preface_inside_a_tunnel_to_a_plain_http_port_is_refused_once(lab, proxy, origins):
    """Straight to the proxy port the preface is refused (test_review_round4.py). Inside a CONNECT to a
    plain-HTTP port the tunnel's first-message check took "PRI * HTTP/2.0" for an HTTP/1 request head:
    mitmproxy then decided and allowed a request with method PRI and path "*", and sent its head to the
    origin (where an h2c server would read the start of an HTTP/2 connection). Only HTTP/1.0 and 1.1
    heads may start such a tunnel now."""
    origin = origins["continue"]
    authority = f"public.lab.example:{origin.port}"
    heads = len(origin.heads)
    audit = AuditWatch(proxy.log_path).mark()
    with tunnel(proxy, authority) as sock:
        sock.sendall(H2_PREFACE + H2_SETTINGS)
        read_all(sock, 3)
    time.sleep(0.3)
    assert origin.heads[heads:] == []
    records = audit.wait_for(lambda r: refusals(r) and [x for x in r if x["event"] == "tunnel"])
    assert [r for r in records if r["event"] == "decision" and r["verdict"] == "allow" and r["method"] != "CONNECT"] \
        == []
    (refused,) = refusals(records)
    assert refused["rule"] == "http:not-http" and "HTTP/2" in refused["reason"]


# ---- a body on a method an origin may not read it for ------------------------------------------------

@pytest.mark.parametrize("method", ["DELETE", "OPTIONS"])
def test_a_request_hidden_in_a_body_the_origin_does_not_read_never_reaches_it(lab, proxy, origins, method):
    """Before the fix the origin served the GET /admin/secret hidden in the body (a path the deny rule refuses,
    with no record). Now refused 400 unless the policy lists the method in http.body_allowed_on
    (test_request_bodies.py)."""
    origin = origins["ignores-bodies"]
    authority = f"public.lab.example:{origin.port}"
    hidden = f"GET /admin/secret HTTP/1.1\r\nHost: {authority}\r\n\r\n"
    served = len(origin.lines)
    exchange(proxy, (f"{method} http://{authority}/item HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n"
                     f"Content-Length: {len(hidden)}\r\n\r\n{hidden}").encode(), timeout=3)
    time.sleep(0.3)
    assert "GET /admin/secret HTTP/1.1" not in origin.lines[served:], origin.lines[served:]
    assert origin.lines[served:] == []  # nor the request carrying it


# ---- the asterisk form ---------------------------------------------------------------------------------

def test_an_asterisk_form_request_is_refused_with_a_reason_that_names_it(lab, proxy):
    """OPTIONS * was refused with "port: the port is not decimal" (the '*' was read glued to the Host
    header's port), a reason that sends a reader after the wrong thing."""
    authority = f"public.lab.example:{lab.public.port}"
    audit = AuditWatch(proxy.log_path).mark()
    before = len(lab.public.requests)
    status, headers, _ = parse_response(exchange(proxy, f"OPTIONS * HTTP/1.1\r\nHost: {authority}\r\n"
                                                        "Connection: close\r\n\r\n".encode()))
    assert status == 403 and headers["x-egresswall-rule"] == "form:asterisk"
    assert seen_since(lab, before) == []
    (refused,) = refusals(audit.wait_for(lambda r: refusals(r)))
    assert refused["rule"] == "form:asterisk" and "asterisk form" in refused["reason"]


# ---- a ClientHello in many tiny records ------------------------------------------------------------------

def _tiny_records(total: int = 32_000) -> bytes:
    """Handshake records of one byte each, of a ClientHello that says it is 16 MiB: never whole."""
    payload = b"\x01\xff\xff\xff\x03\x03" + b"\x00" * (total // 6)
    return b"".join(b"\x16\x03\x01\x00\x01" + payload[i:i + 1] for i in range(len(payload)))[:total]


def test_judging_a_hello_in_one_byte_records_again_and_again_stays_cheap():
    """The transports judge a tunnel's first bytes again on every read until the hello is whole, and
    mitmproxy's reassembly walked and copied every record each time: 30 ms a read for 32 KiB of one-byte
    records, so one client writing a few bytes at a time held the event loop for about a minute (every
    other client waiting). Now a hello in more than 256 records is refused, after reading 256 headers."""
    data = _tiny_records()
    started = time.perf_counter()
    for end in range(len(data) - 200 * 6, len(data), 6):
        judged = classify_tunnel_start(data[:end], "public.lab.example", http_inside=False, ech_allowed=True)
        assert judged.refused and judged.rule == "tls:hello-records", judged
    assert time.perf_counter() - started < 1.0  # was about 6 s


def test_a_hello_in_up_to_256_records_is_still_read():
    """The lab's hello is 82 bytes of handshake, 82 records of one byte; padded to 300 bytes, 300 records."""
    small = client_hello(b"public.lab.example", record_size=1)
    padded = client_hello(b"public.lab.example", extra=(b"\x00\x15\x00\xda" + bytes(218),), record_size=1)
    assert small.count(b"\x16\x03\x01\x00\x01") <= MAX_HELLO_RECORDS < padded.count(b"\x16\x03\x01\x00\x01")
    judged = classify_tunnel_start(small, "public.lab.example", http_inside=False, ech_allowed=True)
    assert (judged.refused, judged.sni) == (False, "public.lab.example")
    judged = classify_tunnel_start(padded, "public.lab.example", http_inside=False, ech_allowed=True)
    assert judged.refused and judged.rule == "tls:hello-records"


def test_a_hello_in_too_many_records_is_refused_at_once_through_the_proxy(lab, proxy):
    audit = AuditWatch(proxy.log_path).mark()
    sock, status, _ = proxy.connect(f"public.lab.example:{lab.public_tls.port}")
    with sock:
        assert status == 200
        started = time.monotonic()
        sock.sendall(_tiny_records(2000))
        answer = read_all(sock, HEADER_TIMEOUT + 3)
        took = time.monotonic() - started
    assert answer[:1] == b"\x15" and took < HEADER_TIMEOUT, (answer, took)  # not the header timeout's close
    (refused,) = refusals(audit.wait_for(lambda r: refusals(r)))
    assert refused["rule"] == "tls:hello-records" and "256 TLS records" in refused["reason"]


# ---- a request head that arrives a few bytes at a time --------------------------------------------------

class CountingSearch:
    """HEAD_END with the bytes each search looks at counted (the real regex does the searching)."""

    def __init__(self, pattern: re.Pattern[bytes]) -> None:
        self.pattern, self.scanned, self.calls = pattern, 0, 0

    def search(self, data: bytes, pos: int = 0) -> re.Match[bytes] | None:
        self.calls += 1
        self.scanned += len(data) - pos
        return self.pattern.search(data, pos)


def test_a_head_written_a_byte_at_a_time_is_searched_once_not_once_per_read(monkeypatch):
    """The front searched the whole buffer for the head's end after every read: a 64 KiB head written a
    byte at a time cost seconds of the event loop per connection (every other client waiting). Each
    byte is searched once now (bar the two before each read's end)."""
    counting = CountingSearch(head_end.HEAD_END)
    monkeypatch.setattr(head_end, "HEAD_END", counting)
    head = (b"GET http://public.lab.example/ HTTP/1.1\r\nHost: public.lab.example\r\nX-Long: " + b"a" * 8000
            + b"\r\n\r\n")

    async def drip() -> bytes:
        reader, writer = socket.socketpair()
        reader.setblocking(False)
        writer.setblocking(False)

        async def write() -> None:
            for i in range(len(head)):
                writer.send(head[i:i + 1])
                await asyncio.sleep(0)

        task = asyncio.get_running_loop().create_task(write())
        try:
            got, _ = await head_reader.read_head(reader, Limits(header_timeout=20, max_header_bytes=65536))
        finally:
            await task
            reader.close()
            writer.close()
        return got

    assert asyncio.run(drip()) == head
    assert counting.calls > 100  # it did come in many reads
    assert counting.scanned <= 3 * len(head), (counting.scanned, counting.calls)


# ---- the admin listener on more than one address ----------------------------------------------------------

def test_the_admin_listener_names_every_address_it_listens_on():
    """``--admin localhost:3131`` binds every address the name resolves to (127.0.0.1 and ::1 on most
    systems; this machine's /etc/hosts has only 127.0.0.1, so the run itself cannot show it), but only the
    first socket's address was registered as egresswall's own: a name resolving to ::1, under a policy that
    re-admits ::1, reached the admin port through the proxy. Every socket's address is registered now
    (proxy/runner.py, and the supervisor's for its workers)."""

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    async def listen() -> tuple[tuple[str, int], list[tuple[str, int]]]:
        server = AdminServer({"/healthz": lambda: (200, "text/plain", "ok\n")})
        first = await server.start(["127.0.0.1", "::1"], port)  # what a name with two addresses binds
        try:
            return first, server.addresses
        finally:
            await server.stop()

    first, addresses = asyncio.run(listen())
    assert first in addresses and sorted(addresses) == [("127.0.0.1", port), ("::1", port)]


# ---- held: regression tests --------------------------------------------------------------------------------

def test_a_connect_to_an_ip_literal_with_the_sni_of_an_allowed_name_is_refused(lab, proxy):
    """The address is allowed (the lab's public one), but the hello names a host: a tunnel to an IP that
    says it is some name is refused, so SNI-based routing at the far end cannot be steered."""
    audit = AuditWatch(proxy.log_path).mark()
    sock, status, _ = proxy.connect(f"{PUBLIC_IP}:{lab.public_tls.port}")
    with sock:
        assert status == 200
        sock.sendall(client_hello(b"public.lab.example"))
        answer = read_all(sock, 5)
    assert answer[:1] == b"\x15"  # a TLS alert, no ServerHello
    (refused,) = refusals(audit.wait_for(lambda r: refusals(r)))
    assert refused["rule"] == "tls:sni" and "127.0.0.2" in refused["reason"]


def test_bytes_an_origin_sends_after_a_head_response_never_become_the_next_answer(lab, proxy, origins):
    """The origin writes 60 bytes after its HEAD response, shaped like a response. Whoever reads them as
    the answer to the next request on the connection has been handed a response the origin never sent
    to it; both paths drop them and ask again on a fresh upstream connection."""
    authority = f"public.lab.example:{origins['head-body'].port}"
    with socket.create_connection((proxy.host, proxy.port), timeout=5) as sock:
        sock.sendall(f"HEAD http://{authority}/h HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        time.sleep(0.5)
        sock.sendall(get(authority, "/g").encode())
        raw = read_all(sock, 5)
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert statuses(head) == [200] and b"content-length: 60" in head.lower()
    second_head, _, second_body = rest.partition(b"\r\n\r\n")
    assert statuses(second_head) == [200] and b"x-smuggled" not in second_head.lower()
    assert len(second_body) == 60 and second_body.startswith(b"HTTP/1.1 200 OK")  # the GET's own body


def test_a_denied_request_pipelined_between_allowed_ones_is_refused_and_ends_the_connection(lab, proxy):
    authority = f"public.lab.example:{lab.public.port}"
    audit = AuditWatch(proxy.log_path).mark()
    before = len(lab.public.requests)
    raw = exchange(proxy, (get(authority, "/one", close=False) + get(authority, "/admin/two", close=False)
                           + get(authority, "/three")).encode())
    assert statuses(raw) == [200, 403], raw[:600]
    assert seen_since(lab, before) == ["/one"]
    (refused,) = refusals(audit.wait_for(lambda r: refusals(r)))
    assert refused["path"] == "/admin/two"


def test_inside_a_tunnel_to_a_plain_http_port_credentials_stay_and_a_denied_path_is_refused(lab, proxy):
    authority = f"public.lab.example:{lab.public.port}"
    audit = AuditWatch(proxy.log_path).mark()
    before = len(lab.public.requests)
    with tunnel(proxy, authority) as sock:
        sock.sendall((f"GET /in-one HTTP/1.1\r\nHost: {authority}\r\nProxy-Authorization: Basic c2VjcmV0\r\n"
                      f"Proxy-Connection: keep-alive\r\n\r\nGET /admin/in-two HTTP/1.1\r\nHost: {authority}\r\n\r\n")
                     .encode())
        raw = read_all(sock, 5)
    assert statuses(raw) == [200, 403], raw[:600]
    time.sleep(0.3)
    ((path, headers),) = [(p, h) for _, p, h in lab.public.requests[before:]]
    assert path == "/in-one"
    assert not {k.lower() for k in headers} & {"proxy-authorization", "proxy-connection"}, headers
    (refused,) = refusals(audit.wait_for(lambda r: refusals(r)))
    assert refused["path"] == "/admin/in-two"


WEBSOCKET = ("Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
             "Sec-WebSocket-Version: 13\r\n")


@pytest.mark.parametrize("where", ["absolute-form", "in-a-tunnel"])
def test_a_websocket_upgrade_to_a_denied_path_is_refused(lab, proxy, where):
    authority = f"public.lab.example:{lab.public.port}"
    audit = AuditWatch(proxy.log_path).mark()
    before = len(lab.public.requests)
    if where == "absolute-form":
        raw = exchange(proxy, get(authority, "/admin/ws", WEBSOCKET, close=False).encode())
    else:
        with tunnel(proxy, authority) as sock:
            sock.sendall(f"GET /admin/ws HTTP/1.1\r\nHost: {authority}\r\n{WEBSOCKET}\r\n".encode())
            raw = read_all(sock, 5)
    assert statuses(raw) == [403], raw[:300]
    assert seen_since(lab, before) == []
    (refused,) = refusals(audit.wait_for(lambda r: refusals(r)))
    assert refused["path"] == "/admin/ws" and "deny rule" in refused["reason"]


def test_connection_naming_host_or_content_length_strips_neither(lab, proxy):
    """RFC 9110 7.6.1 lets a client name any header in Connection; naming the framing or Host must not make
    the proxy drop them (an origin without Host picks its default site; a body without its length becomes
    the next request)."""
    authority = f"public.lab.example:{lab.public.port}"
    before = len(lab.public.requests)
    raw = exchange(proxy, (f"POST http://{authority}/named HTTP/1.1\r\nHost: {authority}\r\n"
                           "Connection: host, content-length, close\r\nContent-Length: 5\r\n\r\nhello").encode())
    status, _, body = parse_response(raw)
    assert (status, body) == (200, b"got 5 bytes")
    time.sleep(0.3)
    ((_, path, headers),) = lab.public.requests[before:]
    assert path == "/named" and headers["Host"] == authority


# A CONNECT whose target the core reads as no authority gets the core's refusal (403 form:url, as
# ``egresswall check`` words it: test_host_form_parity.py); a method in lower case is no request line: 400.
@pytest.mark.parametrize(("line", "status"), [("connect public.lab.example:{t} HTTP/1.1", 400),
                                              ("CONNECT http://public.lab.example:{t}/ HTTP/1.1", 403),
                                              ("CONNECT public.lab.example:{t}/x HTTP/1.1", 403),
                                              ("CONNECT public.lab.example HTTP/1.1", 403)])
def test_a_connect_whose_target_is_not_an_authority_is_refused_once(lab, proxy, line, status):
    target = line.format(t=lab.public_tls.port)
    audit = AuditWatch(proxy.log_path).mark()
    raw = exchange(proxy, f"{target}\r\nHost: public.lab.example:{lab.public_tls.port}\r\n\r\n".encode(), timeout=3)
    assert statuses(raw) == [status], raw[:300]
    records = audit.wait_for(lambda r: refusals(r))
    assert [r["status"] for r in refusals(records)] == [status] and refusals(records)[0]["reason"]

