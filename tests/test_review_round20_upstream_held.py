"""Review round 20 (a helper's: upstream proxy): attacks on upstream chaining that held when tried (kept as
regression tests).

A hostile upstream proxy on loopback (tests/r20_fake_upstream.py) records every byte egresswall sends it.
"""
from __future__ import annotations

import contextlib
import socket
import time

import pytest
from dnslab import Record
from fake_upstream_proxy import ESTABLISHED, OK, FakeUpstream, client_hello, creds_file, header, upstream_policy
from labnet import PUBLIC_IP
from proxyproc import TRANSPORTS
from rawclient import read_all

pytestmark = pytest.mark.integration
OURS = "Basic ZWdyZXNzOnMzY3JldC1wdw=="  # egress:s3cret-pw
CLIENT = "Y2xpZW50OnNlY3JldA=="  # client:secret


def _send(proxy, data: bytes, hello: bool = False, timeout: float = 2) -> bytes:
    with socket.create_connection((proxy.host, proxy.port), timeout=5) as sock:
        sock.sendall(data)
        if hello:
            time.sleep(0.3)
            with contextlib.suppress(OSError):
                sock.sendall(client_hello("public.lab.example"))
        return read_all(sock, timeout)


@pytest.mark.parametrize("transport", list(TRANSPORTS), indirect=True)
def test_absolute_form_and_connect_ask_the_upstream_for_the_normalised_name(lab, start_proxy, tmp_path,
                                                                           transport) -> None:
    lab.dns.set("xn--bcher-kva.lab.example", [Record("A", PUBLIC_IP)])
    up = FakeUpstream()
    try:
        proxy = start_proxy(upstream_policy(lab, up, creds=creds_file(tmp_path)))
        p, t = lab.public.port, lab.public_tls.port
        cases = [
            (f"GET http://PUBLIC.Lab.Example.:{p}/a HTTP/1.1\r\nHost: PUBLIC.Lab.Example.:{p}\r\n", False,
             f"GET http://public.lab.example:{p}/a HTTP/1.1"),
            (f"GET HTTP://PUBLIC.LAB.EXAMPLE:{p}/b HTTP/1.1\r\nHost: public.lab.example:{p}\r\n", False,
             f"GET http://public.lab.example:{p}/b HTTP/1.1"),
            (f"GET http://[::ffff:127.0.0.2]:{p}/c HTTP/1.1\r\nHost: [::ffff:127.0.0.2]:{p}\r\n", False,
             f"GET http://127.0.0.2:{p}/c HTTP/1.1"),
            (f"CONNECT PUBLIC.Lab.Example.:{t} HTTP/1.1\r\nHost: x\r\n", True,
             f"CONNECT public.lab.example:{t} HTTP/1.1"),
            (f"CONNECT xn--bcher-kva.lab.example:{t} HTTP/1.1\r\nHost: x\r\n", True,
             f"CONNECT xn--bcher-kva.lab.example:{t} HTTP/1.1"),
        ]
        for request, hello, expected in cases:
            before = len(up.heads)
            _send(proxy, (request + "Connection: close\r\n\r\n").encode(), hello)
            time.sleep(0.1)
            if transport == "mitmproxy" and "xn--" in expected:
                continue  # the ClientHello names public.lab.example: refused before mitmproxy asks the upstream
            (_, head), = up.heads[before:]
            assert head.split(b"\r\n")[0].decode() == expected, head
            assert header(head, "proxy-authorization") == [OURS], head
        # Refused spellings never reach it.
        for request in (f"GET http://127.2:{p}/ HTTP/1.1\r\nHost: 127.2:{p}\r\n",
                        f"GET http://public.lab.example:0{p}/ HTTP/1.1\r\nHost: x\r\n",
                        f"GET http://public.lab.example:{p}/ HTTP/1.1\r\nHost: internal.lab.example:{p}\r\n",
                        f"CONNECT 127.2:{t} HTTP/1.1\r\nHost: x\r\n"):
            before = len(up.heads)
            assert b" 403 " in _send(proxy, (request + "Connection: close\r\n\r\n").encode())[:20]
            assert len(up.heads) == before
    finally:
        up.close()


@pytest.mark.parametrize("transport", list(TRANSPORTS), indirect=True)
def test_the_clients_proxy_authorization_never_reaches_the_upstream(lab, start_proxy, transport) -> None:
    up = FakeUpstream()
    try:
        proxy = start_proxy(upstream_policy(lab, up))  # no credentials of egresswall's own
        p, t = lab.public.port, lab.public_tls.port
        for extra in (f"Proxy-Authorization: Basic {CLIENT}\r\n", f"proxy-authorization: Basic {CLIENT}\r\n",
                      f"PROXY-AUTHORIZATION:Basic {CLIENT}\r\nProxy-Authorization: Basic {CLIENT}\r\n",
                      f"Proxy-Authorization: Basic {CLIENT}\r\nConnection: keep-alive, Proxy-Authorization\r\n",
                      f"X: y\r\nProxy-Authorization: Basic\r\n {CLIENT}\r\n",
                      f"Proxy_Authorization: Basic {CLIENT}\r\n"):
            _send(proxy, f"GET http://public.lab.example:{p}/x HTTP/1.1\r\nHost: public.lab.example:{p}\r\n{extra}"
                         "Connection: close\r\n\r\n".encode())
            _send(proxy, f"CONNECT public.lab.example:{t} HTTP/1.1\r\nHost: x\r\n{extra}\r\n".encode(), hello=True)
        assert up.heads and not [h for _, h in up.heads if CLIENT.encode() in h or b"roxy-authorization" in h.lower()
                                 or b"roxy_authorization" in h.lower()]
    finally:
        up.close()


@pytest.mark.parametrize("transport", list(TRANSPORTS), indirect=True)
def test_requests_inside_a_connect_to_a_plain_port_carry_no_credentials_and_no_other_host(lab, start_proxy, tmp_path,
                                                                                         transport) -> None:
    up = FakeUpstream(relay_to=(PUBLIC_IP, lab.public.port))
    try:
        proxy = start_proxy(upstream_policy(lab, up, creds=creds_file(tmp_path)))
        p = lab.public.port
        with socket.create_connection((proxy.host, proxy.port), timeout=5) as sock:
            sock.sendall(f"CONNECT PUBLIC.lab.example.:{p} HTTP/1.1\r\nHost: x\r\n"
                         f"Proxy-Authorization: Basic {CLIENT}\r\n\r\n".encode())
            time.sleep(0.3)
            for request in (f"GET /in1 HTTP/1.1\r\nHost: public.lab.example:{p}\r\n"
                            f"Proxy-Authorization: Basic {CLIENT}\r\n\r\n",
                            f"GET http://public.lab.example:{p}/in2 HTTP/1.1\r\nHost: public.lab.example:{p}\r\n\r\n",
                            f"GET http://other.lab.example:{p}/in3 HTTP/1.1\r\nHost: other.lab.example:{p}\r\n\r\n"):
                sock.sendall(request.encode())
                time.sleep(0.3)
            out = read_all(sock, 2)
        assert out.count(b"hello from public /in") == 2 and b" 403 " in out
        assert [line for line in up.request_lines()] == [f"CONNECT public.lab.example:{p} HTTP/1.1"]
        inside = b"".join(bytes(v) for v in up.tunnel_bytes.values())
        assert b"/in1" in inside and b"GET /in2 " in inside and b"in3" not in inside
        assert b"roxy-authorization" not in inside.lower()
    finally:
        up.close()


@pytest.mark.parametrize("transport", list(TRANSPORTS), indirect=True)
def test_plain_requests_for_two_hosts_never_share_an_upstream_connection(lab, start_proxy, tmp_path, transport) -> None:
    up = FakeUpstream()
    try:
        proxy = start_proxy(upstream_policy(lab, up, "hosts:\n  deny: [denied.lab.example]\n", creds_file(tmp_path)))
        p = lab.public.port
        with socket.create_connection((proxy.host, proxy.port), timeout=5) as sock:
            for host in ("public", "other", "public", "denied"):
                sock.sendall(f"GET http://{host}.lab.example:{p}/{host} HTTP/1.1\r\n"
                             f"Host: {host}.lab.example:{p}\r\n\r\n"
                             .encode())
                time.sleep(0.3)
            read_all(sock, 1)
        by_conn = {}
        for number, head in up.heads:
            by_conn.setdefault(number, set()).add(head.split(b"/")[2].split(b":")[0])
        assert all(len(hosts) == 1 for hosts in by_conn.values()), by_conn
        assert not any(b"denied" in h for _, h in up.heads)
    finally:
        up.close()


ANSWERS = {
    "200-with-body": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",
    "200-then-bytes": ESTABLISHED + b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi",
    "101": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\nConnection: upgrade\r\n\r\n",
    "407": (b"HTTP/1.1 407 Proxy Authentication Required\r\nProxy-Authenticate: Basic realm=x\r\n"
            b"Content-Length: 0\r\n\r\n"),
    "302": b"HTTP/1.1 302 Found\r\nLocation: http://internal.lab.example/\r\nContent-Length: 0\r\n\r\n",
    "1xx-flood": b"HTTP/1.1 102 Processing\r\n\r\n" * 5000 + ESTABLISHED,
}


@pytest.mark.parametrize("transport", list(TRANSPORTS), indirect=True)
@pytest.mark.parametrize("shape", list(ANSWERS))
def test_a_hostile_connect_answer_opens_no_tunnel_and_leaks_no_credentials(lab, start_proxy, tmp_path, transport,
                                                                           shape) -> None:
    up = FakeUpstream(lambda head, inside: ANSWERS[shape] if head.startswith(b"CONNECT ") else OK)
    try:
        proxy = start_proxy(upstream_policy(lab, up, creds=creds_file(tmp_path)))
        out = _send(proxy, f"CONNECT public.lab.example:{lab.public_tls.port} HTTP/1.1\r\nHost: x\r\n\r\n".encode(),
                    hello=True, timeout=3)
        time.sleep(0.3)
        assert b"hello" not in out and b"HTTP/1.1 200 OK" not in out and b"Location" not in out, out[:300]
        closed = [r for r in proxy.audit() if r["event"] == "tunnel"]
        assert closed and closed[0]["error"], proxy.audit()  # the tunnel's record says it failed
        secret = OURS.split()[1]
        assert secret not in proxy.log_path.read_text() and secret not in proxy.stderr
        assert secret.encode() not in out
    finally:
        up.close()
