"""The plain-HTTP fast path's parser decisions (proxy/http_head.py, proxy/fast_http.py), as pure code.

A head the fast path takes must have one reading: h11 (which then parses it) and mitmproxy's own HTTP/1
reader must read the same method, target and headers, and the target the fast path hands the gate must
be the one the mitmproxy addon would hand it. Every framing that could be read two ways is not taken.
"""

from __future__ import annotations

import h11
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from mitmproxy.net.http.http1 import read_request_head
from url_forms import urls

from policy.hosts import HostFormError
from proxy.fast_http import _forwarded_request_headers, _forwarded_response_headers, ask_of
from proxy.gate import HttpAsk, plain_target
from proxy.http_head import NotTaken, PlainRequest, take_head

A = "public.lab.example:8080"
GET = f"GET http://{A}/p HTTP/1.1\r\nHost: {A}\r\n"
POST = f"POST http://{A}/p HTTP/1.1\r\nHost: {A}\r\n"

# Every shape of tests/test_hardening_adversarial.py's smuggling list, and more: none is the fast path's.
NOT_TAKEN = {
    "cl-and-te": POST + "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
    "te-and-cl": POST + "Transfer-Encoding: chunked\r\nContent-Length: 40\r\n\r\n",
    "duplicate-cl": POST + "Content-Length: 5\r\nContent-Length: 6\r\n\r\n",
    "duplicate-cl-same": POST + "Content-Length: 5\r\nContent-Length: 5\r\n\r\n",
    "cl-list": POST + "Content-Length: 5, 5\r\n\r\n",
    "cl-plus": POST + "Content-Length: +5\r\n\r\n",
    "cl-hex": POST + "Content-Length: 0x5\r\n\r\n",
    "duplicate-te": POST + "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n",
    "te-list": POST + "Transfer-Encoding: gzip, chunked\r\n\r\n",
    "unknown-te": POST + "Transfer-Encoding: xchunked\r\n\r\n",
    "te-identity": POST + "Transfer-Encoding: identity\r\nContent-Length: 5\r\n\r\n",
    "space-before-colon": POST + "Transfer-Encoding : chunked\r\n\r\n",
    "negative-cl": POST + "Content-Length: -1\r\n\r\n",
    "te-on-http10": POST.replace("HTTP/1.1", "HTTP/1.0") + "Transfer-Encoding: chunked\r\n\r\n",
    "obs-fold": GET + "X-Folded: a\r\n b\r\n\r\n",
    "obs-fold-tab": GET + "X-Folded: a\r\n\tb\r\n\r\n",
    "obs-fold-host": GET.replace(f"Host: {A}\r\n", f"Host: {A}\r\n internal.lab.example\r\n") + "\r\n",
    "bare-cr-in-value": GET + "X-A: a\rTransfer-Encoding: chunked\r\n\r\n",
    "bare-lf": GET.replace("\r\n", "\n") + "\n",
    "bare-lf-one-line": GET + "X-A: a\nX-B: b\r\n\r\n",
    "nul-in-value": GET + "X-A: a\x00b\r\n\r\n",
    "non-ascii-value": GET + "X-A: caf\xe9\r\n\r\n",
    "bad-request-line": f"GET http://{A}/ HTTP/1.1 extra\r\nHost: {A}\r\n\r\n",
    "header-without-colon": GET + "NoColonHere\r\n\r\n",
    "no-host": f"GET http://{A}/ HTTP/1.1\r\n\r\n",
    "two-hosts": GET + f"Host: {A}\r\n\r\n",
    "origin-form": f"GET /p HTTP/1.1\r\nHost: {A}\r\n\r\n",
    "https-absolute": f"GET https://{A}/p HTTP/1.1\r\nHost: {A}\r\n\r\n",
    "upper-scheme": f"GET HTTP://{A}/p HTTP/1.1\r\nHost: {A}\r\n\r\n",
    "userinfo": f"GET http://u:p@{A}/p HTTP/1.1\r\nHost: {A}\r\n\r\n",
    "backslash": f"GET http://{A}\\p HTTP/1.1\r\nHost: {A}\r\n\r\n",
    "percent-host": f"GET http://public%2elab.example/p HTTP/1.1\r\nHost: {A}\r\n\r\n",
    "fragment": f"GET http://{A}/p#f HTTP/1.1\r\nHost: {A}\r\n\r\n",
    "query-without-path": f"GET http://{A}?@evil.example HTTP/1.1\r\nHost: {A}\r\n\r\n",
    "websocket": GET + "Connection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
    "h2c": GET + "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n",
    "expect": POST + "Content-Length: 5\r\nExpect: 100-continue\r\n\r\n",
    "connect": f"CONNECT {A} HTTP/1.1\r\nHost: {A}\r\n\r\n",
    "trace": f"TRACE http://{A}/ HTTP/1.1\r\nHost: {A}\r\n\r\n",
    "lower-method": f"get http://{A}/ HTTP/1.1\r\nHost: {A}\r\n\r\n",
    "http2-version": f"GET http://{A}/ HTTP/2.0\r\nHost: {A}\r\n\r\n",
    "port-out-of-range": f"GET http://public.lab.example:65536/ HTTP/1.1\r\nHost: {A}\r\n\r\n",
    "port-zero": f"GET http://public.lab.example:0/ HTTP/1.1\r\nHost: {A}\r\n\r\n",
    "double-space": f"GET  http://{A}/ HTTP/1.1\r\nHost: {A}\r\n\r\n",
    "head-not-ended": GET + "\r\n",
}


@pytest.mark.parametrize("case", list(NOT_TAKEN))
def test_heads_with_a_second_reading_are_not_taken(case):
    data = NOT_TAKEN[case]
    head = data.encode("latin-1") if case != "head-not-ended" else data.encode()[:-2]
    assert isinstance(take_head(head), NotTaken), case


def test_a_plain_get_and_a_framed_post_are_taken():
    got = take_head((GET + "Accept: */*\r\nProxy-Authorization: Basic eDp5\r\n\r\n").encode())
    assert isinstance(got, PlainRequest)
    assert (got.method, got.host, got.port, got.path, got.content_length, got.chunked) == (
        "GET", "public.lab.example", 8080, "/p", None, False)
    assert got.values("proxy-authorization") == ("Basic eDp5",)
    post = take_head((POST + "Transfer-Encoding: Chunked\r\n\r\n").encode())
    assert isinstance(post, PlainRequest) and post.chunked and post.content_length is None
    v6 = take_head(b"GET http://[2001:db8::1]:81 HTTP/1.0\r\nHost: [2001:db8::1]:81\r\n\r\n")
    assert isinstance(v6, PlainRequest) and (v6.host, v6.port, v6.path, v6.version) == ("2001:db8::1", 81, "/", "1.0")


# ---- one reading: h11 and mitmproxy agree with every head the fast path takes ---------------------

_CLEAN_NAMES = st.sampled_from(["Accept", "X-A", "Cookie", "User-Agent", "Connection", "Content-Length",
                                "Transfer-Encoding", "Proxy-Authorization", "HOST"])
_HOSTILE_NAMES = st.sampled_from(["Host", "Upgrade", "Expect", "content-length", "X A", "X:A", "", "X\tA"])
_CLEAN_VALUES = st.sampled_from([A, "*/*", "5", "0", "chunked", "close", "keep-alive, X-A", "a b", "a\tb", "x=1; y=2"])
_HOSTILE_VALUES = st.sampled_from([" a ", "a\r\n b", "a\rb", "a\nb", "\x00", "caf\xe9", "5, 5", "-1", "websocket", "",
                                   "100-continue", "\t", "chunked, chunked", "\x7f"])
_CLEAN_TARGETS = st.sampled_from([f"http://{A}/p?q=1", "http://1.2.3.4/", "http://[::1]:8/x", "http://a.example",
                                  "http://A.Example.:81/%41?x=%20", "http://xn--bcher-kva.example/", "http://a-b.c/d;e",
                                  "http://[::ffff:1.2.3.4]/", "http://0x7f.1/", "http://a..b/", "http://localhost/",
                                  "http://a.example:080/", "http://2130706433/"])
_LINE_ENDS = st.sampled_from(["\r\n", "\r\n", "\r\n", "\n", "\r"])


def _mostly(draw, clean, hostile):
    return draw(clean) if draw(st.integers(0, 4)) else draw(hostile)


@st.composite
def heads(draw) -> bytes:
    """Request heads that are mostly clean: a fair share is taken, and each hostile piece is tried alone."""
    method = _mostly(draw, st.sampled_from(["GET", "POST", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH"]),
                     st.sampled_from(["TRACE", "get", "CONNECT", "G ET"]))
    target = _mostly(draw, _CLEAN_TARGETS, urls())
    version = _mostly(draw, st.sampled_from(["HTTP/1.1", "HTTP/1.0"]),
                      st.sampled_from(["HTTP/2", "HTTP/1.1 ", "http/1.1"]))
    lines = [f"{method} {target} {version}"]
    if draw(st.integers(0, 9)):
        lines.append(f"Host: {A}")
    count = draw(st.integers(0, 4))
    lines += [f"{_mostly(draw, _CLEAN_NAMES, _HOSTILE_NAMES)}: {_mostly(draw, _CLEAN_VALUES, _HOSTILE_VALUES)}"
              for _ in range(count)]
    end = _mostly(draw, st.just("\r\n"), _LINE_ENDS)
    return (end.join(lines) + end + end).encode("utf-8", "surrogatepass")


def _mitmproxy_reads(head: bytes):
    lines = head.split(b"\r\n")[:-2]
    try:
        return read_request_head([line + b"\r\n" for line in lines])
    except ValueError:
        return None


@settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
@given(head=heads())
@example(head=(GET + "Content-Length: 5\r\n\r\n").encode())
@example(head=b"GET http://XN--ZCA.com/ HTTP/1.1\r\nHost: xn--zca.com\r\n\r\n")
def test_a_taken_head_has_one_reading(head):
    request = take_head(head)
    if isinstance(request, NotTaken):
        return
    assert head.endswith(b"\r\n\r\n") and b"\n" not in head.replace(b"\r\n", b"")
    parser = h11.Connection(h11.SERVER)
    parser.receive_data(head)
    event = parser.next_event()
    assert isinstance(event, h11.Request), "the fast path took a head h11 refuses"
    assert event.method.decode() == request.method
    assert event.target.decode() in (f"http://{request.authority}{request.path}", f"http://{request.authority}")
    assert [(k.decode(), v.decode()) for k, v in event.headers] == [(k.lower(), v) for k, v in request.headers]
    names = [k.lower() for k, _ in request.headers]
    assert names.count("host") == 1 and names.count("content-length") + names.count("transfer-encoding") <= 1
    assert not {"upgrade", "expect"} & set(names)
    mitm = _mitmproxy_reads(head)
    if mitm is None:
        return  # mitmproxy would answer 400 (e.g. an A-label Python's IDNA 2003 codec refuses)
    assert (mitm.method, mitm.port, mitm.path) == (request.method, request.port, request.path)
    assert [(k.decode(), v.decode()) for k, v in mitm.headers.fields] == list(request.headers)
    theirs = _gate_target(HttpAsk(client="c", method=mitm.method, scheme=mitm.scheme, host=mitm.data.host,
                                  port=mitm.data.port, path=mitm.path, host_header=mitm.headers.get("host"),
                                  authority=mitm.data.authority.decode("latin-1") or None))  # as decision.py
    ours = _gate_target(ask_of(request, "c"))
    assert ours == theirs, "the two transports hand the gate two different targets"


def _gate_target(ask: HttpAsk):
    try:
        target = plain_target(ask)
    except HostFormError as err:
        return ("refused", err.form)
    return (target.scheme, target.host, target.port, target.path)


@settings(max_examples=300, deadline=None)
@given(insert=st.sampled_from(["X-F: a\r\n b\r\n", "X-F: a\nX-G: b\r\n", "Content-Length: 1\r\nContent-Length: 1\r\n",
                               "Content-Length: 2\r\nTransfer-Encoding: chunked\r\n", f"Host: {A}\r\n",
                               "Upgrade: websocket\r\n", "X-F: a\rb\r\n", "Transfer-Encoding: chunked, chunked\r\n",
                               "X-F : a\r\n", " X-F: a\r\n"]),
       extra=st.lists(st.sampled_from(["Accept: */*\r\n", "X-A: 1\r\n", "Cookie: a=b\r\n"]), max_size=3),
       where=st.integers(0, 3))
def test_a_taken_head_with_a_smuggling_line_added_is_not_taken(insert, extra, where):
    lines = [*extra]
    lines.insert(min(where, len(lines)), insert)
    assert isinstance(take_head((GET + "".join(lines) + "\r\n").encode()), NotTaken)
    assert isinstance(take_head((GET + "".join(extra) + "\r\n").encode()), PlainRequest)


# ---- what is forwarded ---------------------------------------------------------------------------

def test_the_request_forwarded_has_no_hop_by_hop_header():
    request = take_head((GET + "Connection: close, X-Hop\r\nX-Hop: s\r\nProxy-Authorization: Basic eDp5\r\n"
                         "Proxy-Connection: keep-alive\r\nKeep-Alive: 5\r\nTE: trailers\r\nTrailer: X\r\n"
                         "X-End: kept\r\n\r\n").encode())
    assert isinstance(request, PlainRequest)
    forwarded = _forwarded_request_headers(request)
    assert forwarded == [("Host", A), ("X-End", "kept"), ("Connection", "close")]
    http10 = take_head(f"GET http://{A}/ HTTP/1.0\r\nHost: {A}\r\n\r\n".encode())
    assert ("Connection", "close") in _forwarded_request_headers(http10)


def test_the_response_forwarded_has_no_hop_by_hop_or_egresswall_header_and_is_reframed():
    raw = [(b"Content-Length", b"5"), (b"Transfer-Encoding", b"chunked"), (b"Connection", b"close, X-Secret"),
           (b"X-Secret", b"s"), (b"Keep-Alive", b"5"), (b"X-Egresswall-Rule", b"forged"),
           (b"x-egresswall-reason", b"forged"), (b"Proxy-Authenticate", b"Basic"), (b"Content-Type", b"text/plain")]
    assert _forwarded_response_headers(raw, 200) == [(b"Content-Type", b"text/plain")]
    assert _forwarded_response_headers([(b"Content-Length", b"5")], 200) == [(b"Content-Length", b"5")]
    assert _forwarded_response_headers([(b"Content-Length", b"5")], 304) == [(b"Content-Length", b"5")]
    assert _forwarded_response_headers([(b"Content-Length", b"5")], 204) == []  # a 204 has no body


_VALUE_BYTES = st.binary(min_size=1, max_size=12).filter(lambda b: b"\r" not in b and b"\n" not in b
                                                         and b"\x00" not in b)


@settings(max_examples=400, deadline=None)
@given(st.lists(_VALUE_BYTES, min_size=0, max_size=6), _VALUE_BYTES)
def test_a_response_head_is_refused_exactly_when_a_line_has_a_control_byte_other_than_htab(values, reason):
    """``fast_http._control_byte`` against a plain reading of the rule, over what h11 itself accepts (it keeps
    0x01-0x08, 0x0e-0x1f and 0x7f in values and reason phrases): refused iff some byte of the reason or of a
    value is a control byte other than HTAB; the words name the first such line."""
    from proxy.fast_http import _control_byte

    try:
        response = h11.Response(status_code=200, reason=reason,
                                headers=[(f"x-{i}", value) for i, value in enumerate(values)])
    except h11.LocalProtocolError:
        return  # h11 refuses it (leading or trailing whitespace, ...): never reaches the check
    lines = [response.reason] + [value for _, value in response.headers.raw_items()]
    controls = [i for i, line in enumerate(lines) if any(b < 0x20 and b != 0x09 or b == 0x7f for b in line)]
    found = _control_byte(response)
    assert (found is not None) == bool(controls), (lines, found)
    if controls:
        assert ("status line" if controls[0] == 0 else f"header 'x-{controls[0] - 1}'") in found, found
