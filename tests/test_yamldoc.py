"""policy.yamldoc: the strict loader's shortcuts (tag resolution, no path-resolver steps, origins and lists taken
in bulk) give exactly what PyYAML's own steps give."""

from __future__ import annotations

import re

import pytest
import yaml
from hypothesis import example, given
from hypothesis import strategies as st

from policy.errors import PolicyError
from policy.model import Origin
from policy.yamldoc import YamlDocument, _resolve, _StrictCLoader, _StrictLoader


class _Reference(yaml.SafeLoader):
    """The pure-Python loader with the same implicit tags and PyYAML's own resolve, descend and ascend."""


class _ReferenceC(yaml.CSafeLoader):
    """libyaml's loader the same way: what _StrictCLoader is without its shortcuts."""


_Reference.yaml_implicit_resolvers = _ReferenceC.yaml_implicit_resolvers = _StrictLoader.yaml_implicit_resolvers

# Scalars near every implicit tag: numbers, floats, booleans, null, merge and value keys, the YAML-only
# indicators, and text that starts like them.
scalar_text = st.one_of(
    st.text(alphabet="0123456789.-+_eExXoOabfilnrstuNTFY~<=!&* :", max_size=8),
    st.sampled_from(["", "~", "null", "Null", "NULL", "true", "False", "yes", "no", "on", "0", "-0", "+12", "0443",
                     "1_000", ".5", "-.inf", ".NaN", "1e3", "1.0e+3", "<<", "=", "!", "&", "*", "2024-01-01", "1:30"]),
)


@given(st.sampled_from([yaml.ScalarNode, yaml.SequenceNode, yaml.MappingNode]), scalar_text, st.booleans(),
       st.booleans())
@example(yaml.ScalarNode, "", True, False)
@example(yaml.ScalarNode, "true", False, True)  # quoted: text, whatever it spells
def test_property_resolve_gives_pyyaml_resolves_answer(kind, value, plain, quoted) -> None:
    expected = yaml.resolver.BaseResolver.resolve(_Reference(""), kind, value, (plain, quoted))
    assert _resolve(_StrictCLoader(""), kind, value, (plain, quoted)) == expected


def _shape(node: yaml.Node) -> object:
    marks = (node.start_mark.line, node.start_mark.column, node.end_mark.line, node.end_mark.column)
    if isinstance(node, yaml.ScalarNode):
        return ("scalar", node.tag, node.value, marks)
    if isinstance(node, yaml.SequenceNode):
        return ("seq", node.tag, [_shape(item) for item in node.value], marks)
    return ("map", node.tag, [(_shape(k), _shape(v)) for k, v in node.value], marks)


def _written(value: str, style: int) -> str:
    """The value plain (0), single-quoted (1) or double-quoted (2)."""
    if style == 1 or not value:
        return "'" + value.replace("'", "''") + "'"
    if style == 2:
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return value


@given(st.lists(st.tuples(scalar_text, st.integers(0, 2)), max_size=8), st.booleans())
@example([("!", 0), ("", 0), ("~", 0), ("1", 0), ("1", 1), ("true", 2), ("<<", 0)], False)
def test_property_the_c_loader_composes_what_it_composes_without_the_shortcuts(items, flow) -> None:
    """libyaml with the shortcuts builds the same tree, tags and marks as libyaml with PyYAML's own steps."""
    texts = [_written(value, style) for value, style in items]
    body = ("  allow: [" + ", ".join(texts) + "]\n") if flow else "  allow:\n" + "".join(f"    - {t}\n" for t in texts)
    text = "hosts:\n" + body + "  deny: {a: 1, b: [x, {c: d}]}\n"
    try:
        expected = yaml.compose(text, Loader=_ReferenceC)
    except yaml.YAMLError:  # a plain scalar YAML cannot hold ('*', ': ', ...): refused with the shortcuts too
        with pytest.raises(yaml.YAMLError):
            yaml.compose(text, Loader=_StrictCLoader)
        return
    assert _shape(yaml.compose(text, Loader=_StrictCLoader)) == _shape(expected)


def test_origins_of_items_are_each_items_origin() -> None:
    doc = YamlDocument.parse("hosts:\n  allow:\n    - a.example\n    - &x 'b.example'\n    - *x\n"
                             "    - [c, d]\n  deny: [e.example,\n    f.example]\n", "o.yaml")
    for path, count in ((("hosts", "allow"), 4), (("hosts", "deny"), 2)):
        bulk = doc.origins_of_items(path, count)
        assert bulk == [doc.origin((*path, i)) for i in range(count)]
        assert all(type(origin) is Origin for origin in bulk)
    assert doc.origins_of_items(("hosts", "deny"), 2) == [Origin("o.yaml", 7, 10, "hosts.deny[0]"),
                                                           Origin("o.yaml", 8, 5, "hosts.deny[1]")]
    assert doc.data["hosts"]["allow"] == ["a.example", "b.example", "b.example", ["c", "d"]]


def test_a_key_written_twice_is_found_inside_lists() -> None:
    text = "hosts:\n  allow:\n    - a.example\n    - [b, {host: c.example, host: d.example}]\n"
    doc = YamlDocument.parse(text, "d.yaml")
    assert [(p.line, p.column, p.message.split(" (")[0]) for p in doc.problems] == [(4, 29, "duplicate key")]


def test_a_list_of_text_is_constructed_as_text_only_when_every_item_is() -> None:
    doc = YamlDocument.parse("a: [x, 'y', !!str 3, 4]\nb: [x, y]\nc: []\n", "t.yaml")
    assert doc.data == {"a": ["x", "y", "3", 4], "b": ["x", "y"], "c": []}
    try:
        YamlDocument.parse("a: [x, !!python/name:os.system y]\n", "p.yaml")
    except PolicyError as err:
        assert "p.yaml:1:8" in str(err)
    else:
        raise AssertionError("a Python tag was constructed")


def test_a_list_of_text_is_known_as_such_until_it_changes() -> None:
    doc = YamlDocument.parse("a: [x, 'y']\nb: [x, 1]\nc: []\nd: [x, {k: v}]\ne: &e [p, q]\nf: *e\n", "k.yaml")
    a, b, c, d, e, f = (doc.data[key] for key in "abcdef")
    # Known from the parse (the very list in the data, an alias's too), not from a look at each item:
    assert all(doc._text_lists.get(id(known)) is known for known in (a, e, f)) and e is f
    assert len(doc._text_lists) == 2
    assert doc.only_text(a) and doc.only_text(c)  # c: empty, judged by a look at its (no) items
    assert not doc.only_text(b) and not doc.only_text(d)
    assert doc.only_text(list(a)) and not doc.only_text([*a, 3])  # a list the parse did not make: looked at
    a.append({"host": "z"})
    doc.changed(a)
    assert not doc.only_text(a)


@given(st.text(max_size=12), st.integers(0, 30))
@example("hosts.allow", 3)
@example("a%d%%b", 2)  # a '%' in the path is text, not a format
@example("a\nb", 2)  # a line break in the path: formatted one by one
def test_property_item_paths_are_each_items_path(at: str, count: int) -> None:
    from policy.yamldoc import _item_paths

    assert _item_paths(at, count) == [f"{at}[{i}]" for i in range(count)]


# ---- YAML aliases: a value named again (*name) is the very node its anchor (&name) named --------------------

def _parse_within(text: str, seconds: float = 20.0) -> YamlDocument | PolicyError:
    """The parse, or its refusal, run in a thread: a parse that walks an alias forever fails the test instead of
    hanging it (nothing here is timed; the bound is only how long a hang is waited for)."""
    import threading

    outcome: list[YamlDocument | PolicyError] = []

    def parse() -> None:
        try:
            outcome.append(YamlDocument.parse(text, "a.yaml"))
        except PolicyError as err:
            outcome.append(err)

    worker = threading.Thread(target=parse, daemon=True)
    worker.start()
    worker.join(seconds)
    assert outcome, f"the parse had not ended after {seconds:g}s (an alias walked without end)"
    return outcome[0]


@pytest.mark.parametrize(("text", "where"), [
    ("hosts:\n  allow: &x [*x]\n", "2:14"),  # a list that names itself
    ("a: &m {b: *m}\n", "1:11"),  # a mapping that holds itself
    ("hosts:\n  allow: &x\n    - a.example\n    - [b.example, [*x]]\n", "4:20"),  # deeper inside
])
def test_an_alias_inside_the_value_it_names_is_refused_at_the_alias(text: str, where: str) -> None:
    refused = _parse_within(text)
    assert isinstance(refused, PolicyError), refused
    assert f"a.yaml:{where}:" in str(refused) and "inside the value it names" in str(refused), str(refused)


def _laughs(levels: int, repeats: int) -> str:
    """Each list names the one before ``repeats`` times: repeats**levels values from a few lines."""
    lines = ["version: 1", "hosts:", "  allow:", "    - &l0 [" + ", ".join(["x.example"] * repeats) + "]"]
    lines += [f"    - &l{i} [" + ", ".join([f"*l{i - 1}"] * repeats) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_aliases_that_multiply_a_list_are_refused_at_the_first_alias() -> None:
    refused = _parse_within(_laughs(9, 9))  # 9**9: 387 million values from 13 lines
    assert isinstance(refused, PolicyError), refused
    assert "a.yaml:5:12:" in str(refused) and "may repeat at most 4 times" in str(refused), str(refused)


@pytest.mark.parametrize(("text", "where"), [
    # A list merged over another of another length took the rules' positions apart: an internal error (a
    # traceback on every reload beat, lint's exit 70) where a policy error belongs.
    ("hosts:\n  deny: [a.example, c.example]\n  <<: {deny: [b.example]}\n", "3:3"),
    ("hosts:\n  deny: [a.example]\n  <<: {deny: [b.example]}\n", "3:3"),  # same length: a rule at the wrong line
    ("base: &b {allow: [a.example]}\nroles:\n  - name: r\n    hosts: {<<: *b}\n", "4:13"),  # through an alias
    ("x: [{a: 1}, {<<: [{b: 2}, {c: 3}]}]\n", "1:14"),  # inside a list, a list of mappings merged
])
def test_a_yaml_merge_key_is_refused_at_the_key(text: str, where: str) -> None:
    refused = _parse_within(text)
    assert isinstance(refused, PolicyError), refused
    assert f"a.yaml:{where}:" in str(refused) and "merge key ('<<') is not supported" in str(refused), str(refused)


def test_a_key_spelt_like_a_merge_key_in_quotes_is_only_an_unknown_key() -> None:
    doc = _parse_within('hosts: {"<<": [b.example]}\n')
    assert isinstance(doc, YamlDocument) and doc.data == {"hosts": {"<<": ["b.example"]}}, doc


def test_an_alias_that_reuses_a_list_is_read() -> None:
    text = ("hosts:\n  allow: &shared [a.example, b.example]\nroles:\n  - name: r\n    clients: [10.0.0.0/8]\n"
            "    hosts:\n      allow: *shared\n      deny: [&one c.example, *one]\n")
    doc = _parse_within(text)
    assert isinstance(doc, YamlDocument), doc
    assert doc.data["roles"][0]["hosts"] == {"allow": ["a.example", "b.example"], "deny": ["c.example", "c.example"]}


@given(st.integers(1, 7), st.integers(1, 7))
def test_property_aliases_are_read_only_while_they_repeat_little(levels: int, repeats: int) -> None:
    """Accepted exactly when the values with aliases expanded stay within ALIAS_GROWTH times those written
    (plus a slack), and the data then holds every one of them. Written: each list and mapping once, and
    each item of a list of text; expanded: every node of the tree the aliases make (keys counted)."""
    from policy.yamldoc import _ALIAS_SLACK, ALIAS_GROWTH

    sizes = [1 + repeats]  # each list l_i, expanded: itself and its items
    for _ in range(1, levels):
        sizes.append(1 + repeats * sizes[-1])
    allow = 1 + sum(sizes)
    expanded = 6 + allow  # root, version's key and value, hosts' key, hosts, allow's key, then the list
    written = 3 + (1 + repeats) + (levels - 1)  # root, hosts, allow; l0 and its text; each later list
    outcome = _parse_within(_laughs(levels, repeats))
    if expanded > ALIAS_GROWTH * written + _ALIAS_SLACK:
        assert isinstance(outcome, PolicyError), (levels, repeats, expanded)
        assert "may repeat at most" in str(outcome), str(outcome)
    else:
        assert isinstance(outcome, YamlDocument), outcome

        def values(item) -> int:
            return 1 + sum(map(values, item)) if isinstance(item, list) else 1
        assert values(outcome.data["hosts"]["allow"]) == allow


def test_a_document_without_an_anchor_is_not_walked_for_aliases() -> None:
    """'&' appears nowhere: no alias can, and a big allowlist is answered from the text alone."""
    from policy.yamldoc import _alias_problem

    class Untouchable(yaml.SequenceNode):  # any walk would look at its value
        def __getattribute__(self, name: str):
            raise AssertionError(f"walked: {name}")

    assert _alias_problem(Untouchable("tag", []), "hosts: {allow: [a, '*.b']}") is None
    with pytest.raises(AssertionError, match="walked"):  # with an '&' in the text, it is walked
        _alias_problem(Untouchable("tag", []), "hosts: {allow: [a, '&b']}")


@pytest.mark.parametrize(("text", "says"), [
    ("hosts:\n  allow: " + "[" * 100_000 + "]" * 100_000 + "\n", "exceeded maximum nesting depth"),  # libyaml's
    ("hosts:\n  allow:\n" + "".join("  " * (i + 2) + "-\n" for i in range(3000)), "exceeded maximum nesting depth"),
    ("hosts:\n  allow: " + "[" * 500 + "]" * 500 + "\n", "nested more than 32 levels deep"),  # under libyaml's
    ("a: " + "{b: " * 40 + "c" + "}" * 40 + "\n", "nested more than 32 levels deep"),
])
def test_a_document_nested_too_deep_is_refused_with_a_position_not_a_crash(text: str, says: str) -> None:
    """Past libyaml's 1,000 levels the pure-Python retry ran out of stack (RecursionError: "internal error" at
    the command line); under it, the walks and the schema's validator did. A policy is a few levels deep."""
    refused = _parse_within(text)
    assert isinstance(refused, PolicyError), refused
    assert says in str(refused) and re.search(r"a\.yaml:\d+:\d+:", str(refused)), str(refused)


def test_a_document_at_the_depth_limit_is_read() -> None:
    from policy.yamldoc import MAX_DEPTH

    doc = _parse_within("a: " + "[" * (MAX_DEPTH - 1) + "x" + "]" * (MAX_DEPTH - 1) + "\n")
    assert isinstance(doc, YamlDocument), doc
