"""Review round 19 (h3): a CONNECT judged as TLS becomes a relay for whatever the upstream speaks once the
upstream answers the ClientHello with anything that is not TLS.

egresswall passes "only TLS through CONNECT to this port" (the tls:not-tls refusal's words) and judges only
the client's first message. ``classify_server_first`` (proxy/tls_retry.py) takes a server answer whose first
byte is not 0x16 as "not a HelloRetryRequest", and ``RetryWatch.from_server`` then releases everything the
client held after its ClientHello and the relay copies both ways unread. A TLS server answers a ClientHello
only with a handshake record or an alert record, so such an answer shows the upstream does not speak TLS,
yet the tunnel goes on: a line-protocol service on an allowed host:port that answers one error to the
ClientHello's bytes and reads on (SMTP's "500 unrecognized", memcached's "ERROR", IRC, POP3, ...) is then
driven in its own protocol, which egresswall never checked. The origin below is such a service (it answers
"500" to each line and records everything it got)."""

from __future__ import annotations

import contextlib
import socket
import time

import pytest
from labnet import PUBLIC_IP
from listening import ConnectionServer
from proxyproc import both_transports
from rawclient import read_all, tunnel
from tls_build import client_hello

pytestmark = [pytest.mark.integration]
COMMANDS = b"\r\nMAIL FROM:<agent@example>\r\nRCPT TO:<anyone@example>\r\n"


class LineService(ConnectionServer):
    """Not TLS: answers '500 unrecognized' to each line it reads, and keeps what it got."""

    def __init__(self, greets: bool) -> None:
        super().__init__(PUBLIC_IP)
        self.greets = greets
        self.received = bytearray()

    def serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError), conn:
            conn.settimeout(10)
            if self.greets:
                conn.sendall(b"220 mail.example ESMTP\r\n")
            pending = b""
            while chunk := conn.recv(65536):
                self.received += chunk
                pending += chunk
                while b"\n" in pending:
                    _, pending = pending.split(b"\n", 1)
                    conn.sendall(b"500 5.5.2 unrecognized\r\n")
                if not self.greets and pending and not self.received.count(b"\n"):
                    conn.sendall(b"500 5.5.2 unrecognized\r\n")  # answers the hello's bytes at once


@pytest.fixture(params=[False, True], ids=["answers", "greets-first"])
def service(request):
    server = LineService(request.param)
    yield server
    server.close()


@both_transports
def test_what_follows_a_judged_hello_never_reaches_an_upstream_that_does_not_speak_tls(lab, start_proxy,
                                                                                      service):
    policy = lab.policy_text().replace("  connect: [", f"  connect: [{service.port}, ")
    proxy = start_proxy(policy)
    hello = client_hello(b"public.lab.example")  # egresswall accepts it: its SNI names the CONNECT host
    with tunnel(proxy, f"public.lab.example:{service.port}") as sock:
        sock.sendall(hello + COMMANDS)  # sent with the hello: held until the upstream's first answer
        time.sleep(0.5)
        with contextlib.suppress(OSError):
            sock.sendall(b"DATA\r\n")  # and after it
        time.sleep(0.5)
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)
        answer = read_all(sock, 3)
    time.sleep(0.3)
    print("client got:", answer[:120], "| upstream got after the hello:", bytes(service.received[len(hello):])[:120])
    assert b"MAIL FROM" not in service.received and b"DATA" not in service.received, (
        f"the non-TLS upstream got the client's commands: {bytes(service.received[len(hello):])!r}; "
        f"the client got {answer[:120]!r}; "
        f"records {[(r['event'], r.get('rule'), r.get('error')) for r in proxy.audit()]}")
