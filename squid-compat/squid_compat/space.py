"""The finite set of request classes a squid.conf can tell apart.

Every ACL cuts the space of requests at a few places: ``src`` ranges cut the client addresses,
``port`` ranges cut the ports, ``method`` names pick methods, and every dstdomain value (or host
pattern a regex maps to) is an *anchor* that cuts the host names. Requests in the same piece are
treated alike by every ACL, so evaluating squid's access lists once per piece — with one
representative request — tells what squid does with all of them.

Host pieces (``Region``): for each anchor ``n`` the name itself (EXACT) and the names below it that
are not also below a deeper anchor (BELOW, represented by a fresh label under ``n``); the names under
no anchor (REST); each IP address named in a dstdomain (EXACT); every other IP literal (IP_ANY).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import netaddr

from .acls import (
    ALL_V4,
    ALL_V6,
    BELOW,
    CONNECT,
    EXACT,
    HTTP,
    HTTPS,
    IP_ANY,
    REST,
    HostRef,
    MethodAcl,
    PortAcl,
    SrcAcl,
)
from .acltable import AclTable
from .hostacls import Anchor

OTHER_METHODS = ("GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH", "TRACE", "PROPFIND", "MKCOL")


@dataclass(frozen=True)
class Region:
    key: str
    kind: str  # EXACT, BELOW, REST, IP_ANY
    anchor: str | None  # the anchor name (or IP text)
    host: HostRef
    depth: int  # labels in the anchor: deeper regions are more specific

    @property
    def pattern(self) -> str | None:
        """The egresswall host pattern naming exactly this region's hosts and those below it."""
        if self.kind == EXACT:
            return self.anchor
        if self.kind == BELOW:
            return f"*.{self.anchor}"
        return None

    def describe(self) -> str:
        if self.kind == EXACT:
            return f"{'address' if self.host.ip is not None else 'host'} {self.anchor}"
        if self.kind == BELOW:
            return f"names below {self.anchor}"
        if self.kind == REST:
            return "hosts named by no ACL"
        return "IP-literal URLs not named by an ACL"


@dataclass(frozen=True, order=True)
class Cell:
    """One class of request apart from its host and client: CONNECT to a port range, or a plain
    (``http``) or absolute-form ``https`` request with a method to a port range."""

    kind: str
    method: str
    low: int
    high: int

    @property
    def port(self) -> int:
        return self.low

    def describe(self, other_method: str) -> str:
        return describe_cells([self], other_method)


def describe_cells(cells: Iterable[Cell], other_method: str, named_methods: bool = True) -> str:
    """'CONNECT to 443, 8443; GET http:// to 80' — cells grouped by kind and method."""
    from policy.ports import ports_text

    groups: dict[tuple[str, str], set[int]] = {}
    for cell in cells:
        method = "CONNECT" if cell.kind == CONNECT else (
            "other methods" if cell.method == other_method else cell.method) + f" {cell.kind}://"
        if cell.kind != CONNECT and cell.method == other_method and not named_methods:
            method = f"{cell.kind}:// requests"
        groups.setdefault((cell.kind, method), set()).update(range(cell.low, cell.high + 1))
    order = {CONNECT: 0, HTTP: 1, HTTPS: 2}
    return "; ".join(f"{method} to port {ports_text(ports)}"
                     for (kind, method), ports in sorted(groups.items(), key=lambda g: (order[g[0][0]], g[0][1])))


@dataclass(frozen=True)
class ClientClass:
    addresses: netaddr.IPSet
    representative: netaddr.IPAddress
    members: tuple[str, ...]  # the src ACLs it is in

    def name(self) -> str:
        return "+".join(self.members) if self.members else "others"


@dataclass
class Space:
    regions: list[Region]
    cells: list[Cell]
    clients: list[ClientClass]
    methods: list[str]
    other_method: str
    port_atoms: list[tuple[int, int]]


def build_space(table: AclTable, used: set[str]) -> Space:
    acls = [table.acls[name] for name in sorted(used) if name in table.acls]
    # Methods as egresswall can name them (it compares them upper-cased): each method an ACL names is a
    # class of its own; one probe method stands for all the others.
    methods = sorted({m for acl in acls if isinstance(acl, MethodAcl) for m in acl.atoms()} - {"CONNECT"})
    other = next((m for m in OTHER_METHODS if m not in methods), "EGRESSWALLPROBE")
    method_atoms = [*methods, other]
    port_atoms = _port_atoms(b for acl in acls if isinstance(acl, PortAcl) for b in acl.boundaries())
    cells = [Cell(CONNECT, "CONNECT", low, high) for low, high in port_atoms]
    for kind in (HTTP, HTTPS):
        cells += [Cell(kind, method, low, high) for low, high in port_atoms for method in method_atoms]
    anchors = {anchor for acl in acls if acl.host_dependent for anchor in acl.anchors()}
    clients = _client_classes([acl for acl in acls if isinstance(acl, SrcAcl)])
    return Space(_regions(anchors), cells, clients, method_atoms, other, port_atoms)


def _port_atoms(boundaries: Iterable[int]) -> list[tuple[int, int]]:
    cuts = sorted({1, 65536} | {b for b in boundaries if 1 < b < 65536})
    return [(low, high - 1) for low, high in zip(cuts, cuts[1:], strict=False)]


def _client_classes(srcs: list[SrcAcl]) -> list[ClientClass]:
    everything = netaddr.IPSet([ALL_V4, ALL_V6])
    pieces: list[tuple[netaddr.IPSet, tuple[str, ...]]] = [(everything, ())]
    for acl in srcs:
        if acl.addresses == everything:
            continue  # 'all': every client is in it, nothing to tell apart
        split = []
        for addresses, members in pieces:
            inside, outside = addresses & acl.addresses, addresses - acl.addresses
            if inside:
                split.append((inside, (*members, acl.name)))
            if outside:
                split.append((outside, members))
        pieces = split
    out = []
    for addresses, members in pieces:
        first = next(iter(addresses.iter_cidrs()))
        # A host address, not a network's first: 0.0.0.0 or :: would not make a believable client.
        representative = first[1] if first.size > 2 else first[0]
        out.append(ClientClass(addresses, representative, members))
    return out


def _regions(anchors: set[Anchor]) -> list[Region]:
    labels = {label for anchor in anchors if not anchor.ip for label in anchor.name.split(".")}
    fresh = next(f"zz-probe{i}" for i in range(len(labels) + 2) if f"zz-probe{i}" not in labels)
    regions: list[Region] = []
    for anchor in sorted(anchors, key=lambda a: (a.ip, -a.name.count("."), a.name)):
        if anchor.ip:
            ip = netaddr.IPAddress(anchor.name)
            regions.append(Region(f"ip:{anchor.name}", EXACT, anchor.name, HostRef(EXACT, anchor.name, ip), 0))
            continue
        depth = anchor.name.count(".") + 1
        regions.append(Region(f"={anchor.name}", EXACT, anchor.name, HostRef(EXACT, anchor.name), depth))
        regions.append(Region(f"*.{anchor.name}", BELOW, anchor.name,
                              HostRef(BELOW, f"{fresh}.{anchor.name}"), depth))
    tld = next(f"zz-unlisted{i}" for i in range(len(labels) + 2) if f"zz-unlisted{i}" not in labels)
    regions.append(Region("rest", REST, None, HostRef(REST, f"{fresh}.{tld}"), 0))
    regions.append(Region("ip-any", IP_ANY, None, HostRef(IP_ANY, ""), 0))
    return regions
