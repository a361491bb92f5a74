"""policy.pattern_lists: a whole list of host patterns judged at once gives exactly what HostPattern.parse gives."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from policy.pattern_lists import plain_patterns
from policy.patterns import HostPattern, PatternKind

# Labels near every edge the list's tests look for: LDH labels up to and past 63 octets, upper case, 'xn--', a
# hyphen at either end, a number or '0x' hex, the local names and words that only contain them, '*', empty,
# characters outside LDH (line breaks, non-ASCII, '_').
edge_label = st.one_of(
    st.from_regex(r"[a-z0-9-]{1,10}", fullmatch=True),
    st.sampled_from(["xn--p1ai", "xn--zz", "r3---sn-abc", "0x7f", "0x", "0xg1", "08", "255", "localhost", "local",
                     "internal", "localdomain", "home", "arpa", "mylocal", "localbitcoins", "-a", "a-", "-", "",
                     "a" * 63, "b" * 64, "ü", "A", "a_b", "*", "**", "a*", "a\nb", "\n", " ", "a.b"]),
)


@st.composite
def edge_texts(draw):
    labels = draw(st.lists(edge_label, min_size=1, max_size=5))
    if draw(st.booleans()):
        labels.append(draw(st.sampled_from(["com", "local", "internal", "home.arpa", "localhost", "1", "0x1f"])))
    if draw(st.integers(0, 9)) == 0:  # past the 253-octet limit, or just below it
        labels = ["c" * 63] * draw(st.integers(3, 4)) + labels
    prefix = draw(st.sampled_from(["", "", "*.", ".", "*", "..", "*..", "**.", ".*."]))
    return prefix + ".".join(labels) + draw(st.sampled_from(["", "", ".", ".."]))


entries = st.one_of(edge_texts(), st.text(max_size=30), st.text(alphabet="ab.-*\n0x", max_size=12))


def _parsed(text: str) -> HostPattern | None:
    try:
        return HostPattern.parse(text)
    except ValueError:
        return None


@given(st.lists(entries, max_size=12))
@example(["a.example", "*.a.example", ".a.example", "a.example."])
@example(["a.b" * 126, "a." * 126 + "b", "a." * 126 + "bc", "c" * 63 + ".com", "c" * 64 + ".com"])
@example(["*.com", ".com", "com", "*.", ".", "", "..", "*..a.com", "a..com", "a.com.."])
@example(["a.1", "a.0x1f", "a.0xg", "a.1.", "1.2.3.4", "a.b1"])
@example(["a.local", "a.localhost.", "home.arpa", "x.home.arpa", "localbitcoins.com", "a.internal"])
@example(["-a.com", "a-.com", "a.-b.com", "a.b-.com", "a-b.com", "*.-a.com"])
@example(["xn--p1ai.com", "a.xn--p1ai", "a\nb.com", "a.com\n", "A.com", "ü.com", "a_b.com", "a b.com"])
def test_property_every_pattern_given_is_the_one_parse_gives(items) -> None:
    """A pattern comes back only for a text ``HostPattern.parse`` accepts, and it is the very pattern parse gives
    (kind, name, text); anything else (including what parse refuses) comes back None."""
    got = plain_patterns(items)
    assert len(got) == len(items)
    for item, pattern in zip(items, got, strict=True):
        if pattern is not None:
            assert type(pattern) is HostPattern
            assert pattern == _parsed(item), (item, pattern)


@given(st.lists(entries, max_size=12))
@example(["a.example", "a..example"])  # a finding for one entry of the list must not touch the others
@example(["b.local", "a.example"])
@example(["A.example", "a.example", "*.a.example"])
def test_property_each_entry_is_judged_on_its_own(items) -> None:
    """The tests run on the whole list, but an entry's answer is what it would be alone."""
    assert plain_patterns(items) == [plain_patterns([item])[0] for item in items]


plain_label = st.from_regex(r"[a-z](?:[a-z0-9-]{0,12}[a-z0-9])?", fullmatch=True).filter(
    lambda label: not any(word in label for word in ("local", "internal", "xn--")))


@given(st.lists(st.tuples(st.sampled_from(["", "*.", "."]), st.lists(plain_label, min_size=2, max_size=4),
                          st.booleans()), max_size=10))
def test_property_plainly_normal_entries_are_all_recognised(specs) -> None:
    """What a big allowlist is made of (LDH labels, a letter last, a prefix or none, a trailing dot or none)
    is recognised in bulk: none of it is left to be parsed alone."""
    items = [prefix + ".".join(labels) + ("." if dot else "") for prefix, labels, dot in specs]
    kinds = {"": PatternKind.EXACT, "*.": PatternKind.SUBDOMAINS, ".": PatternKind.DOMAIN}
    got = plain_patterns(items)
    assert None not in got
    assert [(p.kind, p.name) for p in got] == [(kinds[prefix], ".".join(labels)) for prefix, labels, _ in specs]


# One text at each edge of each test, alone in its list: then only the test for it can find it.
ODD = ["A.example", "a.exAmple", "ü.example", "a_b.example", "a b.example", "a\nb.example", "a.example\n",
       "\na.example", "a\tb.example", "*a.example", "a*.example", "a.*.example", "**.a.example", ".*.a.example",
       "*.*.a.example", "a..example", "..a.example", "*..a.example", "a.example..", "", ".", "*.", "*", "-a.example",
       "a-.example", "a.-b.example", "a.b-.example", "a.example-", "*.-a.example", ".-a.example", "-.a.example",
       "com", "*.com", ".com", "com.", "a" * 64 + ".example", "a." + "b" * 64, "a." * 126 + "bc", "a.1", "a.255.",
       "a.0x1f", "a.0x", "1.2.3.4", "a.local", "a.localhost", "a.localdomain.", "a.internal", "home.arpa",
       "x.home.arpa", "home.arpa.", "xn--p1ai.example", "a.xn--p1ai", "*.xn--bcher-kva.example"]


@pytest.mark.parametrize("text", ODD)
def test_an_odd_text_alone_is_left_to_parse(text: str) -> None:
    assert plain_patterns([text]) == [None]
    assert plain_patterns([text, "plain.example"]) == [None, HostPattern.parse("plain.example")]


# Fine, but unusual enough that a list's tests cannot clear them alone: parse judges them, and accepts them.
UNUSUAL = ["localbitcoins.example", "a.mylocal.example", "internal-tools.example", "b" * 63 + ".example",
           "a." * 126 + "b", "a.0xg", "a.b1", "1a.example"]


@pytest.mark.parametrize("text", UNUSUAL)
def test_an_unusual_text_gets_the_pattern_parse_gives(text: str) -> None:
    assert plain_patterns([text])[0] in (None, HostPattern.parse(text))


def test_an_exact_patterns_name_is_its_text() -> None:
    text = "exact.example.com"
    (pattern,) = plain_patterns([text])
    assert pattern is not None and pattern.name is text  # one string per exact entry, not two


def test_only_text_is_taken() -> None:
    with pytest.raises(TypeError):
        plain_patterns(["a.example", {"host": "b.example"}])  # type: ignore[list-item]


@pytest.mark.parametrize("size", [0, 1, 2000])
def test_a_long_list_with_a_few_odd_entries(size: int) -> None:
    items = [f"n{i}.example.com" for i in range(size)] + ["A.example", "x.local", "a..b", "b.xn--p1ai", "c.1"]
    got = plain_patterns(items)
    assert got[:size] == [HostPattern.parse(item) for item in items[:size]]
    assert got[size:] == [None] * 5
