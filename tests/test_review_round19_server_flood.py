"""Review round 19 (h3): an allowed upstream that speaks first and floods, while the client's first message
in the tunnel is not yet whole. On mitmproxy's path ``TunnelStart`` (proxy/addons/tunnel_layers.py) holds
every server event it gets before the client's first message is judged, without bound, for up to
``limits.header_timeout``. The fast front never reads the upstream before the relay."""

from __future__ import annotations

import contextlib
import socket
import time

import pytest
from audit_watch import tree_kib
from labnet import PUBLIC_IP
from listening import ConnectionServer
from proxyproc import both_transports

pytestmark = [pytest.mark.integration]
GROWTH_MIB = 24
CAP = 200 << 20  # the origin stops there: enough to show the growth, not enough to hurt a shared machine
PIECE = b"\x17\x03\x03\x40\x00" + b"f" * 16384


class _Flood(ConnectionServer):
    """An origin that writes as fast as it can from the moment it accepts, and never reads."""

    def __init__(self) -> None:
        super().__init__(PUBLIC_IP)
        self.sent = 0

    def serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            deadline = time.monotonic() + 6
            while time.monotonic() < deadline and not self.closed.is_set() and self.sent < CAP:
                self.sent += conn.send(PIECE)


@pytest.fixture
def flood():
    server = _Flood()
    yield server
    server.close()


def _grows(lab, start_proxy, flood, first: bytes, http_port: bool) -> float:
    policy = lab.policy_text(limits="limits:\n  header_timeout: 30\n")
    policy = policy.replace("  connect: [", f"  connect: [{flood.port}, ")
    if http_port:
        policy = policy.replace("  http: [", f"  http: [{flood.port}, ")
    proxy = start_proxy(policy)
    time.sleep(0.5)
    before = tree_kib(proxy.process.pid)
    sock, status, _ = proxy.connect(f"public.lab.example:{flood.port}")
    assert status == 200
    with sock:
        sock.sendall(first)  # a first message that is never whole
        time.sleep(3)
        grown = (tree_kib(proxy.process.pid) - before) / 1024
    print(f"origin sent {flood.sent >> 20} MiB, proxy grew {grown:.1f} MiB")
    return grown


@both_transports
def test_a_flooding_origin_before_the_clients_hello_is_whole_is_not_held_without_bound(lab, start_proxy, flood):
    grown = _grows(lab, start_proxy, flood, b"\x16", http_port=False)
    assert grown < GROWTH_MIB, f"the proxy grew by {grown:.0f} MiB while the client's ClientHello was not whole"


def test_a_flooding_origin_behind_a_connect_to_a_plain_http_port_is_not_held_without_bound(lab, start_proxy,
                                                                                           flood):
    """The default transport: a CONNECT to a port in both lists goes to mitmproxy's path (proxy/front.py)."""
    grown = _grows(lab, start_proxy, flood, b"G", http_port=True)
    assert grown < GROWTH_MIB, f"the proxy grew by {grown:.0f} MiB while the client's first head was not whole"
