"""egresswall's address rules as sets, for comparing them with squid's ``dst`` ACLs.

egresswall decides one address at a time (``policy.addresses``); a translation needs the whole set of
addresses a policy admits. IPv4-mapped IPv6 (::ffff:0:0/96) is judged by the IPv4 inside, so it is
never part of these sets: squid stores IPv4 addresses as IPv4-mapped IPv6, and its ``dst`` ranges of
IPv4 already cover them (listing ``::ffff:0:0/96`` in squid would match every IPv4 address).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from functools import cache

import netaddr

from policy.addresses import CLOUD_METADATA, SPECIAL_PURPOSE_V4, SPECIAL_PURPOSE_V6

MAPPED = netaddr.IPNetwork("::ffff:0:0/96")
GLOBAL_UNICAST_V6 = netaddr.IPNetwork("2000::/3")


@cache
def never_global() -> netaddr.IPSet:
    """Every address egresswall refuses unless addresses.allow re-admits it (mapped space excluded)."""
    refused = netaddr.IPSet(block.cidr for block in SPECIAL_PURPOSE_V4 + SPECIAL_PURPOSE_V6)
    refused |= netaddr.IPSet(["::/0"]) - netaddr.IPSet([GLOBAL_UNICAST_V6])
    return refused - netaddr.IPSet([MAPPED])


@cache
def cloud_metadata() -> netaddr.IPSet:
    return netaddr.IPSet(block.cidr for block in CLOUD_METADATA)


def admitted(allow: Iterable[str] = (), deny: Iterable[str] = (), refuse_cloud_metadata: bool = True
             ) -> netaddr.IPSet:
    """The addresses an egresswall policy with these address rules connects to."""
    everything = netaddr.IPSet(["0.0.0.0/0", "::/0"]) - netaddr.IPSet([MAPPED])
    out = (everything - never_global()) | netaddr.IPSet(allow)
    if refuse_cloud_metadata:
        out -= cloud_metadata()
    return out - netaddr.IPSet(deny) - netaddr.IPSet([MAPPED])


def refused(allow: Iterable[str] = (), deny: Iterable[str] = (), refuse_cloud_metadata: bool = True
            ) -> netaddr.IPSet:
    everything = netaddr.IPSet(["0.0.0.0/0", "::/0"]) - netaddr.IPSet([MAPPED])
    return everything - admitted(allow, deny, refuse_cloud_metadata)


def cidrs(addresses: netaddr.IPSet, bare_hosts: bool = True) -> list[str]:
    """IPv4 first, then IPv6, in RFC 5952 text (netaddr writes ::0.1.0.0, which squid reads as IPv4);
    host routes as bare addresses unless ``bare_hosts`` is False."""
    out = []
    for network in sorted(addresses.iter_cidrs(), key=lambda n: (n.version, n.first)):
        text = str(ipaddress.ip_network(f"{network.network}/{network.prefixlen}"))
        full = 32 if network.version == 4 else 128
        out.append(text.split("/")[0] if bare_hosts and network.prefixlen == full else text)
    return out
