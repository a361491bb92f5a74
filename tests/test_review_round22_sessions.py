"""Review round 22 (sessions): what a session's records and refusals say, on both transports.

1. A ``session:not-granted`` refusal's reason lists the session's grants (``policy/sessions.py``
   ``_grants_text``) with each URL grant's whole text, query included, into the audit record's ``reason``
   (and the refusal's ``X-Egresswall-Reason`` and body), while ``log.query_strings`` is false. README, *Audit
   log*: "``path`` (no query string unless ``log.query_strings``), ``url`` (... unless ``log.query_strings``,
   the query ``?[query]``; a refusal's ``reason`` quotes a URL the same way)". A granted link's query is what
   a user pasted (a share link's token, a search): every refused request of the session writes it again.
2. A request that presents a valid session but is refused by a form check before the session is looked at
   (a Host header that disagrees with the URL, a body on a GET, ...) is recorded with ``session: null``
   (``Gate.decide_request`` runs those checks before ``_session_first``). README, *Sessions*: "The audit
   record's ``session`` holds the id on every line of the session's requests (decision, response, tunnel)".
   A platform reading its session's lines misses exactly the requests that tried something odd.

Both fixed: ``_grants_text`` writes a URL grant's query as ``?[query]``; ``Gate.session_named`` names the session
the credentials prove (``SessionService.verified_id``: no refusal, no count) on a refusal made before the session
is judged, in the gate and in mitmproxy's decision addon, for CONNECTs too.
"""

from __future__ import annotations

import socket
import time

import pytest
from proxyproc import both_transports, parse_response, read_response
from session_client import create, token_file

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("internal_saw_nothing")]


def _raw(proxy, data: bytes) -> tuple[int, dict[str, str], bytes]:
    with socket.create_connection((proxy.host, proxy.port), timeout=5) as sock:
        sock.sendall(data)
        return parse_response(read_response(sock))


def _lines_after(proxy, before: int, count: int, timeout: float = 5) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        lines = proxy.audit()[before:]
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


@both_transports
def test_a_not_granted_refusal_never_writes_a_grants_query(lab, start_proxy, tmp_path):
    """The grant's query (``token=SEKRET-…``) must not reach the audit log's ``reason`` (README: "a refusal's
    ``reason`` quotes a URL the same way", i.e. ``?[query]`` unless ``log.query_strings``), nor be repeated to a
    client in the refusal. The refused request's own query is already cut; the grants' are not."""
    proxy = start_proxy(lab.policy_text("session: required\n"), "--admin-token-file", str(token_file(tmp_path)))
    port = lab.public.port
    secret_query = "token=SEKRET-share-link-0123"
    session = create(proxy.admin_port, {"urls": [f"http://public.lab.example:{port}/share?{secret_query}"]})
    auth = session["proxy_authorization"]
    before = len(proxy.audit())
    status, headers, body = _raw(proxy, (
        f"GET http://public.lab.example:{port}/other HTTP/1.1\r\nHost: public.lab.example:{port}\r\n"
        f"Proxy-Authorization: {auth}\r\nConnection: close\r\n\r\n").encode())
    assert (status, headers.get("x-egresswall-rule")) == (403, "session:not-granted")
    lines = [r for r in _lines_after(proxy, before, 1) if r.get("rule") == "session:not-granted"]
    assert lines, proxy.audit()[before:]
    assert not [r["reason"] for r in lines if "SEKRET" in r["reason"]], lines[0]["reason"]
    assert "SEKRET" not in headers.get("x-egresswall-reason", "") and b"SEKRET" not in body, headers


@both_transports
@pytest.mark.parametrize("odd", ["host-header", "body-on-get", "two-hosts", "other-upgrade", "bad-websocket",
                                 "over-limit"])
def test_a_session_request_refused_for_its_form_is_recorded_under_its_session(lab, start_proxy, tmp_path, odd):
    """The request carries the session's valid credentials; its refusal line must carry the session's id (README:
    "holds the id on every line of the session's requests"). It is written ``session: null`` on both transports:
    ``Gate.decide_request`` refuses form problems before ``_session_first`` identifies the session."""
    proxy = start_proxy(lab.policy_text("session: required\n"), "--admin-token-file", str(token_file(tmp_path)))
    port = lab.public.port
    session = create(proxy.admin_port, {"hosts": ["public.lab.example"]})
    auth = session["proxy_authorization"]
    host = f"Host: public.lab.example:{port}\r\n"
    extra = {"host-header": "Host: conversation-part-1.other.lab.example\r\n",
             "body-on-get": f"{host}Content-Length: 5\r\n",
             "two-hosts": f"{host}{host}",
             "other-upgrade": f"{host}Connection: Upgrade\r\nUpgrade: h2c\r\n",
             "bad-websocket": f"{host}Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 8\r\n"
                              "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n",
             "over-limit": f"{host}Content-Length: 99999999999\r\n"}[odd]
    before = len(proxy.audit())
    status, headers, _ = _raw(proxy, (
        f"GET http://public.lab.example:{port}/x HTTP/1.1\r\n{extra}Proxy-Authorization: {auth}\r\n"
        "Connection: close\r\n\r\nhello").encode())
    assert status in (400, 403, 413), (status, headers)
    lines = _lines_after(proxy, before, 1)
    assert lines and all(r["verdict"] == "refuse" for r in lines), lines
    assert [r["session"] for r in lines] == [session["id"]] * len(lines), [(r["rule"], r["session"]) for r in lines]


@both_transports
@pytest.mark.parametrize("proof", ["valid", "wrong-secret"])
def test_a_connect_refused_for_its_form_names_the_session_its_credentials_prove(lab, start_proxy, tmp_path, proof):
    """A CONNECT declaring content (refused 400 ``form:connect-content``) with the session's credentials: its line
    names the session; with a wrong secret it names none (an id the secret does not prove never goes into a
    record), and the answer is the form's 400 either way."""
    proxy = start_proxy(lab.policy_text("session: required\n"), "--admin-token-file", str(token_file(tmp_path)))
    session = create(proxy.admin_port, {"hosts": ["public.lab.example"]})
    auth = session["proxy_authorization"]
    if proof == "wrong-secret":
        import base64
        user = base64.b64decode(auth.split()[1]).decode().split(":")[0]
        auth = "Basic " + base64.b64encode(f"{user}:not-the-secret".encode()).decode()
    authority = f"public.lab.example:{lab.public_tls.port}"
    before = len(proxy.audit())
    status, headers, _ = _raw(proxy, (f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n"
                                      f"Proxy-Authorization: {auth}\r\nContent-Length: 3\r\n\r\nabc").encode())
    assert status == 400, (status, headers)
    lines = _lines_after(proxy, before, 1)
    assert [(r["verdict"], r["session"]) for r in lines] == [
        ("refuse", session["id"] if proof == "valid" else None)], lines
