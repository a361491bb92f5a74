"""Review round 20 (a helper's review of the round's diff, what held): a tunnel through an upstream proxy whose
server connection closed, then the client's next
request on the same client connection; a second CONNECT on one client connection; HTTP/1.0 keep-alive."""

from __future__ import annotations

import socket
import time

import pytest
from fake_upstream_proxy import ESTABLISHED, FakeUpstream, creds_file, upstream_policy
from proxyproc import TRANSPORTS
from rawclient import read_all

pytestmark = pytest.mark.integration
CLOSE_OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


class ClosingUpstream(FakeUpstream):
    """Answers a request inside a tunnel keep-alive, then closes the connection (as an origin idling it out)."""

    def serve(self, conn: socket.socket, number: int) -> None:  # type: ignore[override]
        pending = bytearray()
        inside = False
        with conn:
            conn.settimeout(15)
            while True:
                while b"\r\n\r\n" not in pending:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    pending += chunk
                head, _, rest = bytes(pending).partition(b"\r\n\r\n")
                pending[:] = rest
                self.heads.append((number, head + b"\r\n\r\n"))
                if head.startswith(b"CONNECT ") and not inside:
                    conn.sendall(ESTABLISHED)
                    inside = True
                    continue
                conn.sendall(CLOSE_OK)
                time.sleep(0.1)
                return


def _answer(head: bytes, inside: bool) -> bytes:
    if head.startswith(b"CONNECT ") and not inside:
        return ESTABLISHED
    return CLOSE_OK


@pytest.mark.parametrize("transport", list(TRANSPORTS), indirect=True)
def test_after_the_tunnels_server_connection_closed_the_next_request_is_no_request_for_the_upstream(
        lab, start_proxy, tmp_path, transport) -> None:
    up = ClosingUpstream()
    try:
        proxy = start_proxy(upstream_policy(lab, up, creds=creds_file(tmp_path)))
        p = lab.public.port
        with socket.create_connection((proxy.host, proxy.port), timeout=5) as sock:
            sock.sendall(f"CONNECT public.lab.example:{p} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            time.sleep(0.3)
            for path in ("/in1", "/squid-internal-mgr/info", "/in3"):
                sock.sendall(f"GET {path} HTTP/1.1\r\nHost: public.lab.example:{p}\r\n\r\n".encode())
                time.sleep(0.4)
            out = read_all(sock, 2)
        lines = up.request_lines()
        by_conn: dict[int, list[str]] = {}
        for number, head in up.heads:
            by_conn.setdefault(number, []).append(head.split(b"\r\n", 1)[0].decode("latin-1"))
        # Every connection to the upstream starts with a CONNECT for the decided host: a request in origin form as
        # the first thing on a connection is a request for the upstream itself.
        for heads in by_conn.values():
            assert heads[0] == f"CONNECT public.lab.example:{p} HTTP/1.1", (by_conn, out)
        for _, head in up.heads:
            if not head.startswith(b"CONNECT "):
                assert b"proxy-authorization" not in head.lower(), head
        assert lines, out
    finally:
        up.close()


@pytest.mark.parametrize("transport", list(TRANSPORTS), indirect=True)
def test_a_plain_request_after_a_refused_connect_on_one_connection_goes_in_absolute_form(
        lab, start_proxy, tmp_path, transport) -> None:
    up = FakeUpstream()
    try:
        proxy = start_proxy(upstream_policy(lab, up, creds=creds_file(tmp_path)))
        p = lab.public.port
        with socket.create_connection((proxy.host, proxy.port), timeout=5) as sock:
            sock.sendall(f"CONNECT internal.lab.example:{p} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            time.sleep(0.3)
            sock.sendall(f"GET /after HTTP/1.1\r\nHost: public.lab.example:{p}\r\nConnection: close\r\n\r\n".encode())
            out = read_all(sock, 2)
        for _, head in up.heads:
            first = head.split(b"\r\n", 1)[0]
            assert not first.startswith(b"GET /"), (up.heads, out)
    finally:
        up.close()
