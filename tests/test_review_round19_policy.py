"""Review round 19: what a path rule is matched against (the core, unit-level).

A deny rule with ``paths`` matches a path in every reading a server may give it (README, *The policy file*):
IIS and servers on case-insensitive file systems serve ``/ADMIN`` as ``/admin``, so a deny rule matches without
regard to case; an allow rule matches case as written (a path it matches exactly is the same resource there).
"""

from __future__ import annotations

import pytest
from proxyproc import both_transports

from policy.decision import Request, Resolution, Verdict, decide
from policy.hosts import parse_url
from policy.loader import parse_policy

POLICY = """\
version: 1
default: deny
hosts:
  deny:
    - host: app.example.org
      paths: ["/admin", "/*/Secret"]
  allow:
    - host: app.example.org
      paths: ["/v1/public/"]
    - app.example.org
"""


def _verdict(url: str, text: str = POLICY) -> Verdict:
    target = parse_url(url)
    return decide(parse_policy(text, "p.yaml"), Request(target, "GET", "10.0.0.1"),
                  Resolution(target.host, ("93.184.216.34",)))


@pytest.mark.parametrize("path", ["/admin", "/ADMIN", "/Admin/users", "/aDmIn;x=1", "/x/secret", "/x/SECRET"])
def test_a_deny_rule_s_paths_match_in_any_case(path: str) -> None:
    verdict = _verdict(f"http://app.example.org{path}")
    assert not verdict.allowed and verdict.rule == "p.yaml:5", (path, verdict.reason)


@pytest.mark.parametrize("path", ["/v1/public/x", "/other", "/adm"])
def test_what_no_deny_rule_names_is_allowed_as_before(path: str) -> None:
    assert _verdict(f"http://app.example.org{path}").allowed, path


def test_an_allow_rule_s_paths_match_case_as_written() -> None:
    only_paths = POLICY.replace("    - app.example.org\n", "")
    for path, allowed in (("/v1/public/x", True), ("/V1/PUBLIC/x", False)):
        verdict = _verdict(f"http://app.example.org{path}", only_paths)
        assert verdict.allowed is allowed, (path, verdict.reason)


# ---- headers that ask a server for another path or method (through the proxy) ---------------------------------

OVERRIDES = ("hosts:\n  deny:\n    - host: public.lab.example\n      paths: ['/admin']\n"
             "  allow:\n    - host: public.lab.example\n      methods: [GET]\n")


@pytest.mark.integration
@both_transports
@pytest.mark.parametrize("header", ["X-Original-URL: /admin", "X-Rewrite-URL: /admin",
                                    "X-HTTP-Method-Override: DELETE", "x-http-method: DELETE",
                                    "X-Method-Override: PUT"])
def test_a_header_asking_for_another_path_or_method_is_refused_where_a_rule_decides_by_them(lab, start_proxy,
                                                                                          header):
    """IIS URL Rewrite (X-Original-URL), older Symfony (X-Rewrite-URL) and method-override middleware serve the
    path or method the header names: a 'paths' deny rule or a 'methods' allow rule was decided on the request
    line, and another was served (a helper's review of intercepted hosts, round 19). On a host no such rule
    names, the header goes through."""
    proxy = start_proxy(lab.policy_text(OVERRIDES))
    before = len(lab.public.requests)
    status, headers, _ = proxy.get(f"http://public.lab.example:{lab.public.port}/v1/page",
                                   dict([header.split(": ", 1)]))
    assert status == 403 and headers["x-egresswall-rule"] == "http:override-header", (status, headers)
    assert len(lab.public.requests) == before
    status, _, _ = proxy.get(f"http://other.lab.example:{lab.public.port}/v1/page", dict([header.split(": ", 1)]))
    assert status == 200
    assert [p for _, p, _ in lab.public.requests[before:]] == ["/v1/page"]
