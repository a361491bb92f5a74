"""Review round 19 (h3): a tunnel whose client sends nothing, or trickles its ClientHello a byte at a time,
is closed at limits.header_timeout with one refusal record, on both transports — also when the origin speaks
first (on mitmproxy's path that starts TunnelStart's own timer instead of the http_connected one)."""

from __future__ import annotations

import contextlib
import socket
import time

import pytest
from labnet import PUBLIC_IP
from listening import ConnectionServer
from proxyproc import both_transports
from rawclient import tunnel
from tls_build import real_client_hello

pytestmark = [pytest.mark.integration]
HEADER_TIMEOUT = 2


class _Greeter(ConnectionServer):
    """An origin that says one line when it accepts, then reads until the end."""

    def __init__(self) -> None:
        super().__init__(PUBLIC_IP)

    def serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            conn.sendall(b"220 hello\r\n")
            while conn.recv(65536):
                pass


@pytest.fixture
def greeter():
    server = _Greeter()
    yield server
    server.close()


def _proxy(lab, start_proxy, port: int):
    text = lab.policy_text(limits=f"limits:\n  header_timeout: {HEADER_TIMEOUT}\n  idle_timeout: 60\n")
    return start_proxy(text.replace("  connect: [", f"  connect: [{port}, "))


def _refusals(proxy, wait: float = 5) -> list[dict]:
    deadline = time.monotonic() + wait
    while True:
        found = [r for r in proxy.audit() if r.get("verdict") == "refuse"]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


@both_transports
@pytest.mark.parametrize("speaks_first", [False, True], ids=["quiet-origin", "origin-speaks-first"])
@pytest.mark.parametrize("client", ["silent", "trickle"])
def test_a_silent_or_trickling_client_is_cut_at_the_header_timeout_with_one_record(lab, start_proxy, greeter,
                                                                                  speaks_first, client):
    port = greeter.port if speaks_first else lab.public_tls.port
    proxy = _proxy(lab, start_proxy, port)
    hello = real_client_hello("public.lab.example")
    started = time.monotonic()
    got = b""
    with tunnel(proxy, f"public.lab.example:{port}") as sock:
        sock.settimeout(0.5)
        index = 0
        while time.monotonic() - started < HEADER_TIMEOUT + 8:
            if client == "trickle" and index < len(hello):
                with contextlib.suppress(OSError):
                    sock.sendall(hello[index:index + 1])
                index += 1
            try:
                chunk = sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                break
            if not chunk:
                break
            got += chunk
    took = time.monotonic() - started
    assert took < HEADER_TIMEOUT + 3, f"the tunnel stayed open {took:.1f}s"
    assert b"220" not in got, got  # the origin's bytes never reach a client whose first message was not judged
    refusals = _refusals(proxy)
    assert [r["rule"] for r in refusals] == ["limits.header_timeout"], proxy.audit()
