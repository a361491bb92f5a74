"""Review round 23 (intercepted TLS): a CONNECT sent inside an intercepted tunnel (or inside a tunnel to a
plain-HTTP port, whose HTTP egresswall reads).

What holds: it is refused (400), one record, nothing reaches the origin, and the record names the tunnel's
session. What does not: the refusal's reason — in the audit record, in ``X-Egresswall-Reason`` and in the body
an agent reads — is mitmproxy's own advice to its operator, "mitmproxy received an HTTP CONNECT request even
though it is not running in regular/upstream mode. This usually indicates a misconfiguration, please see the
mitmproxy mode documentation for details." egresswall is not misconfigured, and has no "mode" an operator could
change: README, *Refusals an agent can read*: ``reason`` is "the sentence that explains it", and "Every answer
the proxy makes itself has this form, on both transports: the ones mitmproxy makes on egresswall's behalf too
... come as egresswall's refusal with their record's rule and reason"; the refusal the round-20 fix gives an
``HTTP/2.0`` line inside a tunnel says what egresswall reads there ("egresswall reads HTTP/1.0 and HTTP/1.1
requests here"). A CONNECT inside a tunnel deserves the same: its own rule (say ``http:connect-in-tunnel``) and
words ("a CONNECT inside a tunnel: the tunnel reaches only HOST:PORT; open another tunnel through the proxy").
"""

from __future__ import annotations

import contextlib
import time

import pytest
from labnet import PUBLIC_IP, self_signed
from proxyproc import TRANSPORTS, ProxyProcess
from rawclient import tunnel
from review_round23_intercept_origin import RecordingOrigin, open_tunnel, read_quiet, statuses
from session_client import create, token_file

pytestmark = pytest.mark.integration

HOST = "public.lab.example"


@pytest.fixture(scope="module")
def origin(tmp_path_factory):
    context, cert = self_signed([HOST], str(tmp_path_factory.mktemp("r23iccert")))
    server = RecordingOrigin(context)
    server.cert = cert
    yield server
    server.close()


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def proxy(lab, origin, tmp_path_factory, request):
    folder = tmp_path_factory.mktemp("r23ic")
    policy = folder / "policy.yaml"
    policy.write_text(
        "version: 1\nmode: enforce\ndefault: deny\nsession: optional\n"
        f"hosts:\n  allow:\n    - host: {HOST}\n      intercept: true\n"
        f"ports:\n  http: [{lab.public.port}]\n  connect: [{origin.port}, {lab.public.port}]\n"
        f"addresses:\n  allow: [{PUBLIC_IP}/32]\n"
        f"resolver:\n  nameservers: ['{lab.dns.address}']\n  timeout: 1\n"
        "limits:\n  idle_timeout: 4\n  header_timeout: 4\n")
    process = ProxyProcess(["--policy", str(policy), "--confdir", str(folder / "ca"), "--upstream-ca",
                            str(origin.cert), "--admin-token-file", str(token_file(folder)),
                            *TRANSPORTS[request.param]], folder / "audit.jsonl")
    yield process
    process.stop()
    assert "Traceback" not in process.stderr, process.stderr[-2000:]


def _refusals_since(proxy, before: int) -> list[dict]:
    time.sleep(0.3)
    return [r for r in proxy.audit()[before:] if r["verdict"] == "refuse"]


def _inner_connect(authority: str) -> bytes:
    return (f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\nAccept: application/json\r\n\r\n").encode()


def test_a_connect_inside_an_intercepted_tunnel_is_refused_once_and_never_reaches_the_origin_holds(proxy, origin):
    session = create(proxy.admin_port, {"hosts": [HOST]})
    seen, before = len(origin.seen()), len(proxy.audit())
    tls = open_tunnel(proxy, HOST, origin.port, session["proxy_authorization"])
    with contextlib.closing(tls):
        tls.sendall(_inner_connect("other.lab.example:443"))
        answer = read_quiet(tls, 1.5)
    assert origin.seen()[seen:] == b""
    assert statuses(answer) == [400], answer[:300]
    refused = _refusals_since(proxy, before)
    assert len(refused) == 1, refused
    assert refused[0]["session"] == session["id"], refused[0]


@pytest.mark.parametrize("where", ["intercepted", "plain-http-port"])
def test_a_connect_inside_a_tunnel_is_refused_in_egresswalls_words(proxy, origin, lab, where):
    """Fails today on both transports: the reason is mitmproxy's "This usually indicates a misconfiguration,
    please see the mitmproxy mode documentation", in the record, the X-Egresswall-Reason header and the JSON body."""
    before = len(proxy.audit())
    if where == "intercepted":
        sock = open_tunnel(proxy, HOST, origin.port)
    else:
        sock = tunnel(proxy, f"{HOST}:{lab.public.port}")
    with contextlib.closing(sock):
        sock.sendall(_inner_connect("other.lab.example:443"))
        answer = read_quiet(sock, 1.5)
    refused = _refusals_since(proxy, before)
    assert len(refused) == 1, refused
    reason = refused[0]["reason"]
    assert b"misconfiguration" not in answer, answer
    assert "misconfiguration" not in reason and "mitmproxy" not in reason, reason


JSON_CASES = {
    "inner-connect": b"CONNECT other.lab.example:443 HTTP/1.1\r\nHost: other.lab.example:443\r\n",
    "ftp-scheme": b"GET ftp://public.lab.example/x HTTP/1.1\r\nHost: public.lab.example:PORT\r\n",
    "cl-and-te": (b"POST /x HTTP/1.1\r\nHost: public.lab.example:PORT\r\nContent-Length: 3\r\n"
                  b"Transfer-Encoding: chunked\r\n"),
}


@pytest.mark.parametrize("name", list(JSON_CASES))
def test_a_refusal_inside_an_intercepted_tunnel_is_json_when_accept_prefers_it(proxy, origin, name):
    """README, *Refusals an agent can read*: "A client whose Accept header prefers JSON gets the refusal as one
    JSON object ... Every answer the proxy makes itself has this form, on both transports: the ones mitmproxy makes
    on egresswall's behalf too". A request mitmproxy's HTTP layer refuses in ``validate_request`` (a CONNECT inside
    the tunnel, a scheme other than http/https) is answered in text whatever its Accept says (``cl-and-te``, refused
    by the same ``_form_problem`` branch but answered through ``_core_answers``, is the control that holds)."""
    seen, before = len(origin.seen()), len(proxy.audit())
    tls = open_tunnel(proxy, HOST, origin.port)
    with contextlib.closing(tls):
        tls.sendall(JSON_CASES[name].replace(b"PORT", str(origin.port).encode())
                    + b"Accept: application/json\r\n\r\n")
        answer = read_quiet(tls, 1.5)
    assert origin.seen()[seen:] == b""
    assert len(_refusals_since(proxy, before)) == 1
    head = answer.split(b"\r\n\r\n", 1)[0].lower()
    assert statuses(answer)[:1] == [400], answer[:300]
    assert b"content-type: application/json" in head, answer[:400]


def test_plain_http_cl_and_te_refusal_is_json_when_accept_prefers_it(proxy, lab):
    """Fails today on both transports (the fast path hands CL+TE to mitmproxy): outside a tunnel too, a request
    mitmproxy's ``validate_request`` refuses is answered in text whatever its Accept says, and its reason tells the
    client to "Disable the validate_inbound_headers option to skip this security check" — an option egresswall's
    operator cannot set, and a smuggling check that must never be turned off. README, *Refusals an agent can
    read*: JSON where Accept prefers it; the hint for a malformed request is "no policy change admits it"."""
    import socket
    before = len(proxy.audit())
    authority = f"{HOST}:{lab.public.port}"
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(f"POST http://{authority}/x HTTP/1.1\r\nHost: {authority}\r\nContent-Length: 3\r\n"
                     "Transfer-Encoding: chunked\r\nAccept: application/json\r\n\r\n".encode())
        answer = read_quiet(sock, 1.5)
    assert len(_refusals_since(proxy, before)) == 1
    head = answer.split(b"\r\n\r\n", 1)[0].lower()
    assert b"content-type: application/json" in head, answer[:600]
    assert b"validate_inbound_headers" not in answer, answer[:600]
