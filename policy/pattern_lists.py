"""A whole list of host patterns judged at once: a million-entry allowlist without a Python step per entry.

``HostPattern.parse`` judges one text. Run a million times, the Python around its one regular-expression match
is most of what a big allowlist costs to load. ``plain_patterns`` takes the list instead: an entry that is
plainly normal (what ``HostPattern.parse``'s fast path takes: ``*.``, ``.`` or no prefix, then two or more
lower-case LDH labels of 1-63 octets, no hyphen at a label's edge, at most 253 octets, the last label not a
number, no ``xn--`` label, not a local name, at most one trailing dot) is recognised by tests on the whole
list at once: substring searches over the entries joined by line breaks and C-level maps over the list, each
a single pass in C. Only when a test finds something is each entry looked at, and then only by that test.

It only ever says "this entry is plainly normal, and this is its pattern". Whatever a test cannot clear
(including entries that are fine but unusual: a label spelt ``local``, a text over 63 characters) is left to
``HostPattern.parse``, which judges it and gives any reason; tests/test_pattern_lists.py checks by property
that every pattern given here is the one ``HostPattern.parse`` gives.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable, Sequence
from functools import partial
from itertools import compress, repeat

from .hosts import LOCAL_NAMES, MAX_LABEL, MAX_NAME
from .patterns import DOMAIN, EXACT, SUBDOMAINS, HostPattern

# The bytes a plainly normal entry is made of (the line break separates entries in the joined text).
_PLAIN_BYTES = b"abcdefghijklmnopqrstuvwxyz0123456789.-*\n"
_OTHER_CHARACTER = re.compile(r"[^a-z0-9.*-]").search  # anything else, a line break inside an entry included
_NUMBER_AT_END = re.compile(r"\.(?:[0-9]+|0x[0-9a-f]*)\.?\n")  # a last label browsers read as a number
_NUMBER_AT_END_OF_ONE = re.compile(r"\.(?:[0-9]+|0x[0-9a-f]*)\.?\Z").search
_DIGITS_AS_0 = bytes.maketrans(b"123456789", b"000000000")
# A local name contains one of these words ('localhost' and 'localdomain' contain 'local'); an entry that
# contains one anywhere is left to HostPattern.parse, which tells a local name from 'localbitcoins.com'.
_LOCAL_WORDS = tuple(word for word in LOCAL_NAMES if not any(other != word and other in word for other in LOCAL_NAMES))

_FIRST = operator.itemgetter(slice(0, 1))  # '' for an empty text, where [0] would raise
_KIND_BY_FIRST = {"*": SUBDOMAINS, ".": DOMAIN}
_new_pattern = partial(tuple.__new__, HostPattern)  # the named tuple without its Python __new__


def plain_patterns(strings: Sequence[str]) -> list[HostPattern | None]:
    """For each text, in order: its pattern when it is plainly normal (exactly what ``HostPattern.parse`` gives
    for it), else None: parse that one alone. Every item must be a ``str`` (TypeError otherwise)."""
    if not strings:
        return []
    # The name: the text without its leading '*.' or '.' and its one trailing dot. Stripping every leading '*'
    # and '.' and every trailing '.' gives exactly that for an entry that passes the tests below (which find
    # '**', '..', a '*' anywhere else), in two C calls; each hands back the text itself when there is nothing
    # to strip, so an exact pattern's name is its text (one string, not two).
    names = list(map(str.rstrip, map(str.lstrip, strings, repeat("*.")), repeat(".")))
    kinds = map(_KIND_BY_FIRST.get, map(_FIRST, strings), repeat(EXACT))
    patterns: list[HostPattern | None] = list(map(_new_pattern, zip(kinds, names, strings, strict=True)))
    for position in _not_plain(strings, names):
        patterns[position] = None
    return patterns


def _not_plain(strings: Sequence[str], names: list[str]) -> set[int]:
    """The positions of the entries some test cannot clear. Each test is first made on the whole list (the
    entries joined, each between line breaks, so that "starts with" and "ends with" are substrings too); only
    when it finds something is it made entry by entry. An entry is plainly normal when no test finds it."""
    count = len(strings)
    joined = "\n" + "\n".join(strings) + "\n"
    found: set[int] = set()

    def where(predicate: Iterable[object]) -> None:
        found.update(compress(range(count), predicate))

    def containing(*words: str) -> None:
        for word in words:
            where(map(operator.contains, strings, repeat(word)))

    # Characters: a-z, 0-9, '.', '-', '*' only; no line break inside an entry (it would look like two entries).
    ascii_text = joined.encode("ascii") if joined.isascii() else None
    if ascii_text is None or ascii_text.translate(None, _PLAIN_BYTES) or joined.count("\n") != count + 1:
        where(map(_OTHER_CHARACTER, strings))
    # '*' only as the leading '*.' (each '*' of the joined text is then a line break's '\n*.').
    if joined.count("*") != joined.count("\n*."):
        where(map(operator.ne, map(str.count, strings, repeat("*")), map(str.startswith, strings, repeat("*."))))
    # No empty label: no '..' (a name of no labels at all, '', '.' or '*.', has no dot: the two-label test below).
    if ".." in joined:
        containing("..")
    # No hyphen at a label's edge: a label starts after a line break or a dot, and ends before one.
    if "\n-" in joined or "-\n" in joined or ".-" in joined or "-." in joined:
        containing(".-", "-.")
        where(map(str.startswith, strings, repeat("-")))
        where(map(str.endswith, strings, repeat("-")))
    # Two labels or more: the name (prefix and trailing dot taken off) has a dot.
    if not all(map(operator.contains, names, repeat("."))):
        where(map(operator.not_, map(operator.contains, names, repeat("."))))
    # Labels of at most 63 octets and names of at most 253: only a text longer than 63 can break either.
    if count and max(map(len, strings)) > MAX_LABEL:
        for position in compress(range(count), map(MAX_LABEL.__lt__, map(len, strings))):
            name = names[position]
            if len(name) > MAX_NAME or max(map(len, name.split("."))) > MAX_LABEL:
                found.add(position)
    # The last label not a number (decimal, or WHATWG's '0x' hex): such a host is an IPv4 address to a browser.
    # Only an entry that ends in a digit (and a dot perhaps), or has a label starting '0x', can have one: that much
    # is two substring searches, with every digit made '0' first (the regular expression is slower to search).
    digits_as_0 = ascii_text.translate(_DIGITS_AS_0) if ascii_text is not None else None
    if ((digits_as_0 is None or b"0\n" in digits_as_0 or b"0.\n" in digits_as_0 or ".0x" in joined)
            and _NUMBER_AT_END.search(joined)):
        where(map(_NUMBER_AT_END_OF_ONE, strings))
    # Not a local name, and no 'xn--' label (an A-label must be checked as one).
    for word in (*_LOCAL_WORDS, "xn--"):
        if word in joined:
            containing(word)
    return found
