"""Review round 20 (a helper's review of the round's diff, what held): spellings of IDNA 2008-only A-labels on
both transports, after proxy/mitm_hostnames.py.

Upper/mixed case A-labels, a trailing dot, a Host that disagrees with the request line in spelling, an SNI that
spells the CONNECT host differently: each is decided as the core reads it, and nothing reaches another host.
"""

from __future__ import annotations

import contextlib
import socket
import ssl

import pytest
from idna_lab import ALLOWED, proxy_on, tls_origin
from intercept_client import open_intercepted, read_until_quiet
from proxyproc import TRANSPORTS, parse_response
from rawclient import read_all, tunnel

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def origin(tmp_path_factory):
    yield from tls_origin(str(tmp_path_factory.mktemp("r20bidnacert")))


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def proxy(lab, origin, tmp_path_factory, request):
    yield from proxy_on(lab, origin, tmp_path_factory.mktemp("r20bidna"), request.param)


def _raw(proxy, data: bytes) -> bytes:
    with contextlib.closing(socket.create_connection((proxy.host, proxy.port), timeout=10)) as sock:
        sock.sendall(data)
        return read_all(sock, 5)


@pytest.mark.parametrize(("host", "allowed"), [
    ("XN--FA-HIA.lab.example", True), ("Xn--Fa-Hia.LAB.example.", True), (ALLOWED + ".", True),
    ("XN--STRAE-OQA.lab.example", False), ("xn--strae-oqa.LAB.EXAMPLE.", False),
    ("XN--GRO-7KA.lab.example", False), ("xn--gro-7ka.lab.example.", False)])
def test_a_spelling_of_an_idna2008_name_is_decided_as_the_core_reads_it(lab, proxy, host, allowed):
    got, _, body = proxy.get(f"http://{host}:{lab.public.port}/r20b")
    if allowed:
        assert got == 200, body
    else:
        assert got in (400, 403), body


@pytest.mark.parametrize("host_header", ["XN--STRAE-OQA.lab.example", "xn--strae-oqa.lab.example.",
                                         "XN--GRO-7KA.lab.example"])
def test_a_host_header_naming_another_idna2008_name_than_the_line_is_refused(lab, proxy, host_header):
    port = lab.public.port
    answer = _raw(proxy, f"GET http://{ALLOWED}:{port}/r20b HTTP/1.1\r\nHost: {host_header}:{port}\r\n"
                         "Connection: close\r\n\r\n".encode())
    assert parse_response(answer)[0] in (400, 403), answer


@pytest.mark.parametrize("host_header", ["XN--STRAE-OQA.lab.example", "XN--GRO-7KA.lab.example"])
def test_inside_a_connect_to_a_plain_http_port_another_idna2008_host_is_refused(lab, proxy, host_header):
    authority = f"{ALLOWED}:{lab.public.port}"
    with contextlib.closing(tunnel(proxy, authority)) as sock:
        sock.sendall(f"GET /r20b HTTP/1.1\r\nHost: {host_header}:{lab.public.port}\r\nConnection: close\r\n\r\n"
                     .encode())
        answer = read_all(sock, 5)
    assert parse_response(answer)[0] in (400, 403), answer


def _tls_through(proxy, authority: str, sni: str) -> bytes:
    with contextlib.closing(tunnel(proxy, authority)) as sock:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        try:
            with context.wrap_socket(sock, server_hostname=sni) as tls:
                tls.sendall(f"GET /r20b-tls HTTP/1.1\r\nHost: {sni}\r\nConnection: close\r\n\r\n".encode())
                return read_until_quiet(tls, 5)
        except (ssl.SSLError, OSError) as err:
            return repr(err).encode()


@pytest.mark.parametrize("sni", ["XN--FA-HIA.lab.example"])
def test_a_passed_through_tunnel_whose_sni_spells_its_host_otherwise_is_judged_alike(lab, proxy, sni):
    """Parity: whatever one transport answers to an SNI that is the CONNECT host in another spelling, the other
    does too (recorded here per transport; compare the two parameters)."""
    answer = _tls_through(proxy, f"{ALLOWED}:{lab.public_tls.port}", sni)
    assert answer.startswith(b"HTTP/1.1 200"), answer


@pytest.mark.parametrize("sni", ["XN--STRAE-OQA.lab.example", "intercepted.XN--FA-HIA.lab.example"])
def test_a_passed_through_tunnel_whose_sni_names_another_host_is_refused(lab, proxy, sni):
    answer = _tls_through(proxy, f"{ALLOWED}:{lab.public_tls.port}", sni)
    assert not answer.startswith(b"HTTP/1.1 200"), answer


def test_an_intercepted_idna2008_host_in_upper_case_is_decided(proxy, origin):
    host = "INTERCEPTED.XN--FA-HIA.lab.example"
    tls, _ = open_intercepted(proxy, host, origin.port)
    with contextlib.closing(tls):
        tls.sendall(f"GET /inside HTTP/1.1\r\nHost: {host}:{origin.port}\r\nConnection: close\r\n\r\n".encode())
        answer = read_until_quiet(tls, 5)
    assert answer.startswith(b"HTTP/1.1 200"), answer


def test_inside_an_intercepted_idna2008_host_another_is_refused(proxy, origin):
    tls, _ = open_intercepted(proxy, f"intercepted.{ALLOWED}", origin.port)
    with contextlib.closing(tls):
        tls.sendall(f"GET /inside HTTP/1.1\r\nHost: XN--STRAE-OQA.lab.example:{origin.port}\r\n"
                    "Connection: close\r\n\r\n".encode())
        answer = read_until_quiet(tls, 5)
    assert parse_response(answer)[0] in (400, 403), answer
