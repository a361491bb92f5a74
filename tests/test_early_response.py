"""An origin that answers before it has read the request body, on both transports.

RFC 9110 lets a server answer before it has the content (a 413, a 401, a redirect) and stop reading it. The
fast path sent the whole body before it read any response, so with an origin that no longer read, the answer
waited behind the body until limits.idle_timeout and the client got a reset instead (mitmproxy's path relayed
it at once). Now the fast path listens to the origin while a body goes up (proxy/early_response.py): a final
response that begins is relayed at once, beside the body, which goes on while the origin takes it. So a
full-duplex origin (it streams its answer while it reads) gets the whole body, and an unasked
``100 Continue`` changes nothing. mitmproxy's path, for its part, closed the client's connection at once
after such an answer, and the reset of a socket closed with bytes unread destroyed the answer before a client
still sending had read it; both paths close lingering now.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import time

import pytest
from hostile import _Server
from proxyproc import both_transports

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("internal_saw_nothing")]

BODY = 8_000_000  # far more than the sockets between client, proxy and origin hold


def _length_and_rest(head: bytes) -> tuple[int, bytes]:
    """A request's Content-Length, and the body bytes read with its head (hostile.read_head reads past it)."""
    head, _, rest = head.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    return length, rest


class AnswersFirst(_Server):
    """Answers 413 as soon as it has the head, then reads nothing more for a while."""

    def handle(self, conn: socket.socket, head: bytes) -> None:
        conn.sendall(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 5\r\nConnection: close\r\n\r\nlarge")
        time.sleep(8)


class AnswersThenDrains(_Server):
    """Answers 413 as soon as it has the head, shuts its sending side, reads and drops the body for a while
    (a lingering close, as nginx does), then closes."""

    def handle(self, conn: socket.socket, head: bytes) -> None:
        conn.sendall(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 5\r\nConnection: close\r\n\r\nlarge")
        conn.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and conn.recv(65536):
            pass


class EchoesAsItReads(_Server):
    """Answers 200 at once with a chunked body that echoes the request body as it reads it."""

    def handle(self, conn: socket.socket, head: bytes) -> None:
        length, chunk = _length_and_rest(head)
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        # The head may come alone (no body bytes in the read that ended it): read on until the whole body has
        # come or the peer has gone, not until the first empty chunk.
        while length > 0:
            if not chunk and not (chunk := conn.recv(min(65536, length))):
                break
            length -= len(chunk)
            conn.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            chunk = b""
        conn.sendall(b"0\r\n\r\n")


class ContinuesUnasked(_Server):
    """Sends ``100 Continue`` nobody asked for, then reads the whole body and says how much came."""

    def handle(self, conn: socket.socket, head: bytes) -> None:
        length, already = _length_and_rest(head)
        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        got = len(already)
        while got < length and (chunk := conn.recv(65536)):
            got += len(chunk)
        answer = str(got).encode()
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(answer), answer))


def _proxy(lab, start_proxy, origin: _Server, limits: str = ""):
    return start_proxy(lab.policy_text(limits=limits).replace("  http: [", f"  http: [{origin.port}, "))


def _post(proxy, origin: _Server, body: bytes, chunked: bool = False, seconds: float = 10,
          read_after: float = 0.0) -> tuple[bytes, int]:
    """POST ``body`` through the proxy, writing as fast as the socket takes it while reading what comes back
    (from ``read_after`` seconds on), until the answer has ended, the connection closed or time ran out: (what
    came back, body bytes sent)."""
    authority = f"public.lab.example:{origin.port}"
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}"
    wire = (b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)) if chunked else body
    sock = socket.create_connection((proxy.host, proxy.port), timeout=10)
    sock.sendall(f"POST http://{authority}/up HTTP/1.1\r\nHost: {authority}\r\n{framing}\r\n\r\n".encode())
    sock.setblocking(False)
    got, sent = b"", 0
    deadline, reading = time.monotonic() + seconds, time.monotonic() + read_after
    with contextlib.suppress(ConnectionResetError, BrokenPipeError), sock:
        while time.monotonic() < deadline and not got.endswith((b"\r\n0\r\n\r\n", b"large")) \
                and not (got.startswith(b"HTTP/1.1 200 OK\r\nContent-Length") and b"\r\n\r\n" in got
                         and got.split(b"\r\n\r\n", 1)[1].isdigit() and len(got.split(b"\r\n\r\n", 1)[1]) >= 7):
            with contextlib.suppress(BlockingIOError):
                if sent < len(wire):
                    sent += sock.send(wire[sent:sent + 65536])
            if time.monotonic() < reading:
                continue
            with contextlib.suppress(BlockingIOError):
                chunk = sock.recv(1 << 20)
                if not chunk:
                    break
                got += chunk
            time.sleep(0.0005)
    return got, sent


@both_transports
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_an_answer_before_the_body_is_relayed_at_once(lab, start_proxy, chunked):
    origin = AnswersFirst()
    try:
        proxy = _proxy(lab, start_proxy, origin)
        started = time.monotonic()
        got, _ = _post(proxy, origin, b"x" * BODY, chunked)
        assert got.startswith(b"HTTP/1.1 413 Payload Too Large") and got.endswith(b"large"), got[:200]
        assert time.monotonic() - started < 5, "the answer waited behind the body"
        records = [r for r in proxy.audit() if r["event"] == "response"]
        assert [(r["status"], r["error"]) for r in records] == [(413, None)], records
    finally:
        origin.close()


@both_transports
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_an_answer_then_a_drain_reaches_a_client_still_sending(lab, start_proxy, chunked):
    """The origin answers and ends its side; the proxy ends the client's connection, which is still sending
    its body and reads the answer only half a second later. Closed at once with the client's bytes unread,
    the socket sent a reset, which destroyed the answer before the client read it (mitmproxy's path; the
    fast path reads and drops for a moment first). Both close lingering now (mitm_patches.AnsweringWriter)."""
    origin = AnswersThenDrains()
    try:
        proxy = _proxy(lab, start_proxy, origin)
        got, _ = _post(proxy, origin, b"x" * BODY, chunked, read_after=0.5)
        assert got.startswith(b"HTTP/1.1 413 Payload Too Large") and got.endswith(b"large"), got[:200]
    finally:
        origin.close()


@both_transports
def test_a_full_duplex_origin_gets_the_whole_body_while_its_answer_streams(lab, start_proxy):
    origin = EchoesAsItReads()
    try:
        proxy = _proxy(lab, start_proxy, origin, limits="limits:\n  max_request_body: 40000000\n")
        body = bytes(range(256)) * (32_000_000 // 256)  # more than every socket buffer on the way holds
        got, sent = _post(proxy, origin, body, seconds=20)
        head, _, chunked = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), got[:200]
        echoed = bytearray()
        while chunked:
            size_line, _, chunked = chunked.partition(b"\r\n")
            size = int(size_line, 16)
            echoed += chunked[:size]
            chunked = chunked[size + 2:]
            if size == 0:
                break
        assert sent == len(body) and bytes(echoed) == body, (sent, len(echoed))
    finally:
        origin.close()


@both_transports
def test_an_unasked_100_continue_leaves_the_body_going(lab, start_proxy):
    origin = ContinuesUnasked()
    try:
        proxy = _proxy(lab, start_proxy, origin)
        got, sent = _post(proxy, origin, b"y" * BODY)
        assert sent == BODY and got.startswith(b"HTTP/1.1 200 OK"), got[:200]
        assert got.endswith(str(BODY).encode()), got[-200:]
        assert b"100 Continue" not in got
    finally:
        origin.close()


class Resets(_Server):
    """Reads what came with the head, then resets the connection (SO_LINGER 0) without a word."""

    def handle(self, conn: socket.socket, head: bytes) -> None:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()


@both_transports
@pytest.mark.parametrize("size", [0, BODY], ids=["no-body", "body"])
def test_an_origin_that_resets_gets_the_client_a_502(lab, start_proxy, size):
    """The fast path left the client with a reset of its own when the origin reset before answering (the
    send or the read failed); mitmproxy's path answers 502. Both answer 502 now, with one record."""
    origin = Resets()
    try:
        proxy = _proxy(lab, start_proxy, origin)
        got, _ = _post(proxy, origin, b"z" * size, seconds=5)
        assert got.startswith(b"HTTP/1.1 502 Bad Gateway"), got[:200]
        records = [r for r in proxy.audit() if r["event"] == "response"]
        assert [r["status"] for r in records] == [502] and records[0]["error"], records
    finally:
        origin.close()
