"""squid's ACL types, and what each says about one request class (a ``Probe``).

An ACL answers True, False or None. None means *undecided*: the answer depends on something egresswall
cannot see or express (a URL regex, a user name, a time of day, which of several addresses a name
has...). The program evaluation keeps both possibilities open, and the importer admits a request
class only when squid allows it whichever way the undecided ACLs go — that is where egresswall is
stricter, and each such ACL is reported.

Matching follows squid 5, measured against the Debian package: request hosts are compared in lower
case without their trailing dot; a dstdomain value ``.example.com`` matches the name and every name
below it, ``example.com`` only the name; a value written with a trailing dot never matches (squid strips
the request's dot, not the value's); an IPv6 URL host is compared as ``[::1]``; IPv4-mapped IPv6
literals are unwrapped; ``dst`` matches when any address of the name is listed.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass

import netaddr

from .report import NOTE, Note, Where

Tri = bool | None  # True, False, or None: undecided

ALL_V4 = netaddr.IPNetwork("0.0.0.0/0")
ALL_V6 = netaddr.IPNetwork("::/0")

# Request classes. squid's ``proto`` of a CONNECT is NONE (measured: squid 5.7).
CONNECT, HTTP, HTTPS = "connect", "http", "https"
PROTO_OF_KIND = {CONNECT: "NONE", HTTP: "HTTP", HTTPS: "HTTPS"}

# Regions of the host space a probe stands for (see ``space``).
EXACT, BELOW, REST, IP_ANY = "exact", "below", "rest", "ip-any"


def t_and(values: Iterable[Tri]) -> Tri:
    undecided = False
    for value in values:
        if value is False:
            return False
        if value is None:
            undecided = True
    return None if undecided else True


def t_or(values: Iterable[Tri]) -> Tri:
    undecided = False
    for value in values:
        if value is True:
            return True
        if value is None:
            undecided = True
    return None if undecided else False


def t_not(value: Tri) -> Tri:
    return None if value is None else not value


@dataclass(frozen=True)
class HostRef:
    """The host of a probe: a representative of a region of hosts."""

    region: str  # EXACT: one host; BELOW: names below an anchor; REST: names under no anchor; IP_ANY
    name: str  # normalised name or canonical IP text ("" for IP_ANY)
    ip: netaddr.IPAddress | None = None

    @property
    def squid_text(self) -> str:
        """The host as squid compares it in dstdomain and dstdom_regex: IPv6 in brackets."""
        if self.ip is not None and self.ip.version == 6:
            return f"[{self.name}]"
        return self.name


@dataclass(frozen=True)
class Probe:
    client: netaddr.IPAddress
    kind: str  # CONNECT, HTTP (plain http/ws request) or HTTPS (absolute-form https request)
    method: str
    port: int
    host: HostRef


@dataclass
class Context:
    acls: dict[str, Acl]
    admissible: netaddr.IPSet  # addresses egresswall's address rules let through
    resolved: tuple[netaddr.IPAddress, ...] | None = None  # a concrete request's answers (tests), else unknown


class Acl:
    """One named ACL; repeated ``acl`` lines with the same name add values (ORed)."""

    type: str = ""
    host_dependent = False  # its answer depends on the request's host name (dstdomain, dstdom_regex)

    def __init__(self, name: str, type_: str) -> None:
        self.name = name
        self.type = type_
        self.wheres: list[Where] = []
        self.undecided_because: str | None = None  # set when a value could not be understood
        self.used = False

    def add(self, flags: list[str], values: list[tuple[str, Where]], notes: list[Note]) -> None:
        raise NotImplementedError

    def evaluate(self, probe: Probe, ctx: Context) -> Tri:
        if self.undecided_because is not None:
            return None
        return self._evaluate(probe, ctx)

    def _evaluate(self, probe: Probe, ctx: Context) -> Tri:
        raise NotImplementedError

    def undecide(self, where: Where, reason: str, notes: list[Note]) -> None:
        if self.undecided_because is None:
            self.undecided_because = reason
        notes.append(Note(where, f"acl {self.name} ({self.type}): {reason}", "untranslatable-acl"))

    @property
    def where(self) -> Where:
        return self.wheres[0] if self.wheres else Where("?")


# ---- addresses -------------------------------------------------------------------------------------

_DOTTED_MASK = re.compile(r"^(\d+)\.(\d+)\.(\d+)\.(\d+)$")


def parse_squid_address(text: str) -> netaddr.IPSet:
    """squid's address syntax: ``all``, an address, ``addr/len``, ``addr/dotted-mask``, ``a1-a2``."""
    if text == "all":
        return netaddr.IPSet([ALL_V4, ALL_V6])
    text = text.strip("[]") if text.startswith("[") and "]" in text and "/" not in text else text
    if "-" in text and "/" not in text:
        first, last = text.split("-", 1)
        return netaddr.IPSet(netaddr.IPRange(parse_ip(first), parse_ip(last)))
    address, slash, mask = text.partition("/")
    ip = parse_ip(address.strip("[]"))
    if not slash:
        return netaddr.IPSet([ip])
    if _DOTTED_MASK.match(mask):
        prefix = netaddr.IPAddress(mask).netmask_bits()
    elif mask.isdigit():
        prefix = int(mask)
    else:
        raise ValueError(f"{text!r}: the mask {mask!r} is neither a prefix length nor a dotted mask")
    width = 32 if ip.version == 4 else 128
    if prefix > width:
        raise ValueError(f"{text!r}: prefix length {prefix} is longer than {width}")
    return netaddr.IPSet([netaddr.IPNetwork(f"{ip}/{prefix}").cidr])


MAPPED = netaddr.IPNetwork("::ffff:0:0/96")


def with_mapped_ipv4(addresses: netaddr.IPSet) -> netaddr.IPSet:
    """squid keeps IPv4 addresses as IPv4-mapped IPv6: a range covering part of ::ffff:0:0/96 (::/0,
    say) matches those IPv4 addresses too. Add them, as the IPv4 they are."""
    inside = addresses & netaddr.IPSet([MAPPED])
    out = netaddr.IPSet(addresses)
    for network in inside.iter_cidrs():
        out.add(netaddr.IPNetwork(f"{netaddr.IPAddress(network.first & 0xFFFFFFFF, 4)}/{network.prefixlen - 96}"))
    return out


def ip_text(address: netaddr.IPAddress) -> str:
    """Canonical text, as egresswall writes hosts (RFC 5952; netaddr would write ::a00:1 as ::10.0.0.1)."""
    return str(ipaddress.ip_address(int(address))) if address.version == 4 else str(
        ipaddress.IPv6Address(int(address)))


def parse_ip(text: str, unwrap: bool = False) -> netaddr.IPAddress:
    try:
        if ":" in text:
            address = netaddr.IPAddress(text, 6, flags=netaddr.INET_PTON)
            return address.ipv4() if unwrap and address.is_ipv4_mapped() else address
        return netaddr.IPAddress(text, 4, flags=netaddr.INET_PTON)
    except (ValueError, netaddr.AddrFormatError):
        raise ValueError(f"{text!r} is not an IP address") from None


class AddressAcl(Acl):
    """``src`` and ``dst``: address ranges; names among the values are resolved by squid at startup,
    which a translation cannot repeat, so they leave the ACL undecided where the ranges do not decide."""

    def __init__(self, name: str, type_: str) -> None:
        super().__init__(name, type_)
        self.addresses = netaddr.IPSet()
        self.names: list[tuple[str, Where]] = []
        self.no_lookup = False
        self._relative: dict[int, Tri] = {}

    def add(self, flags: list[str], values: list[tuple[str, Where]], notes: list[Note]) -> None:
        self.no_lookup = self.no_lookup or "-n" in flags
        for value, where in values:
            try:
                self.addresses |= with_mapped_ipv4(parse_squid_address(value))
            except ValueError as err:
                if re.fullmatch(r"[A-Za-z0-9.-]+", value) and not value.replace(".", "").isdigit():
                    self.names.append((value, where))
                    notes.append(Note(where, f"acl {self.name} {self.type} {value}: squid resolves names in "
                                             f"{self.type} ACLs once, at startup; the translation cannot, so the "
                                             "ACL is undecided for addresses it does not list",
                                      "untranslatable-acl"))
                else:
                    self.undecide(where, f"{value!r} is not an address or range ({err})", notes)

    def relative_to(self, admissible: netaddr.IPSet) -> Tri:
        """For a request whose every address is admissible: True when every admissible address is
        listed, False when none is, None otherwise (squid's 'any answer listed' then depends on which
        answers the name has)."""
        key = id(admissible)
        if key not in self._relative:
            common = admissible & self.addresses
            if not common:
                value: Tri = None if self.names else False
            elif common == admissible:
                value = True
            else:
                value = None
            self._relative[key] = value
        return self._relative[key]


class SrcAcl(AddressAcl):
    def _evaluate(self, probe: Probe, ctx: Context) -> Tri:
        if probe.client in self.addresses:
            return True
        return None if self.names else False


class DstAcl(AddressAcl):
    def _evaluate(self, probe: Probe, ctx: Context) -> Tri:
        host = probe.host
        if host.ip is not None:  # an IP-literal URL: the one address is known
            if host.ip in self.addresses:
                return True
            return None if self.names else False
        if self.no_lookup and host.region != IP_ANY:
            return False  # -n: squid does not resolve the URL's name, so a name never matches
        if ctx.resolved is not None:
            return any(address in self.addresses for address in ctx.resolved) or (None if self.names else False)
        return self.relative_to(ctx.admissible)


# ---- the rest of the request -----------------------------------------------------------------------

class PortAcl(Acl):
    def __init__(self, name: str, type_: str) -> None:
        super().__init__(name, type_)
        self.ranges: list[tuple[int, int]] = []

    def add(self, flags: list[str], values: list[tuple[str, Where]], notes: list[Note]) -> None:
        for value, where in values:
            match = re.fullmatch(r"(\d+)(?:-(\d+))?", value)
            if not match:
                self.undecide(where, f"{value!r} is not a port or port range", notes)
                continue
            low, high = int(match.group(1)), int(match.group(2) or match.group(1))
            if low > high or high > 65535:
                self.undecide(where, f"{value!r} is not a valid port range", notes)
                continue
            self.ranges.append((low, high))

    def boundaries(self) -> Iterable[int]:
        for low, high in self.ranges:
            yield low
            yield high + 1

    def _evaluate(self, probe: Probe, ctx: Context) -> Tri:
        return any(low <= probe.port <= high for low, high in self.ranges)


class MethodAcl(Acl):
    def __init__(self, name: str, type_: str) -> None:
        super().__init__(name, type_)
        self.methods: set[str] = set()

    def add(self, flags: list[str], values: list[tuple[str, Where]], notes: list[Note]) -> None:
        for value, where in values:
            if value != value.upper():
                notes.append(Note(where, f"acl {self.name} method {value}: squid compares methods case-sensitively; "
                                         f"{value!r} only matches a request whose method is written that way",
                                  "method", NOTE))
            self.methods.add(value)

    def _evaluate(self, probe: Probe, ctx: Context) -> Tri:
        return probe.method in self.methods


class ProtoAcl(Acl):
    def __init__(self, name: str, type_: str) -> None:
        super().__init__(name, type_)
        self.protocols: set[str] = set()

    def add(self, flags: list[str], values: list[tuple[str, Where]], notes: list[Note]) -> None:
        self.protocols.update(value.upper() for value, _ in values)

    def _evaluate(self, probe: Probe, ctx: Context) -> Tri:
        return PROTO_OF_KIND[probe.kind] in self.protocols


class GroupAcl(Acl):
    """``any-of`` / ``all-of``: other ACLs combined."""

    def __init__(self, name: str, type_: str) -> None:
        super().__init__(name, type_)
        self.groups: list[list[str]] = []  # each acl line is one group; lines are ORed
        self._busy = False

    def add(self, flags: list[str], values: list[tuple[str, Where]], notes: list[Note]) -> None:
        self.groups.append([value for value, _ in values])

    def _evaluate(self, probe: Probe, ctx: Context) -> Tri:
        if self._busy:
            return None  # a cycle: squid refuses it at startup; undecided here
        self._busy = True
        try:
            combine = t_or if self.type == "any-of" else t_and
            return t_or(combine(_lookup(ctx, name, probe) for name in group) for group in self.groups)
        finally:
            self._busy = False

    def members(self) -> Iterable[str]:
        for group in self.groups:
            yield from group


def _lookup(ctx: Context, name: str, probe: Probe) -> Tri:
    acl = ctx.acls.get(name)
    return None if acl is None else acl.evaluate(probe, ctx)


class ManagerAcl(Acl):
    """squid's predefined ``manager``: URLs of squid's own cache manager. egresswall has none."""

    def add(self, flags: list[str], values: list[tuple[str, Where]], notes: list[Note]) -> None:
        pass

    def _evaluate(self, probe: Probe, ctx: Context) -> Tri:
        return False


class OpaqueAcl(Acl):
    """An ACL type with no egresswall meaning (url_regex, proxy_auth, time, browser...): undecided."""

    def add(self, flags: list[str], values: list[tuple[str, Where]], notes: list[Note]) -> None:
        pass

    def _evaluate(self, probe: Probe, ctx: Context) -> Tri:
        return None
