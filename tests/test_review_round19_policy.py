"""Review round 19: what a path rule is matched against (the core, unit-level).

A deny rule with ``paths`` matches a path in every reading a server may give it (README, *The policy file*):
IIS and servers on case-insensitive file systems serve ``/ADMIN`` as ``/admin``, so a deny rule matches without
regard to case; an allow rule matches case as written (a path it matches exactly is the same resource there).
"""

from __future__ import annotations

import pytest

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
