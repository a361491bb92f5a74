"""Review round 18: the policy core's semantics, by differential testing (each test failed before its fix:
policy/decision.py `_host_rules` holds deny rules against the IPv4 an IPv6 literal wraps, `_check_cname` asks a
rule's expiry; proxy/cli/check.py `_check_one` decides https, wss and ws as the proxy decides the CONNECT).

Pure tests: no proxy, no DNS (IP-literal URLs only; ``egresswall check`` is given a loopback nameserver it
never needs to ask). Each test states the README sentence it holds the code to.
"""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from policy.decision import Request, Resolution, decide, precheck
from policy.hosts import parse_authority, parse_url
from policy.loader import parse_policy

ROOT = Path(__file__).resolve().parent.parent
EGRESSWALL = [sys.executable, "-m", "proxy.cli"]
PUBLIC = "93.184.216.34"  # 0x5db8d822


def policy(text: str):
    return parse_policy("version: 1\n" + text, "p.yaml")


def decide_url(pol, url: str, addresses=(PUBLIC,), cnames=(), **kwargs):
    request = Request(parse_url(url), **kwargs)
    return decide(pol, request, Resolution(request.target.host, addresses, cnames))


# --- 1. A host deny rule on an IPv4 literal is dodged by an IPv6 wrapping of the same address ----------------
#
# README, "How a request is decided", step 1: "The target is normalised strictly (... canonical IP literals,
# IPv4-mapped IPv6 unwrapped)" -- so `[::ffff:93.184.216.34]` is refused by `hosts.deny: [93.184.216.34]`.
# Step 5: "Re-admitting a prefix that wraps IPv4 (`::/96`, NAT64 `64:ff9b::/96`, 6to4, Teredo) does not re-admit
# the IPv4 inside: that IPv4 must pass on its own. For local-use NAT64 (`64:ff9b:1::/48`) ... re-admit the
# translator's own prefix". An operator on an IPv6-only (DNS64/NAT64) network must re-admit the translator's
# prefix, as the README says; then the NAT64 spelling of a denied IPv4 literal reaches exactly the host the
# deny rule names, and is allowed. (`addresses.deny` does see through the wrapping; host rules do not.)

DENIED_LITERAL = """\
default: allow
hosts:
  deny:
    - host: 93.184.216.34
      reason: this server is off limits
addresses:
  allow: ["64:ff9b::/96", "64:ff9b:1::/96", "2002::/16"]
"""


@pytest.mark.parametrize("url", [
    "http://93.184.216.34/",
    "http://[::ffff:93.184.216.34]/",          # holds today: IPv4-mapped is unwrapped
    "http://[64:ff9b::5db8:d822]/",            # NAT64 well-known prefix (RFC 6052)
    "http://[64:ff9b::93.184.216.34]/",        # the same, dotted
    "http://[64:ff9b:1::5db8:d822]/",          # local-use NAT64 under a re-admitted /96 translator prefix
    "http://[2002:5db8:d822::]/",              # 6to4 of the same IPv4
])
def test_a_denied_ipv4_literal_is_refused_in_every_wrapping_the_policy_re_admits(url: str) -> None:
    verdict = decide_url(policy(DENIED_LITERAL), url)
    assert not verdict.allowed, (url, verdict.rule, verdict.reason)


@pytest.mark.parametrize("url", [
    "http://[2a00:1234:64::5db8:d822]/",       # the network's own NAT64 prefix (addresses.nat64, round 19)
    "http://[2606:4700:10::5efe:5db8:d822]/",  # an ISATAP interface identifier (round 19)
])
def test_a_denied_ipv4_literal_is_refused_under_the_network_s_nat64_prefix_and_isatap(url: str) -> None:
    pol = policy(DENIED_LITERAL + '  nat64: ["2a00:1234:64::/96"]\n')
    verdict = decide_url(pol, url)
    assert not verdict.allowed and "93.184.216.34" in verdict.reason, (url, verdict.rule, verdict.reason)
    assert decide_url(policy(DENIED_LITERAL.replace("93.184.216.34", "93.184.216.35")
                             + '  nat64: ["2a00:1234:64::/96"]\n'), url).allowed


def test_the_wrapping_dodge_also_opens_a_tunnel() -> None:
    pol = policy(DENIED_LITERAL)
    for authority in ("93.184.216.34:443", "[64:ff9b::5db8:d822]:443"):
        verdict = precheck(pol, Request(parse_authority(authority), "CONNECT", tunnel=True))
        assert not verdict.allowed, (authority, verdict.reason)


# --- 2. `egresswall check wss://...` disagrees with the proxy's decision of that same wss:// ------------------
#
# README, Commands: "`egresswall check URL...` explains a decision" and "A `ws://` URL is checked as a browser
# sends it: `CONNECT host:port`, then the upgrade inside"; The policy file: "A `wss://` through a passed-through
# TLS tunnel looks like any HTTPS tunnel, and the rule opens it". policy/resolver.py resolve_and_decide: "The one
# path both `egresswall check` and the proxy take, so they cannot disagree."
# Every client sends wss:// through an HTTP proxy as `CONNECT host:443`, which the proxy decides as
# Request(parse_authority(authority, "https"), "CONNECT", tunnel=True) (proxy/gate.py decide_connect): scheme
# https, websocket False. `check` instead decides a tunnel Request with scheme "wss" and websocket=True
# (proxy/cli/check.py _check_one), so a rule's `schemes:` and `websocket:` conditions read differently:
#   * deny {host, schemes: [wss]}      -> check REFUSED, proxy ALLOWS the tunnel (and the wss inside);
#   * allow {host, websocket: false}   -> check REFUSED, proxy ALLOWS;
#   * allow {host, schemes: [wss]}     -> check ALLOWED, proxy REFUSES.

WSS_CASES = {
    "deny-schemes-wss": "default: allow\nhosts:\n  deny:\n    - host: 93.184.216.34\n      schemes: [wss]\n",
    "allow-websocket-false": "default: deny\nhosts:\n  allow:\n    - host: 93.184.216.34\n      websocket: false\n",
    "allow-schemes-wss": "default: deny\nhosts:\n  allow:\n    - host: 93.184.216.34\n      schemes: [wss]\n",
}


def _proxy_decides_connect(pol, authority: str) -> bool:
    """What proxy/gate.py decide_connect asks the core for a CONNECT (no session, no DNS for an IP literal)."""
    return precheck(pol, Request(parse_authority(authority, "https"), "CONNECT", tunnel=True)).allowed


def _check_allows(tmp_path: Path, text: str, url: str) -> tuple[bool, subprocess.CompletedProcess]:
    """What ``egresswall check`` says of ``url`` under the policy ``text`` (exit 0 allowed, 1 refused). An IP
    literal is never resolved; the nameserver is loopback all the same."""
    policy_file = tmp_path / "p.yaml"
    policy_file.write_text(text)
    done = subprocess.run([*EGRESSWALL, "check", "--policy", str(policy_file), "--nameserver", "127.0.0.1:9", url],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode in (0, 1), done.stderr
    return done.returncode == 0, done


@pytest.mark.parametrize("case", sorted(WSS_CASES))
def test_check_of_a_wss_url_agrees_with_the_connect_the_proxy_decides(case: str, tmp_path: Path) -> None:
    text = "version: 1\n" + WSS_CASES[case]
    proxy_allows = _proxy_decides_connect(parse_policy(text, "p.yaml"), f"{PUBLIC}:443")
    check_allows, done = _check_allows(tmp_path, text, f"wss://{PUBLIC}/")
    assert check_allows == proxy_allows, (case, f"check says {'ALLOWED' if check_allows else 'REFUSED'}, the "
                                                f"proxy's CONNECT is {'allowed' if proxy_allows else 'refused'}",
                                          done.stdout)


# --- 3. An expired deny rule still refuses every alias (CNAME) of the host it named ---------------------------
#
# README, The policy file, Expiry: "`expires: 2027-06-30` (a bare date) means the whole of that day in UTC: the
# rule matches through 30 June and stops at 2027-07-01T00:00Z." policy/decision.py _check_cname: "A deny rule
# counts when it would refuse this same request sent to the alias's name". After expiry the host itself is
# allowed, but a name that is a CNAME of it is refused by that expired rule: _check_cname treats a rule with no
# ports/schemes/methods/paths as "unconditional" and never asks about its expiry (nor its websocket flag).
# Fails closed, but two spellings of one destination are decided differently.

def test_an_expired_deny_rule_refuses_neither_the_host_nor_its_aliases() -> None:
    pol = policy("default: allow\nhosts:\n  deny:\n    - host: tracker.example.com\n      expires: 2027-06-30\n")
    after = datetime(2027, 8, 1, tzinfo=UTC)
    direct = decide_url(pol, "http://tracker.example.com/", at=after)
    assert direct.allowed, direct.reason
    alias = decide_url(pol, "http://cdn.example.net/", cnames=("tracker.example.com",), at=after)
    assert alias.allowed, (alias.rule, alias.reason)


# --- 4. `egresswall check https://...` of an intercepted host skips the CONNECT the proxy decides first -------
#
# Same README sentences as 2. For a host some allow rule intercepts (``Policy.intercepts``: any candidate rule with
# intercept: true, whatever its other conditions), check decides only the request inside (tunnel=False), while
# the proxy first decides `CONNECT host:443` as a tunnel, where a methods/paths rule without intercept: true does
# not hold. Here check says ALLOWED and the proxy refuses the CONNECT (fails closed; check misleads).

def test_check_of_an_intercepted_https_url_agrees_with_the_connect_the_proxy_decides(tmp_path: Path) -> None:
    text = ("version: 1\ndefault: deny\nports: {connect: [443, 8443]}\nhosts:\n  allow:\n"
            "    - host: 93.184.216.34\n      methods: [GET]\n"
            "    - host: 93.184.216.34\n      intercept: true\n      ports: [8443]\n")
    proxy_allows = _proxy_decides_connect(parse_policy(text, "p.yaml"), f"{PUBLIC}:443")
    check_allows, done = _check_allows(tmp_path, text, f"https://{PUBLIC}/")
    assert check_allows == proxy_allows, (proxy_allows, done.stdout)
