"""squid_compat.overlaps, its indexes against the plain reading of squid's rule: each new value compared with every
value kept before it (a value kept never overlaps another, so the order of comparison does not matter)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from squid_compat.overlaps import (
    ALL_ONES,
    DomainOverlapFatal,
    DomainTree,
    IpData,
    IpTree,
    domain_matches,
)

LABELS = st.sampled_from([b"a", b"b", b"test", b"www"])
DOMAINS = st.builds(lambda dot, labels: (b"." if dot else b"") + b".".join(labels), st.booleans(),
                    st.lists(LABELS, min_size=1, max_size=3))


def plainly(values: list[bytes]) -> tuple[list[bytes], bytes | None]:
    """The values squid keeps, and the first it refuses to start on (None: it starts)."""
    kept: list[bytes] = []
    for value in values:
        if any(domain_matches(k, value) and k != value for k in kept):
            return kept, value
        if not any(k == value or domain_matches(value, k) for k in kept):
            kept.append(value)
    return kept, None


@given(st.lists(DOMAINS, max_size=12))
def test_the_domain_index_keeps_what_the_plain_reading_keeps(values):
    tree, kept, fatal = DomainTree(), [], None
    for value in values:
        try:
            if tree.insert(value).kept:
                kept.append(value)
        except DomainOverlapFatal as err:
            fatal = err.new
            break
    assert (kept, fatal) == plainly(values)


def test_the_rules_squid_was_measured_keeping():
    tree = DomainTree()
    assert tree.insert(b".a.test").kept and not tree.insert(b"www.a.test").kept  # below: dropped, nothing lost
    assert tree.insert(b"test").kept  # no overlap: .a.test does not match test
    for later in (b"a.test", b".test"):  # would match .a.test's name: squid refuses to start
        fresh = DomainTree()
        fresh.insert(b".a.test")
        with pytest.raises(DomainOverlapFatal):
            fresh.insert(later)


# ranges first-last (last 0 is squid's "a network under its mask"), and networks under a mask
RANGES = st.tuples(st.integers(1, 40), st.integers(0, 10)).map(lambda t: IpData(t[0], t[0] + t[1], 0))
NETWORKS = st.tuples(st.integers(0, 63), st.integers(0, 6)).map(
    lambda t: IpData(t[0] & ~((1 << t[1]) - 1), 0, ALL_ONES ^ ((1 << t[1]) - 1)))


@given(st.lists(st.one_of(RANGES, NETWORKS), max_size=12))
def test_the_address_index_keeps_what_the_plain_reading_keeps(values):
    tree, kept = IpTree(), []
    for value in values:
        overlapping = any(value.span[0] <= k.span[1] and k.span[0] <= value.span[1] for k in kept)
        assert tree.insert(value).kept == (not overlapping), (value, kept)
        if not overlapping:
            kept.append(value)
