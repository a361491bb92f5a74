"""A YAML document that remembers where everything was written: text in, data plus positions out.

Pure: it parses text it is given and never opens a file. YAML is read strictly (see ``_StrictLoader``), and
every key path of the data leads back to a ``file:line:column`` (or to the command-line flag that added the
value), so that each problem found later can point at the line to fix.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Iterable
from functools import partial
from itertools import repeat
from typing import Any

import yaml

from .errors import PolicyError, PolicyProblem
from .model import Origin

KeyPath = tuple[str | int, ...]
_tuple_new = tuple.__new__


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that reads plain scalars as YAML 1.2 (what editors validating with schema.json use).

    YAML 1.1 traps are removed, not guessed at: dates stay text (checked by the schema); only
    true/false are booleans (``default: no`` is the text 'no', an error, not False); integers are
    plain decimals (``0443`` is not octal 291 and ``1:30`` not sexagesimal 90: both are text, an error).
    Duplicate keys (YAML would silently keep the last one) are found by ``YamlDocument``.
    """

    text_lists: dict[int, list[str]]  # each list constructed from text scalars only, by id()

    def construct_list(self, node: yaml.SequenceNode) -> Any:
        """A YAML sequence. One of text items only (a host allowlist, up to a million of them) is built without a
        Python step per item: the test and the values are taken by C-level maps, and the list is remembered
        (``text_lists``), so that nothing later has to look at every item again to know it holds only ``str``.
        (Text cannot refer back to its list, so the list is built at once, not filled afterwards as SafeLoader
        does to allow for that.) Any other sequence is SafeLoader's."""
        items = node.value
        if _only_text(items):
            values = list(map(_value_of, items))
            self.text_lists[id(values)] = values
            return values
        return yaml.constructor.SafeConstructor.construct_yaml_seq(self, node)


_STR = "tag:yaml.org,2002:str"
_BOOL_TAG, _INT_TAG, _FLOAT_TAG = "tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_YAML11_ONLY = {"tag:yaml.org,2002:timestamp", _BOOL_TAG, _INT_TAG, _FLOAT_TAG}
# YAML 1.2's core schema, less what a policy has no use for and would only mislead: a leading zero (YAML 1.1
# reads 0443 as octal 291), ``1_000`` and ``1:30`` (1.1's separators and sexagesimal), and ``.inf`` / ``.nan``
# (no bound of the schema holds against NaN: ``resolver.timeout: .nan`` loaded and refused every name).
_BOOLS = {"true": True, "True": True, "TRUE": True, "false": False, "False": False, "FALSE": False}
_INT = re.compile(r"[-+]?(?:0|[1-9][0-9]*)")
_FLOAT = re.compile(r"[-+]?(?:(?:0|[1-9][0-9]*)(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")  # an integer too
MAX_DIGITS = 20  # an integer's digits at most: more than any count, size or port a policy holds
_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in _YAML11_ONLY]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_StrictLoader.add_implicit_resolver(_BOOL_TAG, re.compile(f"^(?:{'|'.join(_BOOLS)})$"), list("tTfF"))
_StrictLoader.add_implicit_resolver(_INT_TAG, re.compile(f"^{_INT.pattern}$"), list("-+0123456789"))
_StrictLoader.add_implicit_resolver(_FLOAT_TAG, re.compile(f"^(?:{_FLOAT.pattern})$"), list("-+.0123456789"))


def _scalar_error(node: yaml.ScalarNode, message: str) -> yaml.constructor.ConstructorError:
    return yaml.constructor.ConstructorError(None, None, message, node.start_mark)


def _construct_bool(loader: yaml.constructor.SafeConstructor, node: yaml.ScalarNode) -> bool:
    """A boolean, written plainly or tagged ``!!bool``: true or false only (``!!bool yes`` is YAML 1.1's)."""
    value = loader.construct_scalar(node)
    if value not in _BOOLS:
        raise _scalar_error(node, f"got {value!r} as a boolean; expected true or false")
    return _BOOLS[value]


def _construct_int(loader: yaml.constructor.SafeConstructor, node: yaml.ScalarNode) -> int:
    """An integer, written plainly or tagged ``!!int``: decimal digits without a leading zero, at most
    MAX_DIGITS of them (Python refuses to read one of over 4,300 digits, which was an internal error)."""
    value = loader.construct_scalar(node)
    if not _INT.fullmatch(value):
        raise _scalar_error(node, f"got {value!r} as an integer; expected decimal digits without a leading zero "
                                  "(YAML 1.1 would read 0443 as octal, 1:20 as sexagesimal)")
    if len(value.lstrip("+-")) > MAX_DIGITS:
        raise _scalar_error(node, f"got an integer of {len(value.lstrip('+-'))} digits; expected at most {MAX_DIGITS}")
    return int(value)


def _construct_float(loader: yaml.constructor.SafeConstructor, node: yaml.ScalarNode) -> float:
    """A number with a fraction or an exponent, written plainly or tagged ``!!float``: finite only (``.nan``,
    ``.inf`` and ``1e999`` are refused: no bound of the schema holds against them)."""
    value = loader.construct_scalar(node)
    if not _FLOAT.fullmatch(value):
        raise _scalar_error(node, f"got {value!r} as a number; expected a decimal number such as 2 or 0.5")
    number = float(value)
    if not math.isfinite(number):
        raise _scalar_error(node, f"got {value!r}, which is not a finite number; expected a decimal number such as "
                                  "2 or 0.5")
    return number


for _tag, _construct in ((_BOOL_TAG, _construct_bool), (_INT_TAG, _construct_int), (_FLOAT_TAG, _construct_float)):
    _StrictLoader.add_constructor(_tag, _construct)

# The implicit resolvers by a plain scalar's first character ('' for the empty scalar), each list with the
# wildcard resolvers (key None, tried after the others) behind it, as BaseResolver.resolve tries them.
_WILDCARD = tuple(_StrictLoader.yaml_implicit_resolvers.get(None, ()))
_IMPLICIT = {first: (*resolvers, *_WILDCARD) for first, resolvers in _StrictLoader.yaml_implicit_resolvers.items()
             if first is not None}
if _StrictLoader.yaml_path_resolvers:  # _resolve and the C loader's no-op descent rely on there being none
    raise RuntimeError("policy YAML loader: path resolvers are registered; _resolve does not apply them")


def _resolve(self: yaml.resolver.BaseResolver, kind: type[yaml.Node], value: Any,
             implicit: tuple[bool, bool]) -> str | None:
    """``BaseResolver.resolve`` for these loaders, the same answer in fewer steps: called once per scalar by the
    C loader (a million times for a big allowlist), and most host names start with a letter no implicit tag
    can start with, so they are text after one dict lookup. No path resolvers are registered, so the
    resolvers of the value's first character (and the wildcard ones) are all there is to try."""
    if kind is yaml.ScalarNode:
        if implicit[0]:
            for tag, regexp in _IMPLICIT.get(value[:1], _WILDCARD):
                if regexp.match(value):
                    return tag
        return _STR
    if kind is yaml.SequenceNode:
        return yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG
    if kind is yaml.MappingNode:
        return yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG
    return None


def plain_reads_as_text(scalar: str) -> bool:
    """Whether ``scalar``, written unquoted, is read as text by a policy's YAML (not a number, a boolean or null):
    for tools that write policies (``squid import``), which quote what is not."""
    return _resolve(None, yaml.ScalarNode, scalar, (True, False)) == _STR  # type: ignore[arg-type]


_StrictLoader.resolve = _resolve  # type: ignore[method-assign]
_StrictLoader.add_constructor("tag:yaml.org,2002:seq", _StrictLoader.construct_list)


class _StrictCLoader(yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader):  # type: ignore[misc]
    """The same rules, with libyaml doing the parsing: a million-entry allowlist composes in seconds.

    libyaml's composer calls back into Python for every node: to resolve its tag, and to descend into and
    ascend from it for path resolvers. There are none, so descending and ascending are C built-ins that do
    nothing with their arguments (``operator.is_`` compares the parent and index and the answer is dropped;
    ``tuple()`` returns the empty tuple): two Python calls fewer per scalar.
    """

    resolve = _resolve
    descend_resolver = staticmethod(operator.is_)
    ascend_resolver = staticmethod(tuple)


_StrictCLoader.yaml_implicit_resolvers = _StrictLoader.yaml_implicit_resolvers
_value_of, _tag_of = operator.attrgetter("value"), operator.attrgetter("tag")
_start_of, _line_of, _column_of = map(operator.attrgetter, ("start_mark", "line", "column"))


def _only_scalars(nodes: list[yaml.Node]) -> bool:
    return set(map(type, nodes)) == {yaml.ScalarNode}


def _only_text(nodes: list[yaml.Node]) -> bool:
    """Every node a scalar tagged as text (written plainly or quoted, or with ``!!str``), none of them a list
    or a mapping. False for no nodes: an empty list is constructed the usual way."""
    return _only_scalars(nodes) and set(map(_tag_of, nodes)) == {_STR}


class YamlDocument:
    """The YAML data plus a way back from any key path to where it was written.

    ``problems`` holds what was wrong but did not stop the parse (duplicate keys); a document that is
    not YAML at all raises ``PolicyError`` from ``parse``.
    """

    def __init__(self, source: str, root: yaml.Node | None, data: Any, problems: list[PolicyProblem],
                 text_lists: dict[int, list[str]] | None = None) -> None:
        self.source, self.root, self.data = source, root, data
        self.problems = problems
        self.extra_origins: dict[KeyPath, Origin] = {}  # values added by command-line flags
        # The data's lists that hold only str, as constructed, by id() (held, so that no other list takes the id).
        self._text_lists = text_lists or {}

    def only_text(self, values: list[Any]) -> bool:
        """Every item of this list of the data is a ``str``: known without a look at each item when the list was
        constructed from text scalars and not changed since (``changed``)."""
        return self._text_lists.get(id(values)) is values or set(map(type, values)) <= {str}

    def changed(self, values: list[Any]) -> None:
        """A list of the data was changed after the parse (a command-line addition): judge it afresh."""
        self._text_lists.pop(id(values), None)

    @property
    def is_empty(self) -> bool:
        return self.root is None or (isinstance(self.root, yaml.ScalarNode)
                                     and self.root.tag == "tag:yaml.org,2002:null")

    @classmethod
    def parse(cls, text: str, source: str) -> YamlDocument:
        try:
            root = _compose(text)
        except yaml.MarkedYAMLError as err:
            raise _yaml_error(source, err, "not valid YAML") from None
        except yaml.YAMLError as err:
            raise PolicyError(source, 0, 0, "", f"not valid YAML: {err}") from None
        if root is None:
            return cls(source, None, None, [])
        alias_problem = _alias_problem(root, text)
        if alias_problem is not None:
            raise _alias_error(text, source, alias_problem)
        merge = _merge_key(root)
        if merge is not None:
            mark = merge.start_mark
            raise PolicyError(source, mark.line + 1, mark.column + 1, "<<",
                              "a YAML merge key ('<<') is not supported in a policy: write the keys out (a rule "
                              "stands where it is written, once)")
        deep = _too_deep(root)
        if deep is not None:
            mark = deep.start_mark
            raise PolicyError(source, mark.line + 1, mark.column + 1, "",
                              f"lists and mappings nested more than {MAX_DEPTH} levels deep; a policy is a few levels "
                              "deep")
        problems = list(_duplicate_keys(root, source))
        loader = _StrictLoader("")
        loader.text_lists = {}
        try:
            data = loader.construct_document(root)
        except yaml.MarkedYAMLError as err:  # an unhashable (complex) key, an unknown tag such as !!python/...
            raise _yaml_error(source, err, "not valid policy YAML") from None
        finally:
            loader.dispose()
        return cls(source, root, data, problems, loader.text_lists)

    def origin(self, path: KeyPath) -> Origin:
        if path in self.extra_origins:
            return self.extra_origins[path]
        node = self.root
        for step in path:
            child = _child(node, step)
            if child is None:
                break
            node = child
        mark = node.start_mark if node is not None else None
        return Origin(self.source, mark.line + 1 if mark else 0, mark.column + 1 if mark else 0, dotted(path))

    def origins_of_items(self, path: KeyPath, count: int) -> list[Origin]:
        """The origins of items 0..count-1 of the list at path (one walk for the list, not one per item)."""
        node = self.root
        for step in path:
            node = _child(node, step) if node is not None else None
        if not isinstance(node, yaml.SequenceNode) or any(key[:-1] == path for key in self.extra_origins):
            return [self.origin((*path, i)) for i in range(count)]
        # A million of these for a big allowlist: each field is taken by a C-level map (the marks' 0-based line and
        # column made 1-based, the key path formatted) and each tuple built directly, without Origin's Python
        # __new__; no Python bytecode runs per item.
        marks = list(map(_start_of, node.value[:count]))
        return list(map(partial(_tuple_new, Origin), zip(
            repeat(self.source),
            map((1).__add__, map(_line_of, marks)),
            map((1).__add__, map(_column_of, marks)),
            _item_paths(dotted(path), len(marks)), strict=False)))

    def problem(self, path: KeyPath, message: str) -> PolicyProblem:
        origin = self.origin(path)  # a value added by a flag names the flag, not the file
        return PolicyProblem(origin.source, origin.line, origin.column, dotted(path), message)

    def key_problem(self, path: KeyPath, key: str, message: str) -> PolicyProblem:
        """A problem with a key itself (an unknown key): point at the key, not at its mapping."""
        node = self.root
        for step in path:
            node = _child(node, step)
        for key_node, _ in node.value if isinstance(node, yaml.MappingNode) else ():
            if isinstance(key_node, yaml.ScalarNode) and key_node.value == key:
                mark = key_node.start_mark
                return PolicyProblem(self.source, mark.line + 1, mark.column + 1, dotted((*path, key)), message)
        return self.problem(path, message)

    def error(self, path: KeyPath, message: str) -> PolicyError:
        return PolicyError.of([self.problem(path, message)])


def _item_paths(at: str, count: int) -> list[str]:
    """``[f"{at}[{i}]" for i in range(count)]``, formatted as one text and split (a third faster than a format per
    item, for the million item paths of a big allowlist)."""
    if "\n" in at:
        return [f"{at}[{i}]" for i in range(count)]
    item = at.replace("%", "%%") + "[%d]\n"
    paths = ((item * count) % tuple(range(count))).split("\n")
    paths.pop()  # the '' after the last line break
    return paths


def dotted(path: Iterable[str | int]) -> str:
    """("hosts", "allow", 3, "ports") → "hosts.allow[3].ports"."""
    out = ""
    for step in path:
        out += f"[{step}]" if isinstance(step, int) else (f".{step}" if out else step)
    return out


def _compose(text: str) -> yaml.Node | None:
    """libyaml for speed; on an error, the pure-Python parser again for its more precise message — unless
    that one runs out of Python's stack (a document nested past libyaml's limit of 1,000 levels): then
    libyaml's error it is."""
    try:
        return yaml.compose(text, Loader=_StrictCLoader)
    except yaml.YAMLError as err:
        try:
            return yaml.compose(text, Loader=_StrictLoader)
        except RecursionError:
            raise err from None


MAX_DEPTH = 32  # lists and mappings inside each other; a policy is at most eight or so levels deep


def _too_deep(root: yaml.Node) -> yaml.Node | None:
    """The first list or mapping nested deeper than MAX_DEPTH, or None. Iterative (the walks after it, and
    the schema's validator, recurse: a document a few hundred levels deep ran them out of stack); called
    once aliases are known to be bounded."""
    stack = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            return node
        if not _scalar_list(node):
            stack.extend((child, depth + 1) for child in _children(node) if not isinstance(child, yaml.ScalarNode))
    return None


def _yaml_error(source: str, err: yaml.MarkedYAMLError, what: str) -> PolicyError:
    mark = err.problem_mark or err.context_mark
    line, column = (mark.line + 1, mark.column + 1) if mark else (0, 0)
    return PolicyError(source, line, column, "", f"{what}: {err.problem or err}")


ALIAS_GROWTH = 4  # a document's aliases may make it at most this many times the values written (plus _ALIAS_SLACK)
_ALIAS_SLACK = 1000


def _alias_problem(root: yaml.Node, text: str) -> str | None:
    """What is wrong with the document's YAML aliases (``*name``), or None.

    The composer makes an alias the very node its anchor (``&name``) named, so every later walk goes through
    it each time it is named: nine lists each naming the one before nine times make a billion values out of
    ten lines, and a list that names itself (``&x [*x]``) never ends. Refused: an alias inside what it
    names, and aliases that make the document more than ALIAS_GROWTH times the values written. One walk, each
    list and mapping once, its expanded size kept (a list of text only is counted, not walked). An alias needs
    an anchor, written with ``&``: a document without one is answered from its text alone."""
    if "&" not in text:
        return None
    expanded: dict[int, int] = {}  # id of a finished list or mapping -> its values, aliases expanded
    open_: set[int] = set()  # started, not finished: the path from the root
    written = 0
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        if finished:
            open_.discard(key)
            expanded[key] = 1 + (len(node.value) if _scalar_list(node) else sum(
                expanded.get(id(child), 1) for child in _children(node)))
            continue
        if key in expanded or isinstance(node, yaml.ScalarNode):
            continue  # named again (counted where it was written), or a value with nothing inside
        if key in open_:
            return "cycle"
        open_.add(key)
        written += 1
        stack.append((node, True))
        if _scalar_list(node):
            written += len(node.value)
        else:
            stack.extend((child, False) for child in _children(node))
    total = expanded.get(id(root), 1)
    if total > ALIAS_GROWTH * written + _ALIAS_SLACK:
        return f"its aliases make the document {total:,} values long, from {written:,} written"
    return None


def _scalar_list(node: yaml.Node) -> bool:
    return isinstance(node, yaml.SequenceNode) and _only_scalars(node.value)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return node.value if isinstance(node, yaml.SequenceNode) else []


def _alias_error(text: str, source: str, problem: str) -> PolicyError:
    """The refusal, at the alias that names what holds it (a cycle) or at the first alias written (the parser's
    events: a composed node carries its anchor's position, not the alias's)."""
    anchors_open: list[str | None] = []
    first: yaml.AliasEvent | None = None
    for event in yaml.parse(text, Loader=_StrictCLoader):
        if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            anchors_open.append(event.anchor)
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            anchors_open.pop()
        elif isinstance(event, yaml.AliasEvent):
            first = first or event
            if problem == "cycle" and event.anchor in anchors_open:
                return _at(source, event, f"a YAML alias (*{event.anchor}) inside the value it names: the "
                                          "value would never end")
    if first is None:
        return PolicyError(source, 0, 0, "", f"not a policy: {problem}")
    return _at(source, first, f"{problem}; a policy's YAML aliases (*{first.anchor}) may repeat at most "
                              f"{ALIAS_GROWTH} times what is written: write the values out")


def _at(source: str, event: yaml.Event, message: str) -> PolicyError:
    return PolicyError(source, event.start_mark.line + 1, event.start_mark.column + 1, "", message)


def _merge_key(root: yaml.Node) -> yaml.Node | None:
    """The first YAML merge key (``<<``, which copies keys from another mapping), or None. Refused before the
    document is built: the merged data no longer matches the nodes every rule's position is read from (a list
    merged over another took their lengths apart). Iterative; called once aliases are known to be bounded."""
    stack = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if key.tag == "tag:yaml.org,2002:merge":
                    return key
                stack.append(value)
        elif isinstance(node, yaml.SequenceNode) and not _only_scalars(node.value):
            stack.extend(node.value)
    return None


def _duplicate_keys(root: yaml.Node, source: str) -> Iterable[PolicyProblem]:
    """Every key written twice in one mapping. Iterative: a deep document must not exhaust the stack."""
    stack = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, yaml.Node] = {}
            for key, value in node.value:
                name = key.value if isinstance(key, yaml.ScalarNode) else id(key)
                if name in seen:
                    first = seen[name].start_mark.line + 1
                    mark = key.start_mark
                    yield PolicyProblem(source, mark.line + 1, mark.column + 1, str(name),
                                        f"duplicate key (first written on line {first}); YAML would keep only the last")
                else:
                    seen[name] = key
                stack.append(value)
        elif isinstance(node, yaml.SequenceNode) and not _only_scalars(node.value):  # a scalar holds no key
            stack.extend(node.value)


def _child(node: yaml.Node | None, step: str | int) -> yaml.Node | None:
    if isinstance(node, yaml.MappingNode) and isinstance(step, str):
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.value == step:
                return value
    if isinstance(node, yaml.SequenceNode) and isinstance(step, int) and step < len(node.value):
        return node.value[step]
    return None
