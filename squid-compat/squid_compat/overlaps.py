"""Which values of a ``dstdomain`` or ``src``/``dst`` ACL squid 5.7 keeps, when values overlap.

squid never keeps two overlapping values in one of these ACLs (measured with squid 5.7 on loopback, and what
its warnings say):

- ``dstdomain``: a value equal to one listed before it is dropped; a value that one listed before it already
  matches is dropped with a warning ("'www.a.test' is a subdomain of '.a.test'", nothing is lost); a value that
  would match one listed before it makes squid refuse to start (``www.a.test .a.test``, ``a.test .a.test``,
  and ``.a.test a.test`` too: squid reads the earlier value's name without its dot).
- ``src``/``dst``: a value whose addresses overlap one listed before it is dropped ("... is ignored to keep splay
  tree searching predictable"), even when it is the wider one: ``10.1.0.0/16 10.0.0.0/8`` is 10.1.0.0/16 only.

Values that squid kept never overlap, so whether a new value overlaps a kept one is one question, whatever
order squid happens to search them in.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

ALL_ONES = (1 << 128) - 1


@dataclass(frozen=True)
class Inserted[T]:
    """What squid did with one value: kept it, or dropped it because of ``covered_by`` (None: the same value
    again)."""

    kept: bool
    covered_by: T | None = None


# ---- dstdomain -----------------------------------------------------------------------------------------

class DomainOverlapFatal(Exception):
    """squid refuses to start: a value would match ``kept``, listed before it in the same ACL."""

    def __init__(self, kept: bytes, new: bytes) -> None:
        super().__init__(kept, new)
        self.kept, self.new = kept, new


def domain_matches(host: bytes, value: bytes) -> bool:
    """Whether a ``dstdomain`` value matches a name (both lower case): ``.a.test`` matches a.test and every name
    below it, ``a.test`` that name only. A value compared as a name is read without its leading dots."""
    host = host.lstrip(b".")
    if value.startswith(b"."):
        return host == value[1:] or host.endswith(value)
    return host == value


class DomainTree:
    """An ACL's dstdomain values (lower case, as squid's Tolower leaves them) in the order squid reads them,
    indexed by name, so that a list of many thousand values costs a few lookups a value."""

    def __init__(self) -> None:
        self._kept: set[bytes] = set()
        self._at_or_below: dict[bytes, bytes] = {}  # each kept value's name, and every ".suffix" of it -> the value

    def insert(self, value: bytes) -> Inserted[bytes]:
        """Kept, or dropped as squid drops it; raises DomainOverlapFatal where squid refuses to start."""
        host = value.lstrip(b".")
        if value in self._kept:
            return Inserted(False)
        # a kept value this one would match: its name is this value's, or (a wildcard) lies below it
        hidden = self._at_or_below.get(host) or (self._at_or_below.get(value) if value.startswith(b".") else None)
        if hidden is not None:
            raise DomainOverlapFatal(hidden, value)
        # a kept value that matches this one's name: the name itself, or a wildcard of it or above it
        for above in (host, b"." + host, *_suffixes(host)):
            if above in self._kept and domain_matches(host, above):
                return Inserted(False, above)
        self._kept.add(value)
        self._at_or_below.setdefault(host, value)
        for suffix in _suffixes(host):
            self._at_or_below.setdefault(suffix, value)
        return Inserted(True)


def _suffixes(host: bytes) -> list[bytes]:
    """Every ".suffix" of a name: www.a.test has .a.test and .test."""
    return [host[i:] for i in range(1, len(host)) if host[i:i + 1] == b"."]


# ---- src / dst -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class IpData:
    """An address value as squid stores it: 128-bit integers, IPv4 as IPv4-mapped IPv6. ``last`` 0: one
    address or network (``first`` under ``mask``); else the range ``first``-``last``."""

    first: int
    last: int
    mask: int

    @property
    def span(self) -> tuple[int, int]:
        """The lowest and highest address the value matches."""
        if self.last == 0:
            return self.first & self.mask, (self.first & self.mask) | (ALL_ONES ^ self.mask)
        return self.first, self.last


class IpTree:
    """An ACL's address values in the order squid reads them; the kept ones' spans, sorted (they never overlap)."""

    def __init__(self) -> None:
        self._spans: list[tuple[int, int, IpData]] = []

    def insert(self, value: IpData) -> Inserted[IpData]:
        """Kept, or dropped because it overlaps a value kept before it."""
        low, high = value.span
        at = bisect.bisect(self._spans, (low, high), key=lambda kept: kept[:2])
        for kept_low, kept_high, kept in self._spans[max(0, at - 1):at + 1]:
            if low <= kept_high and kept_low <= high:
                return Inserted(False, None if kept == value else kept)
        self._spans.insert(at, (low, high, value))
        return Inserted(True)
