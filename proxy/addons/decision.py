"""Decide every CONNECT and every request before an upstream socket opens; refuse before the body."""

from __future__ import annotations

import logging
import time
import uuid

from mitmproxy import http

from policy.wire import METHOD

from ..gate import Gate, HttpAsk, refusal_for
from ..http_hygiene import CONTROL_BYTE, OTHER_UPGRADE, WEBSOCKET, connect_content, override_headers, upgrade_kind
from ..mitm_patches import (
    FRAMING_REFUSED,
    SENT_AUTHORITY,
    connect_error_text,
    invalid_framing,
    refuse_before_body,
    several_hosts_reason,
)
from ..peers import peer_of
from ..refusals import Refusal, failed_connect, refusal_parts
from .connections import ConnectionTable
from .tunnel_watch import close_client

log = logging.getLogger("egresswall.decision")
VERDICT, TARGET, STARTED, FLOW_ID = "egresswall_verdict", "egresswall_target", "egresswall_started", "egresswall_id"
# The request body's bytes charged to its session before the exchange ended (declared at admission, or a chunked
# body once read): the closing record charges only what went beyond them (Gate.response_closed).
CHARGED = "egresswall_charged"
SESSION = "egresswall_session"  # the Session an allowed request was admitted under (a WebSocket is watched by it)
CONNECT_ANSWER = "egresswall_connect_answer"  # an allowed CONNECT's (target, role, Accept), should its connect fail


def to_response(refusal: Refusal) -> http.Response:
    status, headers, body = refusal_parts(refusal)
    return http.Response.make(status, body, [(k.encode(), v.encode("latin-1")) for k, v in headers])


def _names(request: http.Request) -> list[str]:
    """The request's header names as sent, read off its fields in one pass: mitmproxy's ``Headers.keys()`` costs
    the square of the header count (0.7 s for 3,000 headers within max_header_bytes; review round 23)."""
    return [name.decode("latin-1") for name, _ in request.headers.fields]


def accept_of(flow: http.HTTPFlow) -> tuple[str, ...]:
    """The request's Accept header values, which choose a refusal's body (proxy/accept.py)."""
    return tuple(flow.request.headers.get_all("accept"))


def credentials_of(flow: http.HTTPFlow) -> tuple[str, ...]:
    """The Proxy-Authorization header values (a session's id:secret); hop_by_hop.py strips them before forwarding."""
    return tuple(flow.request.headers.get_all("proxy-authorization"))


class DecisionAddon:
    def __init__(self, gate: Gate, table: ConnectionTable) -> None:
        self.gate, self.table = gate, table

    async def http_connect(self, flow: http.HTTPFlow) -> None:
        try:
            await self._decide_connect(flow)
        except Exception as err:  # noqa: BLE001 - a bug of ours: the CONNECT must not go on undecided
            flow.response = self._internal_error(flow, err)

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        try:
            await self._decide_request(flow)
        except Exception as err:  # noqa: BLE001 - a bug of ours: the request must not go on undecided
            refuse_before_body(flow, self._internal_error(flow, err))

    def _internal_error(self, flow: http.HTTPFlow, err: Exception) -> http.Response:
        """The answer to a request or CONNECT whose decision raised: refused 500 with its record. mitmproxy logs an
        addon's error and carries the flow on, where a connect nobody decided is decided by the policy alone
        (pinning.py), without the session or the form checks (review round 23: a session record the store could
        not read let requests through undecided)."""
        log.exception("the decision of %s %s failed; refused", flow.request.method, flow.request.pretty_url[:200])
        try:
            return to_response(self.gate.internal_error(peer_of(flow.client_conn.peername), err, flow.request.method,
                                                        flow.request.pretty_url, flow.metadata.get(FLOW_ID) or flow.id,
                                                        accept_of(flow)))
        except Exception:  # noqa: BLE001 - not even its record could be made: refused all the same
            log.exception("the refusal of a request whose decision failed could not be recorded")
            return http.Response.make(500, b"egresswall: internal error; refused\n",
                                       {"Content-Type": "text/plain", "Connection": "close"})

    async def _decide_connect(self, flow: http.HTTPFlow) -> None:
        authority = (flow.request.data.authority.decode("latin-1") if flow.request.data.authority
                     else f"{flow.request.host}:{flow.request.port}")
        headers = flow.request.headers
        outcome = await self.gate.decide_connect(peer_of(flow.client_conn.peername), authority, flow.id,
                                                 accept_of(flow), credentials_of(flow),
                                                 connect_content(headers.get_all("transfer-encoding"),
                                                                 headers.get_all("content-length")))
        if outcome.refusal is not None:
            flow.response = to_response(outcome.refusal)
            return
        tunnel = outcome.tunnel
        assert tunnel is not None and tunnel.verdict.pinned is not None
        flow.metadata[CONNECT_ANSWER] = (tunnel.target, tunnel.verdict.role, accept_of(flow))
        tunnel.client_conn_id = flow.client_conn.id
        if not (tunnel.intercept or tunnel.http_inside):
            # TLS passed through: until the relay's own cut, a session's end (or budget) reaches it already. One
            # that carries requests egresswall reads stays open: each of them gets a refusal it can read.
            client_id = flow.client_conn.id
            tunnel.cut = lambda: close_client(client_id)
        # From here the client connection is the tunnel: a plain request's pin on it (pin_for prefers those)
        # must not steer the tunnel's connects away from the address its CONNECT was decided on.
        self.table.request_pins.pop(flow.client_conn.id, None)
        self.table.pins[(flow.client_conn.id, tunnel.target.host, tunnel.target.port)] = tunnel.verdict.pinned
        self.table.tunnels[flow.server_conn.id] = tunnel
        self.table.tunneled.add(flow.client_conn.id)

    def http_connect_error(self, flow: http.HTTPFlow) -> None:
        """The allowed CONNECT's connect failed (its tunnel's closing line is pinning.py's): answered 502 as the
        front answers it (``Front._connect_failed``), not with mitmproxy's "Cannot connect" text."""
        if CONNECT_ANSWER not in flow.metadata or not flow.server_conn.error:
            return  # refused before any connect (mitmproxy calls this for every CONNECT not answered 2xx)
        target, role, accept = flow.metadata[CONNECT_ANSWER]
        reason = connect_error_text(flow.server_conn.error)
        verdict = failed_connect(reason, role, self.gate.policy.upstream is not None)
        flow.response = to_response(refusal_for(502, verdict, target, accept))

    def http_connected(self, flow: http.HTTPFlow) -> None:
        """The CONNECT was answered 2xx: a connect that fails from now on fails inside an open tunnel."""
        tunnel = self.table.tunnels.get(flow.server_conn.id)
        if tunnel is not None:
            tunnel.established = True

    async def _decide_request(self, flow: http.HTTPFlow) -> None:
        flow.request.egresswall_seen = True  # proxy/mitm_patches.py: an error answer for it is already recorded
        flow.metadata[FLOW_ID] = flow.id or uuid.uuid4().hex
        flow.metadata[STARTED] = time.monotonic()
        client = peer_of(flow.client_conn.peername)
        request = flow.request
        tunnel = self.table.tunnels.get(flow.server_conn.id)
        upgrade = upgrade_kind(request.headers.get_all("upgrade"))
        problem = _form_problem(flow, upgrade)
        if problem is not None:
            # Refused for its form before any decision. Its record names the session it came under, as every line
            # of a session's requests does: inside a tunnel the CONNECT's, else the one its credentials prove.
            status, rule, reason = problem
            session = await self.gate.session_named(client, credentials_of(flow), tunnel)
            refusal = self.gate.refuse(client, request.method, None, status, "form", rule, reason,
                                       url=request.pretty_url, flow_id=flow.metadata[FLOW_ID], accept=accept_of(flow),
                                       session=session)
            if flow.error is None:  # (framing mitmproxy refused itself has its answer and its error already)
                refuse_before_body(flow, to_response(refusal))
            return
        length = request.headers.get("content-length")
        ask = HttpAsk(client=client, method=request.method, scheme=request.scheme, host=request.data.host,
                      port=request.data.port, path=request.path, host_header=request.headers.get("host"),
                      websocket=upgrade == WEBSOCKET,
                      content_length=int(length) if length is not None and length.isdigit() else None,
                      chunked="transfer-encoding" in request.headers,
                      accept=accept_of(flow), authority=sent_authority(request),
                      credentials=credentials_of(flow), overrides=override_headers(_names(request)),
                      flow_id=flow.metadata[FLOW_ID], head_size=_head_size(request))
        outcome = await self.gate.decide_request(ask, tunnel)
        if outcome.refusal is not None:
            refuse_before_body(flow, to_response(outcome.refusal))
            return
        target = outcome.target
        assert target is not None
        if outcome.verdict.pinned and tunnel is None:
            self.table.request_pins[flow.client_conn.id] = (target.host, target.port, outcome.verdict.pinned)
        if tunnel is not None:
            request.authority = ""  # forwarded in origin form: the tunnel's host is the only one it can name
        flow.metadata[VERDICT] = outcome.verdict
        flow.metadata[TARGET] = target
        if outcome.session is not None:
            flow.metadata[SESSION] = outcome.session
            flow.metadata[CHARGED] = ask.content_length or 0  # with the head, at admission (Gate._session_charge)
        # Should mitmproxy answer it itself (a failed connect: proxy/mitm_patches.py ``_server_send``), the
        # answer names the target and takes the client's Accept, as every other refusal does.
        request.egresswall_answer_context = (target, outcome.verdict.role, accept_of(flow))


def _form_problem(flow: http.HTTPFlow, upgrade: str) -> tuple[int, str, str] | None:
    """(status, rule, reason) of a request refused for its form before any decision, or None. ``upgrade``: what
    its Upgrade headers ask for (``upgrade_kind``)."""
    request = flow.request
    malformed = _malformed(flow)
    if malformed is not None:
        # Framing mitmproxy already refused (it answers 400 itself), or header values it would forward as they
        # are: the decision record says refused, with mitmproxy's or our reason.
        return 400, *malformed
    method = request.data.method
    if not METHOD.fullmatch(method.decode("latin-1")):
        # mitmproxy reads any bytes but whitespace as a method and forwards them as they came, while the record
        # (and a methods: rule) read them decoded: "DELETE\x00" passed a rule denying DELETE (review round 23).
        return 400, "http:malformed", (f"the request method {method[:40]!r} is not an HTTP token (RFC 9110 5.6.2: "
                                       "letters, digits and !#$%&'*+-.^_`|~)")
    if request.http_version not in ("HTTP/1.0", "HTTP/1.1"):
        # mitmproxy reads any HTTP/d.d line: HTTP/1.2 and HTTP/2.0 requests without a Host reached the origin
        # without one (the Host this path adds is for 1.0 and 1.1), and the fast path hands such lines here.
        # (HTTP/2 itself is never offered to a client: LimitsOptions.)
        return 505, "http:version", (f"the request line says {request.http_version[:20]!r}; egresswall reads "
                                     "HTTP/1.0 and HTTP/1.1 requests here")
    if upgrade == OTHER_UPGRADE:
        values = ", ".join(request.headers.get_all("upgrade"))[:100]
        return 403, "http:upgrade", (f"the request asks to upgrade to {values!r}; egresswall relays only WebSocket "
                                     "upgrades (one Upgrade header naming websocket)")
    handshake = websocket_handshake_problem(request) if upgrade == WEBSOCKET else None
    if handshake is not None:
        return 400, "http:websocket-handshake", handshake
    hosts = request.headers.get_all("host")
    if len(hosts) > 1:  # beside an absolute URI or inside a tunnel (origin form outside: mitm_patches)
        return 400, "form:host-header", several_hosts_reason(hosts)
    return None


def sent_authority(request: http.Request) -> str | None:
    """The request target's authority as the client sent it (absolute form), or None (origin form): noted by
    proxy/mitm_patches.py before mitmproxy's regular mode empties it to forward origin form."""
    return getattr(request, SENT_AUTHORITY, request.data.authority.decode("latin-1")) or None


def _head_size(request: http.Request) -> int:
    """The request head's bytes as the client sent them, about (mitmproxy keeps no raw head): its line with the
    target as sent, each header as ``name: value``, the line ends."""
    authority = sent_authority(request)
    target = f"{request.scheme}://{authority}{request.path}" if authority else request.path
    line = len(request.method) + len(target) + len(request.http_version) + 4
    return line + sum(len(name) + len(value) + 4 for name, value in request.headers.fields) + 2


def websocket_handshake_problem(request: http.Request) -> str | None:
    """Why a WebSocket upgrade request cannot be relayed as one, or None (RFC 6455 4.1: a GET, without a body,
    with Sec-WebSocket-Version 13). With a body, mitmproxy framed the WebSocket's bytes after the 101 as more of
    that body (chunks of a chunked one): the origin read a frame egresswall wrote as a chunk header, or body bytes
    after its early 101 as WebSocket data; with another version mitmproxy relays the 101 and then cuts the
    connection, which was recorded as a WebSocket answered (review round 20)."""
    if request.method != "GET":
        return f"a WebSocket handshake is a GET (RFC 6455 4.1); this one is a {request.method[:20]}"
    if "transfer-encoding" in request.headers or request.headers.get("content-length", "0").strip() != "0":
        return "a WebSocket handshake carries no body (RFC 6455 4.1)"
    if request.headers.get_all("sec-websocket-version") != ["13"]:
        return "a WebSocket handshake carries one Sec-WebSocket-Version: 13 (RFC 6455 4.1), the one egresswall relays"
    return None


def _malformed(flow: http.HTTPFlow) -> tuple[str, str] | None:
    """(rule, reason) for a request mitmproxy already refused as malformed, or whose header values hold a control
    byte other than HTAB (RFC 9110, 5.5): mitmproxy keeps an obs-fold as "\r\n " inside the value and passes a bare
    CR on, which an upstream may read as the start of another header, and the other control bytes as they are, as
    the fast path's head grammar does not (a response with one is refused 502 on both paths); None for a
    well-formed one."""
    if flow.error is not None:
        verdict = invalid_framing(getattr(flow.request, FRAMING_REFUSED, None) or flow.error.msg)
        return verdict.rule, verdict.reason
    for name, value in flow.request.headers.fields:
        bad = CONTROL_BYTE.search(value)
        if bad is not None:
            byte = bad.group()[0]
            kind = ("a line folded onto the next (obs-fold)" if b"\n" in value else "a bare CR" if byte == 0x0D
                    else "a NUL" if byte == 0 else f"the control byte 0x{byte:02x}")
            return "http:header-value", (f"the header {name.decode('latin-1')[:60]!r} holds {kind}; egresswall does "
                                         "not forward headers an upstream may split or read otherwise (RFC 9110 5.5: "
                                         "no control byte but HTAB)")
    return None
