"""Review round 19: what README says about ``schemes`` and a browser's ws://, through the real proxy on both
transports, and ``check`` agreeing with it.

A browser sends ``ws://host/`` through a proxy as ``CONNECT host:80``; egresswall decides that CONNECT with
scheme https (it may carry TLS) and the upgrade inside with scheme ws. So a rule with ``schemes: [ws]``
admits a client that sends the upgrade as a plain-HTTP request and never a browser, and README's recipe
for a browser, ``schemes: [https, ws]`` with the port, admits the upgrade inside and nothing else there.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from dnslab import Record
from hostile import SwitchesProtocols
from labnet import PUBLIC_IP
from proxyproc import ROOT, TRANSPORTS, ProxyProcess, parse_response
from rawclient import read_head, tunnel

pytestmark = pytest.mark.integration

UPGRADE = ("GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
           "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")


@pytest.fixture(scope="module")
def switch():
    server = SwitchesProtocols()
    yield server
    server.close()


def _policy(lab, port: int) -> str:
    return (f"version: 1\nmode: enforce\ndefault: deny\n"
            f"hosts:\n  allow:\n"
            f"    - host: ws-only.lab.example\n      schemes: [ws]\n"
            f"    - host: ws-browser.lab.example\n      schemes: [https, ws]\n      ports: [{port}]\n"
            f"ports:\n  http: [{port}]\n  connect: [{port}]\n"
            f"addresses:\n  allow: [{PUBLIC_IP}/32]\n"
            f"resolver:\n  nameservers: ['{lab.dns.address}']\n  timeout: 1\n")


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def proxy(lab, switch, tmp_path_factory, request):
    for name in ("ws-only.lab.example", "ws-browser.lab.example"):
        lab.dns.set(name, [Record("A", PUBLIC_IP, ttl=60)])
    folder = tmp_path_factory.mktemp("round19")
    (folder / "policy.yaml").write_text(_policy(lab, switch.port))
    process = ProxyProcess(["--policy", str(folder / "policy.yaml"), *TRANSPORTS[request.param]],
                           folder / "audit.jsonl")
    process.policy_path = folder / "policy.yaml"
    yield process
    process.stop()
    assert not [e for e in process.outbound() if e["host"] != PUBLIC_IP], process.outbound()


def _requests(switch: SwitchesProtocols) -> int:
    """Request heads the origin read (a tunnel's upstream connection is opened at the CONNECT: an empty head
    is a connection that carried no request)."""
    return len([head for head in switch.heads if head])


def test_schemes_ws_admits_the_upgrade_sent_as_a_plain_http_request(proxy, switch):
    authority = f"ws-only.lab.example:{switch.port}"
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(UPGRADE.format(target=f"http://{authority}/chat", host=authority).encode())
        assert read_head(sock).startswith(b"HTTP/1.1 101")


def test_schemes_ws_alone_refuses_the_connect_a_browser_sends(proxy, switch):
    authority = f"ws-only.lab.example:{switch.port}"
    heads = _requests(switch)
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        status, headers, _ = parse_response(read_head(sock))
    assert status == 403 and "allows only ['ws']" in headers["x-egresswall-reason"], headers
    assert _requests(switch) == heads


def test_schemes_https_ws_admits_a_browser_s_ws_and_nothing_else_inside(proxy, switch):
    authority = f"ws-browser.lab.example:{switch.port}"
    heads = _requests(switch)
    with tunnel(proxy, authority) as sock:
        sock.sendall(UPGRADE.format(target="/chat", host=authority).encode())
        assert read_head(sock).startswith(b"HTTP/1.1 101")
    assert _requests(switch) == heads + 1
    with tunnel(proxy, authority) as sock:
        sock.sendall(f"GET /page HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        status, headers, _ = parse_response(read_head(sock))
    assert status == 403 and headers["x-egresswall-rule"].startswith("default deny"), headers
    assert _requests(switch) == heads + 1  # the plain GET never reached the origin


@pytest.mark.parametrize(("name", "code"), [("ws-only", 1), ("ws-browser", 0)])
def test_check_decides_a_ws_url_as_the_proxy_does(lab, proxy, switch, name, code):
    done = subprocess.run([sys.executable, "-m", "proxy.cli", "check", "--policy", str(proxy.policy_path),
                           f"ws://{name}.lab.example:{switch.port}/chat"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == code, done.stdout + done.stderr
