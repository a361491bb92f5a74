"""Adversarial review, round 9: a hostile or broken origin, allowed by the policy, talking to the proxy, on
both transports (the fast path's h11 parse and re-framing, mitmproxy's reader with egresswall's patches and
``ResponseHygiene``). Earlier rounds attacked from the client's side; the response-side cases they hold
(a response framed two ways, two lengths, bytes after a response or after a HEAD response, interim
responses and a flood of them, an unasked 101, trailers, a 204's Content-Length, endless or dripped heads,
an origin that never answers) are not repeated here.

Each origin here is a raw socket on 127.0.0.2 that writes exactly the bytes given, in the pieces and at the
pace given; each client is a raw socket that reads everything the proxy sends until it closes.

Defects found and fixed:

* mitmproxy's path relayed a bare CR or a NUL inside an origin's header value or reason phrase as it came
  (``X-A: foo<CR>X-Injected: 1``): a client that ends a line at a bare CR (Python's email-based header
  parser is one) read a header the origin smuggled past every hop. It relayed a status code of four digits
  (``HTTP/1.1 2000 OK``, recorded as status 2000) and a Content-Length of 23 digits, which a client parsing
  into 64 bits wraps. The fast path's h11 refuses all of these; now both answer 502
  (``proxy/mitm_patches.py`` ``_read_response_head``);
* mitmproxy's path answered a ``304`` whose head said ``Transfer-Encoding: chunked`` with that head and
  then a last chunk, ``0`` CRLF CRLF, for a body it never read: a kept-alive client read those bytes as the
  start of the next response. The 304 now loses its Transfer-Encoding (``ResponseHygiene``), as h11 drops it
  on the fast path;
* the fast path recorded a response that broke off (the origin closed mid-body, a bad chunk, a client that
  left before the end) with status null and ``bytes_down`` 0, whatever the client had been sent: a session's
  ``budgets.response_bytes`` was charged nothing for a download its client cut short a byte before the
  end. The record now has the status and the body bytes relayed, and the client gets the head and body h11
  read before the break (it got nothing when the break was a bad chunk), then the close;
* the fast path answered a 103 and then an unasked 101 as a response it cannot parse (in h11's words, rule
  ``connect``), where mitmproxy's path refuses it as ``http:unrequested-upgrade``; now both do;
* mitmproxy's path recorded every streamed (Content-Length) request body as ``bytes_up`` 0: it counted the
  body kept on the flow, and a streamed one is not kept; a session's ``budgets.request_bytes`` was never
  charged for one. Its bytes are counted as they pass now (``BodyLimit``);
* mitmproxy's path sent a kept-alive client's request down the upstream connection it kept for the name,
  to the address the name had before, when the request was decided and pinned to another (the name's answer
  changed, both allowed): the record named one address, the bytes went to the other. A kept connection is
  reused only for the address its request was pinned to now (``Pinning.requestheaders``), as on the fast path;
* mitmproxy's path recorded a response whose head it refused (framed two ways, a header name it will not
  pass on) with the origin's status, 200, while its client was answered 502; it is null now, as on the fast
  path, with mitmproxy's reason in ``error``.

Held, on both transports: hop-by-hop response headers beyond the ones test_fast_http.py names
(``Proxy-Connection``, an ``Upgrade`` on a 200, ``TE``, ``Trailer``) never reach the client; a response framed
two ways, or an interim response, dripped a byte per write, is read as a whole; an interim response with a
body is refused; an origin that closes mid-head gets its client a 502, and one that closes mid-body gets its
client the truncation (the connection closed before the body's end, never a clean end it could keep alive
after). Differences between the transports that are by design are in the README (*Forwarding hygiene*).
"""

from __future__ import annotations

import contextlib
import re
import socket
import time
import uuid
from collections.abc import Callable

import pytest
from audit_watch import AuditWatch, decisions
from dnslab import Record
from hostile import _Server
from hostile import read_head as origin_read_head
from labnet import PUBLIC_IP
from proxyproc import TRANSPORTS, both_transports, serve_module_proxy
from rawclient import read_all

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("internal_saw_nothing")]

HEADER_TIMEOUT, IDLE_TIMEOUT = 2, 4
NEXT = b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nnext"  # every origin's answer to a connection's later requests
OK = b"HTTP/1.1 200 OK\r\n"


class Close:
    """A step of a script: the origin closes the connection (``reset``: with an RST)."""

    def __init__(self, reset: bool = False) -> None:
        self.reset = reset


Step = bytes | float | Close


def drip(data: bytes, gap: float = 0.002) -> list[Step]:
    """``data`` a byte per write, ``gap`` seconds apart."""
    steps: list[Step] = []
    for byte in data:
        steps += [bytes([byte]), gap]
    return steps


class ScriptedOrigin(_Server):
    """Answers a request for ``/first`` with ``first`` (bytes written as they are, pauses, a close) and any
    other with ``NEXT``, on as many kept-alive connections as it is asked; ``heads`` are the heads it read."""

    def __init__(self, first: list[Step]) -> None:
        self.first = first
        self.heads: list[bytes] = []
        super().__init__()

    def handle(self, conn: socket.socket, head: bytes) -> None:
        while head and not self.closed.is_set():
            self.heads.append(head)
            for step in self.first if head.startswith(b"GET /first ") else [NEXT]:
                if isinstance(step, Close):
                    if step.reset:
                        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    return
                if isinstance(step, float):
                    time.sleep(step)
                else:
                    conn.sendall(step)
            head = origin_read_head(conn)


SCRIPTS: dict[str, list[Step]] = {
    # control bytes in a response head, and numbers no careful client reads
    "bare-cr-value": [OK + b"X-A: foo\rX-Injected: 1\r\nContent-Length: 5\r\n\r\nhello"],
    "bare-cr-reason": [b"HTTP/1.1 200 OK\rX-Injected: 1\r\nContent-Length: 5\r\n\r\nhello"],
    "nul-value": [OK + b"X-A: foo\x00X-Injected: 1\r\nContent-Length: 5\r\n\r\nhello"],
    "soh-reason": [b"HTTP/1.1 200 O\x01K\r\nX-Injected: 1\r\nContent-Length: 5\r\n\r\nhello"],  # h11 reads it
    "vertical-tab-value": [OK + b"X-A: foo\x0bX-Injected: 1\r\nContent-Length: 5\r\n\r\nhello"],
    "four-digit-status": [b"HTTP/1.1 2000 OK\r\nX-Injected: 1\r\nContent-Length: 5\r\n\r\nhello"],
    "huge-length": [OK + b"X-Injected: 1\r\nContent-Length: 100000000000000000000005\r\n\r\nhello", 0.3, Close()],
    # a 304 that says it is chunked, and what follows it on a kept-alive connection
    "304-chunked": [b"HTTP/1.1 304 Not Modified\r\nTransfer-Encoding: chunked\r\nETag: \"e\"\r\n\r\n"],
    "304-chunked-body": [b"HTTP/1.1 304 Not Modified\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"],
    "304-length-body": [b"HTTP/1.1 304 Not Modified\r\nContent-Length: 5\r\n\r\nhello"],
    # responses that break off
    "closes-mid-length": [OK + b"Content-Length: 10\r\n\r\nhello", 0.3, Close()],
    "closes-mid-chunked": [OK + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n", 0.3, Close()],
    "resets-mid-length": [OK + b"Content-Length: 10\r\n\r\nhello", 0.3, Close(reset=True)],
    "bad-chunk-footer": [OK + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhelloXX0\r\n\r\n", 0.3, Close()],
    "closes-mid-head": [OK + b"Content-Le", 0.3, Close()],
    # heads mitmproxy reads and then refuses (the fast path's h11 refuses them too)
    "two-ways": [OK + b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n5\r\nhello\r\n0\r\n\r\n"],
    "space-before-colon": [OK + b"Content-Length : 5\r\n\r\nhello"],
    # an unasked 101 behind an interim response
    "103-then-101": [b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\nHTTP/1.1 101 Switching Protocols"
                     b"\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\nRAW BYTES"],
    # hop-by-hop headers test_fast_http.py does not name
    "hop-by-hop": [OK + b"Proxy-Connection: keep-alive\r\nUpgrade: h2c\r\nTE: trailers\r\nTrailer: X-T\r\n"
                   b"Connection: Upgrade, X-Named\r\nX-Named: 1\r\nX-Kept: yes\r\nContent-Length: 5\r\n\r\nhello"],
    # framing dripped a byte per write
    "two-ways-dripped": drip(OK + b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n5\r\nhello\r\n0\r\n\r\n"),
    "interim-dripped": drip(b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n" + OK
                            + b"Content-Length: 5\r\n\r\nhello"),
    "interim-with-a-body": [b"HTTP/1.1 100 Continue\r\nContent-Length: 5\r\n\r\nhello" + OK
                            + b"Content-Length: 5\r\n\r\nfinal"],
}


@pytest.fixture(scope="module")
def origins():
    servers = {name: ScriptedOrigin(script) for name, script in SCRIPTS.items()}
    servers["big"] = BigBody()
    yield servers
    for server in servers.values():
        server.close()


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def proxy(lab, origins, tmp_path_factory, request):
    """Default allow, every port above 1023 open to plain HTTP (each origin has a port of its own)."""
    folder = tmp_path_factory.mktemp("round9")
    text = lab.policy_text(limits=f"limits:\n  header_timeout: {HEADER_TIMEOUT}\n  idle_timeout: {IDLE_TIMEOUT}\n")
    text = text.replace(f"  http: {sorted({80, lab.public.port})}", "  http: [80, '1024-65535']")
    yield from serve_module_proxy(folder, text, request.param)


def get(port: int, path: str) -> bytes:
    authority = f"public.lab.example:{port}"
    return f"GET http://{authority}{path} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode()


def first_then_next(proxy, port: int, pause: float = 0.8) -> bytes:
    """A GET, and ``pause`` seconds later (its answer is in, or its exchange ended) a second GET on the same
    kept-alive connection: every byte the client got, until the proxy closed or went quiet."""
    with socket.create_connection((proxy.host, proxy.port), timeout=5) as sock:
        sock.sendall(get(port, "/first"))
        time.sleep(pause)
        with contextlib.suppress(OSError):  # closed already: what came before is the answer
            sock.sendall(get(port, "/second"))
        return read_all(sock, 2)


def responses(proxy, audit: AuditWatch, count: int) -> list[dict]:
    return [r for r in audit.wait_for(lambda rs: len([r for r in rs if r["event"] == "response"]) >= count, 5)
            if r["event"] == "response"]


def status_lines(raw: bytes) -> list[bytes]:
    """Every status line at the start of a line of ``raw`` (a body glued to the next response, ``helloHTTP/1.1``,
    is one of this test's bodies; a refusal's reason quoting the origin's bytes is not a line of its own)."""
    return re.findall(rb"(?m)^[^\r\n]{0,5}(HTTP/1\.[01] [0-9]{3} [^\r\n]*)", raw)


# ---- control bytes and impossible numbers in a response head ----------------------------------------------

@pytest.mark.parametrize("case", ["bare-cr-value", "bare-cr-reason", "soh-reason", "nul-value", "vertical-tab-value",
                                  "four-digit-status", "huge-length"])
def test_a_control_byte_in_an_origins_response_head_never_reaches_the_client(proxy, origins, case):
    """mitmproxy's path wrote ``X-A: foo<CR>X-Injected: 1`` to the client as the origin sent it: a client that
    ends a line at a bare CR gets a header the origin smuggled through. Both transports now answer 502 and
    close; nothing of the origin's head or body reaches the client, and the record says why (its status is
    the 502 the client was answered, its bytes_down 0)."""
    audit = AuditWatch(proxy.log_path).mark()
    raw = first_then_next(proxy, origins[case].port)
    assert status_lines(raw)[:1] == [b"HTTP/1.1 502 Bad Gateway"], raw[:300]
    assert len(status_lines(raw)) == 1, raw  # and the connection closed after it
    assert not re.search(rb"\r(?!\n)|[\x00-\x08\x0b]", raw), raw  # no control byte of the origin's, raw
    assert not re.search(rb"(?im)^x-injected", raw) and b"hello" not in raw, raw
    (record,) = responses(proxy, audit, 1)
    assert record["status"] == 502 and record["bytes_down"] == 0, record
    assert record["error"], record


# ---- a 304 that says it is chunked -------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["304-chunked", "304-chunked-body", "304-length-body"])
def test_what_follows_a_304_on_a_kept_alive_connection_is_the_next_response(proxy, origins, case):
    """A 304 has no body whatever its head says. mitmproxy's path, seeing ``chunked`` in the head it relayed,
    ended the body it never read with ``0`` CRLF CRLF: the client read those bytes as the start of the next
    response. After the 304's head, the next bytes the client gets must be the next response's status line."""
    audit = AuditWatch(proxy.log_path).mark()
    raw = first_then_next(proxy, origins[case].port)
    head, sep, rest = raw.partition(b"\r\n\r\n")
    assert sep and head.startswith(b"HTTP/1.1 304 "), raw
    assert b"transfer-encoding" not in head.lower(), head
    assert rest.startswith(b"HTTP/1.1 200 OK\r\n"), raw  # the second GET's answer, nothing before it
    assert rest.endswith(b"next") and b"hello" not in rest, raw
    assert [r["status"] for r in responses(proxy, audit, 2)] == [304, 200]


# ---- responses that break off --------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["closes-mid-length", "closes-mid-chunked", "resets-mid-length", "bad-chunk-footer"])
def test_a_response_that_breaks_off_is_cut_short_for_the_client_and_recorded_with_what_it_got(proxy, origins, case):
    """The origin sends a 200 head and 5 bytes of its body, then closes (or resets, or sends a chunk h11 will not
    read). The client gets the head and those bytes and then the close: never a clean end (the last chunk)
    that would let it take the truncated body for the whole one, and nothing more on the connection. The
    record has the status the client was sent, the 5 body bytes and the break: the fast path recorded status
    null and 0 bytes (a session's response bytes went uncharged), and for a bad chunk sent the client nothing."""
    audit = AuditWatch(proxy.log_path).mark()
    raw = first_then_next(proxy, origins[case].port)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert status_lines(raw) == [b"HTTP/1.1 200 OK"], raw
    assert b"hello" in body and not body.endswith(b"0\r\n\r\n"), raw
    if b"content-length" in head.lower():
        assert body == b"hello", raw  # fewer bytes than its Content-Length (10): cut short
    (record,) = responses(proxy, audit, 1)
    assert (record["status"], record["bytes_down"]) == (200, 5), record
    assert record["error"], record


def test_an_origin_that_closes_mid_head_gets_its_client_a_502(proxy, origins):
    audit = AuditWatch(proxy.log_path).mark()
    raw = first_then_next(proxy, origins["closes-mid-head"].port)
    assert status_lines(raw) == [b"HTTP/1.1 502 Bad Gateway"], raw
    (record,) = responses(proxy, audit, 1)
    assert record["status"] == 502 and record["error"], record


@pytest.mark.parametrize("case", ["two-ways", "space-before-colon"])
def test_a_response_head_refused_after_it_was_read_is_recorded_as_not_relayed(proxy, origins, case):
    """mitmproxy reads the head, then refuses it (framed two ways; a header name with a space before its colon)
    and answers the client 502 itself; the record said status 200, the origin's. It is 502, what the client
    was answered, on both transports now, the refusal's reason in ``error``."""
    audit = AuditWatch(proxy.log_path).mark()
    raw = first_then_next(proxy, origins[case].port)
    assert status_lines(raw) == [b"HTTP/1.1 502 Bad Gateway"] and b"hello" not in raw, raw
    (record,) = responses(proxy, audit, 1)
    assert record["status"] == 502 and record["bytes_down"] == 0 and record["error"], record


class BigBody(_Server):
    """A 200 with a 4 MiB Content-Length; 256 KiB of it, then nothing more for 2 seconds, then the close."""

    SIZE, SENT = 4 << 20, 256 << 10

    def handle(self, conn: socket.socket, head: bytes) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % self.SIZE + b"x" * self.SENT)
        time.sleep(2)


def test_a_client_that_leaves_mid_response_is_recorded_with_the_bytes_it_was_sent(proxy, origins):
    """A client reads 256 KiB of a 4 MiB response and goes. The record (and with it a session's
    ``budgets.response_bytes``, charged from it) has the bytes relayed, not 0 as on the fast path before."""
    audit = AuditWatch(proxy.log_path).mark()
    with socket.create_connection((proxy.host, proxy.port), timeout=5) as sock:
        sock.sendall(get(origins["big"].port, "/big"))
        got = b""
        while len(got) < BigBody.SENT:
            chunk = sock.recv(65536)
            assert chunk, len(got)
            got += chunk
    (record,) = responses(proxy, audit, 1)
    assert record["status"] == 200 and record["error"], record
    assert record["bytes_down"] >= BigBody.SENT - 65536, record  # what was relayed, give or take a read


def test_an_unasked_101_behind_an_interim_response_is_refused_as_one(proxy, origins):
    """A 103 and then a 101 to a GET that asked for no upgrade: both transports refuse it as the unasked
    upgrade it is (``http:unrequested-upgrade``, one refusal record). The fast path named only a 101 at the
    start of the response so, and answered this one with h11's words as a response it cannot parse."""
    audit = AuditWatch(proxy.log_path).mark()
    raw = first_then_next(proxy, origins["103-then-101"].port)
    assert status_lines(raw) == [b"HTTP/1.1 502 Bad Gateway"] and b"RAW BYTES" not in raw, raw
    assert b"X-Egresswall-Rule: http:unrequested-upgrade\r\n" in raw, raw
    records = audit.wait_for(lambda rs: any(r.get("rule") == "http:unrequested-upgrade" for r in rs), 5)
    assert [r["status"] for r in records if r.get("rule") == "http:unrequested-upgrade"] == [502], records


def test_a_streamed_request_body_is_recorded_with_its_bytes(proxy, lab):
    """A POST with a Content-Length body, streamed to the origin: its response record has the body's bytes
    as ``bytes_up`` (a session's ``budgets.request_bytes`` is charged from it). mitmproxy's path recorded 0
    for every such body (it counted the body kept on the flow, and a streamed one is not kept)."""
    audit = AuditWatch(proxy.log_path).mark()
    authority = f"public.lab.example:{lab.public.port}"  # an origin that reads the body before it answers
    with socket.create_connection((proxy.host, proxy.port), timeout=5) as sock:
        sock.sendall(f"POST http://{authority}/upload HTTP/1.1\r\nHost: {authority}\r\nContent-Length: 3000\r\n"
                     "Connection: close\r\n\r\n".encode())
        for _ in range(3):
            sock.sendall(b"u" * 1000)
            time.sleep(0.05)
        assert read_all(sock, 5).endswith(b"got 3000 bytes")
    (record,) = responses(proxy, audit, 1)
    assert (record["status"], record["bytes_up"]) == (200, 3000), record


# ---- held: hop-by-hop headers, dripped framing, interim bodies -------------------------------------------------

def test_hop_by_hop_response_headers_never_reach_the_client(proxy, origins):
    raw = first_then_next(proxy, origins["hop-by-hop"].port)
    head = raw.partition(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"http/1.1 200 ok") and b"x-kept: yes" in head, raw
    for name in (b"proxy-connection", b"upgrade", b"\r\nte:", b"trailer", b"x-named", b"connection: upgrade"):
        assert name not in head, (name, head)
    assert status_lines(raw) == [b"HTTP/1.1 200 OK"] * 2, raw  # and the connection served the next request


@pytest.mark.parametrize(("case", "expect"), [
    ("two-ways-dripped", lambda raw: status_lines(raw) == [b"HTTP/1.1 502 Bad Gateway"] and b"hello" not in raw),
    ("interim-dripped", lambda raw: status_lines(raw) == [b"HTTP/1.1 200 OK"] * 2 and b"Early" not in raw),
    ("interim-with-a-body", lambda raw: status_lines(raw) == [b"HTTP/1.1 502 Bad Gateway"] and b"final" not in raw),
])
def test_framing_written_a_byte_at_a_time_or_around_an_interim_response(proxy, origins, case,
                                                                         expect: Callable[[bytes], bool]):
    raw = first_then_next(proxy, origins[case].port, pause=1.5)
    assert expect(raw), raw


# ---- an upstream connection kept for the next request -----------------------------------------------------

SECOND_PUBLIC_IP = "127.0.0.4"  # another allowed address, for a name whose answer changes


class Names(_Server):
    """Answers every request with its own ``name`` as the body, on a kept-alive connection."""

    def __init__(self, host: str, port: int, name: bytes) -> None:
        self.name = name
        super().__init__(host=host, port=port)

    def handle(self, conn: socket.socket, head: bytes) -> None:
        while head and not self.closed.is_set():
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(self.name), self.name))
            head = origin_read_head(conn)


@both_transports
def test_a_kept_upstream_connection_serves_only_the_address_its_request_was_pinned_to(lab, start_proxy):
    """A name answers 127.0.0.2, then (its TTL 0) 127.0.0.4, both allowed. The second request on the kept-alive
    client connection is decided and pinned to 127.0.0.4, and its record says so; mitmproxy's path sent it
    down the upstream connection it kept for the name, to 127.0.0.2, an address this request was never
    decided for (after a reload that denies it, one no request may reach). The fast path reuses a connection
    only for the same pinned address; now mitmproxy's path opens a new one too."""
    first = Names(PUBLIC_IP, 0, b"first address")
    second = Names(SECOND_PUBLIC_IP, first.port, b"second address")
    name = f"flip-{uuid.uuid4().hex[:8]}.lab.example"
    lab.dns.set(name, [Record("A", PUBLIC_IP, ttl=0)])
    text = lab.policy_text().replace(f"  allow: [{PUBLIC_IP}/32]", f"  allow: [{PUBLIC_IP}/32, {SECOND_PUBLIC_IP}/32]")
    proxy = start_proxy(text.replace(f"  http: {sorted({80, lab.public.port})}", f"  http: [80, {first.port}]"))
    audit = AuditWatch(proxy.log_path).mark()
    try:
        with socket.create_connection((proxy.host, proxy.port), timeout=5) as sock:
            sock.sendall(f"GET http://{name}:{first.port}/1 HTTP/1.1\r\nHost: {name}:{first.port}\r\n\r\n".encode())
            one = read_until(sock, b"address")
            lab.dns.set(name, [Record("A", SECOND_PUBLIC_IP, ttl=0)])
            sock.sendall(f"GET http://{name}:{first.port}/2 HTTP/1.1\r\nHost: {name}:{first.port}\r\n\r\n".encode())
            two = read_until(sock, b"address")
            sock.sendall(f"GET http://{name}:{first.port}/3 HTTP/1.1\r\nHost: {name}:{first.port}\r\n\r\n".encode())
            three = read_until(sock, b"address")  # the answer unchanged: the connection to it is kept
    finally:
        first.close()
        second.close()
    assert one.endswith(b"first address") and two.endswith(b"second address"), (one, two)
    assert three.endswith(b"second address") and (first.connections, second.connections) == (1, 1)
    pinned = [r["pinned"] for r in audit.wait_for(lambda rs: len(decisions(rs)) == 3) if r["event"] == "decision"]
    assert pinned == [PUBLIC_IP, SECOND_PUBLIC_IP, SECOND_PUBLIC_IP]


def read_until(sock: socket.socket, end: bytes) -> bytes:
    data = b""
    while not data.endswith(end):
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    return data


def test_the_proxy_is_alive_and_quiet_after_all_of_it(proxy, lab):
    authority = f"public.lab.example:{lab.public.port}"
    with socket.create_connection((proxy.host, proxy.port), timeout=5) as sock:
        sock.sendall(f"GET http://{authority}/alive HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n"
                     .encode())
        assert read_all(sock, 5).startswith(b"HTTP/1.1 200 ")
    assert "Traceback" not in proxy.stderr, proxy.stderr[-2000:]
