"""Review round 19, second pass: a helper's adversarial review of the round's own fixes (47989b9..).

Each test marked "Failed before its fix" showed a defect in them (or, where said, one older); the others held and
are kept as regressions.
"""

from __future__ import annotations

import contextlib
import time
import uuid

import pytest
from dnslab import Record
from intercept_client import open_intercepted, read_until_quiet, statuses
from proxyproc import both_transports
from session_client import create, get, token_file

from policy.decision import Request, decides_by_request_line, precheck
from policy.hosts import parse_url
from policy.loader import parse_policy

pytestmark = pytest.mark.integration

OVERRIDES = ("hosts:\n  deny:\n    - host: public.lab.example\n      paths: ['/admin']\n"
             "  allow:\n    - host: public.lab.example\n      methods: [GET]\n")


# ---- 1. http:override-header: a header name IIS/CGI/PHP read as HTTP_X_ORIGINAL_URL -----------------------------

@both_transports
@pytest.mark.parametrize("header", ["X_Original_URL: /admin", "X_Rewrite_URL: /admin",
                                    "X_HTTP_Method_Override: DELETE", "x_http_method: DELETE",
                                    "X_Method_Override: PUT"])
def test_an_underscore_spelling_of_an_override_header_is_refused_too(lab, start_proxy, header):
    """Failed before its fix (both transports).
    CGI/FastCGI gateways (IIS, PHP's built-in server, any gateway that does not
    drop underscored names) turn a header name into HTTP_ + upper case with '-' -> '_': 'X_Original_URL' and
    'X-Original-URL' are the same variable HTTP_X_ORIGINAL_URL, which Symfony's Request (X_ORIGINAL_URL) and
    IIS URL Rewrite read. override_headers() compares lower-cased names only, so the underscore spelling goes
    through to the origin of a host whose rules decide by path or method."""
    proxy = start_proxy(lab.policy_text(OVERRIDES))
    before = len(lab.public.requests)
    status, headers, _ = proxy.get(f"http://public.lab.example:{lab.public.port}/v1/page",
                                   dict([header.split(": ", 1)]))
    time.sleep(0.2)
    forwarded = lab.public.requests[before:]
    assert status == 403 and headers.get("x-egresswall-rule") == "http:override-header", (status, forwarded)
    assert forwarded == []


# ---- 2. http:override-header and a CNAME alias of a host with path rules --------------------------------------

@both_transports
def test_an_override_header_to_an_alias_of_a_host_with_path_rules_is_refused(lab, start_proxy):
    """Failed before its fix (both transports). A deny rule reached through a CNAME counts with its paths (decision.
    _check_cname: '/admin' asked of the alias is refused). decides_by_request_line looks only at rules naming the
    name asked for, so '/v1/page' with 'X-Original-URL: /admin' to the alias goes through, and an origin that
    honours the header serves /admin of the denied host."""
    alias = f"a{uuid.uuid4().hex[:8]}.lab.example"
    lab.dns.set(alias, [Record("CNAME", "public.lab.example")])
    proxy = start_proxy(lab.policy_text("hosts:\n  deny:\n    - host: public.lab.example\n      paths: ['/admin']\n"))
    base = f"http://{alias}:{lab.public.port}"
    before = len(lab.public.requests)
    status, headers, _ = proxy.get(f"{base}/admin")  # the deny rule holds through the alias
    assert status == 403, headers
    status, headers, _ = proxy.get(f"{base}/v1/page", {"X-Original-URL": "/admin"})
    time.sleep(0.2)
    forwarded = lab.public.requests[before:]
    assert status == 403 and headers.get("x-egresswall-rule") == "http:override-header", (status, forwarded)
    assert forwarded == []


# ---- 3. http:override-header and a session's exact URL grant --------------------------------------------------

@both_transports
def test_an_override_header_cannot_widen_a_session_url_grant(lab, start_proxy, tmp_path):
    """Failed before its fix (both transports).
    A session granted one exact URL (what `egresswall browse --policy` makes)
    is held to it where the request is visible; the override check looks only at the policy's host rules, so
    'GET /docs/page' with 'X-Original-URL: /admin' is admitted under the grant for /docs/page and an IIS or
    older Symfony origin serves /admin."""
    policy = lab.policy_text("roles:\n  - name: agents\n    clients: [127.0.0.1/32]\n    session: required\n")
    proxy = start_proxy(policy, "--admin-token-file", str(token_file(tmp_path)))
    base = f"http://public.lab.example:{lab.public.port}"
    session = create(proxy.admin_port, {"urls": [f"{base}/docs/page"]})
    status, headers, _ = get(proxy, f"{base}/admin", session)
    assert (status, headers.get("x-egresswall-rule")) == (403, "session:not-granted")
    before = len(lab.public.requests)
    status, headers, _ = get(proxy, f"{base}/docs/page", session, {"X-Original-URL": "/admin"})
    time.sleep(0.2)
    forwarded = lab.public.requests[before:]
    assert status == 403, (status, headers.get("x-egresswall-rule"), forwarded)
    assert forwarded == []


# ---- 4. a browser's query with a backslash, inside an intercepted tunnel (newly refused) ----------------------

def _intercepting(lab, start_proxy, tmp_path):
    return start_proxy(lab.policy_text("hosts:\n  allow:\n    - host: public.lab.example\n      intercept: true\n"),
                       "--upstream-ca", str(lab.cert_file), "--confdir", str(tmp_path / "ca"))


def _inside(proxy, lab, target: bytes) -> bytes:
    tls, _ = open_intercepted(proxy, "public.lab.example", lab.public_tls.port)
    with contextlib.closing(tls):
        tls.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: " + f"public.lab.example:{lab.public_tls.port}".encode()
                    + b"\r\nConnection: close\r\n\r\n")
        return read_until_quiet(tls, 3)


# Chromium 1xx sends this request line for https://host/search?q=C:\Users\x|y^z`w (checked against a loopback
# server): the URL standard's query percent-encode set leaves '\', '|', '^', '`', '{', '}', '[', ']' as they are.
BROWSER_QUERIES = {
    "backslash": b"/search?q=C:\\Users\\x",
    "pipe-caret-backtick": b"/search?q=a|b^c`d",
    "braces-brackets": b"/search?q={a}[b]",
    "slash-colon-at-question": b"/search?next=/a:b@c?d",
    "empty-query": b"/search?",
    "percent-00": b"/search?q=%00",
    "percent-utf8": b"/caf%C3%A9/?q=%E2%9C%93",
    "semicolon": b"/a;v=1/b?x=1;y=2",
}


@both_transports
@pytest.mark.parametrize("name", list(BROWSER_QUERIES))
def test_a_browser_query_goes_through_an_intercepted_tunnel(lab, start_proxy, tmp_path, name):
    """'backslash' failed before its fix (both transports):
    refused 4xx by parse_url's backslash check ('browsers read it
    as /', true of a path, not of a query), which d501bfc now runs on an intercepted tunnel's path; before today
    it went through. Plain HTTP refused it before today too (test below). The others hold."""
    proxy = _intercepting(lab, start_proxy, tmp_path)
    before = len(lab.public_tls.requests)
    answer = _inside(proxy, lab, BROWSER_QUERIES[name])
    assert statuses(answer)[:1] == [200] or statuses(answer)[:1] == [404], answer[:300]
    assert len(lab.public_tls.requests) == before + 1


@both_transports
def test_a_browser_query_with_a_backslash_goes_through_plain_http(lab, start_proxy):
    """Failed before its fix (both transports), and before this round too: plain HTTP refuses what Chromium sends for
    http://host/search?q=C:\\Users\\x."""
    proxy = start_proxy(lab.policy_text())
    before = len(lab.public.requests)
    status, headers, _ = proxy.get(f"http://public.lab.example:{lab.public.port}/search?q=C:\\Users\\x")
    assert status == 200, (status, headers.get("x-egresswall-reason"))
    assert len(lab.public.requests) == before + 1


# ---- 5. addresses: a host deny rule on an IPv4 literal and ISATAP inside another wrapping ---------------------

ISATAP_POLICY = """\
version: 1
default: allow
hosts:
  deny:
    - 93.184.216.34
addresses:
  allow: ['2002::/16', '2001::/32']
"""


@pytest.mark.parametrize("url", [
    "http://[2002:808:808::5efe:5db8:d822]/",      # 6to4 of 8.8.8.8, ISATAP identifier of 93.184.216.34
    "http://[2001:0:808:808:0:5efe:5db8:d822]/",   # Teredo, ISATAP identifier of 93.184.216.34
])
def test_a_host_deny_rule_on_an_ipv4_literal_holds_for_an_isatap_identifier_inside_a_readmitted_wrapping(url):
    """Failed before its fix.
    README step 3: a deny rule naming an IPv4 literal also refuses the IPv6 literals that wrap it
    (... ISATAP ...). AddressRules.embedded_ipv4 returns the wrapping's IPv4 (6to4, Teredo) and never reaches the
    ISATAP reading when the address has both; _check reads both, so only the host deny rule is dodged."""
    policy = parse_policy(ISATAP_POLICY, "p.yaml")
    verdict = precheck(policy, Request(parse_url(url), "GET", "10.0.0.1"))
    assert not verdict.allowed, verdict.reason
    # the same ISATAP identifier under a prefix with no other wrapping is refused (holds today)
    held = precheck(policy, Request(parse_url("http://[fd00::5efe:5db8:d822]/"), "GET", "10.0.0.1"))
    assert not held.allowed


def test_an_address_deny_rule_written_as_a_listed_nat64_spelling_refuses_the_ipv4_it_reaches():
    """Failed before its fix.
    An address deny rule written inside ::ffff:0:0/96 is the IPv4 range it maps (README step 5);
    one written inside a prefix under addresses.nat64 is left as IPv6, so it refuses only that spelling: the
    IPv4 itself, and the same IPv4 through another listed translator, pass."""
    from policy.addresses import AddressRules

    rules = AddressRules(deny=["2a00:1234:64::5db8:d822/128"], nat64=["2a00:1234:64::/96", "2a00:9999:64::/96"])
    assert not rules.check("2a00:1234:64::5db8:d822").allowed
    assert not rules.check("2a00:9999:64::5db8:d822").allowed, "another translator's spelling passes"
    assert not rules.check("93.184.216.34").allowed, "the IPv4 spelling passes"


# ---- held: decides_by_request_line over wildcard and suffix rules, role lists ----------------------------------

def test_decides_by_request_line_sees_wildcard_suffix_and_role_rules():
    policy = parse_policy("""\
version: 1
default: allow
hosts:
  deny:
    - host: '*.w.example'
      paths: ['/admin']
    - host: .s.example
      methods: [DELETE]
roles:
  - name: r
    clients: [10.9.0.0/16]
    hosts:
      allow:
        - host: role.example
          paths: ['/x']
""", "p.yaml")
    assert decides_by_request_line(policy, "a.w.example", "10.0.0.1")
    assert decides_by_request_line(policy, "b.a.w.example", "10.0.0.1")
    assert decides_by_request_line(policy, "s.example", "10.0.0.1")
    assert decides_by_request_line(policy, "x.s.example", "10.0.0.1")
    assert decides_by_request_line(policy, "role.example", "10.9.0.1")
    assert not decides_by_request_line(policy, "role.example", "10.0.0.1")
    assert not decides_by_request_line(policy, "other.example", "10.0.0.1")


# ---- 6. store_url.redacted and a unix:// store URL with a password -------------------------------------------

@pytest.mark.parametrize("url", ["unix://:s3cret-h4@/tmp/r19b-none.sock?db=0", "unix://user:s3cret-h4@/tmp/r19b.sock"])
def test_a_unix_store_url_s_password_is_redacted(url):
    """Failed before its fix. redis-py (8.2) reads a unix:// URL's userinfo as username and password
    (redis.connection.parse_url('unix://:pw@/x.sock') -> password 'pw'); redacted() keeps a unix URL's userinfo
    whole, so the start-up line ('session store unix://:s3cret@/...') and the store-unavailable operator log line
    carry it."""
    from proxy.sessions.store_url import redacted

    assert "s3cret-h4" not in redacted(url), redacted(url)


def test_the_start_up_line_never_carries_a_unix_store_password(tmp_path):
    """Failed before its fix: the start-up line prints the unix URL with its password."""
    from proxyproc import ProxyProcess

    proxy = ProxyProcess(["--admin-token-file", str(token_file(tmp_path)), "--session-store",
                          "unix://:s3cret-h4@/tmp/r19b-none.sock", "--nameserver", "127.0.0.1:9"],
                         tmp_path / "audit.jsonl")
    try:
        time.sleep(0.5)
        text = proxy.stderr + proxy.log_path.read_text()
    finally:
        proxy.stop()
    assert "s3cret-h4" not in text, [line for line in text.splitlines() if "s3cret" in line]
