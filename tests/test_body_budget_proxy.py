"""Buffered chunked request bodies through the real proxy, on both transports (the fast front's h11 path and
mitmproxy's): the process-wide budget (``limits.max_buffered_request_bodies``, proxy/body_budget.py) and
the body limit counted on the wire (``limits.max_request_body``).

Defects these tests were written for (each failed before its fix):

* a chunked body is read whole before it goes upstream, and nothing bounded all of them together: one
  client with ``limits.max_connections_per_client`` slow uploads held that many times
  ``limits.max_request_body`` (2.5 GiB with the defaults), several clients more;
* only a chunked body's data counted toward ``limits.max_request_body``: one-byte chunks with long chunk
  extensions streamed bytes without end inside one request, each read and dropped (and on mitmproxy's
  path a chunk size line that never ended was buffered without any limit).

Every client here is a loopback address (127.0.0.x, bound as the source), the origin the lab's.
"""

from __future__ import annotations

import contextlib
import re
import select
import socket
import struct
import time
from pathlib import Path

import pytest
from audit_watch import AuditWatch, refusals
from labnet import PUBLIC_IP
from metrics_page import value
from proxyproc import TRANSPORTS, ProxyProcess, parse_response, read_response
from rawclient import read_all

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("internal_saw_nothing")]

BODY_LIMIT, BUDGET, IDLE_TIMEOUT = 100_000, 240_000, 4
SHARE = max(BUDGET // 4, BODY_LIMIT)  # a client's share (proxy/body_budget.py)
GAUGE = "egresswall_buffered_request_body_bytes"
RULE = "limits.max_buffered_request_bodies"


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def proxy(lab, tmp_path_factory, request):
    folder = tmp_path_factory.mktemp("body-budget")
    policy = folder / "policy.yaml"
    # max_header_bytes above the body limit: a size line that never ends is then the body limit's to
    # refuse on both transports (below it, h11 on the fast path refuses the line first, 400).
    policy.write_text(lab.policy_text(limits=f"limits:\n  max_request_body: {BODY_LIMIT}\n"
                                             f"  max_buffered_request_bodies: {BUDGET}\n"
                                             f"  idle_timeout: {IDLE_TIMEOUT}\n  max_header_bytes: 131072\n"))
    process = ProxyProcess(["--policy", str(policy), *TRANSPORTS[request.param]], folder / "audit.jsonl")
    process.transport = request.param
    yield process
    process.stop()
    assert not [e for e in process.outbound() if e["host"] != PUBLIC_IP], process.outbound()


# ---- helpers -------------------------------------------------------------------------------------------

def head(lab, path: str) -> bytes:
    authority = f"public.lab.example:{lab.public.port}"
    return (f"POST http://{authority}{path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def upload(proxy: ProxyProcess, lab, client: str, path: str, first: bytes = b"") -> socket.socket:
    """A chunked POST from ``client`` (a loopback address), its head and ``first`` sent; the rest is the
    caller's."""
    sock = socket.create_connection((proxy.host, proxy.port), timeout=10, source_address=(client, 0))
    sock.sendall(head(lab, path) + first)
    return sock


def finish(sock: socket.socket) -> tuple[int, bytes]:
    with sock:
        sock.sendall(b"0\r\n\r\n")
        status, _, body = parse_response(read_response(sock))
    return status, body


def answer_of(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    with sock:
        return parse_response(read_all(sock, 10))


def held(proxy: ProxyProcess) -> float | None:
    return value(proxy.admin("/metrics")[1], GAUGE)


def wait_held(proxy: ProxyProcess, size: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while held(proxy) != size:
        assert time.monotonic() < deadline, f"{GAUGE} is {held(proxy)}, not {size}"
        time.sleep(0.05)




def requests_to(lab, prefix: str) -> list[str]:
    return [path for _, path, _ in lab.public.requests if path.startswith(prefix)]


# ---- the budget ------------------------------------------------------------------------------------------

def test_concurrent_slow_uploads_past_the_budget_are_refused_503_while_the_earlier_ones_complete(lab, proxy):
    """Four clients, two slow uploads each, 30 000 bytes apiece in three writes: the budget (240 000) is full.
    Two later clients' uploads are refused at their first chunk with 503 and one record each, and reach no
    origin; the earlier eight then complete, whole; the budget is back to 0 and takes a new upload."""
    wait_held(proxy, 0)
    audit = AuditWatch(proxy.log_path).mark()
    tag = f"/budget-{proxy.transport}-{time.monotonic_ns()}"
    early = [(f"127.0.0.{21 + n}", upload(proxy, lab, f"127.0.0.{21 + n}", f"{tag}/early-{n}-{k}"))
             for n in range(4) for k in range(2)]
    for _ in range(3):  # slow: a piece at a time, every upload in turn
        for _, sock in early:
            sock.sendall(chunk(b"e" * 10_000))
        time.sleep(0.1)
    wait_held(proxy, BUDGET)
    late = [upload(proxy, lab, f"127.0.0.{25 + n}", f"{tag}/late-{n}", chunk(b"l" * 1000)) for n in range(2)]
    answers = [answer_of(sock) for sock in late]
    assert [status for status, _, _ in answers] == [503, 503], answers
    assert all(headers["x-egresswall-rule"] == RULE for _, headers, _ in answers), answers
    finished = [finish(sock) for _, sock in early]
    assert finished == [(200, b"got 30000 bytes")] * 8, finished
    wait_held(proxy, 0)
    assert finish(upload(proxy, lab, "127.0.0.25", f"{tag}/again", chunk(b"a" * 50_000))) == (200, b"got 50000 bytes")
    records = audit.wait_for(lambda r: len([x for x in r if x["event"] == "response"]) >= 11)
    refused = refusals(records)
    assert len(refused) == 2, refused
    for record in refused:
        assert (record["status"], record["rule"], record["stage"], record["event"]) == (503, RULE, "limits", "response")
        assert record["client"] in ("127.0.0.25", "127.0.0.26")
        assert (f"egresswall is already buffering {BUDGET} bytes of request bodies, its limit is {BUDGET} ({RULE})"
                in record["reason"]), record
    assert sorted(requests_to(lab, tag)) == sorted([f"{tag}/early-{n}-{k}" for n in range(4) for k in range(2)]
                                                   + [f"{tag}/again"])


def test_one_client_is_held_to_its_share_of_the_budget_and_refused_429(lab, proxy):
    """A client at its share (a quarter of the budget, or one body at the limit if more: 100 000 here) is
    refused 429 for its next piece; another client's uploads go on meanwhile."""
    wait_held(proxy, 0)
    audit = AuditWatch(proxy.log_path).mark()
    tag = f"/share-{proxy.transport}-{time.monotonic_ns()}"
    first = upload(proxy, lab, "127.0.0.31", f"{tag}/first", chunk(b"f" * 60_000))
    second = upload(proxy, lab, "127.0.0.31", f"{tag}/second", chunk(b"s" * 20_000))
    other = upload(proxy, lab, "127.0.0.32", f"{tag}/other", chunk(b"o" * 60_000))
    wait_held(proxy, 140_000)
    second.sendall(chunk(b"s" * 30_000))  # 110 000 for this client: over its share
    status, headers, _ = answer_of(second)
    assert (status, headers["x-egresswall-rule"]) == (429, RULE)
    assert finish(first) == (200, b"got 60000 bytes")
    assert finish(other) == (200, b"got 60000 bytes")
    wait_held(proxy, 0)
    (refused,) = refusals(audit.wait_for(lambda r: len(refusals(r)) >= 1 and len(r) >= 6))
    assert (refused["status"], refused["rule"], refused["client"]) == (429, RULE, "127.0.0.31")
    assert f"client 127.0.0.31 is already buffering 80000 bytes of request bodies, its share is {SHARE}" in \
        refused["reason"], refused
    assert sorted(requests_to(lab, tag)) == [f"{tag}/first", f"{tag}/other"]


def closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """Whether the peer closed (or reset) ``sock`` within ``timeout``, whatever it sent first."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def _reset(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


@pytest.mark.parametrize("ending", ["refused-413", "client-reset", "client-close", "idle-timeout"])
def test_what_a_body_holds_is_given_back_however_its_request_ends(lab, proxy, ending: str):
    """Half a body is held (the gauge says so), then the request ends without going upstream: over the body
    limit (413), a reset, a close, silence past limits.idle_timeout. The budget is back to 0 each time."""
    wait_held(proxy, 0)
    tag = f"/ending-{proxy.transport}-{ending}-{time.monotonic_ns()}"
    sock = upload(proxy, lab, "127.0.0.41", tag, chunk(b"h" * 40_000))
    wait_held(proxy, 40_000)
    if ending == "refused-413":
        with contextlib.suppress(OSError):
            for _ in range(10):
                sock.sendall(chunk(b"h" * 10_000))
        status, headers, _ = answer_of(sock)
        assert (status, headers["x-egresswall-rule"]) == (413, "limits.max_request_body")
    elif ending == "client-reset":
        _reset(sock)
    elif ending == "client-close":
        sock.close()
    else:
        with sock:  # egresswall closes it (with or without an answer): nothing but the close is awaited
            assert closed_by_peer(sock, IDLE_TIMEOUT + 10)
    wait_held(proxy, 0, timeout=IDLE_TIMEOUT + 10)
    assert requests_to(lab, tag) == []
    # And the budget takes a whole body again.
    assert finish(upload(proxy, lab, "127.0.0.41", tag + "-after", chunk(b"a" * 90_000))) == (200, b"got 90000 bytes")
    wait_held(proxy, 0)


def test_an_upload_in_split_slow_writes_is_counted_while_it_comes_and_given_back_after(lab, proxy):
    """Chunks of every size, sent seven bytes a write with each segment its own (size lines, data and line
    ends split anywhere): the gauge shows the body while it comes, the origin gets it whole, then 0."""
    wait_held(proxy, 0)
    pieces = [bytes([65 + n % 26]) * (n * 37 % 1500 + 1) for n in range(60)]
    body = b"".join(chunk(p) for p in pieces) + b"0\r\n\r\n"
    size = sum(map(len, pieces))
    sock = upload(proxy, lab, "127.0.0.42", f"/split-{proxy.transport}")
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    midway = None
    with sock:
        for start in range(0, len(body), 7):
            sock.sendall(body[start:start + 7])
            if start // 7 % 400 == 0:
                time.sleep(0.01)
            if midway is None and start > len(body) // 2:
                time.sleep(0.3)
                midway = held(proxy)
        status, _, answer = parse_response(read_response(sock))
    assert (status, answer) == (200, f"got {size} bytes".encode())
    assert midway is not None and 0 < midway < size, midway
    wait_held(proxy, 0)


# ---- the body limit, counted as sent -----------------------------------------------------------------

def test_a_chunk_extension_flood_is_refused_413_long_before_its_data_reaches_the_limit(lab, proxy):
    """One-byte chunks, each with a 4000-byte extension: refused 413 (limits.max_request_body, counted as
    sent) after about 25 of them; the data sent by then is a few hundred bytes of the 100 000 allowed."""
    audit = AuditWatch(proxy.log_path).mark()
    path = f"/extensions-{proxy.transport}"
    flood = b"1;" + b"a" * 4000 + b"\r\nx\r\n"
    sock = upload(proxy, lab, "127.0.0.43", path)
    data_sent = 0
    with sock:
        with contextlib.suppress(OSError):
            while data_sent < 2000 and not select.select([sock], [], [], 0)[0]:
                sock.sendall(flood)
                data_sent += 1
        status, headers, body = parse_response(read_all(sock, 10))
    assert (status, headers["x-egresswall-rule"]) == (413, "limits.max_request_body"), body[:300]
    assert data_sent < 1000, data_sent  # refused for its framing: about 25 chunks' data when the limit passed
    assert requests_to(lab, path) == []
    (refused,) = refusals(audit.wait_for(lambda r: refusals(r)))
    assert (refused["status"], refused["rule"], refused["event"]) == (413, "limits.max_request_body", "response")
    assert "chunk extensions" in refused["reason"] and str(BODY_LIMIT) in refused["reason"], refused
    wait_held(proxy, 0)


def test_a_chunk_size_line_that_never_ends_is_refused_413_at_the_limit(lab, proxy):
    """``1;aaaa...`` with no line end: nothing of it is data, and mitmproxy's chunk reader buffered it
    without limit. Refused 413 once the body's bytes pass limits.max_request_body."""
    audit = AuditWatch(proxy.log_path).mark()
    path = f"/endless-line-{proxy.transport}"
    sock = upload(proxy, lab, "127.0.0.44", path, b"1;")
    sent = 0
    with sock:
        with contextlib.suppress(OSError):
            while sent < 4 * BODY_LIMIT and not select.select([sock], [], [], 0)[0]:
                sock.sendall(b"a" * 5000)
                sent += 5000
                time.sleep(0.002)
        status, headers, _ = parse_response(read_all(sock, 10))
    assert (status, headers.get("x-egresswall-rule")) == (413, "limits.max_request_body")
    assert requests_to(lab, path) == []
    (refused,) = refusals(audit.wait_for(lambda r: refusals(r)))
    assert (refused["status"], refused["rule"]) == (413, "limits.max_request_body")


def test_a_body_whose_data_fits_but_whose_framing_does_not_is_refused_and_one_that_fits_passes(lab, proxy):
    """The limit is on the body as sent: 99 990 bytes of data in 1000-byte chunks is 100 695 bytes with its
    size lines and line ends, over 100 000; 99 000 bytes in the same chunks (99 698 as sent) passes."""
    over = b"".join(chunk(b"d" * 1000) for _ in range(99)) + chunk(b"d" * 990)
    fits = b"".join(chunk(b"d" * 1000) for _ in range(99))
    assert len(fits) + len(b"0\r\n\r\n") <= BODY_LIMIT < len(over)
    status, headers, _ = answer_of(upload(proxy, lab, "127.0.0.45", f"/framing-over-{proxy.transport}",
                                          over + b"0\r\n\r\n"))
    assert (status, headers.get("x-egresswall-rule")) == (413, "limits.max_request_body")
    assert finish(upload(proxy, lab, "127.0.0.45", f"/framing-fits-{proxy.transport}", fits)) == \
        (200, b"got 99000 bytes")
    wait_held(proxy, 0)


# ---- both transports, one record ---------------------------------------------------------------------

VOLATILE = {"id", "time", "duration_ms"}


def _parity_scenario(proxy: ProxyProcess, lab) -> list[dict]:
    """413 (an extension flood), 429 (a client past its share), 503 (the budget full), each with the held
    bytes settled before it so the records are the same whatever the transport."""
    audit = AuditWatch(proxy.log_path).mark()
    tag = "/parity"
    sock = upload(proxy, lab, "127.0.0.51", f"{tag}/flood")
    with sock, contextlib.suppress(OSError):
        for _ in range(200):
            sock.sendall(b"1;" + b"a" * 100 + b"\r\nx\r\n")
        read_all(sock, 10)
    holding = [upload(proxy, lab, "127.0.0.52", f"{tag}/share-{k}", chunk(b"s" * 900)) for k in range(2)]
    wait_held(proxy, 1800)
    answer_of(upload(proxy, lab, "127.0.0.52", f"{tag}/share-over", chunk(b"s" * 300)))
    holding += [upload(proxy, lab, f"127.0.0.{53 + n}", f"{tag}/fill-{n}-{k}", chunk(b"f" * 900))
                for n in range(3) for k in range(2)]
    wait_held(proxy, 7200)
    answer_of(upload(proxy, lab, "127.0.0.56", f"{tag}/budget-over", chunk(b"b" * 900)))
    for sock in holding:
        assert finish(sock) == (200, b"got 900 bytes")
    wait_held(proxy, 0)
    records = audit.wait_for(lambda r: len(refusals(r)) >= 3 and len(r) >= 14)
    return [{k: v for k, v in r.items() if k not in VOLATILE} for r in refusals(records)]


def test_the_refusals_leave_the_same_records_on_both_transports(lab, start_proxy, tmp_path: Path):
    text = lab.policy_text(limits="limits:\n  max_request_body: 1000\n  max_buffered_request_bodies: 8000\n")
    seen = {}
    for name, flags in TRANSPORTS.items():
        proxy = start_proxy(text, *flags, name=f"policy-{name}.yaml")
        seen[name] = _parity_scenario(proxy, lab)
        proxy.stop()
    fast, mitm = seen["fast"], seen["mitmproxy"]
    assert [(r["status"], r["rule"]) for r in fast] == [(413, "limits.max_request_body"), (429, RULE), (503, RULE)]
    assert fast == mitm
    assert re.search(r"client 127\.0\.0\.52 is already buffering 1800 bytes .* would take 300 more", fast[1]["reason"])
    assert re.search(r"already buffering 7200 bytes of request bodies, its limit is 8000 .* would take 900 more",
                     fast[2]["reason"])


def _endless_line(proxy: ProxyProcess, lab, line: bytes) -> tuple[int, dict[str, str], list[dict]]:
    audit = AuditWatch(proxy.log_path).mark()
    sock = upload(proxy, lab, "127.0.0.61", "/endless", line)
    with sock:
        with contextlib.suppress(OSError):
            for _ in range(100):
                if select.select([sock], [], [], 0)[0]:
                    break
                sock.sendall(b"a" * 1000)
                time.sleep(0.002)
        status, headers, _ = parse_response(read_all(sock, 10))
    wait_held(proxy, 0)
    records = audit.wait_for(lambda r: refusals(r))
    return status, headers, [{k: v for k, v in r.items() if k not in VOLATILE} for r in refusals(records)]


@pytest.mark.parametrize("line", [b"1;", b"5\r\nhello\r\n0\r\nX-Trailer: "], ids=["size-line", "trailer"])
def test_a_chunked_body_line_longer_than_a_head_is_refused_400_alike_on_both_transports(lab, start_proxy, line):
    """Under the body limit but over limits.max_header_bytes, a line that never ends (a size line's extension,
    a trailer): h11 refuses it on the fast path, and mitmproxy's reader, which held it without limit, now
    does too at the same bound; the same 400 and record on both."""
    text = lab.policy_text(limits="limits:\n  max_request_body: 1000000\n  max_header_bytes: 4096\n")
    seen = {}
    for name, flags in TRANSPORTS.items():
        proxy = start_proxy(text, *flags, name=f"policy-{name}.yaml")
        status, headers, records = _endless_line(proxy, lab, line)
        assert (status, headers.get("x-egresswall-rule")) == (400, "http:bad-chunked"), name
        seen[name] = records
        proxy.stop()
    (fast,) = seen["fast"]
    assert seen["mitmproxy"] == [fast]
    assert (fast["status"], fast["rule"], fast["event"]) == (400, "http:bad-chunked", "response")
    assert "over 4096 bytes (limits.max_header_bytes) and has not ended" in fast["reason"], fast
    assert not [p for _, p, _ in lab.public.requests if p == "/endless"]
