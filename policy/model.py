"""The policy as the decision function sees it: immutable, indexed once at load time."""

from __future__ import annotations

import fnmatch
import operator
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from itertools import repeat
from typing import NamedTuple

import netaddr

from . import rule_ids
from .addresses import AddressRules
from .patterns import HostIndex, HostPattern

ENFORCE, REPORT = "enforce", "report"
ALLOW, DENY = "allow", "deny"
REQUIRED, OPTIONAL = "required", "optional"  # whether a client must present a session


class Origin(NamedTuple):
    """Where a rule was written: a file position, or the command-line flag that added it.

    A named tuple, as ``HostPattern`` is: one per rule of a million-entry list, built in a fifth of the time of
    a frozen dataclass, and as immutable.
    """

    source: str
    line: int = 0  # 1-based; 0 when there is no line (command line, built-in)
    column: int = 0
    path: str = ""  # key path, e.g. "hosts.allow[3]"

    def __str__(self) -> str:
        return f"{self.source}:{self.line}" if self.line else self.source


class HostRule(NamedTuple):
    """One host rule: a pattern, its action and its conditions.

    A named tuple, as ``HostPattern`` and ``Origin`` are: a big allowlist is a million of these, and a frozen
    dataclass sets each field through ``object.__setattr__`` (a slow call, thirteen times a rule), where a named
    tuple is one allocation, and can be built in bulk by C-level maps (``HostRule.plain_rules``). As immutable
    (setting a field raises AttributeError); compared and hashed by its fields; ``rule._replace(id=...)`` for a
    changed copy.
    """

    action: str  # ALLOW or DENY
    pattern: HostPattern
    origin: Origin
    # Stable across edits above it (policy/rule_ids.py): the YAML `id:`, or a derived id that the action and the
    # pattern alone do not give (a role's list, a repeat's #n); "" when they do: rule_id derives it.
    id: str = ""
    ports: frozenset[int] | None = None
    schemes: frozenset[str] | None = None
    methods: frozenset[str] | None = None
    paths: tuple[str, ...] | None = None
    websocket: bool = True
    intercept: bool = False
    expires: datetime | None = None
    owner: str | None = None
    reason: str | None = None

    @classmethod
    def plain(cls, action: str, pattern: HostPattern, origin: Origin, id: str) -> HostRule:
        """A rule with no condition (a bare pattern in a list): ``HostRule(action, pattern, origin, id)``."""
        return _tuple_new(cls, (action, pattern, origin, id, *_NO_CONDITIONS))

    @classmethod
    def plain_rules(cls, action: str, patterns: Iterable[HostPattern], origins: Iterable[Origin],
                    ids: Iterable[str]) -> list[HostRule]:
        """``plain`` for each (pattern, origin, id), in order, built by C-level maps: no Python step per rule."""
        return list(map(partial(_tuple_new, cls), zip(repeat(action), patterns, origins, ids,
                                                      *map(repeat, _NO_CONDITIONS))))

    @property
    def where(self) -> str:
        """Where the rule was written, for a human: ``policy.yaml:12`` or the flag that added it (``str(origin)``,
        written out: every verdict a rule makes asks for it)."""
        origin = self.origin
        return f"{origin.source}:{origin.line}" if origin.line else origin.source

    @property
    def rule_id(self) -> str:
        """The stable id (metrics, records): ``id``, or when that is "" (a first entry of ``hosts.allow`` or
        ``hosts.deny``, a rule built by hand) the id its list and pattern derive (never ``where``: a file
        position moves, and labels metrics)."""
        if self.id:
            return self.id
        prefix = _IMPLIED_ID_PREFIX.get(self.action)
        if prefix is None:
            return rule_ids.derived(rule_ids.host_list(self.action), self.pattern.text)
        return prefix + self.pattern.text  # rule_ids.derived's text, without two calls on a verdict's path

    @property
    def needs_visible_request(self) -> bool:
        """Method and path conditions can be checked only where the proxy sees the request."""
        return self.methods is not None or self.paths is not None

    def expired(self, at: datetime) -> bool:
        return self.expires is not None and at >= self.expires

    def path_matches(self, path: str) -> bool:
        if self.paths is None:
            return True
        canonical = canonical_path(path.split("?", 1)[0] or "/")
        if canonical is None:
            # '/docs/../admin' starts with '/docs/' but the server serves /admin: a path the server may
            # read as another path is never admitted by an allow rule, and is refused by a deny rule.
            return self.action == DENY
        # Tomcat, Jetty and Spring drop a segment's ';' parameters ('/admin;x/secret' is /admin/secret
        # there), other servers keep them: a deny rule matches either reading, an allow rule both.
        readings = (canonical, without_parameters(canonical))
        if self.action == DENY:
            # IIS, and any server on a case-insensitive file system, serves '/ADMIN' as '/admin': a deny rule
            # matches that reading too (an allow rule needs no third reading: a path it matches exactly is the
            # same resource to such a server).
            return any(path_pattern_matches(p, reading) for p in self.paths for reading in readings) or any(
                path_pattern_matches(p.lower(), reading.lower()) for p in self.paths for reading in readings)
        return all(any(path_pattern_matches(p, reading) for p in self.paths) for reading in readings)

    def describe(self) -> str:
        return f"{self.action} {self.pattern.text} ({self.origin})"


_tuple_new = tuple.__new__  # the named tuple without its Python __new__ (which takes each field as an argument)
_NO_CONDITIONS = tuple(HostRule._field_defaults[name] for name in HostRule._fields[4:])
_IMPLIED_ID_PREFIX = {action: rule_ids.derived(rule_ids.host_list(action), "") for action in (ALLOW, DENY)}
_pattern_of = operator.itemgetter(1)  # HostRule.pattern, a million times: no attribute lookups

_ESCAPE = re.compile(r"%([0-9A-Fa-f]{2})")
_ENCODED_SEPARATOR = re.compile(r"%(?:2f|5c)", re.IGNORECASE)


def canonical_path(path: str) -> str | None:
    """The path as a server reads it, or None when servers may read it differently (dot segments,
    also percent-encoded or with ';' parameters, encoded slashes, backslashes, empty segments): such
    paths are not matched against path rules. Escapes of unreserved characters are decoded (RFC 3986,
    6.2.2.2). An empty segment ('//admin/', '/a//b') is one: nginx merges slashes by default, Python's
    http.server strips leading ones, and both then serve /admin/ for a path no '/admin/' rule names (a
    trailing slash is no empty segment: '/docs/' is one segment, 'docs', and the end)."""

    def unescape(match: re.Match[str]) -> str:
        char = chr(int(match.group(1), 16))
        return char if char.isascii() and (char.isalnum() or char in "-._~") else match.group(0)

    path = _ESCAPE.sub(unescape, path)
    if "\\" in path or _ENCODED_SEPARATOR.search(path):
        return None
    segments = [segment.split(";", 1)[0] for segment in path.split("/")]
    if any(segment in (".", "..") for segment in segments):
        return None
    if "" in segments[1:-1]:  # '//', or a segment of ';' parameters only (Tomcat drops those: '/;x/admin/')
        return None
    return path


def without_parameters(path: str) -> str:
    """The path with every segment's ';' parameters removed, as servers that read path parameters serve
    it ('/admin;jsessionid=1/x' -> '/admin/x', '/a/b;v=2' -> '/a/b')."""
    if ";" not in path:
        return path
    return "/".join(segment.split(";", 1)[0] for segment in path.split("/"))


def path_pattern_matches(pattern: str, path: str) -> bool:
    """A pattern without '*' is a prefix ('/docs/'); with '*' it is a glob over the whole path."""
    if "*" in pattern:
        return fnmatch.fnmatchcase(path, pattern)
    return path.startswith(pattern)


@dataclass
class HostTable:
    """One list of host rules (allow or deny), in file order, indexed by host suffix."""

    rules: tuple[HostRule, ...] = ()
    index: HostIndex[HostRule] = field(default_factory=HostIndex)

    @classmethod
    def build(cls, rules: list[HostRule], patterns: list[HostPattern] | None = None) -> HostTable:
        """The table of these rules; ``patterns``: their patterns, in order, when the caller has them already."""
        rules_tuple = tuple(rules)
        return cls(rules_tuple, HostIndex.of(list(map(_pattern_of, rules_tuple)) if patterns is None else patterns,
                                             rules_tuple))

    def candidates(self, host: str) -> list[HostRule]:
        return self.index.candidates(host)

    def __len__(self) -> int:
        return len(self.rules)


@dataclass(frozen=True)
class Role:
    name: str
    clients: netaddr.IPSet
    origin: Origin
    default: str | None  # None: the policy's default
    allow: HostTable
    deny: HostTable
    session: str | None = None  # REQUIRED | OPTIONAL; None: the policy's


@dataclass(frozen=True)
class ResolverSettings:
    nameservers: tuple[tuple[str, int], ...] = ()  # () means the nameservers in /etc/resolv.conf
    timeout: float = 2.0
    ttl_floor: int = 0
    ttl_ceiling: int = 300


@dataclass(frozen=True)
class Limits:
    max_connections: int = 2000
    max_connections_per_client: int = 256
    connect_timeout: float = 10.0
    idle_timeout: float = 120.0
    max_request_body: int = 10 * 1024 * 1024
    # Every chunked request body being buffered (read whole before it goes upstream), all clients
    # together: bytes (proxy/body_budget.py; a client may hold a quarter of it, with N workers each
    # worker 1/N of it).
    max_buffered_request_bodies: int = 256 * 1024 * 1024
    tunnel_grace: float = 10.0
    # A request or response head (start line and headers) may be at most this big and must arrive
    # within header_timeout of its first byte: mitmproxy itself bounds neither (proxy/mitm_patches.py).
    max_header_bytes: int = 64 * 1024
    header_timeout: float = 30.0
    # A connection that has sent nothing at all is closed after this long: silent sockets must not
    # hold their client's (or everyone's) connection slots until the idle timeout.
    first_byte_timeout: float = 10.0
    # One WebSocket message, either way: mitmproxy holds a message whole before relaying it, so without a
    # bound one endless fragmented message filled a worker's memory (proxy/mitm_patches.py).
    max_websocket_message: int = 10 * 1024 * 1024


@dataclass(frozen=True)
class HttpSettings:
    """How plain HTTP (and HTTP inside tunnels) is handled beyond host rules."""

    # Methods whose request body goes through although HTTP defines no meaning for it: only DELETE and
    # OPTIONS can be listed (policy/request_bodies.py); GET, HEAD and TRACE bodies are always refused.
    body_allowed_on: frozenset[str] = frozenset()


RESOLUTION_UPSTREAM = "upstream"  # the only accepted value: the upstream resolves names, pinning cannot hold


@dataclass(frozen=True)
class Upstream:
    """Where every allowed request and tunnel goes, instead of to the address egresswall checked."""

    host: str  # an IP address (canonical, no brackets) or a lower-case name
    port: int
    resolution: str = RESOLUTION_UPSTREAM
    credentials_file: str | None = None  # an absolute path; read once at start (proxy/upstream.py)
    origin: Origin = field(default=Origin("<built>"), compare=False)

    @property
    def authority(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.authority}"


@dataclass(frozen=True)
class Policy:
    source: str
    mode: str
    default: str
    default_origin: Origin
    allow: HostTable
    deny: HostTable
    addresses: AddressRules
    connect_ports: frozenset[int]
    http_ports: frozenset[int]
    roles: tuple[Role, ...] = ()
    resolver: ResolverSettings = ResolverSettings()
    limits: Limits = Limits()
    http: HttpSettings = HttpSettings()
    log_query_strings: bool = False
    session: str = "optional"  # REQUIRED: a client outside a role that says otherwise must present a session
    tls_ech: str | None = None  # "allow" | "refuse"; None: refused on an allowlist (``ech_allowed``)
    address_rules_text: tuple[tuple[str, str, Origin], ...] = ()  # (action, cidr, origin), for lint/export
    # Forward through this proxy (policy/upstream.py): decisions stay egresswall's, the connect is the upstream's.
    upstream: Upstream | None = None
    # Which role a client address has never changes for one policy: remember it (IPSet membership costs
    # tens of microseconds, and one client sends many requests). Bounded; a new policy starts empty.
    _role_cache: dict[int, Role | None] = field(default_factory=dict, compare=False, repr=False)

    def role_for(self, client: netaddr.IPAddress | None) -> Role | None:
        if client is None or not self.roles:
            return None
        key = (client.version << 128) | int(client)
        if key in self._role_cache:
            return self._role_cache[key]
        role = next((role for role in self.roles if client in role.clients), None)
        if len(self._role_cache) >= 65536:
            self._role_cache.clear()
        self._role_cache[key] = role
        return role

    def session_required(self, role: Role | None) -> bool:
        """Whether a client with this role (None: no role) must present a session."""
        need = role.session if role is not None and role.session is not None else self.session
        return need == REQUIRED

    @property
    def requires_sessions(self) -> bool:
        """Some client must present a session: the proxy judges session credentials then."""
        return self.session == REQUIRED or any(role.session == REQUIRED for role in self.roles)

    def all_host_rules(self) -> Iterator[HostRule]:
        yield from self.deny.rules
        yield from self.allow.rules
        for role in self.roles:
            yield from role.deny.rules
            yield from role.allow.rules

    def intercepts(self, host: str) -> bool:
        """True when an allow rule asks to decrypt TLS for this host (path or frame rules)."""
        tables = [self.allow] + [role.allow for role in self.roles]
        return any(rule.intercept for table in tables for rule in table.candidates(host))


def ech_allowed(policy: Policy) -> bool:
    """``tls.ech`` in the policy. Unset, Encrypted Client Hello is let through only where no host rule can
    be dodged with it: ECH hides the real name behind the outer one, and the outer name (a CDN's, say) is all
    egresswall can check. So it is refused on an allowlist, and on the open web too once any deny rule names
    a host or any role denies by default; an open-web policy with no host to refuse lets it through."""
    if policy.tls_ech:
        return policy.tls_ech == "allow"
    if policy.default != "allow" or len(policy.deny):
        return False
    return not any(role.default == "deny" or len(role.deny) for role in policy.roles)
