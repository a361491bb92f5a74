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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from . import frozen
from .hosts import HostFormError, fast_name, normalise_host


class PatternKind(enum.Enum):
    EXACT = "exact"
    SUBDOMAINS = "subdomains"  # *.example.com
    DOMAIN = "domain"  # .example.com


@dataclass(frozen=True)
class HostPattern:
    kind: PatternKind
    name: str  # normalised host the pattern is anchored at (an IP text for an exact IP pattern)
    text: str  # as the operator wrote it

    @classmethod
    def parse(cls, text: str) -> HostPattern:
        """Parse a pattern strictly; raises ValueError with a reason an operator can act on."""
        if not isinstance(text, str) or not text:
            raise ValueError("a host pattern must be a non-empty string")
        if text.startswith("*."):
            kind, rest = PatternKind.SUBDOMAINS, text[2:]
        elif text.startswith("."):
            kind, rest = PatternKind.DOMAIN, text[1:]
        else:
            kind, rest = PatternKind.EXACT, text
        if "*" in rest:
            raise ValueError(f"host pattern {text!r}: '*' is allowed only as a leading '*.' label")
        name = fast_name(rest)
        if name is not None:
            # Already normal, as nearly every entry of a big list is. An exact pattern's name is its text
            # (one string, not two, a million times over).
            return frozen.instance(cls, {"kind": kind, "name": text if name == text else name, "text": text})
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


EXACT, DOMAIN = PatternKind.EXACT, PatternKind.DOMAIN


class HostIndex[T]:
    """Maps patterns to items; ``candidates(host)`` yields every item whose pattern matches host.

    Items come out in the order they were added, so the first rule written is the first rule tried.
    """

    def __init__(self, entries: Iterable[tuple[HostPattern, T]] = ()) -> None:
        self._exact: dict[str, list[tuple[int, T]]] = {}
        self._below: dict[str, list[tuple[int, T]]] = {}  # *.name and .name, for hosts below name
        self._apex: dict[str, list[tuple[int, T]]] = {}  # .name, for name itself
        self._count = 0
        exact, below, apex = self._exact, self._below, self._apex
        # add(), inline: an index is built from up to a million entries at once.
        for count, (pattern, item) in enumerate(entries):
            entry = (count, item)
            if pattern.kind is EXACT:
                exact.setdefault(pattern.name, []).append(entry)
            else:
                below.setdefault(pattern.name, []).append(entry)
                if pattern.kind is DOMAIN:
                    apex.setdefault(pattern.name, []).append(entry)
            self._count = count + 1

    def __len__(self) -> int:
        return self._count

    def add(self, pattern: HostPattern, item: T) -> None:
        entry = (self._count, item)
        self._count += 1
        if pattern.kind is PatternKind.EXACT:
            self._exact.setdefault(pattern.name, []).append(entry)
        else:
            self._below.setdefault(pattern.name, []).append(entry)
            if pattern.kind is PatternKind.DOMAIN:
                self._apex.setdefault(pattern.name, []).append(entry)

    def candidates(self, host: str) -> Iterator[T]:
        found: list[tuple[int, T]] = []
        found += self._exact.get(host, ())
        found += self._apex.get(host, ())
        suffix = host
        while (dot := suffix.find(".")) != -1:
            suffix = suffix[dot + 1 :]
            found += self._below.get(suffix, ())
        if len(found) > 1:
            found.sort(key=lambda entry: entry[0])
        return (item for _, item in found)
