"""A tunnel's first message, read by read: a dripped first head costs the work of its size, not its square.

A CONNECT to a port in both ports.connect and ports.http may carry plain HTTP; its first request head must be
whole and judged before anything reaches the upstream (proxy/first_bytes.py). Judging it once built a new h11
parser over every byte received so far on every read: a 64 KiB head sent a byte at a time cost about 5 s of
the event loop per connection. Now the head's end is searched for in each read's new bytes only
(proxy/head_end.py, shared with the front's head reader) and h11 parses the head once, when it is whole.

The work is counted (bytes searched, parsers built, bytes parsed), never timed: on mitmproxy's path
(``TunnelStart``, driven in-process by mitmproxy events), on the front's first-message reader, and through
the real proxy on both transports (the counts are taken inside the proxy process). Hypothesis checks that
any split of the bytes into reads gives the answer the whole gives at once.
"""

from __future__ import annotations

import json
import socket
import string
import time

import h11
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from patched_gate import patched_gate
from proxyproc import TRANSPORTS, ProxyProcess, parse_response
from rawclient import read_all, tunnel
from tls_build import client_hello, counted_record_headers, padded_hello

from policy.decision import Verdict
from policy.hosts import parse_authority
from proxy import head_end
from proxy.first_bytes import FirstBytes, FirstMessage, classify_tunnel_start
from proxy.gate import Tunnel

HOST = "public.lab.example"
ALLOWED = Verdict(True, "host", "default:allow", "allowed by default", pinned="198.18.0.1")


def long_head(size: int) -> bytes:
    """A valid request head of about ``size`` bytes (one long header)."""
    start = f"GET /drip HTTP/1.1\r\nHost: {HOST}\r\nX-Long: ".encode()
    return start + b"a" * max(0, size - len(start) - 4) + b"\r\n\r\n"


def in_reads(first: FirstMessage, chunks: list[bytes]) -> tuple[FirstBytes, int]:
    """Feed ``chunks`` as reads until one is judged: (the judgement, the index of the read it came at)."""
    judged = FirstBytes.more()
    for index, chunk in enumerate(chunks):
        judged = first.feed(chunk, ech_allowed=True)
        if not judged.need_more:
            return judged, index
    return judged, len(chunks)


class Work:
    """The work judging does, counted by wrapping the real pieces (the real regex and h11 still run)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.scanned = self.searches = self.parsers = self.parsed = 0
        pattern, work = head_end.HEAD_END, self

        class CountingSearch:
            def search(self, data: bytes, pos: int = 0):
                work.searches += 1
                work.scanned += len(data) - pos
                return pattern.search(data, pos)

        class CountingParser(h11.Connection):
            def __init__(self, *args, **kwargs) -> None:
                work.parsers += 1
                super().__init__(*args, **kwargs)

            def receive_data(self, data: bytes) -> None:
                work.parsed += len(data)
                super().receive_data(data)

        monkeypatch.setattr(head_end, "HEAD_END", CountingSearch())
        monkeypatch.setattr(h11, "Connection", CountingParser)


# ---- the reader alone ---------------------------------------------------------------------------------------

def test_a_head_fed_a_byte_at_a_time_is_searched_once_and_parsed_once(monkeypatch):
    work = Work(monkeypatch)
    head = long_head(64 * 1024 - 100)
    first = FirstMessage(HOST, http_inside=True, max_head=64 * 1024)
    judged, at = in_reads(first, [head[i:i + 1] for i in range(len(head))])
    assert (judged.kind, at) == ("http", len(head) - 1)  # judged at its last byte, not before
    assert work.searches >= len(head) - 1  # it did come in that many reads
    assert work.scanned <= 3 * len(head), work.scanned  # each byte searched once (bar two per read)
    # h11: once for the first byte (which it may refuse alone), once for the whole head.
    assert work.parsers <= 2 and work.parsed <= len(head) + 1, (work.parsers, work.parsed)


def test_an_end_split_across_reads_is_found(monkeypatch):
    head = long_head(300)
    for cut in range(len(head) - 4, len(head)):  # every split of the final "\r\n\r\n"
        judged, at = in_reads(FirstMessage(HOST, True), [head[:cut], head[cut:]])
        assert (judged.kind, at) == ("http", 1), cut
    for end in (b"\n\n", b"\n\r\n"):  # what h11 accepts as the end too, split after each byte
        bare = head[:-4] + end
        judged, _ = in_reads(FirstMessage(HOST, True), [bare[i:i + 1] for i in range(len(bare))])
        assert judged.kind == "http", end


def test_a_dripped_head_over_the_limit_is_refused_at_the_limit_without_a_parse(monkeypatch):
    work = Work(monkeypatch)
    endless = b"GET / HTTP/1.1\r\nX: " + b"a" * 5000
    first = FirstMessage(HOST, http_inside=True, max_head=4096)
    judged, at = in_reads(first, [endless[i:i + 1] for i in range(len(endless))])
    assert (judged.rule, at) == ("limits.max_header_bytes", 4096)  # at the first byte past the limit
    assert judged.reason == "the first request head in the tunnel is over 4096 bytes"
    assert work.parsers == 1 and work.scanned <= 3 * 4097  # h11 saw the first byte only
    # A whole head past the limit is refused too, however it comes (it was let through in one read).
    whole = long_head(5000)
    assert classify_tunnel_start(whole, HOST, True, True, max_head=4096).rule == "limits.max_header_bytes"


def test_the_refusals_are_the_ones_of_today():
    assert classify_tunnel_start(b"\x00\x01 not http\r\n\r\n", HOST, True, True).rule == "http:not-http"
    assert classify_tunnel_start(b"\x00", HOST, True, True).rule == "http:not-http"  # told at once, not at a bound
    assert classify_tunnel_start(b"G", HOST, True, True).need_more
    preface = classify_tunnel_start(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", HOST, True, True)
    assert preface.rule == "http:not-http" and "connection preface" in preface.reason
    # A whole head h11 refuses, whose first byte it took, goes to mitmproxy's HTTP layer like the tunnel's later
    # heads (which refuses or decides it as it does the same head outside a tunnel: tests/test_tunnel_first_head.py).
    assert classify_tunnel_start(b"GET / HTTP/1.1\r\n\r\n", HOST, True, True).kind == "http"
    assert classify_tunnel_start(b"HTTP/1.1 200 OK\r\n\r\n", HOST, True, True).kind == "http"
    assert classify_tunnel_start(b"GET / HTTP/1.1\r\nX: a\x0bb\r\n\r\n", HOST, True, True).kind == "http"
    assert classify_tunnel_start(client_hello(HOST.encode()), HOST, True, True).kind == "tls"  # TLS may come too
    assert classify_tunnel_start(b"GET / HTTP/1.1\r\n\r\n", HOST, False, True).rule == "tls:not-tls"


TOKEN = st.text(string.ascii_letters + string.digits + "-", min_size=1, max_size=12).filter(
    lambda name: name.lower() not in ("host", "content-length", "transfer-encoding"))
VALUE = st.text(string.ascii_letters + string.digits + " ;=/.,", max_size=40).map(str.strip)


@st.composite
def heads(draw) -> bytes:
    """A valid HTTP/1.x request head (CRLF or bare LF lines), and maybe what the client sent after it."""
    method = draw(st.sampled_from(["GET", "POST", "PUT", "OPTIONS", "DELETE"]))
    path = "/" + draw(st.text(string.ascii_letters + string.digits + "/-_.", max_size=30))
    newline = draw(st.sampled_from(["\r\n", "\n"]))
    fields = [("Host", HOST), *draw(st.lists(st.tuples(TOKEN, VALUE), max_size=8))]
    head = f"{method} {path} HTTP/{draw(st.sampled_from(['1.0', '1.1']))}{newline}"
    head += "".join(f"{name}: {value}{newline}" for name, value in fields) + newline
    return head.encode() + draw(st.binary(max_size=20))


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = [0, *sorted(cut % (len(data) + 1) for cut in cuts), len(data)]
    return [data[a:b] for a, b in zip(points, points[1:], strict=False)]


@settings(max_examples=300, deadline=None)
@given(heads(), st.lists(st.integers(0, 10_000), max_size=40))
def test_any_split_of_a_valid_head_gives_the_answer_of_the_whole_at_the_read_that_ends_it(data, cuts):
    whole = classify_tunnel_start(data, HOST, True, True)
    assert whole.kind == "http", whole
    chunks = split(data, cuts)
    judged, at = in_reads(FirstMessage(HOST, True), chunks)
    assert judged == whole
    ends_in = next(i for i in range(len(chunks)) if len(b"".join(chunks[:i + 1])) >= head_end.HEAD_END.search(
        data).end())
    assert at == ends_in  # not a read earlier (a fragment) and not later


GARBAGE = st.one_of(
    st.binary(max_size=300),
    st.lists(st.sampled_from([b"\r\n", b"\n", b"\r", b"GET ", b"a", b"\x00", b"\x16", b" ", b"HTTP/1.1", b"/",
                              b"Host: x", b":", b"PRI * HTTP/2.0", b"\x03\x01"]), max_size=60).map(b"".join),
)


def test_a_hello_in_many_records_fed_a_byte_at_a_time_has_each_record_header_read_once(monkeypatch):
    """Read from the start on every read, a 30 KB hello in 255 records, dripped a byte per write, had its
    record headers read 4 million times: seconds of the event loop for one connection (every client waits).
    Each record is read once now: the work of a read no longer grows with the records before it (the
    first record's start and the header of the one being received are looked at again per read)."""
    hello = padded_hello(HOST.encode(), 119)
    records = -(-len(hello) // 124)  # records of 5 + 119 bytes, rounded up
    headers = counted_record_headers(monkeypatch)
    judged, at = in_reads(FirstMessage(HOST, http_inside=False), [hello[i:i + 1] for i in range(len(hello))])
    assert (judged.kind, judged.sni, at) == ("tls", HOST, len(hello) - 1)
    assert 200 < records <= 256
    assert headers[0] <= 2 * len(hello) + records, headers[0]  # was about len(hello) * records / 2


@given(st.integers(1, 400), st.lists(st.integers(0, 40_000), max_size=60))
@settings(max_examples=60, deadline=None)
def test_any_split_of_a_hello_in_any_records_gives_the_answer_of_the_whole_at_its_last_byte(record_size, cuts):
    hello = padded_hello(HOST.encode(), record_size, padding=4_000)
    whole = classify_tunnel_start(hello, HOST, False, True)
    chunks = split(hello, cuts)
    judged, at = in_reads(FirstMessage(HOST, http_inside=False), chunks)
    assert judged == whole  # the same hello (or, past MAX_HELLO_RECORDS records, the same refusal)
    if whole.kind == "tls":  # judged at the read that completes it, not before
        assert sum(len(c) for c in chunks[:at + 1]) == len(hello) and chunks[at] != b""


@settings(max_examples=500, deadline=None)
@given(GARBAGE, st.lists(st.integers(0, 10_000), max_size=40), st.booleans())
def test_any_split_of_any_bytes_gives_the_same_judgement_as_the_whole(data, cuts, http_inside):
    whole = classify_tunnel_start(data, HOST, http_inside, True, max_head=128)
    judged, _ = in_reads(FirstMessage(HOST, http_inside, max_head=128), split(data, cuts))
    assert judged == whole  # the same refusal, rule and reason, or the same "need more"


# ---- mitmproxy's path: TunnelStart, fed by mitmproxy events ------------------------------------------------

@pytest.fixture
def gate(tmp_path):
    with patched_gate(tmp_path, "version: 1\ndefault: allow\n") as gate:
        yield gate


def test_tunnel_start_judges_a_dripped_head_once_and_holds_every_byte_until_then(gate, monkeypatch):
    from mitmproxy.proxy import commands, events
    from mitmproxy.proxy import layer as mlayer
    from mitmproxy.proxy.context import Context
    from mitmproxy.proxy.layers import HttpLayer
    from mitmproxy.test import taddons, tflow

    from proxy.addons.connections import ConnectionTable
    from proxy.addons.tunnel_layers import TunnelStart
    from proxy.addons.tunnel_watch import TunnelWatch

    head = long_head(16 * 1024)
    table = ConnectionTable()
    with taddons.context() as tctx:
        context = Context(tflow.tclient_conn(), tctx.options)
        context.server = tflow.tserver_conn()
        table.tunnels[context.server.id] = Tunnel("t1", parse_authority(f"{HOST}:80"), ALLOWED, "10.0.0.1",
                                                  intercept=False, http_inside=True)
        nextlayer = mlayer.NextLayer(context)
        TunnelWatch(gate, table).next_layer(nextlayer)
        start = nextlayer.layer
        assert isinstance(start, TunnelStart)
        assert [type(c) for c in start.handle_event(events.Start())] == [commands.RequestWakeup]
        work = Work(monkeypatch)  # from the first byte on
        before = [list(start.handle_event(events.DataReceived(context.client, head[i:i + 1])))
                  for i in range(len(head) - 1)]
        assert not any(before)  # nothing to the upstream (nor anywhere) before the head is whole
        assert start.child is None
        handed: list[events.Event] = []
        monkeypatch.setattr(HttpLayer, "handle_event", lambda self, event: handed.append(event) or iter(()))
        list(start.handle_event(events.DataReceived(context.client, head[-1:])))
    assert isinstance(start.child, HttpLayer)
    received = [e for e in handed if isinstance(e, events.DataReceived)]
    assert [e.data for e in received] == [head]  # the whole head, as one event
    assert work.scanned <= 3 * len(head), work.scanned
    assert work.parsers <= 2 and work.parsed <= len(head) + 1, (work.parsers, work.parsed)


# ---- the front's first-message reader -----------------------------------------------------------------------

def test_the_fronts_first_message_reader_feeds_each_read_once(gate, monkeypatch):
    import asyncio

    from proxy.front import Front

    head = long_head(8 * 1024)
    tunnel_ = Tunnel("t2", parse_authority(f"{HOST}:80"), ALLOWED, "10.0.0.1", intercept=False, http_inside=True)
    front = Front(gate, handoff=lambda *a: None)
    work = Work(monkeypatch)

    async def drip():
        reader, writer = socket.socketpair()
        reader.setblocking(False)
        writer.setblocking(False)

        async def write() -> None:
            for i in range(1, len(head)):
                writer.send(head[i:i + 1])
                await asyncio.sleep(0)

        task = asyncio.get_running_loop().create_task(write())
        try:
            return await front._first_message(reader, tunnel_, head[:1])
        finally:
            await task
            reader.close()
            writer.close()

    data, judged = asyncio.run(drip())
    assert data == head and judged.kind == "http"
    assert work.searches > 100  # it did come in many reads
    assert work.scanned <= 3 * len(head), work.scanned
    assert work.parsers <= 2 and work.parsed <= len(head) + 1, (work.parsers, work.parsed)


# ---- through the real proxy, both transports ----------------------------------------------------------------

COUNTING_PRELUDE = """
import json as _json, h11 as _h11
_counts = {"parsers": 0, "parsed": 0}
def _save():
    with open(COUNT_PATH, "w") as f:
        f.write(_json.dumps(_counts))
class _CountingParser(_h11.Connection):
    def __init__(self, *a, **k):
        _counts["parsers"] += 1
        _save()
        super().__init__(*a, **k)
    def receive_data(self, data):
        _counts["parsed"] += len(data)
        _save()
        super().receive_data(data)
_h11.Connection = _CountingParser
"""


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_a_dripped_first_head_in_a_tunnel_is_parsed_once_through_the_real_proxy(lab, tmp_path, transport):
    """Every h11 parser the proxy process builds, and every byte it hands one, counted in that process: the
    CONNECT's own head and the dripped head inside, each parsed about once — not once per read."""
    counts = tmp_path / "h11-counts.json"
    policy = tmp_path / "policy.yaml"
    policy.write_text(lab.policy_text().replace("  connect: [", f"  connect: [{lab.public.port}, "))
    proxy = ProxyProcess(["--policy", str(policy), *TRANSPORTS[transport]], tmp_path / "audit.jsonl",
                         prelude=COUNTING_PRELUDE.replace("COUNT_PATH", repr(str(counts))))
    try:
        path = f"/drip-{transport}"
        head = f"GET {path} HTTP/1.1\r\nHost: {HOST}:{lab.public.port}\r\nX-Long: ".encode()
        head += b"a" * 3000 + b"\r\nConnection: close\r\n\r\n"
        sock = tunnel(proxy, f"{HOST}:{lab.public.port}")
        with sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            before = json.loads(counts.read_text()) if counts.exists() else {"parsers": 0, "parsed": 0}
            for i in range(len(head)):
                sock.send(head[i:i + 1])
                if i % 4 == 0:
                    time.sleep(0.0005)  # so that the proxy gets it in many reads
                if i == len(head) - 2:
                    time.sleep(0.3)
                    assert not [p for _, p, _ in lab.public.requests if p == path]  # not whole: nothing sent on
            status, _, body = parse_response(read_all(sock, 10))
        assert status == 200 and [p for _, p, _ in lab.public.requests if p == path]
        after = json.loads(counts.read_text())
    finally:
        proxy.stop()
    parsers, parsed = after["parsers"] - before["parsers"], after["parsed"] - before["parsed"]
    # Old code: a parser per read over all the bytes so far (hundreds of parsers, megabytes parsed).
    assert parsers <= 4 and parsed <= 2 * len(head) + 200, (parsers, parsed)


RECORD_COUNTING_PRELUDE = """
import json as _json
import proxy.tls_hello as _tls_hello
_counts = {"headers": 0}
_real = _tls_hello.starts_like_tls_record
def _counting(data):
    _counts["headers"] += 1
    if _counts["headers"] % 500 == 0:
        with open(COUNT_PATH, "w") as f:
            f.write(_json.dumps(_counts))
    return _real(data)
_tls_hello.starts_like_tls_record = _counting
"""


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_a_hello_in_many_records_dripped_through_the_real_proxy_is_read_once_and_passes_whole(lab, tmp_path,
                                                                                             transport):
    """The record headers the proxy process's ClientHello reader looks at, counted in that process, for a
    30 KB hello in 250 records sent a byte per write: about two per read (it was the records so far, per
    read: millions), and the hello reaches the upstream whole, after the upstream's banner is let through."""
    from test_review_uvloop import SpeakFirstUpstream, _policy, _recv_until

    counts = tmp_path / "record-counts.json"
    policy = tmp_path / "policy.yaml"
    policy.write_text(_policy(lab))
    upstream = SpeakFirstUpstream()
    proxy = ProxyProcess(["--policy", str(policy), *TRANSPORTS[transport]], tmp_path / "audit.jsonl",
                         prelude=RECORD_COUNTING_PRELUDE.replace("COUNT_PATH", repr(str(counts))))
    hello = padded_hello(HOST.encode(), 121)
    try:
        with tunnel(proxy, f"{HOST}:{upstream.port}") as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for i in range(len(hello)):
                sock.send(hello[i:i + 1])
                if i % 16 == 0:
                    time.sleep(0.0002)  # so that the proxy gets it in many reads
            sock.settimeout(10)
            got = _recv_until(sock, hello)
        assert got == SpeakFirstUpstream.BANNER + hello
        assert upstream.ended_all(1, 10) and bytes(upstream.received[0]) == hello
        headers = json.loads(counts.read_text())["headers"]
    finally:
        proxy.stop()
        upstream.close()
    assert headers <= 2 * len(hello) + 1000, headers  # a few hundred records, two looks per read at most
