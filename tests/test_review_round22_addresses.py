"""Review round 22, topic ``addresses``: findings (each test here FAILS on the tree it was written against).

The IPv4-translated block ``::ffff:0:0:0/96`` (RFC 2765 SIIT, ``::ffff:0:a.b.c.d``) carries an IPv4 address in its
low 32 bits exactly as the IPv4-compatible ``::/96`` and NAT64 ``64:ff9b::/96`` do: a stateless translator that
routes it (Jool SIIT and others still accept it) reaches that IPv4. ``policy/addresses.py`` does not know it as a
wrapping (``_WRAPPINGS`` lists ``::/96``, ``64:ff9b::/96``, ``64:ff9b:1::/48``, ``2002::/16``, ``2001::/32``), so
by default it is refused only as "outside 2000::/3"; but once an ``addresses.allow`` range covers it (the block
itself, or a wider one such as ``::/64``), every IPv4 inside passes unchecked — the cloud metadata address, an
IPv4 an address deny rule refuses, and an IPv4 literal a host deny rule refuses.

README (opening): "every other non-global address are refused by default, including their IPv6 wrappings";
README, step 5: "`addresses.deny` wins, then the cloud metadata set (no range re-admits it)" and "Re-admitting a
prefix that wraps IPv4 (`::/96`, NAT64 `64:ff9b::/96`, 6to4, Teredo) does not re-admit the IPv4 inside: that IPv4
must pass on its own"; README, step 3: "A deny rule naming an IPv4 literal also refuses the IPv6 literals that wrap
it". The README's hint for a metadata refusal: "refused whatever addresses.allow says".
"""

from __future__ import annotations

import contextlib
import socket
import time

import pytest
from dnslab import Record
from labnet import INTERNAL_IP, PUBLIC_IP
from proxyproc import both_transports, parse_response, read_response

from policy.addresses import AddressRules
from policy.decision import Request, precheck
from policy.hosts import parse_url
from policy.loader import parse_policy

TRANSLATED = "::ffff:0:0:0/96"


def translated(ipv4: str) -> str:
    """``::ffff:0:a.b.c.d`` (RFC 2765 IPv4-translated) in canonical text."""
    a, b, c, d = (int(part) for part in ipv4.split("."))
    return f"::ffff:0:{a * 256 + b:x}:{c * 256 + d:x}"


@pytest.mark.parametrize("readmit", [TRANSLATED, "::/64"])
def test_a_readmitted_ipv4_translated_range_does_not_readmit_cloud_metadata(readmit):
    """``::ffff:0:169.254.169.254`` must be refused as the cloud metadata endpoint whatever addresses.allow says
    (refuse_cloud_metadata is true), as its 6to4, NAT64 and IPv4-compatible spellings are. Today: allowed,
    "is in ::ffff:0:0:0/96, which the policy allows"."""
    rules = AddressRules(allow=[readmit])
    verdict = rules.check(translated("169.254.169.254"))
    assert not verdict.allowed, verdict
    assert verdict.rule.startswith("cloud-metadata"), verdict


@pytest.mark.parametrize("ipv4", [INTERNAL_IP, "10.0.0.1", "192.168.1.1", "100.64.0.1", "0.0.0.0"])
@pytest.mark.parametrize("readmit", [TRANSLATED, "::/64"])
def test_a_readmitted_ipv4_translated_range_does_not_readmit_the_ipv4_inside(readmit, ipv4):
    """Re-admitting the wrapping must not re-admit the IPv4 inside it: that IPv4 must pass on its own, as for
    ``::/96``, NAT64, 6to4 and Teredo (``AddressRules._wrapped_refusal``). Today: allowed."""
    rules = AddressRules(allow=[readmit])
    verdict = rules.check(translated(ipv4))
    assert not verdict.allowed, verdict
    assert ipv4 in verdict.reason, verdict


def test_an_address_deny_rule_refuses_the_ipv4_translated_spelling_of_what_it_denies():
    """``addresses.deny`` wins over ``addresses.allow``, and deny rules see the IPv4 inside a wrapping
    (``candidates`` in ``AddressRules._check``). Today ``::ffff:0:10.0.0.1`` passes a deny of 10.0.0.0/8."""
    rules = AddressRules(allow=[TRANSLATED], deny=["10.0.0.0/8"])
    verdict = rules.check(translated("10.0.0.1"))
    assert not verdict.allowed, verdict
    assert "10.0.0.0/8" in verdict.rule, verdict


def test_a_host_deny_rule_on_an_ipv4_literal_refuses_its_ipv4_translated_literal():
    """README step 3: "A deny rule naming an IPv4 literal also refuses the IPv6 literals that wrap it" — held for
    NAT64 (``[64:ff9b::a00:5]`` is refused by ``- 10.0.0.5``) but not for ``[::ffff:0:a00:5]``
    (``AddressRules.embedded_ipv4s`` does not know the block). Today: allowed by default."""
    policy = parse_policy("version: 1\ndefault: allow\nhosts:\n  deny:\n    - 10.0.0.5\n"
                          f"addresses:\n  allow: ['{TRANSLATED}']\n")
    verdict = precheck(policy, Request(parse_url(f"http://[{translated('10.0.0.5')}]/")))
    assert not verdict.allowed, verdict
    wrapped_nat64 = precheck(policy, Request(parse_url("http://[64:ff9b::a00:5]/")))
    assert not wrapped_nat64.allowed  # the same rule, another wrapping: this one holds today


def _decisions_for(proxy, host: str, wait: float = 2.0) -> list[dict]:
    deadline = time.monotonic() + wait
    while True:
        found = [r for r in proxy.decisions() if r.get("host") == host]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


@both_transports
@pytest.mark.integration
def test_a_name_answering_an_ipv4_translated_internal_address_is_refused_before_any_connect(lab, start_proxy):
    """With ``::ffff:0:0:0/96`` re-admitted, a name whose only answer is ``::ffff:0:127.0.0.3`` (the internal
    stand-in, IPv4-translated) must be refused at the address stage with one record, and nothing connected.
    Today the proxy allows it, pins ``::ffff:0:7f00:3`` and tries to connect there (the test guard refuses the
    non-loopback connect: a 502, and a recorded attempt to leave loopback)."""
    name = "r22-siit.lab.example"
    lab.dns.set(name, [Record("AAAA", translated(INTERNAL_IP))])
    text = lab.policy_text().replace(f"allow: [{PUBLIC_IP}/32]", f"allow: [{PUBLIC_IP}/32, '{TRANSLATED}']")
    proxy = start_proxy(text)
    status, headers, body = proxy.get(f"http://{name}:{lab.public.port}/r22")
    with contextlib.closing(socket.create_connection((proxy.host, proxy.port), timeout=10)) as sock:
        authority = f"{name}:{lab.public_tls.port}"
        sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        connect_status = parse_response(read_response(sock))[0]
    outside = [e for e in proxy.outbound() if not e["host"].startswith("127.") and e["host"] != "::1"]
    assert (status, connect_status) == (403, 403), (status, connect_status, body)
    assert "x-egresswall-reason" in headers
    records = _decisions_for(proxy, name)
    assert [(r["method"], r["verdict"], r["stage"]) for r in records] == [
        ("GET", "refuse", "address"), ("CONNECT", "refuse", "address")], records
    assert not outside, outside


# --- :: and ::1 under a re-admitted ::/96 ------------------------------------------------------------------
#
# ``_wrapping`` (policy/addresses.py) leaves ``::`` and ``::1`` out of the IPv4-compatible block ("blocks of their
# own"), so an addresses.allow range over ::/96 — the README's own example of a wrapping prefix whose re-admission
# "does not re-admit the IPv4 inside" — re-admits the IPv6 loopback and the unspecified address (a connect to which
# reaches this host) with the reason "which is not global unicast, but the policy re-admits ::/96". ``::2`` and every
# other IPv4-compatible address stay refused, as the IPv4 they carry (0.0.0.2) must pass on its own.


@pytest.mark.parametrize("readmit", ["::/96", "::/64"])
@pytest.mark.parametrize("address", ["::1", "::"])
def test_readmitting_the_ipv4_compatible_prefix_does_not_readmit_loopback_or_unspecified(readmit, address):
    """README step 5: "Re-admitting a prefix that wraps IPv4 (`::/96`, ...) does not re-admit the IPv4 inside: that
    IPv4 must pass on its own" — ``::1`` is 0.0.0.1 and ``::`` is 0.0.0.0 read that way, neither of which passes,
    and read as themselves they are the loopback and this host, which no range wider than them should re-admit by
    accident. Today: allowed."""
    verdict = AddressRules(allow=[readmit]).check(address)
    assert not verdict.allowed, verdict


@both_transports
@pytest.mark.integration
def test_a_name_answering_ipv6_loopback_is_refused_when_the_ipv4_compatible_prefix_is_readmitted(lab, start_proxy):
    """With ``::/96`` in addresses.allow (beside the lab's public stand-in), a name whose AAAA is ``::1`` must be
    refused at the address stage. Today the proxy allows it and connects to ``[::1]``: a stand-in listening there
    (loopback: the network rule allows it) receives the connection."""
    from labnet import StandIn
    try:
        loopback6 = StandIn("::1", 0)
    except OSError:  # no IPv6 loopback on this machine: the refusal is still checked, the listener cannot be
        loopback6 = None
    port = loopback6.port if loopback6 is not None else lab.public.port
    try:
        name = "r22-v6loopback.lab.example"
        lab.dns.set(name, [Record("AAAA", "::1")])
        text = lab.policy_text().replace(f"allow: [{PUBLIC_IP}/32]", f"allow: [{PUBLIC_IP}/32, '::/96']")
        if loopback6 is not None:
            text = text.replace(f"  http: [80, {lab.public.port}]", f"  http: [80, {lab.public.port}, {port}]")
        proxy = start_proxy(text)
        status, _, body = proxy.get(f"http://{name}:{port}/r22")
        time.sleep(0.2)
        reached = loopback6.connections if loopback6 is not None else []
        assert (status, reached) == (403, []), (status, body, reached)
        records = _decisions_for(proxy, name)
        assert [(r["verdict"], r["stage"]) for r in records] == [("refuse", "address")], records
    finally:
        if loopback6 is not None:
            loopback6.close()
