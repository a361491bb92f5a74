"""Review round 19 (a helper's adversarial review): request targets inside a tunnel skipped the URL checks a
plain-HTTP request gets; now ``Gate._request_target`` reads them with the core as it reads a plain request's.

A plain-HTTP request's target is read by ``policy.hosts.parse_url`` (via ``gate.plain_target``), which refuses a
fragment (``#``: "a client never sends" one), C0/C1 control characters, Unicode whitespace and the asterisk form.
Inside a tunnel (an intercepted host, or a CONNECT to a plain-HTTP port) ``Gate._request_target`` took the path
as mitmproxy split it and built the Target from the tunnel's, so none of those checks ran: the path went to
the path rules and on to the origin as it came. Origins read such a path as another one — Python's
``SimpleHTTPRequestHandler`` cuts it at ``#`` and splits the request line at ``\\x1f`` or ``\\xa0`` (str.split),
nginx ends the path at ``#`` — so a glob ``paths:`` rule is read on one path and the origin serves another:
an allow rule ``/*.json`` admits ``/private#.json`` (the origin serves ``/private``), a deny rule
``/*/secret`` misses ``/x/secret#z``, ``/x/secret\\x1f``, ``/x/secret\\xa0`` (the origin serves ``/x/secret``).

Both transports (intercepted tunnels are mitmproxy's on both). The plain-HTTP ones show the check exists there;
every tunnel case failed before the fix.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import socket
import ssl
import threading
import time
from pathlib import Path

import pytest
from intercept_client import open_intercepted, read_until_quiet, statuses
from labnet import PUBLIC_IP, self_signed
from proxyproc import TRANSPORTS, ProxyProcess
from rawclient import tunnel

pytestmark = pytest.mark.integration

HOST = "public.lab.example"


class _Files(http.server.SimpleHTTPRequestHandler):
    """A real file-serving origin (Python's own), recording each request line it read."""

    def log_message(self, *args: object) -> None:
        pass

    def parse_request(self) -> bool:
        ok = super().parse_request()
        self.server.lines.append(self.raw_requestline)
        return ok


class FileOrigin:
    """Python's SimpleHTTPRequestHandler over TLS on the lab's public address, serving ``private`` and
    ``v1/public/x/secret`` (what the policy refuses) and ``v1/public/ok.json`` (what it allows)."""

    def __init__(self, folder: Path, context: ssl.SSLContext) -> None:
        (folder / "v1/public/x").mkdir(parents=True)
        (folder / "private").write_text("PRIVATE-FILE")
        (folder / "v1/public/x/secret").write_text("SECRET-FILE")
        (folder / "v1/public/ok.json").write_text("OK-JSON")
        self.server = http.server.ThreadingHTTPServer((PUBLIC_IP, 0),
                                                      functools.partial(_Files, directory=str(folder)))
        self.server.daemon_threads = True
        self.server.lines = []
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    context, cert = self_signed([HOST, "other.lab.example"], str(tmp_path_factory.mktemp("r19h1cert")))
    origin = FileOrigin(tmp_path_factory.mktemp("r19h1files"), context)
    origin.cert = cert
    yield origin
    origin.close()


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def proxy(lab, files, tmp_path_factory, request):
    folder = tmp_path_factory.mktemp("r19h1paths")
    policy = folder / "policy.yaml"
    policy.write_text(
        "version: 1\nmode: enforce\ndefault: deny\n"
        f"hosts:\n  deny:\n    - host: {HOST}\n      paths: ['/*/secret']\n"
        f"  allow:\n    - host: {HOST}\n      intercept: true\n      methods: [GET]\n"
        "      paths: ['/v1/public/', '/*.json']\n"
        "    - host: other.lab.example\n      intercept: true\n"
        f"ports:\n  http: [{lab.public.port}]\n  connect: [{files.port}, {lab.public.port}]\n"
        f"addresses:\n  allow: [{PUBLIC_IP}/32]\n"
        f"resolver:\n  nameservers: ['{lab.dns.address}']\n  timeout: 1\n"
        "limits:\n  idle_timeout: 4\n  header_timeout: 4\n")
    process = ProxyProcess(["--policy", str(policy), "--confdir", str(folder / "ca"), "--upstream-ca",
                            str(files.cert), *TRANSPORTS[request.param]], folder / "audit.jsonl")
    process.transport = request.param
    yield process
    process.stop()
    assert "Traceback" not in process.stderr, process.stderr[-2000:]
    assert not [e for e in process.outbound() if e["host"] != PUBLIC_IP], process.outbound()


def _inside(proxy, files, target: bytes) -> bytes:
    """One GET for ``target`` inside an intercepted tunnel to HOST; what came back."""
    tls, _ = open_intercepted(proxy, HOST, files.port)
    with contextlib.closing(tls):
        tls.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: " + f"{HOST}:{files.port}".encode()
                    + b"\r\nConnection: close\r\n\r\n")
        return read_until_quiet(tls, 3)


# ---- what holds: the rules as written, on paths every reader reads alike ----------------------------------------

@pytest.mark.parametrize(("target", "status", "body"), [
    (b"/v1/public/ok.json", 200, b"OK-JSON"),
    (b"/private", 403, b""),
    (b"/v1/public/x/secret", 403, b""),
])
def test_the_rules_hold_for_plain_paths(proxy, files, target, status, body):
    answer = _inside(proxy, files, target)
    assert statuses(answer) == [status], answer[:300]
    assert body in answer


# ---- the bypass: the origin serves a file a rule refuses ----------------------------------------------------------

@pytest.mark.parametrize(("target", "refused_file"), [
    (b"/private#.json", b"PRIVATE-FILE"),            # allow '/*.json' read on the whole target; origin cuts at '#'
    (b"/v1/public/x/secret#z", b"SECRET-FILE"),      # deny '/*/secret' misses; origin cuts at '#'
    (b"/v1/public/x/secret\x1f", b"SECRET-FILE"),    # deny misses; origin's request line split() drops \x1f
    (b"/v1/public/x/secret\xa0", b"SECRET-FILE"),    # deny misses; origin's split() (latin-1 text) drops NBSP
], ids=["hash-allow-glob", "hash-deny-glob", "x1f-deny-glob", "nbsp-deny-glob"])
def test_an_intercepted_request_never_gets_a_file_its_path_rules_refuse(proxy, files, target, refused_file):
    """Failed on both transports before the fix (the origin answered 200 with the refused file)."""
    before = len(files.server.lines)
    answer = _inside(proxy, files, target)
    time.sleep(0.2)
    assert refused_file not in answer, (statuses(answer), answer[-80:], files.server.lines[before:])


# ---- parity: the target checks plain HTTP makes, made inside the tunnel too -------------------------------------

MALFORMED = {
    "fragment": b"/v1/public/a#b",
    "c0-control": b"/v1/public/a\x01b",
    "nul": b"/v1/public/a\x00.json",
    "del": b"/v1/public/a\x7f",
    "nbsp": b"/v1/public/a\xa0b",
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_plain_http_refuses_the_target(proxy, lab, name):
    """The check exists on the plain-HTTP path (passes today)."""
    before = len(lab.public.requests)
    authority = f"{HOST}:{lab.public.port}"
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(b"GET http://" + authority.encode() + MALFORMED[name] + b" HTTP/1.1\r\nHost: "
                     + authority.encode() + b"\r\nConnection: close\r\n\r\n")
        answer = read_until_quiet(sock, 3)
    time.sleep(0.2)
    assert statuses(answer) and 400 <= statuses(answer)[0] < 500, answer[:300]
    assert len(lab.public.requests) == before


@pytest.mark.parametrize("name", list(MALFORMED))
def test_an_intercepted_tunnel_refuses_the_target_as_plain_http_does(proxy, files, name):
    """Failed on both transports before the fix (forwarded; the origin answered)."""
    before = len(files.server.lines)
    answer = _inside(proxy, files, MALFORMED[name])
    time.sleep(0.2)
    assert statuses(answer) and 400 <= statuses(answer)[0] < 500, answer[:300]
    assert files.server.lines[before:] == []


@pytest.mark.parametrize("name", ["fragment", "c0-control"])
def test_a_tunnel_to_a_plain_http_port_refuses_the_target_as_plain_http_does(proxy, lab, name):
    """HTTP inside a CONNECT to a port in both ports.connect and ports.http: the same code. A control byte in the
    request line, which h11 refuses, goes to mitmproxy's HTTP layer like the tunnel's later heads (it was closed
    unanswered as http:not-http before: tests/test_tunnel_first_head.py) and is refused as outside a tunnel;
    either way nothing reaches the origin."""
    before = len(lab.public.requests)
    authority = f"{HOST}:{lab.public.port}"
    with tunnel(proxy, authority) as sock:
        sock.sendall(b"GET " + MALFORMED[name] + b" HTTP/1.1\r\nHost: " + authority.encode()
                     + b"\r\nConnection: close\r\n\r\n")
        answer = read_until_quiet(sock, 3)
    time.sleep(0.2)
    assert len(lab.public.requests) == before, lab.public.requests[before:]
    assert statuses(answer) and 400 <= statuses(answer)[0] < 500, answer[:300]
    if name == "c0-control":
        assert b"X-Egresswall-Rule: form:control" in answer, answer[:400]


def test_an_intercepted_tunnel_refuses_the_asterisk_form_as_plain_http_does(proxy, files):
    """``OPTIONS *`` (which asks the server it is sent to about itself, no URL): plain HTTP refuses it
    (form:asterisk, ``gate.plain_target``); inside an intercepted tunnel to a host allowed without path rules it
    went to the origin, and a deny rule with ``paths`` never matches it (its path does not begin with '/').
    Failed on both transports before the fix."""
    before = len(files.server.lines)
    tls, _ = open_intercepted(proxy, "other.lab.example", files.port)
    with contextlib.closing(tls):
        tls.sendall(f"OPTIONS * HTTP/1.1\r\nHost: other.lab.example:{files.port}\r\nConnection: close\r\n\r\n"
                    .encode())
        answer = read_until_quiet(tls, 3)
    time.sleep(0.2)
    assert files.server.lines[before:] == [], answer[:200]
