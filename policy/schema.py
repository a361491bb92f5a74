"""The policy document against ``schema.json``, every error turned into "what was found, what was expected".

``schema.json`` is this package's own data, shipped beside this module for editors to validate with. It is
read once, when this module is imported, through ``importlib.resources`` (as an import reads a module's
code): the schema is part of the program, not input, and nothing here reads a file at decision or load
time after that. Its validators are built on first use and kept.
"""

from __future__ import annotations

import json
import math
import re
import reprlib
from collections.abc import Iterable
from functools import cache
from importlib import resources
from typing import Any

import jsonschema

from .errors import PolicyProblem
from .yamldoc import KeyPath, YamlDocument

SCHEMA: dict[str, Any] = json.loads(resources.files(__package__).joinpath("schema.json").read_text("utf-8"))


def schema() -> dict[str, Any]:
    return SCHEMA


def schema_problems(doc: YamlDocument) -> tuple[list[PolicyProblem], list[KeyPath]]:
    """Every schema error of the document, and the key paths whose values cannot be used because of them.

    Host lists can hold a million plain strings, so they are checked apart: a non-empty string is a valid
    entry by the schema's own rule (its pattern is judged later, with a reason), and only mapping entries
    go through the validator.
    """
    problems: list[PolicyProblem] = []
    bad: list[KeyPath] = []
    slim, host_lists = _without_host_entries(doc.data)
    _collect(doc, _document_validator().iter_errors(slim), (), problems, bad)
    entry_validator = _entry_validator()
    for path, entries in host_lists:
        if doc.only_text(entries) and all(entries):
            continue  # non-empty strings only (a big allowlist): known from the parse, and one pass in C
        for i, entry in enumerate(entries):
            if not (isinstance(entry, str) and entry):
                _collect(doc, entry_validator.iter_errors(entry), (*path, i), problems, bad)
    return problems, bad


def _collect(doc: YamlDocument, errors: Iterable[jsonschema.ValidationError], prefix: KeyPath,
             problems: list[PolicyProblem], bad: list[KeyPath]) -> None:
    seen: set[tuple[KeyPath, str]] = set()
    for err in (specific for found in errors for specific in _most_specific(found)):
        path = (*prefix, *err.absolute_path)
        if err.validator == "additionalProperties" and isinstance(err.instance, dict):
            known = err.schema.get("properties", {})
            allowed = ", ".join(sorted(known))
            for key in (key for key in err.instance if key not in known):  # in file order
                problems.append(doc.key_problem(path, str(key), f"unknown key {key!r}; expected one of: {allowed}"))
                bad.append((*path, str(key)))
            continue
        message = _explain(err)
        if (path, message) in seen:
            continue
        seen.add((path, message))
        problems.append(doc.problem(path, message))
        if err.validator == "required" and isinstance(err.instance, dict):
            bad.extend((*path, key) for key in err.validator_value if key not in err.instance)
        else:
            bad.append(path)


def _is_integer(checker: object, value: object) -> bool:
    return type(value) is int  # not a bool, and not 443.0, which JSON Schema counts as an integer


def _is_number(checker: object, value: object) -> bool:
    return type(value) is int or (type(value) is float and math.isfinite(value))  # NaN passes every bound


# JSON Schema's types, strict: a port, a count or a size is an int (443.0 reached the port lists, which read
# it as text), and a number is finite (a policy's YAML refuses .nan and .inf; json.loads, for the admin API,
# reads NaN and Infinity).
_Validator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine_many({"integer": _is_integer,
                                                                             "number": _is_number}))


@cache
def _document_validator() -> jsonschema.Draft202012Validator:
    return _Validator(SCHEMA)


@cache
def _entry_validator() -> jsonschema.Draft202012Validator:
    return _Validator({"$ref": "#/$defs/hostEntry", "$defs": SCHEMA["$defs"]})


def definition_problems(data: Any, definition: str) -> list[tuple[KeyPath, str]]:
    """(key path, message) for every error of ``data`` (parsed JSON, e.g. an admin API body) against one of
    the schema's ``$defs``, with the policy file's words ("what was found, what was expected")."""
    problems: list[tuple[KeyPath, str]] = []
    for err in (specific for found in _definition_validator(definition).iter_errors(data)
                for specific in _most_specific(found)):
        path = tuple(err.absolute_path)
        if err.validator == "additionalProperties" and isinstance(err.instance, dict):
            allowed = ", ".join(sorted(err.schema.get("properties", {})))
            problems.extend(((*path, str(key)), f"unknown key {key!r}; expected one of: {allowed}")
                            for key in err.instance if key not in err.schema.get("properties", {}))
            continue
        problems.append((path, _explain(err)))
    return problems


@cache
def _definition_validator(definition: str) -> jsonschema.Draft202012Validator:
    return _Validator({"$ref": f"#/$defs/{definition}", "$defs": SCHEMA["$defs"]})


def _without_host_entries(data: Any) -> tuple[Any, list[tuple[KeyPath, list[Any]]]]:
    """A shallow copy of the document with every host list emptied, and the lists taken out."""
    lists: list[tuple[KeyPath, list[Any]]] = []

    def strip(hosts: Any, at: KeyPath) -> Any:
        if not isinstance(hosts, dict):
            return hosts
        out = dict(hosts)
        for action in ("allow", "deny"):
            if isinstance(out.get(action), list):
                lists.append(((*at, action), out[action]))
                out[action] = []
        return out

    if not isinstance(data, dict):
        return data, lists
    slim = dict(data)
    if "hosts" in slim:
        slim["hosts"] = strip(slim["hosts"], ("hosts",))
    if isinstance(slim.get("roles"), list):
        slim["roles"] = [
            {**role, "hosts": strip(role["hosts"], ("roles", i, "hosts"))} if isinstance(role, dict) and "hosts" in role
            else role for i, role in enumerate(slim["roles"])]
    return slim, lists


def _most_specific(err: jsonschema.ValidationError) -> list[jsonschema.ValidationError]:
    """For a oneOf (a host pattern string or a mapping; a port or a range), every error of the branch the operator
    was evidently writing: the one of the value's own type (a mapping's, a string's), all of its errors at once
    (a rule with bad methods, ports and paths gets three, not the deepest one)."""
    if err.validator != "oneOf" or not err.context:
        return [err]
    mapping = isinstance(err.instance, dict)
    candidates = [e for e in err.context if (e.schema.get("type") == "object") == mapping
                  or e.relative_schema_path[0] == (1 if mapping else 0)] or list(err.context)
    # A branch whose own type the value is not ("80 - 90" against the integer branch) is not the one meant.
    typed = [e for e in candidates if not (e.validator == "type" and not e.relative_path)]
    candidates = typed or candidates
    chosen = max(candidates, key=lambda e: len(e.absolute_path)).relative_schema_path[0]
    return [found for e in candidates if e.relative_schema_path[0] == chosen for found in _most_specific(e)]


def _explain(err: jsonschema.ValidationError) -> str:
    """Turn a schema error into 'what was found, what was expected'. What was found is shown shortened (a
    list of a million names in the wrong place is named by its first few)."""
    kind, expected, found = err.validator, err.validator_value, _Shown(err.instance)
    if kind == "required":
        missing = [key for key in expected if not isinstance(err.instance, dict) or key not in err.instance]
        return f"missing key; expected {', '.join(map(repr, missing or expected))}"
    if kind == "enum":
        return f"got {found!r}; expected one of: {', '.join(map(str, expected))}"
    if kind == "const":
        if type(err.instance) is not type(expected):  # version: "1" — the text "1", not the number 1
            return f"got {_json_type(err.instance)} {found!r}; expected {_json_type(expected)} {expected!r}"
        return f"got {found!r}; expected {expected!r}"
    if kind == "type" and expected == "integer" and type(err.instance) is float:
        return f"got {found!r}; expected a whole number, written without a fraction or an exponent"
    if kind == "type" and type(err.instance) is float and not math.isfinite(err.instance):
        return f"got {found!r}; expected a finite number"
    if kind == "type" and isinstance(err.instance, str) and err.instance.lstrip("+-").lower() in (".nan", ".inf"):
        return f"got {found!r}; expected a finite number (a policy reads .nan and .inf as text: no bound holds)"
    if kind in ("type", "pattern") and isinstance(err.instance, str) and _LEADING_ZERO.fullmatch(err.instance):
        return (f"got {found!r}; expected a number without a leading zero (YAML 1.1 would read {err.instance} as "
                "octal, so a policy refuses it)")
    if kind == "type":
        return f"got {type(err.instance).__name__} {found!r}; expected {expected}"
    if kind == "oneOf":
        return f"got {found!r}; expected a host pattern string or a mapping with 'host'"
    if kind == "pattern" and err.schema.get("$id") == "portRange":  # a port list's text: a port or a range meant
        return f"got text {found!r}; expected a port number (no quotes) or a range such as 1025-65535 (no spaces)"
    if kind == "pattern":
        what = err.schema.get("title")
        return f"got {found!r}; expected text matching {expected}" + (f" ({what})" if what else "")
    if kind == "minItems" and expected == 1 and err.absolute_path and err.absolute_path[-1] in _CONDITIONS:
        return ("got an empty list; expected at least one item (a condition that lists nothing matches nothing: "
                "on a deny rule it would refuse nothing; leave the key out to match every value)")
    if kind in ("minimum", "maximum", "exclusiveMinimum"):
        return f"got {found!r}; expected a value {_BOUND_WORDS[kind]} {expected}"
    return err.message if len(err.message) <= _MESSAGE_MAX else err.message[:_MESSAGE_MAX] + "..."


_LEADING_ZERO = re.compile(r"[-+]?0[0-9]+")  # 0443: text to the policy's YAML, octal to YAML 1.1
_CONDITIONS = frozenset({"ports", "schemes", "methods", "paths"})  # a host rule's conditions
_SHORT = reprlib.Repr(maxlevel=2, maxlist=4, maxdict=4, maxstring=80, maxother=80)
_MESSAGE_MAX = 400


def _json_type(value: object) -> str:
    return {bool: "boolean", int: "number", float: "number", str: "text", list: "list", dict: "mapping"}.get(
        type(value), type(value).__name__)


class _Shown:
    """A found value in a message: its repr, shortened (reprlib: at most a few items of each list and
    mapping, two levels deep, long text cut)."""

    def __init__(self, value: object) -> None:
        self.value = value

    def __repr__(self) -> str:
        return _SHORT.repr(self.value)


_BOUND_WORDS = {"minimum": ">=", "maximum": "<=", "exclusiveMinimum": ">"}
