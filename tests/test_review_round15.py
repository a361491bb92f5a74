"""Review round 15: hot reload and sessions, attacked while connections are open (both transports)."""

from __future__ import annotations

import signal
import socket
import time

import pytest
from dnslab import Behaviour, Record
from labnet import StandIn
from proxyproc import both_transports, parse_response
from session_client import token_file

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("internal_saw_nothing")]


def _wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("timed out")


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    status, headers, body = parse_response(data)
    while len(body) < int(headers.get("content-length", "0")):
        chunk = sock.recv(65536)
        assert chunk, data
        body += chunk
    return status, headers, body


def _tunnel_to_a_plain_http_port_without_a_session(lab, start_proxy, tmp_path):
    """(proxy, its policy text, the authority, the socket): a CONNECT to the lab's plain-HTTP port, answered 200,
    on a proxy with the session API whose policy requires no session yet."""
    text = lab.policy_text().replace("connect: [", f"connect: [{lab.public.port}, ")
    proxy = start_proxy(text, "--admin-token-file", str(token_file(tmp_path)))
    authority = f"public.lab.example:{lab.public.port}"
    sock, status, _ = proxy.connect(authority)
    assert status == 200
    return proxy, text, authority, sock


@both_transports
@pytest.mark.parametrize("required", ["policy", "role"])
def test_a_reload_that_requires_a_session_holds_inside_a_tunnel_opened_without_one(lab, start_proxy, tmp_path,
                                                                                   required):
    """A CONNECT to a plain-HTTP port carries requests egresswall decides one by one. Opened when no session
    was required, its next request after a reload that requires one (the whole policy, or the client's role)
    went to the origin as before: the tunnel had no session, so none was looked for."""
    proxy, text, authority, sock = _tunnel_to_a_plain_http_port_without_a_session(lab, start_proxy, tmp_path)
    with sock:
        sock.sendall(f"GET /before HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        assert _read_response(sock)[0] == 200
        narrowed = (text + "session: required\n" if required == "policy" else
                    text + "roles:\n  - name: agents\n    clients: [127.0.0.0/8]\n    session: required\n")
        proxy.policy_path.write_text(narrowed)
        proxy.signal(signal.SIGHUP)
        _wait_for(lambda: proxy.get(f"http://{authority}/probe")[0] == 407)  # a new connection is asked for one
        sock.sendall(f"GET /after-{required} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        status, headers, _ = _read_response(sock)
        assert status == 403, (status, headers)  # inside a tunnel there is no proxy to authenticate to
    assert f"/after-{required}" not in [path for _, path, _ in lab.public.requests]
    refusal = next(r for r in proxy.audit() if r.get("path") == f"/after-{required}")
    assert refusal["rule"] == "session:required" and "this tunnel was opened without one" in refusal["reason"], refusal


def _inside(sock: socket.socket, authority: str, path: str) -> int:
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    return _read_response(sock)[0]


@both_transports
@pytest.mark.parametrize("reload", [False, True])
def test_a_request_inside_a_tunnel_is_decided_on_the_address_the_tunnel_goes_to(lab, start_proxy, transport,
                                                                                reload):
    """A CONNECT to a plain-HTTP port has one upstream connection, to the address it was pinned to; each request
    inside was decided on a fresh lookup. A name that answered another address by then had the request decided
    (and recorded as pinned) there, and sent down the tunnel to the first: after a reload that no longer admits
    the first address, a request reached an address the policy in force refuses. Now a request inside a tunnel
    is judged on the CONNECT's answer by the policy in force."""
    name = f"tunnel-pin-{transport}-{reload}.lab.example".lower()
    other = "127.0.0.4"  # admitted; nothing listens there and nothing may connect there
    lab.dns.set(name, Behaviour(sequence=[[Record("A", "127.0.0.2", ttl=0)], [Record("A", other, ttl=0)]]))
    text = lab.policy_text().replace("connect: [", f"connect: [{lab.public.port}, ").replace(
        "allow: [127.0.0.2/32]", f"allow: [127.0.0.2/32, {other}/32]")
    proxy = start_proxy(text)
    authority, second = f"{name}:{lab.public.port}", f"/second-{name}"  # the lab's origin is every test's
    sock, status, _ = proxy.connect(authority)
    assert status == 200
    with sock:
        assert _inside(sock, authority, "/first") == 200
        if reload:  # the tunnel's address is no longer admitted; the name's new answer is
            proxy.policy_path.write_text(text.replace(f"allow: [127.0.0.2/32, {other}/32]", f"allow: [{other}/32]"))
            proxy.signal(signal.SIGHUP)
            _wait_for(lambda: proxy.get(f"http://public.lab.example:{lab.public.port}/probe")[0] == 403)
        status = _inside(sock, authority, second)
    records = [r for r in proxy.audit() if r["event"] == "decision" and r.get("path") == second]
    assert len(records) == 1, records
    reached = [path for _, path, _ in lab.public.requests]
    if reload:
        assert status == 403 and records[0]["verdict"] == "refuse" and second not in reached, records
        assert "127.0.0.2" in records[0]["reason"], records
    else:
        assert status == 200 and second in reached
        assert records[0]["pinned"] == "127.0.0.2", records  # where its bytes went
    assert not [r for r in proxy.audit() if r.get("pinned") == other]


@both_transports
def test_a_name_answering_the_mapped_form_of_egresswall_s_own_address_is_refused_as_itself(lab, start_proxy,
                                                                                          transport):
    """The check that a request does not reach egresswall itself compared address text: a name whose only answer
    is AAAA ::ffff:127.0.0.1 (the listeners' 127.0.0.1, as the kernel delivers it) got egresswall's own metrics
    page, and a CONNECT looped back into the proxy, once the policy admitted 127.0.0.1."""
    name = f"self-mapped-{transport}.lab.example".lower()
    lab.dns.set(name, [Record("AAAA", "::ffff:127.0.0.1")])
    proxy = start_proxy(lab.policy_text().replace("http: [", "http: ['1-65535', ").replace(
        "connect: [", "connect: ['1-65535', ").replace("allow: [127.0.0.2/32]", "allow: [127.0.0.0/8]"))
    assert proxy.host == "127.0.0.1"
    status, _, body = proxy.get(f"http://{name}:{proxy.admin_port}/metrics")
    sock, connect_status, _ = proxy.connect(f"{name}:{proxy.port}")
    sock.close()
    assert status == 403 and b"egresswall_" not in body, (status, body[:200])
    assert connect_status == 403
    refusals = [r for r in proxy.audit() if r["event"] == "decision" and r.get("host") == name]
    assert [r["rule"] for r in refusals] == ["self", "self"], refusals
    assert "egresswall's own listener" in refusals[0]["reason"], refusals


@both_transports
def test_a_tunnel_connects_where_its_connect_was_pinned_after_a_plain_request_on_its_connection(lab, start_proxy,
                                                                                                transport):
    """mitmproxy's path kept the pin of the last plain request of a client connection and preferred it for every
    connect of that connection to the same host and port: a CONNECT after it had its tunnel connected to the
    plain request's address, while its record named the address it was decided on (and the requests inside,
    judged on the CONNECT's answer, went elsewhere)."""
    name = f"pin-after-plain-{transport}.lab.example".lower()
    other = StandIn("127.0.0.4", lab.public.port)  # the CONNECT's answer; it only counts connections
    try:
        lab.dns.set(name, Behaviour(sequence=[[Record("A", "127.0.0.2", ttl=0)], [Record("A", other.host, ttl=0)]]))
        proxy = start_proxy(lab.policy_text().replace("connect: [", f"connect: [{lab.public.port}, ").replace(
            "allow: [127.0.0.2/32]", f"allow: [127.0.0.2/32, {other.host}/32]"))
        authority = f"{name}:{lab.public.port}"
        with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
            sock.sendall(f"GET http://{authority}/plain HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
            assert _read_response(sock)[0] == 200
            sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
            sock.settimeout(5)
            sock.recv(65536)  # 200 then the stand-in's close, or 502: where it connected is what is checked
        _wait_for(lambda: any(r["event"] == "tunnel" and r.get("host") == name for r in proxy.audit()))
    finally:
        other.close()
    tunnel = next(r for r in proxy.audit() if r["event"] == "decision" and r.get("method") == "CONNECT"
                  and r.get("host") == name)
    assert tunnel["pinned"] == other.host, tunnel
    assert other.connections, "the tunnel did not connect to the address its CONNECT was pinned to"


@both_transports
def test_a_name_answering_the_unspecified_address_is_refused_as_egresswall_itself(lab, start_proxy, transport):
    """A connect to 0.0.0.0 reaches this host: a listener bound to 127.0.0.1 takes it. With a policy that admits
    every address, a name answering 0.0.0.0 reached egresswall's own admin listener."""
    name = f"unspecified-{transport}.lab.example".lower()
    lab.dns.set(name, [Record("A", "0.0.0.0")])
    proxy = start_proxy(lab.policy_text().replace("http: [", "http: ['1-65535', ").replace(
        "allow: [127.0.0.2/32]", "allow: [0.0.0.0/0]"))
    status, _, body = proxy.get(f"http://{name}:{proxy.admin_port}/metrics")
    assert status == 403 and b"egresswall_" not in body, (status, body[:200])
    refusal = next(r for r in proxy.audit() if r["event"] == "decision" and r.get("host") == name)
    assert refusal["rule"] == "self" and "egresswall's own listener" in refusal["reason"], refusal


@both_transports
def test_tls_in_a_tunnel_opened_without_a_session_is_refused_once_a_reload_requires_one(lab, start_proxy, tmp_path):
    """A CONNECT to a plain-HTTP port may carry TLS, passed through unread. Opened before a reload that requires
    a session, its requests were refused but its ClientHello went through: now the first message is held to
    the policy in force as a request inside is."""
    from tls_build import real_client_hello

    proxy, text, authority, sock = _tunnel_to_a_plain_http_port_without_a_session(lab, start_proxy, tmp_path)
    with sock:
        proxy.policy_path.write_text(text + "session: required\n")
        proxy.signal(signal.SIGHUP)
        _wait_for(lambda: proxy.get(f"http://{authority}/probe")[0] == 407)
        before = lab.public.connections
        sock.sendall(real_client_hello("public.lab.example"))
        sock.settimeout(5)
        assert sock.recv(65536) == b""  # closed, nothing relayed
    refusal = next(r for r in proxy.audit() if r["event"] == "decision" and r.get("rule") == "session:required"
                   and r.get("method") == "CONNECT")
    assert "this tunnel was opened without one" in refusal["reason"], refusal
    assert lab.public.connections == before  # the tunnel's upstream was not connected anew (nor used)
