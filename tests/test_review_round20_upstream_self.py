"""Review round 20 (a helper's: upstream proxy): the upstream proxy named by a host name that is egresswall's own
listener.

``Gate.guard_upstream`` refuses "the upstream proxy ... is egresswall's own listener" (``is_self``) — but only
when the policy spells the upstream as an address: ``is_self`` compares addresses, and the upstream's name is
resolved after the guard, with the system resolver (the front: ``proxy/upstream_connect.py`` ``_open``,
``loop.getaddrinfo``; mitmproxy's upstream mode: its own connect). ``localhost`` (from /etc/hosts: no DNS query
leaves the machine) names egresswall's own listener, and one CONNECT becomes a loop of CONNECTs egresswall sends
itself, each decided and recorded, until the per-client connection cap of 127.0.0.1 is full.
"""

from __future__ import annotations

import socket
import time

import pytest
from fake_upstream_proxy import client_hello
from rawclient import read_all
from test_squid_differential import free_port

pytestmark = pytest.mark.integration


# mitmproxy's path with ``localhost`` is not run: the test guard (tests/proxyproc.py) refuses a connect to a
# name, so it never gets there. The address spelling holds on both transports.
@pytest.mark.parametrize(("transport", "spelling"), [("fast", "127.0.0.1"), ("mitmproxy", "127.0.0.1"),
                                                     ("fast", "localhost"), ("mitmproxy", "localhost")],
                         indirect=["transport"])
def test_an_upstream_that_is_egresswalls_own_listener_is_refused_however_it_is_spelled(lab, start_proxy, transport,
                                                                                       spelling) -> None:
    port = free_port()
    policy = lab.policy_text(f"upstream:\n  proxy: http://{spelling}:{port}\n  resolution: upstream\n")
    proxy = start_proxy(policy, "--listen", f"127.0.0.1:{port}")
    assert proxy.port == port
    started = time.monotonic()
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(f"CONNECT public.lab.example:{lab.public_tls.port} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        time.sleep(0.3)
        sock.sendall(client_hello("public.lab.example"))  # mitmproxy's upstream mode connects on the first message
        answer = read_all(sock, 10)
    took = time.monotonic() - started
    time.sleep(1.0)
    decisions = proxy.decisions()
    to_itself = [e for e in proxy.outbound() if e["port"] == port]
    print(f"\n{spelling}/{transport}: {answer[:120]!r} after {took:.1f}s; {len(decisions)} decisions, "
          f"{len(to_itself)} connects to itself")
    # Never a loop: the one CONNECT is the only decision, and egresswall never connects to its own listener.
    assert len(decisions) == 1, len(decisions)
    assert not to_itself
