"""Adversarial review, round 7: a chunked request body that cannot be read on (a framing h11's chunk reader
refuses, trailer fields), through the real proxy on both transports. Plain HTTP goes through the fast
path on the fast transport and through mitmproxy's (proxy/mitm_patches.py ``_server_read_body``) on the
other; HTTP inside a CONNECT to a plain-HTTP port is mitmproxy's on both.

What must hold for every shape: no byte of the body reaches the origin, nothing pipelined after it is
sent anywhere, the client is answered once with a reason, the refusal has exactly one record, and every
connection of it ends.

Defects found and fixed (proxy/mitm_patches.py):

* a request the policy refuses, whose bad chunk framing came in the head's read (plain HTTP on
  mitmproxy's transport; inside a tunnel to a plain-HTTP port on both): mitmproxy's master runs hooks
  eagerly, so the refusal set ``request.stream`` before the reader met the framing, the patch stood
  aside for a "streamed" body, and mitmproxy closed the client before the 403 went out: the client got
  nothing, the record said 403 and 655 bytes sent. A body refused before it is read is now dropped unread;
* trailers (or a bad framing) behind data already over limits.max_request_body, in the head's read: while
  the decision hook held the stream, the reader found the trailers, and the stream answered 400
  ``http:trailers``; split over two reads (and on the fast path) the same request got 413. The limit is
  now checked first, in wire order, on both transports.
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time

import h11
import pytest
from hostile import _Server
from proxyproc import TRANSPORTS, ProxyProcess, parse_response, serve_module_proxy
from rawclient import tunnel

pytestmark = pytest.mark.integration

IDLE = 3.0
LIMIT = 1000
MARK = b"SECRETBODY"  # in every refused body: the origin must never read it


class Recorder(_Server):
    """An origin that keeps every byte each connection brought, answers each whole request ``200 ok``,
    and notes when a connection ended (the proxy closed its side)."""

    def __init__(self) -> None:
        self.raw: list[bytearray] = []
        self.paths: list[str] = []
        self.ended: list[threading.Event] = []
        super().__init__()

    def serve(self, conn: socket.socket) -> None:
        got, ended = bytearray(), threading.Event()
        self.raw.append(got)
        self.ended.append(ended)
        parser = h11.Connection(h11.SERVER)
        with contextlib.suppress(OSError, h11.ProtocolError), conn:
            conn.settimeout(60)
            while not self.closed.is_set():
                event = parser.next_event()
                if event is h11.NEED_DATA:
                    data = conn.recv(65536)
                    got += data
                    parser.receive_data(data)
                    continue
                if isinstance(event, h11.Request):
                    self.paths.append(event.target.decode())
                elif isinstance(event, h11.EndOfMessage):
                    conn.sendall(parser.send(h11.Response(status_code=200, headers=[("Content-Length", "2")]))
                                 + parser.send(h11.Data(data=b"ok")) + parser.send(h11.EndOfMessage()))
                    parser.start_next_cycle()
                elif isinstance(event, h11.ConnectionClosed):
                    break
        ended.set()

    def saw(self, needle: bytes) -> bool:
        return any(needle in bytes(raw) for raw in self.raw)


@pytest.fixture(scope="module")
def origin():
    server = Recorder()
    yield server
    server.close()


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def proxy(lab, origin, tmp_path_factory, request):
    """Default allow but /denied/ on public.lab.example; the origin's port open to plain HTTP and to CONNECT
    (a tunnel to a plain-HTTP port carries HTTP, decided request by request)."""
    folder = tmp_path_factory.mktemp("round7")
    text = lab.policy_text("hosts:\n  deny:\n    - host: public.lab.example\n      paths: [/denied/]\n",
                           limits=f"limits:\n  max_request_body: {LIMIT}\n  idle_timeout: {IDLE}\n")
    text = text.replace(f"  http: {sorted({80, lab.public.port})}", f"  http: {sorted({80, origin.port})}")
    text = text.replace(f"  connect: {sorted({443, lab.public_tls.port})}", f"  connect: {sorted({443, origin.port})}")
    yield from serve_module_proxy(folder, text, request.param)


BAD_BODIES = {
    "negative": b"-1\r\nSECRETBODY\r\n0\r\n\r\n",
    "hex-prefix": b"0xa\r\nSECRETBODY\r\n0\r\n\r\n",
    "no-crlf-after-data": b"a\r\nSECRETBODYXX0\r\n\r\n",
    "data-then-bad-size": b"a\r\nSECRETBODY\r\nzz\r\n0\r\n\r\n",
    "bad-trailer-line": b"a\r\nSECRETBODY\r\n0\r\nno colon here\r\n\r\n",
    "trailers": b"a\r\nSECRETBODY\r\n0\r\nX-Trailer: 1\r\n\r\n",
}
RULES = {shape: "http:trailers" if shape == "trailers" else "http:bad-chunked" for shape in BAD_BODIES}


def _authority(origin: Recorder) -> str:
    return f"public.lab.example:{origin.port}"


def _head(authority: str, path: str, extra: str = "", absolute: bool = True) -> bytes:
    target = f"http://{authority}{path}" if absolute else path
    return (f"POST {target} HTTP/1.1\r\nHost: {authority}\r\nTransfer-Encoding: chunked\r\n{extra}\r\n").encode()


def _smuggled(authority: str, path: str) -> bytes:
    return f"GET http://{authority}{path} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode()


def _read_to_end(sock: socket.socket, timeout: float) -> tuple[bytes, bool]:
    """What the proxy sent until it closed its side (True) or was silent for ``timeout`` (False)."""
    sock.settimeout(timeout)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except TimeoutError:
        return got, False
    except ConnectionResetError:
        return got, True
    return got, True


def _send(sock: socket.socket, pieces: list[bytes], pause: float) -> None:
    for piece in pieces:
        with contextlib.suppress(OSError):
            sock.sendall(piece)
        if pause:
            time.sleep(pause)


def _statuses(raw: bytes) -> list[int]:
    """The status of every response head in ``raw`` (a body may run into the next head: ``okHTTP/1.1 400``)."""
    return [int(m[1]) for m in re.finditer(rb"HTTP/1\.[01] (\d{3})[ \r]", raw)]


def _records(proxy: ProxyProcess, path: str, wait: float = 0.5) -> list[dict]:
    time.sleep(wait)
    return [r for r in proxy.audit() if r.get("path") == path]


def _assert_refused_once(proxy: ProxyProcess, path: str, status: int, rule: str) -> None:
    """Exactly one record of the request, the refusal, with the rule and a reason a human can read."""
    mine = _records(proxy, path)
    refusals = [r for r in mine if r.get("status") == status and r.get("rule") == rule]
    assert len(refusals) == 1 and refusals[0].get("reason"), mine
    assert not [r for r in mine if r.get("verdict") == "allow" and r.get("status") not in (None, status)], mine
    assert len([r for r in mine if r["event"] == "response"]) == 1, mine


def _answered(raw: bytes, status: int, rule: str) -> None:
    assert _statuses(raw)[-1:] == [status], raw[:400]
    head = raw[raw.rfind(b"HTTP/1.1 " + str(status).encode()):].partition(b"\r\n\r\n")[0].lower()
    assert f"x-egresswall-rule: {rule}".encode() in head, raw[:400]
    assert b"x-egresswall-reason: " in head, raw[:400]


def _origin_untouched(origin: Recorder, paths: list[str]) -> None:
    time.sleep(0.3)
    assert not origin.saw(MARK), "a byte of a refused body reached the origin"
    for path in paths:
        assert path not in origin.paths, (path, origin.paths[-5:])


def _still_serves(proxy: ProxyProcess, origin: Recorder) -> None:
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(f"GET http://{_authority(origin)}/alive HTTP/1.1\r\nHost: {_authority(origin)}\r\n"
                     "Connection: close\r\n\r\n".encode())
        raw, _ = _read_to_end(sock, 10)
    assert parse_response(raw)[0] == 200, raw[:300]


# ---- split and slow writes ----------------------------------------------------------------------------

@pytest.mark.parametrize("shape", list(BAD_BODIES))
def test_a_bad_body_written_byte_by_byte_after_the_head_is_refused_once_and_never_forwarded(proxy, origin, shape):
    path = f"/slow-{shape}"
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(_head(_authority(origin), path))
        time.sleep(0.4)  # the decision is made before the body comes
        _send(sock, [bytes([b]) for b in BAD_BODIES[shape]], 0.005)
        raw, closed = _read_to_end(sock, IDLE + 3)
    _answered(raw, 400, RULES[shape])
    assert closed, "the proxy never closed its side after the refusal"
    _assert_refused_once(proxy, path, 400, RULES[shape])
    _origin_untouched(origin, [path])


@pytest.mark.parametrize("shape", list(BAD_BODIES))
def test_a_bad_body_in_the_heads_write_with_a_request_behind_it(proxy, origin, shape):
    path, hidden = f"/one-{shape}", f"/hidden-one-{shape}"
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(_head(_authority(origin), path) + BAD_BODIES[shape] + _smuggled(_authority(origin), hidden))
        raw, closed = _read_to_end(sock, IDLE + 3)
    assert _statuses(raw) == [400], raw[:400]
    _answered(raw, 400, RULES[shape])
    assert closed
    _assert_refused_once(proxy, path, 400, RULES[shape])
    _origin_untouched(origin, [path, hidden])


# ---- kept alive ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("writes", ["one-write", "two-writes"])
@pytest.mark.parametrize("shape", ["negative", "no-crlf-after-data", "trailers"])
def test_a_bad_body_after_a_good_request_on_a_kept_alive_connection(proxy, origin, shape, writes):
    good, bad, hidden = f"/good-{shape}-{writes}", f"/bad-{shape}-{writes}", f"/hidden-ka-{shape}-{writes}"
    first = _head(_authority(origin), good) + b"5\r\nhello\r\n0\r\n\r\n"
    second = _head(_authority(origin), bad) + BAD_BODIES[shape] + _smuggled(_authority(origin), hidden)
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        if writes == "one-write":
            sock.sendall(first + second)
        else:
            sock.sendall(first)
            time.sleep(0.5)
            sock.sendall(second)
        raw, closed = _read_to_end(sock, IDLE + 3)
    assert _statuses(raw) == [200, 400], raw[:600]
    _answered(raw, 400, RULES[shape])
    assert closed
    assert good in origin.paths
    _assert_refused_once(proxy, bad, 400, RULES[shape])
    _origin_untouched(origin, [bad, hidden])


# ---- inside a tunnel to a plain-HTTP port -------------------------------------------------------------

@pytest.mark.parametrize("split", ["with-head", "byte-by-byte"])
@pytest.mark.parametrize("shape", list(BAD_BODIES))
def test_a_bad_body_inside_a_tunnel_to_a_plain_http_port(proxy, origin, shape, split):
    path, hidden = f"/tunnel-{shape}-{split}", f"/hidden-tunnel-{shape}-{split}"
    connections = len(origin.ended)
    sock = tunnel(proxy, _authority(origin))
    with sock:
        head = _head(_authority(origin), path, absolute=False)
        rest = BAD_BODIES[shape] + _smuggled(_authority(origin), hidden)
        if split == "with-head":
            sock.sendall(head + rest)
        else:
            sock.sendall(head)
            time.sleep(0.4)
            _send(sock, [bytes([b]) for b in rest], 0.003)
        raw, closed = _read_to_end(sock, IDLE + 3)
    _answered(raw, 400, RULES[shape])
    assert _statuses(raw) == [400], raw[:400]
    assert closed
    _assert_refused_once(proxy, path, 400, RULES[shape])
    _origin_untouched(origin, [path, hidden])
    # Whatever upstream connection the tunnel opened ends with it.
    deadline = time.monotonic() + IDLE + 5
    while time.monotonic() < deadline and not all(e.is_set() for e in origin.ended[connections:]):
        time.sleep(0.1)
    assert all(e.is_set() for e in origin.ended[connections:]), "an upstream connection of the tunnel stayed open"


# ---- Expect: 100-continue, a policy refusal, a client that leaves ---------------------------------------

@pytest.mark.parametrize("shape", ["negative", "trailers"])
def test_expect_100_continue_then_a_bad_body(proxy, origin, shape):
    path = f"/expect-{shape}"
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(_head(_authority(origin), path, "Expect: 100-continue\r\n"))
        sock.settimeout(1.5)
        early = b""
        with contextlib.suppress(TimeoutError):
            early = sock.recv(65536)  # a 100 Continue, or nothing (the body is sent anyway, as curl does)
        assert not early or early.startswith(b"HTTP/1.1 100"), early
        sock.sendall(BAD_BODIES[shape])
        raw, closed = _read_to_end(sock, IDLE + 3)
    _answered(early + raw, 400, RULES[shape])
    assert closed
    _assert_refused_once(proxy, path, 400, RULES[shape])
    _origin_untouched(origin, [path])


@pytest.mark.parametrize("shape", ["negative", "trailers"])
@pytest.mark.parametrize("split", ["with-head", "after-head", "in-a-tunnel"])
def test_a_bad_body_on_a_request_the_policy_refuses_has_only_the_policy_refusal(proxy, origin, shape, split):
    path = f"/denied/{shape}-{split}"
    in_tunnel = split == "in-a-tunnel"
    with (tunnel(proxy, _authority(origin)) if in_tunnel
          else socket.create_connection((proxy.host, proxy.port), timeout=10)) as sock:
        if split != "after-head":
            sock.sendall(_head(_authority(origin), path, absolute=not in_tunnel) + BAD_BODIES[shape])
        else:
            sock.sendall(_head(_authority(origin), path))
            time.sleep(0.4)
            with contextlib.suppress(OSError):
                sock.sendall(BAD_BODIES[shape])
        raw, closed = _read_to_end(sock, IDLE + 3)
    mine = _records(proxy, path)
    # The client is told (mitmproxy's path closed it without the 403 its record claimed, when the bad
    # framing came with the head: the refusal ran, eagerly, before mitmproxy read those bytes).
    assert _statuses(raw) == [403], (raw[:400], mine)
    assert closed
    assert len(mine) == 1 and mine[0]["verdict"] == "refuse" and mine[0].get("reason"), mine
    _origin_untouched(origin, [path])


@pytest.mark.parametrize("how", ["shutdown", "close"])
@pytest.mark.parametrize("shape", ["negative", "trailers"])
def test_a_client_that_leaves_right_after_the_bad_chunk(proxy, origin, shape, how):
    path = f"/leaves-{shape}-{how}"
    sock = socket.create_connection((proxy.host, proxy.port), timeout=10)
    sock.sendall(_head(_authority(origin), path) + BAD_BODIES[shape])
    if how == "shutdown":
        sock.shutdown(socket.SHUT_WR)
        _read_to_end(sock, IDLE + 3)
    sock.close()
    mine = _records(proxy, path, wait=1.0)
    assert len([r for r in mine if r["event"] == "response"]) == 1 and mine[-1].get("reason"), mine
    assert not [r for r in mine if r.get("status") == 200], mine
    _origin_untouched(origin, [path])
    _still_serves(proxy, origin)


# ---- trailers and the limit ---------------------------------------------------------------------------

@pytest.mark.parametrize("writes", ["one-write", "byte-by-byte-trailer"])
def test_trailers_behind_a_body_over_the_limit(proxy, origin, writes):
    path = f"/over-trailers-{writes}"
    data = b"".join(b"64\r\n" + MARK * 10 + b"\r\n" for _ in range(15))  # 1500 bytes of data, over 1000
    trailer = b"0\r\nX-Trailer: 1\r\n\r\n"
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        if writes == "one-write":
            sock.sendall(_head(_authority(origin), path) + data + trailer)
        else:
            sock.sendall(_head(_authority(origin), path) + data)
            time.sleep(0.3)
            _send(sock, [bytes([b]) for b in trailer], 0.005)
        raw, closed = _read_to_end(sock, IDLE + 3)
    assert _statuses(raw) == [413], raw[:400]
    _answered(raw, 413, "limits.max_request_body")
    assert closed
    _assert_refused_once(proxy, path, 413, "limits.max_request_body")
    _origin_untouched(origin, [path])


def test_a_bad_line_after_data_under_the_limit_with_junk_past_it(proxy, origin):
    """Read in wire order: the data is under the limit when the bad line comes, so it is the framing that
    is refused (400), whatever junk follows in the same write, on both transports."""
    path = "/bad-then-junk"
    body = b"384\r\n" + MARK * 90 + b"\r\n-1\r\n" + b"j" * 5000  # 900 bytes of data, then a negative size
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(_head(_authority(origin), path) + body)
        raw, closed = _read_to_end(sock, IDLE + 3)
    assert _statuses(raw) == [400], raw[:400]
    _answered(raw, 400, "http:bad-chunked")
    _assert_refused_once(proxy, path, 400, "http:bad-chunked")
    _origin_untouched(origin, [path])


def test_trailers_under_the_limit_but_a_trailer_section_over_it(proxy, origin):
    """Trailer lines that together pass limits.max_request_body: refused, one record, nothing forwarded."""
    path = "/many-trailers"
    trailers = b"".join(b"X-T%d: %s\r\n" % (i, b"v" * 50) for i in range(40))  # 2.3 KB of short lines
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(_head(_authority(origin), path) + b"a\r\nSECRETBODY\r\n0\r\n")
        time.sleep(0.3)
        _send(sock, [trailers[i:i + 64] for i in range(0, len(trailers), 64)] + [b"\r\n"], 0.01)
        raw, closed = _read_to_end(sock, IDLE + 3)
    assert len(_statuses(raw)) == 1 and _statuses(raw)[0] in (400, 413), raw[:400]
    assert closed
    mine = _records(proxy, path)
    assert len([r for r in mine if r["event"] == "response"]) == 1 and mine[-1].get("reason"), mine
    _origin_untouched(origin, [path])


# ---- a CONNECT that declares a body -------------------------------------------------------------------

@pytest.mark.parametrize("body", ["negative", "good", "trailers"])
def test_a_connect_that_declares_a_chunked_body(proxy, origin, body):
    """mitmproxy reads a CONNECT's chunked body with the same reader: whatever it makes of it, the proxy
    does not crash, the connection ends, and the request hidden behind it is not sent undecided."""
    hidden = f"/hidden-connect-{body}"
    chunked = {"negative": BAD_BODIES["negative"], "good": b"5\r\nhello\r\n0\r\n\r\n",
               "trailers": BAD_BODIES["trailers"]}[body]
    crashes = proxy.stderr.count("crashed")
    authority = _authority(origin)
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
                     + chunked + f"GET {hidden} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        raw, closed = _read_to_end(sock, IDLE + 3)
    assert closed, f"the connection was neither answered to its end nor closed: {raw[:300]!r}"
    time.sleep(0.3)
    assert proxy.stderr.count("crashed") == crashes, proxy.stderr[-3000:]
    if hidden in origin.paths:
        allowed = [d["path"] for d in proxy.decisions() if d["verdict"] == "allow"]
        assert hidden in allowed, (hidden, allowed[-5:])


def test_the_proxy_is_alive_after_all_of_it(proxy, origin):
    _still_serves(proxy, origin)
    assert proxy.process.poll() is None
    assert "crashed" not in proxy.stderr and "Traceback" not in proxy.stderr, proxy.stderr[-2000:]
