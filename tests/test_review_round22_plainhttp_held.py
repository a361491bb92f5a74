"""Review round 22 (plainhttp): plain-HTTP attacks on the forward proxy that HELD when tried, kept as
regression tests, on both transports (the fast front and mitmproxy's path).

A loopback origin (tests/raw_origin.py) logs every raw byte it receives; each test compares those
bytes with what the policy decided and with the audit records. The policy allows public.lab.example only for
GET/HEAD/POST/PUT on paths under /ok/ (absolute-form requests, the fast path's ground), and other.lab.example
only under /ok/ with ``intercept: true`` (a CONNECT to the plain-HTTP port, read request by request);
denied.lab.example is refused by default.
"""

from __future__ import annotations

import contextlib
import re
import socket
import time

import pytest
from labnet import PUBLIC_IP
from proxyproc import TRANSPORTS, ProxyProcess
from raw_origin import RawOrigin

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("internal_saw_nothing")]

LIMIT = 100


def _policy(lab, port: int) -> str:
    return (f"version: 1\nmode: enforce\ndefault: deny\n"
            f"ports:\n  http: [80, {port}]\n  connect: [443, {port}]\n"
            f"addresses:\n  allow: [{PUBLIC_IP}/32]\n"
            f"resolver:\n  nameservers: ['{lab.dns.address}']\n  timeout: 1\n"
            f"limits:\n  max_request_body: {LIMIT}\n  idle_timeout: 5\n"
            "hosts:\n  allow:\n"
            "    - host: public.lab.example\n      methods: [GET, HEAD, POST, PUT]\n      paths: [\"/ok/\"]\n"
            "    - host: other.lab.example\n      paths: [\"/ok/\"]\n      intercept: true\n")


@pytest.fixture(scope="module")
def origin():
    server = RawOrigin()
    yield server
    server.close()


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def proxy(lab, origin, tmp_path_factory, request):
    folder = tmp_path_factory.mktemp("r22-plainhttp")
    policy = folder / "policy.yaml"
    policy.write_text(_policy(lab, origin.port))
    process = ProxyProcess(["--policy", str(policy), *TRANSPORTS[request.param]], folder / "audit.jsonl")
    process.transport = request.param
    yield process
    process.stop()
    assert not [e for e in process.outbound() if e["host"] != PUBLIC_IP], process.outbound()


def _talk(proxy: ProxyProcess, pieces: list[bytes], delay: float = 0.0, timeout: float = 3,
          tunnel: str | None = None, close_after: bool = False) -> bytes:
    """Send ``pieces`` (``delay`` apart) on one connection (through a CONNECT to ``tunnel`` first); read all
    that comes back until the proxy closes or is silent ``timeout`` seconds (or at once with close_after)."""
    got = b""
    with socket.create_connection((proxy.host, proxy.port), timeout=timeout) as sock:
        if tunnel:
            sock.sendall(f"CONNECT {tunnel} HTTP/1.1\r\nHost: {tunnel}\r\n\r\n".encode())
            while b"\r\n\r\n" not in got and (byte := sock.recv(1)):
                got += byte
            assert got.startswith(b"HTTP/1.1 200"), got
        for piece in pieces:
            sock.sendall(piece)
            if delay:
                time.sleep(delay)
        if close_after:
            return got
        with contextlib.suppress(TimeoutError, ConnectionResetError, OSError):
            while chunk := sock.recv(65536):
                got += chunk
    return got


def _statuses(raw: bytes) -> list[int]:
    return [int(m) for m in re.findall(rb"HTTP/1\.[01] (\d{3}) ", raw)]


def _records(proxy: ProxyProcess, before: int, count: int, wait: float = 5) -> list[dict]:
    deadline = time.monotonic() + wait
    while True:
        records = proxy.audit()[before:]
        if len(records) >= count or time.monotonic() > deadline:
            time.sleep(0.2)
            return proxy.audit()[before:]
        time.sleep(0.05)


def _public(origin) -> str:
    return f"public.lab.example:{origin.port}"


def _other(origin) -> str:
    return f"other.lab.example:{origin.port}"


# ---- a head cut at every byte boundary ------------------------------------------------------------------

def test_a_head_cut_at_every_byte_boundary_is_one_request_decided_once_holds(proxy, origin):
    """Every cut of an allowed POST (head and body) reaches the origin as the same one request, with one
    decision and one response record each; every cut of a refused one reaches nothing, one refusal each."""
    a = _public(origin)
    allowed = (f"POST http://{a}/ok/cut HTTP/1.1\r\nHost: {a}\r\nContent-Length: 5\r\nConnection: close\r\n"
               f"X-Note: n\r\n\r\nhello").encode()
    refused = f"GET http://{a}/secret HTTP/1.1\r\nHost: {a}\r\nConnection: close\r\n\r\n".encode()
    for data, good in ((allowed, True), (refused, False)):
        cuts = range(1, len(data))
        mark, before = origin.mark(), len(proxy.audit())
        for cut in cuts:
            raw = _talk(proxy, [data[:cut], data[cut:]], delay=0.01)
            assert _statuses(raw)[:1] == ([200] if good else [403]), (cut, raw[:200])
        records = _records(proxy, before, len(cuts) * (2 if good else 1))
        seen = origin.since(mark)
        if good:
            requests = [b"POST " + r for r in seen.split(b"POST ")[1:]]
            assert len(requests) == len(cuts) and len(set(requests)) == 1, seen[:400]
            head, _, body = requests[0].partition(b"\r\n\r\n")
            assert body == b"hello" and sorted(head.split(b"\r\n")[1:]) == sorted(
                [f"Host: {a}".encode(), b"Content-Length: 5", b"Connection: close", b"X-Note: n"]), requests[0]
            assert [r["event"] for r in records].count("decision") == len(cuts)
            assert [r["event"] for r in records].count("response") == len(cuts)
            assert all(r["verdict"] == "allow" and r["path"] == "/ok/cut" for r in records), records[:3]
        else:
            assert seen == b""
            assert len(records) == len(cuts) and all(r["verdict"] == "refuse" for r in records), records[:3]


def _dechunk(data: bytes) -> bytes:
    out = b""
    while True:
        size, _, data = data.partition(b"\r\n")
        n = int(size.split(b";")[0], 16)
        if n == 0:
            return out
        out, data = out + data[:n], data[n + 2:]


# ---- a body dribbled -----------------------------------------------------------------------------------

@pytest.mark.parametrize("chunked", [False, True], ids=["length", "chunked"])
def test_a_body_dribbled_byte_by_byte_under_the_limit_arrives_whole_holds(proxy, origin, chunked):
    a = _public(origin)
    body = b"0123456789" * (1 if chunked else 4)  # a chunked body counts its framing against the limit
    framing = (b"Transfer-Encoding: chunked\r\n\r\n" + b"".join(b"1\r\n%c\r\n" % c for c in body) + b"0\r\n\r\n"
               if chunked else b"Content-Length: %d\r\n\r\n" % len(body) + body)
    head, _, rest = (f"PUT http://{a}/ok/drip HTTP/1.1\r\nHost: {a}\r\nConnection: close\r\n".encode()
                     + framing).partition(b"\r\n\r\n")
    mark, before = origin.mark(), len(proxy.audit())
    raw = _talk(proxy, [head + b"\r\n\r\n", *[rest[i:i + 1] for i in range(len(rest))]], delay=0.005)
    assert _statuses(raw) == [200], raw[:300]
    seen = origin.since(mark)
    assert seen.count(b"PUT /ok/drip") == 1
    if chunked:
        assert _dechunk(seen.split(b"\r\n\r\n", 1)[1]) == body, seen
    else:
        assert seen.endswith(b"\r\n\r\n" + body)
    records = _records(proxy, before, 2)
    assert [r["event"] for r in records] == ["decision", "response"] and records[1]["bytes_up"] == len(body)


def test_a_chunked_body_dribbled_past_the_limit_never_reaches_the_origin_holds(proxy, origin):
    a = _public(origin)
    head = f"POST http://{a}/ok/over HTTP/1.1\r\nHost: {a}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
    body = b"".join(b"1\r\nx\r\n" for _ in range(40)) + b"0\r\n\r\n"
    mark, before = origin.mark(), len(proxy.audit())
    raw = _talk(proxy, [head, *[body[i:i + 3] for i in range(0, len(body), 3)]], delay=0.005)
    assert _statuses(raw) == [413], raw[:300]
    assert origin.since(mark) == b""
    records = _records(proxy, before, 2)
    refusals = [r for r in records if r["verdict"] == "refuse"]
    assert len(refusals) == 1 and refusals[0]["rule"] == "limits.max_request_body", records


# ---- a HEAD answered with a body by a broken origin ---------------------------------------------------

def test_a_head_answered_with_a_body_does_not_answer_the_next_request_holds(proxy, origin):
    """The origin (wrongly) sends its 2-byte body after the HEAD's response: the next pipelined request must
    get its own answer, never those two bytes read as the start of a response."""
    a = _public(origin)
    data = (f"HEAD http://{a}/ok/h HTTP/1.1\r\nHost: {a}\r\n\r\n"
            f"GET http://{a}/ok/g HTTP/1.1\r\nHost: {a}\r\nConnection: close\r\n\r\n").encode()
    raw = _talk(proxy, [data])
    first, _, rest = raw.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 200")
    assert rest.startswith(b"HTTP/1.1 "), raw  # the next answer starts right after the HEAD's head
    assert _statuses(rest)[:1] in ([200], [502]), raw


# ---- a client that closes half way ----------------------------------------------------------------------

@pytest.mark.parametrize("where", ["head", "body"])
def test_a_client_that_closes_half_way_leaves_at_most_one_record_and_no_whole_request_holds(proxy, origin, where):
    a = _public(origin)
    head = f"POST http://{a}/ok/half HTTP/1.1\r\nHost: {a}\r\nContent-Length: 50\r\n\r\n".encode()
    data = head[: len(head) // 2] if where == "head" else head + b"x" * 20
    mark, before = origin.mark(), len(proxy.audit())
    _talk(proxy, [data], delay=0.3, close_after=True)
    time.sleep(1.0)
    seen = origin.since(mark)
    records = proxy.audit()[before:]
    if where == "head":
        assert seen == b""
        assert [r["event"] for r in records].count("decision") <= 1
    else:
        assert seen.count(b"POST /ok/half") <= 1 and b"x" * 21 not in seen
        assert [r["event"] for r in records].count("decision") == 1
        assert [r["event"] for r in records].count("response") <= 1


# ---- shapes: what the origin receives against what was decided ---------------------------------------

def _shapes(port: int) -> dict[str, tuple[bool, list[str]]]:
    a, o = f"public.lab.example:{port}", f"other.lab.example:{port}"
    post = f"POST http://{a}/ok/s HTTP/1.1\r\nHost: {a}\r\n"
    get = f"GET http://{a}/ok/s HTTP/1.1\r\nHost: {a}\r\n"
    hidden = f"GET /secret HTTP/1.1\r\nHost: denied.lab.example:{port}\r\n\r\n"
    tget = f"GET /ok/s HTTP/1.1\r\nHost: {o}\r\n"
    tpost = f"POST /ok/s HTTP/1.1\r\nHost: {o}\r\n"
    chunk = f"{len(hidden):x}\r\n{hidden}\r\n0\r\n\r\n"
    return {
        "cl-hex": (False, [post + "Content-Length: 0x5\r\n\r\nhello"]),
        "cl-leading-zero": (False, [post + "Content-Length: 05\r\nConnection: close\r\n\r\nhello"]),
        "cl-formfeed": (False, [post + "Content-Length:\x0c5\r\nConnection: close\r\n\r\nhello"]),
        "cl-name-space": (False, [post + f"Content-Length : {len(hidden)}\r\nContent-Length: 0\r\n\r\n" + hidden]),
        "cl-named-in-connection": (False, [post + f"Content-Length: {len(hidden)}\r\nConnection: Content-Length"
                                                  "\r\n\r\n" + hidden]),
        "te-named-in-connection": (False, [post + "Transfer-Encoding: chunked\r\nConnection: Transfer-Encoding"
                                                  "\r\n\r\n" + chunk]),
        "te-chunked-twice-in-one": (False, [post + "Transfer-Encoding: chunked, chunked\r\n\r\n" + chunk]),
        "host-named-in-connection": (False, [get + "Connection: close, Host\r\n\r\n"]),
        "connection-lists": (False, [get + "Connection: keep-alive\r\nConnection: ,x-secret ,, X-Two\t\r\n"
                                           "X-Secret: 1\r\nX-Two: 2\r\nKeep-Alive: 5\r\nTE: trailers\r\n"
                                           "Proxy-Connection: keep-alive\r\nproxy-authorization: Basic YTpi\r\n"
                                           "PROXY-AUTHORIZATION: Basic Yzpk\r\nProxy_Authorization: e\r\n"
                                           "Trailer: X\r\nConnection: close\r\n\r\n"]),
        "chunk-size-leading-zeros": (False, [post + "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                                                    "0005\r\nhello\r\n0000\r\n\r\n"]),
        "chunk-ext-space": (False, [post + "Transfer-Encoding: chunked\r\n\r\n5 ;a=b\r\nhello\r\n0\r\n\r\n"
                                    + hidden]),
        "chunk-ext-bare-lf": (False, [post + "Transfer-Encoding: chunked\r\n\r\n5;a\nb\r\nhello\r\n0\r\n\r\n"
                                      + hidden]),
        "trailer-content-length": (False, [post + "Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n"
                                           f"Content-Length: {len(hidden)}\r\n\r\n" + hidden]),
        "expect-refused-host": (False, [f"POST http://denied.lab.example:{port}/ok/s HTTP/1.1\r\n"
                                        f"Host: denied.lab.example:{port}\r\nExpect: 100-continue\r\n"
                                        "Content-Length: 5\r\n\r\n", "hello"]),
        "expect-over-limit": (False, [post + f"Expect: 100-continue\r\nContent-Length: {LIMIT + 1}\r\n\r\n",
                                      "x" * (LIMIT + 1)]),
        "http10-keepalive-pipelined": (False, [f"GET http://{a}/ok/s HTTP/1.0\r\nHost: {a}\r\n"
                                               "Connection: keep-alive\r\n\r\n" + hidden]),
        "pipelined-other-host-header": (False, [get + "\r\n" + f"GET http://{a}/ok/2 HTTP/1.1\r\n"
                                                f"Host: denied.lab.example:{port}\r\n\r\n"]),
        "pipelined-refused-path": (False, [get + "\r\n" + f"GET http://{a}/secret HTTP/1.1\r\nHost: {a}\r\n\r\n"]),
        "host-without-port": (False, [f"GET http://{a}/ok/s HTTP/1.1\r\nHost: public.lab.example\r\n\r\n"]),
        "post-http10-no-length": (False, [f"POST http://{a}/ok/s HTTP/1.0\r\nHost: {a}\r\n\r\n" + hidden]),
        "tunnel-host-header-other": (True, [tget.replace(f"Host: {o}", f"Host: {a}") + "\r\n"]),
        "tunnel-pipelined-secret": (True, [tget + "\r\n" + f"GET /secret HTTP/1.1\r\nHost: {o}\r\n\r\n"]),
        "tunnel-cl-named-in-connection": (True, [tpost + f"Content-Length: {len(hidden)}\r\n"
                                                 "Connection: Content-Length\r\n\r\n" + hidden]),
        "tunnel-over-limit": (True, [tpost + f"Content-Length: {LIMIT + 1}\r\n\r\n" + "x" * (LIMIT + 1)]),
        "tunnel-expect-secret": (True, [f"POST /secret HTTP/1.1\r\nHost: {o}\r\nExpect: 100-continue\r\n"
                                        "Content-Length: 5\r\n\r\n", "hello"]),
        "tunnel-hop-by-hop": (True, [tget + "Proxy-Authorization: Basic YTpi\r\nConnection: X-S\r\nX-S: 1\r\n"
                                     "TE: trailers\r\nKeep-Alive: 1\r\nProxy-Connection: k\r\n\r\n"]),
        "tunnel-te-chunked-identity": (True, [tpost + "Transfer-Encoding: chunked, identity\r\n\r\n" + chunk]),
        "tunnel-http10-keepalive-pipelined": (True, [f"GET /ok/s HTTP/1.0\r\nHost: {o}\r\n"
                                                     "Connection: keep-alive\r\n\r\n" + hidden]),
    }


HOP = re.compile(rb"(?im)^(proxy-authorization|proxy_authorization|proxy-connection|keep-alive|te|trailer|upgrade"
                 rb"|x-secret|x-two|x-s):")


@pytest.mark.parametrize("shape", list(_shapes(1)))
def test_what_the_origin_reads_was_decided_and_is_clean_holds(proxy, origin, shape):
    """Whatever the shape: the origin never reads a request for /secret or naming denied.lab.example, every
    request head it reads is for a path an allowing decision named, no hop-by-hop or proxy header reaches it,
    no body over the limit reaches it, and every refusal the client got has a record."""
    in_tunnel, pieces = _shapes(origin.port)[shape]
    mark, heads_before, before = origin.mark(), len(origin.heads), len(proxy.audit())
    raw = _talk(proxy, [p.encode("latin-1") for p in pieces], delay=0.3,
                tunnel=_other(origin) if in_tunnel else None)
    time.sleep(0.5)
    seen, parsed = origin.since(mark), origin.heads[heads_before:]
    records = proxy.audit()[before:]
    # what the origin reads as request heads (a body's bytes, framed as a body, are no request)
    assert not [h for h in parsed if b"/secret" in h or b"denied.lab.example" in h], seen
    assert not [h for h in parsed if HOP.findall(h)], seen
    heads = [tuple(h.split(b" ")[:2]) for h in parsed]
    allowed = [(r["method"], r["path"]) for r in records if r["event"] == "decision" and r["verdict"] == "allow"
               and r["method"] != "CONNECT"]
    assert len(heads) <= len(allowed), (heads, allowed)
    for method, path in heads:
        assert (method.decode(), path.decode()) in allowed, (method, path, allowed)
    assert len(seen) < 2 * LIMIT + 400, seen  # no body over the limit went up
    refusals = [r for r in records if r["verdict"] == "refuse"]
    answered_refusals = [s for s in _statuses(raw) if s >= 400]
    assert len(refusals) >= len(answered_refusals), (raw[:400], records)


# ---- two pipelined requests, cut at every byte boundary ------------------------------------------------

def test_a_pipelined_pair_cut_at_every_byte_boundary_is_decided_request_by_request_holds(proxy, origin):
    """An allowed GET and, behind it, a GET for a refused path, in two writes cut anywhere: the origin reads
    only the first, each connection gets 200 then 403, and each refusal has its record."""
    a = _public(origin)
    data = (f"GET http://{a}/ok/pair HTTP/1.1\r\nHost: {a}\r\n\r\n"
            f"GET http://{a}/secret HTTP/1.1\r\nHost: {a}\r\n\r\n").encode()
    cuts = range(1, len(data), 3)
    mark, heads_before, before = origin.mark(), len(origin.heads), len(proxy.audit())
    for cut in cuts:
        raw = _talk(proxy, [data[:cut], data[cut:]], delay=0.01, timeout=2)
        assert _statuses(raw) == [200, 403], (cut, raw[:300])
    records = _records(proxy, before, len(cuts) * 3)
    parsed = origin.heads[heads_before:]
    assert len(parsed) == len(cuts) and all(h.startswith(b"GET /ok/pair ") for h in parsed), origin.since(mark)
    refusals = [r for r in records if r["verdict"] == "refuse"]
    assert len(refusals) == len(cuts) and {r["path"] for r in refusals} == {"/secret"}, refusals[:3]
