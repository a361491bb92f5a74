"""Review round 14: an origin's answer before the request body is sent (proxy/early_response.py and its use in
proxy/fast_http.py), attacked from a hostile origin and a hostile client, on both transports."""

from __future__ import annotations

import contextlib
import os
import socket
import time

import pytest
from hostile import _Server
from proxyproc import both_transports

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("internal_saw_nothing")]

BODY = 8_000_000


def _length_and_rest(head: bytes) -> tuple[int, bytes]:
    head, _, rest = head.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    return length, rest


class Early(_Server):
    """Sends ``answer`` once it has the head, then reads ``read`` bytes of the body (counting them in
    ``received``), then waits ``hold`` seconds, then closes (``close``: plainly; ``rst``: with a reset)."""

    def __init__(self, answer: bytes | list[bytes], read: int = 0, hold: float = 8.0, rst: bool = False,
                 gap: float = 0.0) -> None:
        self.answer = answer if isinstance(answer, list) else [answer]
        self.read, self.hold, self.rst, self.gap = read, hold, rst, gap
        self.received = 0
        self.heads: list[bytes] = []
        super().__init__()

    def handle(self, conn: socket.socket, head: bytes) -> None:
        self.heads.append(head)
        _, rest = _length_and_rest(head)
        self.received += len(rest)
        for piece in self.answer:
            conn.sendall(piece)
            if self.gap:
                time.sleep(self.gap)
        while self.received < self.read and (chunk := conn.recv(65536)):
            self.received += len(chunk)
        if self.rst:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            return
        time.sleep(self.hold)


def _proxy(lab, start_proxy, origin, limits: str = ""):
    return start_proxy(lab.policy_text(limits=limits).replace("  http: [", f"  http: [{origin.port}, "))


def post(proxy, port: int, body: bytes, chunked: bool = False, seconds: float = 10, after: bytes = b"",
         stop_at: int | None = None, until=None) -> tuple[bytes, int, float]:
    """POST ``body`` (then ``after``) writing as the socket takes it and reading at the same time, until the
    proxy closes, time runs out, or ``until(got)``: (what came back, bytes sent, seconds taken)."""
    authority = f"public.lab.example:{port}"
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}"
    wire = (b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)) if chunked else body
    wire += after
    if stop_at is not None:
        wire = wire[:stop_at]
    sock = socket.create_connection((proxy.host, proxy.port), timeout=10)
    sock.sendall(f"POST http://{authority}/up HTTP/1.1\r\nHost: {authority}\r\n{framing}\r\n\r\n".encode())
    sock.setblocking(False)
    got, sent = b"", 0
    started = time.monotonic()
    deadline = started + seconds
    with contextlib.suppress(ConnectionResetError, BrokenPipeError), sock:
        while time.monotonic() < deadline and not (until and until(got)):
            with contextlib.suppress(BlockingIOError):
                if sent < len(wire):
                    sent += sock.send(wire[sent:sent + 65536])
            with contextlib.suppress(BlockingIOError):
                chunk = sock.recv(1 << 20)
                if not chunk:
                    break
                got += chunk
            time.sleep(0.0005)
    return got, sent, time.monotonic() - started


def responses(proxy) -> list[dict]:
    return [r for r in proxy.audit() if r["event"] == "response"]


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


FINAL_413 = b"HTTP/1.1 413 Too Large\r\nContent-Length: 5\r\n\r\nlarge"


@both_transports
@pytest.mark.parametrize("interim", [b"HTTP/1.1 100 Continue\r\n\r\n",
                                     b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n",
                                     b"HTTP/1.1 100 Continue\n\n"],  # h11 ends a head at a bare LF too
                         ids=["100", "103", "100-bare-lf"])
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_an_answer_after_an_interim_one_is_relayed_at_once(lab, start_proxy, interim, chunked):
    """An origin that sends an interim response, then its final answer, and then reads no more: the answer
    is relayed at once (the listener went on after the interim one), not held behind the body until
    limits.idle_timeout and then lost in a reset (mitmproxy's path relays it at once)."""
    origin = Early([interim, FINAL_413], hold=8, gap=0.05)  # the two come in reads of their own
    try:
        proxy = _proxy(lab, start_proxy, origin, limits="limits:\n  idle_timeout: 6\n")
        got, _, took = post(proxy, origin.port, b"x" * BODY, chunked, seconds=10,
                            until=lambda g: g.endswith(b"large"))
        assert got.startswith(b"HTTP/1.1 413 Too Large") and got.endswith(b"large"), got[:200]
        assert b" 10" not in got.split(b"\r\n", 1)[0] and b"Continue" not in got and b"Early" not in got
        assert took < 3, f"the answer waited {took:.1f}s behind the body"
        time.sleep(0.5)
        assert [(r["status"], r["error"]) for r in responses(proxy)] == [(413, None)], responses(proxy)
    finally:
        origin.close()


@both_transports
def test_an_unasked_101_before_the_body_is_refused_at_once(lab, start_proxy):
    """A 101 the request did not ask for, sent before the body: refused with 502 at once (never relayed),
    not taken for an interim response that leaves the body waiting on an origin that no longer reads."""
    origin = Early(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\nConnection: upgrade\r\n\r\nraw bytes",
                   hold=8)
    try:
        proxy = _proxy(lab, start_proxy, origin, limits="limits:\n  idle_timeout: 6\n")
        got, _, took = post(proxy, origin.port, b"x" * BODY, seconds=10, until=lambda g: b"\r\n\r\n" in g)
        assert got.startswith(b"HTTP/1.1 502"), got[:200]
        assert b"101" not in got.split(b"\r\n", 1)[0] and b"raw bytes" not in got
        assert took < 3, f"the refusal waited {took:.1f}s"
    finally:
        origin.close()


@both_transports
@pytest.mark.parametrize("answer", [b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial", b""],
                         ids=["early-answer-broken-off", "no-answer"])
def test_a_body_cut_short_is_recorded_with_the_bytes_that_went_up(lab, start_proxy, answer):
    """The origin takes a megabyte of the body, then resets (after an early answer it breaks off, or without
    one): the record's bytes_up has the body's bytes that went up, not 0 (they are what a session's
    request_bytes budget is charged with)."""
    origin = Early(answer, read=1_000_000, rst=True)
    try:
        proxy = _proxy(lab, start_proxy, origin)
        post(proxy, origin.port, b"x" * BODY, seconds=5)
        time.sleep(0.5)
        records = responses(proxy)
        assert len(records) == 1 and records[0]["error"], records
        assert origin.received >= 1_000_000
        assert records[0]["bytes_up"] >= origin.received, (records[0]["bytes_up"], origin.received)
    finally:
        origin.close()


class AnswersFirstKeepsReading(_Server):
    """Answers 413 at once (keep-alive: no Connection: close), then reads and keeps every head-like line it
    gets on the connection, and answers each with a 200 that names what it took for its request line."""

    def __init__(self) -> None:
        self.heads: list[bytes] = []
        self.taken = b""
        super().__init__()

    def handle(self, conn: socket.socket, head: bytes) -> None:
        self.heads.append(head)
        conn.sendall(FINAL_413)
        conn.settimeout(3)
        with contextlib.suppress(OSError):
            while chunk := conn.recv(65536):
                self.taken += chunk
                if b"GET http" in self.taken or b"GET /smuggled" in self.taken:
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nsmuggled")


@both_transports
def test_a_request_inside_a_body_answered_early_is_never_read_as_one(lab, start_proxy):
    """The body's bytes after the origin's early answer look like requests (to a path the policy would
    decide on its own): they stay body bytes the origin may take, never a request of the client's (no
    decision for it), and what the origin sends after its answer (a 200 to the look-alike) is not relayed."""
    origin = AnswersFirstKeepsReading()
    try:
        proxy = _proxy(lab, start_proxy, origin)
        authority = f"public.lab.example:{origin.port}"
        fake = f"GET http://{authority}/smuggled HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode()
        body = fake * (2_000_000 // len(fake))
        got, _, _ = post(proxy, origin.port, body, seconds=8)
        assert got.startswith(b"HTTP/1.1 413") and got.endswith(b"large"), got[:200]
        assert b"smuggled" not in got and got.count(b"HTTP/1.1") == 1, got[:300]
        time.sleep(0.5)
        assert len(origin.heads) == 1 and origin.connections == 1
        decisions = [r for r in proxy.decisions() if r.get("path") == "/smuggled"]
        assert not decisions, decisions
        assert [(r["status"], r["error"]) for r in responses(proxy)] == [(413, None)], responses(proxy)
    finally:
        origin.close()


@both_transports
def test_a_client_that_half_closes_mid_body_still_gets_the_early_answer(lab, start_proxy):
    """The client sends a part of its body, reads nothing yet, then half-closes: the origin's early answer
    is still relayed in full, and the exchange has one response record, the answer's status."""
    origin = Early(FINAL_413, hold=4)
    try:
        proxy = _proxy(lab, start_proxy, origin)
        authority = f"public.lab.example:{origin.port}"
        with socket.create_connection((proxy.host, proxy.port), timeout=8) as sock:
            sock.sendall(f"POST http://{authority}/up HTTP/1.1\r\nHost: {authority}\r\n"
                         f"Content-Length: {BODY}\r\n\r\n".encode() + b"x" * 100_000)
            time.sleep(0.3)
            sock.shutdown(socket.SHUT_WR)
            got = b""
            with contextlib.suppress(OSError):
                while not got.endswith(b"large") and (chunk := sock.recv(65536)):
                    got += chunk
        assert got.startswith(b"HTTP/1.1 413") and got.endswith(b"large"), got[:200]
        time.sleep(0.5)
        records = responses(proxy)
        assert [r["status"] for r in records] == [413], records
        assert 0 < records[0]["bytes_up"] <= 100_000, records
    finally:
        origin.close()


class TrickledHead(_Server):
    """Answers at once with a status line, then header lines of 1 KB each, one every ``interval`` seconds,
    and never reads the body."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        super().__init__()

    def handle(self, conn: socket.socket, head: bytes) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\n")
        deadline = time.monotonic() + 15
        while not self.closed.is_set() and time.monotonic() < deadline:
            conn.sendall(b"X-Trickle: " + b"a" * 1000 + b"\r\n")
            time.sleep(self.interval)


@both_transports
@pytest.mark.parametrize("interval", [0.0005, 0.2], ids=["fast", "slow"])
def test_an_early_head_that_never_ends_is_bounded(lab, start_proxy, interval):
    """An early answer whose head never ends, sent fast (over limits.max_header_bytes) or trickled (past
    limits.header_timeout): refused with 502 within the bound, nothing of it relayed."""
    origin = TrickledHead(interval)
    try:
        proxy = _proxy(lab, start_proxy, origin, limits="limits:\n  header_timeout: 2\n  max_header_bytes: 16384\n")
        got, _, took = post(proxy, origin.port, b"x" * BODY, seconds=10, until=lambda g: b"\r\n\r\n" in g)
        assert b"X-Trickle" not in got and b"200 OK" not in got, got[:200]
        assert took < 6, took
        time.sleep(0.5)
        records = responses(proxy)
        assert len(records) <= 1 and all(r["status"] in (502, None) for r in records), records
    finally:
        origin.close()


@both_transports
def test_many_early_answers_leave_no_descriptor_behind(lab, start_proxy):
    """Forty exchanges answered early (a 413, garbage, an answer broken off, a 100 then a 413), with the
    client going away in different ways: the proxy's open descriptors come back to what they were, and each
    exchange has its one response record."""
    answers = [FINAL_413, b"GARBAGE\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npart",
               [b"HTTP/1.1 100 Continue\r\n\r\n", FINAL_413]]
    origins = [Early(answer, hold=0.5, gap=0.02) for answer in answers]
    try:
        policy = lab.policy_text().replace("  http: [", "  http: [" + "".join(f"{o.port}, " for o in origins))
        proxy = start_proxy(policy)
        post(proxy, origins[0].port, b"x" * 1000, seconds=3, until=lambda g: g.endswith(b"large"))
        time.sleep(0.5)
        before = fds(proxy.process.pid)
        for round_ in range(10):
            for index, origin in enumerate(origins):
                seconds = 0.3 if (round_ + index) % 3 == 0 else 3  # some clients leave before the end
                post(proxy, origin.port, b"x" * 2_000_000, seconds=seconds,
                     until=lambda g: g.endswith((b"large", b"part")) or b"\r\n\r\n" in g and b"502" in g[:12])
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline and fds(proxy.process.pid) > before:
            time.sleep(0.2)
        assert fds(proxy.process.pid) <= before, (before, os.listdir(f"/proc/{proxy.process.pid}/fd"))
        records = responses(proxy)
        assert len(records) == 41, [(r["status"], r["error"]) for r in records]
        assert all(r["status"] is None or 100 <= r["status"] < 600 for r in records)
    finally:
        for origin in origins:
            origin.close()
