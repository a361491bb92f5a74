"""The real proxy against loopback upstreams and a DNS server: what must be refused is refused
before any connection, and the internal stand-ins never see a packet."""

from __future__ import annotations

import socket
import ssl
import uuid

import pytest
from labnet import PUBLIC_IP
from proxyproc import TRANSPORTS, both_transports

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("internal_saw_nothing")]


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def proxy(lab, tmp_path_factory, request):
    """Every test here runs against both tunnel paths: egresswall's fast relay and mitmproxy's layers."""
    from proxyproc import ProxyProcess

    folder = tmp_path_factory.mktemp("enforce")
    policy = folder / "policy.yaml"
    policy.write_text(lab.policy_text("hosts:\n  deny:\n    - denied.lab.example\n"))
    mode = TRANSPORTS[request.param]
    process = ProxyProcess(["--policy", str(policy), *mode], folder / "audit.jsonl")
    process.transport = request.param
    yield process
    process.stop()
    assert not [e for e in process.outbound() if e["host"] not in (PUBLIC_IP,)], process.outbound()


def test_allowed_name_is_forwarded_to_the_checked_address(lab, proxy):
    status, headers, body = proxy.get(f"http://public.lab.example:{lab.public.port}/hello")
    assert status == 200
    assert body == b"hello from public /hello"


@pytest.mark.parametrize("name", ["internal.lab.example", "mixed.lab.example", "alias.lab.example",
                                  "alias2.lab.example", "mapped.lab.example"])
def test_name_resolving_inside_is_refused_for_http(lab, proxy, name):
    status, headers, body = proxy.get(f"http://{name}:{lab.public.port}/")
    assert status == 403
    reason = headers["x-egresswall-reason"]
    # The client reads the rule that refused, never the address or the internal alias the name led to (the audit
    # record has them: policy.wire.client_reason, review round 23).
    assert reason.startswith(name) and ("special-purpose 127.0.0.0/8" in reason or "cname:" in reason), reason
    assert "127.0.0.3" not in reason and "db.internal" not in reason


def test_name_resolving_inside_is_refused_for_connect(lab, proxy):
    sock, status, headers = proxy.connect(f"internal.lab.example:{lab.public_tls.port}")
    sock.close()
    assert status == 403
    assert "127.0.0.0/8" in headers["x-egresswall-rule"]


def test_name_resolving_inside_is_refused_for_websocket(lab, proxy):
    ws_headers = {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
                  "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}
    status, headers, _ = proxy.get(f"http://internal.lab.example:{lab.public.port}/ws", ws_headers)
    assert status == 403
    # Chromium sends ws:// as a CONNECT to the host's port: refused the same way.
    sock, status, _ = proxy.connect(f"internal.lab.example:{lab.public.port}")
    sock.close()
    assert status == 403


@pytest.mark.parametrize("host", ["127.0.0.3", "[::ffff:127.0.0.3]", "[::ffff:7f00:3]", "[::1]", "127.0.0.1",
                                  "0x7f.0.0.3", "0177.0.0.3", "2130706435", "127.3", "0", "[::127.0.0.3]",
                                  "localhost", "db.localhost", "db.internal", "printer.local", "router.home.arpa",
                                  "[fe80::1%25lo]", "intranet", "127。0。0。3"])
def test_internal_ip_literals_and_names_are_refused(lab, proxy, host):
    status, headers, body = proxy.get(f"http://{host}:{lab.public.port}/")
    assert status in (400, 403), body
    if status == 403:
        assert headers["x-egresswall-reason"]


def test_redirect_to_internal_host_is_refused_at_the_second_hop(lab, proxy):
    target = f"http://internal.lab.example:{lab.public.port}/secret"
    status, headers, _ = proxy.get(f"http://public.lab.example:{lab.public.port}/redirect?to={target}")
    assert status == 302 and headers["location"] == target
    status, headers, _ = proxy.get(headers["location"])  # the client follows, through the proxy
    assert status == 403


def test_dns_rebinding_never_reaches_the_internal_stand_in(lab, proxy):
    # First answer public (TTL 0), every later answer internal: the proxy connects to what it checked.
    from dnslab import Behaviour, Record

    name = f"rebind-{uuid.uuid4().hex[:8]}.lab.example"
    lab.dns.set(name, Behaviour(sequence=[[Record("A", PUBLIC_IP, ttl=0)], [Record("A", "127.0.0.3", ttl=0)]]))
    status, _, body = proxy.get(f"http://{name}:{lab.public.port}/first")
    assert status == 200 and body.endswith(b"/first")
    status, headers, _ = proxy.get(f"http://{name}:{lab.public.port}/second")
    assert status == 403 and "special-purpose 127.0.0.0/8" in headers["x-egresswall-reason"]


def test_host_header_that_disagrees_is_refused(lab, proxy):
    status, headers, _ = proxy.get(f"http://public.lab.example:{lab.public.port}/",
                                   {"Host": f"internal.lab.example:{lab.public.port}"})
    assert status == 403
    assert headers["x-egresswall-rule"] == "form:host-header"


def test_host_header_with_other_port_is_refused(lab, proxy):
    status, headers, _ = proxy.get(f"http://public.lab.example:{lab.public.port}/", {"Host": "public.lab.example:1"})
    assert status == 403 and headers["x-egresswall-rule"] == "form:host-header"


def test_tls_tunnel_passes_through_with_matching_sni(lab, proxy):
    sock, status, _ = proxy.connect(f"public.lab.example:{lab.public_tls.port}")
    assert status == 200
    context = ssl.create_default_context(cafile=str(lab.cert_file))  # the upstream's own certificate: no MITM
    with context.wrap_socket(sock, server_hostname="public.lab.example") as tls:
        tls.sendall(b"GET /tunnel HTTP/1.1\r\nHost: public.lab.example\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := tls.recv(4096):
            data += chunk
    assert data.endswith(b"/tunnel")


def test_tls_sni_that_disagrees_with_connect_is_closed_with_an_alert(lab, proxy):
    sock, status, _ = proxy.connect(f"public.lab.example:{lab.public_tls.port}")
    assert status == 200
    context = ssl.create_default_context(cafile=str(lab.cert_file))
    with pytest.raises(ssl.SSLError, match="UNRECOGNIZED_NAME"):
        context.wrap_socket(sock, server_hostname="other.lab.example")
    sock.close()
    refusal = [d for d in proxy.decisions() if d["rule"] == "tls:sni"]
    assert refusal and "other.lab.example" in refusal[-1]["reason"]


def test_connect_to_forbidden_port_is_refused(lab, proxy):
    sock, status, headers = proxy.connect("public.lab.example:22")
    sock.close()
    assert status == 403 and headers["x-egresswall-rule"] == "ports.connect"


def test_denied_host_is_refused_and_never_resolved(lab, proxy):
    before = len(lab.dns.queries)  # the lab's DNS server is shared by the session: look only at this test
    status, headers, _ = proxy.get(f"http://denied.lab.example:{lab.public.port}/")
    assert status == 403
    assert "denied.lab.example" not in {name for name, _ in lab.dns.queries[before:]}


def test_upstream_cannot_forge_egresswall_headers(lab, proxy):
    status, headers, body = proxy.get(f"http://public.lab.example:{lab.public.port}/forge")
    assert status == 200 and body == b"forged"
    assert "x-egresswall-reason" not in headers


def test_no_getaddrinfo_while_proxying_named_hosts(lab, proxy):
    for _ in range(3):
        assert proxy.get(f"http://public.lab.example:{lab.public.port}/")[0] == 200
    sock, status, _ = proxy.connect(f"public.lab.example:{lab.public_tls.port}")
    sock.close()
    assert status == 200
    assert proxy.getaddrinfo_names() == []
    connects = proxy.outbound()
    assert connects and all(c["host"] == PUBLIC_IP for c in connects)


def test_keep_alive_reuses_the_upstream_connection(lab, proxy):
    before = lab.public.connections
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        for i in range(3):
            sock.sendall(f"GET http://public.lab.example:{lab.public.port}/ka{i} HTTP/1.1\r\n"
                         f"Host: public.lab.example:{lab.public.port}\r\n\r\n".encode())
            from proxyproc import parse_response, read_response

            status, _, body = parse_response(read_response(sock))
            assert status == 200 and body.endswith(f"/ka{i}".encode())
    assert lab.public.connections - before == 1


def test_expect_continue_to_refused_target_is_refused_before_the_body(lab, proxy):
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(f"POST http://internal.lab.example:{lab.public.port}/upload HTTP/1.1\r\n"
                     f"Host: internal.lab.example:{lab.public.port}\r\nContent-Length: 1000000\r\n"
                     "Expect: 100-continue\r\n\r\n".encode())
        head = sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 403")


@both_transports
def test_request_body_over_the_limit_is_refused(lab, start_proxy):
    proxy = start_proxy(lab.policy_text(limits="limits:\n  max_request_body: 100\n"))
    status, headers, _ = proxy.get(f"http://public.lab.example:{lab.public.port}/up", method="POST", body=b"x" * 101)
    assert status == 413 and headers["x-egresswall-rule"] == "limits.max_request_body"
    status, _, body = proxy.get(f"http://public.lab.example:{lab.public.port}/up", method="POST", body=b"x" * 100)
    assert status == 200 and body == b"got 100 bytes"


@both_transports
def test_requests_to_the_proxy_itself_are_refused(lab, start_proxy):
    # Even a policy that re-admits all of loopback and the proxy's own ports cannot make it talk to itself.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    text = lab.policy_text().replace(f"[{PUBLIC_IP}/32]", "[127.0.0.0/8]")
    text = text.replace("http: [", f"http: [{port}, ").replace("connect: [", f"connect: [{port}, ")
    proxy = start_proxy(text, "--listen", f"127.0.0.1:{port}")
    assert proxy.port == port
    sock, status, headers = proxy.connect(f"127.0.0.1:{port}")
    sock.close()
    assert status == 403 and headers["x-egresswall-rule"] == "self"
    status, headers, _ = proxy.get(f"http://127.0.0.1:{port}/")
    assert status == 403 and headers["x-egresswall-rule"] == "self"


@both_transports
def test_per_client_connection_cap(lab, start_proxy):
    proxy = start_proxy(lab.policy_text(limits="limits:\n  max_connections_per_client: 2\n"))
    held = [socket.create_connection((proxy.host, proxy.port), timeout=10) for _ in range(2)]
    try:
        import time

        time.sleep(0.3)
        status, headers, _ = proxy.get(f"http://public.lab.example:{lab.public.port}/")
        assert status == 429 and headers["x-egresswall-rule"] == "limits.max_connections_per_client"
    finally:
        for sock in held:
            sock.close()


@both_transports
def test_report_mode_lets_host_refusals_through_but_never_address_refusals(lab, start_proxy):
    proxy = start_proxy(lab.policy_text("hosts:\n  deny:\n    - public.lab.example\n", mode="report"))
    status, _, body = proxy.get(f"http://public.lab.example:{lab.public.port}/reported")
    assert status == 200 and body.endswith(b"/reported")
    status, _, _ = proxy.get(f"http://internal.lab.example:{lab.public.port}/")
    assert status == 403
    verdicts = [(d["host"], d["verdict"]) for d in proxy.decisions()]
    assert ("public.lab.example", "report") in verdicts
    assert ("internal.lab.example", "refuse") in verdicts


@both_transports
def test_internal_address_literal_refused_even_when_host_allowed(lab, start_proxy):
    proxy = start_proxy(lab.policy_text("hosts:\n  allow:\n    - internal.lab.example\n", default="deny"))
    status, headers, _ = proxy.get(f"http://internal.lab.example:{lab.public.port}/")
    assert status == 403 and "127.0.0.0/8" in headers["x-egresswall-rule"]


@both_transports
def test_allowlist_mode_refuses_unlisted_host_without_resolving(lab, start_proxy):
    proxy = start_proxy(lab.policy_text("hosts:\n  allow:\n    - public.lab.example\n", default="deny"))
    assert proxy.get(f"http://public.lab.example:{lab.public.port}/")[0] == 200
    before = len(lab.dns.queries)  # the lab's DNS server is shared by the session: look only at this test
    status, headers, _ = proxy.get(f"http://other.lab.example:{lab.public.port}/")
    assert status == 403 and headers["x-egresswall-rule"].startswith("default deny")
    assert "other.lab.example" not in {name for name, _ in lab.dns.queries[before:]}



def test_tunnels_take_the_path_the_proxy_was_started_with(lab, proxy):
    sock, status, _ = proxy.connect(f"public.lab.example:{lab.public_tls.port}")
    sock.close()
    assert status == 200
    _, body = proxy.admin("/metrics")
    fast = [line for line in body.splitlines() if line.startswith("egresswall_fast_tunnels_total")]
    count = float(fast[0].split()[-1])
    assert (count > 0) == (proxy.transport == "fast")


def test_client_hello_split_across_reads_still_passes_through(lab, proxy):
    """A ClientHello whose first two bytes arrive alone is still a ClientHello (both tunnel paths)."""
    import time

    sock, status, _ = proxy.connect(f"public.lab.example:{lab.public_tls.port}")
    assert status == 200
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    context = ssl.create_default_context(cafile=str(lab.cert_file))
    tls = context.wrap_bio(incoming, outgoing, server_hostname="public.lab.example")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    hello = outgoing.read()
    sock.sendall(hello[:2])
    time.sleep(0.2)
    sock.sendall(hello[2:])
    while True:  # finish the handshake over the tunnel by hand
        try:
            tls.do_handshake()
            break
        except ssl.SSLWantReadError:
            if data := outgoing.read():
                sock.sendall(data)
            chunk = sock.recv(65536)
            assert chunk, "the tunnel was closed during the handshake"
            incoming.write(chunk)
    sock.sendall(outgoing.read())
    sock.close()


def test_plain_http_takes_the_path_the_proxy_was_started_with(lab, proxy):
    def relayed_by_the_front() -> float:
        _, body = proxy.admin("/metrics")
        return float(next(line for line in body.splitlines()
                          if line.startswith("egresswall_fast_http_requests_total")).split()[-1])

    before = relayed_by_the_front()
    assert proxy.get(f"http://public.lab.example:{lab.public.port}/which-path")[0] == 200
    assert (relayed_by_the_front() > before) == (proxy.transport == "fast")
