"""policy.addresses: IANA classification, wrappings, operator rules and strict parsing.

The property tests judge the module against an independent list of refused space written here from the
IANA registries (and checked with Python's ipaddress, not netaddr), not against the module's own tables.
"""

import ipaddress

import netaddr
import pytest
from hypothesis import given
from hypothesis import strategies as st

from policy.addresses import (
    CHECKED_CACHE_SIZE,
    CLOUD_METADATA,
    SPECIAL_PURPOSE_V4,
    SPECIAL_PURPOSE_V6,
    AddressBlock,
    AddressRules,
    AddressVerdict,
    parse_address,
    parse_cidr,
    rfc6052_ipv4,
    unwrap_mapped,
)

DEFAULT = AddressRules()

# --- the independent list: everything default rules must refuse ------------------------------------

REFUSED_V4 = [ipaddress.IPv4Network(text) for text in (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
    "192.0.0.0/24", "192.0.2.0/24", "192.88.99.0/24", "192.168.0.0/16", "198.18.0.0/15",
    "198.51.100.0/24", "203.0.113.0/24", "224.0.0.0/4", "240.0.0.0/4",
    "168.63.129.16/32",  # Azure WireServer: public, but cloud metadata
)]
# Inside 2000::/3 only; everything outside it is refused anyway (checked separately).
REFUSED_V6 = [ipaddress.IPv6Network(text) for text in (
    "2001::/23", "2001:db8::/32", "2002::/16", "3fff::/20",
)]
GLOBAL_UNICAST_V6 = ipaddress.IPv6Network("2000::/3")


def independently_refused(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if address.version == 6:
        if address.ipv4_mapped is not None:
            return independently_refused(address.ipv4_mapped)
        return address not in GLOBAL_UNICAST_V6 or any(address in net for net in REFUSED_V6)
    return any(address in net for net in REFUSED_V4)


def ip(value: int, version: int) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.IPv4Address(value) if version == 4 else ipaddress.IPv6Address(value)


def rule_cidr(verdict: AddressVerdict) -> str:
    return verdict.rule.rsplit(" ", 1)[-1]


# --- the tables --------------------------------------------------------------------------------------

ALL_BLOCKS = SPECIAL_PURPOSE_V4 + SPECIAL_PURPOSE_V6 + CLOUD_METADATA


def test_tables_are_well_formed() -> None:
    for block in ALL_BLOCKS:
        assert isinstance(block, AddressBlock)
        assert block.name and block.source
        assert str(ipaddress.ip_network(block.cidr)) == block.cidr  # canonical, no host bits
    assert all(ipaddress.ip_network(b.cidr).version == 4 for b in SPECIAL_PURPOSE_V4)
    assert all(ipaddress.ip_network(b.cidr).version == 6 for b in SPECIAL_PURPOSE_V6)
    required_v4 = {
        "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
        "192.0.0.0/24", "192.0.2.0/24", "192.88.99.0/24", "192.168.0.0/16", "198.18.0.0/15",
        "198.51.100.0/24", "203.0.113.0/24", "224.0.0.0/4", "240.0.0.0/4", "255.255.255.255/32",
    }
    required_v6 = {
        "::/128", "::1/128", "::/96", "::ffff:0:0/96", "64:ff9b::/96", "64:ff9b:1::/48", "100::/64",
        "2001::/23", "2001::/32", "2001:db8::/32", "2002::/16", "3fff::/20", "5f00::/16", "fc00::/7",
        "fe80::/10", "fec0::/10", "ff00::/8",
    }
    assert required_v4 <= {b.cidr for b in SPECIAL_PURPOSE_V4}
    assert required_v6 <= {b.cidr for b in SPECIAL_PURPOSE_V6}
    clouds = {(b.cidr, b.name.split()[0]) for b in CLOUD_METADATA}
    assert {("169.254.169.254/32", "AWS"), ("fd00:ec2::254/128", "AWS"), ("169.254.169.254/32", "GCP"),
            ("168.63.129.16/32", "Azure"), ("169.254.169.254/32", "Azure"), ("192.0.0.192/32", "Oracle"),
            ("169.254.169.254/32", "Oracle"), ("100.100.100.200/32", "Alibaba")} <= clouds


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=lambda b: f"{b.cidr} {b.name}")
def test_block_edges(block: AddressBlock) -> None:
    net = ipaddress.ip_network(block.cidr)
    for inside in (net[0], net[-1]):
        verdict = DEFAULT.check(str(inside))
        assert not verdict.allowed, verdict
        assert verdict.reason
        if block.cidr != "::ffff:0:0/96":  # mapped addresses are judged (and named) as their IPv4
            decided_by = ipaddress.ip_network(rule_cidr(verdict))
            assert decided_by.version == net.version and decided_by.subnet_of(net), verdict
    top = 2 ** net.max_prefixlen - 1
    for value in (int(net[0]) - 1, int(net[-1]) + 1):
        if not 0 <= value <= top:
            continue
        outside = ip(value, net.version)
        verdict = DEFAULT.check(outside)
        assert verdict.allowed == (not independently_refused(outside)), verdict
        if not verdict.allowed:
            assert rule_cidr(verdict) != block.cidr, verdict


def test_block_reasons_cite_name_and_source() -> None:
    verdict = DEFAULT.check("10.0.0.5")
    assert verdict == AddressVerdict(False, "10.0.0.5", "special-purpose 10.0.0.0/8", verdict.reason)
    assert "10.0.0.0/8" in verdict.reason and "Private-Use" in verdict.reason and "RFC 1918" in verdict.reason
    verdict = DEFAULT.check("3fff::1")
    assert "Documentation" in verdict.reason and "RFC 9637" in verdict.reason
    verdict = DEFAULT.check("5f00::1")
    assert verdict.rule == "special-purpose 5f00::/16" and "RFC 9602" in verdict.reason


@pytest.mark.parametrize("text", [
    "192.0.0.9", "192.0.0.10", "192.88.99.2",
    "2001:1::1", "2001:1::2", "2001:3::1", "2001:4:112::1", "2001:20::1", "2001:30::1",
])
def test_registry_global_blocks_refused_by_design(text: str) -> None:
    # IANA marks these globally reachable (or sub-blocks of a refused block); the design refuses the parent.
    assert not DEFAULT.check(text).allowed


@pytest.mark.parametrize("text", [
    "192.31.196.1", "192.52.193.1", "192.175.48.1", "8.8.8.8", "1.1.1.1", "223.255.255.255",
    "2620:4f:8000::1", "2606:4700:4700::1111", "2003::1",
])
def test_global_addresses_allowed(text: str) -> None:
    verdict = DEFAULT.check(text)
    assert verdict.allowed and verdict.rule == "global", verdict


@pytest.mark.parametrize("text", ["4000::1", "::1:0:0", "1::", "8000::", "e000::1"])
def test_ipv6_outside_global_unicast(text: str) -> None:
    verdict = DEFAULT.check(text)
    assert not verdict.allowed
    assert verdict.rule == "outside-global-unicast 2000::/3"
    assert "outside 2000::/3 global unicast" in verdict.reason


@pytest.mark.parametrize("text, names", [
    ("169.254.169.254", ["AWS", "GCP", "Azure", "Oracle"]),
    ("168.63.129.16", ["Azure"]),
    ("100.100.100.200", ["Alibaba"]),
    ("192.0.0.192", ["Oracle"]),
    ("fd00:ec2::254", ["AWS"]),
    ("169.254.0.23", ["Tencent"]),
    ("169.254.42.42", ["Scaleway"]),
    ("fd00:42::42", ["Scaleway"]),
])
def test_cloud_metadata_named(text: str, names: list[str]) -> None:
    verdict = DEFAULT.check(text)
    assert not verdict.allowed
    assert verdict.rule == f"cloud-metadata {ipaddress.ip_network(text)}"
    assert all(name in verdict.reason for name in names)


# --- wrappings ---------------------------------------------------------------------------------------

def wrappings(v4: ipaddress.IPv4Address) -> dict[str, ipaddress.IPv6Address]:
    """Every way to carry an IPv4 inside IPv6, built by hand from the RFCs."""
    n = int(v4)
    return {
        "IPv4-mapped": ipaddress.IPv6Address(0xFFFF << 32 | n),                        # RFC 4291
        "IPv4-compatible": ipaddress.IPv6Address(n),                                   # RFC 4291
        "NAT64": ipaddress.IPv6Address(0x64FF9B << 96 | n),                            # RFC 6052 /96
        "NAT64 (local-use)": ipaddress.IPv6Address(                                    # RFC 6052 /48 layout
            0x0064FF9B0001 << 80 | (n >> 16) << 64 | (n & 0xFFFF) << 40),
        "6to4": ipaddress.IPv6Address(0x2002 << 112 | n << 80 | 1),                    # RFC 3056
        "Teredo": ipaddress.IPv6Address(0x20010000 << 96 | 0x4136E378 << 64 | 0x8000 << 48 | 0x63BF << 32
                                        | (n ^ 0xFFFFFFFF)),                           # RFC 4380
    }


@pytest.mark.parametrize("block", SPECIAL_PURPOSE_V4, ids=lambda b: b.cidr)
def test_wrappings_of_refused_ipv4(block: AddressBlock) -> None:
    net = ipaddress.IPv4Network(block.cidr)
    v4 = net[-1]
    for label, wrapped in wrappings(v4).items():
        verdict = DEFAULT.check(str(wrapped))
        assert not verdict.allowed, (label, verdict)
        if label == "IPv4-compatible" and int(v4) <= 1:
            continue  # ::0.0.0.0 and ::0.0.0.1 are :: and ::1, blocks of their own
        assert label in verdict.reason, (label, verdict)
        if label != "NAT64 (local-use)":  # the only wrapping without a fixed IPv4 position
            assert str(v4) in verdict.reason, (label, verdict)


def test_mapped_is_judged_as_its_ipv4() -> None:
    refused = DEFAULT.check("::ffff:10.0.0.1")
    assert not refused.allowed and refused.rule == "special-purpose 10.0.0.0/8"
    assert refused.address == "::ffff:10.0.0.1" and "IPv4-mapped" in refused.reason
    allowed = DEFAULT.check("::ffff:8.8.8.8")
    assert allowed.allowed and allowed.rule == "global" and "IPv4-mapped" in allowed.reason
    assert DEFAULT.check("::ffff:808:808") == allowed
    assert not DEFAULT.check("::ffff:169.254.169.254").allowed


@pytest.mark.parametrize("label", ["IPv4-compatible", "NAT64", "NAT64 (local-use)", "6to4", "Teredo"])
def test_wrappings_of_global_ipv4_refused_whole(label: str) -> None:
    verdict = DEFAULT.check(wrappings(ipaddress.IPv4Address("8.8.8.8"))[label])
    assert not verdict.allowed and label in verdict.reason and "whole" in verdict.reason


def test_teredo_reason_deobfuscates_client() -> None:
    verdict = DEFAULT.check("2001:0:4136:e378:8000:63bf:3fff:fdd2")  # RFC 4380 example: client 192.0.2.45
    assert not verdict.allowed and verdict.rule == "special-purpose 2001::/32"
    assert "192.0.2.45" in verdict.reason and "Teredo" in verdict.reason


# --- operator rules ----------------------------------------------------------------------------------

def test_allow_readmits_benchmarking_and_one_loopback() -> None:
    rules = AddressRules(allow=["198.18.0.0/15", "127.0.0.2/32"])
    lab = rules.check("198.19.255.255")
    assert lab.allowed and lab.rule == "address-allow 198.18.0.0/15" and "Benchmarking" in lab.reason
    assert rules.check("127.0.0.2").allowed
    assert rules.check("::ffff:127.0.0.2").allowed
    assert not rules.check("127.0.0.1").allowed
    assert rules.check("198.20.0.0").allowed  # just outside 198.18/15: global again


def test_allow_cannot_readmit_cloud_metadata() -> None:
    rules = AddressRules(allow=["169.254.0.0/16", "168.63.129.16/32", "fd00::/8"])
    for text in ("169.254.169.254", "168.63.129.16", "fd00:ec2::254", "::ffff:169.254.169.254"):
        verdict = rules.check(text)
        assert not verdict.allowed and verdict.rule.startswith("cloud-metadata "), verdict
    assert rules.check("169.254.1.1").allowed
    off = AddressRules(allow=["169.254.169.254/32"], refuse_cloud_metadata=False)
    assert off.check("169.254.169.254").allowed
    assert AddressRules(refuse_cloud_metadata=False).check("168.63.129.16").allowed  # public, flag off
    assert not AddressRules(refuse_cloud_metadata=False).check("169.254.169.254").allowed  # still link-local


def test_deny_beats_allow_and_refuses_public() -> None:
    rules = AddressRules(allow=["198.18.0.0/15"], deny=["198.18.1.0/24", "8.8.8.0/24"])
    assert rules.check("198.18.0.1").allowed
    denied = rules.check("198.18.1.1")
    assert not denied.allowed and denied.rule == "address-deny 198.18.1.0/24"
    public = rules.check("8.8.8.8")
    assert not public.allowed and public.rule == "address-deny 8.8.8.0/24" and "8.8.8.0/24" in public.reason
    assert rules.check("8.8.4.4").allowed


def test_deny_sees_mapped_and_wrapped_ipv4() -> None:
    rules = AddressRules(deny=["93.184.216.0/24", "::ffff:1.1.1.0/120"])
    for text in ("::ffff:93.184.216.34", "64:ff9b::5db8:d822", "2002:5db8:d822::1"):
        verdict = rules.check(text)
        assert verdict.rule == "address-deny 93.184.216.0/24", verdict
    # A range written IPv4-mapped is the IPv4 range it maps, as a mapped address is its IPv4 address.
    assert rules.check("::ffff:1.1.1.1").rule == "address-deny 1.1.1.0/24"
    assert rules.check("1.1.1.1").rule == "address-deny 1.1.1.0/24"


def test_allowing_a_wrapping_does_not_readmit_what_it_wraps() -> None:
    rules = AddressRules(allow=["64:ff9b::/96"])
    assert rules.check("64:ff9b::808:808").allowed
    inner = rules.check("64:ff9b::a00:1")
    assert not inner.allowed and inner.rule == "special-purpose 10.0.0.0/8" and "NAT64" in inner.reason
    assert not rules.check("64:ff9b::a9fe:a9fe").allowed


def test_labels_appear_in_rule() -> None:
    rules = AddressRules(allow=["198.18.0.0/15"], deny=["203.0.113.0/24", "10.0.0.1"],
                         allow_labels={"198.18.0.0/15": "policy.yaml:14"},
                         deny_labels={"203.0.113.0/24": "policy.yaml:20", "10.0.0.1": "policy.yaml:21"})
    assert rules.check("198.18.0.1").rule == "policy.yaml:14"
    assert rules.check("203.0.113.9").rule == "policy.yaml:20"
    assert rules.check("10.0.0.1").rule == "policy.yaml:21"
    assert rules.check("10.0.0.2").rule == "special-purpose 10.0.0.0/8"


def test_most_specific_rule_names_the_decision() -> None:
    rules = AddressRules(deny=["2001:4860::/32", "2001:4860:4860::/48", "2001:4860:4860::8888/128"],
                         deny_labels={"2001:4860:4860::/48": "policy.yaml:7"})
    assert rules.check("2001:4860:4860::8888").rule == "address-deny 2001:4860:4860::8888/128"
    assert rules.check("2001:4860:4860::8844").rule == "policy.yaml:7"
    assert rules.check("2001:4860:1::1").rule == "address-deny 2001:4860::/32"
    assert rules.check("2001:4861::1").rule == "global"


@pytest.mark.parametrize("cidr", [
    "10.0.0.1/8", "10.0.0.0/33", "10.0.0/8", "10.0.0.0/08", "10.0.0.0/", "010.0.0.0/8", "10.0.0.0/+8",
    "10.0.0.0/8/8", "fe80::/129", "fe80::1/10", "fe80::%eth0/10", "example.com", "", " 10.0.0.0/8",
])
def test_invalid_cidr_rejected_by_name(cidr: str) -> None:
    for kwargs in ({"allow": [cidr]}, {"deny": [cidr]}):
        with pytest.raises(ValueError) as info:
            AddressRules(**kwargs)
        assert repr(cidr) in str(info.value)


def test_host_bits_error_suggests_network() -> None:
    with pytest.raises(ValueError, match="did you mean 10.0.0.0/8"):
        AddressRules(allow=["10.0.0.1/8"])


def test_label_for_unknown_range_rejected() -> None:
    with pytest.raises(ValueError, match="not an allow rule"):
        AddressRules(allow=["198.18.0.0/15"], allow_labels={"10.0.0.0/8": "policy.yaml:3"})


# --- parsing -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", [
    "127.1", "0177.0.0.1", "0x7f.0.0.1", "2130706433", "010.0.0.1", "1.2.3.4.5", "fe80::1%eth0", "[::1]",
    " 1.2.3.4", "1.2.3.4 ", "1.2.3.4\n", "", "1.2.3.256", "1.2.3", "0x7f000001", "1..2.3", "::1::",
    "1:2:3:4:5:6:7:8:9", "1.2.3.4::", "12345::", "::ffff:01.2.3.4", ":1::", "1::2:", ":::",
    "1:2:3:4:5:6:7:8::", "g::1", "\u0661.1.1.1", "1.2.3.4/32", "localhost",
])
def test_parse_address_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_address(text)


@pytest.mark.parametrize("text, canonical", [
    ("0.0.0.0", "0.0.0.0"), ("255.255.255.255", "255.255.255.255"), ("8.8.8.8", "8.8.8.8"),
    ("::", "::"), ("::1", "::1"), ("2001:db8::1", "2001:db8::1"), ("2001:0DB8:0000::0001", "2001:db8::1"),
    ("::ffff:1.2.3.4", "::ffff:1.2.3.4"), ("::ffff:102:304", "::ffff:1.2.3.4"),
    ("1:2:3:4:5:6:7:8", "1:2:3:4:5:6:7:8"),
    ("1::", "1::"), ("fe80::1", "fe80::1"), ("1:2:3:4:5:6:1.2.3.4", "1:2:3:4:5:6:102:304"),
    ("::10.0.0.1", "::a00:1"), ("1:2:3:4:5:6:7::", "1:2:3:4:5:6:7:0"),
])
def test_parse_address_accepts_and_canonicalises(text: str, canonical: str) -> None:
    expected = ipaddress.ip_address(canonical)
    assert parse_address(text) == netaddr.IPAddress(int(expected), expected.version)
    assert DEFAULT.check(text).address == canonical


def test_check_accepts_address_objects() -> None:
    assert DEFAULT.check(netaddr.IPAddress("10.0.0.1")).rule == "special-purpose 10.0.0.0/8"
    assert DEFAULT.check(ipaddress.IPv4Address("8.8.8.8")).allowed
    assert DEFAULT.check(ipaddress.IPv6Address("::ffff:10.0.0.1")).address == "::ffff:10.0.0.1"
    with pytest.raises(ValueError):
        DEFAULT.check(ipaddress.IPv6Address("fe80::1%eth0"))
    with pytest.raises(ValueError):
        DEFAULT.check("127.1")
    with pytest.raises(TypeError):
        DEFAULT.check(2130706433)  # type: ignore[arg-type]


@given(st.integers(0, 2**32 - 1))
def test_parse_ipv4_round_trip(value: int) -> None:
    assert int(parse_address(str(ipaddress.IPv4Address(value)))) == value


@given(st.integers(0, 2**128 - 1))
def test_parse_ipv6_round_trip(value: int) -> None:
    address = ipaddress.IPv6Address(value)
    for text in (str(address), address.exploded, address.exploded.upper()):
        assert int(parse_address(text)) == value


@given(st.text(alphabet="0123456789abcdefx.:%[]/ ", max_size=24))
def test_parse_address_never_looser_than_ipaddress(text: str) -> None:
    # Differential: whatever we accept, Python's strict parser accepts as the same address.
    try:
        parsed = parse_address(text)
    except ValueError:
        return
    assert "%" not in text
    assert int(parsed) == int(ipaddress.ip_address(text))


# --- properties --------------------------------------------------------------------------------------

# ::ffff:0:0/96 is not refused as such: a mapped address is judged as the IPv4 inside it.
REFUSED_BLOCKS = [ipaddress.ip_network(b.cidr) for b in ALL_BLOCKS if b.cidr != "::ffff:0:0/96"]
REFUSED_BLOCKS += REFUSED_V4 + REFUSED_V6


@st.composite
def refused_addresses(draw: st.DrawFn) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    net = draw(st.sampled_from(REFUSED_BLOCKS))
    return ip(int(net[0]) + draw(st.integers(0, net.num_addresses - 1)), net.version)


@st.composite
def refused_ipv4(draw: st.DrawFn) -> ipaddress.IPv4Address:
    net = draw(st.sampled_from([n for n in REFUSED_BLOCKS if n.version == 4]))
    return ipaddress.IPv4Address(int(net[0]) + draw(st.integers(0, net.num_addresses - 1)))


@given(refused_addresses())
def test_refused_blocks_never_allowed(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> None:
    assert not DEFAULT.check(str(address)).allowed


@given(refused_ipv4(), st.sampled_from(sorted(wrappings(ipaddress.IPv4Address(0)))))
def test_wrapped_refused_ipv4_never_allowed(v4: ipaddress.IPv4Address, label: str) -> None:
    wrapped = wrappings(v4)[label]
    assert not DEFAULT.check(str(wrapped)).allowed
    # Allowing every wrapping prefix still does not let a refused IPv4 through.
    permissive = AddressRules(allow=["::/96", "64:ff9b::/96", "2002::/16", "2001::/32"])
    if label != "NAT64 (local-use)" and not (label == "IPv4-compatible" and int(v4) <= 1):
        assert not permissive.check(wrapped).allowed  # (::/96 as written does cover :: and ::1)


@given(st.one_of(
    st.integers(0, 2**32 - 1).map(ipaddress.IPv4Address),
    st.integers(0x2000 << 112, (0x4000 << 112) - 1).map(ipaddress.IPv6Address),
    st.integers(0, 2**32 - 1).map(lambda n: ipaddress.IPv6Address(0xFFFF << 32 | n)),
).filter(lambda address: not independently_refused(address)))
def test_global_addresses_never_refused(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> None:
    verdict = DEFAULT.check(str(address))
    assert verdict.allowed and verdict.rule == "global", verdict


# --- why not ipaddress.is_global ---------------------------------------------------------------------

def test_python_is_global_is_not_enough() -> None:
    # IANA itself marks 64:ff9b::/96 globally reachable, so is_global says True on every Python version,
    # yet this is NAT64 for 10.0.0.1: a way into private space through the translator.
    assert ipaddress.ip_address("64:ff9b::a00:1").is_global
    assert not DEFAULT.check("64:ff9b::a00:1").allowed
    # Others that depend on the Python version (multicast, 6to4 of private space, compatible forms):
    candidates = ("224.0.0.1", "2002:a00:1::", "::a00:1", "192.0.0.9", "64:ff9b::a9fe:a9fe")
    disagreements = [text for text in candidates
                     if ipaddress.ip_address(text).is_global and not DEFAULT.check(text).allowed]
    assert "64:ff9b::a9fe:a9fe" in disagreements


# --- address-rule edge cases: rules normalised as targets are --------------------------------------

def test_a_deny_written_ipv4_mapped_refuses_the_ipv4() -> None:
    rules = AddressRules(deny=["::ffff:8.8.8.8/128"])
    for text in ("8.8.8.8", "::ffff:8.8.8.8", "::ffff:808:808", "64:ff9b::808:808"):
        verdict = rules.check(text)
        assert not verdict.allowed and verdict.rule == "address-deny 8.8.8.8/32", (text, verdict)
        assert verdict.rule_id == "addresses.deny:8.8.8.8/32"
    assert rules.check("8.8.4.4").allowed


@pytest.mark.parametrize("written, normalised", [
    ("::ffff:8.8.8.8/128", "8.8.8.8/32"),
    ("::ffff:10.0.0.0/104", "10.0.0.0/8"),
    ("::ffff:0:0/96", "0.0.0.0/0"),
    ("::ffff:c0a8:0/112", "192.168.0.0/16"),
    ("::ffff:8.8.8.8", "8.8.8.8/32"),
    ("::/0", "::/0"),  # wider than the mapped range: it names IPv6 space and stays IPv6
    ("::ffff:0:0/95", None),  # host bits set
    ("2001:db8::/32", "2001:db8::/32"),
    ("10.0.0.0/8", "10.0.0.0/8"),
])
def test_parse_cidr_normalises_mapped_ranges(written: str, normalised: str | None) -> None:
    if normalised is None:
        with pytest.raises(ValueError, match="host bits are set"):
            parse_cidr(written)
    else:
        assert str(parse_cidr(written)) == normalised


@given(st.ip_addresses(v=4), st.integers(0, 32))
def test_a_mapped_range_is_its_ipv4_range(v4: ipaddress.IPv4Address, length: int) -> None:
    network = ipaddress.IPv4Network(f"{v4}/{length}", strict=False)
    mapped = f"::ffff:{network.network_address}/{96 + length}"
    assert str(parse_cidr(mapped)) == str(network)
    deny = AddressRules(deny=[mapped])
    assert not deny.check(str(v4)).allowed and not deny.check(f"::ffff:{v4}").allowed


@pytest.mark.parametrize("inner, readmit, allowed", [
    ("10.0.0.1", [], False),
    ("127.0.0.1", [], False),
    ("169.254.169.254", ["169.254.0.0/16"], False),  # metadata is never re-admitted by a range
    ("8.8.8.8", [], True),
    ("10.0.0.1", ["10.0.0.0/8"], True),  # the IPv4 inside is itself re-admitted
])
@pytest.mark.parametrize("length", [48, 56, 64, 96])
def test_local_use_nat64_is_judged_by_the_ipv4_at_the_prefixs_position(inner: str, readmit: list[str], allowed: bool,
                                                                        length: int) -> None:
    prefix = {48: "64:ff9b:1::/48", 56: "64:ff9b:1:ab00::/56", 64: "64:ff9b:1:abcd::/64",
              96: "64:ff9b:1:abcd:0:1::/96"}[length]
    wrapped = _rfc6052_embed(ipaddress.IPv4Address(inner), ipaddress.IPv6Network(prefix))
    assert str(rfc6052_ipv4(netaddr.IPAddress(str(wrapped)), length)) == inner
    rules = AddressRules(allow=[prefix, *readmit])
    verdict = rules.check(str(wrapped))
    assert verdict.allowed is allowed, verdict
    if not allowed:
        assert inner in verdict.reason and "local-use" in verdict.reason
    assert not DEFAULT.check(str(wrapped)).allowed  # without the allow: refused whole


def test_local_use_nat64_under_a_range_of_no_translator_length_stays_refused() -> None:
    wrapped = _rfc6052_embed(ipaddress.IPv4Address("8.8.8.8"), ipaddress.IPv6Network("64:ff9b:1::/96"))
    for allow in ("64:ff9b::/32", "::/0", "64:ff9b:1::/80", "64:ff9b:1::808:808/128"):
        verdict = AddressRules(allow=[allow]).check(str(wrapped))
        assert not verdict.allowed and verdict.rule == "special-purpose 64:ff9b:1::/48", (allow, verdict)
        assert "translator's prefix" in verdict.reason


def _rfc6052_embed(v4: ipaddress.IPv4Address, prefix: ipaddress.IPv6Network) -> ipaddress.IPv6Address:
    """RFC 6052, Section 2.2, written out by hand from its figure (independent of the module's table)."""
    octets = v4.packed
    out = bytearray(prefix.network_address.packed)
    positions = {32: [4, 5, 6, 7], 40: [5, 6, 7, 9], 48: [6, 7, 9, 10], 56: [7, 9, 10, 11], 64: [9, 10, 11, 12],
                 96: [12, 13, 14, 15]}[prefix.prefixlen]
    for position, octet in zip(positions, octets, strict=True):
        out[position] = octet
    return ipaddress.IPv6Address(bytes(out))


WRAP_PREFIXES = {
    "IPv4-compatible": "::/96", "NAT64": "64:ff9b::/96", "6to4": "2002::/16", "Teredo": "2001::/32",
}


@given(st.one_of(refused_ipv4(), st.ip_addresses(v=4)), st.sampled_from(sorted(WRAP_PREFIXES)))
def test_allowing_a_wrapping_prefix_readmits_only_what_its_ipv4_would_be(v4: ipaddress.IPv4Address,
                                                                          label: str) -> None:
    """Property: under an allow over a wrapping prefix, the wrapping of v4 passes exactly when v4 passes."""
    if label == "IPv4-compatible" and int(v4) <= 1:
        return  # :: and ::1 are blocks of their own
    rules = AddressRules(allow=[WRAP_PREFIXES[label]])
    assert rules.check(str(wrappings(v4)[label])).allowed == rules.check(str(v4)).allowed


@given(st.ip_addresses(v=4), st.sampled_from([48, 56, 64, 96]))
def test_local_use_nat64_allow_readmits_only_what_its_ipv4_would_be(v4: ipaddress.IPv4Address, length: int) -> None:
    prefix = ipaddress.IPv6Network(f"64:ff9b:1::/{length}")
    rules = AddressRules(allow=[str(prefix)])
    assert rules.check(str(_rfc6052_embed(v4, prefix))).allowed == rules.check(str(v4)).allowed


@pytest.mark.parametrize("address", ["169.254.0.23", "169.254.42.42", "169.254.169.254", "169.254.170.2"])
def test_allowing_link_local_does_not_readmit_metadata(address: str) -> None:
    rules = AddressRules(allow=["169.254.0.0/16"])
    verdict = rules.check(address)
    assert not verdict.allowed and verdict.rule == f"cloud-metadata {address}/32", verdict
    assert "no addresses.allow range re-admits it" in verdict.reason
    assert rules.check("169.254.1.1").allowed


def test_refusals_by_address_say_how_a_range_is_readmitted() -> None:
    for text, example in (("10.0.0.5", "10.0.0.5/32"), ("fd00::1", "fd00::1/128"), ("4000::1", "4000::1/128")):
        reason = DEFAULT.check(text).reason
        assert f"only an addresses.allow range re-admits it (e.g. {example})" in reason, reason
        assert "a host allow rule cannot" in reason
    assert "addresses.allow range over 64:ff9b::/96" in DEFAULT.check("64:ff9b::808:808").reason


# --- one unwrap of ::ffff: -------------------------------------------------------------------------

@given(st.ip_addresses(v=4))
def test_unwrap_mapped_gives_the_ipv4(v4: ipaddress.IPv4Address) -> None:
    for text in (f"::ffff:{v4}", str(ipaddress.IPv6Address(0xFFFF << 32 | int(v4))), f"0:0:0:0:0:FFFF:{v4}"):
        assert unwrap_mapped(text) == str(v4)
    assert unwrap_mapped(str(v4)) == str(v4)


@given(st.one_of(st.ip_addresses(v=6).filter(lambda a: a.ipv4_mapped is None).map(str), st.text(max_size=30)))
def test_unwrap_mapped_leaves_everything_else_alone(text: str) -> None:
    assert unwrap_mapped(text) == text


_ADDRESS_TEXTS = st.one_of(
    st.integers(0, 2**32 - 1).map(lambda n: str(ipaddress.IPv4Address(n))),
    st.integers(0, 2**128 - 1).map(lambda n: str(ipaddress.IPv6Address(n))),
    st.integers(0, 2**32 - 1).map(lambda n: f"::ffff:{ipaddress.IPv4Address(n)}"),
    st.sampled_from(["169.254.169.254", "fd00:ec2::254", "64:ff9b::a00:1", "2002:a00:1::1", "10.0.0.5"]),
)


_RULES = {"allow": ["198.18.0.0/15", "64:ff9b::/96"], "deny": ["203.0.113.0/24"]}
_WARM = AddressRules(**_RULES)


@given(_ADDRESS_TEXTS)
def test_remembered_verdicts_equal_fresh_ones(text: str) -> None:
    """check() remembers verdicts on address texts: the remembered answer equals a fresh rule set's,
    and the answer on the address object (never remembered)."""
    first = _WARM.check(text)
    assert _WARM.check(text) == first == AddressRules(**_RULES).check(text)
    assert AddressRules(**_RULES).check(netaddr.IPAddress(text)) == first


def test_remembered_verdicts_are_bounded() -> None:
    rules = AddressRules(**_RULES)
    before = rules.check("10.0.0.5")
    for n in range(CHECKED_CACHE_SIZE + 10):
        rules.check(str(ipaddress.IPv4Address(0x08000000 + n)))
    assert len(rules._checked) <= CHECKED_CACHE_SIZE
    assert rules.check("10.0.0.5") == before and not before.allowed


# --- the network's own NAT64 prefixes (addresses.nat64) and ISATAP ------------------------------------------

def _embed(prefix: str, ipv4: str) -> str:
    """RFC 6052, Section 2.2, written out for the test (the core reads it with rfc6052_ipv4): the IPv4's
    32 bits around the "u" octet (bits 64-71, zero) after a prefix of each length."""
    network, value = ipaddress.IPv6Network(prefix), int(ipaddress.IPv4Address(ipv4))
    length, base = network.prefixlen, int(network.network_address)
    if length == 96:
        return str(ipaddress.IPv6Address(base | value))
    before = 64 - length  # bits of the IPv4 that fit between the prefix and the u octet
    high, low = value >> (32 - before), value & ((1 << (32 - before)) - 1)
    return str(ipaddress.IPv6Address(base | (high << 64) | (low << (56 - (32 - before)))))


NAT64_PREFIXES = ["2001:db8:100::/40", "2a00:1::/32", "2a00:2:3::/48", "2a00:4:5:600::/56", "2a00:7:8:9::/64",
                  "2a00:a:b:c:d:e::/96", "64:ff9b::/96"]


@pytest.mark.parametrize("prefix", NAT64_PREFIXES)
@given(ipv4=st.integers(0, 2**32 - 1).map(lambda n: str(ipaddress.IPv4Address(n))))
def test_an_address_under_a_nat64_prefix_is_judged_as_the_ipv4_it_reaches(prefix: str, ipv4: str) -> None:
    rules = AddressRules(nat64=[prefix])
    wrapped = _embed(prefix, ipv4)
    inside, outside = rules.check(wrapped), rules.check(ipv4)
    assert (inside.allowed, inside.rule) == (outside.allowed, outside.rule), (wrapped, inside.reason)
    assert f"which reaches IPv4 {ipv4}" in inside.reason
    assert rules.embedded_ipv4s(wrapped) == (ipv4,)


def test_a_network_specific_nat64_prefix_is_global_ipv6_until_it_is_listed() -> None:
    internal = "2a00:1234:64::a00:1"  # 10.0.0.1 through a translator at 2a00:1234:64::/96
    assert AddressRules().check(internal).allowed  # nothing says it is a translator: global unicast
    listed = AddressRules(nat64=["2a00:1234:64::/96"]).check(internal)
    assert not listed.allowed and listed.rule == "special-purpose 10.0.0.0/8"
    metadata = AddressRules(nat64=["2a00:1234:64::/96"]).check("2a00:1234:64::a9fe:a9fe")
    assert not metadata.allowed and metadata.rule.startswith("cloud-metadata")
    # deny rules see both spellings; an allow range re-admits the IPv4 it reaches
    assert not AddressRules(deny=["2a00:1234:64::/96"], nat64=["2a00:1234:64::/96"]).check(
        "2a00:1234:64::808:808").allowed
    assert not AddressRules(deny=["8.8.8.8"], nat64=["2a00:1234:64::/96"]).check("2a00:1234:64::808:808").allowed
    assert AddressRules(allow=["10.0.0.0/8"], nat64=["2a00:1234:64::/96"]).check(internal).allowed


@pytest.mark.parametrize("text", ["2001:db8:64::/80", "10.0.0.0/8", "2001:db8::1/96", "nonsense",
                                  # blocks whose addresses mean something else (review round 19)
                                  "::ffff:0:0/96", "::/96", "2001::/32", "2002:808:808::/48", "fe80::/64",
                                  "ff02::/96"])
def test_a_nat64_prefix_must_be_an_ipv6_range_of_an_rfc6052_length(text: str) -> None:
    with pytest.raises(ValueError):
        AddressRules(nat64=[text])


@given(ipv4=st.integers(0, 2**32 - 1).map(lambda n: str(ipaddress.IPv4Address(n))),
       marker=st.sampled_from(["0:5efe", "200:5efe", "100:5efe", "300:5efe"]))
def test_an_isatap_address_passes_only_if_the_ipv4_it_carries_passes(ipv4: str, marker: str) -> None:
    address = f"2606:4700:10::{marker}:{ipv4}"  # a global /64 with an ISATAP interface identifier
    verdict, inside = AddressRules().check(address), AddressRules().check(ipv4)
    assert verdict.allowed == inside.allowed, (address, verdict.reason)
    if not inside.allowed:
        assert verdict.rule == inside.rule and "ISATAP" in verdict.reason
    assert ipv4 in AddressRules().embedded_ipv4s(address)


def test_an_interface_identifier_that_is_not_isatap_is_no_wrapping() -> None:
    for address in ("2606:4700:10::5eff:a00:1", "2606:4700:10::400:5efe:a00:1", "2606:4700:10::a00:1"):
        assert AddressRules().check(address).allowed, address
        assert AddressRules().embedded_ipv4s(address) == ()
