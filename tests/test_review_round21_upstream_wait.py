"""Review round 21, second pass (a helper's): proxy/mitm_upstream_wait.py, the bound on mitmproxy's wait for
an upstream proxy's answer to its CONNECT (limits.connect_timeout, a RequestWakeup), attacked.

README ("Upstream proxy", How it forwards): "an upstream that does not answer that CONNECT within
limits.connect_timeout, or closes without answering, has the tunnel closed and named in its record, as on the
front". The wake-up must never touch a tunnel that opened, nor reach a layer that does not expect it.
"""
from __future__ import annotations

import contextlib
import signal
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from fake_upstream_proxy import ESTABLISHED, FakeUpstream, upstream_policy
from labnet import PUBLIC_IP
from proxyproc import TRANSPORTS, read_response
from rawclient import read_all, read_head

pytestmark = pytest.mark.integration
BAD = ("Traceback", "AssertionError", "Unexpected event", "internal error")


def _clean(proxy) -> None:
    assert not [w for w in BAD if w in proxy.stderr], proxy.stderr[-3000:]


def _get(sock, authority: str, path: str, close: bool = False) -> bytes:
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {authority}\r\n{'Connection: close' if close else ''}\r\n\r\n"
                 .encode().replace(b"\r\n\r\n\r\n", b"\r\n\r\n"))
    return read_response(sock)


@pytest.mark.parametrize("transport", list(TRANSPORTS), indirect=True)
def test_an_open_tunnel_outlives_connect_timeout_holds(lab, start_proxy, transport) -> None:
    """A tunnel the upstream opened at once is idle past connect_timeout (1 s) several times: each request
    inside it is still answered; the wake-up that fires meanwhile is the layer's own and changes nothing."""
    up = FakeUpstream(relay_to=(PUBLIC_IP, lab.public.port))
    try:
        proxy = start_proxy(upstream_policy(lab, up, "limits:\n  connect_timeout: 1\n  idle_timeout: 20\n"))
        authority = f"public.lab.example:{lab.public.port}"
        with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
            sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
            assert read_head(sock).startswith(b"HTTP/1.1 200"), "no 200"
            answers = []
            for index in range(3):
                time.sleep(1.6)
                answers.append(_get(sock, authority, f"/idle/{index}", close=index == 2))
        for answer in answers:
            assert answer.startswith(b"HTTP/1.1 200") and b"hello from public" in answer, answers
        _clean(proxy)
    finally:
        up.close()


def _intercept_policy(lab, up, tmp_path) -> str:
    return upstream_policy(lab, up, "limits:\n  connect_timeout: 1\n  idle_timeout: 20\n"
                                    "hosts:\n  allow:\n    - host: public.lab.example\n      intercept: true\n")


@pytest.mark.parametrize("transport", list(TRANSPORTS), indirect=True)
def test_an_intercepted_host_through_an_upstream_http1_outlives_connect_timeout_holds(lab, start_proxy, tmp_path,
                                                                                       transport) -> None:
    up = FakeUpstream(relay_to=(PUBLIC_IP, lab.public_tls.port))
    try:
        proxy = start_proxy(_intercept_policy(lab, up, tmp_path), "--confdir", str(tmp_path / "ca"),
                            "--upstream-ca", str(lab.cert_file))
        authority = f"public.lab.example:{lab.public_tls.port}"
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        sock, status, _ = proxy.connect(authority)
        assert status == 200
        answers = []
        with context.wrap_socket(sock, server_hostname="public.lab.example") as tls:
            for index in range(3):
                time.sleep(1.4)
                answers.append(_get(tls, authority, f"/i/{index}", close=index == 2))
        for answer in answers:
            assert answer.startswith(b"HTTP/1.1 200") and b"hello from public-tls" in answer, answers
        _clean(proxy)
    finally:
        up.close()


class Scripted(FakeUpstream):
    """Answers the CONNECT with ``pieces`` (bytes, delay before each), then relays to ``relay_to``."""

    def __init__(self, pieces: list[tuple[float, bytes]], relay_to) -> None:
        self.pieces = pieces
        super().__init__(relay_to=relay_to)

    def serve(self, conn, number):  # type: ignore[override]
        with contextlib.suppress(OSError), conn:
            conn.settimeout(15)
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                head += chunk
            self.heads.append((number, head))
            for delay, piece in self.pieces:
                time.sleep(delay)
                conn.sendall(piece)
            rest = head.partition(b"\r\n\r\n")[2]
            self._relay(conn, number, rest)


def _tunnel_get(lab, proxy, wait_head: float = 10) -> tuple[bytes, bytes]:
    """CONNECT to the plain-HTTP stand-in (mitmproxy sends its CONNECT when the first message arrives), one GET."""
    authority = f"public.lab.example:{lab.public.port}"
    with socket.create_connection((proxy.host, proxy.port), timeout=wait_head) as sock:
        sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        head = read_head(sock)
        if not head.startswith(b"HTTP/1.1 200"):
            return head, b""
        sock.sendall(f"GET /slow HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n".encode())
        return head, read_all(sock, 8)


@dataclass
class ScriptedTunnel:
    proxy: object
    up: Scripted
    head: bytes  # the proxy's answer to the CONNECT
    answer: bytes  # what came back for the GET inside, if the tunnel opened
    seconds: float  # from the CONNECT to the end of the answer


@contextlib.contextmanager
def scripted_tunnel(lab, start_proxy, pieces: list[tuple[float, bytes]], limits: str) -> Iterator[ScriptedTunnel]:
    """A proxy chained to a Scripted upstream that answers the CONNECT with ``pieces``; one tunnel and a GET
    through it (``_tunnel_get``). The proxy's stderr is checked for tracebacks once the caller's checks hold."""
    up = Scripted(pieces, (PUBLIC_IP, lab.public.port))
    try:
        proxy = start_proxy(upstream_policy(lab, up, limits))
        started = time.monotonic()
        head, answer = _tunnel_get(lab, proxy)
        yield ScriptedTunnel(proxy, up, head, answer, time.monotonic() - started)
        _clean(proxy)
    finally:
        up.close()


@pytest.mark.parametrize("transport", list(TRANSPORTS), indirect=True)
def test_an_answer_trickled_within_connect_timeout_opens_the_tunnel_holds(lab, start_proxy, transport) -> None:
    """The answer byte by byte over ~1.2 s, connect_timeout 3: the tunnel opens on both paths."""
    pieces = [(0.03, bytes([b])) for b in ESTABLISHED]
    with scripted_tunnel(lab, start_proxy, pieces, "limits:\n  connect_timeout: 3\n") as t:
        assert t.head.startswith(b"HTTP/1.1 200") and t.answer.startswith(b"HTTP/1.1 200"), (t.head, t.answer[:200])
        assert b"hello from public" in t.answer


@pytest.mark.parametrize("transport", list(TRANSPORTS), indirect=True)
def test_an_answer_just_after_connect_timeout_closes_the_tunnel_and_names_the_upstream_holds(
        lab, start_proxy, transport) -> None:
    """The 200 comes 1.6 s after the CONNECT, connect_timeout 1: too late on both paths; the request's record says
    why, and so does the tunnel's closing line."""
    with scripted_tunnel(lab, start_proxy, [(1.6, ESTABLISHED)],
                         "limits:\n  connect_timeout: 1\n  idle_timeout: 20\n") as t:
        proxy, up, answer = t.proxy, t.up, t.answer
        assert b"hello from public" not in answer, answer
        time.sleep(0.5)
        why = (f"the upstream proxy http://127.0.0.1:{up.port} did not open the tunnel within 1s "
               "(limits.connect_timeout)")
        assert answer.startswith(b"HTTP/1.1 502") and why.encode() in answer, answer[:400]
        records = [r for r in proxy.audit() if r["event"] == "response"]
        assert records and records[0]["error"] == why, records
        # The tunnel's own line names it too (it said only "the client connection closed", session 2026-12-07).
        (tunnel,) = [r for r in proxy.audit() if r["event"] == "tunnel"]
        assert tunnel["error"] == f"the client connection closed after a request inside the tunnel failed: {why}"


@pytest.mark.parametrize("transport", list(TRANSPORTS), indirect=True)
def test_an_informational_answer_before_the_200_opens_the_tunnel_on_both_paths(lab, start_proxy, transport) -> None:
    """An upstream that answers ``100 Continue`` (a 1xx) and then ``200``: the fast front skips 1xx answers
    (proxy/upstream_connect.py _response, "1xx answers are skipped") and opens the tunnel; mitmproxy's
    HttpUpstreamProxy.receive_handshake_data takes the 100 as the final answer ("refused HTTP CONNECT request:
    100 Continue") and closes it. README: intercepted hosts and --no-fast-tunnels go "through mitmproxy's
    upstream mode ... as on the front"; the same upstream must open the same tunnels on both paths (RFC 9110
    15.2: a client must parse 1xx answers before the final one). Fix: in mitm_upstream_wait, skip a 1xx head in
    receive_handshake_data (as the front does) — done."""
    pieces = [(0, b"HTTP/1.1 100 Continue\r\n\r\n"), (0.05, ESTABLISHED)]
    with scripted_tunnel(lab, start_proxy, pieces, "limits:\n  connect_timeout: 3\n") as t:
        assert t.head.startswith(b"HTTP/1.1 200") and b"hello from public" in t.answer, (t.head, t.answer[:300])


@pytest.mark.parametrize("transport", list(TRANSPORTS), indirect=True)
@pytest.mark.parametrize("split", [False, True])
def test_interim_answers_split_across_reads_are_skipped(lab, start_proxy, transport, split) -> None:
    """Two 1xx answers, then the 200 and nothing else, each cut in the middle of its status line when ``split``
    (mitmproxy's reader must not see a piece of a 1xx as the start of the final answer)."""
    wire = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + ESTABLISHED
    cuts = [5, 12, 30, 40, 60] if split else []
    pieces = [(0.05, wire[a:b]) for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True)]
    with scripted_tunnel(lab, start_proxy, pieces, "limits:\n  connect_timeout: 3\n") as t:
        assert t.head.startswith(b"HTTP/1.1 200") and b"hello from public" in t.answer, (t.head, t.answer[:300])


@pytest.mark.parametrize("transport", list(TRANSPORTS), indirect=True)
def test_an_endless_answer_head_is_bounded_as_on_the_front(lab, start_proxy, transport) -> None:
    """An upstream that answers the CONNECT with a head that never ends (a header of 100 KB, then silence):
    mitmproxy buffered it for as long as the wait lasted; it fails at MAX_RESPONSE_HEAD (64 KiB), as the fast
    front's does, before connect_timeout, and the answer says so."""
    pieces = [(0, b"HTTP/1.1 200 OK\r\nX: " + b"a" * 100_000), (8, b"\r\n\r\n")]
    with scripted_tunnel(lab, start_proxy, pieces, "limits:\n  connect_timeout: 6\n  idle_timeout: 20\n") as t:
        assert t.seconds < 4, "not bounded before connect_timeout"
        assert t.answer.startswith(b"HTTP/1.1 502") and b"answer head is over 65536 bytes" in t.answer, t.answer[:400]


@pytest.mark.parametrize("transport", list(TRANSPORTS), indirect=True)
def test_a_reload_to_a_shorter_connect_timeout_applies_to_the_next_tunnel_holds(lab, start_proxy, transport) -> None:
    up = Scripted([(30, b"")], (PUBLIC_IP, lab.public.port))  # never answers
    try:
        text = upstream_policy(lab, up, "limits:\n  connect_timeout: 15\n  idle_timeout: 30\n")
        proxy = start_proxy(text)
        proxy.policy_path.write_text(text.replace("connect_timeout: 15", "connect_timeout: 1"))
        proxy.signal(signal.SIGHUP)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and "reload" not in proxy.stderr:
            time.sleep(0.05)
        time.sleep(0.3)
        started = time.monotonic()
        _, answer = _tunnel_get(lab, proxy)
        assert time.monotonic() - started < 6
        assert answer.startswith(b"HTTP/1.1 502") and b"within 1s (limits.connect_timeout)" in answer, answer[:400]
        _clean(proxy)
    finally:
        up.close()


@pytest.mark.parametrize("transport", list(TRANSPORTS), indirect=True)
def test_many_tunnels_at_once_through_an_upstream_all_work_holds(lab, start_proxy, transport) -> None:
    """40 tunnels at once, each idle past connect_timeout before its request: all answered, nothing logged."""
    up = FakeUpstream(relay_to=(PUBLIC_IP, lab.public.port))
    results: list[bytes] = []
    try:
        proxy = start_proxy(upstream_policy(lab, up, "limits:\n  connect_timeout: 1\n  idle_timeout: 20\n"))
        authority = f"public.lab.example:{lab.public.port}"

        def one(index: int) -> None:
            with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
                sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
                read_head(sock)
                sock.sendall(f"GET /a/{index} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
                first = read_response(sock)
                time.sleep(1.5)
                results.append(first + _get(sock, authority, f"/b/{index}", close=True))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(40)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20)
        assert len(results) == 40 and all(r.count(b"hello from public") == 2 for r in results), len(results)
        _clean(proxy)
    finally:
        up.close()


@pytest.mark.parametrize("transport", ["fast"], indirect=True)
def test_the_fast_front_skips_an_informational_answer_to_its_connect_holds(lab, start_proxy, transport) -> None:
    """The contrast to the test above: a passed-through TLS tunnel on the fast front, the same upstream
    (100 Continue, then 200): the front opens it and the origin answers."""
    up = Scripted([(0, b"HTTP/1.1 100 Continue\r\n\r\n"), (0.05, ESTABLISHED)], (PUBLIC_IP, lab.public_tls.port))
    try:
        proxy = start_proxy(upstream_policy(lab, up, "limits:\n  connect_timeout: 3\n"))
        authority = f"public.lab.example:{lab.public_tls.port}"
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.load_verify_locations(str(lab.cert_file))
        sock, status, _ = proxy.connect(authority)
        assert status == 200
        with context.wrap_socket(sock, server_hostname="public.lab.example") as tls:
            answer = _get(tls, authority, "/after-100", close=True)
        assert answer.startswith(b"HTTP/1.1 200") and b"hello from public-tls" in answer, answer[:300]
    finally:
        up.close()
