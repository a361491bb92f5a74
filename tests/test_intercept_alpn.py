"""An intercepted host's origin is offered HTTP's ALPN protocols only, never the client's other offers (an open
item of review round 20). mitmproxy copies the client's ALPN offers into its own ClientHello to the origin:
any bytes a client chooses (up to 255 a protocol name, many names), sent to the granted origin and charged to no
byte budget — a covert channel to it beside the requests egresswall reads. Now what goes on is the client's
offers among h2, http/1.1 and http/1.0, in its order (with none of those, none)."""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time

import pytest
from intercept_client import open_intercepted
from labnet import PUBLIC_IP
from listening import ConnectionServer

pytestmark = pytest.mark.integration

HOST = "public.lab.example"
COVERT = "x-exfil-" + "5ecret" * 8


class HelloRecorder(ConnectionServer):
    """Records the first bytes each connection sends (the proxy's ClientHello to the origin), then closes."""

    def __init__(self) -> None:
        self.hellos: list[bytes] = []
        self.lock = threading.Lock()
        super().__init__(PUBLIC_IP)

    def serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError), conn:
            conn.settimeout(5)
            data = b""
            while len(data) < 5 or len(data) < 5 + int.from_bytes(data[3:5], "big"):
                chunk = conn.recv(65536)
                if not chunk:
                    break
                data += chunk
            with self.lock:
                self.hellos.append(data)


@pytest.mark.parametrize("offers", [[COVERT, "http/1.1"], ["h2", COVERT, "http/1.1"], [COVERT]])
def test_the_origin_of_an_intercepted_host_is_offered_http_protocols_only(lab, start_proxy, offers) -> None:
    origin = HelloRecorder()
    try:
        proxy = start_proxy(lab.policy_text(f"hosts:\n  allow:\n    - host: {HOST}\n      intercept: true\n")
                            .replace("  connect: [", f"  connect: [{origin.port}, "))
        with contextlib.suppress(OSError, ssl.SSLError, AssertionError):
            tls, _ = open_intercepted(proxy, HOST, origin.port, alpn=offers, timeout=5)
            tls.close()
        deadline = time.monotonic() + 5
        while not origin.hellos and time.monotonic() < deadline:
            time.sleep(0.1)
        assert origin.hellos, "the proxy never connected to the origin"
        hello = origin.hellos[0]
        assert hello[:1] == b"\x16", hello[:20]  # a TLS handshake record
        assert COVERT.encode() not in hello
        if "http/1.1" in offers:  # HTTP's own offer still goes on (h2 only where mitmproxy's http2 is on)
            assert b"\x08http/1.1" in hello, hello
    finally:
        origin.close()
