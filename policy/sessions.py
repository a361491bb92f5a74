"""Session grants: what one client session may reach, inside what the policy allows. Pure: no I/O, no clock.

A session is created by a platform for one conversation turn (the admin API, ``proxy/sessions/api.py``)
and presented by a client as ``Proxy-Authorization: Basic id:secret`` (``policy/credentials.py``). It
only narrows: a request must pass the policy (role, host rules, address rules, unchanged) *and* the
session. This module holds the session's model, the parser of its grants (the same host pattern rules
and error words as the policy file), and the checks:

* ``check_grant``: is the target granted, and is the session still in force (no counters needed);
* ``judge_budgets``: given the usage counters the store read, may one more request go (the store
  applies the answer atomically: ``proxy/sessions/store.py``);
* ``bytes_over_budget``: has an open passed-through tunnel, whose bytes are no requests, carried the
  session past a byte budget (the gate closes it then).

A URL grant admits its exact URL where the request is visible (plain HTTP, requests inside an
intercepted or plain-HTTP tunnel) and only its host and port for a passed-through TLS tunnel, where
egresswall sees no path — an https URL's only: TLS passed through reaches every https path there, which
an http URL never granted.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from .decision import Verdict
from .hosts import HostFormError, Target, parse_url
from .model import Policy, Role, canonical_path
from .patterns import HostPattern
from .schema import definition_problems
from .yamldoc import KeyPath, dotted

STAGE = "session"
NOT_GRANTED, EXPIRED, ENDED = "session:not-granted", "session:expired", "session:ended"
BUDGET_REQUESTS, BUDGET_HOSTS = "session:budget-requests", "session:budget-hosts"
BUDGET_REQUEST_BYTES, BUDGET_RESPONSE_BYTES = "session:budget-request-bytes", "session:budget-response-bytes"
REQUIRED, CREDENTIALS = "session:required", "session:credentials"  # answered 407
STORE_UNAVAILABLE = "session:store-unavailable"  # answered 503
DEFAULT_TTL = 900.0
SESSION_ID = re.compile(r"\A[A-Za-z0-9_-]{1,64}\Z")  # \Z: "$" would let a trailing newline in
_URL_SCHEMES = frozenset({"http", "https"})
_ASCII_PRINTABLE = "".join(map(chr, range(0x21, 0x7F)))  # kept as given (escapes too) when a path is encoded
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")  # RFC 3986 3.1
_NOT_HTTP = ("got {text!r}; a URL grant is an http or https URL (a WebSocket handshake is a request to its "
             "http(s) URL)")
_PLAIN = {"ws": "http", "wss": "https"}  # a WebSocket handshake is a request to the http(s) URL it upgrades


@dataclass(frozen=True)
class UrlGrant:
    """One granted URL: scheme, host and port as the policy normalises them; path and query exact."""

    text: str
    scheme: str
    host: str
    port: int
    path: str  # canonical path with the query, e.g. "/a/b?x=1"

    def admits_tunnel(self, target: Target, tls: bool = False) -> bool:
        """``tls``: the tunnel carries (or may carry) TLS passed through unread, which reaches any https path
        there: only an https URL's host and port admit it. An http URL's host and port admit a tunnel
        whose requests are seen (HTTP inside), each then held to the exact URL."""
        return target.host == self.host and target.port == self.port and (self.scheme == "https" or not tls)

    def admits_request(self, target: Target) -> bool:
        if _PLAIN.get(target.scheme, target.scheme) != self.scheme or not self.admits_tunnel(target):
            return False
        return canonical_request_path(target.path) == self.path


@dataclass(frozen=True)
class Grants:
    hosts: tuple[HostPattern, ...] = ()
    urls: tuple[UrlGrant, ...] = ()

    def admit(self, target: Target, visible: bool, tls: bool = False) -> bool:
        """``visible``: the request's scheme and path are seen (not a tunnel); ``tls``: a tunnel that carries
        (or may carry) TLS passed through unread (``UrlGrant.admits_tunnel``)."""
        if any(pattern.matches(target.host) for pattern in self.hosts):
            return True
        if visible:
            return any(url.admits_request(target) for url in self.urls)
        return any(url.admits_tunnel(target, tls) for url in self.urls)

    def as_json(self) -> dict[str, list[str]]:
        return {"hosts": [p.text for p in self.hosts], "urls": [u.text for u in self.urls]}


@dataclass(frozen=True)
class Budgets:
    """None: no bound. Bytes are counted when a response or tunnel ends (an open passed-through tunnel's
    every second too), and checked before each request and, for open tunnels and WebSockets, chunk by chunk
    before each is relayed (proxy/byte_allowance.py)."""

    requests: int | None = None
    hosts: int | None = None
    request_bytes: int | None = None
    response_bytes: int | None = None

    def as_json(self) -> dict[str, int]:
        return {k: v for k, v in (("requests", self.requests), ("hosts", self.hosts),
                                  ("request_bytes", self.request_bytes), ("response_bytes", self.response_bytes))
                if v is not None}


@dataclass(frozen=True)
class Usage:
    requests: int = 0
    hosts: int = 0
    request_bytes: int = 0
    response_bytes: int = 0

    def as_json(self) -> dict[str, int]:
        return {"requests": self.requests, "hosts": self.hosts, "request_bytes": self.request_bytes,
                "response_bytes": self.response_bytes}


@dataclass(frozen=True)
class SessionSpec:
    """What a platform asked for (``POST /v1/sessions``), validated."""

    grants: Grants
    budgets: Budgets
    ttl: float

    def as_json(self) -> dict[str, Any]:
        """The normalised request (stores keep this and parse it again on load)."""
        return {"grants": self.grants.as_json(), "budgets": self.budgets.as_json(), "ttl": self.ttl}


@dataclass(frozen=True)
class Session:
    id: str
    secret_digest: str  # SHA-256 of the secret, hex: the secret itself is never kept
    created: float  # seconds since the epoch (a shared store's processes share a wall clock, not a monotonic one)
    expires: float
    spec: SessionSpec

    @property
    def grants(self) -> Grants:
        return self.spec.grants

    @property
    def budgets(self) -> Budgets:
        return self.spec.budgets

    def secret_matches(self, secret: str) -> bool:
        """Constant-time: the digests are compared, never the texts."""
        return hmac.compare_digest(secret_digest(secret), self.secret_digest)


class SessionSpecError(ValueError):
    """A session request that cannot be used: every problem, each with its field ("grants.urls[1]")."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        super().__init__("; ".join(f"{field}: {message}" if field else message for field, message in problems))
        self.problems = problems


def secret_digest(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def canonical_request_path(path: str) -> str | None:
    """Path (canonical, as policy path rules read it) and query (exact); None for a path servers may read
    differently (dot segments, encoded slashes, empty segments): such a request matches no URL grant."""
    base, sep, query = (path or "/").partition("?")
    canonical = canonical_path(base or "/")
    return None if canonical is None else canonical + sep + query


def parse_url_grant(text: str) -> UrlGrant:
    """An absolute http(s) URL, parsed as strictly as a request target; ValueError with the reason."""
    scheme, sep, _ = text.partition("://")
    # Checked before the URL is parsed, whose own error lists ws and wss too, which a grant refuses (only for a
    # well-formed scheme: " http" or "ht\ntp" get the parser's own words).
    if sep and _SCHEME.fullmatch(scheme) and scheme.lower() not in _URL_SCHEMES:
        raise ValueError(_NOT_HTTP.format(text=text))
    try:
        target = parse_url(text)
    except HostFormError as err:
        raise ValueError(f"got {text!r}; {err.reason}") from None
    if target.scheme not in _URL_SCHEMES:
        raise ValueError(_NOT_HTTP.format(text=text))
    path = canonical_request_path(_as_sent(text, target.path))
    if path is None:
        raise ValueError(f"got {text!r}; the path has dot segments, encoded separators or empty segments, which "
                         "servers read differently: give the path the server serves")
    return UrlGrant(text, target.scheme, target.host, target.port, path)


def _as_sent(text: str, path: str) -> str:
    """The path and query as a request carries them: ASCII. A request target is ASCII on the wire (both
    transports refuse any other byte), and a browser sends a link's other characters percent-encoded as
    UTF-8 (``/wiki/Café`` as ``/wiki/Caf%C3%A9``): a grant of the raw text would match no request at all."""
    if path.isascii():
        return path
    try:
        return quote(path, safe=_ASCII_PRINTABLE)  # escapes already there, and every ASCII character, kept
    except UnicodeEncodeError:  # a lone surrogate (JSON's "\ud800"): no character, no UTF-8
        raise ValueError(f"got {text!r}; the path or query is not valid Unicode (a lone surrogate)") from None


def parse_session_spec(data: Any) -> SessionSpec:
    """A session request (parsed JSON) → SessionSpec, or SessionSpecError listing every problem."""
    problems = [(dotted(path), message) for path, message in definition_problems(data, "sessionRequest")]
    if problems:
        raise SessionSpecError(problems)
    grants = data["grants"]
    hosts = _parsed(grants.get("hosts", []), ("grants", "hosts"), HostPattern.parse, problems)
    urls = _parsed(grants.get("urls", []), ("grants", "urls"), parse_url_grant, problems)
    if not problems and not hosts and not urls:
        problems.append(("grants", "the session grants nothing; give 'hosts' or 'urls'"))
    if problems:
        raise SessionSpecError(problems)
    raw = data.get("budgets", {})  # whole numbers: the schema's integer is an int, never 1.0 or 1e3
    budgets = Budgets(raw.get("requests"), raw.get("hosts"), raw.get("request_bytes"), raw.get("response_bytes"))
    return SessionSpec(Grants(tuple(hosts), tuple(urls)), budgets, float(data.get("ttl", DEFAULT_TTL)))


def parse_extension(data: Any) -> float:
    """The body of an extend request → its ttl (seconds from now)."""
    problems = [(dotted(path), message) for path, message in definition_problems(data, "sessionExtend")]
    if problems:
        raise SessionSpecError(problems)
    return float(data["ttl"])


def _parsed(values: Iterable[str], at: KeyPath, parse, problems: list[tuple[str, str]]) -> list:
    out = []
    for i, text in enumerate(values):
        try:
            out.append(parse(text))
        except ValueError as err:
            problems.append((dotted((*at, i)), str(err)))
    return out


# ---- the checks -----------------------------------------------------------------------------------

def required_refusal(policy: Policy, role: Role | None) -> Verdict | None:
    """The refusal (407) of a request that presents no session where the policy (or the client's role) requires
    one; None where none is required. The proxy answers it before the policy decides; ``check`` says it too."""
    if not policy.session_required(role):
        return None
    whose = f"role {role.name}" if role is not None and role.session else "the policy"
    return refused(REQUIRED, f"{whose} requires a session (session: required): send Proxy-Authorization: Basic "
                             "with the session's id and secret", None, role.name if role else None)


def refused(rule: str, reason: str, session: Session | None, role: str | None = None) -> Verdict:
    return Verdict(False, STAGE, rule, reason, role=role, session=session.id if session else None)


def check_grant(session: Session, target: Target, visible: bool, now: float, role: str | None = None,
                tls: bool = False) -> Verdict | None:
    """A refusal when the session is no longer in force or does not grant the target; None: granted.
    ``tls``: a tunnel that carries (or may carry) TLS passed through (``Grants.admit``)."""
    if now >= session.expires:
        return refused(EXPIRED, f"session {session.id} expired {now - session.expires:.0f}s ago", session, role)
    return grant_refusal(session, target, visible, tls, role)


def grant_refusal(session: Session, target: Target, visible: bool, tls: bool, role: str | None = None
                  ) -> Verdict | None:
    """The ``session:not-granted`` refusal when the session does not grant the target (expiry aside); None:
    granted."""
    if session.grants.admit(target, visible, tls):
        return None
    # Without the query: it is what an exfiltrating request carries, and the audit log keeps none by default.
    where = (target.url().split("?", 1)[0] if visible
             else f"{target.authority} (a TLS tunnel passed through: only its host and port are seen, and only an "
                  "https URL grants them)" if tls and session.grants.admit(target, False)
             else f"{target.authority} (a tunnel: only its host and port are seen)")
    return refused(NOT_GRANTED, f"session {session.id} does not grant {where}; it grants "
                                f"{_grants_text(session.grants)}", session, role)


def judge_budgets(session: Session, usage: Usage, host_seen: bool, content_length: int | None = None,
                  role: str | None = None) -> Verdict | None:
    """Whether one more request to a host (``host_seen``: reached before under this session) fits the
    budgets, given the usage so far; None: it does, and the store counts it."""
    budgets = session.budgets
    if budgets.requests is not None and usage.requests >= budgets.requests:
        return refused(BUDGET_REQUESTS, f"session {session.id} has used its budget of {budgets.requests} requests",
                       session, role)
    if budgets.request_bytes is not None:
        coming = content_length or 0
        if usage.request_bytes >= budgets.request_bytes or usage.request_bytes + coming > budgets.request_bytes:
            return refused(BUDGET_REQUEST_BYTES, f"session {session.id} has sent {usage.request_bytes} bytes"
                           + (f" and this request would add {coming}" if coming else "")
                           + f"; its budget is {budgets.request_bytes} bytes", session, role)
    if budgets.response_bytes is not None and usage.response_bytes >= budgets.response_bytes:
        return refused(BUDGET_RESPONSE_BYTES, f"session {session.id} has received {usage.response_bytes} bytes; its "
                                              f"budget is {budgets.response_bytes} bytes", session, role)
    if budgets.hosts is not None and not host_seen and usage.hosts >= budgets.hosts:
        return refused(BUDGET_HOSTS, f"session {session.id} has reached its budget of {budgets.hosts} distinct "
                                     "hosts; this would be another", session, role)
    return None


def bytes_over_budget(session: Session, usage: Usage, role: str | None = None) -> Verdict | None:
    """Whether the bytes counted so far are past a byte budget (strictly: a session at its budget has used
    it, and its next request is refused by ``judge_budgets``). Asked of a session whose passed-through
    tunnel is open: its bytes are no requests, so nothing else would stop it crossing the budget without
    end. None: within both budgets."""
    budgets = session.budgets
    if budgets.request_bytes is not None and usage.request_bytes > budgets.request_bytes:
        return refused(BUDGET_REQUEST_BYTES, f"session {session.id} has sent {usage.request_bytes} bytes; its "
                                             f"budget is {budgets.request_bytes} bytes", session, role)
    if budgets.response_bytes is not None and usage.response_bytes > budgets.response_bytes:
        return refused(BUDGET_RESPONSE_BYTES, f"session {session.id} has received {usage.response_bytes} bytes; "
                                              f"its budget is {budgets.response_bytes} bytes", session, role)
    return None


def has_any_budget(session: Session) -> bool:
    budgets = session.budgets
    return any(limit is not None for limit in (budgets.requests, budgets.hosts, budgets.request_bytes,
                                               budgets.response_bytes))


def has_byte_budget(session: Session) -> bool:
    return session.budgets.request_bytes is not None or session.budgets.response_bytes is not None


def bytes_would_cross(session: Session, sending: bool, reached: int) -> Verdict:
    """The refusal when the next chunk of an open tunnel or WebSocket would carry the session's bytes to
    ``reached``, past its budget that way (``sending``: from the client): the chunk is not relayed."""
    if sending:
        return refused(BUDGET_REQUEST_BYTES, f"session {session.id} would have sent {reached} bytes; its budget is "
                                             f"{session.budgets.request_bytes} bytes", session)
    return refused(BUDGET_RESPONSE_BYTES, f"session {session.id} would have received {reached} bytes; its budget is "
                                          f"{session.budgets.response_bytes} bytes", session)


def _grants_text(grants: Grants, limit: int = 5) -> str:
    """The grants a refusal names: a URL grant without its query (``?[query]`` in its place), as the refused
    URL is written: a granted link's query is what its user pasted (a share token, a search), and the reason is
    written to the audit log and sent back on every refused request of the session (review round 22)."""
    named = [p.text for p in grants.hosts] + [_without_query(u.text) for u in grants.urls]
    more = len(named) - limit
    return ", ".join(named[:limit]) + (f" and {more} more" if more > 0 else "")


def _without_query(url: str) -> str:
    path, query = url.split("?", 1) if "?" in url else (url, None)
    return path if query is None else f"{path}?[query]"
