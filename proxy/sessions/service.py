"""What the gate asks about sessions: who is this (``identify``), may it go (``check``), count it (``charge``).

The pure rules are policy/sessions.py's and policy/credentials.py's; this adapter adds the store (I/O) and
the clock. Sessions are judged when they are *on*: a session store or an admin token file was given, or
the policy requires a session somewhere (``session: required``). Off, a Proxy-Authorization header is
not looked at (it is still stripped before forwarding, as every hop-by-hop header is).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from policy.credentials import CredentialsError, parse_proxy_authorization
from policy.decision import Verdict, role_of
from policy.hosts import Target
from policy.model import Policy
from policy.sessions import (
    CREDENTIALS,
    ENDED,
    EXPIRED,
    STORE_UNAVAILABLE,
    Session,
    SessionSpec,
    Usage,
    bytes_over_budget,
    bytes_would_cross,
    check_grant,
    grant_refusal,
    has_any_budget,
    has_byte_budget,
    judge_budgets,
    refused,
    required_refusal,
    secret_digest,
)

from ..metrics import Metrics
from .store import MemoryStore, SessionStore, StoreUnavailable

log = logging.getLogger("egresswall")


@dataclass(frozen=True)
class Identity:
    """Who a request came as: a session, none, or a refusal (``status`` 407 or 503)."""

    session: Session | None = None
    refusal: Verdict | None = None
    status: int = 0


NO_SESSION = Identity()
_DECOY = secret_digest(secrets.token_urlsafe(32))  # compared against when the id is unknown: the same work


class SessionService:
    def __init__(self, store: SessionStore | None = None, metrics: Metrics | None = None, configured: bool = False,
                 clock: Callable[[], float] = time.time) -> None:
        self.store: SessionStore = store or MemoryStore()
        self.metrics = metrics or Metrics()
        self.configured = configured
        self.clock = clock
        self._tasks: set[asyncio.Task] = set()

    def enabled(self, policy: Policy) -> bool:
        return self.configured or policy.requires_sessions

    # ---- identity -----------------------------------------------------------------------------

    async def verified_id(self, policy: Policy, client: str | None, values: Sequence[str]) -> str | None:
        """The id of the session a request's credentials prove (its secret matches), or None — for the record of a
        request refused for its form before any session check: it names the session it came under, as every line
        of a session's requests does, and an id the secret does not prove never goes into a record. Nothing is
        refused or counted here (review round 22)."""
        if not values or not self.enabled(policy):
            return None
        try:
            credentials = parse_proxy_authorization(values)
            session = await self.store.get(credentials.session_id) if credentials is not None else None
        except (CredentialsError, StoreUnavailable):
            return None
        return session.id if credentials is not None and _proves(session, credentials.secret) else None

    async def identify(self, policy: Policy, client: str | None, values: Sequence[str]) -> Identity:
        if not self.enabled(policy):
            return NO_SESSION
        role = role_of(policy, client)
        role_name = role.name if role else None
        try:
            credentials = parse_proxy_authorization(values)
        except CredentialsError as err:
            return self._refused(Identity(None, refused(CREDENTIALS, err.reason, None, role_name), 407))
        if credentials is None:
            required = required_refusal(policy, role)
            return NO_SESSION if required is None else self._refused(Identity(None, required, 407))
        try:
            session = await self.store.get(credentials.session_id)
        except StoreUnavailable as err:
            return self._refused(Identity(None, refused(STORE_UNAVAILABLE, str(err), None, role_name), 503))
        if not _proves(session, credentials.secret):
            return self._refused(Identity(None, refused(
                CREDENTIALS, f"no session {credentials.session_id} with this secret (unknown, ended, or a wrong "
                             "secret)", None, role_name), 407))
        return Identity(session)

    def required_in_tunnel(self, policy: Policy, client: str | None) -> Verdict | None:
        """For a tunnel opened without a session, at its first message and at each request inside: the refusal
        when the policy in force now requires one of this client (a reload since the CONNECT). A header inside a
        tunnel names no session, so this is answered from the policy alone."""
        if not self.enabled(policy):
            return None
        refusal = required_refusal(policy, role_of(policy, client))
        if refusal is None:
            return None
        return self._counted(replace(refusal, reason=f"{refusal.reason}; this tunnel was opened without one, before "
                                                     "the policy required it: open a new one with the session"))

    async def current(self, session: Session, role: str | None) -> tuple[Session | None, Verdict | None, int]:
        """The session as the store holds it now, for a request inside a tunnel opened under it: an extension
        or a shortened ttl applies there as on a new connection, and an ended session is refused.
        (session, None, 0), or (None, refusal, status)."""
        try:
            now = await self.store.get(session.id)
        except StoreUnavailable as err:
            return None, self.store_down(session, err, role), 503
        if now is None or not hmac.compare_digest(now.secret_digest, session.secret_digest):
            return None, self._counted(refused(ENDED, f"session {session.id} has ended", session, role)), 403
        return now, None, 0

    async def over(self, session: Session) -> tuple[Session, Verdict | None]:
        """What the store holds of ``session`` now (an extension or a shortened ttl since it opened), and the
        refusal that ends a tunnel or WebSocket opened under it: it has ended (deleted, or its secret changed) or
        expired since (None while it holds). StoreUnavailable when the store cannot be asked (the gate's sweep
        decides how long that may last: ``Gate.store_grace``)."""
        now = await self.store.get(session.id)
        if now is None or not hmac.compare_digest(now.secret_digest, session.secret_digest):
            return session, refused(ENDED, f"session {session.id} has ended", session)
        return now, self.expired(now)

    def expired(self, session: Session) -> Verdict | None:
        """The refusal once ``session`` (as last seen) has expired; None before."""
        if session.expires <= self.clock():
            return refused(EXPIRED, f"session {session.id} expired", session)
        return None

    def store_lost(self, session: Session, seconds: float, err: StoreUnavailable) -> Verdict:
        """The refusal that ends what is open under ``session`` once the store has not answered for ``seconds``:
        its bytes can be neither charged nor held to the session's end, and egresswall fails closed."""
        return self._counted(refused(
            STORE_UNAVAILABLE, f"the session store has not answered for {seconds:.0f}s ({err}), so session "
                               f"{session.id} can be neither checked nor charged", session))

    # ---- the checks ---------------------------------------------------------------------------

    def check(self, session: Session, target: Target, visible: bool, role: str | None, tls: bool = False
              ) -> Verdict | None:
        """``tls``: a CONNECT whose tunnel may carry TLS passed through unread (policy/sessions.py)."""
        refusal = check_grant(session, target, visible, self.clock(), role, tls)
        if refusal is not None:
            self.metrics.session_refusal(refusal.rule)
        return refusal

    def check_passthrough(self, session: Session, target: Target, role: str | None) -> Verdict | None:
        """A tunnel admitted at its CONNECT (within its session's time then) whose first message turned out
        to be TLS egresswall passes through: does the session grant that (an http URL's host and port do
        not)? A refusal, counted, or None."""
        refusal = grant_refusal(session, target, False, True, role)
        if refusal is not None:
            self.metrics.session_refusal(refusal.rule)
        return refusal

    async def charge(self, session: Session, target: Target, content_length: int | None,
                     role: str | None) -> tuple[Verdict | None, int]:
        """(refusal, status) for one more request under the session; (None, 0) once it is counted."""
        refusal, status = await self._budgets(self.store.charge, session, target, content_length, role)
        if refusal is None:
            self.metrics.session_request()
        return refusal, status

    async def fits(self, session: Session, target: Target, sent: int | None, role: str | None
                   ) -> tuple[Verdict | None, int]:
        """Before the name is looked up: (refusal, status) when one more request under the session would be
        refused by a budget (``charge``'s judgement, nothing counted), so a session past its budgets makes no
        lookup; (None, 0) when it fits, or when the session has no budget at all (nothing to ask the store)."""
        if not has_any_budget(session):
            return None, 0
        return await self._budgets(self.store.judge, session, target, sent, role)

    def fits_moved(self, session: Session, moved: Usage, sent: int | None, role: str | None) -> Verdict | None:
        """``fits``'s byte budgets judged on ``moved``: the bytes this worker's open tunnels and WebSockets of the
        session have moved as their allowance knows them, which the store learns only at the next sweep. The
        refusal (counted), or None."""
        refusal = judge_budgets(session, moved, True, sent, role)
        return None if refusal is None else self._counted(refusal)

    async def _budgets(self, ask, session: Session, target: Target, sent: int | None, role: str | None
                       ) -> tuple[Verdict | None, int]:
        """The store's ``charge`` or ``judge``, as (refusal, status): 503 when it cannot be asked, 403 when a
        budget refuses (counted in the metrics), (None, 0) when the request fits."""
        try:
            refusal = await ask(session, target.host, sent, role)
        except StoreUnavailable as err:
            return self.store_down(session, err, role), 503
        if refusal is not None:
            self.metrics.session_refusal(refusal.rule)
            return refusal, 403
        return None, 0

    def count_bytes(self, session_id: str | None, up: int, down: int) -> None:
        """Add a finished response's or tunnel's bytes to its session (in the background: the record is
        written already, and the next request's charge reads the counts)."""
        if session_id is None or not (up or down):
            return
        try:
            task = asyncio.get_running_loop().create_task(self._count_bytes(session_id, up, down))
        except RuntimeError:  # no loop (a gate driven by hand)
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _count_bytes(self, session_id: str, up: int, down: int) -> None:
        try:
            await self.store.add_bytes(session_id, up, down)
        except StoreUnavailable as err:
            log.warning("session %s: %d/%d bytes not counted: %s", session_id, up, down, err)

    async def add_running_bytes(self, session: Session, up: int, down: int) -> None:
        """Add bytes an open tunnel moved since it was last counted, now (awaited: the budget is read right
        after). StoreUnavailable when the store cannot take them (they are counted again at the next try)."""
        if up or down:
            await self.store.add_bytes(session.id, up, down)

    async def byte_usage(self, session: Session) -> tuple[Verdict | None, Usage | None]:
        """(the refusal once the session's bytes are past a byte budget — its open tunnels are closed then —,
        the usage the store holds); (None, None) for a session without byte budgets. StoreUnavailable when
        the store cannot be asked."""
        if not has_byte_budget(session):
            return None, None
        usage = await self.store.usage(session.id)
        return bytes_over_budget(session, usage), usage

    def store_down(self, session: Session, err: StoreUnavailable, role: str | None = None) -> Verdict:
        """The refusal, counted, of a request whose session the store cannot answer for now (503)."""
        return self._counted(refused(STORE_UNAVAILABLE, str(err), session, role))

    def bytes_would_cross(self, session: Session, sending: bool, reached: int) -> Verdict:
        """The refusal, counted, when an open tunnel's or WebSocket's next chunk would pass a byte budget."""
        return self._counted(bytes_would_cross(session, sending, reached))

    def _counted(self, refusal: Verdict) -> Verdict:
        self.metrics.session_refusal(refusal.rule)
        return refusal

    def _refused(self, identity: Identity) -> Identity:
        assert identity.refusal is not None
        self.metrics.session_refusal(identity.refusal.rule)
        return identity

    # ---- the admin API's side -----------------------------------------------------------------

    def new_session(self, spec: SessionSpec) -> tuple[Session, str]:
        """A new session for a validated request, and its secret (handed out once, kept only as a digest)."""
        secret = secrets.token_urlsafe(32)
        now = self.clock()
        return Session("s" + secrets.token_hex(12), secret_digest(secret), now, now + spec.ttl, spec), secret


def _proves(session: Session | None, secret: str) -> bool:
    """Whether ``secret`` is the session's. The same work for an unknown id and a wrong secret (a digest compared in
    constant time either way): a client learns nothing about which ids exist, from an answer or from its time."""
    if session is None:
        hmac.compare_digest(secret_digest(secret), _DECOY)
        return False
    return session.secret_matches(secret)
