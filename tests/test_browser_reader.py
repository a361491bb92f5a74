"""The page reader: the real Chromium behind the real proxy on loopback.

One in-process proxy (``EmbeddedProxy``, as ``egresswall browse --policy`` runs it) and one browser
for the module; two tests run the command line itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from unprivileged import NO_SANDBOX_ARGS, SANDBOX

from browser.launch import launch, plan_launch
from browser.reader import PageReader, ReadLimits, cut_at_paragraph
from policy.loader import Overrides
from proxy.cli.embedded import EmbeddedProxy

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parent.parent

ARTICLE = """<html><head><title>Lab article</title></head><body>
<nav><a href="/">home</a> <a href="/about">about</a></nav>
<article><h1>Lab article</h1>
<p>The first paragraph of the lab article says something worth reading.</p>
<p>The second paragraph continues the thought with a <a href="/more">link</a>.</p>
<p>The third paragraph ends it.</p>
</article><footer>footer text</footer></body></html>"""
LONG = "<html><head><title>Long</title></head><body><article>" + "".join(
    f"<p>Paragraph {i} of the long page, which keeps going for a while to fill the limit.</p>" for i in range(40)
) + "</article></body></html>"
# other.lab.example is intercepted (TLS decrypted) so its paths can be checked: /page/ allowed, /secret refused.
POLICY = """hosts:
  deny:
    - host: other.lab.example
      paths: ["/secret"]
      reason: the lab's secret area
  allow:
    - host: other.lab.example
      intercept: true
      paths: ["/page/"]
"""


@pytest.fixture(scope="module")
def site(lab):
    lab.public.serve("/page/article", ARTICLE)
    lab.public.serve("/page/long", LONG)
    lab.public.serve("/page/empty", "<html><head><title>Nothing</title></head><body></body></html>")
    lab.public_tls.serve("/page/tls", "<html><head><title>Intercepted</title></head><body>"
                                      "<p>Read through egresswall's TLS interception.</p></body></html>")
    lab.public_tls.serve("/secret/plans", "<html><body><p>the secret plans</p></body></html>")
    return lab


@pytest.fixture(scope="module")
def embedded(site, tmp_path_factory):
    policy = tmp_path_factory.mktemp("reader") / "policy.yaml"
    policy.write_text(site.policy_text(POLICY))
    proxy = EmbeddedProxy(str(policy), Overrides(), upstream_ca=str(site.cert_file)).start()
    records: list[dict] = []
    proxy.runner.audit.listeners.append(records.append)
    yield proxy
    proxy.stop()
    # The in-process proxy has no outbound guard: check every connect it made went to loopback.
    connects = {r["pinned"] for r in records if r.get("pinned")}
    assert all(c.startswith("127.") for c in connects), connects


@pytest.fixture(scope="module")
def playwright():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as instance:  # one per thread at a time: the module's tests share it
        yield instance


@pytest.fixture(scope="module")
def browser(embedded, playwright):
    assert embedded.intercepts_anything()
    plan = plan_launch(embedded.address, ca_files=[embedded.ca_file], sandbox=SANDBOX)
    chromium = launch(playwright, plan)
    yield chromium
    chromium.close()
    plan.cleanup()


@pytest.fixture
def reader(browser, embedded):
    return PageReader(browser, embedded.refusals, ReadLimits(timeout=8))


def url(lab, path: str, tls: bool = False, host: str = "public.lab.example") -> str:
    return f"https://{host}:{lab.public_tls.port}{path}" if tls else f"http://{host}:{lab.public.port}{path}"


def test_allowed_page_is_read_as_markdown(reader, site):
    result = reader.read(url(site, "/page/article"))
    assert result.read and result.status == 200 and result.title == "Lab article"
    assert "The first paragraph of the lab article" in result.content
    assert "The third paragraph ends it." in result.content
    assert "[link](http://public.lab.example:" in result.content  # markdown, links made absolute
    assert "footer text" not in result.content  # the main content, not the chrome around it
    assert not result.truncated


def test_refused_url_reports_the_proxys_rule_and_reason(reader, site):
    before = list(site.internal.connections)
    result = reader.read(url(site, "/", host="internal.lab.example"))
    assert not result.read and result.problem == "refused"
    assert result.rule == "special-purpose 127.0.0.0/8"
    # What the proxy tells a client, which this report goes to: the rule, not the address the name resolved to
    # (policy.wire.client_reason; the audit record has it).
    assert "resolves to an address egresswall does not connect to (special-purpose 127.0.0.0/8)" in result.reason
    assert "127.0.0.3" not in result.reason
    assert site.internal.connections == before


def test_refused_connect_reports_the_reason_chromium_cannot_see(reader, site):
    """For https Chromium shows only ERR_TUNNEL_CONNECTION_FAILED; the reason comes from the proxy's
    audit record of that CONNECT."""
    result = reader.read(url(site, "/", tls=True, host="internal.lab.example"))
    assert result.problem == "refused" and result.rule == "special-purpose 127.0.0.0/8"
    assert "does not connect to (special-purpose 127.0.0.0/8)" in result.reason and "127.0.0.3" not in result.reason
    result = reader.read(f"https://localhost:{site.public_tls.port}/")
    assert result.problem == "refused" and result.rule == "form:localhost"


@pytest.mark.parametrize("tls", [False, True], ids=["to-http", "to-https"])
def test_redirect_to_a_refused_host_reports_the_refusal(reader, site, tls):
    """An allowed page redirects to an internal host: over http the proxy's 403 comes back, over https
    the CONNECT is refused (and its reason comes from the audit record)."""
    target = url(site, "/secret-db", tls=tls, host="internal.lab.example")
    result = reader.read(url(site, f"/redirect?to={target}"))
    assert not result.read and result.problem == "refused"
    assert result.rule == "special-purpose 127.0.0.0/8"
    assert f"after a redirect to {target}" in result.reason
    assert result.redirected_from and "/redirect?to=" in result.redirected_from[0]


def test_non_html_is_reported_as_such(reader, site):
    result = reader.read(url(site, "/pdf"))
    assert not result.read and result.problem == "non-html" and "application/pdf" in result.reason
    result = reader.read(url(site, "/hello"))  # text/plain
    assert result.problem == "non-html" and "text/plain" in result.reason


def test_timeout_is_reported_as_such(browser, embedded, site):
    result = PageReader(browser, embedded.refusals, ReadLimits(timeout=1.5)).read(url(site, "/slow/4"))
    assert not result.read and result.problem == "timeout" and "1.5 seconds" in result.reason


def test_http_error_status_and_empty_page(reader, site):
    result = reader.read(url(site, "/status/404"))
    assert result.problem == "http-status" and result.status == 404 and "404" in result.reason
    result = reader.read(url(site, "/page/empty"))
    assert result.problem == "empty" and result.title == "Nothing"


def test_content_is_cut_at_a_paragraph_break_with_a_note(browser, embedded, site, tmp_path):
    shot = tmp_path / "long.png"
    result = PageReader(browser, embedded.refusals, ReadLimits(max_chars=500, timeout=8)).read(
        url(site, "/page/long"), screenshot=str(shot))
    assert result.read and result.truncated and len(result.content) <= 500 and result.chars > 500
    assert result.content.endswith("fill the limit.")  # a whole paragraph, cut at the break after it
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_links_per_call_limit(browser, embedded, site):
    reader = PageReader(browser, embedded.refusals, ReadLimits(max_links=1, timeout=8))
    results = reader.read_all([url(site, "/page/article"), url(site, "/page/article?again")])
    assert results[0].read and not results[1].read and results[1].problem == "limit"


def test_intercepted_host_path_rule_allows_one_path_and_refuses_another(reader, site, embedded):
    """TLS to other.lab.example is intercepted; Chromium trusts the proxy's CA through the SPKI flag
    (no certificate error) and the path rules decide each request inside the tunnel."""
    allowed = reader.read(url(site, "/page/tls", tls=True, host="other.lab.example"))
    assert allowed.read and allowed.status == 200 and allowed.title == "Intercepted"
    assert "TLS interception" in allowed.content
    refused = reader.read(url(site, "/secret/plans", tls=True, host="other.lab.example"))
    assert refused.problem == "refused" and refused.status == 403
    deny_line = Path(embedded.policy.source).read_text().splitlines().index("  deny:") + 2
    assert "the lab's secret area" in refused.reason and refused.rule.endswith(f"policy.yaml:{deny_line}")
    assert not any(path.startswith("/secret") for _, path, _ in site.public_tls.requests)


def test_without_the_spki_flag_the_intercepted_host_fails_on_its_certificate(embedded, site, playwright):
    """The negative control: the same page in a browser that was not told the proxy CA's key."""
    plan = plan_launch(embedded.address, sandbox=SANDBOX)
    try:
        chromium = launch(playwright, plan)
        try:
            result = PageReader(chromium, embedded.refusals, ReadLimits(timeout=8)).read(
                url(site, "/page/tls", tls=True, host="other.lab.example"))
        finally:
            chromium.close()
    finally:
        plan.cleanup()
    assert result.problem == "error" and "ERR_CERT_AUTHORITY_INVALID" in result.reason


def test_cut_at_paragraph_unit():
    text = "one two three\n\nfour five six\n\nseven"
    assert cut_at_paragraph(text, 100) == (text, False)
    assert cut_at_paragraph(text, 30) == ("one two three\n\nfour five six", True)
    assert cut_at_paragraph("a" * 50, 10) == ("a" * 10, True)


# ---- the command line --------------------------------------------------------------------------------

def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "proxy.cli", *args, *NO_SANDBOX_ARGS], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_browse_command_prints_the_page_and_the_refusal(site, tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text(site.policy_text())
    done = run_cli("browse", url(site, "/page/article"), url(site, "/x", host="internal.lab.example"),
                   "--policy", str(policy), "--timeout", "10")
    assert done.returncode == 1, done.stderr  # not every URL was read
    out = done.stdout
    assert "Title:     Lab article" in out and "The second paragraph continues the thought" in out
    assert "NOT READ:  refused by egresswall" in out and "Rule:      special-purpose 127.0.0.0/8" in out
    done = run_cli("browse", url(site, "/page/article"), "--policy", str(policy), "--format", "markdown")
    assert done.returncode == 0 and done.stdout.startswith("# Lab article"), done.stderr


def test_browse_with_a_running_proxy_asks_it_why_a_connect_was_refused(site, start_proxy):
    proxy = start_proxy(site.policy_text())
    done = run_cli("browse", url(site, "/", tls=True, host="internal.lab.example"), url(site, "/page/article"),
                   "--proxy", f"{proxy.host}:{proxy.port}", "--format", "json")
    assert done.returncode == 1, done.stderr
    refused, read = (json.loads(line) for line in done.stdout.splitlines())
    assert refused["problem"] == "refused" and refused["rule"] == "special-purpose 127.0.0.0/8"
    assert read["read"] and "lab article" in read["content"]
    done = run_cli("browse", url(site, "/"), "--proxy", f"{proxy.host}:{proxy.port}", "--policy", "x.yaml")
    assert done.returncode == 2 and "exclude each other" in done.stderr


def test_browse_with_a_running_proxy_reports_a_refused_http_page_from_the_refusal_itself(site, start_proxy):
    """A refused http:// page comes back as the proxy's 403 with X-Egresswall-Rule/-Reason: that is the
    answer. Asking the proxy again with a CONNECT would be refused by port (ports.connect), report that
    instead, and write a CONNECT nobody made into the operator's audit log."""
    proxy = start_proxy(site.policy_text())
    target = url(site, "/x", host="internal.lab.example")
    done = run_cli("browse", target, "--proxy", f"{proxy.host}:{proxy.port}", "--format", "json")
    assert done.returncode == 1, done.stderr
    result = json.loads(done.stdout)
    assert result["problem"] == "refused" and result["rule"] == "special-purpose 127.0.0.0/8", result
    assert "does not connect to (special-purpose 127.0.0.0/8)" in result["reason"], result
    assert "127.0.0.3" not in result["reason"]
    decisions = [r for r in proxy.audit() if r.get("event") == "decision" and r.get("host") == "internal.lab.example"]
    assert decisions and all(r.get("method") != "CONNECT" for r in decisions), decisions
