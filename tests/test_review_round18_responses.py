"""Review round 18: what a hostile origin sends back, on both transports.

Each test here failed before its fix (mitmproxy's path: ``mitm_patches._client_read_body`` drops what an
upstream sends after its response and ``_client_mark_done`` closes that connection; the fast path:
``fast_http._control_byte`` reads every header value):

* on mitmproxy's path, an origin that answers a request early (before the body it is still uploading is
  all sent) and then sends any further byte makes mitmproxy's layer raise: its Content-Length body reader,
  already at its end, returns EndOfMessage again for every read, and the stream, done, refuses the second
  one (AssertionError in HttpStream.state_done, "mitmproxy has crashed!" with a traceback on stderr). One
  traceback per write of the origin, for as long as the upload goes on;
* the same with a chunked early answer: the reader, past the last chunk, reads the extra bytes as trailer
  lines and fails; the upstream connection is closed, and the client connection with it, before the client
  got the last chunk (mitmproxy sends a response's end only once the request is done), while the response
  record says status 200 with no error;
* on the fast path, a response header value holding a control byte other than HTAB, CR, LF, VT, FF or NUL
  (0x01-0x08, 0x0e-0x1f, 0x7f) is relayed as it came: h11 takes any byte but NUL and whitespace in a value.
  mitmproxy's path refuses it (502), as the README says both paths do.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import time

import pytest
from hostile import Scripted, _Server
from labnet import PUBLIC_IP
from proxyproc import TRANSPORTS, proxy_with_origins

pytestmark = pytest.mark.integration

UPLOAD = 200_000  # the request body the client uploads, in two writes
FIRST = 1_000  # its first write, sent with the head; the rest a second later


class AnswersEarly(_Server):
    """Answers a request's head at once with ``answer`` (before the body), then, ``delay`` seconds later, sends
    ``extra`` (what an origin sends after its answer: any bytes at all), then reads the whole body."""

    def __init__(self, answer: bytes, extra: bytes, delay: float = 0.2) -> None:
        self.answer, self.extra, self.delay = answer, extra, delay
        self.body_read: list[int] = []
        super().__init__()

    def handle(self, conn: socket.socket, head: bytes) -> None:
        match = re.search(rb"(?i)\r\ncontent-length: *([0-9]+)", head)
        wanted = int(match.group(1)) if match else 0
        got = len(head.partition(b"\r\n\r\n")[2])
        conn.sendall(self.answer)
        time.sleep(self.delay)
        conn.sendall(self.extra)
        while got < wanted:
            chunk = conn.recv(65536)
            if not chunk:
                break
            got += len(chunk)
        self.body_read.append(got)


EARLY_LENGTH = b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 5\r\n\r\nnope!"
EARLY_CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nnope!\r\n0\r\n\r\n"
AFTER = b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\nX-Smuggled: 1\r\n\r\nSMUGGLED"


def _control_byte_answer(byte: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nX-Odd: a" + byte + b"b\r\nContent-Length: 5\r\n\r\nhello"


CONTROL_BYTES = [b"\x01", b"\x08", b"\x1b", b"\x1f", b"\x7f"]
HUGE_LENGTHS = [2**63, 2**64 + 5, 10**19]  # over 2**63 - 1; 2**64 + 5 is 5 to a client that wraps at 64 bits


@pytest.fixture(scope="module")
def origins():
    servers: dict[str, _Server] = {
        "early-length": AnswersEarly(EARLY_LENGTH, AFTER),
        "early-length-one-byte": AnswersEarly(EARLY_LENGTH, b"x"),
        "early-chunked": AnswersEarly(EARLY_CHUNKED, AFTER),
    }
    for byte in CONTROL_BYTES:
        servers[f"control-{byte.hex()}"] = Scripted(_control_byte_answer(byte))
    for length in HUGE_LENGTHS:
        servers[f"length-{length}"] = Scripted(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\nhello" % length)
    yield servers
    for server in servers.values():
        server.close()


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def proxy(lab, origins, tmp_path_factory, request):
    folder = tmp_path_factory.mktemp("r18-response")
    process = proxy_with_origins(lab, folder, (s.port for s in origins.values()), request.param,
                                 "limits:\n  idle_timeout: 6\n")
    yield process
    process.stop()
    assert not [e for e in process.outbound() if e["host"] != PUBLIC_IP], process.outbound()


def _upload(proxy, port: int, path: str, wait: float = 4.0) -> tuple[bytes, str]:
    """A POST of UPLOAD bytes to the origin on ``port``: the head and FIRST bytes, the rest a second later.
    Returns what the client got within ``wait`` seconds and how the connection ended ("closed", "open")."""
    authority = f"public.lab.example:{port}"
    head = (f"POST http://{authority}{path} HTTP/1.1\r\nHost: {authority}\r\nContent-Length: {UPLOAD}\r\n\r\n").encode()
    got, ended = b"", "open"
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(head + b"x" * FIRST)
        sock.settimeout(0.25)
        started, rest_sent = time.monotonic(), False
        while time.monotonic() - started < wait:
            if not rest_sent and time.monotonic() - started > 1.0:
                with contextlib.suppress(OSError):
                    sock.sendall(b"x" * (UPLOAD - FIRST))
                rest_sent = True
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:
                ended = "reset"
                break
            if not chunk:
                ended = "closed"
                break
            got += chunk
    return got, ended


def _response_records(proxy, path: str, timeout: float = 5) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [r for r in proxy.audit() if r.get("event") == "response" and r.get("path") == path]
        if found:
            return found
        time.sleep(0.1)
    return []


@pytest.mark.parametrize("origin", ["early-length", "early-length-one-byte"])
def test_bytes_after_an_early_answer_raise_nothing_in_the_proxy(proxy, origins, origin):
    """An origin answers before the upload is done, then sends more: the client gets the answer, and no layer
    of the proxy raises (mitmproxy's path logged "mitmproxy has crashed!" with a traceback, once per write of
    the origin)."""
    before = proxy.stderr.count("Traceback")
    got, _ = _upload(proxy, origins[origin].port, f"/{origin}")
    assert got.startswith(b"HTTP/1.1 413 ") and got.endswith(b"nope!"), got[:200]
    assert b"SMUGGLED" not in got
    time.sleep(0.5)
    stderr = proxy.stderr
    assert stderr.count("Traceback") == before, stderr[-3000:]
    assert "mitmproxy has crashed" not in stderr


def test_an_early_chunked_answer_reaches_the_client_whole_or_its_record_says_it_broke_off(proxy, origins):
    """A chunked answer that began early, then bytes after its last chunk: either the client gets the answer
    whole (its last chunk) or the response record names the error. On mitmproxy's path the client connection
    was closed before the last chunk and the record said status 200, error null."""
    got, ended = _upload(proxy, origins["early-chunked"].port, "/early-chunked")
    assert b"SMUGGLED" not in got
    whole = got.endswith(b"5\r\nnope!\r\n0\r\n\r\n")
    (record,) = _response_records(proxy, "/early-chunked")
    assert whole or record["error"], (got, ended, json.dumps(record))


@pytest.mark.parametrize("byte", CONTROL_BYTES, ids=lambda b: b.hex())
def test_a_control_byte_in_a_response_header_value_gets_502_on_both_paths(proxy, origins, byte):
    """README: a response head with a control byte other than HTAB in a line gets the client a 502 on both
    paths. mitmproxy's path refuses it (proxy/mitm_patches.py ``_read_response_head``); the fast path relayed
    0x01-0x08, 0x0e-0x1f and 0x7f as they came (h11 takes any byte but NUL and whitespace in a value, and
    proxy/fast_http.py checks only the reason phrase)."""
    port = origins[f"control-{byte.hex()}"].port
    authority = f"public.lab.example:{port}"
    request = f"GET http://{authority}/c HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n".encode()
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(request)
        sock.settimeout(5)
        got = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := sock.recv(65536):
                got += chunk
    assert got.startswith(b"HTTP/1.1 502 "), got[:200]
    assert byte not in got.partition(b"\r\n\r\n")[0]


def _get(proxy, port: int, path: str) -> bytes:
    authority = f"public.lab.example:{port}"
    request = f"GET http://{authority}{path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n".encode()
    got = b""
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(request)
        sock.settimeout(5)
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := sock.recv(65536):
                got += chunk
    return got


@pytest.mark.parametrize("length", HUGE_LENGTHS)
def test_a_content_length_a_64_bit_client_could_wrap_gets_502_on_both_paths(proxy, origins, length):
    """A 20-digit Content-Length was relayed on both paths (only more than 20 digits was refused): a client that
    reads it into an unsigned 64-bit integer takes 2**64 + 5 for 5 and reads what follows as another response."""
    got = _get(proxy, origins[f"length-{length}"].port, f"/length-{length}")
    assert got.startswith(b"HTTP/1.1 502 "), got[:200]
    assert str(length).encode() not in got
