"""``url_regex``: squid matches the whole request URL against a regex. egresswall has no URL regexes, but
a tunnel's URL is only its authority: squid matches a CONNECT against ``host:port`` (measured: squid 5.7
and 6). A regex that provably cannot match any ``host:port`` — it needs a ``/``, ``?`` or ``=``, or it
ends (``$``) in a character that is not a digit, as ``\\.exe$`` does — answers *no* for every CONNECT,
so a ``deny`` line with it leaves tunnels to squid's other lines. Everything else stays undecided (plain
HTTP: the answer depends on the path, which request classes do not carry).

The proof reads the regex's parse tree (``re._parser``) and only concludes from parts every match must
contain: literals in sequence, groups, repeats of at least one, alternatives that all agree. Anything it
does not understand counts as "may match", so it can be wrong only towards undecided (stricter). It reads
only regexes Python and squid's POSIX regcomp read alike (``posixregex``): ``\\x2f`` is ``/`` to Python but
the letters ``x2f`` to squid, which then matches a tunnel to ``x2fdl.test:443``.
"""

from __future__ import annotations

import string

from .acls import CONNECT, Acl, Context, Probe, Tri
from .posixregex import needs_char_outside, parse, squid_difference, sre_constants
from .report import NOTE, Note, Where

# Every character a CONNECT URL (host:port, an IPv6 literal in brackets) can contain.
AUTHORITY_CHARS = frozenset(string.ascii_letters + string.digits + ".-_:[]")
DIGITS = frozenset(string.digits)


def never_matches_authority(pattern: str, icase: bool) -> bool:
    """True when no ``host:port`` string can contain a match of this regex (as squid reads it)."""
    items = parse(pattern, icase)
    if items is None:
        return False
    if needs_char_outside(items, AUTHORITY_CHARS):
        return True
    # "...X$" with X never a digit: an authority always ends in its port's digits.
    if items and items[-1] == (sre_constants.AT, sre_constants.AT_END) and len(items) >= 2:
        last = _last_chars(items[-2])
        return last is not None and not (last & DIGITS)
    return False


def _last_chars(item) -> frozenset[str] | None:
    """The characters a match of this item can end with, or None when that is not known."""
    op, arg = item
    if op == sre_constants.LITERAL:
        return frozenset({chr(arg), chr(arg).swapcase()})
    if op == sre_constants.SUBPATTERN:
        inner = list(arg[-1])
        return _last_chars(inner[-1]) if inner else None
    if op in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT) and arg[0] >= 1:
        inner = list(arg[2])
        return _last_chars(inner[-1]) if inner else None
    if op == sre_constants.BRANCH:
        out: set[str] = set()
        for branch in arg[1]:
            branch = list(branch)
            last = _last_chars(branch[-1]) if branch else None
            if last is None:
                return None
            out |= last
        return frozenset(out)
    if op == sre_constants.IN and all(kind == sre_constants.LITERAL for kind, _ in arg):
        return frozenset(c for _, value in arg for c in (chr(value), chr(value).swapcase()))
    return None


class UrlRegexAcl(Acl):
    """``url_regex``: no for a CONNECT when no value can match an authority; undecided otherwise."""

    def __init__(self, name: str, type_: str) -> None:
        super().__init__(name, type_)
        self.tunnel_safe = True  # every value provably misses every host:port

    def add(self, flags: list[str], values: list[tuple[str, Where]], notes: list[Note]) -> None:
        icase = False
        for raw, where in values:
            if raw in ("-i", "+i"):
                icase = raw == "-i"
                continue
            if never_matches_authority(raw, icase):
                notes.append(Note(where, f"acl {self.name} url_regex {raw}: cannot match a tunnel's URL (host:port), "
                                         "so it is decided for CONNECT (no match); plain-HTTP requests depend on "
                                         "the path, which egresswall does not translate: undecided there "
                                         "(refused where it decides)", "url-regex", NOTE))
            else:
                self.tunnel_safe = False
                why = squid_difference(raw, icase)
                reason = f"{why}, so nothing is proved about it" if why else \
                    "may match a tunnel's URL (host:port) or a path egresswall does not see"
                notes.append(Note(where, f"acl {self.name} url_regex {raw}: {reason}; undecided for every request "
                                         "(refused where it decides)", "url-regex"))

    def _evaluate(self, probe: Probe, ctx: Context) -> Tri:
        if probe.kind == CONNECT and self.tunnel_safe:
            return False
        return None
