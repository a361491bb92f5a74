"""squid's regular expressions read with Python's ``re``, where that is safe.

squid compiles ACL regexes with POSIX ``regcomp`` (extended syntax, glibc, the C locale: one byte is one
character); the import evaluates and reasons about them with Python's ``re``. The two agree on a common
core only. Outside it they read the same text differently: ``\\x2f`` is ``/`` to Python and the letters
``x2f`` to squid, ``\\d`` is a digit to Python and a ``d`` to squid, ``[\\.]`` is a dot to Python and a
backslash or a dot to squid, ``(?i)`` is a flag to Python and an error to squid, ``ü?`` makes the whole
letter optional in Python and only its last byte in squid. A regex outside the core is *undecided*: no
answer, no proof, refused wherever its answer matters.

The core: ordinary ASCII characters and ``.``; ``\\`` before an ASCII punctuation character (that
character); bracket expressions without backslashes, nested brackets or POSIX classes; groups without
``(?``; ``|``, ``^``, ``$``; one repetition (``*``, ``+``, ``?``, ``{m}``, ``{m,}``, ``{m,n}`` up to
``MAX_REPEAT``) after an atom; a non-ASCII character only where no repetition applies to it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

try:  # Python 3.11+ keeps the parser here; sre_parse is its deprecated alias
    from re import _constants as sre_constants
    from re import _parser as sre_parse
except ImportError:  # pragma: no cover
    import sre_constants  # type: ignore[no-redef]
    import sre_parse  # type: ignore[no-redef]

MAX_REPEAT = 1000  # larger counts are left undecided (glibc's own limit is 32767; Python's parser overflows)
MAX_NESTING = 100  # deeper groups are left undecided (Python's parser recurses once a level)
_INTERVAL = re.compile(r"\{([0-9]+)(,([0-9]*))?\}")
_QUANTIFIERS = "*+?{"
# A bracket expression's members: single characters and ranges a-b, with a '-' first or last as a member (glibc
# refuses [1-1-1], which Python reads); where case is ignored, ranges only within the digits or the letters of one
# case (glibc refuses [^-b] then, which Python reads)
_SIMPLE_RANGES = re.compile(r"-?(?:[^-]-[^-]|[^-](?!-[^-\]]))*-?")
_SIMPLE_RANGES_ICASE = re.compile(r"-?(?:[0-9]-[0-9]|[a-z]-[a-z]|[A-Z]-[A-Z]|[^-](?!-[^-\]]))*-?")


def squid_difference(pattern: str, icase: bool = False) -> str | None:
    """None when Python's ``re`` reads the pattern as squid's POSIX regcomp does (``icase``: both ignoring case);
    else why not."""
    i, depth, atom = 0, 0, False  # atom: the last item can take a repetition
    n = len(pattern)
    while i < n:
        ch = pattern[i]
        if ch == "\\":
            escaped = pattern[i + 1:i + 2]
            if not escaped.isascii() or escaped.isalnum() or not escaped:
                return f"'\\{escaped}' means different things to Python and to squid's POSIX regex"
            i, atom = i + 2, True
        elif ch == "[":
            end, why = _bracket_end(pattern, i, icase)
            if why:
                return why
            i, atom = end + 1, True
        elif ch == "(":
            if pattern.startswith("(?", i):
                return "'(?' is Python syntax (an error to squid)"
            depth += 1
            if depth > MAX_NESTING:
                return f"groups nested deeper than {MAX_NESTING}"
            i, atom = i + 1, False
        elif ch == ")":
            depth -= 1
            if depth < 0:
                return "an unbalanced ')'"
            i, atom = i + 1, True
        elif ch in _QUANTIFIERS:
            length, why = _repetition(pattern, i, atom)
            if why:
                return why
            i, atom = i + length, False
        elif ch == "}":
            return "a '}' without '{'"
        else:
            if not ch.isascii() and pattern[i + 1:i + 2] and pattern[i + 1] in _QUANTIFIERS:
                return f"a repetition after {ch!r} applies to its last byte in squid, to the whole letter in Python"
            i, atom = i + 1, ch not in "|^$"
    return "an unbalanced '('" if depth else None


def _bracket_end(pattern: str, start: int, icase: bool) -> tuple[int, str | None]:
    """Where the bracket expression opened at ``start`` closes, or why it is outside the common core."""
    i = start + 1
    if pattern.startswith("^", i):
        i += 1
    members = i
    if pattern.startswith("]", i):
        i += 1  # a ']' first is a member, in both
    while i < len(pattern) and pattern[i] != "]":
        ch = pattern[i]
        if ch == "\\":
            return i, "a backslash in a bracket expression is a member to squid, an escape to Python"
        if ch == "[":
            return i, "'[' in a bracket expression (a POSIX class to squid, a nested set to newer Pythons)"
        if not ch.isascii():
            return i, f"{ch!r} in a bracket expression is one character to Python, several bytes to squid"
        if pattern.startswith(("--", "&&", "~~", "||"), i):
            return i, f"{pattern[i:i + 2]!r} in a bracket expression (set operations to newer Pythons)"
        i += 1
    if i >= len(pattern):
        return i, "an unterminated '['"
    if not (_SIMPLE_RANGES_ICASE if icase else _SIMPLE_RANGES).fullmatch(pattern, members, i):
        return i, ("a '-' in a bracket expression that is neither a member nor one range a-b"
                   + (" within the digits or the letters of one case (case is ignored)" if icase else ""))
    return i, None


def _repetition(pattern: str, start: int, atom: bool) -> tuple[int, str | None]:
    """The length of the repetition at ``start``, or why it is outside the common core."""
    if not atom:
        return 0, "a repetition of nothing"
    length = 1
    if pattern[start] == "{":
        match = _INTERVAL.match(pattern, start)
        if match is None:
            return 0, "a '{' that is not a repetition count {m}, {m,} or {m,n}"
        counts = [count for count in (match.group(1), match.group(3)) if count]
        if any(len(count) > 6 or int(count) > MAX_REPEAT for count in counts):
            return 0, f"a repetition count over {MAX_REPEAT}"
        if len(counts) == 2 and int(counts[1]) < int(counts[0]):
            return 0, "a repetition count {m,n} with n below m"
        length = match.end() - start
    if pattern[start + length:start + length + 1] and pattern[start + length] in _QUANTIFIERS:
        return 0, "a repetition of a repetition (lazy or possessive in Python)"
    return length, None


def parse(pattern: str, icase: bool) -> list | None:
    """Python's parse tree of a pattern in the common core (None otherwise, or when Python refuses it)."""
    if squid_difference(pattern, icase) is not None:
        return None
    try:
        return list(sre_parse.parse(pattern, re.IGNORECASE if icase else 0))
    except (re.error, OverflowError, RecursionError):
        return None


def compile_like_squid(pattern: str, icase: bool) -> tuple[re.Pattern[str] | None, str | None]:
    """(the compiled pattern, None), or (None, why it cannot be evaluated as squid would)."""
    why = squid_difference(pattern, icase)
    if why is not None:
        return None, why
    try:
        return re.compile(pattern, re.IGNORECASE if icase else 0), None
    except (re.error, OverflowError, RecursionError) as err:
        return None, f"not a regular expression Python reads ({err})"


def needs_char_outside(items: Iterable, alphabet: frozenset[str]) -> bool:
    """Every match of this parse tree contains a character outside ``alphabet`` (case ignored)."""
    for op, arg in items:
        if op == sre_constants.LITERAL and not _in_alphabet(chr(arg), alphabet):
            return True
        if op == sre_constants.IN and _set_misses(arg, alphabet):
            return True
        if op == sre_constants.SUBPATTERN and needs_char_outside(arg[-1], alphabet):
            return True
        if op in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT) and arg[0] >= 1 and \
                needs_char_outside(arg[2], alphabet):
            return True
        if op == sre_constants.BRANCH and all(needs_char_outside(branch, alphabet) for branch in arg[1]):
            return True
    return False


def _in_alphabet(ch: str, alphabet: frozenset[str]) -> bool:
    return ch in alphabet or ch.swapcase() in alphabet


def _set_misses(members: list, alphabet: frozenset[str]) -> bool:
    """A bracket expression that no character of the alphabet (either case) is in."""
    for ch in alphabet:
        for candidate in (ch, ch.swapcase()):
            inside = _set_contains(members, candidate)
            if inside is None or inside:
                return False
    return True


def _set_contains(members: list, ch: str) -> bool | None:
    """Is the character in the set (None: the set has a part this does not read)?"""
    negated, hit = False, False
    for op, arg in members:
        if op == sre_constants.NEGATE:
            negated = True
        elif op == sre_constants.LITERAL:
            hit = hit or chr(arg) == ch
        elif op == sre_constants.RANGE:
            hit = hit or arg[0] <= ord(ch) <= arg[1]
        else:
            return None
    return hit != negated
