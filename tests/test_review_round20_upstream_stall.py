"""Review round 20 (a helper's: upstream proxy): an upstream proxy that stalls or breaks off its answer to the
CONNECT.

Both transports bound it by limits.connect_timeout (the fast front answers 502; mitmproxy's upstream mode has
answered 200 itself and closes the tunnel), and the tunnel's record names the upstream, not the client. Until
proxy/mitm_upstream_wait.py, mitmproxy's path waited until limits.idle_timeout and its record said "the client
connection closed" (two strict xfails here, review round 20).
"""
from __future__ import annotations

import contextlib
import socket
import time

import pytest
from fake_upstream_proxy import FakeUpstream, client_hello
from proxyproc import TRANSPORTS
from rawclient import read_all

pytestmark = pytest.mark.integration


class Breaking(FakeUpstream):
    def __init__(self, first: bytes, close: bool) -> None:
        self.first, self.close_after = first, close
        super().__init__()

    def serve(self, conn, number):  # type: ignore[override]
        with contextlib.suppress(OSError), conn:
            conn.recv(65536)
            conn.sendall(self.first)
            if not self.close_after:
                time.sleep(25)


@pytest.mark.parametrize("transport", list(TRANSPORTS), indirect=True)
@pytest.mark.parametrize(("first", "close"), [(b"HTTP/1.1 200 Conn", True), (b"HTTP/1.1 200 OK\r\nX: y\r\n", False),
                                              (b"", False)])
def test_a_stalled_or_broken_connect_answer_is_bounded_and_recorded(lab, start_proxy, transport, first, close,
                                                                    ) -> None:
    up = Breaking(first, close)
    try:
        policy = lab.policy_text(f"upstream:\n  proxy: http://127.0.0.1:{up.port}\n  resolution: upstream\n",
                                 limits="limits:\n  connect_timeout: 2\n  idle_timeout: 4\n")
        proxy = start_proxy(policy)
        started = time.monotonic()
        with socket.create_connection((proxy.host, proxy.port), timeout=5) as sock:
            sock.sendall(f"CONNECT public.lab.example:{lab.public_tls.port} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            time.sleep(0.3)
            with contextlib.suppress(OSError):
                sock.sendall(client_hello("public.lab.example"))
            got = read_all(sock, 20)
        took = time.monotonic() - started
        time.sleep(0.3)
        closed = [r for r in proxy.audit() if r["event"] == "tunnel"]
        if transport == "fast":  # answered only once the upstream opened the tunnel: here never
            assert got.startswith(b"HTTP/1.1 502 "), got[:200]
        assert took < 6.5  # connect_timeout (2 s) on the fast path; idle_timeout (4 s) would do
        assert closed, proxy.audit()
        assert "client connection closed" not in (closed[0]["error"] or ""), closed[0]  # it was the upstream
        if transport == "mitmproxy" and not first.startswith(b"HTTP/1.1 200 Conn"):  # a head it never finished
            assert f"the upstream proxy http://127.0.0.1:{up.port} " in closed[0]["error"], closed[0]
    finally:
        up.close()
