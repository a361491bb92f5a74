"""Address classification: may egresswall connect to this IP address?

Pure and sans-I/O. The tables below are written from the IANA IPv4 and IPv6 special-purpose address
registries (RFC 6890 as amended by RFC 8190). Every lookup structure is built once (with netaddr IPSet
arithmetic), at import or when an ``AddressRules`` is made; a check is then a few O(log n) bisects.

Python's ``ipaddress.is_global`` is not used: it calls multicast, NAT64 (64:ff9b::/96) and, in some
versions, 6to4 wrappings of private space "global", which would let a name that resolves to
``64:ff9b::a9fe:a9fe`` reach a NAT64 gateway's metadata service.
"""

import ipaddress
import re
import string
from bisect import bisect_right
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import netaddr

from . import rule_ids


@dataclass(frozen=True)
class AddressBlock:
    cidr: str
    name: str
    source: str


def _blocks(*rows: tuple[str, str, str]) -> tuple[AddressBlock, ...]:
    return tuple(AddressBlock(*row) for row in rows)


# Every block of the IANA IPv4 special-purpose registry whose "Globally Reachable" is not True, plus
# multicast (224/4, from the multicast registry: not unicast). 192.0.0.0/24 is refused whole, so its
# global sub-blocks 192.0.0.9/32 and 192.0.0.10/32 are refused too; 192.88.99.0/24 (terminated) likewise.
# AS112 (192.31.196/24, 192.175.48/24) and AMT (192.52.193/24) are globally reachable and stay allowed.
SPECIAL_PURPOSE_V4: tuple[AddressBlock, ...] = _blocks(
    ("0.0.0.0/8", '"This network"', "RFC 791, Section 3.2"),
    ("0.0.0.0/32", '"This host on this network"', "RFC 1122, Section 3.2.1.3"),
    ("10.0.0.0/8", "Private-Use", "RFC 1918"),
    ("100.64.0.0/10", "Shared Address Space", "RFC 6598"),
    ("127.0.0.0/8", "Loopback", "RFC 1122, Section 3.2.1.3"),
    ("169.254.0.0/16", "Link Local", "RFC 3927"),
    ("172.16.0.0/12", "Private-Use", "RFC 1918"),
    ("192.0.0.0/24", "IETF Protocol Assignments", "RFC 6890, Section 2.1"),
    ("192.0.0.0/29", "IPv4 Service Continuity Prefix", "RFC 7335"),
    ("192.0.0.8/32", "IPv4 dummy address", "RFC 7600"),
    ("192.0.0.170/32", "NAT64/DNS64 Discovery", "RFC 8880, RFC 7050 Section 2.2"),
    ("192.0.0.171/32", "NAT64/DNS64 Discovery", "RFC 8880, RFC 7050 Section 2.2"),
    ("192.0.2.0/24", "Documentation (TEST-NET-1)", "RFC 5737"),
    ("192.88.99.0/24", "Deprecated (6to4 Relay Anycast)", "RFC 7526"),
    ("192.88.99.2/32", "6a44-relay anycast address", "RFC 6751"),
    ("192.168.0.0/16", "Private-Use", "RFC 1918"),
    ("198.18.0.0/15", "Benchmarking", "RFC 2544"),
    ("198.51.100.0/24", "Documentation (TEST-NET-2)", "RFC 5737"),
    ("203.0.113.0/24", "Documentation (TEST-NET-3)", "RFC 5737"),
    ("224.0.0.0/4", "Multicast", "RFC 5771"),
    ("240.0.0.0/4", "Reserved", "RFC 1112, Section 4"),
    ("255.255.255.255/32", "Limited Broadcast", "RFC 8190, RFC 919 Section 7"),
)

# The same for IPv6, plus the deprecated IPv4-compatible ::/96, site-local fec0::/10 and multicast
# ff00::/8 (from the IPv6 address-space registry). 2001::/23 is refused whole, including the sub-blocks
# IANA marks global (PCP/TURN/DNS-SD anycast, AMT, AS112-v6, ORCHIDv2, DETs); only the non-global ones
# are named here so that reasons stay true. Anything else outside 2000::/3 is refused by check() itself.
SPECIAL_PURPOSE_V6: tuple[AddressBlock, ...] = _blocks(
    ("::/128", "Unspecified Address", "RFC 4291"),
    ("::1/128", "Loopback Address", "RFC 4291"),
    ("::/96", "IPv4-compatible Address (deprecated)", "RFC 4291, Section 2.5.5.1"),
    ("::ffff:0:0/96", "IPv4-mapped Address", "RFC 4291"),
    ("::ffff:0:0:0/96", "IPv4-translated Address (deprecated)", "RFC 2765, Section 2.1"),
    ("64:ff9b::/96", "IPv4-IPv6 Translat.", "RFC 6052"),
    ("64:ff9b:1::/48", "IPv4-IPv6 Translat.", "RFC 8215"),
    ("100::/64", "Discard-Only Address Block", "RFC 6666"),
    ("100:0:0:1::/64", "Dummy IPv6 Prefix", "RFC 9780"),
    ("2001::/23", "IETF Protocol Assignments", "RFC 2928"),
    ("2001::/32", "TEREDO", "RFC 4380, RFC 8190"),
    ("2001:2::/48", "Benchmarking", "RFC 5180, RFC Errata 1752"),
    ("2001:10::/28", "Deprecated (previously ORCHID)", "RFC 4843"),
    ("2001:db8::/32", "Documentation", "RFC 3849"),
    ("2002::/16", "6to4", "RFC 3056"),
    ("3fff::/20", "Documentation", "RFC 9637"),
    ("5f00::/16", "Segment Routing (SRv6) SIDs", "RFC 9602"),
    ("fc00::/7", "Unique-Local", "RFC 4193, RFC 8190"),
    ("fe80::/10", "Link-Local Unicast", "RFC 4291"),
    ("fec0::/10", "Site-Local (deprecated)", "RFC 3879"),
    ("ff00::/8", "Multicast", "RFC 4291"),
)

# Instance metadata and platform endpoints that hand out credentials or configuration. Refused by
# default even where the address is public (Azure's 168.63.129.16) and even when an operator allow rule
# covers them: an SSRF to one of these is the classic way out of a cloud VM. Several clouds share
# 169.254.169.254; each provider keeps its own entry so the reason can name them all.
CLOUD_METADATA: tuple[AddressBlock, ...] = _blocks(
    ("169.254.169.254/32", "AWS instance metadata", "AWS EC2 IMDS documentation"),
    ("fd00:ec2::254/128", "AWS instance metadata (IPv6)", "AWS EC2 IMDS documentation"),
    ("169.254.170.2/32", "AWS ECS task metadata and credentials", "AWS ECS documentation"),
    ("169.254.170.23/32", "AWS EKS Pod Identity Agent", "AWS EKS documentation"),
    ("fd00:ec2::23/128", "AWS EKS Pod Identity Agent (IPv6)", "AWS EKS documentation"),
    ("169.254.169.254/32", "GCP metadata server", "Google Compute Engine documentation"),
    ("fd20:ce::254/128", "GCP metadata server (IPv6)", "Google Compute Engine documentation"),
    ("169.254.169.254/32", "Azure Instance Metadata Service", "Azure documentation"),
    ("168.63.129.16/32", "Azure WireServer (platform virtual IP)", "Azure documentation"),
    ("169.254.169.254/32", "Oracle Cloud instance metadata", "OCI documentation"),
    ("192.0.0.192/32", "Oracle Cloud instance metadata (legacy)", "OCI documentation"),
    ("100.100.100.200/32", "Alibaba Cloud instance metadata", "Alibaba Cloud ECS documentation"),
    ("169.254.0.23/32", "Tencent Cloud instance metadata", "Tencent Cloud CVM documentation"),
    ("169.254.42.42/32", "Scaleway instance metadata", "Scaleway Instances documentation"),
    ("fd00:42::42/128", "Scaleway instance metadata (IPv6)", "Scaleway Instances documentation"),
)


@dataclass(frozen=True)
class AddressVerdict:
    allowed: bool
    address: str
    rule: str  # what decided, for a human: "special-purpose 10.0.0.0/8", "address-allow 198.18.0.0/15 (p.yaml:9)"
    reason: str
    rule_id: str = ""  # the same without a file position, stable across edits; "" means: the same as rule

    def __post_init__(self) -> None:
        if not self.rule_id:
            object.__setattr__(self, "rule_id", self.rule)


# --- parsing ---------------------------------------------------------------------------------------

_DECIMAL = re.compile(r"0|[1-9][0-9]{0,2}")  # ASCII only: \d would accept other scripts' digits
_HEX_GROUP = re.compile(r"[0-9A-Fa-f]{1,4}")


def _check_ipv4(text: str, whole: str) -> None:
    # inet_aton reads 127.1, 0177.0.0.1, 0x7f.0.0.1 and 2130706433 as loopback; a filter that parses
    # differently from the connecting code is a bypass, so only the one unambiguous form is accepted.
    parts = text.split(".")
    if len(parts) != 4:
        raise ValueError(f"{whole!r}: IPv4 needs exactly four dotted decimal parts (short forms are refused)")
    for part in parts:
        if not _DECIMAL.fullmatch(part):
            raise ValueError(f"{whole!r}: {part!r} is not a decimal 0-255 without leading zeros "
                             "(octal and hex forms are refused)")
        if int(part) > 255:
            raise ValueError(f"{whole!r}: {part!r} is greater than 255")


def _check_ipv6(text: str) -> None:
    if text.count("::") > 1:
        raise ValueError(f"{text!r}: '::' may appear only once")
    head, gap, tail = text.partition("::")
    groups = (head.split(":") if head else []) + (tail.split(":") if tail else [])
    width = 0
    for i, group in enumerate(groups):
        if "." in group and i == len(groups) - 1 and text.endswith(group):
            _check_ipv4(group, text)
            width += 2
        elif _HEX_GROUP.fullmatch(group):
            width += 1
        else:
            raise ValueError(f"{text!r}: {group!r} is not a group of 1-4 hex digits")
    if (gap and width > 7) or (not gap and width != 8):
        raise ValueError(f"{text!r}: an IPv6 address has eight 16-bit groups")


def _why_not_an_address(text: str) -> str:
    """For text with neither dots nor colons: 3232235777 and 0xc0a80101 are legacy spellings of IPv4 that
    inet_aton reads; anything else is simply not an address."""
    if text.isascii() and (text.isdigit() or (text[:2].lower() == "0x" and all(c in string.hexdigits
                                                                                for c in text[2:]))):
        return "bare numbers are a legacy IPv4 form and are refused"
    return "IPv4 is written with dots, IPv6 with colons"


def parse_address(text: str) -> netaddr.IPAddress:
    """Strict: dotted-quad IPv4 or RFC 4291 IPv6 text (no zone id, no brackets); ValueError otherwise."""
    if not isinstance(text, str):
        raise TypeError(f"expected the text of an address, got {type(text).__name__}")
    if not text:
        raise ValueError("empty address")
    if any(c.isspace() for c in text):
        raise ValueError(f"{text!r}: contains whitespace")
    if "[" in text or "]" in text:
        raise ValueError(f"{text!r}: brackets belong to URL syntax, not to the address")
    if "%" in text:
        raise ValueError(f"{text!r}: IPv6 zone ids are refused")
    if ":" in text:
        _check_ipv6(text)
        version = 6
    elif "." in text:
        _check_ipv4(text, text)
        version = 4
    else:
        raise ValueError(f"{text!r}: not an address ({_why_not_an_address(text)})")
    try:  # INET_PTON: the second, independent parser must agree with the checks above
        return netaddr.IPAddress(text, version, flags=netaddr.INET_PTON)
    except netaddr.AddrFormatError as err:
        raise ValueError(f"{text!r}: {err}") from None


def parse_cidr(text: str) -> netaddr.IPNetwork:
    """An operator's range (an address rule, a role's clients): ADDRESS or ADDRESS/LEN, strict; host bits
    set is an error, not a rounding. ValueError says what is wrong (without repeating the text).

    A range written inside ::ffff:0:0/96 is the IPv4 range it maps (``::ffff:10.0.0.0/104`` is
    ``10.0.0.0/8``), because an IPv4-mapped address is judged as its IPv4 address: a rule is normalised
    the way the addresses it is matched against are. A wider IPv6 range (``::/0``) stays IPv6: it names
    IPv6 space, and every IPv4 address is not what it means.
    """
    if not isinstance(text, str):
        raise ValueError(f"got {type(text).__name__}, not the text of a range")
    address_text, slash, length_text = text.partition("/")
    address = parse_address(address_text)
    width = 32 if address.version == 4 else 128
    if not slash:
        length = width
    elif _DECIMAL.fullmatch(length_text) and int(length_text) <= width:
        length = int(length_text)
    else:
        raise ValueError(f"prefix length must be a decimal 0-{width}")
    network = netaddr.IPNetwork(f"{address}/{length}")
    if network.ip != network.network:
        raise ValueError(f"host bits are set; did you mean {network.cidr}?")
    if network.version == 6 and length >= 96 and network.ip in _MAPPED:
        return netaddr.IPNetwork(f"{netaddr.IPAddress(_low32(int(network.ip)), 4)}/{length - 96}")
    return network.cidr


def _parse_range(text: str) -> netaddr.IPNetwork:
    try:
        return parse_cidr(text)
    except ValueError as err:
        raise ValueError(f"address range {text!r}: {err}") from None


def unwrap_mapped(text: str) -> str:
    """``::ffff:192.0.2.1`` (how a dual-stack socket reports an IPv4 peer) → ``192.0.2.1``; any other text
    unchanged. The one place the proxy and the decision turn a mapped address into the IPv4 it is."""
    if "ffff" not in text and "FFFF" not in text:
        return text
    try:
        mapped = ipaddress.IPv6Address(text).ipv4_mapped
    except ValueError:
        return text
    return str(mapped) if mapped is not None else text


def parse_client_address(text: str) -> str:
    """A client address given by hand (``check --client``): strict, IPv4-mapped unwrapped, canonical text."""
    try:
        address = parse_address(text)
    except (TypeError, ValueError) as err:
        raise ValueError(f"the client {text!r} is not an IP address ({err})") from None
    return unwrap_mapped(_text(address))


def cap_group(client: str) -> str:
    """What a per-client cap counts by: an IPv4 address itself; for IPv6, the /64 it is in.

    One IPv6 host is routinely given a whole /64 (SLAAC, privacy addresses, a container's prefix), so a
    client can pick a fresh address for every connection; counting by exact address would let it multiply
    its cap by 2**64. ``::1`` stays itself. Anything that is not an address (a session key) is unchanged."""
    if ":" not in client:
        return client
    try:
        address = ipaddress.IPv6Address(client.split("%", 1)[0])
    except ValueError:
        return client
    if address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    if address.is_loopback:
        return str(address)
    return str(ipaddress.IPv6Network((int(address) >> 64 << 64, 64)))


_MAPPED = netaddr.IPNetwork("::ffff:0:0/96")
_GLOBAL_UNICAST_V6 = netaddr.IPNetwork("2000::/3")


def _text(address: netaddr.IPAddress) -> str:
    """RFC 5952 text; dotted quad only for IPv4-mapped (netaddr also prints ::a00:1 as ::10.0.0.1)."""
    if address.version == 4:
        return str(address)
    if address in _MAPPED:
        return f"::ffff:{netaddr.IPAddress(int(address) & 0xFFFFFFFF, 4)}"
    return str(ipaddress.IPv6Address(int(address)))


def _as_address(address: object) -> netaddr.IPAddress:
    if isinstance(address, netaddr.IPAddress):
        return address
    if isinstance(address, str):
        return parse_address(address)
    if isinstance(address, ipaddress.IPv6Address) and address.scope_id:
        raise ValueError(f"{address}: IPv6 zone ids are refused")
    if isinstance(address, ipaddress.IPv4Address | ipaddress.IPv6Address):
        return netaddr.IPAddress(int(address), address.version)
    raise TypeError(f"expected an IP address, got {type(address).__name__}")


# --- lookup ----------------------------------------------------------------------------------------

class _MostSpecific[T]:
    """The value of the most specific CIDR holding an address, in O(log n).

    Built once with netaddr IPSet arithmetic: each CIDR minus the more specific CIDRs inside it becomes
    disjoint ranges. A lookup is then one bisect over their starts. (IPSet's own membership test walks up
    to 128 supernets, building an IPNetwork for each: about 100 times slower for IPv6.)
    """

    def __init__(self, entries: Iterable[tuple[netaddr.IPNetwork, T]]):
        covered = netaddr.IPSet()
        rows: list[tuple[tuple[int, int], int, T]] = []
        for network, value in sorted(entries, key=lambda entry: entry[0].prefixlen, reverse=True):
            for piece in (netaddr.IPSet([network]) - covered).iter_cidrs():
                rows.append(((piece.version, piece.first), piece.last, value))
            covered.add(network)
        rows.sort(key=lambda row: row[0])
        self._starts = [start for start, _, _ in rows]
        self._rows = rows

    def get(self, address: netaddr.IPAddress) -> T | None:
        i = bisect_right(self._starts, (address.version, int(address))) - 1
        if i < 0:
            return None
        (version, _), last, value = self._rows[i]
        return value if version == address.version and int(address) <= last else None


def _grouped(blocks: Iterable[AddressBlock]) -> list[tuple[netaddr.IPNetwork, tuple[AddressBlock, ...]]]:
    by_cidr: dict[str, tuple[AddressBlock, ...]] = {}
    for block in blocks:
        by_cidr[block.cidr] = by_cidr.get(block.cidr, ()) + (block,)
    return [(netaddr.IPNetwork(cidr), group) for cidr, group in by_cidr.items()]


_SPECIAL = _MostSpecific(_grouped(SPECIAL_PURPOSE_V4 + SPECIAL_PURPOSE_V6))
_CLOUD = _MostSpecific(_grouped(CLOUD_METADATA))


def _low32(value: int) -> int:
    return value & 0xFFFFFFFF


# Prefixes that carry IPv4 inside IPv6 and are refused whole: a connection to one reaches whatever IPv4
# the relay or translator derives, which this check cannot see. Where the IPv4 sits at a known position
# we extract it, to name it in the reason and to hold it against deny rules and the metadata set.
_WRAPPINGS: dict[str, tuple[str, Callable[[int], int] | None]] = {
    "::/96": ("IPv4-compatible", _low32),
    "::ffff:0:0:0/96": ("IPv4-translated", _low32),  # SIIT's spelling (RFC 2765): a translator reaches the IPv4
    "64:ff9b::/96": ("NAT64", _low32),
    "64:ff9b:1::/48": ("NAT64 (local-use)", None),  # RFC 6052 position depends on the local prefix length
    "2002::/16": ("6to4", lambda value: (value >> 80) & 0xFFFFFFFF),
    "2001::/32": ("Teredo", lambda value: _low32(value) ^ 0xFFFFFFFF),  # client address is obfuscated
}


def _wrapping(address: netaddr.IPAddress) -> tuple[AddressBlock, str, netaddr.IPAddress | None] | None:
    if address.version != 6 or int(address) <= 1:  # :: and ::1 are blocks of their own
        return None
    found = _SPECIAL.get(address)
    if found is None or found[0].cidr not in _WRAPPINGS:
        return None
    label, extract = _WRAPPINGS[found[0].cidr]
    embedded = netaddr.IPAddress(extract(int(address)), 4) if extract else None
    return found[0], label, embedded


def _describe(blocks: tuple[AddressBlock, ...]) -> str:
    if len(blocks) == 1:
        return f"{blocks[0].cidr} ({blocks[0].name}, {blocks[0].source})"
    return f"{blocks[0].cidr} ({'; '.join(block.name for block in blocks)})"


_LOCAL_NAT64 = netaddr.IPNetwork("64:ff9b:1::/48")
# RFC 6052, Section 2.2: where the 32 bits of IPv4 sit for each prefix length (bits 64-71 are the "u" octet,
# never part of the address). As (first bit, bit count) pairs, most significant part first.
_RFC6052_LAYOUT: dict[int, tuple[tuple[int, int], ...]] = {
    32: ((32, 32),), 40: ((40, 24), (72, 8)), 48: ((48, 16), (72, 16)),
    56: ((56, 8), (72, 24)), 64: ((72, 32),), 96: ((96, 32),),
}


def rfc6052_ipv4(address: netaddr.IPAddress, prefix_length: int) -> netaddr.IPAddress:
    """The IPv4 address embedded in an IPv4-embedded IPv6 address under a translator prefix of this length."""
    value, out = int(address), 0
    for first, count in _RFC6052_LAYOUT[prefix_length]:
        out = (out << count) | ((value >> (128 - first - count)) & ((1 << count) - 1))
    return netaddr.IPAddress(out, 4)


NAT64_PREFIX_LENGTHS = tuple(sorted(_RFC6052_LAYOUT))
# RFC 5214: an ISATAP interface identifier is 0000:5efe or 0200:5efe (the u and g bits may be set) and then
# an IPv4 address, under any /64, global ones included: a router of that prefix that speaks ISATAP sends the
# packet on inside IPv4 to that address. The IPv4 must pass on its own.
_ISATAP_MASK, _ISATAP = 0xFCFFFFFF, 0x00005EFE


def isatap_ipv4(address: netaddr.IPAddress) -> netaddr.IPAddress | None:
    """The IPv4 an IPv6 address's ISATAP interface identifier carries (RFC 5214), or None."""
    value = int(address)
    if address.version != 6 or (value >> 32) & _ISATAP_MASK != _ISATAP:
        return None
    return netaddr.IPAddress(_low32(value), 4)


# Where no NAT64 translator's prefix can be: blocks whose addresses already mean something else (another
# wrapping of IPv4, link-local, multicast), which listing as a translator would re-read as IPv4 (review round 19).
_NOT_NAT64 = (("::/96", "IPv4-compatible addresses"), ("::ffff:0:0:0/96", "IPv4-translated addresses"),
              ("2002::/16", "6to4"), ("2001::/32", "Teredo"),
              ("fe80::/10", "link-local"), ("ff00::/8", "multicast"))


def parse_nat64_prefix(text: str) -> netaddr.IPNetwork:
    """A NAT64 translator's prefix (``addresses.nat64``): IPv6, of a length RFC 6052 defines, outside the blocks
    whose addresses mean something else. ValueError says what is wrong."""
    network = parse_cidr(text)
    if network.version == 4 and isinstance(text, str) and ":" in text:
        raise ValueError("the IPv4-mapped range ::ffff:0:0/96 is no NAT64 prefix (an address there is its IPv4 "
                         "already)")
    if network.version != 6 or network.prefixlen not in _RFC6052_LAYOUT:
        lengths = ", ".join(f"/{n}" for n in NAT64_PREFIX_LENGTHS)
        raise ValueError(f"a NAT64 prefix is an IPv6 range of length {lengths} (RFC 6052)")
    for cidr, what in _NOT_NAT64:
        block = netaddr.IPNetwork(cidr)
        if network in block or block in network:
            raise ValueError(f"{network} is in {cidr} ({what}), which no NAT64 translator's prefix can be")
    return network


def _hint(address: netaddr.IPAddress) -> str:
    """How an operator who does mean to reach this address lets it through (and what does not)."""
    one = "32" if address.version == 4 else "128"
    return (f"; only an addresses.allow range re-admits it (e.g. {_text(address)}/{one}), "
            "a host allow rule cannot")


# --- rules -----------------------------------------------------------------------------------------

CHECKED_CACHE_SIZE = 4096  # remembered verdicts per rule set; emptied whole when full

class AddressRules:
    """Special-purpose and metadata refusals, plus the operator's explicit address-range rules.

    ``allow_labels`` / ``deny_labels`` map a range (as written) to the text that names its rule for a
    human (``address-allow 198.18.0.0/15 (policy.yaml:9)``); a verdict's ``rule_id`` is always the stable
    ``addresses.allow:198.18.0.0/15``, whatever the label.
    """

    def __init__(self, allow: Iterable[str] = (), deny: Iterable[str] = (),
                 refuse_cloud_metadata: bool = True,
                 allow_labels: Mapping[str, str] | None = None, deny_labels: Mapping[str, str] | None = None,
                 nat64: Iterable[str] = (), nat64_labels: Mapping[str, str] | None = None):
        self.refuse_cloud_metadata = refuse_cloud_metadata
        self._checked: dict[str, AddressVerdict] = {}
        # The network's own NAT64 translators (a network-specific prefix such as 2001:db8:64::/96, or the
        # well-known one): an address inside is the IPv4 it reaches, judged as that IPv4.
        if isinstance(nat64, str):
            raise TypeError("NAT64 prefixes must be a list of ranges, not one string")
        labels = nat64_labels or {}
        translators = [(parse_nat64_prefix(text), labels.get(text, "addresses.nat64")) for text in nat64]
        self.nat64_prefixes = tuple(str(network) for network, _ in translators)
        self._nat64 = _MostSpecific((network, (network, label)) for network, label in translators)
        self._allow = self._rules("allow", allow, allow_labels or {}, self.through_nat64)
        self._deny = self._rules("deny", deny, deny_labels or {}, self.through_nat64)

    def through_nat64(self, network: netaddr.IPNetwork) -> netaddr.IPNetwork:
        """A range written inside one of the network's NAT64 prefixes is the IPv4 range it reaches, as one written
        inside ::ffff:0:0/96 is the IPv4 range it maps (``parse_cidr``): a deny rule on one translator's spelling
        refuses the IPv4 itself and its other spellings (review round 19). Under a /96 prefix any range of /96
        or longer maps; under a shorter one (whose IPv4 is split around the "u" octet, RFC 6052) one address does,
        and a wider range stays the IPv6 range written."""
        translator = self._nat64_of(network.ip) if network.version == 6 else None
        if translator is None or network.prefixlen < translator[0].prefixlen:
            return network
        prefix_length = translator[0].prefixlen
        if prefix_length == 96:
            return netaddr.IPNetwork(f"{netaddr.IPAddress(_low32(int(network.ip)), 4)}/{network.prefixlen - 96}")
        if network.prefixlen == 128:
            return netaddr.IPNetwork(f"{rfc6052_ipv4(network.ip, prefix_length)}/32")
        return network

    @staticmethod
    def _rules(action: str, cidrs: Iterable[str], labels: Mapping[str, str],
               normalised: Callable[[netaddr.IPNetwork], netaddr.IPNetwork]
               ) -> _MostSpecific[tuple[netaddr.IPNetwork, str, str]]:
        if isinstance(cidrs, str):
            raise TypeError(f"address {action} rules must be a list of ranges, not one string")
        rule_texts: dict[netaddr.IPNetwork, str] = {}
        for text in cidrs:
            network = normalised(_parse_range(text))
            rule_texts.setdefault(network, f"address-{action} {network}")
        for text, label in labels.items():
            network = normalised(_parse_range(text))
            if network not in rule_texts:
                raise ValueError(f"label {label!r} names address range {text!r}, "
                                 f"which is not an {action} rule")
            rule_texts[network] = label
        return _MostSpecific((network, (network, rule, rule_ids.address_rule(action, network)))
                             for network, rule in rule_texts.items())

    def check(self, address: str | netaddr.IPAddress | ipaddress.IPv4Address | ipaddress.IPv6Address
              ) -> AddressVerdict:
        """The verdict on one address. A verdict depends only on the rules and the address as given,
        so verdicts on address texts are remembered (bounded): a browser asks about the same few
        addresses over and over, and every tunnel checks its pin twice (decision and connect guard)."""
        if not isinstance(address, str):
            return self._check(address)
        known = self._checked.get(address)
        if known is None:
            known = self._check(address)
            if len(self._checked) >= CHECKED_CACHE_SIZE:
                self._checked.clear()  # bounded: a flood of distinct addresses cannot grow memory
            self._checked[address] = known
        return known

    def _check(self, address: str | netaddr.IPAddress | ipaddress.IPv4Address | ipaddress.IPv6Address
               ) -> AddressVerdict:
        given = _as_address(address)
        text = _text(given)

        def verdict(allowed: bool, rule: str, reason: str, rule_id: str = "") -> AddressVerdict:
            return AddressVerdict(allowed, text, rule, reason, rule_id)

        # 1. An IPv4-mapped address is the IPv4 address: judge that. So is an address under one of the
        # network's NAT64 prefixes: the translator connects to the IPv4 inside.
        judged, preface = given, ""
        if given.version == 6 and given in _MAPPED:
            judged = netaddr.IPAddress(_low32(int(given)), 4)
            preface = f"{text} is IPv4-mapped (::ffff:0:0/96, RFC 4291) {judged}; "
        elif given.version == 6 and (translator := self._nat64_of(given)) is not None:
            network, label = translator
            judged = rfc6052_ipv4(given, network.prefixlen)
            preface = f"{text} is in the NAT64 prefix {network} ({label}), which reaches IPv4 {judged}; "
        wrapped = _wrapping(judged)
        isatap = isatap_ipv4(judged) if judged.version == 6 else None
        shown = _text(judged)

        # Deny rules and the metadata set also see the IPv6 text of a mapped address and the IPv4
        # inside a wrapping: a refusal must not be dodged by spelling the address another way.
        candidates = [(judged, preface)]
        if judged is not given:
            candidates.append((given, ""))
        if wrapped and wrapped[2] is not None:
            block, label, inner = wrapped
            candidates.append((inner, f"{text} is the {label} wrapping ({block.cidr}) of IPv4 {inner}; "))
        if isatap is not None:
            candidates.append((isatap, f"{text} carries IPv4 {isatap} in its ISATAP interface identifier "
                                       "(RFC 5214); "))

        # 2. Operator deny rules; deny beats allow.
        for candidate, note in candidates:
            denied = self._deny.get(candidate)
            if denied is not None:
                network, rule, rule_id = denied
                return verdict(False, rule,
                               f"{note}{_text(candidate)} is in {network}, which the policy denies ({rule})", rule_id)

        # 3. Cloud metadata: no allow rule re-admits it, only refuse_cloud_metadata=False.
        if self.refuse_cloud_metadata:
            for candidate, note in candidates:
                found = _CLOUD.get(candidate)
                if found is not None:
                    return verdict(False, f"cloud-metadata {found[0].cidr}",
                                   f"{note}{_text(candidate)} is in {_describe(found)}, a cloud metadata "
                                   "endpoint refused by default (no addresses.allow range re-admits it while "
                                   "addresses.refuse_cloud_metadata is true)")

        # An ISATAP address reaches its IPv4 through the prefix's router: that IPv4 must pass on its own.
        if isatap is not None:
            inside = self.check(isatap)
            if not inside.allowed:
                return verdict(False, inside.rule, f"{text} carries IPv4 {isatap} in its ISATAP interface "
                                                   f"identifier (RFC 5214), which a router of its prefix may "
                                                   f"reach: {inside.reason}", inside.rule_id)

        # 4. Operator allow rules: the only way a non-global address is accepted. Re-admitting a wrapping
        # prefix does not re-admit the IPv4 inside it: that IPv4 must pass on its own.
        special = _SPECIAL.get(judged)
        allowed = self._allow.get(judged)
        unnamed = ""
        if allowed is not None and judged.version == 6 and int(judged) <= 1 and allowed[0].prefixlen != 128:
            # :: and ::1 sit inside ::/96, and a range written to re-admit IPv4-compatible addresses (whose IPv4
            # must pass on its own, and 0.0.0.0 and 0.0.0.1 do not) or a wider one must not re-admit this host
            # and its loopback by the way: only naming the address itself does (review round 22).
            unnamed = f" (the policy allows {allowed[0]}, which covers it, but only {shown}/128 itself re-admits it)"
            allowed = None
        if allowed is not None:
            network, rule, rule_id = allowed
            if wrapped:
                refusal = self._wrapped_refusal(wrapped, judged, network, rule, rule_id)
                if refusal is not None:
                    return verdict(False, *refusal)
            if special is not None:
                return verdict(True, rule, f"{preface}{shown} is in {_describe(special)}, which is not "
                                           f"global unicast, but the policy re-admits {network} ({rule})", rule_id)
            return verdict(True, rule, f"{preface}{shown} is in {network}, which the policy allows ({rule})", rule_id)

        # 5. IPv4 wrapped in IPv6 is refused whole: the IPv4 it reaches is chosen by a relay or translator.
        if wrapped:
            block, label, inner = wrapped
            carried = f"IPv4 {inner}" if inner is not None else "an IPv4 address"
            return verdict(False, f"special-purpose {block.cidr}",
                           f"{shown} is in {_describe(special)}: the {label} wrapping of {carried}, "
                           f"which is refused whole (an addresses.allow range over {block.cidr} re-admits "
                           "it only when the IPv4 inside passes too)")

        # 6. Every other block that is not global unicast.
        if special is not None:
            return verdict(False, f"special-purpose {special[0].cidr}",
                           f"{preface}{shown} is in {_describe(special)}, which is not global unicast{unnamed}"
                           + _hint(judged))
        if judged.version == 6 and judged not in _GLOBAL_UNICAST_V6:
            return verdict(False, "outside-global-unicast 2000::/3",
                           f"{shown} is outside 2000::/3 global unicast (RFC 4291, Section 2.4)" + _hint(judged))

        # 7.
        return verdict(True, "global", f"{preface}{shown} is global unicast (in no special-purpose block)")

    def embedded_ipv4s(self, address: str | netaddr.IPAddress) -> tuple[str, ...]:
        """Every IPv4 an IPv6 address carries, as text, where its place is known (the network's NAT64 prefixes,
        IPv4-compatible, NAT64, 6to4, Teredo, an ISATAP interface identifier; local-use NAT64 under a translator
        prefix the policy re-admits); () for any other address. An ISATAP identifier under a 6to4 or Teredo
        prefix carries two (review round 19: the ISATAP one was missed there). Host deny rules are held against
        each (policy/decision.py), as address deny rules are: an IPv4 literal denied by name must not be reached
        by writing it as a wrapping the policy re-admits."""
        given = _as_address(address)
        if given.version != 6:
            return ()
        translator = self._nat64_of(given)
        if translator is not None:
            return (_text(rfc6052_ipv4(given, translator[0].prefixlen)),)
        found: list[netaddr.IPAddress] = []
        wrapped = _wrapping(given)
        if wrapped is not None:
            inner = wrapped[2]
            if inner is None:  # local-use NAT64: where the IPv4 sits depends on the translator prefix re-admitted
                allowed = self._allow.get(given)
                network = allowed[0] if allowed is not None else None
                if network is not None and network.prefixlen in _RFC6052_LAYOUT and network in _LOCAL_NAT64:
                    inner = rfc6052_ipv4(given, network.prefixlen)
            if inner is not None:
                found.append(inner)
        isatap = isatap_ipv4(given)
        if isatap is not None:
            found.append(isatap)
        return tuple(dict.fromkeys(_text(inner) for inner in found))

    def _nat64_of(self, address: netaddr.IPAddress) -> tuple[netaddr.IPNetwork, str] | None:
        """(prefix, its label) of the network's NAT64 translator whose prefix holds this address, or None."""
        return self._nat64.get(address) if self.nat64_prefixes else None

    def _wrapped_refusal(self, wrapped: tuple[AddressBlock, str, netaddr.IPAddress | None],
                         address: netaddr.IPAddress, network: netaddr.IPNetwork, rule: str, rule_id: str
                         ) -> tuple[str, str, str] | None:
        """An allow range covers a wrapping of IPv4: the IPv4 inside must pass too. (rule, reason, rule_id)
        of the refusal, or None when it passes."""
        block, label, inner = wrapped
        shown = _text(address)
        if inner is None:
            # Local-use NAT64 puts the IPv4 where the translator's prefix length says (RFC 6052). The
            # re-admitting range is that prefix; a range of another length leaves the IPv4 unknown.
            if network.prefixlen not in _RFC6052_LAYOUT or network not in _LOCAL_NAT64:
                return (f"special-purpose {block.cidr}",
                        f"{shown} is in {network}, which the policy allows ({rule}), but it is {label} "
                        f"({block.cidr}), where the IPv4 inside sits where the translator's prefix length puts "
                        "it (RFC 6052); re-admit the translator's prefix itself (a /48, /56, /64 or /96 inside "
                        f"{block.cidr}) so that the IPv4 can be checked", "")
            inner = rfc6052_ipv4(address, network.prefixlen)
            label = f"{label}, read as the /{network.prefixlen} translator prefix {network}"
        inside = self.check(inner)
        if inside.allowed:
            return None
        return (inside.rule, f"{shown} is in {network}, which the policy allows ({rule}), but it is the "
                             f"{label} wrapping ({block.cidr}) of IPv4 {inner}; {inside.reason}", inside.rule_id)
