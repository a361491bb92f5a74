"""Host patterns and the index that matches a host against many of them.

Three forms, as operators know them from squid and smokescreen:

* ``example.com``    the name itself, nothing else;
* ``*.example.com``  any name below it, not the name itself;
* ``.example.com``   the name and any name below it (squid's ``dstdomain`` meaning).

A pattern is written in the normalised form hosts take (A-labels, lower case), so matching is a
string comparison. The index looks a host up by each of its suffixes, so the cost of a match grows
with the number of labels in the host and not with the number of patterns.
"""

from __future__ import annotations

import enum
import operator
import re
from collections.abc import Iterable, Sequence
from itertools import compress
from typing import NamedTuple

from .hosts import FAST_NAME_REGEX, HostFormError, normalise_host


class PatternKind(enum.Enum):
    EXACT = "exact"
    SUBDOMAINS = "subdomains"  # *.example.com
    DOMAIN = "domain"  # .example.com

    # Members are singletons, equal only to themselves: hashed by identity, in C. (Enum's own __hash__ is a
    # Python method, a call per lookup: a million of them to index a big allowlist by kind.)
    __hash__ = object.__hash__


class HostPattern(NamedTuple):
    """One parsed pattern: immutable, compared and hashed by its fields.

    A named tuple rather than a frozen dataclass: a big allowlist parses a million of these, and a frozen
    dataclass sets each field through ``object.__setattr__`` (about five times the cost of building the tuple).
    """

    kind: PatternKind
    name: str  # normalised host the pattern is anchored at (an IP text for an exact IP pattern)
    text: str  # as the operator wrote it

    @classmethod
    def parse(cls, text: str) -> HostPattern:
        """Parse a pattern strictly; raises ValueError with a reason an operator can act on."""
        if not isinstance(text, str) or not text:
            raise ValueError("a host pattern must be a non-empty string")
        if _FAST_PATTERN(text) is not None and "xn--" not in text:
            # Already normal, as nearly every entry of a big list is: hosts.fast_name's test, with the prefix, in
            # one match. An exact pattern's name is its text (one string, not two, a million times over).
            first = text[0]
            kind, name = (SUBDOMAINS, text[2:]) if first == "*" else (DOMAIN, text[1:]) if first == "." else (
                EXACT, text)
            return _tuple_new(cls, (kind, name[:-1] if name[-1] == "." else name, text))
        if text.startswith("*."):
            kind, rest = PatternKind.SUBDOMAINS, text[2:]
        elif text.startswith("."):
            kind, rest = PatternKind.DOMAIN, text[1:]
        else:
            kind, rest = PatternKind.EXACT, text
        if "*" in rest:
            raise ValueError(f"host pattern {text!r}: '*' is allowed only as a leading '*.' label")
        if "://" in rest:  # an operator's likely slip: said as such, not as the IPv6 literal a ':' first suggests
            raise ValueError(f"host pattern {text!r}: a host pattern is a name, not a URL; write the host alone "
                             "(a rule's schemes:, ports: and paths: say the rest)")
        if rest.count(":") == 1 and not rest.startswith("["):
            raise ValueError(f"host pattern {text!r}: a host pattern has no port; write the host alone and put the "
                             "port in the rule's ports:")
        try:
            name, ip = normalise_pattern_host(rest)
        except HostFormError as err:
            raise ValueError(f"host pattern {text!r}: {err.reason}") from None
        if ip is not None and kind is not PatternKind.EXACT:
            raise ValueError(f"host pattern {text!r}: an IP address cannot have subdomains")
        return cls(kind, name, text)

    def matches(self, host: str) -> bool:
        if self.kind is PatternKind.EXACT:
            return host == self.name
        below = host.endswith("." + self.name)
        return below or (self.kind is PatternKind.DOMAIN and host == self.name)

    def covers(self, other: HostPattern) -> bool:
        """True when every host ``other`` matches is matched by this pattern too (used by lint)."""
        if self.kind is PatternKind.EXACT:
            return other.kind is PatternKind.EXACT and other.name == self.name
        if other.name.endswith("." + self.name):
            return True
        if other.name == self.name:
            return self.kind is PatternKind.DOMAIN or other.kind is PatternKind.SUBDOMAINS
        return False


def normalise_pattern_host(text: str) -> tuple[str, object]:
    """Normalise the host part of a pattern with the same rules as a request host.

    A pattern may name a single-label suffix such as ``com`` (``.com``), which the request
    normaliser refuses as "a name without a dot"; a pattern is not a request, so that check is
    skipped for patterns by normalising under a placeholder label.
    """
    if "." not in text.strip(".") and ":" not in text:  # not for IPv6 literals, which have no dot
        try:
            name, _ = normalise_host("pattern-anchor." + text)
        except HostFormError as err:
            raise HostFormError(err.form, err.reason.replace("pattern-anchor.", "")) from None
        return name.removeprefix("pattern-anchor."), None
    return normalise_host(text)


EXACT, SUBDOMAINS, DOMAIN = PatternKind.EXACT, PatternKind.SUBDOMAINS, PatternKind.DOMAIN
# A pattern that is a prefix ('*.' or '.', or none) and a name hosts.fast_name takes as already normal.
_FAST_PATTERN = re.compile(r"(?:\*\.|\.)?" + FAST_NAME_REGEX).fullmatch
_tuple_new = tuple.__new__  # HostPattern.parse, a million times: the named tuple without its Python __new__
_first, _second = operator.itemgetter(0), operator.itemgetter(1)
_kind_of, _name_of = _first, _second  # HostPattern.kind and .name, by position


class HostIndex[T]:
    """Maps patterns to items; ``candidates(host)`` lists every item whose pattern matches host.

    Items come out in the order they were added, so the first rule written is the first rule tried.
    A host is looked up by each of its suffixes, so a match costs the same for ten patterns as for a
    million. One table maps each name a pattern is anchored at to an entry (or to a list of entries when
    several patterns share the name): one int per pattern, not a list and a tuple, for a million-entry
    index. An entry is the item's position shifted left by two, with two bits that say what the pattern
    matches: ``SELF`` the name itself (exact, ``.name``), ``BELOW`` names below it (``*.name``, ``.name``).
    A lookup then reads nothing but the table and the items it finds (at a million entries, each other
    place read is a cache miss).
    """

    SELF, BELOW = 1, 2
    _MATCHES = {PatternKind.EXACT: SELF, PatternKind.SUBDOMAINS: BELOW, PatternKind.DOMAIN: SELF | BELOW}

    def __init__(self, entries: Iterable[tuple[HostPattern, T]] = ()) -> None:
        self._items: list[T] = []
        self._names: dict[str, int | list[int]] = {}
        self.extend(entries)

    @classmethod
    def of(cls, patterns: Sequence[HostPattern], items: Iterable[T]) -> HostIndex[T]:
        """An index of items[i] under patterns[i] (a policy's table, built once): ``HostIndex(zip(patterns,
        items))`` without a pair per entry. A million entries go in without a Python step per entry: C-level
        maps make the entries and take the names, and one dict built from the names in reverse maps each to
        its first entry; only a name written more than once (found by comparing each name's first entry with
        its own, also in C) is then given its later entries."""
        index = cls()
        index._items.extend(items)
        count = len(index._items)
        if count != len(patterns):
            raise ValueError(f"{len(patterns)} patterns for {count} items")
        entries = list(map(operator.or_, range(0, count << 2, 4),
                           map(cls._MATCHES.__getitem__, map(_kind_of, patterns))))
        names = list(map(_name_of, patterns))
        index._names = first = dict(zip(reversed(names), reversed(entries), strict=True))
        if len(first) != count:  # some name written more than once
            for position in compress(range(count), map(operator.ne, map(first.__getitem__, names), entries)):
                _put(first, names[position], entries[position])
        return index

    def __len__(self) -> int:
        return len(self._items)

    def every_name_once(self) -> bool:
        """No two patterns anchored at the same name (then no pattern text is written twice either)."""
        return len(self._names) == len(self._items)

    def add(self, pattern: HostPattern, item: T) -> None:
        self.extend(((pattern, item),))

    def extend(self, entries: Iterable[tuple[HostPattern, T]]) -> None:
        """``add`` for each entry, in order (a name seen for the first time costs one ``setdefault``)."""
        items, names, matches = self._items, self._names, self._MATCHES
        append = items.append
        for (kind, name, _), item in entries:
            entry = len(items) << 2 | matches[kind]
            append(item)
            if names.setdefault(name, entry) != entry:
                _put(names, name, entry)

    def candidates(self, host: str) -> list[T]:
        """The items whose pattern matches host, in the order they were added: the host itself by an exact or
        a ``.name`` pattern, each suffix (a name above the host) by a ``*.name`` or ``.name`` one. Written out in
        one loop, without a call per suffix: every request's decision looks up every table it may match."""
        names = self._names
        if not names:
            return []  # an empty table (often the deny list): no suffix to look up
        lookup = names.get
        found: list[int] = []
        held = lookup(host)
        if held is not None:
            if type(held) is int:
                if held & 1:  # SELF
                    found.append(held)
            else:
                found.extend(entry for entry in held if entry & 1)
        suffix = host
        while True:
            # Each name above the host: str.partition takes one argument the fast way (find's position arguments
            # are parsed the old, slow way), a fifth of a lookup.
            suffix = suffix.partition(".")[2]
            if not suffix:
                break
            held = lookup(suffix)
            if held is not None:
                if type(held) is int:
                    if held & 2:  # BELOW
                        found.append(held)
                else:
                    found.extend(entry for entry in held if entry & 2)
        if not found:
            return []
        items = self._items
        if len(found) == 1:
            return [items[found[0] >> 2]]
        found.sort()  # by position, the high bits
        return [items[entry >> 2] for entry in found]


def _put(table: dict[str, int | list[int]], name: str, entry: int) -> None:
    held = table.get(name)
    if held is None:
        table[name] = entry
    elif type(held) is int:
        table[name] = [held, entry]
    else:
        held.append(entry)
