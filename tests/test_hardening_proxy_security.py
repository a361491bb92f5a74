"""HTTP-proxy hygiene through the real proxy, on both tunnel paths: hop-by-hop headers, body limits,
heads that stop half way, tunnels that never become a blind relay, strict SNI, upgrades, silent
sockets, and a proxy port that speaks HTTP/1.1 only. Each case was a reproduced defect."""

from __future__ import annotations

import socket
import ssl
import subprocess
import sys
import time

import pytest
from hostile import SwitchesProtocols
from labnet import PUBLIC_IP
from proxyproc import ROOT, TRANSPORTS, ProxyProcess, parse_response, read_response
from rawclient import read_all, tunnel
from tls_build import ECH, client_hello, extension, real_client_hello, server_name_body

pytestmark = pytest.mark.integration
HEADER_TIMEOUT, FIRST_BYTE_TIMEOUT, IDLE_TIMEOUT, BODY_LIMIT = 2, 2, 8, 1000


@pytest.fixture(scope="module")
def switch():
    server = SwitchesProtocols()
    yield server
    server.close()


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def proxy(lab, switch, tmp_path_factory, request):
    folder = tmp_path_factory.mktemp("security")
    policy = folder / "policy.yaml"
    policy.write_text(
        f"version: 1\nmode: enforce\ndefault: deny\n"
        f"hosts:\n  allow:\n    - host: public.lab.example\n      websocket: true\n"
        f"    - host: other.lab.example\n      websocket: false\n"
        f"ports:\n  http: [80, {lab.public.port}, {switch.port}]\n"
        f"  connect: [443, {lab.public_tls.port}, {lab.public.port}]\n"
        f"addresses:\n  allow: [{PUBLIC_IP}/32]\n"
        f"resolver:\n  nameservers: ['{lab.dns.address}']\n  timeout: 1\n"
        f"limits:\n  header_timeout: {HEADER_TIMEOUT}\n  first_byte_timeout: {FIRST_BYTE_TIMEOUT}\n"
        f"  idle_timeout: {IDLE_TIMEOUT}\n  max_request_body: {BODY_LIMIT}\n  max_connections_per_client: 40\n")
    mode = TRANSPORTS[request.param]
    process = ProxyProcess(["--policy", str(policy), *mode], folder / "audit.jsonl")
    yield process
    process.stop()
    assert not [e for e in process.outbound() if e["host"] != PUBLIC_IP], process.outbound()


def records_for(proxy: ProxyProcess, predicate, timeout: float = 10, at_least: int = 1) -> list[dict]:
    """The records ``predicate`` picks, once there are ``at_least`` of them (or what there is at the timeout:
    records are written as each connection is judged, not all at once)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [r for r in proxy.audit() if predicate(r)]
        if len(found) >= at_least or time.monotonic() >= deadline:
            return found
        time.sleep(0.1)





# ---- 1. hop-by-hop headers ------------------------------------------------------------------------

HOP_HEADERS = {"Proxy-Authorization": "Basic dXNlcjpwcm94eS1zZWNyZXQ=", "Proxy-Connection": "keep-alive",
               "Keep-Alive": "timeout=5", "TE": "trailers", "Trailer": "X-Checksum", "X-Hop-Secret": "named",
               "Upgrade-Insecure-Requests": "1"}


def _forwarded_headers(lab, path: str) -> dict[str, str]:
    sent = [h for _, p, h in lab.public.requests if p == path]
    assert len(sent) == 1, sent
    return {k.lower(): v for k, v in sent[0].items()}


def test_hop_by_hop_headers_never_reach_the_origin(lab, proxy):
    path = f"/hop-{proxy.port}"
    raw = (f"GET http://public.lab.example:{lab.public.port}{path} HTTP/1.1\r\nHost: public.lab.example:"
           f"{lab.public.port}\r\nConnection: close, X-Hop-Secret\r\n"
           + "".join(f"{k}: {v}\r\n" for k, v in HOP_HEADERS.items()) + "\r\n").encode()
    status, _, _ = parse_response(proxy.raw(raw))
    assert status == 200
    got = _forwarded_headers(lab, path)
    for name in ("proxy-authorization", "proxy-connection", "keep-alive", "te", "trailer", "x-hop-secret"):
        assert name not in got, (name, got)
    assert got["upgrade-insecure-requests"] == "1"  # an end-to-end header that merely looks alike stays
    assert "proxy-secret" not in str(got)


def test_hop_by_hop_headers_are_removed_inside_a_connect_to_a_plain_http_port(lab, proxy):
    path = f"/hop-tunnel-{proxy.port}"
    sock = tunnel(proxy, f"public.lab.example:{lab.public.port}")
    with sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: public.lab.example:{lab.public.port}\r\nConnection: close, "
                     f"X-Hop-Secret\r\nX-Hop-Secret: s\r\nProxy-Authorization: Basic c2VjcmV0\r\n\r\n".encode())
        assert read_all(sock).startswith(b"HTTP/1.1 200")
    got = _forwarded_headers(lab, path)
    assert "x-hop-secret" not in got and "proxy-authorization" not in got


# ---- 2. chunked bodies over the limit -------------------------------------------------------------

def _chunked(path: str, port: int, chunks: list[bytes]) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    return (f"POST http://public.lab.example:{port}{path} HTTP/1.1\r\nHost: public.lab.example:{port}\r\n"
            "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n").encode() + body


def test_a_chunked_body_over_the_limit_gets_413_and_the_upstream_sees_nothing(lab, proxy):
    path = f"/upload-{proxy.port}"
    connections = lab.public.connections
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        data = _chunked(path, lab.public.port, [b"a" * 400] * 3)
        try:
            for i in range(0, len(data), 97):  # split and slow writes
                sock.sendall(data[i:i + 97])
                time.sleep(0.01)
        except OSError:
            pass  # the proxy stopped listening to a body it refused
        answer = read_response(sock)
    status, headers, body = parse_response(answer)
    assert status == 413 and headers["x-egresswall-rule"] == "limits.max_request_body", answer[:300]
    assert not [p for _, p, _ in lab.public.requests if p == path]
    assert lab.public.connections == connections, "the upstream was connected for a refused body"
    (record,) = records_for(proxy, lambda r: r.get("path") == path and r["verdict"] == "refuse")
    assert record["status"] == 413 and record["rule"] == "limits.max_request_body"
    assert not [r for r in proxy.audit() if r.get("path") == path and r["event"] == "response"
                and r["verdict"] == "allow"]


def test_a_chunked_body_under_the_limit_is_forwarded(lab, proxy):
    path = f"/small-upload-{proxy.port}"
    status, _, body = parse_response(proxy.raw(_chunked(path, lab.public.port, [b"b" * 300, b"c" * 300])))
    assert status == 200 and body == b"got 600 bytes"  # the whole body reached the upstream
    assert [p for _, p, _ in lab.public.requests if p == path] == [path]


# ---- 3. a head that stops half way ----------------------------------------------------------------

def test_half_a_head_then_silence_gets_408(lab, proxy):
    started = time.monotonic()
    with socket.create_connection((proxy.host, proxy.port), timeout=IDLE_TIMEOUT + 5) as sock:
        sock.sendall(f"GET http://public.lab.example:{lab.public.port}/half HTTP/1.1\r\nHost: public.lab.example"
                     f"\r\nX-Partial: ".encode())
        answer = read_response(sock)
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert HEADER_TIMEOUT - 0.5 < time.monotonic() - started < IDLE_TIMEOUT


def test_half_a_second_head_on_a_kept_alive_connection_gets_408(lab, proxy):
    with socket.create_connection((proxy.host, proxy.port), timeout=IDLE_TIMEOUT + 5) as sock:
        sock.sendall(f"GET http://public.lab.example:{lab.public.port}/first HTTP/1.1\r\nHost: "
                     f"public.lab.example:{lab.public.port}\r\n\r\n".encode())
        first = b""
        while b"hello from public /first" not in first:
            first += sock.recv(65536)
        started = time.monotonic()
        sock.sendall(f"GET http://public.lab.example:{lab.public.port}/second HTTP/1.1\r\nHost: pub".encode())
        answer = read_response(sock)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:100]
    assert time.monotonic() - started < IDLE_TIMEOUT


# ---- 7. tunnels that never become a blind relay ---------------------------------------------------

def test_a_client_hello_whose_first_byte_arrives_alone_is_still_checked(lab, proxy):
    sock = tunnel(proxy, f"public.lab.example:{lab.public_tls.port}")
    with sock:
        hello = real_client_hello("other.lab.example")
        sock.sendall(hello[:1])
        time.sleep(0.5)
        sock.sendall(hello[1:])
        answer = read_all(sock)
    assert answer[:1] == b"\x15", answer[:20]  # a TLS alert, not the upstream's ServerHello
    assert records_for(proxy, lambda r: r["rule"] == "tls:sni" and "other.lab.example" in r["reason"])


def test_plain_text_inside_a_connect_to_a_tls_port_is_refused(lab, proxy):
    sock = tunnel(proxy, f"public.lab.example:{lab.public_tls.port}")
    with sock:
        sock.sendall(b"G")
        time.sleep(0.3)
        sock.sendall(b"ET / HTTP/1.1\r\nHost: denied.lab.example\r\n\r\n")
        answer = read_all(sock)
    assert b"HTTP/1" not in answer
    assert records_for(proxy, lambda r: r["rule"] == "tls:not-tls")


def test_http_inside_a_tunnel_split_after_its_first_byte_is_decided(lab, proxy):
    sock = tunnel(proxy, f"public.lab.example:{lab.public.port}")
    path = f"/split-{proxy.port}"
    with sock:
        sock.sendall(b"G")
        time.sleep(0.3)
        sock.sendall(f"ET {path} HTTP/1.1\r\nHost: denied.lab.example\r\n\r\n".encode())
        status, headers, _ = parse_response(read_all(sock, 5))
    assert status == 403 and headers["x-egresswall-rule"] == "form:host-header"
    assert not [p for _, p, _ in lab.public.requests if p == path]


def test_a_tunnel_whose_first_message_never_completes_is_closed(lab, proxy):
    sock = tunnel(proxy, f"public.lab.example:{lab.public_tls.port}")
    started = time.monotonic()
    with sock:
        sock.sendall(real_client_hello("public.lab.example")[:40])
        read_all(sock, HEADER_TIMEOUT + 10)
    assert time.monotonic() - started < HEADER_TIMEOUT + 5
    assert records_for(proxy, lambda r: r["rule"] == "limits.header_timeout" and r["method"] == "CONNECT")


# ---- 8. an SNI egresswall cannot read, and Encrypted Client Hello --------------------------------

@pytest.mark.parametrize("hello", [
    client_hello(sni_body=server_name_body(b"public.lab.example ")),
    client_hello(sni_body=server_name_body(b"a" * 64 + b".lab.example")),
    client_hello(sni_body=server_name_body(b"public.lab.example", b"other.lab.example")),
    client_hello(sni_body=server_name_body(b"public.lab.example", name_type=1)),
    client_hello(b"public.lab.example", extra=(extension(ECH, bytes(48)),)),  # the allowlist refuses ECH
], ids=["trailing-space", "long-label", "two-names", "name-type", "ech"])
def test_an_unreadable_sni_or_ech_is_refused_not_passed_as_no_sni(lab, proxy, hello):
    sock = tunnel(proxy, f"public.lab.example:{lab.public_tls.port}")
    with sock:
        sock.sendall(hello)
        answer = read_all(sock)
    assert answer[:1] in (b"\x15", b""), answer[:20]
    assert records_for(proxy, lambda r: r["stage"] == "tls" and r["verdict"] == "refuse"
                       and r["rule"] in ("tls:sni", "tls:ech", "tls:invalid-hello"))


def test_a_real_tls_client_still_gets_through(lab, proxy):
    sock = tunnel(proxy, f"public.lab.example:{lab.public_tls.port}")
    context = ssl.create_default_context(cafile=str(lab.cert_file))
    with context.wrap_socket(sock, server_hostname="public.lab.example") as tls:
        tls.sendall(b"GET /ok HTTP/1.1\r\nHost: public.lab.example\r\nConnection: close\r\n\r\n")
        assert b"hello from public-tls /ok" in read_all(tls)


# ---- 9. upgrades -----------------------------------------------------------------------------------

@pytest.mark.parametrize("upgrade", [["websocket, foo"], ["foo, websocket"], ["foo"], ["websocket", "websocket"],
                                     ["h2c"]])
def test_any_upgrade_but_one_websocket_is_refused(lab, proxy, switch, upgrade):
    heads = len(switch.heads)
    lines = "".join(f"Upgrade: {u}\r\n" for u in upgrade)
    raw = (f"GET http://public.lab.example:{switch.port}/up HTTP/1.1\r\nHost: public.lab.example:{switch.port}\r\n"
           f"Connection: Upgrade\r\n{lines}Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
           "Sec-WebSocket-Version: 13\r\n\r\n").encode()
    status, headers, _ = parse_response(proxy.raw(raw))
    assert status == 403 and headers["x-egresswall-rule"] == "http:upgrade"
    assert len(switch.heads) == heads


def test_websocket_false_is_not_bypassed(lab, proxy, switch):
    raw = (f"GET http://other.lab.example:{switch.port}/ws HTTP/1.1\r\nHost: other.lab.example:{switch.port}\r\n"
           "Connection: Upgrade\r\nUpgrade: WebSocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
           "Sec-WebSocket-Version: 13\r\n\r\n").encode()
    status, _, _ = parse_response(proxy.raw(raw))
    assert status == 403


def test_an_upstream_cannot_switch_protocols_unasked(lab, proxy, switch):
    echoed = switch.echoed
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(f"GET http://public.lab.example:{switch.port}/plain HTTP/1.1\r\nHost: public.lab.example:"
                     f"{switch.port}\r\n\r\n".encode())
        time.sleep(0.3)
        with pytest.raises(OSError) if False else _nothing():
            sock.sendall(b"raw bytes for a relay")
        answer = read_all(sock, 5)
    status, headers, _ = parse_response(answer)
    assert status == 502 and headers["x-egresswall-rule"] == "http:unrequested-upgrade"
    time.sleep(0.3)
    assert switch.echoed == echoed


def test_an_allowed_websocket_upgrade_works(lab, proxy, switch):
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(f"GET http://public.lab.example:{switch.port}/ws HTTP/1.1\r\nHost: public.lab.example:"
                     f"{switch.port}\r\nConnection: keep-alive, Upgrade\r\nUpgrade: websocket\r\n"
                     "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 101"), head
    forwarded = switch.heads[-1].lower()
    assert b"upgrade: websocket" in forwarded and b"connection: upgrade" in forwarded


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return isinstance(exc[1], OSError)


# ---- 10. silent sockets ----------------------------------------------------------------------------

def test_one_clients_silent_sockets_do_not_shut_others_out(lab, proxy):
    silent = []
    try:
        for _ in range(60):  # past this client's cap of 40
            sock = socket.socket()
            sock.bind(("127.0.9.9", 0))
            sock.connect((proxy.host, proxy.port))
            silent.append(sock)
        time.sleep(0.5)
        other = socket.socket()
        other.bind(("127.0.9.10", 0))
        other.connect((proxy.host, proxy.port))
        other.sendall(f"GET http://public.lab.example:{lab.public.port}/other HTTP/1.1\r\nHost: "
                      f"public.lab.example:{lab.public.port}\r\nConnection: close\r\n\r\n".encode())
        assert read_all(other).startswith(b"HTTP/1.1 200"), "another client was shut out"
        other.close()
        refused = records_for(proxy, lambda r: r["rule"] == "limits.max_connections_per_client"
                              and r["client"] == "127.0.9.9", at_least=20 - 1)
        assert len(refused) >= 20 - 1
        started = time.monotonic()
        for sock in silent[:40]:
            sock.settimeout(FIRST_BYTE_TIMEOUT + 5)
            assert sock.recv(1) == b"" or True
        assert time.monotonic() - started < FIRST_BYTE_TIMEOUT + 5
        assert records_for(proxy, lambda r: r["rule"] == "limits.first_byte_timeout" and r["client"] == "127.0.9.9")
    finally:
        for sock in silent:
            sock.close()


# ---- 11. the proxy port speaks HTTP/1.1 --------------------------------------------------------------

def test_tls_straight_to_the_proxy_port_is_refused(proxy):
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    context.set_alpn_protocols(["h2", "http/1.1"])
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock, \
            pytest.raises((ssl.SSLError, OSError)):
        context.wrap_socket(sock, server_hostname="proxy.example")
    assert records_for(proxy, lambda r: r["rule"] in ("http:tls-to-proxy",))


# ---- 4. ws:// from a browser: CONNECT to port 80 with the bundled policy ----------------------------

def test_the_bundled_policy_lets_ws_through_connect_80_and_check_agrees(lab, tmp_path):
    try:
        upstream = SwitchesProtocols(port=80)
    except OSError:
        pytest.skip("binding 127.0.0.2:80 needs root")
    flags = ["--nameserver", lab.dns.address, "--allow-range", f"{PUBLIC_IP}/32"]
    proxy = ProxyProcess(["--policy", str(ROOT / "policy" / "default.yaml"), *flags], tmp_path / "audit.jsonl")
    try:
        sock = tunnel(proxy, "public.lab.example:80")
        with sock:
            sock.sendall(b"GET /chat HTTP/1.1\r\nHost: public.lab.example\r\nConnection: Upgrade\r\nUpgrade: websocket"
                         b"\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
            head = b""
            while b"\r\n\r\n" not in head:
                head += sock.recv(4096)
            assert head.startswith(b"HTTP/1.1 101")
    finally:
        proxy.stop()
        upstream.close()
    check = subprocess.run([sys.executable, "-m", "proxy.cli", "check", "ws://public.lab.example/", *flags],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


# ---- found by the adversarial review: each a reproduced bypass or crash, now a regression case ---------

def test_a_request_line_that_does_not_start_with_three_letters_is_still_parsed(lab, proxy):
    """mitmproxy's own layer choice takes such a first line for raw TCP: egresswall chooses HTTP itself."""
    path = f"/pipelined-{proxy.port}"
    sock = tunnel(proxy, f"public.lab.example:{lab.public.port}")
    with sock:
        sock.sendall(f"GE /odd-{proxy.port} HTTP/1.1\r\nHost: public.lab.example:{lab.public.port}\r\n\r\n"
                     f"GET {path} HTTP/1.1\r\nHost: secret.lab.example\r\n\r\n".encode())
        read_all(sock, 5)
    assert records_for(proxy, lambda r: r["method"] == "GE" and r["event"] == "decision")  # parsed, decided
    assert not [p for _, p, _ in lab.public.requests if p == path]


def test_absolute_form_inside_a_tunnel_cannot_name_another_host(lab, proxy):
    before = len(lab.public.requests)  # the lab is the session's: other tests' requests are in it too
    sock = tunnel(proxy, f"public.lab.example:{lab.public.port}")
    with sock:
        sock.sendall(f"GET http://secret.lab.example/admin HTTP/1.1\r\nHost: public.lab.example:{lab.public.port}"
                     "\r\n\r\n".encode())
        status, headers, _ = parse_response(read_all(sock, 5))
    assert status == 403 and headers["x-egresswall-rule"] == "form:authority"
    assert not [p for _, p, _ in lab.public.requests[before:] if "admin" in p]


def test_a_kept_alive_tunnel_outlives_the_start_bound(lab, proxy):
    sock = tunnel(proxy, f"public.lab.example:{lab.public.port}")
    with sock:
        for i in range(2):
            sock.sendall(f"GET /kept-{i} HTTP/1.1\r\nHost: public.lab.example:{lab.public.port}\r\n\r\n".encode())
            got = b""
            while f"hello from public /kept-{i}".encode() not in got:
                chunk = sock.recv(65536)
                assert chunk, got
                got += chunk
            time.sleep(HEADER_TIMEOUT + 0.5)  # past the tunnel-start timer: it must not fire into mitmproxy
    assert "has crashed" not in proxy.stderr


def test_mitmproxys_own_400_is_recorded(lab, proxy):
    answer = proxy.raw(b"GET /no-host HTTP/1.0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.") and b" 400 " in answer.split(b"\r\n")[0]
    assert records_for(proxy, lambda r: r["rule"] == "http:invalid-request" and "host" in r["reason"].lower())


def test_tls_to_the_proxy_port_is_refused_whatever_the_hello_holds(proxy):
    hello = client_hello(b"x.example", extra=(extension(0x7A7A, b"\n\r\n\n\r\n"),))  # a head end, in TLS
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(hello)
        assert read_all(sock, 5) == b""
    assert records_for(proxy, lambda r: r["rule"] == "http:tls-to-proxy")


def test_an_upstream_101_crashes_nothing(lab, proxy, switch):
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(f"GET http://public.lab.example:{switch.port}/p HTTP/1.1\r\nHost: public.lab.example:"
                     f"{switch.port}\r\n\r\n".encode())
        assert read_all(sock, 3).startswith(b"HTTP/1.1 502")
    time.sleep(0.5)
    assert "has crashed" not in proxy.stderr


# ---- an intercepted host: its first byte alone, odd first lines, absolute form -------------------------

@pytest.fixture(scope="module", params=list(TRANSPORTS))
def intercepting(lab, tmp_path_factory, request):
    folder = tmp_path_factory.mktemp("intercept")
    policy = folder / "policy.yaml"
    policy.write_text(
        "version: 1\nmode: enforce\ndefault: deny\n"
        "hosts:\n  allow:\n    - host: public.lab.example\n      paths: [/ok/]\n      intercept: true\n"
        f"ports:\n  http: [80]\n  connect: [443, {lab.public_tls.port}]\n"
        f"addresses:\n  allow: [{PUBLIC_IP}/32]\n"
        f"resolver:\n  nameservers: ['{lab.dns.address}']\n  timeout: 1\n")
    mode = TRANSPORTS[request.param]
    process = ProxyProcess(["--policy", str(policy), "--confdir", str(folder / "ca"), "--upstream-ca",
                            str(lab.cert_file), *mode], folder / "audit.jsonl")
    yield process
    process.stop()


def _intercepted(proxy: ProxyProcess, lab, payload: bytes, split_first_byte: bool = False) -> bytes:
    """TLS to the proxy's interception certificate (not verified here), the first byte sent alone if
    asked, then ``payload``; returns what came back."""
    sock = tunnel(proxy, f"public.lab.example:{lab.public_tls.port}")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname="public.lab.example")
    first = True
    with sock:
        while True:
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                data = outgoing.read()
                if first and split_first_byte:
                    sock.sendall(data[:1])
                    time.sleep(0.5)
                    data = data[1:]
                first = False
                sock.sendall(data)
                chunk = sock.recv(65536)
                if not chunk:
                    return b""
                incoming.write(chunk)
        sock.sendall(outgoing.read())
        tls.write(payload.replace(b"PORT", str(lab.public_tls.port).encode()))
        sock.sendall(outgoing.read())
        answer = b""
        sock.settimeout(3)
        try:
            while chunk := sock.recv(65536):
                incoming.write(chunk)
                try:
                    while piece := tls.read(65536):
                        answer += piece
                except (ssl.SSLWantReadError, ssl.SSLZeroReturnError):
                    pass
        except (TimeoutError, ConnectionResetError):
            pass
    return answer


@pytest.mark.parametrize("split", [False, True], ids=["whole", "first-byte-alone"])
def test_an_intercepted_host_is_decided_request_by_request(lab, intercepting, split):
    ok = _intercepted(intercepting, lab, b"GET /ok/x HTTP/1.1\r\nHost: public.lab.example:PORT\r\n\r\n", split)
    assert ok.startswith(b"HTTP/1.1 200") and b"hello from public-tls /ok/x" in ok, ok[:200]
    admin = _intercepted(intercepting, lab, b"GET /admin HTTP/1.1\r\nHost: public.lab.example:PORT\r\n\r\n", split)
    assert admin.startswith(b"HTTP/1.1 403"), admin[:200]


def test_an_intercepted_tunnel_never_becomes_raw(lab, intercepting):
    before = len(lab.public_tls.requests)
    _intercepted(intercepting, lab, b"M-SEARCH /ok/ HTTP/1.1\r\nHost: public.lab.example:PORT\r\n\r\n"
                                    b"GET /admin HTTP/1.1\r\nHost: public.lab.example:PORT\r\n\r\n")
    assert records_for(intercepting, lambda r: r["method"] == "M-SEARCH" and r["event"] == "decision")
    assert not [p for _, p, _ in lab.public_tls.requests[before:] if p == "/admin"]
    other = _intercepted(intercepting, lab, b"GET https://other.lab.example/ok/ HTTP/1.1\r\n"
                                           b"Host: public.lab.example:PORT\r\n\r\n")
    assert other.startswith(b"HTTP/1.1 403") and b"form:authority" in other
