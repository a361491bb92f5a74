"""Review round 23b (core): where a client still reads the address a name resolved to (after c96be78), and what
a tunnel to a plain-HTTP port forwards of a first head h11 refuses (after f307d92)."""

from __future__ import annotations

import socket

import pytest
from audit_watch import AuditWatch
from labnet import PUBLIC_IP
from proxyproc import TRANSPORTS, ProxyProcess, parse_response
from raw_origin import RawOrigin

pytestmark = pytest.mark.integration


def _closed_port(host: str = PUBLIC_IP) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def origin():
    server = RawOrigin()
    yield server
    server.close()


@pytest.fixture(scope="module")
def dead_port():
    return _closed_port()


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def proxy(lab, origin, dead_port, tmp_path_factory, request):
    folder = tmp_path_factory.mktemp("r23b-core-leaks")
    policy = folder / "policy.yaml"
    ports = f"{origin.port}, {dead_port}"
    policy.write_text(f"version: 1\nmode: enforce\ndefault: allow\n"
                      f"ports:\n  http: [80, {ports}]\n  connect: [443, {ports}]\n"
                      f"addresses:\n  allow: [{PUBLIC_IP}/32]\n"
                      f"resolver:\n  nameservers: ['{lab.dns.address}']\n  timeout: 1\n"
                      "limits:\n  header_timeout: 3\n  idle_timeout: 3\n  connect_timeout: 2\n")
    process = ProxyProcess(["--policy", str(policy), *TRANSPORTS[request.param]], folder / "audit.jsonl")
    process.transport = request.param
    yield process
    process.stop()
    assert not [e for e in process.outbound() if e["host"] != PUBLIC_IP], process.outbound()


def _exchange(proxy: ProxyProcess, data: bytes) -> bytes:
    got = b""
    with socket.create_connection((proxy.host, proxy.port), timeout=6) as sock:
        sock.sendall(data)
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return got


@pytest.mark.parametrize("accept", ["text/plain", "application/json"])
def test_a_failed_connect_to_a_name_does_not_say_the_address_it_resolved_to(lab, proxy, dead_port, accept):
    """README (the refusal's ``reason``): "For a name refused by the address it resolved to, it names the rule
    ... but not the address: a page in a contained browser could otherwise point a name of its own at internal
    names and read their addresses off its refusals." A connect that fails (nothing listens there) is answered
    502 with ``connect to 127.0.0.2:PORT failed: Connection refused`` in X-Egresswall-Reason and the body: the
    same mapping of a name to its address, for every name whose address the policy admits (an addresses.allow
    range of internal addresses, where a closed port is the rule). The record keeps it; the client's answer
    should not."""
    authority = f"public.lab.example:{dead_port}"
    watch = AuditWatch(proxy.log_path).mark()
    answer = _exchange(proxy, f"GET http://{authority}/x HTTP/1.1\r\nHost: {authority}\r\nAccept: {accept}\r\n"
                              f"Connection: close\r\n\r\n".encode())
    status, headers, body = parse_response(answer)
    assert status == 502, answer[:300]
    records = watch.wait_for(lambda r: any(x.get("status") == 502 for x in r))
    assert any(PUBLIC_IP in str(r.get("reason")) + str(r.get("error")) for r in records), records  # the record's
    assert PUBLIC_IP not in headers.get("x-egresswall-reason", ""), headers
    assert PUBLIC_IP.encode() not in body, body


def test_a_failed_tunnel_connect_to_a_name_does_not_say_the_address_it_resolved_to(lab, proxy, dead_port):
    """As above, for ``CONNECT name:port`` answered 502 (the fast front's ``_connect_failed``, mitmproxy's
    ``_server_send``)."""
    authority = f"public.lab.example:{dead_port}"
    answer = _exchange(proxy, f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    status, headers, body = parse_response(answer)
    assert status == 502, answer[:300]
    assert PUBLIC_IP not in headers.get("x-egresswall-reason", ""), headers
    assert PUBLIC_IP.encode() not in body, body


@pytest.mark.parametrize("method", [b"G\x01T", b"GET\x00", b"GE\x7fT", b"G\xc3\xa9T", b"GET;x", b"GET:"],
                         ids=["soh", "nul", "del", "utf8", "semicolon", "colon"])
def test_a_method_that_is_not_a_token_is_not_forwarded(lab, proxy, origin, method):
    """A first head in a tunnel to a plain-HTTP port whose method is not an HTTP token (RFC 9110 9.1: method =
    token) now goes to mitmproxy's HTTP layer (f307d92), which takes any bytes but whitespace as a method; the
    decision allows it, its record names another method than the one sent (``GT`` for ``G\\x01T``, ``GET;X`` for
    ``GET;x``), and the origin receives the bytes as they are (a NUL, a control byte, non-ASCII). The README holds
    ``egresswall check --method`` to an HTTP token ("--method must be an HTTP token (else exit 2)") and says the
    method "is matched without regard to case, as the proxy matches it": a method no check can name should not
    reach an origin, and what reaches it should be what was recorded. Expected: refused 400 (http:malformed or
    form:method), nothing at the origin."""
    authority = f"public.lab.example:{origin.port}"
    mark = origin.mark()
    watch = AuditWatch(proxy.log_path).mark()
    answer = _exchange(proxy, f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode()
                       + method + f" /m HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n".encode())
    watch.wait_for(lambda r: any(x["event"] == "tunnel" for x in r))
    origin.settle(0.3)
    got = origin.since(mark)
    assert method + b" /m" not in got, (answer[:200], got)
    assert b"HTTP/1.1 400" in answer, answer[:300]
