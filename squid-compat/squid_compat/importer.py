"""``egresswall squid import``: the access-control part of a squid.conf as an egresswall policy.

squid's access lists are evaluated for every request class the configuration can tell apart (see
``space``), with undecided ACLs kept open (see ``acls``); egresswall rules are then built to admit
exactly what squid certainly allows, or less (see ``synth``), and the written YAML is loaded back with
``policy.loader`` and checked class by class. Every place where the result refuses more than squid is
reported with the squid line it concerns.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import netaddr
import yaml

from policy.addresses import AddressRules, parse_cidr
from policy.loader import PolicyError, parse_policy
from policy.model import ALLOW, DENY, HostTable, Policy

from . import addrsets
from .acls import (
    BELOW,
    CONNECT,
    EXACT,
    IP_ANY,
    REST,
    Context,
    DstAcl,
    GroupAcl,
    ManagerAcl,
    Probe,
    ip_text,
    literal_acl,
)
from .acltable import PREDEFINED, AclTable
from .conf import ConfError, Directive, parse_directive, read_conf, read_conf_text
from .directives import SQUID_DIRECTIVES
from .emit import PolicySpec, ScopeSpec, comment_lines, to_yaml
from .losses import DENY_OVERLAP, Loss, classify, report
from .program import ACCESS_LIST_ALIASES, ACCESS_LISTS, AccessRule, Outcome, Program
from .report import BUILT_IN, NOTE, WARNING, Note, Where, printable
from .space import Cell, Region, Space, build_space
from .synth import Gates, admits, egress_probe, synthesise

NOTHING_ADMITTED = "nothing-admitted"  # a client class squid allows something keeps nothing
NON_GLOBAL_RANGES = "non-global-ranges"  # non-global ranges squid reaches and egresswall refuses

COPIES_CHECKED = 3  # of each group of anchors built alike, how many are decided in full by the check

# Directives that touch access control but have no egresswall translation: said once each.
DIRECTIVE_WARNINGS = {
    "http_reply_access": ("filters responses after the request was sent; egresswall decides requests only",
                          "reply-access"),
    "ssl_bump": ("squid decrypts TLS here; egresswall passes TLS through unless a host rule says intercept: true",
                 "ssl-bump"),
    "never_direct": ("squid forwards through a parent proxy; egresswall connects directly, to the address it "
                     "checked", "peer"),
    "always_direct": ("squid chooses direct or parent routing; egresswall always connects directly", "peer"),
    "cache_peer": ("squid forwards through a parent proxy; egresswall connects directly", "peer"),
    "cache_peer_access": ("parent-proxy routing; egresswall connects directly", "peer"),
    "hosts_file": ("squid resolves names from this file; egresswall resolves through DNS only, never from a "
                   "hosts file", "hosts-file"),
    "url_rewrite_program": ("squid rewrites URLs; egresswall decides the URL the client sent", "rewrite"),
    "url_rewrite_access": ("squid rewrites URLs; egresswall decides the URL the client sent", "rewrite"),
    "store_id_program": ("squid rewrites cache keys; not access control in egresswall", "rewrite"),
    "external_acl_type": ("a helper decides ACLs of this type; such ACLs are undecided here", "helper"),
    "auth_param": ("proxy authentication is not part of egresswall; proxy_auth ACLs are undecided", "auth"),
    "follow_x_forwarded_for": ("egresswall chooses roles by the address that connected, never by "
                               "X-Forwarded-For", "client-address"),
    "icap_service": ("content adaptation is not part of egresswall", "adaptation"),
    "ecap_service": ("content adaptation is not part of egresswall", "adaptation"),
    "adaptation_access": ("content adaptation is not part of egresswall", "adaptation"),
}


@dataclass
class ImportResult:
    yaml: str
    policy: Policy
    notes: list[Note]
    losses: list[Loss]
    space: Space
    program: Program = field(repr=False, default_factory=Program)
    context: Context | None = field(repr=False, default=None)
    # Per client class (squid src ACL names): how many request classes squid allows, and how many of
    # those the imported policy admits.
    squid_allows: dict[str, int] = field(default_factory=dict)
    policy_admits: dict[str, int] = field(default_factory=dict)
    # squid's dst ACLs let it reach only addresses egresswall refuses without a rule (acl x dst 10.0.0.0/8,
    # http_access allow x): the request classes above are judged on addresses egresswall may reach, so they
    # count nothing squid allows, and the policy admits nothing at all.
    only_refused_destinations: bool = False
    # No http_access line at all: squid refuses every request. A file with none is rarely the squid.conf meant.
    no_http_access: bool = False

    @property
    def failure(self) -> str | None:
        """Why this import must not be deployed as a translation (the command exits 1), or None."""
        if self.no_http_access:
            return "it has no http_access line (squid then refuses every request): there is nothing to translate"
        if self.admits_nothing:
            return "the imported policy refuses every request squid allows, for every client"
        return None

    @property
    def admits_nothing(self) -> bool:
        """squid allows something, and the imported policy admits none of it, for every client class."""
        if self.only_refused_destinations:
            return True
        return any(self.squid_allows.values()) and not any(self.policy_admits.values())

    def clients_left_with_nothing(self) -> list[str]:
        return [name for name, count in self.squid_allows.items() if count and not self.policy_admits.get(name)]

    @property
    def warnings(self) -> list[Note]:
        return [note for note in self.notes if note.level == WARNING]

    def region_of(self, host: str) -> Region:
        """The region of the host space a concrete host falls in."""
        text = host.strip("[]").lower().rstrip(".")
        try:
            address = netaddr.IPAddress(text, flags=netaddr.INET_PTON)
            text = ip_text(address.ipv4() if address.version == 6 and address.is_ipv4_mapped() else address)
            return next((r for r in self.space.regions if r.host.ip is not None and r.anchor == text),
                        next(r for r in self.space.regions if r.kind == IP_ANY))
        except (ValueError, netaddr.AddrFormatError):
            pass
        regions = {(r.kind, r.anchor): r for r in self.space.regions if r.host.ip is None}
        if (EXACT, text) in regions:
            return regions[(EXACT, text)]
        suffix = text
        while "." in suffix:
            suffix = suffix.split(".", 1)[1]
            if (BELOW, suffix) in regions:
                return regions[(BELOW, suffix)]
        return next(r for r in self.space.regions if r.kind == REST)

    def squid_outcome(self, client: str, kind: str, method: str, port: int, host: str,
                      addresses: Sequence[str] = ()) -> Outcome:
        """What the translated squid program says about one concrete request whose name resolves to
        ``addresses`` (tests compare it with egresswall's decision)."""
        from .acls import HostRef

        text = host.strip("[]").lower().rstrip(".")
        ip = None
        try:
            ip = netaddr.IPAddress(text, flags=netaddr.INET_PTON)
            ip = ip.ipv4() if ip.version == 6 and ip.is_ipv4_mapped() else ip
            text = ip_text(ip)
        except (ValueError, netaddr.AddrFormatError):
            pass
        assert self.context is not None
        context = replace(self.context, resolved=tuple(netaddr.IPAddress(a) for a in addresses))
        probe = Probe(netaddr.IPAddress(client), kind, method, port, HostRef(EXACT, text, ip))
        return self.program.evaluate(probe, context)


def import_conf(path: str | Path, readmit: Sequence[str] = ()) -> ImportResult:
    directives, notes = read_conf(path)
    return _Importer(directives, notes, str(path), readmit).run()


def import_text(text: str, source: str = "squid.conf", readmit: Sequence[str] = ()) -> ImportResult:
    directives, notes = read_conf_text(text, source)
    return _Importer(directives, notes, source, readmit).run()


class _Importer:
    def __init__(self, directives: list[Directive], notes: list[Note], source: str, readmit: Sequence[str]) -> None:
        self.directives = directives
        self.notes = notes
        self.source = source
        self.readmit = netaddr.IPSet()
        for cidr in readmit:
            try:
                network = parse_cidr(cidr)
            except ValueError as err:
                raise ValueError(f"--readmit {cidr}: not an address range ({err})") from None
            self.readmit.add(network)
        self.table = AclTable()
        self.program = Program()
        self.nameservers: list[str] = []
        self.twins: dict[int, dict[str, str]] = {}  # client class -> region twins of its scope
        self.nameservers_where: Where | None = None

    # ---- reading ---------------------------------------------------------------------------------

    def _load(self) -> None:
        builtin_notes: list[Note] = []
        for line in PREDEFINED:
            self.table.define(parse_directive(line, BUILT_IN), builtin_notes)
        self._refuse_unknown_directives()
        self.table.method_case_exact = any(d.name == "relaxed_header_parser" and d.args[:1] == ("off",)
                                           for d in self.directives)
        seen_warnings: set[str] = set()
        for directive in self.directives:
            name = directive.name
            if name == "acl":
                self.table.define(directive, self.notes)
            elif name in ACCESS_LISTS or name in ACCESS_LIST_ALIASES:
                self.program.add(directive, self.notes, self.table.defines)
            elif name == "dns_nameservers":
                self._nameservers(directive)
            elif name == "configuration_includes_quoted_values" and directive.args[:1] == ("on",):
                raise ConfError(f"{directive.where}: configuration_includes_quoted_values on: squid then reads quoted "
                                "values and parameters(...) instead of value files; not supported (turn it off, or "
                                "import a configuration without it)")
            elif name in DIRECTIVE_WARNINGS:
                message, category = DIRECTIVE_WARNINGS[name]
                level = WARNING if name not in seen_warnings else NOTE
                seen_warnings.add(name)
                self.notes.append(Note(directive.where, f"{name}: {message}; not translated", category, level))
            elif name in ("http_port", "https_port") and any(
                    word in ("intercept", "transparent", "tproxy", "accel") for word in directive.args):
                self.notes.append(Note(directive.where, f"{directive.text}: egresswall is a forward proxy only; "
                                                        "interception/acceleration modes are not translated",
                                       "listener"))
            else:
                self.notes.append(Note(directive.where, f"{name}: not access control; not translated",
                                       "not-access-control", NOTE))

    def _refuse_unknown_directives(self) -> None:
        """squid refuses to start on a directive it does not know ("unrecognized"): so does the import. A
        misspelled ``http_acess deny bad`` would otherwise drop a refusal squid never ran without, and a file
        that is no squid.conf at all (a policy YAML) would import as an empty policy."""
        unknown = [d for d in self.directives if d.name not in SQUID_DIRECTIVES]
        if unknown:
            lines = [f"{d.where}: unrecognized directive {printable(d.name)!r}" for d in unknown[:20]]
            more = f"\n... and {len(unknown) - 20} more" if len(unknown) > 20 else ""
            raise ConfError("\n".join(lines) + more + "\n(squid refuses to start on a directive it does not know; "
                            "is this a squid.conf?)")

    def _nameservers(self, directive: Directive) -> None:
        for value in directive.args:
            try:
                netaddr.IPAddress(value, flags=netaddr.INET_PTON)
            except (ValueError, netaddr.AddrFormatError):
                self.notes.append(Note(directive.where, f"dns_nameservers {value}: not an address; skipped",
                                       "resolver"))
                continue
            self.nameservers.append(value)
            self.nameservers_where = self.nameservers_where or directive.where

    def _used(self) -> set[str]:
        used: set[str] = set()
        pending = [literal.name for rule in self.program.rules for literal in rule.literals if not literal.undefined]
        while pending:
            name = pending.pop()
            if name in used:
                continue
            used.add(name)
            acl = self.table.acls.get(name)
            if isinstance(acl, GroupAcl):
                pending += list(acl.members())
        for rule in self.program.rules:
            for literal in rule.literals:
                acl = literal_acl(literal, self.table.acls)
                if isinstance(acl, ManagerAcl):
                    first = not any(note.category == "cache-manager" for note in self.notes)
                    self.notes.append(Note(rule.where, f"{rule.text}: acl manager names squid's own cache manager, "
                                                       "which egresswall does not have; translated as never matching "
                                                       "(squid would also apply it to origin URLs whose path starts "
                                                       "/squid-internal-mgr/)", "cache-manager",
                                           WARNING if first else NOTE))
                elif acl is not None and acl.undecided_because:
                    self.notes.append(Note(rule.where, f"{rule.text}: acl {literal.written} is undecided "
                                                       f"({acl.undecided_because}); where its answer matters, "
                                                       "egresswall refuses", "untranslatable-acl"))
        for name, acl in self.table.acls.items():
            if name not in used and acl.where != BUILT_IN:
                self.notes.append(Note(acl.where, f"acl {acl.name} is defined but no access list uses it", "unused",
                                       NOTE))
        return used

    # ---- addresses -------------------------------------------------------------------------------

    def _addresses(self) -> tuple[netaddr.IPSet, list[tuple[netaddr.IPSet, AccessRule, str]]]:
        """Address ranges squid refuses whatever else a request is: unconditional ``deny dst`` lines,
        ``deny !dst`` lines, and every allow line naming a destination. egresswall refuses them by
        address rule, for every request (it checks addresses after host rules)."""
        denied = netaddr.IPSet()
        why: list[tuple[netaddr.IPSet, AccessRule, str]] = []
        everything = netaddr.IPSet(["0.0.0.0/0", "::/0"])
        access = self.program.lists["http_access"]
        for rule in self.program.rules:
            literals = [lit for lit in rule.literals if lit.name != "all" or lit.negated or lit.undefined]
            if rule.action != DENY or len(literals) != 1:
                continue
            acl = literal_acl(literals[0], self.table.acls)
            if not isinstance(acl, DstAcl) or acl.undecided_because or acl.names:
                continue
            ranges = everything - acl.addresses if literals[0].negated else acl.addresses
            denied |= ranges
            why.append((ranges, rule, "squid refuses a request when any address of the name is in these ranges"
                        if not literals[0].negated else "squid refuses every request to an address outside "
                        f"acl {acl.name}"))
        allows = [rule for rule in access.rules if rule.action == ALLOW]
        last = access.rules[-1] if access.rules else None
        catch_all = last is not None and last.action == DENY and all(
            literal.name == "all" and not literal.negated and not literal.undefined for literal in last.literals)
        if allows and (access.default == DENY or catch_all):
            destinations = [self._positive_dst(rule) for rule in allows]
            if all(d is not None for d in destinations):
                union = netaddr.IPSet()
                for ranges in destinations:
                    union |= ranges
                outside = everything - union
                denied |= outside
                why.append((outside, allows[0], "every http_access allow line names a destination (dst), so squid "
                                                "allows only requests with an address in them; egresswall requires "
                                                "every address to be in them"))
        return denied, why

    def _positive_dst(self, rule: AccessRule) -> netaddr.IPSet | None:
        ranges = None
        for literal in rule.literals:
            acl = literal_acl(literal, self.table.acls)
            if isinstance(acl, DstAcl) and not literal.negated and not acl.undecided_because and not acl.names:
                ranges = acl.addresses if ranges is None else ranges & acl.addresses
        return ranges

    # ---- the run ---------------------------------------------------------------------------------

    def run(self) -> ImportResult:
        self._load()
        used = self._used()
        denied, why = self._addresses()
        readmit = self.readmit - denied
        if self.readmit & denied:
            self.notes.append(Note(None, f"--readmit {', '.join(addrsets.cidrs(self.readmit & denied))}: squid "
                                         "refuses these addresses; not re-admitted", "readmit"))
        admissible = addrsets.admitted(addrsets.cidrs(readmit), addrsets.cidrs(denied))
        only_refused = self._only_refused_destinations(denied, admissible, why)
        # Written as squid's ranges, less those egresswall refuses without a rule (said in a comment).
        implicit = addrsets.never_global() | addrsets.cloud_metadata()
        effective_deny = netaddr.IPSet(network for network in denied.iter_cidrs()
                                       if not netaddr.IPSet([network]).issubset(implicit))
        ctx = Context(self.table.acls, admissible)
        space = build_space(self.table, used)
        answers = self._evaluate(space, ctx)
        spec, scopes = self._build(space, answers, admissible, readmit, effective_deny, denied, why)
        yaml_text = to_yaml(spec)
        try:
            policy = parse_policy(yaml_text, self.source + " (imported)")
        except PolicyError as err:  # a bug here, never the operator's
            raise RuntimeError(f"internal error: the imported policy does not load: {err}\n{yaml_text}") from None
        self.squid_allows: dict[str, int] = defaultdict(int)
        self.policy_admits: dict[str, int] = defaultdict(int)
        losses = self._verify(policy, space, answers, scopes, admissible)
        if any(self.squid_allows.values()):
            self._non_global_note(denied | readmit)
        no_http_access = not self.program.lists["http_access"].rules
        if no_http_access:
            self.notes.append(Note(None, "no http_access line: squid refuses every request without one, and so does "
                                         "the imported policy (is this the squid.conf you meant?)", "no-http-access"))
        result = ImportResult("", policy, self.notes, losses, space, self.program, ctx,
                              dict(self.squid_allows), dict(self.policy_admits), only_refused, no_http_access)
        for name in result.clients_left_with_nothing():
            self.notes.append(Note(None, f"clients {name}: squid allows {self.squid_allows[name]} request class(es) "
                                         "from them, and the imported policy admits none: every request from these "
                                         "clients is refused (the warnings above say why)", NOTHING_ADMITTED))
        result.yaml = self._with_warnings(yaml_text)
        same_document(result.yaml, yaml_text, self.source + " (imported)")
        return result

    def _only_refused_destinations(self, denied: netaddr.IPSet, admissible: netaddr.IPSet,
                                   why: list[tuple[netaddr.IPSet, AccessRule, str]]) -> bool:
        """squid allows requests, but its dst ACLs leave it only addresses egresswall refuses without a rule
        (non-global, cloud metadata): said as a warning, since the policy then admits nothing at all."""
        allows = [rule for rule in self.program.lists["http_access"].rules if rule.action == ALLOW]
        everything = netaddr.IPSet(["0.0.0.0/0", "::/0"]) - netaddr.IPSet([addrsets.MAPPED])
        reach = everything - denied
        if not allows or not why or not reach or reach & admissible:
            return False
        ranges = ", ".join(addrsets.cidrs(reach, bare_hosts=False))
        rule = why[0][1]  # the line whose dst ACL took the other addresses away
        self.notes.append(Note(rule.where, f"{rule.text}: squid's dst ACLs let it reach only {ranges}, and "
                                                "egresswall refuses every one of these addresses without a rule (a "
                                                "non-global one unless addresses.allow re-admits it, cloud metadata "
                                                "always); a dst ACL never admits "
                                                "anything in egresswall (it becomes addresses.deny of every other "
                                                "range, and host rules still decide first), so the imported policy "
                                                "admits no request at all; import with --readmit CIDR for the ranges "
                                                "you mean to reach", "non-global-address"))
        return True

    def _count(self, client: str, outcome: Outcome, admitted: bool) -> None:
        # A class squid may allow (an undecided ACL left open) counts: squid allows it for some requests.
        if outcome.allowed or ALLOW in outcome.actions:
            self.squid_allows[client] += 1
            self.policy_admits[client] += admitted

    def _non_global_note(self, covered: netaddr.IPSet) -> None:
        """Non-global ranges squid would connect to (no dst deny covers them) and egresswall refuses."""
        refused = (addrsets.never_global() | addrsets.cloud_metadata()) - covered
        unicast = netaddr.IPSet([addrsets.GLOBAL_UNICAST_V6])
        listed = netaddr.IPSet(n for n in refused.iter_cidrs() if n.version == 4) | (refused & unicast)
        shown = addrsets.cidrs(listed)
        if any(network.version == 6 for network in (refused - unicast).iter_cidrs()):
            # Written out, IPv6 outside global unicast is a hundred ranges: named as the whole it is.
            partly = bool(covered & (netaddr.IPSet(["::/0"]) - unicast))
            shown.append("IPv6 outside 2000::/3" + (" (in part)" if partly else ""))
        if refused:
            self.notes.append(Note(None, "squid allows names that resolve into these non-global ranges (no dst deny "
                                         "covers them), and egresswall refuses them: " + ", ".join(shown)
                                         + "; to re-admit one you really mean to reach, list it under addresses.allow "
                                         "(or import with --readmit CIDR)", NON_GLOBAL_RANGES, NOTE))

    def _evaluate(self, space: Space, ctx: Context) -> dict[tuple[int, str, Cell], Outcome]:
        """squid's outcome for every (client class, region, cell); regions alike in every host-dependent
        ACL share one evaluation."""
        host_acls = [acl for acl in self.table.acls.values() if acl.host_dependent or isinstance(acl, DstAcl)]
        cache: dict[tuple, Outcome] = {}
        out: dict[tuple[int, str, Cell], Outcome] = {}
        for region in space.regions:
            probe0 = Probe(space.clients[0].representative, CONNECT, "CONNECT", 443, region.host)
            signature = tuple(acl.evaluate(probe0, ctx) for acl in host_acls)
            for i, client in enumerate(space.clients):
                for cell in space.cells:
                    key = (i, signature, cell)
                    if key not in cache:
                        probe = Probe(client.representative, cell.kind, cell.method, cell.port, region.host)
                        cache[key] = self.program.evaluate(probe, ctx)
                    out[(i, region.key, cell)] = cache[key]
        return out

    def _build(self, space: Space, answers: dict[tuple[int, str, Cell], Outcome], admissible: netaddr.IPSet,
               readmit: netaddr.IPSet, effective_deny: netaddr.IPSet, denied: netaddr.IPSet,
               why: list[tuple[netaddr.IPSet, AccessRule, str]]) -> tuple[PolicySpec, list[tuple[str | None,
                                                                                              list[int]]]]:
        allowed_cells = {cell for (_, _, cell), outcome in answers.items() if outcome.allowed}
        gates = Gates.of(allowed_cells, space.cells)
        spec = PolicySpec(self._header(), gates.connect, gates.http, self._ports_comment(gates))
        spec.address_allow = [(cidr, "re-admitted with --readmit (egresswall refuses non-global addresses "
                                     "otherwise)") for cidr in addrsets.cidrs(readmit)]
        spec.address_deny = self._deny_entries(effective_deny, denied, why)
        if self.nameservers:
            spec.nameservers = self.nameservers
            spec.nameservers_comment = f"{self.nameservers_where}: dns_nameservers"
        address = probe_address(spec.address_rules(), space, admissible)

        groups: dict[tuple, list[int]] = defaultdict(list)
        for i, _ in enumerate(space.clients):
            key = tuple(answers[(i, region.key, cell)].allowed for region in space.regions for cell in space.cells)
            groups[key].append(i)
        members = list(groups.values())
        scopes: list[tuple[str | None, list[int]]] = []
        names: set[str] = set()
        for group in members:
            name = None if len(members) == 1 else self._role_name(space, group, names)
            scopes.append((name, group))
        made = [self._scope(space, answers, gates, spec, name, group, address) for name, group in scopes]
        built = [scope for scope, _ in made]
        self.twins = {i: twins for (_, group), (_, twins) in zip(scopes, made, strict=True) for i in group}
        if len(built) > 1:
            # The client class with the most addresses (usually "everyone else") becomes the global section,
            # so its client list need not be written out. Its deny rules then apply to every role too: only
            # a class whose deny rules change no role's decisions qualifies. Failing that, every class is a
            # role and the global section refuses.
            sizes = [sum(space.clients[i].addresses.size for i in group) for _, group in scopes]
            for chosen in sorted(range(len(built)), key=lambda i: -sizes[i]):
                if all(self._unaffected(space, gates, spec, other, built[chosen].deny, scopes[i][1][0], address)
                       for i, other in enumerate(built) if i != chosen):
                    built[chosen].name, built[chosen].clients = None, []
                    scopes[chosen] = (None, scopes[chosen][1])
                    break
            else:
                built.append(ScopeSpec(None, DENY, "every client address is in one of the roles below"))
        spec.scopes = built
        return spec, scopes

    @staticmethod
    def _unaffected(space: Space, gates: Gates, spec: PolicySpec, scope: ScopeSpec, extra: list,
                    client_index: int, address: str) -> bool:
        """Would these extra deny rules (another scope's) leave this scope's decisions as they are?

        Every region whose host one of them names is decided before and after, copies of a template
        included: the scope built its copies like their template, but the extra rules were built for
        another scope, where the copy and the template may differ (a deny rule for the copy's name and
        none for the template's). A region no extra rule names cannot change (deny rules are looked up
        by host), so it is not decided again."""
        if not extra or not gates.cells:
            return True
        client = str(space.clients[client_index].representative)
        named = HostTable.build([rule.host_rule(DENY) for rule in extra])
        before = spec.scope_policy(scope)
        after = spec.scope_policy(ScopeSpec(scope.name, scope.default, allow=scope.allow, deny=scope.deny + extra))
        sample = min(gates.cells)
        for region in space.regions:
            request = egress_probe(region, sample, client, address).request
            if request is None or not named.candidates(request.target.host):
                continue  # a host form refused outright, or a host no extra rule names
            for cell in gates.cells:
                probe = egress_probe(region, cell, client, address)
                if admits(before, probe) != admits(after, probe):
                    return False
        return True

    def _scope(self, space: Space, answers: dict[tuple[int, str, Cell], Outcome], gates: Gates, spec: PolicySpec,
               name: str | None, group: list[int], address: str) -> tuple[ScopeSpec, dict[str, str]]:
        first = group[0]
        client = space.clients[first]
        want = {region.key: frozenset(cell for cell in gates.cells if answers[(first, region.key, cell)].allowed)
                for region in space.regions}

        def build(default: str, allow, deny) -> Policy:
            return spec.scope_policy(ScopeSpec(name, default, allow=allow, deny=deny))

        def probe(region: Region, cell: Cell):
            return egress_probe(region, cell, str(client.representative), address)

        def comment(region: Region, cells: Iterable[Cell], action: str) -> str:
            rules = []
            for cell in sorted(cells):
                outcome = answers[(first, region.key, cell)]
                text = _decided(outcome, self.program)
                if text not in rules:
                    rules.append(text)
            verb = "squid allows" if action == ALLOW else "squid refuses"
            shown = "; ".join(rules[:3]) + (f"; and {len(rules) - 3} more" if len(rules) > 3 else "")
            return f"{region.describe()}: {verb}: {shown}"

        result = synthesise(space.regions, want, gates, space.methods, build, probe, comment)
        rest = [answers[(first, "rest", cell)] for cell in gates.cells]
        if result.default == ALLOW:
            default_comment = "hosts no ACL names: squid allows them: " + _decided(rest[0], self.program)
        elif any(outcome.allowed for outcome in rest):
            default_comment = ("hosts no ACL names: squid allows some requests to them and refuses others; "
                               "egresswall's default cannot depend on port, method or scheme, so it refuses them")
        else:
            refusal = next((o for o in rest if not o.allowed), None)
            default_comment = "hosts no ACL names: squid refuses them" + (
                f": {_decided(refusal, self.program)}" if refusal else "")
        for dropped in result.dropped:
            self.notes.append(Note(None, f"{dropped.pattern}: squid allows some requests to it, but the deny rules "
                                         "egresswall needs for it (or for an enclosing domain) refuse them too, "
                                         "because egresswall checks deny rules first; allow rule left out",
                                   DENY_OVERLAP, NOTE))
        addresses = netaddr.IPSet()
        for i in group:
            addresses |= space.clients[i].addresses
        clients = [] if name is None else addrsets.cidrs(addresses, bare_hosts=False)
        who = ", ".join(space.clients[i].name() for i in group)
        return ScopeSpec(name, result.default, default_comment, clients,
                         f"clients: {who} (squid src ACLs)" if name else "", result.allow, result.deny), result.twins

    def _role_name(self, space: Space, group: list[int], taken: set[str]) -> str:
        raw = "_".join(sorted(space.clients[i].name() for i in group))
        base = re.sub(r"[^A-Za-z0-9_.-]", "-", raw)[:60] or "clients"
        name, n = base, 2
        while name in taken:
            name, n = f"{base}-{n}", n + 1
        taken.add(name)
        return name

    # ---- comments --------------------------------------------------------------------------------

    def _header(self) -> list[str]:
        return [
            f"egresswall policy imported from {printable(self.source)} by `egresswall squid import`.",
            "",
            "squid's access lists were evaluated for every kind of request they tell apart (client, host,",
            "port, method); this policy admits what squid certainly allows, or less. Each entry says which",
            "squid line it comes from; warnings below and in comments say where egresswall refuses more.",
            "",
            "Where squid and egresswall mean different things (squid-compat/README.md has the list):",
            "- dst: squid matches when ANY address of a name is listed; egresswall checks EVERY address, and",
            "  connects only to an address it checked.",
            "- dstdomain and dstdom_regex on an IP-literal URL: squid also tries the address's reverse (PTR)",
            "  name; egresswall never looks one up (whoever owns an address chooses its PTR name).",
            "- egresswall refuses every non-global address (private, loopback, link-local, CGNAT, metadata...)",
            "  unless addresses.allow re-admits it, whatever squid allowed.",
            "- egresswall refuses names that do not resolve, and hosts in forms it does not accept.",
        ]

    def _ports_comment(self, gates: Gates) -> str:
        return ("the ports squid allows CONNECT to, and plain-HTTP requests to, for some client and host;\n"
                "absolute-form https:// requests are judged by the CONNECT ports, as for a tunnel")

    def _deny_entries(self, effective: netaddr.IPSet, denied: netaddr.IPSet,
                      why: list[tuple[netaddr.IPSet, AccessRule, str]]) -> list[tuple[str, str]]:
        entries = []
        for cidr in addrsets.cidrs(effective):
            network = netaddr.IPSet([cidr])
            whole = [f"{rule.where} {rule.text}: {text}" for ranges, rule, text in why if network.issubset(ranges)]
            parts = [f"{rule.where} {rule.text}" for ranges, rule, _ in why if ranges & network]
            entries.append((cidr, whole[0] if whole else "from " + "; ".join(dict.fromkeys(parts))))
        implicit = denied - effective
        if implicit and entries:
            entries[0] = (entries[0][0], "(squid also refuses ranges egresswall refuses without a rule: "
                          + _short_list(addrsets.cidrs(implicit)) + ")\n" + entries[0][1])
        elif implicit:
            self.notes.append(Note(None, "squid's address refusals ("
                                         + _short_list(addrsets.cidrs(implicit))
                                         + ") are all non-global ranges egresswall refuses without a rule",
                                   "addresses", NOTE))
        return entries

    # ---- checking --------------------------------------------------------------------------------

    def _verify(self, policy: Policy, space: Space, answers: dict[tuple[int, str, Cell], Outcome],
                scopes: list[tuple[str | None, list[int]]], admissible: netaddr.IPSet) -> list[Loss]:
        """Every request class, decided by the loaded policy: admitting more than squid is a bug;
        admitting less is a loss, reported."""
        address = probe_address(policy.addresses, space, admissible)
        losses: list[Loss] = []
        undecided: dict[AccessRule, int] = defaultdict(int)
        regions = {region.key: region for region in space.regions}
        in_role = {i for name, group in scopes if name is not None for i in group}
        for i, client in enumerate(space.clients):
            twins = self.twins.get(i, {})
            checked: dict[str, int] = defaultdict(int)  # copies of a template checked with decide themselves
            seen: dict[tuple[str, Cell], tuple[bool, Loss | None]] = {}
            for region in space.regions:
                template = twins.get(region.key)
                # A role's copies are built like their template from the role's own rules; the global deny
                # rules apply to the role too, and were built for other clients: a copy one of them names is
                # decided in full, whatever the count.
                shortcut = template is not None and checked[template] >= COPIES_CHECKED and not (
                    i in in_role and _named_by(policy.deny, region, space, str(client.representative), address))
                for cell in space.cells:
                    outcome = answers[(i, region.key, cell)]
                    if shortcut:
                        # A copy of a template squid and the construction treat alike: its answer is the
                        # template's (a few copies of each are decided in full, below, to keep that honest).
                        admitted, loss = seen[(template, cell)]
                        self._count(client.name(), outcome, admitted)
                        if loss is not None:
                            old, new = regions[template].anchor or "", region.anchor or ""
                            losses.append(replace(loss, region=region, reason=loss.reason.replace(old, new)))
                        continue
                    probe = egress_probe(region, cell, str(client.representative), address)
                    admitted = admits(policy, probe)
                    if template is not None and (template, cell) in seen and seen[(template, cell)][0] != admitted:
                        raise RuntimeError(f"internal error: {region.describe()} is decided unlike "
                                           f"{regions[template].describe()}, which it was built like")
                    if admitted and not outcome.allowed:
                        raise RuntimeError(f"internal error: the imported policy admits {cell} to "
                                           f"{region.describe()} from {client.name()}, which squid refuses")
                    loss = None
                    self._count(client.name(), outcome, admitted)
                    if outcome.allowed and not admitted:
                        loss = classify(policy, probe, outcome, client.name(), region, cell)
                        losses.append(loss)
                    elif not outcome.allowed and ALLOW in outcome.actions:
                        for rule in outcome.undecided:
                            undecided[rule] += 1
                    seen[(region.key, cell)] = (admitted, loss)
                if template is not None:
                    checked[template] += 1
        for rule, count in undecided.items():
            self.notes.append(Note(rule.where, f"{rule.text}: squid's answer depends on ACLs egresswall cannot "
                                               f"decide; {count} request class(es) squid may allow are refused",
                                   "undecided"))
        self.notes += report(losses, space)
        return losses

    def _with_warnings(self, yaml_text: str) -> str:
        """The checked YAML with the warnings repeated in a comment block at the top."""
        warnings = [note for note in self.notes if note.level == WARNING]
        if not warnings:
            return yaml_text
        lines = yaml_text.splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith("version:"))
        block = ["#", *comment_lines("Warnings (also printed on stderr):")]
        block += [line for note in warnings for line in comment_lines(f"  {note}")]
        return "\n".join(lines[:at] + block + lines[at:]) + "\n"


def same_document(written: str, checked: str, source: str) -> None:
    """The text written must be the policy that was checked: comments added after the check (the warnings,
    which quote file names and squid.conf text) must not have changed a single value."""
    try:
        parse_policy(written, source)
        same = yaml.safe_load(written) == yaml.safe_load(checked)
    except (PolicyError, yaml.YAMLError) as err:
        raise RuntimeError(f"internal error: the imported policy no longer loads once commented: {err}") from None
    if not same:
        raise RuntimeError("internal error: the comments added to the imported policy changed what it says")


def probe_address(rules: AddressRules, space: Space, admissible: netaddr.IPSet) -> str:
    """An address egresswall admits, standing for 'what the name resolves to'."""
    anchors = {region.anchor for region in space.regions if region.host.ip is not None}
    for network in sorted(admissible.iter_cidrs(), key=lambda n: (n.version, -n.size)):
        for candidate in (network[1] if network.size > 2 else network[0], network[0], network[-1]):
            text = str(candidate)
            if text not in anchors and rules.check(text).allowed:
                return text
    return "192.0.2.1"  # nothing is admitted: any address is refused


def _named_by(table: HostTable, region: Region, space: Space, client: str, address: str) -> bool:
    """Does a rule of this table name the region's host (its representative)?"""
    request = egress_probe(region, space.cells[0], client, address).request
    return request is not None and bool(table.candidates(request.target.host))


def _decided(outcome: Outcome | None, program: Program) -> str:
    if outcome is None:
        return ""
    if outcome.decided_by is not None:
        return f"{outcome.decided_by.where} {outcome.decided_by.text}"
    return program.lists["http_access"].describe_default()


def _short_list(items: list[str], limit: int = 6) -> str:
    return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")
