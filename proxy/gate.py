"""The gate: every path a byte can take to an upstream passes here, whichever transport carries it.

The transports — the mitmproxy addons (``proxy/addons/``) and the fast front (``proxy/front.py``) —
are adapters: they turn what they parsed into a call on the gate and carry out its answer. The gate
holds, once each:

* admission (``proxy/admission.py``): connection caps, checked at accept;
* the budget for buffered request bodies (``proxy/body_budget.py``): every chunked body being read
  whole, all clients together, whichever transport reads it;
* the decision: the policy in force, the resolver, and the check that a pin is not egresswall itself;
* the connect-time guard: the pinned address re-checked against the policy in force at connect time;
* the first bytes of a tunnel: a whole ClientHello whose SNI names the CONNECT host, or HTTP where the
  CONNECT went to a plain-HTTP port — a tunnel never becomes a blind relay;
* the one writer of records (``proxy/records.py``): the same input gives the same record on both paths.

No mitmproxy import here: the gate is tested in process with plain values.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from policy.addresses import unwrap_mapped
from policy.decision import (
    WOULD_REFUSE,
    Request,
    Resolution,
    Verdict,
    decide_on_answer,
    decides_by_request_line,
    refuse_form,
    role_of,
)
from policy.hosts import (
    HostFormError,
    Target,
    for_logs,
    host_header_agrees,
    parse_authority,
    parse_host_header,
    parse_origin_target,
    parse_url,
)
from policy.model import REPORT, Policy, ech_allowed
from policy.resolver import DnsResolver, Resolver, resolve_and_decide
from policy.sessions import STAGE as SESSION_STAGE
from policy.sessions import STORE_UNAVAILABLE, Session, has_byte_budget

from .accept import prefers_json
from .admission import Admission, CapRefusal
from .audit import AuditLog
from .body_budget import BodyBudget
from .byte_allowance import UP, ByteAllowance
from .first_bytes import FirstBytes, FirstMessage
from .http_hygiene import CONNECT_CONTENT, OVERRIDE_HEADER, UNEXPECTED_BODY, unexpected_body
from .metrics import Metrics
from .peers import is_local_address
from .records import DECISION, RESPONSE, TUNNEL, Recorder, safe_text
from .refusals import Refusal, refusal_bytes
from .reload import PolicyHolder
from .sessions.service import SessionService
from .sessions.store import StoreUnavailable
from .tls_hello import TLS_ALERT_UNRECOGNIZED_NAME
from .tls_retry import RetryWatch

log = logging.getLogger("egresswall")
LIMITS, TLS, HTTP = "limits", "tls", "http"
SESSION_SWEEP = 1.0  # seconds between looks at the sessions of open tunnels (an end cuts them within it)
# How long the session store may go unanswered before what is open under a session is closed: a hiccup cuts
# nothing, an outage does not leave bytes moving that can be neither charged nor held to the session's end.
SESSION_STORE_GRACE = 5.0


# The error of a tunnel's, a WebSocket's or an exchange's closing record when a stop closed it (README: stopping).
# A request, CONNECT or connection whose handling raised (a bug of ours): refused, never let through undecided.
INTERNAL_STAGE, INTERNAL_ERROR = "internal", "egresswall:internal-error"
STOP_CUT = "egresswall stopped: still open at the end of limits.tunnel_grace, and closed"

@dataclass(eq=False, kw_only=True)
class UnderSession:
    """What stays open under a session with bytes that are no requests egresswall sees: a passed-through TLS
    tunnel, an open WebSocket. The gate's sweep (``Gate._sweep_sessions``) charges what it moved to the
    session and ends it once the session has ended, expired or gone past a byte budget."""

    session: Session | None = None  # the session it was opened under (a tunnel's applies to every request inside)
    closed: bool = False
    # Set by the transport while the bytes move: ``cut`` ends it (``cut_by``: the session's refusal that did),
    # ``moved`` is the bytes so far (up, down); ``charged``: how many of them the session has been charged already.
    cut: Callable[[], None] | None = None
    cut_by: Verdict | None = None
    moved: Callable[[], tuple[int, int]] | None = None
    charged: tuple[int, int] = (0, 0)
    store_silent_since: float | None = None  # when the sweep first found the session store not answering
    # What its session may still move (shared by everything open under it in this worker; None: no byte
    # budget). The transport takes each chunk from it before relaying it (proxy/byte_allowance.py).
    allowance: ByteAllowance | None = None


@dataclass(eq=False)
class Tunnel(UnderSession):
    """An allowed CONNECT: what it may carry, where it was pinned, and its one closing line."""

    id: str
    target: Target
    verdict: Verdict
    client: str
    intercept: bool
    # The port is a plain-HTTP port too (ws:// arrives as CONNECT host:80): the tunnel may carry HTTP,
    # which is parsed and decided request by request, as well as TLS (SNI-checked). Else TLS only.
    http_inside: bool
    cnames: tuple[str, ...] = ()
    started: float = field(default_factory=time.monotonic)
    first_byte_at: float | None = None
    client_conn_id: str = ""  # the mitmproxy client connection carrying it (so it never outlives it)
    established: bool = False  # the client's CONNECT was answered 200 (mitmproxy's path: http_connected)
    decided_by: Policy | None = None  # the policy its CONNECT was decided by (a reload before its first message)


@dataclass(eq=False, kw_only=True)
class OpenWebSocket(UnderSession):
    """An allowed WebSocket under a session, from its 101 to its end (its messages are no requests)."""

    id: str
    client: str
    target: Target
    verdict: Verdict


@dataclass(frozen=True)
class ConnectOutcome:
    tunnel: Tunnel | None
    refusal: Refusal | None


@dataclass(frozen=True)
class RequestOutcome:
    verdict: Verdict
    target: Target | None
    refusal: Refusal | None
    session: Session | None = None  # the session an allowed request was admitted under


@dataclass(frozen=True)
class HttpAsk:
    """A plain-HTTP request (or one inside a tunnel) as a transport parsed it."""

    client: str
    method: str
    scheme: str  # http or https, as the transport saw it
    host: str
    port: int
    path: str
    host_header: str | None
    websocket: bool = False
    content_length: int | None = None  # None: no Content-Length (chunked, or no body)
    chunked: bool = False  # the body is framed by Transfer-Encoding
    authority: str | None = None  # the request target's authority (absolute-form), if it had one
    accept: tuple[str, ...] = ()  # the Accept header values, as sent: a refusal is JSON when they prefer it
    credentials: tuple[str, ...] = ()  # the Proxy-Authorization header values, as sent (a session's id:secret)
    overrides: tuple[str, ...] = ()  # headers asking for another path or method (http_hygiene.OVERRIDE_HEADERS)
    flow_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # The head's bytes as the client sent them: its URL and headers carry data out as a body does, so a
    # session's request_bytes counts them (they are charged when the request is admitted).
    head_size: int = 0


class Gate:
    def __init__(self, holder: PolicyHolder, audit: AuditLog, metrics: Metrics | None = None,
                 resolver: Resolver | None = None, share: int = 1, sessions: SessionService | None = None) -> None:
        self.holder = holder
        self.audit = audit
        self.metrics = metrics or Metrics()
        self.sessions = sessions or SessionService(metrics=self.metrics)
        self.recorder = Recorder(audit, self.metrics, lambda: self.holder.policy, self._start_audit_probe)
        self.admission = Admission(share)
        # Set when a stop cuts what is still open at the end of limits.tunnel_grace: their closing records say so.
        self.stopping_cut = False
        self.body_budget = BodyBudget(share, on_change=self.metrics.buffered_request_bodies)
        self.self_endpoints: set[tuple[str, int]] = set()  # (ip or "*", port) egresswall itself listens on
        # (ip, port) of the shared session store: a client that reached it could grant itself sessions
        self.store_endpoints: set[tuple[str, int]] = set()
        self._resolver = resolver
        self._resolver_for: Policy | None = None
        self._audit_probe: asyncio.Task | None = None
        self.under_sessions: dict[str, UnderSession] = {}  # open tunnels and WebSockets under a session, by id
        self.allowances: dict[str, ByteAllowance] = {}  # by session id, while something is open under it
        self._session_sweep: asyncio.Task | None = None
        self._first_reads: dict[str, asyncio.Task] = {}  # by session id: the look that reads a new allowance
        self.store_grace = SESSION_STORE_GRACE
        self.metrics.policy_in_force()
        self.metrics.count_audit_failures(lambda: self.audit.failures)

    # ---- the policy, the resolver and the decision -------------------------------------------------

    @property
    def policy(self) -> Policy:
        return self.holder.policy

    @property
    def draining(self) -> bool:
        return self.admission.draining

    def resolver(self, policy: Policy) -> Resolver:
        """One resolver per policy's resolver settings; a reload that changes them gets a new one."""
        given_by_caller = self._resolver_for is None
        if self._resolver is not None and (given_by_caller or self._resolver_for.resolver == policy.resolver):
            return self._resolver
        self._resolver = DnsResolver.for_policy(policy)
        self._resolver_for = policy
        return self._resolver

    async def decide(self, policy: Policy, request: Request, answer: Resolution | None = None
                     ) -> tuple[Verdict, Resolution | None]:
        """The decision, with the name looked up, or judged on ``answer`` when there is one (``decide_on_answer``)."""
        if answer is not None:
            verdict, resolution = decide_on_answer(policy, request, answer), answer
        else:
            started = time.monotonic()
            verdict, resolution = await resolve_and_decide(policy, request, self.resolver(policy))
            if resolution is not None or verdict.stage == "resolve":
                self.metrics.observe_dns(time.monotonic() - started)
            if verdict.stage == "resolve" and verdict.rule.startswith("dns:"):
                self.metrics.dns_error(verdict.rule[4:])
        if verdict.allowed and verdict.pinned:
            own = self.own_endpoint(verdict.pinned, request.target.port)
            if own is not None:
                verdict = self_refusal(verdict.pinned, request.target.port, own, verdict)
        return verdict, resolution

    def own_endpoint(self, address: str, port: int) -> str | None:
        """What of egresswall's own answers at (address, port) — a listener or its session store — or None.
        An IPv4-mapped address is the IPv4 it maps (a name answering AAAA ``::ffff:127.0.0.1`` reaches
        127.0.0.1), and an unspecified one (``0.0.0.0``, ``::``) reaches this host's listeners, whichever
        address they are bound to: a connect to it is a connect to this host."""
        address = unwrap_mapped(address)
        anywhere_here = _unspecified(address)
        if (address, port) in self.self_endpoints or (
                ("*", port) in self.self_endpoints and is_local_address(address)) or (
                anywhere_here and any(p == port for _, p in self.self_endpoints)):
            return "egresswall's own listener"
        if (address, port) in self.store_endpoints or (
                ("*", port) in self.store_endpoints and is_local_address(address)) or (
                anywhere_here and any(p == port for _, p in self.store_endpoints)):
            return "egresswall's session store"
        return None

    def is_self(self, address: str, port: int) -> bool:
        return self.own_endpoint(address, port) is not None

    # ---- admission ---------------------------------------------------------------------------------

    def admit(self, client: str, descriptor: int | None = None) -> CapRefusal | None:
        """``descriptor``: the accepted connection's file descriptor, where the transport has it (the front)."""
        refusal = self.admission.admit(client, self.policy.limits, descriptor)
        if refusal is None:
            self.metrics.connections_open(self.admission.total)
        else:
            self.metrics.refusal(refusal.rule)
        return refusal

    def release(self, client: str) -> None:
        self.admission.release(client)
        self.metrics.connections_open(self.admission.total)

    def refuse_admission(self, client: str, cap: CapRefusal, method: str | None = None,
                         target: Target | None = None, url: str | None = None,
                         accept: Iterable[str] = ()) -> Refusal:
        """The record of a connection refused by a cap, with host and port when the client said them."""
        return self.refuse(client, method, target, cap.status, LIMITS, cap.rule, cap.reason, url=url, accept=accept)

    # ---- CONNECT -----------------------------------------------------------------------------------

    async def decide_connect(self, client: str, authority: str, flow_id: str | None = None,
                             accept: Iterable[str] = (), credentials: Iterable[str] = (),
                             content: str | None = None) -> ConnectOutcome:
        """Decide a CONNECT; an allowed one gets its Tunnel (counted open until ``tunnel_closed``).
        ``accept``: the CONNECT's Accept header values, which choose the refusal's body; ``credentials``: its
        Proxy-Authorization values (a session); ``content``: why it declares content (``connect_content``),
        refused 400."""
        policy = self.policy
        flow_id = flow_id or uuid.uuid4().hex
        resolution = None
        session = None
        status = 403
        try:
            target = parse_authority(authority, "https")
        except HostFormError as err:
            verdict, target = refuse_form(err), None
        else:
            if content is not None:
                verdict, status = Verdict(False, "form", CONNECT_CONTENT, content), 400
        if target is not None and status != 400:
            # A tunnel neither intercepted nor to a plain-HTTP port carries TLS passed through unread.
            tls = not (policy.intercepts(target.host) or target.port in policy.http_ports)
            session, verdict, status = await self._session_first(policy, client, tuple(credentials), target, False,
                                                                 tls)
            if verdict is None:
                verdict, resolution = await self.decide(policy, Request(target, "CONNECT", client, tunnel=True))
                verdict, status = await self._session_charge(session, verdict, target, None)
        else:  # refused for its form: its record names the session its credentials prove, as every session line
            verdict = replace(verdict, session=await self.session_named(client, credentials, None))
        record = self.recorder.record(DECISION, flow_id, client, "CONNECT", target, verdict,
                                      resolution.cnames if resolution else ())
        if target is None:
            record.url = self.recorder.url(authority)
        if not verdict.allowed:
            refusal = refusal_for(status, verdict, target, accept)
            record.status, record.bytes_down = status, refusal.size
            self.recorder.decision(record)
            return ConnectOutcome(None, refusal)
        if not (self.recorder.decision(record) and self.audit.healthy):
            return ConnectOutcome(None, self.audit_unwritable(target, accept))
        assert target is not None
        tunnel = Tunnel(flow_id, target, verdict, client, intercept=policy.intercepts(target.host),
                        http_inside=target.port in policy.http_ports,
                        cnames=resolution.cnames if resolution else (), session=session, decided_by=policy)
        self.metrics.tunnel_opened()
        if session is not None:
            self._watch_session(tunnel.id, tunnel)
            # Read before the tunnel is answered: a first message sent with the CONNECT was taken against the
            # whole budget while a remote store's answer was on its way (review rounds 16 and 18).
            refused = await self._allowance_known(tunnel)
            if refused is not None:
                status = 503 if refused.rule == STORE_UNAVAILABLE else 403
                self.refuse_tunnel(tunnel, refused.rule, refused.reason, status=status)
                return ConnectOutcome(None, refusal_for(status, refused, target, accept))
        return ConnectOutcome(tunnel, None)

    def first_message(self, tunnel: Tunnel) -> FirstMessage:
        """A reader of the tunnel's first message, for its transport to hold and feed each read to ``tunnel_start``
        (a head is bounded by ``limits.max_header_bytes``, as every other request head is)."""
        return FirstMessage(tunnel.target.host, tunnel.http_inside, self.policy.limits.max_header_bytes)

    def tunnel_start(self, tunnel: Tunnel, first: FirstMessage, chunk: bytes) -> FirstBytes:
        """Judge the first bytes a tunnel carries, ``chunk`` the newest read (``first`` holds the ones before it);
        a refusal gets its record and closes the tunnel."""
        if tunnel.first_byte_at is None and chunk:
            tunnel.first_byte_at = time.monotonic()
        judged = first.feed(chunk, ech_allowed(self.policy))
        if judged.kind == "tls" and tunnel.decided_by is not None and tunnel.decided_by is not self.policy:
            # A reload since the CONNECT: nothing has passed yet, so its ClientHello is the tunnel's first request
            # and the policy in force judges it, on the CONNECT's own answer (no lookup), as a request inside a
            # tunnel to a plain-HTTP port is judged (review round 22).
            again = decide_on_answer(self.policy, Request(tunnel.target, "CONNECT", tunnel.client, tunnel=True),
                                     Resolution(tunnel.target.host, tunnel.verdict.addresses, tunnel.cnames))
            if not again.allowed:
                reason = f"since the CONNECT was answered, a policy reload refuses it: {again.reason}"
                self.refuse_tunnel(tunnel, again.rule, reason, verdict=replace(again, reason=reason))
                return FirstBytes.refuse(again.rule, reason)
        if judged.kind == "tls" and not tunnel.intercept:
            if tunnel.session is not None:
                # TLS in a tunnel to a plain-HTTP port, passed through: the CONNECT was admitted for HTTP inside,
                # whose requests are each held to the grants; TLS would reach any https path there.
                refusal = self.sessions.check_passthrough(tunnel.session, tunnel.target, tunnel.verdict.role)
            else:  # opened without a session, passed through unread: as for a request inside (decide_request)
                refusal = self.sessions.required_in_tunnel(self.policy, tunnel.client)
            if refusal is not None:
                judged = FirstBytes.refuse(refusal.rule, refusal.reason)
        if judged.refused:
            verdict = self.refuse_tunnel(tunnel, judged.rule, judged.reason)
            if judged.rule.startswith("tls:"):
                judged = replace(judged, answer=TLS_ALERT_UNRECOGNIZED_NAME)
            elif judged.status:  # a refused request head: answered as the same head outside a tunnel is
                judged = replace(judged, answer=refusal_bytes(refusal_for(judged.status, verdict, tunnel.target)))
        return judged

    def tunnel_start_timed_out(self, tunnel: Tunnel, seen: int) -> None:
        """The tunnel's first message was not whole ``limits.header_timeout`` after the tunnel opened."""
        timeout = self.policy.limits.header_timeout
        what = f"only {seen} bytes of it had come" if seen else "nothing had come"
        self.refuse_tunnel(tunnel, "limits.header_timeout",
                           f"the tunnel's first message (a TLS ClientHello or an HTTP request head) was not complete "
                           f"{timeout:g}s after the tunnel opened ({what}; limits.header_timeout)")

    def tunnel_cut_short(self, tunnel: Tunnel, seen: int) -> None:
        """The client closed the tunnel after its 200 with ``seen`` bytes of a first message that was not whole
        (none at all, too): the same closing line whichever transport carried it."""
        self.tunnel_closed(tunnel, seen, 0, "the client closed the tunnel before its first message was complete")

    def retry_watch(self, judged: FirstBytes, held: bytes) -> RetryWatch:
        """The watch a passed-through TLS tunnel keeps after its first ClientHello (``judged``; ``held``: what the
        client sent after it), until the server's first answer shows whether a second one is asked for."""
        return RetryWatch(judged.sni, ech_allowed(self.policy), held)

    def refuse_tunnel(self, tunnel: Tunnel, rule: str, reason: str, up: int = 0, down: int = 0,
                      status: int = 200, verdict: Verdict | None = None) -> Verdict:
        """``status``: what the client's CONNECT was answered (a refusal before the 200 is not 200); ``verdict``: the
        policy's refusal when it made one (its stage and rule id go into the record). Returns the refusal recorded."""
        stage = (LIMITS if rule.startswith("limits.") else TLS if rule.startswith("tls:")
                 else SESSION_STAGE if rule.startswith("session:") else HTTP)
        verdict = (replace(verdict, addresses=tunnel.verdict.addresses, session=tunnel.verdict.session)
                   if verdict is not None else  # its own role: the one whose rule refused
                   Verdict(False, stage, rule, reason, role=tunnel.verdict.role, addresses=tunnel.verdict.addresses,
                           session=tunnel.verdict.session))
        record = self.recorder.record(DECISION, tunnel.id + "-tls", tunnel.client, "CONNECT", tunnel.target, verdict,
                                      tunnel.cnames)
        self.recorder.decision(record)
        self.tunnel_closed(tunnel, up, down, reason, status)
        return verdict

    def tunnel_closed(self, tunnel: Tunnel, up: int, down: int, error: str | None, status: int = 200) -> None:
        """The closing line of a tunnel, once, on either path, with its bytes each way. ``status``: what the
        client's CONNECT was answered — 200, or 502 when the connect failed before the tunnel opened."""
        if tunnel.closed:
            return
        tunnel.closed = True
        self._unwatch_session(tunnel.id, tunnel)
        if tunnel.cut_by is not None:
            error = f"{tunnel.cut_by.reason} ({tunnel.cut_by.rule}): egresswall closed the tunnel"
        elif self.stopping_cut:  # whatever it saw, the stop's cut ended it
            error = STOP_CUT
        self.metrics.tunnel_closed()
        record = self.recorder.record(TUNNEL, tunnel.id, tunnel.client, "CONNECT", tunnel.target, tunnel.verdict,
                                      tunnel.cnames)
        self.recorder.ended(record, tunnel.started, up, down, error, status)
        self._charge_rest(tunnel, tunnel.verdict.session, up, down)

    # ---- tunnels and WebSockets under a session ----------------------------------------------------

    async def websocket_opened(self, flow_id: str, client: str, target: Target, verdict: Verdict, session: Session,
                               cut: Callable[[], None], moved: Callable[[], tuple[int, int]]) -> OpenWebSocket:
        """An allowed WebSocket under ``session`` has switched protocols: watched like a tunnel from here on.
        Returns once its session's allowance has been read from the store (when this is the first thing open
        under the session here), as ``decide_connect`` does before a tunnel is answered: a message sent at once
        after the 101, or behind the handshake, was taken against the whole budget while a remote store's
        answer was on its way (review round 18)."""
        websocket = OpenWebSocket(id=flow_id, client=client, target=target, verdict=verdict, session=session,
                                  cut=cut, moved=moved)
        self._watch_session(websocket.id, websocket)
        refused = await self._allowance_known(websocket)
        if refused is not None:
            self._cut([websocket], refused)  # its allowance, unread, takes nothing meanwhile
        return websocket

    def websocket_closed(self, websocket: OpenWebSocket, up: int, down: int) -> None:
        """Its session is charged the rest of its bytes; a WebSocket the sweep ended gets the line saying why."""
        if websocket.closed:
            return
        websocket.closed = True
        self._unwatch_session(websocket.id, websocket)
        if websocket.cut_by is not None:
            self.refuse(websocket.client, "GET", websocket.target, 0, SESSION_STAGE, websocket.cut_by.rule,
                        f"{websocket.cut_by.reason}: egresswall closed the WebSocket", flow_id=f"{websocket.id}-ws",
                        session=websocket.verdict.session)
        self._charge_rest(websocket, websocket.verdict.session, up, down)

    def _charge_rest(self, held: UnderSession, session_id: str | None, up: int, down: int) -> None:
        """At its close: the session is charged what it moved past what the sweep charged while it was open."""
        charged_up, charged_down = held.charged
        self.sessions.count_bytes(session_id, max(0, up - charged_up), max(0, down - charged_down))

    def _watch_session(self, key: str, held: UnderSession) -> None:
        """Watch it by its session, with the session's allowance in this worker (made unread by the first one:
        ``_allowance_known`` reads it before anything under it is relayed)."""
        self.under_sessions[key] = held
        loop = asyncio.get_running_loop()
        session = held.session
        assert session is not None
        if has_byte_budget(session):
            allowance = self.allowances.get(session.id)
            if allowance is None:
                allowance = self.allowances[session.id] = ByteAllowance(
                    session.budgets.request_bytes, session.budgets.response_bytes,
                    lambda way, reached: self._bytes_would_cross(session.id, way, reached), read=False)
            allowance.holders += 1
            held.allowance = allowance
        if self._session_sweep is None or self._session_sweep.done():
            self._session_sweep = loop.create_task(self._sweep_sessions())

    async def _allowance_known(self, held: UnderSession) -> Verdict | None:
        """None once what its session may still move here has been read from the store (at once when it was
        already); else the refusal that ends it: the session ended, expired or is past a byte budget, or the
        store did not answer (fail closed: an allowance never read would let the whole budget through).
        Everything opened under the session while the first look is on its way waits for that same look: one
        opened beside it took the whole budget (review round 18)."""
        allowance, session = held.allowance, held.session
        if allowance is None or allowance.read:
            return held.cut_by
        assert session is not None
        task = self._first_reads.get(session.id)
        if task is None or task.done():
            under = [h for h in self.under_sessions.values()
                     if h.session is not None and h.session.id == session.id and not h.closed]
            task = self._first_reads[session.id] = asyncio.get_running_loop().create_task(
                self._look_at_session(under))
            task.add_done_callback(lambda done: self._first_reads.pop(session.id, None)
                                   if self._first_reads.get(session.id) is done else None)
        over = await asyncio.shield(task)
        if held.cut_by is not None or over is not None:
            return held.cut_by or over
        if not allowance.read:
            return self.sessions.store_down(session, StoreUnavailable(
                "the session store did not answer the first look at what the session may still send and receive"))
        return None

    def _unwatch_session(self, key: str, held: UnderSession) -> None:
        """It has closed: no longer looked at, and its allowance dropped with the last one under its session."""
        self.under_sessions.pop(key, None)
        allowance, held.allowance = held.allowance, None
        if allowance is not None:
            allowance.holders -= 1
            session_id = held.session.id if held.session is not None else None
            if allowance.holders <= 0 and self.allowances.get(session_id or "") is allowance:
                del self.allowances[session_id or ""]

    def _bytes_would_cross(self, session_id: str, way: str, reached: int) -> None:
        """A chunk was not relayed: it would have carried the session past a byte budget. Everything open under
        the session in this worker ends now, with the refusal that says so (as the sweep ends them)."""
        helds = [held for held in self.under_sessions.values() if held.session is not None
                 and held.session.id == session_id and held.cut_by is None and not held.closed]
        if not helds:
            return  # all ended already by an earlier crossing (each later chunk under it asks again)
        assert helds[0].session is not None
        self._cut(helds, self.sessions.bytes_would_cross(helds[0].session, way == UP, reached))

    @staticmethod
    def _cut(helds: list[UnderSession], over: Verdict) -> None:
        """End each with ``over``: its closing line says why, even one whose transport had not yet set ``cut``."""
        for held in helds:
            if not held.closed and held.cut_by is None:
                held.cut_by = over
                if held.cut is not None:
                    held.cut()

    async def _sweep_sessions(self) -> None:
        """While tunnels or WebSockets opened under a session are open: every ``SESSION_SWEEP`` seconds, each
        one whose session has ended or expired since it opened, or whose session its bytes have carried past a
        byte budget, is ended. A request inside a tunnel is checked against the session as it is then; the
        bytes of a tunnel passed through unread (TLS) and a WebSocket's messages are not requests, and without
        this they outlived their session for as long as they kept moving, and moved any number of bytes under
        a session's byte budgets. One session's store trouble never stops the sweep for the others."""
        while self.under_sessions:
            await asyncio.sleep(SESSION_SWEEP)
            by_session: dict[str, list[UnderSession]] = {}
            for held in list(self.under_sessions.values()):
                assert held.session is not None
                by_session.setdefault(held.session.id, []).append(held)
            # Concurrently: each look is a few store round trips, and one slow session must not stretch
            # the others' bound of about a second.
            await asyncio.gather(*(self._look_at_session(helds) for helds in by_session.values()))

    async def _look_at_session(self, helds: list[UnderSession]) -> Verdict | None:
        """End a session's open tunnels and WebSockets once it has ended or expired, its bytes are past a byte
        budget, or the store has not answered for ``store_grace`` seconds. Any other error here is logged, and
        the sweep goes on for every other session (a sweep that died would cut nothing again until another one
        opened)."""
        session = helds[0].session
        assert session is not None
        started = time.monotonic()
        try:
            # A store already silent at the last look may hang this one until its timeout: the expiry last
            # seen is judged first, so the session still ends on time.
            over = self._expired(helds) if helds[0].store_silent_since is not None else None
            if over is None:
                current, over = await self.sessions.over(session)
                for held in helds:  # as the store holds it now: its expiry is known should the store fall silent
                    held.session = current
                over = over or await self._charge_open(current, helds)
        except StoreUnavailable as err:
            over = self._store_silent(session, helds, err, started)
        except Exception:  # noqa: BLE001 - see the docstring; CancelledError (shutdown) is no Exception
            log.exception("session %s: its open tunnels and WebSockets could not be looked at", session.id)
            return None
        else:
            for held in helds:
                held.store_silent_since = None
        if over is not None:
            self._cut(helds, over)
        return over

    def _expired(self, helds: list[UnderSession]) -> Verdict | None:
        """The refusal once the session has expired as last seen (the earliest expiry any of them saw)."""
        soonest = min((held.session for held in helds if held.session is not None), key=lambda s: s.expires)
        return self.sessions.expired(soonest)

    def _store_silent(self, session: Session, helds: list[UnderSession], err: StoreUnavailable,
                      asked: float) -> Verdict | None:
        """The store did not answer the look that began at ``asked``. A hiccup cuts nothing (new requests under
        the session are refused 503 meanwhile) unless the session has expired as last seen; once it has not
        answered for ``store_grace`` seconds, the refusal that ends them."""
        expired = self._expired(helds)
        if expired is not None:
            return expired
        for held in helds:
            if held.store_silent_since is None:
                held.store_silent_since = asked
        silent = time.monotonic() - min(held.store_silent_since or asked for held in helds)
        log.warning("session %s: the session store did not answer for %.0fs: %s", session.id, silent, err)
        if silent < self.store_grace:
            return None
        return self.sessions.store_lost(session, silent, err)

    async def _charge_open(self, session: Session, helds: list[UnderSession]) -> Verdict | None:
        """Charge the session what its open tunnels and WebSockets moved since the last look, and say whether
        that put it past a byte budget. The charged counts are moved on before the store is asked, so one that
        closes meanwhile counts only the rest (``tunnel_closed``, ``websocket_closed``); a store that could not
        take them moves them back for the ones still open (and StoreUnavailable goes on to the sweep)."""
        moved = [(held, held.charged, held.moved()) for held in helds if held.moved is not None and not held.closed]
        up = sum(now[0] - before[0] for _, before, now in moved)
        down = sum(now[1] - before[1] for _, before, now in moved)
        for held, _, now in moved:
            held.charged = now
        try:
            await self.sessions.add_running_bytes(session, up, down)
        except StoreUnavailable:
            for held, before, _ in moved:
                if not held.closed:
                    held.charged = before
            raise
        over, usage = await self.sessions.byte_usage(session)
        allowance = self.allowances.get(session.id)
        if usage is not None and allowance is not None:
            # What moved while the store was asked is not in its usage yet: it is taken off too.
            since = [(now[0] - held.charged[0], now[1] - held.charged[1])
                     for held in helds if held.moved is not None and not held.closed for now in [held.moved()]]
            allowance.refresh(usage, (sum(u for u, _ in since), sum(d for _, d in since)))
        return over

    # ---- the guard at connect time -----------------------------------------------------------------

    def guard(self, pinned: str, port: int) -> str | None:
        """Why connecting to ``pinned`` is refused now (a reload may have landed since the decision)."""
        checked = self.policy.addresses.check(pinned)
        if not checked.allowed:
            return f"refused connect to {pinned}: {checked.reason}"
        own = self.own_endpoint(pinned, port)
        if own is not None:
            return f"refused connect to {pinned}:{port}: it is {own}"
        return None

    def guard_upstream(self, host: str, port: int) -> str | None:
        """Why a connect to (host, port) is refused when the policy names an upstream proxy: only the
        upstream itself may be connected to, and never when it is egresswall's own listener."""
        upstream = self.policy.upstream
        assert upstream is not None
        if (host.lower().strip("[]"), port) != (upstream.host, upstream.port):
            return (f"egresswall: refused a direct connect to {host}:{port}: the policy sends every connection "
                    f"through the upstream proxy {upstream.url}")
        if self.is_self(upstream.host, port):
            return f"egresswall: the upstream proxy {upstream.url} is egresswall's own listener"
        return None

    # ---- a request head the transport's parser could not read ----------------------------------------

    def refuse_unread_target(self, client: str, method: str, target: str, host_header: str | None,
                             accept: Iterable[str] = ()) -> Refusal | None:
        """The core's refusal of a request that mitmproxy's parser refused before any hook of ours saw it (its
        request line: ``GET http://a..b/``, ``CONNECT [1.2.3.4]:443``; an origin-form request's Host header),
        when the core refuses the host or port it names: the rule, reason and record ``decide_connect`` and
        ``decide_request`` give the same request on the fast path, where mitmproxy's parser is not asked.
        ``target``: the request target as sent; ``host_header``: the one Host header (None: none, or several).
        None: the core reads the target, and mitmproxy's refusal stands (its parser refused something else, or
        a host the core takes but mitmproxy cannot represent: it is never forwarded)."""
        try:
            if method == "CONNECT":
                url = target
                parse_authority(target, "https")
            elif target.startswith("/"):
                if host_header is None:
                    return None
                url = f"http://{host_header}{target}"
                parse_host_header(host_header, "http")
            elif "://" in target:
                url = target if "/" in target.partition("://")[2] else target + "/"  # as the fast path records it
                parse_url(target)
            else:
                return None  # '*', or no URL at all: nothing names a host
        except HostFormError as err:
            verdict = refuse_form(err)
            return self.refuse(client, method, None, 403, verdict.stage, verdict.rule, verdict.reason, url=url,
                               accept=accept)
        return None

    # ---- plain HTTP, and requests inside tunnels ---------------------------------------------------

    async def decide_request(self, ask: HttpAsk, tunnel: Tunnel | None) -> RequestOutcome:
        policy = self.policy
        try:
            target = self._request_target(ask, tunnel)
        except HostFormError as err:
            return await self._request_refused(ask, None, refuse_form(err), 403, url=sent_url(ask), tunnel=tunnel)
        early = self._form_refusal(policy, ask, target, tunnel)
        if early is not None:
            return await self._request_refused(ask, target, *early, tunnel=tunnel)
        resolution = None
        if tunnel is not None:  # the CONNECT's session applies inside; a header inside names no other one
            session, verdict, status = None, None, 403
            if tunnel.session is not None:  # as the store has it now: extended, shortened or ended since
                session, verdict, status = await self.sessions.current(tunnel.session, tunnel.verdict.role)
                if session is not None:
                    verdict, status = self.sessions.check(session, target, True, tunnel.verdict.role), 403
            else:  # opened without one: the policy in force now may require one (a reload since the CONNECT)
                verdict = self.sessions.required_in_tunnel(policy, ask.client)
        else:
            session, verdict, status = await self._session_first(policy, ask.client, ask.credentials, target, True,
                                                                 sent=(ask.content_length or 0) + ask.head_size)
        if verdict is None:
            # Inside a tunnel: on the CONNECT's answer, where its one upstream connection goes (decide_on_answer).
            answer = None if tunnel is None else Resolution(tunnel.target.host, tunnel.verdict.addresses, tunnel.cnames)
            verdict, resolution = await self.decide(
                policy, Request(target, ask.method, ask.client, tunnel=False, websocket=ask.websocket), answer)
            if verdict.allowed and ask.overrides:
                verdict = self._override_refused(policy, ask, target, verdict, resolution, session) or verdict
            verdict, status = await self._session_charge(session, verdict, target, ask.content_length, ask.head_size)
        elif session is not None:
            verdict = replace(verdict, session=session.id)
        record = self.recorder.record(DECISION, ask.flow_id, ask.client, ask.method, target, verdict,
                                      resolution.cnames if resolution else ())
        if not verdict.allowed:
            refusal = refusal_for(status, verdict, target, ask.accept)
            record.status, record.bytes_down = status, refusal.size
            self.recorder.decision(record)
            return RequestOutcome(verdict, target, refusal)
        if not (self.recorder.decision(record) and self.audit.healthy):
            return RequestOutcome(verdict, target, self.audit_unwritable(target, ask.accept))
        return RequestOutcome(verdict, target, None, session)

    # ---- sessions --------------------------------------------------------------------------------

    async def _session_first(self, policy: Policy, client: str, credentials: tuple[str, ...], target: Target,
                             visible: bool, tls: bool = False, sent: int | None = None
                             ) -> tuple[Session | None, Verdict | None, int]:
        """Before the policy decides, so that no name is looked up for a request its session refuses: who the
        request came as, whether its session grants the target (``tls``: a tunnel carrying TLS passed through),
        and whether one more request (of ``sent`` bytes) fits its budgets — judged here, counted only once the
        policy allows it (``_session_charge``). Past a budget, a wildcard grant's names would otherwise each
        still be looked up, carrying client-chosen labels to DNS (review round 18). (session, refusal or None,
        status of a refusal)."""
        identity = await self.sessions.identify(policy, client, credentials)
        if identity.refusal is not None:
            return None, identity.refusal, identity.status
        session = identity.session
        if session is None:
            return None, None, 403
        role = role_of(policy, client)
        role_name = role.name if role else None
        refusal = self.sessions.check(session, target, visible, role_name, tls)
        if refusal is not None:
            return session, refusal, 403
        refusal, status = await self.sessions.fits(session, target, sent, role_name)
        allowance = self.allowances.get(session.id)
        if refusal is None and allowance is not None and allowance.read:
            # A tunnel or WebSocket of the session open in this worker: the store learns its bytes at the next
            # sweep, the allowance already knows them (review round 20: a budget spent there still let a second
            # of requests, each refused after its name was looked up).
            refusal = self.sessions.fits_moved(session, allowance.used(), sent, role_name)
        return session, refusal, status or 403

    async def _session_charge(self, session: Session | None, verdict: Verdict, target: Target,
                              content_length: int | None, head_size: int = 0) -> tuple[Verdict, int]:
        """After the policy allowed it: count the request against the session's budgets (atomically, in the
        store). The verdict carries the session's id from here on, into every record. ``head_size``: the head's
        bytes; with the declared body they are judged and charged at once, so requests admitted together are
        judged on each other's bytes (``response_closed`` charges only what went beyond the declared body)."""
        if session is None:
            return verdict, 403
        if not verdict.allowed:
            return replace(verdict, session=session.id), 403
        coming = (content_length or 0) + head_size
        over = self._over_allowance(session, coming)
        if over is not None:
            return replace(over, addresses=verdict.addresses), 403
        refusal, status = await self.sessions.charge(session, target, coming, verdict.role)
        if refusal is not None:
            return replace(refusal, addresses=verdict.addresses), status
        return replace(verdict, session=session.id), 403

    async def chunked_body_refusal(self, session: Session | None, size: int) -> tuple[Verdict, int] | None:
        """A chunked body read whole, before any of it goes upstream: its admission could not know its size, so
        it is judged now against the session's request_bytes (the store's count and this worker's allowance).
        (the refusal, its status), or None when it fits (or there is no such budget)."""
        if session is None or not size:
            return None
        if session.budgets.request_bytes is None:
            self.sessions.count_bytes(session.id, size, 0)  # counted now, as a budget would charge it
            return None
        over = self._over_allowance(session, size)
        if over is not None:
            return over, 403
        try:  # charged now, atomically, as a declared body is at admission (``response_closed`` counts the rest)
            reached = await self.sessions.store.charge_bytes(session.id, size, session.budgets.request_bytes)
        except StoreUnavailable as err:
            return self.sessions.store_down(session, err), 503
        if reached is not None:
            return self.sessions.bytes_would_cross(session, True, reached), 403
        return None

    def _over_allowance(self, session: Session, size: int) -> Verdict | None:
        """Reserve ``size`` bytes sent from the session's allowance in this worker, if it has one (a tunnel or
        WebSocket of it is open): the store has not yet been charged what those moved since the last look, the
        allowance has. The refusal when they do not fit (nothing else ends), else None."""
        allowance = self.allowances.get(session.id)
        if allowance is None or not size or allowance.reserve(UP, size):
            return None
        return self.sessions.bytes_would_cross(session, True, allowance.needed(UP, size))

    @staticmethod
    def _override_refused(policy: Policy, ask: HttpAsk, target: Target, verdict: Verdict,
                          resolution: Resolution | None, session: Session | None) -> Verdict | None:
        """The refusal of an allowed request that carries a header asking a server for another path or method
        (``http_hygiene.OVERRIDE_HEADERS``), where the decision was made by path or method: a host rule for the
        target or for a name of its CNAME chain (whose deny rules judged the request by its path too) has
        ``paths`` or ``methods``, or the session grants exact URLs."""
        names = (target.host, *(name.rstrip(".").lower() for name in (resolution.cnames if resolution else ())))
        by_rule = next((f"a rule for {name} decides by path or method" for name in names
                        if decides_by_request_line(policy, name, ask.client)), None)
        by_grant = "the session grants exact URLs" if session is not None and session.grants.urls else None
        why = by_grant or by_rule
        if why is None:
            return None
        reason = (f"the request carries {', '.join(ask.overrides)}, which asks a server for another path or method "
                  f"than the request line's, and {why}")
        if by_grant is None and policy.mode == REPORT:
            # Host rules are what it protects, and report mode relaxes them (a DELETE a methods rule refuses is
            # let through there): reported, unless the decision is reported already. A session's grant is not.
            return verdict if verdict.report_only else replace(verdict, report_only=True, stage="form",
                                                               rule=OVERRIDE_HEADER, rule_id=OVERRIDE_HEADER,
                                                               reason=f"{WOULD_REFUSE}{reason}")
        return Verdict(False, "form", OVERRIDE_HEADER, reason, role=verdict.role)

    def _request_target(self, ask: HttpAsk, tunnel: Tunnel | None) -> Target:
        if not ask.path.isascii():
            # A request target is ASCII on the wire (RFC 9112); a client sends a URL's other characters
            # percent-encoded. mitmproxy hands other bytes over decoded with surrogateescape, which the core would
            # read as characters: '/secret' and a lone 0xa0 byte dodged a deny rule (review round 19).
            raise HostFormError("url", f"the request target {safe_text(for_logs(ask.path), 60)!r} has a byte outside "
                                       "ASCII; a client sends a URL's other characters percent-encoded")
        if tunnel is not None:
            # Inside a tunnel the target is the tunnel's; the Host header must agree with it. The path is read by
            # the core as a plain request's is: taken as mitmproxy split it, '/private#.json' matched the rule
            # '/*.json' while the origin served /private, and a control byte or NBSP after '/secret' dodged a deny
            # rule an origin's str.split() then read past (review round 19).
            plain = {"https": "wss", "http": "ws"} if ask.websocket else {"https": "https", "http": "http"}
            scheme = plain.get(ask.scheme, ask.scheme)
            _refuse_asterisk(ask.path)
            t = tunnel.target
            path = parse_url(f"{scheme}://{t.authority}{ask.path}").path
            return Target(scheme, t.host, t.port, path, t.ip)
        return plain_target(ask)

    def _form_refusal(self, policy: Policy, ask: HttpAsk, target: Target, tunnel: Tunnel | None
                      ) -> tuple[Verdict, int] | None:
        """A request refused for its form or declared size before any session or policy check: (verdict, status)."""
        if tunnel is not None and ask.authority and not host_header_agrees(target, ask.authority):
            # Absolute-form inside a tunnel: an origin must use the URI's authority over Host (RFC 9112
            # 3.2.2), so one naming another host than the tunnel's would reach that host.
            return Verdict(False, "form", "form:authority",
                           f"the request target names {safe_text(for_logs(ask.authority), 100)!r}, not the "
                           f"tunnel's {target.authority}"), 403
        if ask.host_header is not None and not host_header_agrees(target, ask.host_header):
            return Verdict(False, "form", "form:host-header",
                           f"the Host header {safe_text(for_logs(ask.host_header), 100)!r} does not agree with "
                           f"the target {target.authority}"), 403
        body_refused = unexpected_body(ask.method, ask.content_length, ask.chunked, policy.http.body_allowed_on)
        if body_refused:
            return Verdict(False, "form", UNEXPECTED_BODY, body_refused), 400
        limit = policy.limits.max_request_body
        if ask.content_length is not None and ask.content_length > limit:
            self.metrics.refusal("limits.max_request_body")
            return Verdict(False, LIMITS, "limits.max_request_body",
                           f"the request body of {ask.content_length} bytes is over the limit of {limit} "
                           "(limits.max_request_body)"), 413
        return None

    async def session_named(self, client: str, credentials: Iterable[str], tunnel: Tunnel | None) -> str | None:
        """The session a request refused before its session was checked came under, for its record: inside a
        tunnel the CONNECT's; outside, the one its credentials prove (no refusal or count of its own)."""
        if tunnel is not None:
            return tunnel.verdict.session
        return await self.sessions.verified_id(self.policy, client, tuple(credentials))

    async def _request_refused(self, ask: HttpAsk, target: Target | None, verdict: Verdict, status: int,
                               url: str | None = None, tunnel: Tunnel | None = None) -> RequestOutcome:
        # Every line of a session's requests names it, a request refused for its form too (review round 22).
        verdict = replace(verdict, session=await self.session_named(ask.client, ask.credentials, tunnel))
        record = self.recorder.record(DECISION, ask.flow_id, ask.client, ask.method, target, verdict)
        refusal = refusal_for(status, verdict, target, ask.accept)
        record.status, record.bytes_down = status, refusal.size
        if target is None and url is not None:
            record.url = self.recorder.url(url)
        self.recorder.decision(record)
        return RequestOutcome(verdict, target, refusal)

    def refuse(self, client: str, method: str | None, target: Target | None, status: int, stage: str, rule: str,
               reason: str, url: str | None = None, flow_id: str | None = None, event: str = DECISION,
               accept: Iterable[str] = (), session: str | None = None) -> Refusal:
        """A refusal made before any policy decision (malformed, over a bound, over a cap), or after one
        (a body refused while it is read): its one record. ``accept``: the request's Accept header values,
        when a head was read (they choose the body); ``session``: the id of the session the request was
        admitted under, which every line of its requests names."""
        verdict = Verdict(False, stage, rule, reason, session=session)
        record = self.recorder.record(event, flow_id or uuid.uuid4().hex, client, method, target, verdict)
        refusal = refusal_for(status, verdict, target, accept)
        record.status, record.bytes_down = status or None, refusal.size if status else 0
        if target is None and url:
            record.url = self.recorder.url(url)
        self.recorder.decision(record)
        if rule.startswith("limits.") or rule in ("shutdown", "audit"):
            self.metrics.refusal(rule)
        return refusal

    def internal_error(self, client: str, err: Exception, method: str | None = None, url: str | None = None,
                       flow_id: str | None = None, accept: Iterable[str] = (), status: int = 500) -> Refusal:
        """The refusal of a request, CONNECT or connection whose handling raised (a bug of ours), with its record:
        whatever failed, nothing goes on undecided (review round 23). ``status`` 0: closed without an answer."""
        return self.refuse(client, method, None, status, INTERNAL_STAGE, INTERNAL_ERROR,
                           f"egresswall could not handle this request: an internal error ({type(err).__name__}); it "
                           "is refused, and the proxy's log has the details", url=url, flow_id=flow_id, accept=accept)

    def connection_refused(self, client: str, status: int, rule: str, reason: str) -> None:
        """A connection ended by a bound before any request was whole (head too big, too slow, silent);
        status 0: closed without an answer."""
        self.refuse(client, None, None, status, LIMITS if rule.startswith("limits.") else "form", rule, reason)

    def response_closed(self, flow_id: str, client: str, method: str, target: Target | None, verdict: Verdict,
                        started: float, up: int, down: int, status: int | None, error: str | None,
                        charged: int = 0, charge: bool = True) -> None:
        """The exchange's closing record; its session is charged its bytes but the ``charged`` ones (a declared or
        chunked body, charged when it was admitted or read), unless ``charge`` is False (a WebSocket's, whose
        bytes were charged as they moved)."""
        if self.stopping_cut:
            error = STOP_CUT
        record = self.recorder.record(RESPONSE, flow_id, client, method, target, verdict)
        self.recorder.ended(record, started, up, down, error, status)
        if charge:
            self.sessions.count_bytes(verdict.session, max(0, up - charged), down)

    # ---- the audit log failing closed ----------------------------------------------------------------

    def audit_unwritable(self, target: Target | None = None, accept: Iterable[str] = ()) -> Refusal:
        """Fail closed: a request is let through only once its decision line is written. While the log
        cannot take lines, allowed requests are refused with 503, /readyz fails, and a probe tries a
        line every second (README, "Audit log and admin endpoint")."""
        self._start_audit_probe()
        self.metrics.refusal("audit")
        return refusal_for(503, Verdict(False, "audit", "audit", "the audit log cannot be written, and egresswall "
                                                                 "does not let through what it cannot record"),
                           target, accept)

    def _start_audit_probe(self) -> None:
        # Started by the failure itself, not by the next request: with /readyz failing, no traffic may
        # come to notice that the disk has room again.
        if self._audit_probe is None or self._audit_probe.done():
            with contextlib.suppress(RuntimeError):  # no event loop (a gate driven by hand)
                self._audit_probe = asyncio.get_running_loop().create_task(self._probe_audit())

    async def _probe_audit(self) -> None:
        while not self.audit.probe():
            await asyncio.sleep(1)


def plain_target(ask: HttpAsk) -> Target:
    """The target of a plain-HTTP request (not inside a tunnel) as both transports hand it over: scheme,
    host, port and path as the transport split them, read again by policy.hosts (HostFormError: refused)."""
    scheme = {"http": "ws", "https": "wss"}.get(ask.scheme, ask.scheme) if ask.websocket else ask.scheme
    _refuse_asterisk(ask.path)
    if ask.authority is not None:
        # Absolute form: the URL as the client sent it, read by the core as ``egresswall check`` reads it. The
        # transport's own split (mitmproxy reads port 0 as the scheme's default, and drops the brackets of an
        # IPv4 in them, as the fast path's head classifier does) never stands in for what was sent.
        return parse_url(f"{scheme}://{ask.authority}{ask.path}")
    if ask.host_header is not None and ask.path.startswith("/"):
        # Origin form: the Host header as sent ('[1.2.3.4]' is no IPv4, whatever mitmproxy's split of it says).
        return parse_origin_target(ask.host_header, scheme, ask.path)
    bracketed = f"[{ask.host}]" if ":" in ask.host else ask.host
    return parse_url(f"{scheme}://{bracketed}:{ask.port}{ask.path}")


def _refuse_asterisk(path: str) -> None:
    """"OPTIONS * HTTP/1.1" (or any target that is not a path): glued to a port it would read as one that is not
    decimal, and a path rule (which begins with '/') never matches it."""
    if path and not path.startswith("/"):
        raise HostFormError("asterisk", f"the request target {safe_text(path, 40)!r} is not a path (the asterisk "
                                        "form asks the server it is sent to about itself); egresswall forwards "
                                        "requests for a URL")


def sent_url(ask: HttpAsk) -> str:
    """What the client asked for, for the record of a request whose target the core refused."""
    host = ask.authority if ask.authority is not None else ask.host_header if ask.host_header is not None else ask.host
    return f"{ask.scheme}://{host}{ask.path}"


def refusal_for(status: int, verdict: Verdict, target: Target | None, accept: Iterable[str] = ()) -> Refusal:
    """The Refusal for a target (host and port named when there is one), JSON when ``accept`` prefers it:
    chosen here, before the record is written, so its ``bytes_down`` is the size of the body sent."""
    host, port = (target.host, target.port) if target is not None else (None, None)
    return Refusal(status, verdict, host, port, json=prefers_json(tuple(accept)))


def self_refusal(pinned: str, port: int, own: str, verdict: Verdict) -> Verdict:
    return Verdict(False, "address", "self", f"{pinned}:{port} is {own}; a request to the proxy itself is refused",
                   role=verdict.role, addresses=verdict.addresses)


def _unspecified(address: str) -> bool:
    """0.0.0.0 or :: in any spelling: a connect to it goes to this host itself."""
    try:
        return ipaddress.ip_address(address).is_unspecified
    except ValueError:
        return False
