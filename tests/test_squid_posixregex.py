"""squid_compat.posixregex against the regex engine squid really uses: glibc's POSIX ``regcomp`` (extended
syntax), called through ctypes. Whatever pattern ``squid_difference`` lets through must be read by Python's ``re``
exactly as glibc reads it: the same strings match (search) in both. ASCII only, so the locale plays no part."""

from __future__ import annotations

import ctypes
import ctypes.util
import re

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from squid_compat.posixregex import squid_difference

REG_EXTENDED, REG_ICASE, REG_NOSUB = 1, 2, 8
_LIBC = ctypes.CDLL(ctypes.util.find_library("c"))
_LIBC.regcomp.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
_LIBC.regexec.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int]
_LIBC.regfree.argtypes = [ctypes.c_void_p]


def posix_matches(pattern: str, subjects: list[str], icase: bool) -> list[bool] | None:
    """Which subjects glibc's regexec finds the pattern in; None when regcomp refuses the pattern."""
    compiled = ctypes.create_string_buffer(256)  # regex_t is 64 bytes on glibc x86-64: room to spare
    flags = REG_EXTENDED | REG_NOSUB | (REG_ICASE if icase else 0)
    if _LIBC.regcomp(compiled, pattern.encode(), flags) != 0:
        return None
    try:
        return [_LIBC.regexec(compiled, subject.encode(), 0, None, 0) == 0 for subject in subjects]
    finally:
        _LIBC.regfree(compiled)


PATTERN = st.text(alphabet="ab.-/\\*+?|()[]^${},1Z9", max_size=12)
SUBJECTS = st.lists(st.text(alphabet="abAB.-/\\1{},^_`Zz9", max_size=6), min_size=1, max_size=8)


@settings(max_examples=3000, deadline=None)
@given(PATTERN, SUBJECTS, st.booleans())
def test_what_squid_difference_lets_through_python_reads_as_glibc_does(pattern, subjects, icase):
    assume(squid_difference(pattern, icase) is None)
    posix = posix_matches(pattern, subjects, icase)
    try:
        python = re.compile(pattern, re.IGNORECASE if icase else 0)
    except re.error:
        python = None
    assert (posix is None) == (python is None), (pattern, posix)
    if python is not None:
        assert [python.search(s) is not None for s in subjects] == posix, (pattern, subjects, icase)


@pytest.mark.parametrize("pattern, icase", [(r"\x2fdl", False), (r"\d", False), (r"[\.]", False), (r"(?i)a", False),
                                            (r"a*?", False), (r"[[:alpha:]]", False), (r"a{2}{3}", False),
                                            ("[1-1-1]", False), ("[.^-b]", True)])  # the last two: found above
def test_patterns_the_two_read_differently_are_left_undecided(pattern, icase):
    assert squid_difference(pattern, icase) is not None
