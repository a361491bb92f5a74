"""From squid's answers per request class to egresswall host rules, checked by egresswall itself.

egresswall's model is narrower than squid's: deny rules are checked before allow rules, the default
cannot depend on port, method or client, a deny rule for ``*.example.com`` also covers names below a
deeper anchor, and a CONNECT cannot be told from an absolute-form https request by host rules. The
construction therefore goes in three steps, each checked with ``policy.decision.decide``:

1. the default is ``allow`` only when squid allows every request class to hosts no ACL names;
2. with default ``deny``, allow rules for what squid allows, the most specific names first;
3. deny rules for whatever is still admitted that squid refuses, enclosing domains first (their deny
   rules may already cover what lies below them).

Whatever squid allows and the result refuses is a *loss*: reported, never silent. A request class
squid refuses and the result admits would be a bug, and raises.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

from policy.decision import Request, Resolution, decide
from policy.hosts import HostFormError, Target, normalise_host
from policy.model import ALLOW, DENY, Policy

from .acls import BELOW, CONNECT, EXACT, HTTP, HTTPS, IP_ANY
from .emit import HTTP_SCHEMES, TLS_SCHEMES, RuleSpec
from .space import Cell, Region

Want = dict[str, frozenset[Cell]]  # region key -> the cells squid allows


@dataclass(frozen=True)
class Probe:
    """How to ask egresswall about one request class."""

    request: Request | None  # None: egresswall refuses the host's form outright
    resolution: Resolution | None


def egress_probe(region: Region, cell: Cell, client: str, address: str) -> Probe:
    host = region.host
    if region.kind == IP_ANY:
        name, ip = address, ipaddress.ip_address(address)
    elif host.ip is not None:
        name, ip = host.name, ipaddress.ip_address(host.name)
    else:
        try:
            name, ip = normalise_host(host.name)
        except HostFormError:
            return Probe(None, None)
        if name != host.name:
            return Probe(None, None)
    scheme = {CONNECT: "https", HTTP: "http", HTTPS: "https"}[cell.kind]
    target = Target(scheme, name, cell.port, "" if cell.kind == CONNECT else "/", ip)
    request = Request(target, cell.method, client, tunnel=cell.kind == CONNECT)
    return Probe(request, None if ip is not None else Resolution(name, (address,)))


def admits(policy: Policy, probe: Probe) -> bool:
    if probe.request is None:
        return False
    return decide(policy, probe.request, probe.resolution).allowed


def port_set(cells: Iterable[Cell]) -> frozenset[int]:
    ports: set[int] = set()
    for cell in cells:
        ports.update(range(cell.low, cell.high + 1))
    return frozenset(ports)


@dataclass
class Gates:
    connect: frozenset[int]
    http: frozenset[int]
    cells: frozenset[Cell]  # the cells egresswall's port checks let through to host rules

    @classmethod
    def of(cls, allowed: Iterable[Cell], all_cells: list[Cell]) -> Gates:
        allowed = set(allowed)
        connect_atoms = {(c.low, c.high) for c in allowed if c.kind == CONNECT}
        http_atoms = {(c.low, c.high) for c in allowed if c.kind == HTTP}
        gated = frozenset(c for c in all_cells if (c.low, c.high) in (http_atoms if c.kind == HTTP else connect_atoms))
        return cls(port_set(c for c in allowed if c.kind == CONNECT), port_set(c for c in allowed if c.kind == HTTP),
                   gated)


def allow_specs(pattern: str, cells: frozenset[Cell], gates: Gates, methods: list[str]) -> list[RuleSpec]:
    """Allow rules admitting what ``cells`` asks for, or less (over-admission of methods the ACLs do
    not name is repaired by deny rules afterwards)."""
    if cells == gates.cells:
        return [RuleSpec(pattern)]
    specs: list[RuleSpec] = []
    connect = port_set(c for c in cells if c.kind == CONNECT)
    if connect:
        # A CONNECT allow rule (no method can be seen in a tunnel) admits absolute-form https too.
        specs.append(RuleSpec(pattern, None if connect == gates.connect else connect, TLS_SCHEMES))
    plain = _per_atom(cells, HTTP, methods)
    tls = {atom: chosen for atom, chosen in _per_atom(cells, HTTPS, methods).items() if atom[0] not in connect}

    def every(chosen: tuple[str, ...]) -> bool:
        return set(chosen) == set(methods) or methods[-1] in chosen  # the last method stands for the rest

    def indifferent_tls(atom: tuple[int, int]) -> bool:  # refused by ports.connect, or admitted by CONNECT
        return atom[0] not in gates.connect or atom[0] in connect

    def indifferent_plain(atom: tuple[int, int]) -> bool:
        return atom[0] not in gates.http

    # One rule without schemes serves plain and absolute-form https where both want the same methods (or
    # where the other kind does not matter at that port); other method lists get a rule per kind.
    shared = {chosen for atom, chosen in plain.items() if not every(chosen) and tls.get(atom) == chosen}
    shared |= {chosen for chosen in plain.values() if not every(chosen)} & {
        chosen for chosen in tls.values() if not every(chosen)}
    groups: dict[tuple[tuple[str, ...], tuple[str, ...] | None], set[int]] = {}
    for atom in sorted(set(plain) | set(tls)):
        wanted_plain, wanted_tls = plain.get(atom), tls.get(atom)
        keys = []
        if wanted_plain and every(wanted_plain):
            keys.append(((), HTTP_SCHEMES))
        elif wanted_plain:
            both = wanted_plain in shared and (indifferent_tls(atom) or wanted_tls == wanted_plain)
            keys.append((wanted_plain, None if both else HTTP_SCHEMES))
        if wanted_tls and not every(wanted_tls) and (wanted_tls, None) not in keys:
            both = wanted_tls in shared and (indifferent_plain(atom) or wanted_plain == wanted_tls)
            keys.append((wanted_tls, None if both else TLS_SCHEMES))
        # (every method over absolute-form https without the CONNECT: no rule can say it; refused)
        for key in keys:
            groups.setdefault(key, set()).update(range(atom[0], atom[1] + 1))
    for (chosen, schemes), ports in sorted(groups.items(), key=lambda g: (g[0][0], g[0][1] or ())):
        gate = gates.http if schemes == HTTP_SCHEMES else gates.connect if schemes else gates.http | gates.connect
        specs.append(RuleSpec(pattern, None if ports >= gate else frozenset(ports), schemes, chosen or None))
    tunnel_everywhere = RuleSpec(pattern, None, TLS_SCHEMES)
    plain_everywhere = RuleSpec(pattern, None, HTTP_SCHEMES)
    if specs == [tunnel_everywhere, plain_everywhere]:
        return [RuleSpec(pattern)]  # the same as one rule without conditions
    return specs


def _per_atom(cells: Iterable[Cell], kind: str, methods: list[str]) -> dict[tuple[int, int], tuple[str, ...]]:
    chosen: dict[tuple[int, int], set[str]] = {}
    for cell in cells:
        if cell.kind == kind:
            chosen.setdefault((cell.low, cell.high), set()).add(cell.method)
    return {atom: tuple(m for m in methods if m in found) for atom, found in chosen.items()}


def deny_specs(pattern: str, cells: set[Cell], gates: Gates, methods: list[str]) -> list[RuleSpec]:
    """Deny rules refusing at least ``cells``."""
    if cells >= gates.cells:
        return [RuleSpec(pattern)]
    specs: list[RuleSpec] = []
    connect = port_set(c for c in cells if c.kind == CONNECT)
    if connect:
        specs.append(RuleSpec(pattern, None if connect == gates.connect else connect, TLS_SCHEMES))
    for kind, schemes, gate in ((HTTP, HTTP_SCHEMES, gates.http), (HTTPS, TLS_SCHEMES, gates.connect)):
        rest = {c for c in cells if c.kind == kind and not (kind == HTTPS and c.port in connect)}
        for ports, chosen in _method_groups(rest, kind, methods):
            every = set(chosen) == set(methods) or methods[-1] in chosen
            ports_or_all = None if ports == gate else ports
            if not every:
                specs.append(RuleSpec(pattern, ports_or_all, schemes, tuple(chosen)))
            elif kind == HTTP:
                specs.append(RuleSpec(pattern, ports_or_all, schemes))
            else:  # every visible https request, but not the CONNECT: only a path condition says that
                specs.append(RuleSpec(pattern, ports_or_all, schemes, paths=("/",)))
    whole = {spec.schemes for spec in specs if spec.ports is None and spec.methods is None and spec.paths is None}
    if {TLS_SCHEMES, HTTP_SCHEMES} <= whole:
        return [RuleSpec(pattern)]  # CONNECT and https refused at every port, and plain HTTP too: all of it
    return specs


def _method_groups(cells: Iterable[Cell], kind: str, methods: list[str]) -> list[tuple[frozenset[int], list[str]]]:
    by_atom: dict[tuple[int, int], set[str]] = {}
    for cell in cells:
        if cell.kind == kind:
            by_atom.setdefault((cell.low, cell.high), set()).add(cell.method)
    groups: dict[tuple[str, ...], set[int]] = {}
    for (low, high), chosen in by_atom.items():
        key = tuple(m for m in methods if m in chosen)
        groups.setdefault(key, set()).update(range(low, high + 1))
    return [(frozenset(ports), list(key)) for key, ports in sorted(groups.items())]


@dataclass
class Scope:
    default: str
    allow: list[RuleSpec]
    deny: list[RuleSpec]
    dropped: list[RuleSpec]  # allow rules an enclosing deny rule makes useless
    twins: dict[str, str] = field(default_factory=dict)  # region key -> key of the region it was built like


Group = tuple[Region, Region | None]  # an anchor's EXACT region and its BELOW region (None for an address)


def synthesise(regions: list[Region], want: Want, gates: Gates, methods: list[str],
               build: Callable[[str, list[RuleSpec], list[RuleSpec]], Policy],
               probe: Callable[[Region, Cell], Probe],
               comment: Callable[[Region, Iterable[Cell], str], str]) -> Scope:
    by_key = {region.key: region for region in regions}
    rest_ok = bool(gates.cells) and all(want[key] >= gates.cells for key in ("rest", "ip-any"))
    default = ALLOW if rest_ok else DENY
    # Anchors with no anchor above or below them do not interact: those squid treats alike get rules alike,
    # so one of each kind is worked out (and checked) and the others are copies. This keeps a squid.conf
    # with a list of 100,000 domains tractable.
    work, alike = _classes(_anchor_groups(regions), want, gates, probe)

    allow: list[RuleSpec] = []
    if default == DENY:
        for exact, below in sorted(work, key=lambda g: -g[0].depth if g[0].host.ip is None else -999):
            allow += _specs_for(exact, below, want[exact.key], want[below.key] if below else None,
                                lambda p, cells: allow_specs(p, cells, gates, methods), comment, ALLOW)

    deny: list[RuleSpec] = []
    over_by_key: dict[str, frozenset[Cell]] = {}
    policy = build(default, allow, deny)
    for exact, below in sorted(work, key=lambda g: g[0].depth):
        over: list[frozenset[Cell] | None] = []
        for region in (exact, below):
            if region is None:
                over.append(None)
                continue
            admitted = {cell for cell in gates.cells if admits(policy, probe(region, cell))}
            over.append(frozenset(admitted - want[region.key]))
            over_by_key[region.key] = over[-1]
        if not any(over):
            continue
        deny += _specs_for(exact, below, over[0], over[1], lambda p, cells: deny_specs(p, set(cells), gates, methods),
                           comment, DENY)
        policy = build(default, allow, deny)
    for key in ("rest", "ip-any"):
        region = by_key[key]
        stray = {cell for cell in gates.cells if admits(policy, probe(region, cell))} - want[key]
        if stray:
            raise RuntimeError(f"internal error: {region.describe()} admitted {sorted(stray)} that squid refuses")

    work_regions = [r for group in work for r in group if r is not None] + [by_key["rest"], by_key["ip-any"]]
    kept, dropped = _prune(work_regions, allow, deny, default, gates, build, probe)
    twins: dict[str, str] = {}
    for template, copies in alike:
        own = [_own(specs, template) for specs in (kept, deny, dropped)]
        for group in copies:
            kept += _copy(own[0], template, group, want, comment, ALLOW)
            deny += _copy(own[1], template, group, over_by_key, comment, DENY)
            dropped += _copy(own[2], template, group, want, comment, ALLOW)
            for mine, theirs in zip(group, template, strict=True):
                if mine is not None and theirs is not None:
                    twins[mine.key] = theirs.key
    return Scope(default, kept, deny, dropped, twins)


def _classes(groups: list[Group], want: Want, gates: Gates, probe: Callable[[Region, Cell], Probe]
             ) -> tuple[list[Group], list[tuple[Group, list[Group]]]]:
    """The groups to work out one by one, and (template, copies) for isolated anchors treated alike."""
    names = {exact.anchor for exact, _ in groups if exact.host.ip is None}
    related: set[str] = set()
    for name in names:
        suffix = name or ""
        while "." in suffix:
            suffix = suffix.split(".", 1)[1]
            if suffix in names:
                related |= {name, suffix}
    sample = min(gates.cells) if gates.cells else None
    work: list[Group] = []
    classes: dict[tuple, list[Group]] = {}
    for group in groups:
        exact, below = group
        if exact.anchor in related or sample is None:
            work.append(group)
            continue
        # Alike: the same cells wanted, and the same fate of the host's form (a name without a dot...).
        key = (exact.host.ip is not None, want[exact.key], want[below.key] if below else None,
               probe(exact, sample).request is None, probe(below, sample).request is None if below else None)
        classes.setdefault(key, []).append(group)
    alike = []
    for members in classes.values():
        work.append(members[0])
        if len(members) > 1:
            alike.append((members[0], members[1:]))
    return work, alike


def _own(specs: list[RuleSpec], group: Group) -> list[RuleSpec]:
    """The rules written for this group's anchor (name, .name or *.name)."""
    name = group[0].anchor or ""
    return [spec for spec in specs if spec.pattern in (name, "." + name, "*." + name)]


def _copy(specs: list[RuleSpec], template: Group, group: Group, cells_by_key: Mapping[str, frozenset[Cell]],
          comment: Callable[[Region, Iterable[Cell], str], str], action: str) -> list[RuleSpec]:
    """The template group's rules, renamed for another group alike; comments written for it."""
    old, new = template[0].anchor or "", group[0].anchor or ""
    out: list[RuleSpec] = []
    commented: set[str] = set()
    for spec in specs:
        for prefix, part in (("", 0), (".", 0), ("*.", 1)):
            if spec.pattern != prefix + old:
                continue
            region = group[part]
            copy = replace(spec, pattern=prefix + new, comment="")
            if region is not None and region.key not in commented:
                commented.add(region.key)
                copy.comment = comment(region, cells_by_key.get(template[part].key, frozenset()), action)
            out.append(copy)
    return out


def _prune(regions: list[Region], allow: list[RuleSpec], deny: list[RuleSpec], default: str, gates: Gates,
           build: Callable[[str, list[RuleSpec], list[RuleSpec]], Policy],
           probe: Callable[[Region, Cell], Probe]) -> tuple[list[RuleSpec], list[RuleSpec]]:
    """Leave out allow rules that the deny rules (for the same name or an enclosing one) make useless:
    they would only confuse a reader, and lint rightly says they can never match."""
    deny_patterns = [spec.host_rule(DENY).pattern for spec in deny]
    kept, dropped = list(allow), []
    policy = build(default, kept, deny)
    for spec in allow:
        pattern = spec.host_rule(ALLOW).pattern
        if not any(other.covers(pattern) for other in deny_patterns):
            continue
        hit = [region for region in regions if region.host.name and pattern.matches(region.host.name)]
        trial_rules = [other for other in kept if other is not spec]
        trial = build(default, trial_rules, deny)
        if all(admits(policy, probe(region, cell)) == admits(trial, probe(region, cell))
               for region in hit for cell in gates.cells):
            kept, policy = trial_rules, trial
            dropped.append(spec)
    return kept, dropped


def _anchor_groups(regions: list[Region]) -> list[tuple[Region, Region | None]]:
    below = {region.anchor: region for region in regions if region.kind == BELOW}
    return [(region, below.get(region.anchor) if region.host.ip is None else None)
            for region in regions if region.kind == EXACT]


def _specs_for(exact: Region, below: Region | None, exact_cells: frozenset[Cell] | None,
               below_cells: frozenset[Cell] | None, make: Callable[[str, frozenset[Cell]], list[RuleSpec]],
               comment: Callable[[Region, Iterable[Cell], str], str], action: str) -> list[RuleSpec]:
    """Rules for an anchor's name and the names below it: one '.name' rule when both need the same."""
    name = exact.anchor or ""
    if below is not None and exact_cells and exact_cells == below_cells:
        specs = make("." + name, exact_cells)
        _annotate(specs, comment(exact, exact_cells, action))
        return specs
    specs = []
    if exact_cells:
        part = make(name, exact_cells)
        _annotate(part, comment(exact, exact_cells, action))
        specs += part
    if below is not None and below_cells:
        part = make("*." + name, below_cells)
        _annotate(part, comment(below, below_cells, action))
        specs += part
    return specs


def _annotate(specs: list[RuleSpec], text: str) -> None:
    if specs:
        specs[0].comment = text
