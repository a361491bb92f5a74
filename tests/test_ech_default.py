"""Encrypted Client Hello when ``tls.ech`` is unset: refused wherever a host rule could be dodged with it.

ECH hides the real server name behind the outer one, and the outer name is all egresswall can judge; an
allowed outer name (a CDN's) can carry a host a deny rule names. Unit tests of ``policy.model.ech_allowed``
over parsed policies, and one through the real proxy on both tunnel transports."""

from __future__ import annotations

import pytest
from proxyproc import both_transports
from rawclient import read_all
from tls_build import ECH, client_hello, extension

from policy.loader import parse_policy
from policy.model import ech_allowed

HEAD = "version: 1\nmode: enforce\n"
ROLE = "roles:\n  - name: kiosk\n    clients: [10.0.0.0/8]\n"


@pytest.mark.parametrize(("text", "allowed"), [
    ("default: allow\n", True),
    ("default: deny\n", False),
    ("default: allow\nhosts:\n  deny: [tracker.example]\n", False),
    ("default: allow\n" + ROLE + "    default: deny\n", False),
    ("default: allow\n" + ROLE + "    hosts:\n      deny: [tracker.example]\n", False),
    ("default: allow\n" + ROLE + "    hosts:\n      allow: [a.example]\n", True),
    ("default: deny\ntls:\n  ech: allow\n", True),
    ("default: allow\ntls:\n  ech: refuse\n", False),
    ("default: allow\nhosts:\n  deny: [tracker.example]\ntls:\n  ech: allow\n", True),
], ids=["open-web", "allowlist", "deny-rule", "role-denies-by-default", "role-deny-rule", "role-allows-only",
        "set-allow", "set-refuse", "deny-rule-but-set-allow"])
def test_ech_is_let_through_unset_only_where_no_host_rule_can_be_dodged(text, allowed):
    assert ech_allowed(parse_policy(HEAD + text, "ech.yaml")) is allowed


@both_transports
def test_an_open_web_policy_with_a_deny_rule_refuses_ech_on_both_transports(lab, start_proxy):
    proxy = start_proxy(lab.policy_text("hosts:\n  deny:\n    - denied.lab.example\n"))
    sock, status, _ = proxy.connect(f"public.lab.example:{lab.public_tls.port}")
    assert status == 200
    with sock:
        sock.sendall(client_hello(b"public.lab.example", extra=(extension(ECH, bytes(48)),)))
        answer = read_all(sock)
    assert answer[:1] in (b"\x15", b""), answer[:20]  # a TLS alert, or closed: never the origin's answer
    refusals = [r for r in proxy.audit() if r.get("rule") == "tls:ech" and r["verdict"] == "refuse"]
    assert len(refusals) == 1 and refusals[0]["host"] == "public.lab.example", proxy.audit()
