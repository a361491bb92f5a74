"""Review round 20: a name whose A-label only IDNA 2008 reads (``xn--fa-hia`` is ``faß``; IDNA 2003 maps ß to
ss, so Python's ``idna`` codec refuses to decode it) is decided on mitmproxy's path as on the fast front.

The core normalises hosts by IDNA 2008 / UTS-46, as Chromium does (``faß.de`` is ``xn--fa-hia.de``); mitmproxy
reads a request line's host and a ClientHello's SNI with Python's IDNA 2003 codec, which refuses such a label,
so its path answered 400 ``http:malformed`` to every request for the name — a browser's ``ws://`` (a CONNECT to
port 80), a plain request inside a CONNECT to a plain-HTTP port, an intercepted host, and with
``--no-fast-http`` or ``--no-fast-tunnels`` everything. ``proxy.mitm_patches`` lets mitmproxy's readers take an
all-ASCII name the core accepts; what the name is allowed to reach is decided by the core, as for any name.
"""

from __future__ import annotations

import contextlib
import socket
import ssl

import pytest
from dnslab import Record
from idna_lab import ALLOWED, INTERNAL, REFUSED, proxy_on, tls_origin
from intercept_client import open_intercepted, read_until_quiet
from labnet import PUBLIC_IP
from proxyproc import TRANSPORTS, parse_response, read_response
from rawclient import read_all, tunnel

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def origin(tmp_path_factory):
    yield from tls_origin(str(tmp_path_factory.mktemp("r20idnacert")))


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def proxy(lab, origin, tmp_path_factory, request):
    yield from proxy_on(lab, origin, tmp_path_factory.mktemp("r20idna"), request.param)


def _last_decision(proxy, host: str) -> dict:
    return [r for r in proxy.audit() if r["event"] == "decision" and r["host"] == host][-1]


@pytest.mark.parametrize(("host", "status", "stage"), [
    (ALLOWED, 200, "host"), (REFUSED, 403, "host"), (INTERNAL, 403, "address")])
def test_a_plain_request_for_an_idna2008_name_is_decided(lab, proxy, host, status, stage):
    got, _, body = proxy.get(f"http://{host}:{lab.public.port}/idna")
    assert got == status, body
    record = _last_decision(proxy, host)
    assert (record["verdict"], record["stage"]) == ("allow" if status == 200 else "refuse", stage), record


@pytest.mark.parametrize("host", ["xn--a.lab.example", "xn--ls8h.lab.example", "xn--xxx-.lab.example"])
def test_an_a_label_the_core_refuses_is_still_refused_on_both_paths(lab, proxy, host):
    """xn--a is no Punycode, xn--ls8h is an emoji IDNA 2008 refuses, xn--xxx- ends in a hyphen: none reaches an
    origin."""
    got, _, body = proxy.get(f"http://{host}:{lab.public.port}/idna")
    assert got in (400, 403), body
    with contextlib.closing(socket.create_connection((proxy.host, proxy.port), timeout=10)) as sock:
        sock.sendall(f"CONNECT {host}:{lab.public.port} HTTP/1.1\r\nHost: {host}:{lab.public.port}\r\n\r\n".encode())
        assert parse_response(read_response(sock))[0] in (400, 403)


@pytest.mark.parametrize(("host", "status"), [(ALLOWED, 200), (REFUSED, 403), (INTERNAL, 403)])
def test_a_request_inside_a_connect_to_a_plain_http_port_for_an_idna2008_name_is_decided(lab, proxy, host, status):
    authority = f"{host}:{lab.public.port}"
    with contextlib.closing(socket.create_connection((proxy.host, proxy.port), timeout=10)) as sock:
        sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        head = read_response(sock) if status != 200 else b""
        if status != 200:
            assert parse_response(head)[0] == status, head
            return
    with contextlib.closing(tunnel(proxy, authority)) as sock:
        sock.sendall(f"GET /idna-tunnel HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n".encode())
        answer = read_all(sock, 5)
    assert parse_response(answer)[0] == 200, answer


def test_a_passed_through_tls_tunnel_for_an_idna2008_name_is_decided_and_its_sni_read(lab, proxy):
    lab.dns.set(ALLOWED, [Record("A", PUBLIC_IP)])
    with contextlib.closing(tunnel(proxy, f"{ALLOWED}:{lab.public_tls.port}")) as sock:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        with context.wrap_socket(sock, server_hostname=ALLOWED) as tls:
            tls.sendall(f"GET /idna-tls HTTP/1.1\r\nHost: {ALLOWED}\r\nConnection: close\r\n\r\n".encode())
            answer = read_until_quiet(tls, 5)
    assert parse_response(answer)[0] == 200, answer


def test_an_intercepted_idna2008_host_is_decided(proxy, origin):
    tls, _ = open_intercepted(proxy, f"intercepted.{ALLOWED}", origin.port)
    with contextlib.closing(tls):
        tls.sendall(f"GET /inside HTTP/1.1\r\nHost: intercepted.{ALLOWED}:{origin.port}\r\nConnection: close\r\n\r\n"
                    .encode())
        answer = read_until_quiet(tls, 5)
    assert answer.startswith(b"HTTP/1.1 200"), answer
    assert b"origin saw: GET /inside" in answer
