"""Load a policy file strictly: YAML → JSON Schema check → semantic checks → an indexed Policy.

Every error names the file, line and column, the key, and what was expected, because the person
reading it is an operator mid-edit who wants to fix the line, not read a traceback.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import netaddr
import yaml

from .addresses import AddressRules
from .model import (
    ALLOW,
    DENY,
    HostRule,
    HostTable,
    Limits,
    Origin,
    Policy,
    ResolverSettings,
    Role,
)
from .patterns import HostPattern
from .ports import parse_port_list

DEFAULT_POLICY = Path(__file__).with_name("default.yaml")
Path_ = tuple[str | int, ...]


class PolicyError(ValueError):
    """A policy that cannot be used. ``str()`` is ``file:line:column: key: message``."""

    def __init__(self, source: str, line: int, column: int, key: str, message: str) -> None:
        self.source, self.line, self.column, self.key, self.message = source, line, column, key, message
        where = f"{source}:{line}:{column}" if line else source
        super().__init__(f"{where}: {key + ': ' if key else ''}{message}")


@dataclass
class Overrides:
    """Command-line additions to a policy (labs, tests, quick use). They add; only default and
    nameservers replace what the file says."""

    default: str | None = None
    allow_hosts: list[str] = field(default_factory=list)
    deny_hosts: list[str] = field(default_factory=list)
    allow_ranges: list[str] = field(default_factory=list)
    deny_ranges: list[str] = field(default_factory=list)
    nameservers: list[str] = field(default_factory=list)
    mode: str | None = None


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that reads plain scalars as YAML 1.2 (what editors validating with schema.json use)
    and without duplicate keys (YAML would silently keep the last one).

    YAML 1.1 traps are removed, not guessed at: dates stay text (checked by the schema); only
    true/false are booleans (``default: no`` is the text 'no', an error, not False); integers are
    plain decimals (``0443`` is not octal 291 and ``1:30`` not sexagesimal 90: both are text, an error).
    """


_YAML11_ONLY = {"tag:yaml.org,2002:timestamp", "tag:yaml.org,2002:bool", "tag:yaml.org,2002:int"}
_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in _YAML11_ONLY]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_StrictLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                    list("tTfF"))
_StrictLoader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^[-+]?(?:0|[1-9][0-9]*)$"),
                                    list("-+0123456789"))


class _StrictCLoader(yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader):  # type: ignore[misc]
    """The same rules, with libyaml doing the parsing: a million-entry allowlist composes in seconds."""


_StrictCLoader.yaml_implicit_resolvers = _StrictLoader.yaml_implicit_resolvers


@cache
def schema() -> dict[str, Any]:
    return json.loads(resources.files("policy").joinpath("schema.json").read_text())


def load_policy(path: str | Path | None = None, overrides: Overrides | None = None) -> Policy:
    """Read, validate and index a policy file (the bundled default when path is None)."""
    path = Path(path) if path is not None else DEFAULT_POLICY
    source = str(path)
    try:
        text = _read_regular_file(path)
    except IsADirectoryError:
        raise PolicyError(source, 0, 0, "", "is a directory, not a policy file") from None
    except FileNotFoundError:
        raise PolicyError(source, 0, 0, "", "no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise PolicyError(source, 0, 0, "", f"cannot be read: {err}") from None
    return parse_policy(text, source, overrides)


def _read_regular_file(path: Path) -> str:
    """The file's text, refusing anything that is not a regular file. A FIFO would block the open (and
    with it the proxy's event loop, which reloads in place) until a writer comes; a device such as
    /dev/zero would be read forever. O_NONBLOCK makes opening a FIFO return at once, and fstat on
    the opened descriptor judges what was opened, not what the name pointed to a moment before."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(str(path))
        if not stat.S_ISREG(mode):
            raise OSError(f"{path} is not a regular file (a FIFO, socket or device)")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8")


def parse_policy(text: str, source: str = "<policy>", overrides: Overrides | None = None) -> Policy:
    document = _Document.parse(text, source)
    if overrides is not None:
        document.apply(overrides)
    document.validate()
    return _build(document)


class _Document:
    """The YAML data plus a way back from any key path to where it was written."""

    def __init__(self, source: str, root: yaml.Node | None, data: Any) -> None:
        self.source, self.root, self.data = source, root, data
        self.extra_origins: dict[Path_, Origin] = {}

    @classmethod
    def parse(cls, text: str, source: str) -> _Document:
        try:
            root = _compose(text)
        except yaml.MarkedYAMLError as err:
            mark = err.problem_mark or err.context_mark
            line, col = (mark.line + 1, mark.column + 1) if mark else (0, 0)
            raise PolicyError(source, line, col, "", f"not valid YAML: {err.problem or err}") from None
        except yaml.YAMLError as err:
            raise PolicyError(source, 0, 0, "", f"not valid YAML: {err}") from None
        if root is None or (isinstance(root, yaml.ScalarNode) and root.tag == "tag:yaml.org,2002:null"):
            raise PolicyError(source, 1, 1, "", "the file is empty; expected a mapping with 'version: 1'")
        _refuse_duplicate_keys(root, source)
        loader = _StrictLoader("")
        try:
            data = loader.construct_document(root)
        except yaml.MarkedYAMLError as err:  # an unhashable (complex) key, an unknown tag such as !!python/...
            mark = err.problem_mark or err.context_mark
            line, col = (mark.line + 1, mark.column + 1) if mark else (0, 0)
            raise PolicyError(source, line, col, "", f"not valid policy YAML: {err.problem or err}") from None
        finally:
            loader.dispose()
        return cls(source, root, data)

    def origin(self, path: Path_) -> Origin:
        if path in self.extra_origins:
            return self.extra_origins[path]
        node, found = self.root, ()
        for step in path:
            child = _child(node, step)
            if child is None:
                break
            node, found = child, (*found, step)
        mark = node.start_mark if node is not None else None
        return Origin(self.source, mark.line + 1 if mark else 0, mark.column + 1 if mark else 0, _dotted(path))

    def origins_of_items(self, path: Path_, count: int) -> list[Origin]:
        """The origins of items 0..count-1 of the list at path."""
        node = self.root
        for step in path:
            node = _child(node, step) if node is not None else None
        if not isinstance(node, yaml.SequenceNode) or any((*path, i) in self.extra_origins for i in range(count)):
            return [self.origin((*path, i)) for i in range(count)]
        dotted = _dotted(path)
        return [Origin(self.source, item.start_mark.line + 1, item.start_mark.column + 1, f"{dotted}[{i}]")
                for i, item in enumerate(node.value[:count])]

    def error(self, path: Path_, message: str) -> PolicyError:
        origin = self.origin(path)  # a value added by a flag names the flag, not the file
        return PolicyError(origin.source, origin.line, origin.column, _dotted(path), message)

    def key_error(self, path: Path_, key: str, message: str) -> PolicyError:
        """An error about a key itself (unknown key): point at the key, not at its mapping."""
        node = self.root
        for step in path:
            node = _child(node, step)
        for key_node, _ in node.value if isinstance(node, yaml.MappingNode) else ():
            if isinstance(key_node, yaml.ScalarNode) and key_node.value == key:
                mark = key_node.start_mark
                return PolicyError(self.source, mark.line + 1, mark.column + 1, _dotted((*path, key)), message)
        return self.error(path, message)

    def validate(self) -> None:
        """The whole document against schema.json. Host lists can hold a million plain strings, so
        they are checked apart: a non-empty string is a valid entry by the schema's own rule (its
        pattern is judged later, with a reason), and only mapping entries go through the validator."""
        slim, host_lists = _without_host_entries(self.data)
        self._raise_first(_document_validator().iter_errors(slim), ())
        entry_validator = _entry_validator()
        for path, entries in host_lists:
            for i, entry in enumerate(entries):
                if not (isinstance(entry, str) and entry):
                    self._raise_first(entry_validator.iter_errors(entry), (*path, i))

    def _raise_first(self, errors: Iterable[jsonschema.ValidationError], prefix: Path_) -> None:
        errors = sorted(errors, key=lambda e: (len(e.absolute_path), str(e.path)))
        if errors:
            err = _most_specific(errors[0])
            path = (*prefix, *err.absolute_path)
            if err.validator == "additionalProperties" and isinstance(err.instance, dict):
                known = err.schema.get("properties", {})
                unknown = [key for key in err.instance if key not in known]  # in file order
                if unknown:
                    raise self.key_error(path, str(unknown[0]), _explain(err))
            raise self.error(path, _explain(err))

    def apply(self, overrides: Overrides) -> None:
        """Add command-line rules at the end of the lists they belong to, marked with their flag."""
        if not isinstance(self.data, dict):
            return  # the schema check reports it
        data = self.data
        if overrides.default is not None:
            data["default"] = overrides.default
            self.extra_origins[("default",)] = Origin("--default")
        if overrides.mode is not None:
            data["mode"] = overrides.mode
        for flag, keys, values in (
            ("--allow-host", ("hosts", "allow"), overrides.allow_hosts),
            ("--deny-host", ("hosts", "deny"), overrides.deny_hosts),
            ("--allow-range", ("addresses", "allow"), overrides.allow_ranges),
            ("--deny-range", ("addresses", "deny"), overrides.deny_ranges),
        ):
            if not values:
                continue
            section = data.setdefault(keys[0], {})
            if not isinstance(section, dict):
                continue
            target = section.setdefault(keys[1], [])
            if not isinstance(target, list):
                continue
            for value in values:
                self.extra_origins[(*keys, len(target))] = Origin(f"command line {flag} {value}")
                target.append(value)
        if overrides.nameservers and isinstance(data.setdefault("resolver", {}), dict):
            data["resolver"]["nameservers"] = list(overrides.nameservers)
            for i in range(len(overrides.nameservers)):
                self.extra_origins[("resolver", "nameservers", i)] = Origin("command line --nameserver")


def _compose(text: str) -> yaml.Node | None:
    """libyaml for speed; on an error, the pure-Python parser again for its more precise message."""
    try:
        return yaml.compose(text, Loader=_StrictCLoader)
    except yaml.YAMLError:
        return yaml.compose(text, Loader=_StrictLoader)


@cache
def _document_validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(schema())


@cache
def _entry_validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({"$ref": "#/$defs/hostEntry", "$defs": schema()["$defs"]})


def _without_host_entries(data: Any) -> tuple[Any, list[tuple[Path_, list[Any]]]]:
    """A shallow copy of the document with every host list emptied, and the lists taken out."""
    lists: list[tuple[Path_, list[Any]]] = []

    def strip(hosts: Any, at: Path_) -> Any:
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


def _refuse_duplicate_keys(node: yaml.Node, source: str) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, yaml.Node] = {}
        for key, value in node.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else id(key)
            if name in seen:
                first = seen[name].start_mark.line + 1
                mark = key.start_mark
                raise PolicyError(source, mark.line + 1, mark.column + 1, str(name),
                                  f"duplicate key (first written on line {first}); YAML would keep only the last")
            seen[name] = key
            _refuse_duplicate_keys(value, source)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _refuse_duplicate_keys(item, source)


def _child(node: yaml.Node | None, step: str | int) -> yaml.Node | None:
    if isinstance(node, yaml.MappingNode) and isinstance(step, str):
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.value == step:
                return value
    if isinstance(node, yaml.SequenceNode) and isinstance(step, int) and step < len(node.value):
        return node.value[step]
    return None


def _dotted(path: Iterable[str | int]) -> str:
    out = ""
    for step in path:
        out += f"[{step}]" if isinstance(step, int) else (f".{step}" if out else step)
    return out


def _most_specific(err: jsonschema.ValidationError) -> jsonschema.ValidationError:
    """For a oneOf (string or mapping), report the branch the operator was evidently writing."""
    if err.validator == "oneOf" and err.context:
        instance_is_mapping = isinstance(err.instance, dict)
        branch = [e for e in err.context if (e.schema.get("type") == "object") == instance_is_mapping
                  or e.relative_schema_path[0] == (1 if instance_is_mapping else 0)]
        deepest = max(branch or err.context, key=lambda e: len(e.absolute_path))
        return _most_specific(deepest)
    return err


def _explain(err: jsonschema.ValidationError) -> str:
    """Turn a schema error into 'what was found, what was expected'."""
    kind, expected, found = err.validator, err.validator_value, err.instance
    if kind == "additionalProperties":
        allowed = sorted(err.schema.get("properties", {}))
        unknown = sorted(set(found) - set(allowed)) if isinstance(found, dict) else []
        return f"unknown key {', '.join(map(repr, unknown))}; expected one of: {', '.join(allowed)}"
    if kind == "required":
        return f"missing key; expected {', '.join(map(repr, expected))}"
    if kind == "enum":
        return f"got {found!r}; expected one of: {', '.join(map(str, expected))}"
    if kind == "const":
        return f"got {found!r}; expected {expected!r}"
    if kind == "type":
        return f"got {type(found).__name__} {found!r}; expected {expected}"
    if kind == "oneOf":
        return f"got {found!r}; expected a host pattern string or a mapping with 'host'"
    if kind == "pattern":
        return f"got {found!r}; expected text matching {expected}"
    if kind in ("minimum", "maximum", "exclusiveMinimum"):
        return f"got {found!r}; expected a value {_bound_words[kind]} {expected}"
    return err.message


_bound_words = {"minimum": ">=", "maximum": "<=", "exclusiveMinimum": ">"}


def _build(doc: _Document) -> Policy:
    data: dict[str, Any] = doc.data
    addresses = data.get("addresses", {})
    address_rules: list[tuple[str, str, Origin]] = []
    for action in (ALLOW, DENY):
        for i, cidr in enumerate(addresses.get(action, [])):
            origin = doc.origin(("addresses", action, i))
            try:
                netaddr.IPNetwork(cidr)
                _strict_cidr(cidr)
            except (ValueError, netaddr.AddrFormatError) as err:
                raise doc.error(("addresses", action, i),
                                f"got {cidr!r}; expected an address or CIDR range ({err})") from None
            address_rules.append((action, cidr, origin))
    try:
        rules = AddressRules(
            allow=[c for a, c, _ in address_rules if a == ALLOW],
            deny=[c for a, c, _ in address_rules if a == DENY],
            refuse_cloud_metadata=addresses.get("refuse_cloud_metadata", True),
            allow_labels={c: f"address-allow {c} ({o})" for a, c, o in address_rules if a == ALLOW},
            deny_labels={c: f"address-deny {c} ({o})" for a, c, o in address_rules if a == DENY},
        )
    except ValueError as err:
        raise doc.error(("addresses",), str(err)) from None

    ports = data.get("ports", {})
    resolver = data.get("resolver", {})
    limits = data.get("limits", {})
    roles = tuple(_build_role(doc, i, role) for i, role in enumerate(data.get("roles", [])))
    names = [role.name for role in roles]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise doc.error(("roles", i, "name"), f"role {name!r} is defined twice")
    if resolver.get("ttl_floor", 0) > resolver.get("ttl_ceiling", 300):
        raise doc.error(("resolver", "ttl_floor"), "ttl_floor is greater than ttl_ceiling")

    return Policy(
        source=doc.source,
        mode=data.get("mode", "enforce"),
        default=data.get("default", DENY),
        default_origin=doc.origin(("default",)) if "default" in data else Origin(f"{doc.source} (built-in default)"),
        allow=_build_table(doc, ("hosts",), ALLOW, data.get("hosts", {})),
        deny=_build_table(doc, ("hosts",), DENY, data.get("hosts", {})),
        addresses=rules,
        connect_ports=_port_set(doc, ("ports", "connect"), ports.get("connect", [443])),
        http_ports=_port_set(doc, ("ports", "http"), ports.get("http", [80])),
        roles=roles,
        resolver=ResolverSettings(
            nameservers=tuple(_nameserver(doc, i, ns) for i, ns in enumerate(resolver.get("nameservers", []))),
            timeout=float(resolver.get("timeout", 2.0)),
            ttl_floor=resolver.get("ttl_floor", 0),
            ttl_ceiling=resolver.get("ttl_ceiling", 300),
        ),
        limits=Limits(**{key: limits[key] for key in limits}),
        log_query_strings=data.get("log", {}).get("query_strings", False),
        address_rules_text=tuple(address_rules),
    )


def _port_set(doc: _Document, path: Path_, values: list[int | str]) -> frozenset[int]:
    """Port numbers and "LOW-HIGH" ranges (the schema checked their shape) → a set of ports."""
    for i, value in enumerate(values):
        try:
            parse_port_list([value])
        except ValueError as err:
            raise doc.error((*path, i), str(err)) from None
    return parse_port_list(values)


def _strict_cidr(text: str) -> None:
    """netaddr accepts '10.0.0.1/8' and legacy forms; an operator who wrote that meant something else."""
    from .addresses import parse_address

    address, _, prefix = text.partition("/")
    parse_address(address)
    if prefix:
        if not prefix.isdigit() or (len(prefix) > 1 and prefix[0] == "0"):
            raise ValueError(f"prefix length {prefix!r} is not a decimal number")
        network = netaddr.IPNetwork(text)
        if network.network != network.ip:
            raise ValueError(f"host bits are set; did you mean {network.cidr}?")


def _build_role(doc: _Document, i: int, raw: dict[str, Any]) -> Role:
    clients = netaddr.IPSet()
    for j, cidr in enumerate(raw["clients"]):
        try:
            _strict_cidr(cidr)
            clients.add(netaddr.IPNetwork(cidr))
        except (ValueError, netaddr.AddrFormatError) as err:
            raise doc.error(("roles", i, "clients", j),
                            f"got {cidr!r}; expected an address or CIDR range ({err})") from None
    hosts = raw.get("hosts", {})
    return Role(
        name=raw["name"],
        clients=clients,
        origin=doc.origin(("roles", i)),
        default=raw.get("default"),
        allow=_build_table(doc, ("roles", i, "hosts"), ALLOW, hosts),
        deny=_build_table(doc, ("roles", i, "hosts"), DENY, hosts),
    )


def _build_table(doc: _Document, at: Path_, action: str, hosts: dict[str, Any]) -> HostTable:
    entries = hosts.get(action, [])
    origins = doc.origins_of_items((*at, action), len(entries))  # one walk for the list, not one per entry
    rules = [_build_rule(doc, (*at, action, i), action, entry, origins[i]) for i, entry in enumerate(entries)]
    return HostTable.build(rules)


def _build_rule(doc: _Document, path: Path_, action: str, entry: str | dict[str, Any], origin: Origin) -> HostRule:
    raw = {"host": entry} if isinstance(entry, str) else entry
    key = path if isinstance(entry, str) else (*path, "host")
    try:
        pattern = HostPattern.parse(raw["host"])
    except ValueError as err:
        raise doc.error(key, str(err)) from None
    expires = None
    if "expires" in raw:
        try:
            expires = _parse_expiry(raw["expires"])
        except ValueError as err:
            raise doc.error((*path, "expires"), f"got {raw['expires']!r}; expected a date ({err})") from None
    paths = raw.get("paths")
    return HostRule(
        action=action,
        pattern=pattern,
        origin=origin,
        ports=_port_set(doc, (*path, "ports"), raw["ports"]) if "ports" in raw else None,
        schemes=frozenset(raw["schemes"]) if "schemes" in raw else None,
        methods=frozenset(raw["methods"]) if "methods" in raw else None,
        paths=tuple(paths) if paths is not None else None,
        websocket=raw.get("websocket", True),
        intercept=raw.get("intercept", False),
        expires=expires,
        owner=raw.get("owner"),
        reason=raw.get("reason"),
    )


def _parse_expiry(text: str) -> datetime:
    """A bare date expires at the start of that day, UTC; a time without a zone is UTC."""
    if len(text) == 10:
        day = date.fromisoformat(text)
        return datetime(day.year, day.month, day.day, tzinfo=UTC)
    moment = datetime.fromisoformat(text.replace(" ", "T"))
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _nameserver(doc: _Document, i: int, text: str) -> tuple[str, int]:
    try:
        return parse_nameserver(text)
    except ValueError as err:
        raise doc.error(("resolver", "nameservers", i), str(err)) from None


def parse_nameserver(text: str) -> tuple[str, int]:
    """``IP``, ``IP:PORT`` or ``[IPv6]:PORT`` → (ip, port); port 53 by default."""
    from .addresses import parse_address

    host, port = text, "53"
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"got {text!r}; expected IP, IP:PORT or [IPv6]:PORT")
        port = rest[1:] if rest else "53"
    elif text.count(":") == 1:
        host, port = text.split(":")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"got {text!r}; port must be 1-65535")
    try:
        address = parse_address(host)
    except ValueError as err:
        raise ValueError(f"got {text!r}; expected an IP address ({err})") from None
    return str(address), int(port)
