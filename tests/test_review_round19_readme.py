"""Review round 19: a newcomer's check of the round's README changes (a helper's), each sentence held against the
real proxy on loopback, on both transports.

- `schemes` on an intercepted host: a wss:// through a proxy is `CONNECT host:443`, decided with scheme https,
  as a ws:// is: `schemes: [wss]` alone refuses the CONNECT (README said it admitted it); `[https, wss]` admits
  the upgrade inside, and an HTTPS request inside too.
- Report mode lets through what host rules would refuse: http:override-header, which exists because a host rule
  has `paths`/`methods`, was enforced in report mode while the DELETE it stands for was let through.
- A request target outside ASCII: `egresswall check` decides a URL as a browser sends it (percent-encoded), as
  the proxy does; the same bytes sent raw are refused.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys

import pytest
from intercept_client import RecordingTlsOrigin, open_intercepted, read_until_quiet, statuses
from labnet import PUBLIC_IP, self_signed
from proxyproc import ROOT, TRANSPORTS, ProxyProcess, parse_response, read_response

pytestmark = pytest.mark.integration

UPGRADE = ("GET /chat HTTP/1.1\r\nHost: {host}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
           "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")


@pytest.fixture(scope="module")
def tls_origin(tmp_path_factory):
    context, cert = self_signed(["wss-only.lab.example", "wss-both.lab.example"],
                                str(tmp_path_factory.mktemp("r19c5cert")))
    origin = RecordingTlsOrigin(context)
    origin.cert = cert
    yield origin
    origin.close()


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def proxy(lab, tls_origin, tmp_path_factory, request):
    from dnslab import Record

    for name in ("wss-only.lab.example", "wss-both.lab.example"):
        lab.dns.set(name, [Record("A", PUBLIC_IP, ttl=60)])
    folder = tmp_path_factory.mktemp("r19c5")
    policy = folder / "policy.yaml"
    policy.write_text(
        "version: 1\nmode: enforce\ndefault: deny\n"
        "hosts:\n  allow:\n"
        "    - host: wss-only.lab.example\n      intercept: true\n      schemes: [wss]\n"
        "    - host: wss-both.lab.example\n      intercept: true\n      schemes: [https, wss]\n"
        f"ports:\n  http: [{lab.public.port}]\n  connect: [{tls_origin.port}]\n"
        f"addresses:\n  allow: [{PUBLIC_IP}/32]\n"
        f"resolver:\n  nameservers: ['{lab.dns.address}']\n  timeout: 1\n")
    process = ProxyProcess(["--policy", str(policy), "--confdir", str(folder / "ca"), "--upstream-ca",
                            str(tls_origin.cert), *TRANSPORTS[request.param]], folder / "audit.jsonl")
    process.policy_path = policy
    yield process
    process.stop()
    assert not [e for e in process.outbound() if e["host"] != PUBLIC_IP], process.outbound()


def test_schemes_wss_alone_on_an_intercepted_host_refuses_the_connect(proxy, tls_origin):
    """README said '`[wss]` on an intercepted host' admits a wss://: the CONNECT is decided with scheme https."""
    authority = f"wss-only.lab.example:{tls_origin.port}"
    sock, status, headers = proxy.connect(authority)
    sock.close()
    assert status == 403 and "allows only ['wss']" in headers.get("x-egresswall-reason", ""), (status, headers)


def test_schemes_https_wss_on_an_intercepted_host_admits_the_upgrade_only(proxy, tls_origin):
    """What does work (holds): [https, wss] with intercept admits the upgrade inside; unlike a browser's ws://
    recipe, it admits a plain HTTPS GET inside too (its scheme is https, which the CONNECT needed): on an
    intercepted host no `schemes` list admits wss:// alone."""
    tls, _ = open_intercepted(proxy, "wss-both.lab.example", tls_origin.port)
    with contextlib.closing(tls):
        tls.sendall(UPGRADE.format(host=f"wss-both.lab.example:{tls_origin.port}").encode())
        assert read_until_quiet(tls, 2).startswith(b"HTTP/1.1 101")
    tls, _ = open_intercepted(proxy, "wss-both.lab.example", tls_origin.port)
    with contextlib.closing(tls):
        tls.sendall(f"GET /page HTTP/1.1\r\nHost: wss-both.lab.example:{tls_origin.port}\r\n"
                    "Connection: close\r\n\r\n".encode())
        assert statuses(read_until_quiet(tls, 3))[:1] == [200]


def test_check_agrees_with_the_proxy_on_wss_on_an_intercepted_host(proxy, tls_origin):
    done = subprocess.run([sys.executable, "-m", "proxy.cli", "check", "--policy", str(proxy.policy_path),
                           f"wss://wss-only.lab.example:{tls_origin.port}/chat"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    sock, status, _ = proxy.connect(f"wss-only.lab.example:{tls_origin.port}")
    sock.close()
    assert (done.returncode == 0) == (status == 200), done.stdout


# ---- report mode and http:override-header ------------------------------------------------------------------

@pytest.fixture(scope="module", params=list(TRANSPORTS))
def report_proxy(lab, tmp_path_factory, request):
    folder = tmp_path_factory.mktemp("r19c5report")
    policy = folder / "policy.yaml"
    policy.write_text(lab.policy_text(default="deny", mode="report", extra=(
        "hosts:\n  allow:\n    - host: public.lab.example\n      methods: [GET]\n")))
    process = ProxyProcess(["--policy", str(policy), *TRANSPORTS[request.param]], folder / "audit.jsonl")
    process.policy_path = policy
    yield process
    process.stop()
    assert not [e for e in process.outbound() if e["host"] != PUBLIC_IP], process.outbound()


def test_report_mode_lets_through_a_delete_the_methods_rule_refuses(report_proxy, lab):
    """Holds: report mode lets a DELETE through (enforce would refuse it by the methods rule)."""
    status, headers, _ = report_proxy.get(f"http://public.lab.example:{lab.public.port}/x", method="DELETE")
    assert status != 403, headers


def test_report_mode_lets_through_a_get_carrying_a_method_override(report_proxy, lab):
    """README: report mode lets through what host rules would refuse. The GET carrying X-HTTP-Method-Override:
    DELETE was refused 403 http:override-header in report mode, while the DELETE itself went through; it is
    reported now."""
    status, headers, _ = report_proxy.get(f"http://public.lab.example:{lab.public.port}/x",
                                          headers={"X-HTTP-Method-Override": "DELETE"})
    assert status != 403, (headers.get("x-egresswall-rule"), headers.get("x-egresswall-reason"))


# ---- a request target outside ASCII: check and the proxy ------------------------------------------------------

def test_check_decides_a_non_ascii_path_as_a_browser_sends_it_and_the_proxy_refuses_it_raw(report_proxy, lab):
    url = f"http://public.lab.example:{lab.public.port}/caf\u00e9"
    authority = f"public.lab.example:{lab.public.port}"

    def sent(path: bytes) -> int:
        with socket.create_connection((report_proxy.host, report_proxy.port), timeout=10) as sock:
            sock.sendall(b"GET http://" + authority.encode() + path + b" HTTP/1.1\r\nHost: " + authority.encode()
                         + b"\r\nConnection: close\r\n\r\n")
            return parse_response(read_response(sock))[0]

    assert sent("/café".encode()) in (400, 403)  # raw UTF-8: not ASCII, refused
    assert sent(b"/caf%C3%A9") not in (400, 403)  # what a browser sends for it
    done = subprocess.run([sys.executable, "-m", "proxy.cli", "check", "--policy", str(report_proxy.policy_path),
                           url], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout  # decided as the browser's request
