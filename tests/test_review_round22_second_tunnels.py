"""Review round 22, second pass (second_tunnels): the round's own tunnel fixes attacked — HeldReader's kinds of
hold (proxy/mitm_patches.py), the re-judgement of a ClientHello after a reload (proxy/gate.py Gate.tunnel_start)
and the closing line of a tunnel whose request inside failed (proxy/addons/tunnel_watch.py, admission.py)."""

from __future__ import annotations

import signal
import socket
import time

import pytest
from fake_upstream_proxy import ESTABLISHED, FakeUpstream, upstream_policy
from labnet import PUBLIC_IP
from proxyproc import both_transports
from rawclient import read_all, read_head, tunnel
from test_review_round22_tunnels import _wait
from tls_build import real_client_hello

pytestmark = pytest.mark.integration
NAME = "public.lab.example"
FAILED = "after a request inside the tunnel failed"


def _tunnel_lines(proxy, wait: float = 6) -> list[dict]:
    _wait(lambda: any(r.get("event") == "tunnel" for r in proxy.audit()), wait)
    time.sleep(0.3)
    return [r for r in proxy.audit() if r.get("event") == "tunnel"]


@both_transports
@pytest.mark.parametrize("kind", ["body-cut", "body-reset"])
def test_a_client_that_aborts_its_request_body_inside_a_tunnel_is_no_failure_on_the_way_out_holds(
        lab, start_proxy, kind):
    """A client inside a CONNECT to a plain-HTTP port sends a POST announcing 1000 bytes, sends 10 and goes away.
    Nothing failed on the way out: the client aborted. The tunnel's closing line must not say "the client
    connection closed after a request inside the tunnel failed" (the fix's own word, TunnelWatch.error: "A client
    that went away ... is not such a failure")."""
    proxy = start_proxy(lab.policy_text(connect_plain=True))
    authority = f"{NAME}:{lab.public.port}"
    sock = tunnel(proxy, authority)
    sock.sendall(f"POST /upload HTTP/1.1\r\nHost: {authority}\r\nContent-Length: 1000\r\n\r\n".encode() + bytes(10))
    time.sleep(0.5)
    if kind == "body-reset":
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()
    lines = _tunnel_lines(proxy)
    assert len(lines) == 1, lines
    assert FAILED not in (lines[0].get("error") or ""), lines[0]


@both_transports
@pytest.mark.parametrize("kind", ["bad-header", "denied-host", "ok-then-close"])
def test_a_refused_or_answered_request_inside_is_no_failure_on_the_way_out_holds(lab, start_proxy, kind):
    """A request inside refused by egresswall (a 400 for its head, a 403 for its host), or one answered 200, then
    the client closes: no failure on the way out, so no "failed" closing line."""
    proxy = start_proxy(lab.policy_text("hosts:\n  deny:\n    - denied.lab.example\n", connect_plain=True))
    authority = f"{NAME}:{lab.public.port}"
    sock = tunnel(proxy, authority)
    with sock:
        if kind == "bad-header":
            sock.sendall(f"GET / HTTP/1.1\r\nHost: {authority}\r\nX-A: a\x0bb\r\n\r\n".encode())
        elif kind == "denied-host":
            sock.sendall(f"GET / HTTP/1.1\r\nHost: denied.lab.example:{lab.public.port}\r\n\r\n".encode())
        else:
            sock.sendall(f"GET / HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        head = read_all(sock, 2) if kind == "bad-header" else read_head(sock)
        assert head[:12] in (b"HTTP/1.1 400", b"HTTP/1.1 403", b"HTTP/1.1 200", b""), head
    lines = _tunnel_lines(proxy)
    assert len(lines) == 1, lines
    assert FAILED not in (lines[0].get("error") or ""), lines[0]


@both_transports
def test_an_http_client_that_half_closes_in_upstream_mode_while_the_upstream_is_slow_gets_its_answer_holds(
        lab, start_proxy):
    """Upstream mode, a CONNECT to a plain-HTTP port: the client sends its request, shuts its sending side
    (SHUT_WR, `nc -N`) and waits. The upstream proxy takes 1 s to open mitmproxy's tunnel (the until_end hold of
    _tcp_start looks for the client's end meanwhile). README: "A client that shuts its sending side once its
    request is out (`nc -N`, some scripts) gets its answer ... on both transports"."""
    def answer(head: bytes, inside: bool):
        if head.startswith(b"CONNECT ") and not inside:
            time.sleep(1.0)
            return ESTABLISHED
        return None

    up = FakeUpstream(answer=answer, relay_to=(PUBLIC_IP, lab.public.port))
    try:
        proxy = start_proxy(upstream_policy(lab, up, "limits:\n  connect_timeout: 10\n  idle_timeout: 20\n"))
        authority = f"{NAME}:{lab.public.port}"
        sock = tunnel(proxy, authority)
        with sock:
            sock.sendall(f"GET /half HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
            sock.shutdown(socket.SHUT_WR)
            got = read_all(sock, 8)
        assert got.startswith(b"HTTP/1.1 200") and b"hello from public" in got, got[:300]
        lines = _tunnel_lines(proxy)
        assert len(lines) == 1, lines
    finally:
        up.close()


def _reload(proxy, text: str) -> None:
    proxy.policy_path.write_text(text)
    proxy.signal(signal.SIGHUP)


def _status(proxy, authority: str) -> int:
    sock, status, _ = proxy.connect(authority)
    sock.close()
    return status


@both_transports
@pytest.mark.parametrize("kind", ["address-deny", "port-gone", "role-deny"])
def test_a_reload_that_refuses_refuses_the_hello_holds(lab, start_proxy, kind):
    """See _refuse_after_reload: each kind of refusal a reload brings refuses the hello after it."""
    _refuse_after_reload(lab, start_proxy, kind)


def _refuse_after_reload(lab, start_proxy, kind):
    """Every kind of refusal a reload can bring (an addresses.deny range over the pinned address, the port no
    longer a CONNECT port) refuses a ClientHello sent after it (README:
    "A tunnel answered before the reload whose first message (its ClientHello) comes after it is judged again by
    the policy in force ... closed with a TLS alert and a refusal record"): one refusal, one closing line, no
    DNS query, nothing to the origin."""
    base = lab.policy_text()
    proxy = start_proxy(base)
    authority = f"{NAME}:{lab.public_tls.port}"
    sock = tunnel(proxy, authority)
    if kind == "address-deny":
        text = base.replace(f"  allow: [{PUBLIC_IP}/32]\n", f"  allow: [{PUBLIC_IP}/32]\n  deny: [{PUBLIC_IP}/32]\n")
    elif kind == "port-gone":
        text = base.replace(f", {lab.public_tls.port}]", "]").replace(f"[{lab.public_tls.port}, ", "[")
    else:
        text = base + (f"roles:\n  - name: locked\n    clients: [127.0.0.0/8]\n    default: allow\n"
                       f"    hosts: {{deny: [{NAME}]}}\n")
    before_dns = len(lab.dns.queries)
    _reload(proxy, text)
    assert _wait(lambda: _status(proxy, authority) != 200, 5), "the reload did not apply"
    after_probe = len(lab.dns.queries)
    with sock:
        sock.sendall(real_client_hello(NAME))
        answer = read_all(sock, 3)
    assert answer[:1] in (b"\x15", b""), answer[:20]
    del before_dns
    assert len(lab.dns.queries) == after_probe, lab.dns.queries[after_probe:]
    refused = [r for r in proxy.audit() if r.get("event") == "decision" and r.get("verdict") == "refuse"
               and "a policy reload refuses it" in (r.get("reason") or "")]
    assert len(refused) == 1, proxy.audit()
    lines = _tunnel_lines(proxy)
    assert len(lines) == 1, lines
    return refused[0]


@both_transports
def test_a_reload_role_refusal_of_a_hello_names_the_role_that_refused(lab, start_proxy):
    """FINDING: a reload puts the client in role `locked`, whose hosts.deny names the host; the hello after it is
    refused by that role's rule, but the refusal record's `role` is the role the CONNECT had (null): refuse_tunnel
    (proxy/gate.py) overwrites the new verdict's role with tunnel.verdict.role. The record names a rule of role
    `locked` for a client it says has no role; `role` must be the role whose rule refused (the verdict's)."""
    refused = _refuse_after_reload(lab, start_proxy, "role-deny")
    assert refused.get("role") == "locked", refused


@both_transports
def test_a_reload_to_report_mode_with_a_deny_lets_the_hello_pass_holds(lab, start_proxy):
    """Report mode relaxes host rules: a reload to report mode that denies the host lets a hello after it pass."""
    import ssl
    base = lab.policy_text()
    proxy = start_proxy(base)
    authority = f"{NAME}:{lab.public_tls.port}"
    sock = tunnel(proxy, authority)
    _reload(proxy, base.replace("mode: enforce", "mode: report") + f"hosts:\n  deny:\n    - {NAME}\n")
    time.sleep(2.5)
    context = ssl.create_default_context(cafile=str(lab.cert_file))
    with context.wrap_socket(sock, server_hostname=NAME) as tls:
        tls.sendall(f"GET / HTTP/1.1\r\nHost: {NAME}\r\nConnection: close\r\n\r\n".encode())
        answer = read_all(tls, 5)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
