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
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import netaddr

from .overlaps import ALL_ONES, IpData, IpTree
from .report import NOTE, WARNING, Note, Where

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

# Values squid reads as 'all' (every IPv4 and IPv6 address), with an error asking for 'all' (acl_ip_data).
ALL_SPELLINGS = ("all", "0/0", "0.0.0.0/0", "0.0.0.0/0.0.0.0", "0.0.0.0-255.255.255.255", "0.0.0.0-0.0.0.0/0")
_IPV4_TEXT = re.compile(r"[0-9.]+")
_IPV6_TEXT = re.compile(r"[0-9A-Fa-f:]+")
_IPV6_DOTTED = re.compile(r"[0-9A-Fa-f:.]+")


def parse_squid_address(text: str) -> netaddr.IPSet:
    """squid 5's address syntax (``acl_ip_data::FactoryParse``): ``all`` and its old spellings, an address,
    ``addr/len``, ``addr/dotted-mask``, ``a1-a2``. Anything squid reads in a way egresswall should not
    guess at raises ValueError (the ACL is then undecided where the value matters)."""
    if text in ALL_SPELLINGS:
        return netaddr.IPSet([ALL_V4, ALL_V6])
    if "-" in text and "/" not in text:
        first, last = text.split("-", 1)
        return netaddr.IPSet(netaddr.IPRange(parse_ip(first), parse_ip(last)))
    address, slash, mask = text.partition("/")
    ip = parse_ip(address, dotted_ipv6=not slash)  # squid's masks do not apply to ::ffff:1.2.3.4 as written
    if not slash:
        return netaddr.IPSet([ip])
    prefix = _prefix_length(ip, mask, text)
    if prefix == 0:
        # squid's applyMask(0) sets the mask to all ones (measured, squid 5.7: 8.0.0.0/0 matches 8.0.0.0 only,
        # ::/0 only ::); only the spellings in ALL_SPELLINGS mean every address.
        return netaddr.IPSet([ip])
    return netaddr.IPSet([netaddr.IPNetwork(f"{ip}/{prefix}").cidr])


def _prefix_length(ip: netaddr.IPAddress, mask: str, text: str) -> int:
    """The prefix length squid uses for ``addr/mask``."""
    width = 32 if ip.version == 4 else 128
    if mask.isdigit() and mask.isascii():
        if int(mask) > width:
            raise ValueError(f"{text!r}: prefix length {mask} is longer than {width} (squid refuses to start)")
        return int(mask)
    if ip.version == 4 and _IPV4_TEXT.fullmatch(mask):
        # A dotted mask: squid counts its leading one bits (Ip::Address::cidr) and ignores the rest, so
        # 255.0.255.0 is /8 (measured, squid 5.7), not the /32 a strict parser makes of it.
        bits = f"{int(parse_ip(mask)):032b}"
        return len(bits) - len(bits.lstrip("1"))
    raise ValueError(f"{text!r}: squid reads the mask {mask!r} in a way egresswall does not guess at "
                     "(write addr/prefix-length)")


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


def parse_ip(text: str, unwrap: bool = False, dotted_ipv6: bool = False) -> netaddr.IPAddress:
    """A plain IPv4 (dotted quad) or IPv6 address; ``dotted_ipv6`` also takes ``::ffff:1.2.3.4``, ``unwrap``
    gives an IPv4-mapped address as its IPv4. squid reads other spellings too (inet_aton's ``10.1``, octal
    ``010.0.0.1``, brackets, a dotted IPv6 with a mask) with results egresswall does not guess at: refused
    here, so the value leaves its ACL undecided."""
    allowed = (_IPV6_DOTTED if dotted_ipv6 else _IPV6_TEXT) if ":" in text else _IPV4_TEXT
    try:
        if allowed.fullmatch(text):
            address = netaddr.IPAddress(text, 6 if ":" in text else 4, flags=netaddr.INET_PTON)
            return address.ipv4() if unwrap and address.is_ipv4_mapped() else address
    except (ValueError, netaddr.AddrFormatError):
        pass
    raise ValueError(f"{text!r} is not an IP address") from None


def squid_ip_data(text: str) -> IpData:
    """The ``acl_ip_data`` squid 5.7 makes of a value ``parse_squid_address`` reads (``FactoryParse``): the
    128-bit first and last address (0: not a range) and mask, IPv4 stored as IPv4-mapped IPv6."""
    if text in ALL_SPELLINGS:
        return IpData(0, 0, 0)  # setAnyAddr(): a mask of zeros matches everything
    if "-" in text and "/" not in text:
        first, last = text.split("-", 1)
        return IpData(_stored(parse_ip(first)), _stored(parse_ip(last)), ALL_ONES)
    address, slash, mask = text.partition("/")
    ip = parse_ip(address, dotted_ipv6=not slash)
    prefix = _prefix_length(ip, mask, text) if slash else 0
    bits = 0 if prefix == 0 else (96 if ip.version == 4 else 0) + prefix  # applyMask(0) leaves all ones
    netmask = ALL_ONES if bits == 0 else ALL_ONES ^ ((1 << (128 - bits)) - 1)
    return IpData(_stored(ip) & netmask, 0, netmask)


def _stored(ip: netaddr.IPAddress) -> int:
    return int(ip) | 0xFFFF_0000_0000 if ip.version == 4 else int(ip)


class AddressAcl(Acl):
    """``src`` and ``dst``: address ranges; names among the values are resolved by squid at startup,
    which a translation cannot repeat, so they leave the ACL undecided where the ranges do not decide.

    squid drops a value overlapping one already in the ACL (``overlaps``), even when the dropped one is the wider
    (``10.1.0.0/16 10.0.0.0/8`` is 10.1.0.0/16 only): the values are inserted as squid inserts them, and only
    those it keeps count."""

    def __init__(self, name: str, type_: str) -> None:
        super().__init__(name, type_)
        self.addresses = netaddr.IPSet()
        self.names: list[tuple[str, Where]] = []
        self.no_lookup = False
        self._relative: dict[int, Tri] = {}
        self._tree = IpTree()

    def add(self, flags: list[str], values: list[tuple[str, Where]], notes: list[Note]) -> None:
        self.no_lookup = self.no_lookup or "-n" in flags
        for value, where in values:
            try:
                addresses = with_mapped_ipv4(parse_squid_address(value))
                data = squid_ip_data(value)
            except ValueError as err:
                if re.fullmatch(r"[A-Za-z0-9.-]+", value) and not value.replace(".", "").isdigit():
                    self.names.append((value, where))
                    notes.append(Note(where, f"acl {self.name} {self.type} {value}: squid resolves names in "
                                             f"{self.type} ACLs once, at startup; the translation cannot, so the "
                                             "ACL is undecided for addresses it does not list",
                                      "untranslatable-acl"))
                else:
                    self.undecide(where, f"{value!r} is not an address or range ({err})", notes)
                continue
            self._insert(value, where, addresses, data, notes)

    def _insert(self, value: str, where: Where, addresses: netaddr.IPSet, data: IpData, notes: list[Note]) -> None:
        if self.names:
            # squid inserted the name's addresses before this value and drops the value if it overlaps one of
            # them: unknown here, so the value is left out (undecided, as every address the ACL does not list).
            notes.append(Note(where, f"acl {self.name} {self.type} {value}: listed after the name "
                                     f"{self.names[0][0]}, whose addresses squid may keep in its place (it ignores "
                                     "a value overlapping one already in the ACL); undecided", "overlap"))
            return
        inserted = self._tree.insert(data)
        if inserted.kept:
            self.addresses |= addresses
            return
        if inserted.covered_by is None:
            return  # the same value again
        lost = addresses - self.addresses
        notes.append(Note(where, f"acl {self.name} {self.type} {value}: squid ignores it, as it overlaps a value "
                                 "listed before it in this ACL (\"is ignored to keep splay tree searching "
                                 "predictable\")" + (f"; {_describe(lost)} is not in the ACL for squid, nor here"
                                                      if lost else ""),
                          "overlap", WARNING if lost else NOTE))

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


def _describe(addresses: netaddr.IPSet) -> str:
    ranges = [str(network) for network in addresses.iter_cidrs()]
    return ", ".join(ranges[:4]) + (f" and {len(ranges) - 4} more ranges" if len(ranges) > 4 else "")


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


# The methods squid 5.7 knows by name (Http::MethodType; the ones under NO_SPECIAL_HANDLING, PATCH among them,
# are not compiled in). With relaxed_header_parser on (squid's default) squid reads them in any case, in ACL
# values and in requests alike: "acl m method get connect" matches GET and CONNECT (measured). Any other
# method is an extension method, compared as written, case included.
SQUID_METHODS = frozenset({
    "GET", "POST", "PUT", "HEAD", "CONNECT", "TRACE", "OPTIONS", "DELETE", "CHECKOUT", "CHECKIN", "UNCHECKOUT",
    "MKWORKSPACE", "VERSION-CONTROL", "REPORT", "UPDATE", "LABEL", "MERGE", "BASELINE-CONTROL", "MKACTIVITY",
    "PROPFIND", "PROPPATCH", "MKCOL", "COPY", "MOVE", "LOCK", "UNLOCK", "SEARCH", "PRI", "PURGE"})
_NAMEABLE_METHOD = re.compile(r"[A-Z]{1,20}")  # a method egresswall's rules can name (policy/schema.json)


class MethodAcl(Acl):
    """``method``. egresswall compares a request's method upper-cased, so it cannot tell ``FROB`` from
    ``frob``: where squid compares an extension method as written, the ACL is undecided for that method."""

    # relaxed_header_parser off: squid compares every method as written (set by the importer).
    case_exact = False

    def __init__(self, name: str, type_: str) -> None:
        super().__init__(name, type_)
        self.methods: set[str] = set()  # upper-cased methods squid matches in any case
        self.case_sensitive: set[str] = set()  # upper-cased: squid matches one spelling of each
        self.unnameable = False  # a method no egresswall rule can name: every other method is undecided

    def add(self, flags: list[str], values: list[tuple[str, Where]], notes: list[Note]) -> None:
        for value, where in values:
            upper = value.upper() if value.isascii() else value
            if upper in SQUID_METHODS and not self.case_exact:
                self.methods.add(upper)
            else:
                self.case_sensitive.add(upper)
                notes.append(Note(where, f"acl {self.name} method {value}: squid matches only a request whose method "
                                         f"is written exactly {value!r}; egresswall compares methods upper-cased, so "
                                         "the ACL is undecided for this method", "method", NOTE))
            if not _NAMEABLE_METHOD.fullmatch(upper):
                self.unnameable = True

    def atoms(self) -> set[str]:
        """The methods this ACL names, as egresswall rules can name them (request classes of their own)."""
        return {m for m in self.methods | self.case_sensitive if _NAMEABLE_METHOD.fullmatch(m)}

    def _evaluate(self, probe: Probe, ctx: Context) -> Tri:
        if probe.method in self.methods:
            return True
        if probe.method in self.case_sensitive:
            return None
        # A probe's method stands for every method no ACL names: one this ACL names that has no class of
        # its own (VERSION-CONTROL) may be among them.
        return None if self.unnameable else False


class ProtoAcl(Acl):
    def __init__(self, name: str, type_: str) -> None:
        super().__init__(name, type_)
        self.protocols: set[str] = set()

    def add(self, flags: list[str], values: list[tuple[str, Where]], notes: list[Note]) -> None:
        self.protocols.update(value.upper() for value, _ in values)

    def _evaluate(self, probe: Probe, ctx: Context) -> Tri:
        return PROTO_OF_KIND[probe.kind] in self.protocols


def acl_key(name: str) -> str:
    """squid finds ACLs by name case-insensitively (``ACL::FindByName``: strcasecmp, ASCII letters only):
    ``acl bad`` and ``acl BAD`` are one ACL, and ``http_access deny Bad`` uses it."""
    return name.translate(_ASCII_LOWER)


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


@dataclass(frozen=True)
class Literal:
    """One ACL named on an access line or in an any-of/all-of: its key (``acl_key``), ``!`` or not, and
    whether it was defined when squid read the line (squid refuses to start otherwise)."""

    name: str
    negated: bool = False
    undefined: bool = False
    written: str = ""

    @classmethod
    def parse(cls, word: str, defined: Callable[[str], bool]) -> Literal:
        negated = word.startswith("!")
        name = word[1:] if negated else word
        return cls(acl_key(name), negated, not defined(acl_key(name)), name)

    def __str__(self) -> str:
        return ("!" if self.negated else "") + (self.written or self.name)


def literal_acl(literal: Literal, acls: dict[str, Acl]) -> Acl | None:
    """The ACL a literal names; None when squid would not have found it (not defined, or not yet)."""
    return None if literal.undefined else acls.get(literal.name)


def literal_value(literal: Literal, probe: Probe, ctx: Context) -> Tri:
    acl = literal_acl(literal, ctx.acls)
    value = None if acl is None else acl.evaluate(probe, ctx)
    return t_not(value) if literal.negated else value


class GroupAcl(Acl):
    """``any-of`` / ``all-of``: other ACLs combined (each may be negated, as on an access line)."""

    def __init__(self, name: str, type_: str) -> None:
        super().__init__(name, type_)
        self.groups: list[list[Literal]] = []  # each acl line is one group; lines are ORed
        self.defined: Callable[[str], bool] = lambda key: True  # set by the table before add()
        self._busy = False

    def add(self, flags: list[str], values: list[tuple[str, Where]], notes: list[Note]) -> None:
        group = [Literal.parse(value, self.defined) for value, _ in values]
        for literal, (_, where) in zip(group, values, strict=True):
            if literal.undefined:
                notes.append(Note(where, f"acl {self.name} {self.type}: acl {literal.written} is not defined before "
                                         "this line (squid refuses to start: 'ACL not found'); undecided", "syntax"))
        self.groups.append(group)

    def _evaluate(self, probe: Probe, ctx: Context) -> Tri:
        if self._busy:
            return None  # a cycle: squid refuses it at startup; undecided here
        self._busy = True
        try:
            combine = t_or if self.type == "any-of" else t_and
            return t_or(combine(literal_value(literal, probe, ctx) for literal in group) for group in self.groups)
        finally:
            self._busy = False

    def members(self) -> Iterable[str]:
        for group in self.groups:
            yield from (literal.name for literal in group if not literal.undefined)


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
