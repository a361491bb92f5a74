"""Build a Policy from policy text: YAML (``yamldoc``) → schema (``schema``) → semantic checks → an indexed Policy.

Pure: ``parse_policy`` takes the text and the name to report it by (a file name, for ``file:line:column``);
reading a file is the caller's business (``proxy/policy_file.py``). Every problem is collected, not just the
first: the ``PolicyError`` raised lists them all in file order. A value the schema already found wrong is not
judged again (its later checks would only repeat the same mistake in other words), but everything around it
still is.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any

import netaddr

from . import rule_ids
from .addresses import AddressRules, parse_address, parse_cidr, parse_nat64_prefix
from .errors import PolicyError, PolicyProblem
from .hosts import split_host_port
from .model import (
    ALLOW,
    DENY,
    RESOLUTION_UPSTREAM,
    HostRule,
    HostTable,
    HttpSettings,
    Limits,
    Origin,
    Policy,
    ResolverSettings,
    Role,
    Upstream,
)
from .pattern_lists import plain_patterns
from .patterns import HostPattern
from .ports import parse_port_list
from .request_bodies import parse_body_method
from .schema import schema, schema_problems
from .upstream import check_credentials_path, parse_upstream_proxy
from .yamldoc import KeyPath, YamlDocument

__all__ = ["Overrides", "PolicyError", "PolicyProblem", "parse_policy", "parse_nameserver", "parse_expiry", "schema"]


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
    upstream: str | None = None  # --upstream: replaces upstream.proxy (the policy must still say resolution)
    upstream_credentials_file: str | None = None  # --upstream-credentials-file: replaces upstream.credentials_file
    # "required": every client, in every role, must present a session (egresswall browse's in-process proxy,
    # whose one client is the browser it reads with); replaces session: in the policy and in each role.
    session: str | None = None


def parse_policy(text: str, source: str = "<policy>", overrides: Overrides | None = None) -> Policy:
    """Validate and index policy text. ``source`` names it in every error (``source:line:column: ...``)."""
    with _collector_paused():
        return _parse_policy(text, source, overrides)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cycle collector off while a policy is built, as it was before afterwards.

    A million-entry allowlist allocates millions of objects that all live on (none is garbage, and none
    forms a cycle that needs the collector), yet each 700 allocations start a collection that rescans
    the survivors: about a third of the load time, measured. Nothing else changes: the objects are the same.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _parse_policy(text: str, source: str, overrides: Overrides | None) -> Policy:
    doc = YamlDocument.parse(text, source)
    if doc.is_empty:
        raise PolicyError(source, 1, 1, "", "the file is empty; expected a mapping with 'version: 1'")
    if overrides is not None:
        _apply(doc, overrides)
    problems, bad = schema_problems(doc)
    builder = _Builder(doc, _Unusable(bad))
    policy = builder.build() if isinstance(doc.data, dict) else None
    problems = doc.problems + problems + builder.problems
    if problems or policy is None:
        raise PolicyError.of(problems)
    return policy


def _apply(doc: YamlDocument, overrides: Overrides) -> None:
    """Add command-line rules at the end of the lists they belong to, marked with their flag."""
    if not isinstance(doc.data, dict):
        return  # the schema check reports it
    data = doc.data
    if overrides.default is not None:
        data["default"] = overrides.default
        doc.extra_origins[("default",)] = Origin("--default")
    if overrides.mode is not None:
        data["mode"] = overrides.mode
    if overrides.session is not None:
        data["session"] = overrides.session
        doc.extra_origins[("session",)] = Origin("command line (session required)")
        roles = data.get("roles")
        for i, role in enumerate(roles if isinstance(roles, list) else []):
            if isinstance(role, dict):
                role["session"] = overrides.session
                doc.extra_origins[("roles", i, "session")] = Origin("command line (session required)")
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
            doc.extra_origins[(*keys, len(target))] = Origin(f"command line {flag} {value}")
            target.append(value)
        doc.changed(target)
    for flag, key, value in (("--upstream", "proxy", overrides.upstream),
                             ("--upstream-credentials-file", "credentials_file", overrides.upstream_credentials_file)):
        if value is not None and isinstance(data.setdefault("upstream", {}), dict):
            data["upstream"][key] = value
            doc.extra_origins[("upstream", key)] = Origin(f"command line {flag}")
    if overrides.nameservers and isinstance(data.setdefault("resolver", {}), dict):
        data["resolver"]["nameservers"] = list(overrides.nameservers)
        for i in range(len(overrides.nameservers)):
            doc.extra_origins[("resolver", "nameservers", i)] = Origin("command line --nameserver")


class _Unusable:
    """Key paths whose values the schema found wrong. ``usable(p)``: nothing at p or above it is wrong (so
    p has the type the schema says and can be walked into); ``clean(p)``: usable, and nothing below is wrong."""

    def __init__(self, paths: list[KeyPath]) -> None:
        self.paths = set(paths)
        self.above = {path[:i] for path in self.paths for i in range(len(path))}

    def usable(self, path: KeyPath) -> bool:
        return not self.paths or not any(path[:i] in self.paths for i in range(len(path) + 1))

    def clean(self, path: KeyPath) -> bool:
        return not self.paths or (self.usable(path) and path not in self.above)


class _Occurrences:
    """How many times each pattern text has been written in one list so far: the n of a derived id's ``#n``."""

    def __init__(self) -> None:
        self.first_at: dict[str, object] = {}  # text -> the list index of its first entry
        self.repeats: dict[str, int] = {}  # text -> times written, for texts written more than once

    def count(self, text: str, at: object) -> int:
        """Count an entry (``at``: its list index) with this text; its occurrence, from 1."""
        return 1 if self.first_at.setdefault(text, at) == at else self.repeat(text)

    def repeat(self, text: str) -> int:
        count = self.repeats[text] = self.repeats.get(text, 1) + 1
        return count


class _Builder:
    """The model from a schema-checked document; semantic problems are collected in ``problems``."""

    def __init__(self, doc: YamlDocument, unusable: _Unusable) -> None:
        self.doc, self.unusable = doc, unusable
        self.problems: list[PolicyProblem] = []
        self.ids: list[tuple[str, Origin, KeyPath]] = []  # written rule ids, to find one used twice

    def problem(self, path: KeyPath, message: str) -> None:
        self.problems.append(self.doc.problem(path, message))

    def value(self, path: KeyPath, default: Any) -> Any:
        """The value at path when the schema found it right, else the default (a problem is reported)."""
        node = _at(self.doc.data, path)
        return default if node is _MISSING or not self.unusable.clean(path) else node

    def section(self, path: KeyPath) -> dict[str, Any]:
        found = self.value(path, {}) if self.unusable.usable(path) else {}
        return found if isinstance(found, dict) else {}

    def items(self, path: KeyPath, whole: bool = True) -> tuple[int, list[tuple[int, Any]]]:
        """(length, items) of the list at path: the items the schema found right (``whole``: nothing wrong
        inside them either), with their index."""
        if not self.unusable.usable(path):
            return 0, []
        node = _at(self.doc.data, path)
        if not isinstance(node, list):
            return 0, []
        if not self.unusable.paths:
            return len(node), list(enumerate(node))
        keep = self.unusable.clean if whole else self.unusable.usable
        return len(node), [(i, item) for i, item in enumerate(node) if keep((*path, i))]

    def build(self) -> Policy:
        doc = self.doc
        address_rules = self.address_rules()
        translators = self.nat64_prefixes()
        addresses = AddressRules(
            allow=[c for a, c, _ in address_rules if a == ALLOW],
            deny=[c for a, c, _ in address_rules if a == DENY],
            refuse_cloud_metadata=self.value(("addresses", "refuse_cloud_metadata"), True),
            allow_labels={c: f"address-allow {c} ({o})" for a, c, o in address_rules if a == ALLOW},
            deny_labels={c: f"address-deny {c} ({o})" for a, c, o in address_rules if a == DENY},
            nat64=[c for c, _ in translators],
            nat64_labels={c: f"addresses.nat64, {o}" for c, o in translators},
        )
        roles = self.roles()
        floor, ceiling = self.value(("resolver", "ttl_floor"), 0), self.value(("resolver", "ttl_ceiling"), 300)
        if floor > ceiling:
            self.problem(("resolver", "ttl_floor"), "ttl_floor is greater than ttl_ceiling")
        limits = self.section(("limits",))
        policy = Policy(
            source=doc.source,
            mode=self.value(("mode",), "enforce"),
            default=self.value(("default",), DENY),
            default_origin=doc.origin(("default",)) if "default" in doc.data
            else Origin(f"{doc.source} (built-in default)"),
            allow=self.table(("hosts",), ALLOW),
            deny=self.table(("hosts",), DENY),
            addresses=addresses,
            connect_ports=self.ports(("ports", "connect"), [443]),
            http_ports=self.ports(("ports", "http"), [80]),
            roles=roles,
            resolver=ResolverSettings(
                nameservers=tuple(self.nameservers()),
                timeout=float(self.value(("resolver", "timeout"), 2.0)),
                ttl_floor=floor,
                ttl_ceiling=ceiling,
            ),
            limits=Limits(**{key: limits[key] for key in limits if self.unusable.clean(("limits", key))}),
            http=HttpSettings(body_allowed_on=self.body_allowed_on()),
            log_query_strings=self.value(("log", "query_strings"), False),
            session=self.value(("session",), "optional"),
            tls_ech=self.value(("tls", "ech"), None),
            address_rules_text=tuple(address_rules),
            upstream=self.upstream(),
        )
        self.duplicate_ids()
        return policy

    def duplicate_ids(self) -> None:
        first: dict[str, Origin] = {}
        for rule_id, origin, path in sorted(self.ids, key=lambda entry: (entry[1].line, entry[1].column)):
            if rule_id in first:
                seen = first[rule_id]
                self.problem(path, f"duplicate rule id {rule_id!r} (first used at {seen.source}:{seen.line}:"
                                   f"{seen.column}); ids must be unique")
            first.setdefault(rule_id, origin)

    def address_rules(self) -> list[tuple[str, str, Origin]]:
        """(action, normalised CIDR text, origin) of every address rule, in file order."""
        out = []
        for action in (ALLOW, DENY):
            for i, cidr in self.items(("addresses", action))[1]:
                network = self.cidr(("addresses", action, i), cidr)
                if network is not None:
                    out.append((action, str(network), self.doc.origin(("addresses", action, i))))
        return out

    def nat64_prefixes(self) -> list[tuple[str, Origin]]:
        """(normalised prefix text, origin) of each of the network's NAT64 translator prefixes."""
        out = []
        for i, text in self.items(("addresses", "nat64"))[1]:
            try:
                network = parse_nat64_prefix(text)
            except ValueError as err:
                self.problem(("addresses", "nat64", i), f"got {text!r}; {err}")
                continue
            out.append((str(network), self.doc.origin(("addresses", "nat64", i))))
        return out

    def cidr(self, path: KeyPath, text: str) -> netaddr.IPNetwork | None:
        try:
            return parse_cidr(text)
        except ValueError as err:
            self.problem(path, f"got {text!r}; expected an address or CIDR range ({err})")
            return None

    def ports(self, path: KeyPath, default: list[int | str]) -> frozenset[int]:
        """Port numbers and "LOW-HIGH" ranges (the schema checked their shape) → a set of ports."""
        if self.value(path, None) is None and not self.items(path)[1]:
            return parse_port_list(default)
        good = []
        for i, value in self.items(path)[1]:
            try:
                parse_port_list([value])
                good.append(value)
            except ValueError as err:
                self.problem((*path, i), str(err))
        return parse_port_list(good)

    def roles(self) -> tuple[Role, ...]:
        roles: list[Role] = []
        first: dict[str, int] = {}
        for i, raw in self.items(("roles",), whole=False)[1]:
            role = self.role(i, raw)
            if role is None:
                continue
            if role.name in first:
                self.problem(("roles", i, "name"), f"role {role.name!r} is defined twice")
            first.setdefault(role.name, i)
            roles.append(role)
        return tuple(roles)

    def role(self, i: int, raw: Any) -> Role | None:
        at: KeyPath = ("roles", i)
        if not self.unusable.usable(at) or not isinstance(raw, dict):
            return None
        name = self.value((*at, "name"), None)
        clients = netaddr.IPSet()
        for j, cidr in self.items((*at, "clients"))[1]:
            network = self.cidr((*at, "clients", j), cidr)
            if network is not None:
                clients.add(network)
        allow = self.table((*at, "hosts"), ALLOW, name)
        deny = self.table((*at, "hosts"), DENY, name)
        if name is None or not self.unusable.clean((*at, "clients")):
            return None  # its host rules were still checked
        return Role(name=name, clients=clients, origin=self.doc.origin(at), default=self.value((*at, "default"), None),
                    allow=allow, deny=deny, session=self.value((*at, "session"), None))

    def table(self, at: KeyPath, action: str, role: str | None = None) -> HostTable:
        path = (*at, action)
        list_name = rule_ids.host_list(action, role)
        whole = _at(self.doc.data, path)
        if isinstance(whole, list) and self.unusable.clean(path) and self.doc.only_text(whole):
            # Bare patterns only, as a big allowlist is: judged as one list (policy/pattern_lists.py), and when
            # every one is plainly normal the rules, ids and origins are built in bulk, no Python step per entry.
            patterns: list[HostPattern] = plain_patterns(whole)  # type: ignore[assignment]  # no None: checked
            if None not in patterns:
                origins = self.doc.origins_of_items(path, len(whole))
                implied = rule_ids.implied(list_name)
                # Built first as if no text were written twice (then no entry has a #n). A text written twice is a
                # name written twice: when the index holds every name once, or the texts turn out all different
                # after all ('a.example' and '.a.example' share a name), that was so. Otherwise, rare, the ids
                # are numbered and the list built again.
                ids = rule_ids.derived_for_list(list_name, whole, implied, distinct=True)
                table = HostTable.build(HostRule.plain_rules(action, patterns, origins, ids), patterns)
                if table.index.every_name_once() or len(set(whole)) == len(whole):
                    return table
                ids = rule_ids.derived_for_list(list_name, whole, implied)
                return HostTable.build(HostRule.plain_rules(action, patterns, origins, ids), patterns)
        length, entries = self.items(path)
        origins = self.doc.origins_of_items(path, length)
        # None for a mapping (given as ''), or for a text to judge alone
        plain = plain_patterns([entry if type(entry) is str else "" for _, entry in entries])
        seen = _Occurrences()
        first_at = seen.first_at
        rules: list[HostRule] = []
        for (i, entry), pattern in zip(entries, plain, strict=True):
            if type(entry) is str:
                if pattern is None:
                    try:
                        pattern = HostPattern.parse(entry)
                    except ValueError as err:
                        self.problem((*path, i), str(err))
                        continue
                # One dict operation for a text written for the first time (nearly all of a big list).
                count = 1 if first_at.setdefault(entry, i) == i else seen.repeat(entry)
                rule_id = rule_ids.given_id(list_name, entry, count, rule_ids.implied(list_name))
                rules.append(HostRule.plain(action, pattern, origins[i], rule_id))
            else:
                rule = self.rule((*path, i), action, entry, origins[i], list_name, seen)
                if rule is not None:
                    rules.append(rule)
        return HostTable.build(rules)

    def rule(self, path: KeyPath, action: str, entry: dict[str, Any], origin: Origin, list_name: str,
             seen: _Occurrences) -> HostRule | None:
        """A rule written as a mapping: ``host`` and its conditions."""
        try:
            pattern = HostPattern.parse(entry["host"])
        except ValueError as err:
            self.problem((*path, "host"), str(err))
            return None
        return self.conditional_rule(path, action, entry, pattern, origin, list_name, seen)

    def conditional_rule(self, path: KeyPath, action: str, raw: dict[str, Any], pattern: HostPattern, origin: Origin,
                         list_name: str, seen: _Occurrences) -> HostRule | None:
        ok = True
        expires = None
        if "expires" in raw:
            try:
                expires = parse_expiry(raw["expires"])
            except ValueError as err:
                self.problem((*path, "expires"), f"got {raw['expires']!r}; expected a date ({err})")
                ok = False
        ports = None
        if "ports" in raw:
            before = len(self.problems)
            ports = self.ports((*path, "ports"), [])
            ok = ok and len(self.problems) == before
        if "id" in raw:
            rule_id = raw["id"]
            self.ids.append((rule_id, self.doc.origin((*path, "id")), (*path, "id")))
        else:
            count = seen.count(pattern.text, path[-1])
            rule_id = rule_ids.given_id(list_name, pattern.text, count, rule_ids.implied(list_name))
        if action == DENY:
            ok = self.deny_only_conditions(path, raw) and ok
        if not ok:
            return None
        paths = raw.get("paths")
        return HostRule(
            action=action,
            pattern=pattern,
            origin=origin,
            id=rule_id,
            ports=ports,
            schemes=frozenset(raw["schemes"]) if "schemes" in raw else None,
            methods=frozenset(raw["methods"]) if "methods" in raw else None,
            paths=tuple(paths) if paths is not None else None,
            websocket=raw.get("websocket", True),
            intercept=raw.get("intercept", False),
            expires=expires,
            owner=raw.get("owner"),
            reason=raw.get("reason"),
        )

    def deny_only_conditions(self, path: KeyPath, raw: dict[str, Any]) -> bool:
        """Two keys of an allow rule that a deny rule cannot take, because there they would quietly open what the
        operator meant to close: ``websocket: false`` is a condition (the rule holds for requests that are not
        upgrades), so on a deny rule it let every WebSocket upgrade to the host through; ``intercept`` decrypts
        a host the policy allows, and a deny rule's was ignored, so its paths were still unread inside HTTPS."""
        ok = True
        if raw.get("websocket") is False:
            self.problem((*path, "websocket"), "a deny rule refuses a WebSocket upgrade like any other request to its "
                         "host, and websocket: false here would exempt upgrades from it (let them through); to keep "
                         "WebSockets out of a host you allow, write websocket: false on its allow rule")
            ok = False
        if raw.get("intercept") is True:
            self.problem((*path, "intercept"), "intercept applies to allow rules (it decrypts a host the policy "
                         "allows); a deny rule's paths and methods are checked inside HTTPS when an allow rule for "
                         "the host says intercept: true")
            ok = False
        return ok

    def upstream(self) -> Upstream | None:
        """The upstream proxy, only when the policy says in so many words that pinning cannot hold through it."""
        at: KeyPath = ("upstream",)
        if _at(self.doc.data, at) is _MISSING or not self.unusable.usable(at):
            return None
        section = self.section(at)
        proxy = self.value((*at, "proxy"), None)
        address = None
        if proxy is not None:
            try:
                address = parse_upstream_proxy(proxy)
            except ValueError as err:
                self.problem((*at, "proxy"), str(err))
        credentials = self.value((*at, "credentials_file"), None)
        if credentials is not None:
            wrong = check_credentials_path(credentials)
            if wrong:
                self.problem((*at, "credentials_file"), wrong)
        if "resolution" not in section and self.unusable.clean(at):
            origin = self.doc.origin((*at, "proxy"))
            where = f" (given by {origin.source})" if not origin.line else ""
            self.problem(at, f"an upstream proxy{where} resolves names itself, so egresswall cannot pin the address it "
                             "checked; set upstream.resolution: upstream in the policy to accept that (address rules "
                             "still run on egresswall's own resolution)")
            return None
        if address is None or not self.unusable.clean(at) or (credentials and check_credentials_path(credentials)):
            return None
        return Upstream(address[0], address[1], self.value((*at, "resolution"), RESOLUTION_UPSTREAM), credentials,
                        self.doc.origin(at))

    def body_allowed_on(self) -> frozenset[str]:
        """``http.body_allowed_on``: DELETE and OPTIONS at most, each once (the schema checked they are text)."""
        path: KeyPath = ("http", "body_allowed_on")
        first: dict[str, int] = {}
        for i, text in self.items(path)[1]:
            try:
                method = parse_body_method(text)
            except ValueError as err:
                self.problem((*path, i), str(err))
                continue
            if method in first:
                seen = self.doc.origin((*path, first[method]))
                self.problem((*path, i), f"{method} is listed twice (first at {seen.source}:{seen.line}:{seen.column})")
            first.setdefault(method, i)
        return frozenset(first)

    def nameservers(self) -> list[tuple[str, int]]:
        out = []
        for i, text in self.items(("resolver", "nameservers"))[1]:
            try:
                out.append(parse_nameserver(text))
            except ValueError as err:
                self.problem(("resolver", "nameservers", i), str(err))
        return out


_MISSING = object()


def _at(data: Any, path: KeyPath) -> Any:
    """The value at a key path, or _MISSING."""
    node = data
    for step in path:
        inside = (step in node) if isinstance(node, dict) else (
            isinstance(node, list) and isinstance(step, int) and 0 <= step < len(node))
        if not inside:
            return _MISSING
        node = node[step]
    return node


def parse_expiry(text: str) -> datetime:
    """The moment a rule stops matching. A bare date is a whole day, UTC: ``2027-06-30`` matches through
    the end of 30 June and stops at 2027-07-01T00:00Z. A time without a zone is UTC."""
    if len(text) == 10:
        day = date.fromisoformat(text)
        return datetime(day.year, day.month, day.day, tzinfo=UTC) + timedelta(days=1)
    moment = datetime.fromisoformat(text.replace(" ", "T"))
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def parse_nameserver(text: str) -> tuple[str, int]:
    """``IP``, ``IP:PORT`` or ``[IPv6]:PORT`` (a bare IPv6 too) → (ip, port); port 53 by default."""
    host, port = split_host_port(text, default_port=53)
    try:
        address = parse_address(host)
    except ValueError as err:
        raise ValueError(f"got {text!r}; expected an IP address ({err})") from None
    return str(address), port
