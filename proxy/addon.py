"""The mitmproxy addon: every plain-HTTP request, CONNECT tunnel and WebSocket upgrade is decided
by ``policy`` before an upstream socket opens, and the upstream socket goes to the checked address.

Hooks, in the order a request meets them:

* ``client_connected``     count connections per client (caps are enforced at the first request);
* ``http_connect``         decide a CONNECT: refuse with 403 before any tunnel, or remember the pin;
* ``requestheaders``       decide a plain-HTTP request (or a request inside a tunnel) before its body;
* ``server_connect``       the guard no path can skip: connect to the pinned, re-checked address only;
* ``server_connected``     put the hostname back, so keep-alive reuse (which compares it) still works;
* ``next_layer``           inside a passed-through tunnel: check the ClientHello's SNI, then relay bytes;
* ``responseheaders``      strip headers only egresswall may set, count response bytes;
* ``response``/``error``   one audit line per finished response.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import re
import socket
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from mitmproxy import connection, http
from mitmproxy.net.tls import starts_like_tls_record
from mitmproxy.proxy import layer as mlayer
from mitmproxy.proxy.layers.tls import parse_client_hello
from mitmproxy.proxy.server_hooks import ServerConnectionHookData
from mitmproxy.tls import ClientHelloData

from policy.decision import Request, Verdict, refuse_form
from policy.hosts import HostFormError, Target, host_header_agrees, normalise_host, parse_authority, parse_url
from policy.model import Policy
from policy.resolver import DnsResolver, Resolver, resolve_and_decide

from . import bounds, early_refusal, refusals
from .audit import AuditLog
from .metrics import Metrics
from .reload import PolicyHolder
from .tunnels import CountedRelay, RefuseTls

log = logging.getLogger("egresswall")
early_refusal.install()
bounds.install()


@dataclass
class Tunnel:
    """A CONNECT that was allowed: what it may carry and where it was pinned."""

    id: str
    target: Target
    verdict: Verdict
    client: str
    intercept: bool
    started: float = field(default_factory=time.time)
    decided_layer: bool = False
    client_conn_id: str = ""  # mitmproxy's client connection, so a tunnel never outlives it


class EgressWall:
    def __init__(self, holder: PolicyHolder, audit: AuditLog, metrics: Metrics | None = None,
                 resolver: Resolver | None = None, share: int = 1) -> None:
        self.holder = holder
        self.share = share  # with N workers on one port, each enforces 1/N of the connection caps
        self.audit = audit
        self.metrics = metrics or Metrics()
        self._resolver = resolver
        self._resolver_for: Policy | None = None
        self.self_endpoints: set[tuple[str, int]] = set()  # (ip or "*", port) the proxy itself listens on
        self.draining = False
        self.pins: dict[tuple[str, str, int], str] = {}  # (client id, host, port) -> checked address
        self.restore: dict[str, tuple[str, int]] = {}  # server id -> (host, port) to put back
        self.tunnels: dict[str, Tunnel] = {}  # server-connection id of a CONNECT -> its tunnel
        self.per_client: Counter[str] = Counter()
        self.open_connections = 0
        self.metrics.policy_loaded = 1
        # proxy/bounds.py reads the limits in force and reports refusals made before any flow exists.
        bounds.current_limits = lambda: self.holder.policy.limits
        bounds.on_refusal = self._audit_connection_refusal
        self._audit_probe: asyncio.Task | None = None

    # ---- policy and resolver ------------------------------------------------------------------

    @property
    def policy(self) -> Policy:
        return self.holder.policy

    def resolver(self, policy: Policy) -> Resolver:
        """One resolver per policy's resolver settings; a reload that changes them gets a new one."""
        given_by_caller = self._resolver_for is None
        if self._resolver is not None and (given_by_caller or self._resolver_for.resolver == policy.resolver):
            return self._resolver
        self._resolver = DnsResolver.for_policy(policy)
        self._resolver_for = policy
        return self._resolver

    async def decide(self, policy: Policy, request: Request) -> Verdict:
        started = time.monotonic()
        verdict, resolution = await resolve_and_decide(policy, request, self.resolver(policy))
        if resolution is not None or verdict.stage == "resolve":
            self.metrics.observe_dns(time.monotonic() - started)
        if verdict.stage == "resolve" and verdict.rule.startswith("dns:"):
            self.metrics.dns_errors[verdict.rule[4:]] += 1
        if verdict.allowed and verdict.pinned and self._is_self(verdict.pinned, request.target.port):
            verdict = Verdict(False, "address", "self", f"{verdict.pinned}:{request.target.port} is egresswall's own "
                                                        "listener; a request to the proxy itself is refused",
                              role=verdict.role, addresses=verdict.addresses)
        return verdict

    def _is_self(self, address: str, port: int) -> bool:
        if (address, port) in self.self_endpoints:
            return True
        if ("*", port) in self.self_endpoints:
            return _is_local_address(address)
        return False

    # ---- connections and caps -----------------------------------------------------------------

    def client_connected(self, client: connection.Client) -> None:
        self.open_connections += 1
        self.per_client[_client_ip(client)] += 1  # one key per client, whatever the listener's family
        self.metrics.open_connections = self.open_connections

    def client_disconnected(self, client: connection.Client) -> None:
        bounds.idle_closed.discard(client.id)
        self.open_connections -= 1
        ip = _client_ip(client)
        self.per_client[ip] -= 1
        if self.per_client[ip] <= 0:
            del self.per_client[ip]
        self.metrics.open_connections = self.open_connections
        for key in [k for k in self.pins if k[0] == client.id]:
            del self.pins[key]
        # Whatever ended this connection, its tunnels end with it: each gets its closing line, and the
        # open-tunnel gauge cannot drift (a relay that already reported is gone from the table).
        for server_id in [sid for sid, t in self.tunnels.items() if t.client_conn_id == client.id]:
            self._tunnel_done(server_id, 0, 0, "the client connection closed")

    def _cap_refusal(self, policy: Policy, client: connection.Client) -> http.Response | None:
        limits = policy.limits
        max_total = -(-limits.max_connections // self.share)
        max_per_client = -(-limits.max_connections_per_client // self.share)
        if self.draining:
            return self._refuse_other(503, "shutdown", "egresswall is shutting down; retry on another instance")
        if self.open_connections > max_total:
            return self._refuse_other(503, "limits.max_connections",
                                      f"egresswall has {self.open_connections} open connections, more than its limit "
                                      f"of {max_total}" + _per_worker(self.share, limits.max_connections))
        ip = _client_ip(client)
        count = self.per_client[ip]
        if count > max_per_client:
            return self._refuse_other(429, "limits.max_connections_per_client",
                                      f"client {ip} has {count} open connections, more than its "
                                      f"limit of {max_per_client}"
                                      + _per_worker(self.share, limits.max_connections_per_client))
        return None

    def _refuse_other(self, status: int, rule: str, reason: str) -> http.Response:
        self.metrics.refusals[rule] += 1
        return refusals.refusal(status, rule, reason)

    # ---- CONNECT ------------------------------------------------------------------------------

    async def http_connect(self, flow: http.HTTPFlow) -> None:
        policy = self.policy
        flow_id = _flow_id(flow)
        cap = self._cap_refusal(policy, flow.client_conn)
        if cap is not None:
            flow.response = cap
            self._audit_decision(flow_id, flow, policy, None, "CONNECT", cap_response=cap)
            return
        authority = flow.request.data.authority.decode("latin-1") if flow.request.data.authority else (
            f"{flow.request.host}:{flow.request.port}")
        try:
            target = parse_authority(authority, "https")
        except HostFormError as err:
            verdict = refuse_form(err)
            target = None
        else:
            intercept = policy.intercepts(target.host)
            request = Request(target, "CONNECT", _client_ip(flow.client_conn), tunnel=True)
            verdict = await self.decide(policy, request)
        recorded = self._audit_decision(flow_id, flow, policy, target, "CONNECT", verdict)
        if not verdict.allowed:
            flow.response = refusals.from_verdict(verdict)
            return
        if not (recorded and self.audit.healthy):
            flow.response = self._audit_unwritable()
            return
        assert target is not None and verdict.pinned is not None
        self.pins[(flow.client_conn.id, target.host, target.port)] = verdict.pinned
        self.tunnels[flow.server_conn.id] = Tunnel(flow_id, target, verdict, _client_ip(flow.client_conn), intercept,
                                                   client_conn_id=flow.client_conn.id)
        self.metrics.open_tunnels += 1

    def next_layer(self, nextlayer: mlayer.NextLayer) -> None:
        """Inside an allowed tunnel that is not intercepted: check SNI, then relay bytes untouched."""
        context = nextlayer.context
        tunnel = self.tunnels.get(context.server.id)
        if tunnel is None or tunnel.intercept or tunnel.decided_layer:
            return
        data = nextlayer.data_client()
        if not starts_like_tls_record(data):
            # Not TLS (ws:// arrives as CONNECT host:80 and speaks HTTP): mitmproxy parses it, and
            # requestheaders checks each request inside against the tunnel's host.
            if data:
                tunnel.decided_layer = True
            return
        try:
            hello = parse_client_hello(data)
        except ValueError:
            hello = None
            sni_problem = "the tunnel's first bytes look like TLS but are not a valid ClientHello"
        else:
            if hello is None:
                nextlayer.layer = None  # wait for the rest of the ClientHello
                return
            sni_problem = self._sni_problem(tunnel, hello.sni)
        tunnel.decided_layer = True
        if sni_problem:
            self._audit_refused_tunnel(tunnel, "tls:sni", sni_problem)
            self._close_tunnel(context.server.id)
            nextlayer.layer = RefuseTls(context)
            return
        nextlayer.layer = CountedRelay(context, lambda up, down, err: self._tunnel_done(context.server.id, up, down,
                                                                                        err))

    def tls_clienthello(self, data: ClientHelloData) -> None:
        """Intercepted tunnels: the SNI must name the CONNECT host here too."""
        tunnel = self.tunnels.get(data.context.server.id)
        if tunnel is None:
            return
        problem = self._sni_problem(tunnel, data.client_hello.sni)
        if problem:
            self._audit_refused_tunnel(tunnel, "tls:sni", problem)
            data.context.client.error = problem  # mitmproxy closes the connection
            data.ignore_connection = False

    def _sni_problem(self, tunnel: Tunnel, sni: str | None) -> str | None:
        if sni is None:
            return None  # no SNI: the pinned address was checked, there is nothing to front
        try:
            host, _ = normalise_host(sni)
        except HostFormError as err:
            return f"TLS SNI {sni!r} is not a valid host name: {err.reason}"
        if host != tunnel.target.host:
            return f"TLS SNI {host} does not match the CONNECT host {tunnel.target.host}"
        return None

    def _tunnel_done(self, server_id: str, up: int, down: int, error: str | None) -> None:
        tunnel = self._close_tunnel(server_id)
        if tunnel is not None:
            self.tunnel_line(tunnel, up, down, error)

    def tunnel_line(self, tunnel: Tunnel, up: int, down: int, error: str | None) -> None:
        """The closing line of a tunnel, on either tunnel path, with its bytes each way."""
        self.metrics.bytes_up += up
        self.metrics.bytes_down += down
        record = self._base_record("tunnel", tunnel.id, tunnel.client, "CONNECT", tunnel.target, tunnel.verdict)
        record.update(status=200, bytes_up=up, bytes_down=down, duration=round(time.time() - tunnel.started, 6),
                      error=error)
        self._write(record)

    def _close_tunnel(self, server_id: str) -> Tunnel | None:
        tunnel = self.tunnels.pop(server_id, None)
        if tunnel is not None:
            self.metrics.open_tunnels -= 1
        return tunnel

    def server_disconnected(self, data: ServerConnectionHookData) -> None:
        # A tunnel that never reached the relay (refused SNI, intercepted, HTTP inside) ends here.
        tunnel = self.tunnels.get(data.server.id)
        if tunnel is not None:
            self._tunnel_done(data.server.id, 0, 0, None)

    # ---- plain HTTP and requests inside tunnels ----------------------------------------------

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        policy = self.policy
        flow_id = _flow_id(flow)
        flow.metadata["egresswall_id"] = flow_id
        flow.metadata["egresswall_started"] = time.time()
        tunnel = self.tunnels.get(flow.server_conn.id)
        cap = None if tunnel else self._cap_refusal(policy, flow.client_conn)
        if cap is not None:
            early_refusal.refuse_before_body(flow, cap)
            self._audit_decision(flow_id, flow, policy, None, flow.request.method, cap_response=cap)
            return
        malformed = _malformed(flow)
        if malformed is not None:
            # Framing mitmproxy already refused (it answers 400 itself), or header values it would
            # forward as they are: the decision line says refused, with mitmproxy's or our reason.
            verdict = Verdict(False, "form", *malformed)
            self._audit_decision(flow_id, flow, policy, None, flow.request.method, verdict, status=400)
            if flow.error is None:
                early_refusal.refuse_before_body(flow, refusals.refusal(400, verdict.rule, verdict.reason))
            return
        websocket = flow.request.headers.get("upgrade", "").lower() == "websocket"
        verdict, target = await self._decide_request(policy, flow, tunnel, websocket)
        recorded = self._audit_decision(flow_id, flow, policy, target, flow.request.method, verdict)
        if not verdict.allowed:
            early_refusal.refuse_before_body(flow, refusals.from_verdict(verdict))
            return
        if not (recorded and self.audit.healthy):
            early_refusal.refuse_before_body(flow, self._audit_unwritable())
            return
        if verdict.pinned and target is not None and tunnel is None:
            self.pins[(flow.client_conn.id, target.host, target.port)] = verdict.pinned
        flow.metadata["egresswall_verdict"] = verdict
        flow.metadata["egresswall_target"] = target
        self._limit_request_body(flow, policy)

    async def _decide_request(self, policy: Policy, flow: http.HTTPFlow, tunnel: Tunnel | None,
                              websocket: bool) -> tuple[Verdict, Target | None]:
        request = flow.request
        host_header = request.headers.get("host")
        try:
            if tunnel is not None:
                scheme = ("wss" if websocket else "https") if request.scheme == "https" else (
                    "ws" if websocket else "http")
                target = Target(scheme, tunnel.target.host, tunnel.target.port, request.path, tunnel.target.ip)
            else:
                scheme = {"http": "ws", "https": "wss"}.get(request.scheme, request.scheme) if websocket else (
                    request.scheme)
                host = request.data.host
                bracketed = f"[{host}]" if ":" in host else host
                target = parse_url(f"{scheme}://{bracketed}:{request.data.port}{request.path}")
        except HostFormError as err:
            return refuse_form(err), None
        if host_header is not None and not host_header_agrees(target, host_header):
            return Verdict(False, "form", "form:host-header",
                           f"the Host header {host_header[:100]!r} does not agree with the target {target.authority}"
                           ), target
        if tunnel is not None and not tunnel.intercept and websocket and not tunnel.verdict.allowed:
            return tunnel.verdict, target
        decision = Request(target, request.method, _client_ip(flow.client_conn), tunnel=False, websocket=websocket)
        return await self.decide(policy, decision), target

    def _limit_request_body(self, flow: http.HTTPFlow, policy: Policy) -> None:
        limit = policy.limits.max_request_body
        length = flow.request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            early_refusal.refuse_before_body(flow, self._refuse_other(413, "limits.max_request_body",
                                               f"the request body of {length} bytes is over the limit of {limit}"))
            return
        if "chunked" in flow.request.headers.get("transfer-encoding", "").lower():
            seen = 0

            def count(chunk: bytes) -> bytes:
                nonlocal seen
                seen += len(chunk)
                if seen > limit:
                    flow.kill()
                    self.metrics.refusals["limits.max_request_body"] += 1
                    return b""
                return chunk

            flow.request.stream = count

    # ---- the guard at connect time ------------------------------------------------------------

    async def server_connect(self, data: ServerConnectionHookData) -> None:
        if data.server.address is None:
            return
        host, port = data.server.address[0], data.server.address[1]
        policy = self.policy
        try:
            key_host, _ = normalise_host(host)
        except HostFormError as err:
            data.server.error = f"egresswall: refused connect to {host!r}: {err.reason}"
            return
        pinned = self.pins.get((data.client.id, key_host, port))
        if pinned is None:
            # No decision prepared this connect (a path the request hooks did not see): decide now.
            try:
                target = parse_authority(f"[{key_host}]:{port}" if ":" in key_host else f"{key_host}:{port}")
            except HostFormError as err:
                data.server.error = f"egresswall: {err.reason}"
                return
            verdict = await self.decide(policy, Request(target, "CONNECT", _client_ip(data.client), tunnel=True))
            if not verdict.allowed or verdict.pinned is None:
                data.server.error = f"egresswall: {verdict.reason}"
                return
            pinned = verdict.pinned
        checked = policy.addresses.check(pinned)  # the policy may have been reloaded since the decision
        if not checked.allowed or self._is_self(pinned, port):
            data.server.error = f"egresswall: refused connect to {pinned}: {checked.reason}"
            return
        self.restore[data.server.id] = (host, port)
        data.server.address = (pinned, port)

    def server_connected(self, data: ServerConnectionHookData) -> None:
        original = self.restore.pop(data.server.id, None)
        if original is not None:
            # mitmproxy matches a reusable connection by (hostname, port); put the name back or every
            # keep-alive request opens a new connection. Server.__setattr__ refuses changes on an open
            # connection, so write the field directly: the socket stays connected to the checked IP
            # (``peername``), only the label used for reuse changes.
            data.server.__dict__["address"] = original

    def server_connect_error(self, data: ServerConnectionHookData) -> None:
        original = self.restore.pop(data.server.id, None)
        if original is not None:
            data.server.address = original
        if data.server.id in self.tunnels:  # the tunnel's connect failed: it ends here, with the reason
            self._tunnel_done(data.server.id, 0, 0, f"connect failed: {data.server.error or 'unknown error'}")

    # ---- responses ----------------------------------------------------------------------------

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is None or "egresswall_verdict" not in flow.metadata:
            return  # our own refusal, not an upstream response
        for name in [n for n in flow.response.headers if n.lower().startswith(refusals.OWN_HEADER_PREFIX)]:
            del flow.response.headers[name]
        counted = {"bytes": 0}
        flow.metadata["egresswall_down"] = counted

        def count(chunk: bytes) -> bytes:
            counted["bytes"] += len(chunk)
            return chunk

        flow.response.stream = count

    def response(self, flow: http.HTTPFlow) -> None:
        self._audit_end(flow, None)

    def error(self, flow: http.HTTPFlow) -> None:
        self._audit_end(flow, flow.error.msg if flow.error else "error")

    def _audit_end(self, flow: http.HTTPFlow, error: str | None) -> None:
        verdict: Verdict | None = flow.metadata.get("egresswall_verdict")
        if verdict is None or flow.metadata.get("egresswall_ended"):
            return  # refused (its decision line says so) or already logged
        flow.metadata["egresswall_ended"] = True
        if flow.client_conn.id in bounds.idle_closed and flow.response is None:
            # mitmproxy reports its own idle timeout as "Client disconnected.": say what happened.
            error = (f"nothing moved for limits.idle_timeout ({self.policy.limits.idle_timeout:g}s): the upstream "
                     "sent no response, and egresswall closed the connection")
        target = flow.metadata.get("egresswall_target")
        down = flow.metadata.get("egresswall_down", {}).get("bytes", 0)
        up = len(flow.request.raw_content or b"")
        self.metrics.bytes_up += up
        self.metrics.bytes_down += down
        record = self._base_record("response", flow.metadata["egresswall_id"], _client_ip(flow.client_conn),
                                   flow.request.method, target, verdict)
        record.update(status=flow.response.status_code if flow.response else None, bytes_up=up, bytes_down=down,
                      duration=round(time.time() - flow.metadata.get("egresswall_started", time.time()), 6),
                      error=error)
        self._write(record)

    # ---- audit --------------------------------------------------------------------------------

    def _audit_decision(self, flow_id: str, flow: http.HTTPFlow, policy: Policy, target: Target | None, method: str,
                        verdict: Verdict | None = None, cap_response: http.Response | None = None,
                        status: int | None = None) -> bool:
        client = _client_ip(flow.client_conn)
        if verdict is None:
            assert cap_response is not None
            verdict = Verdict(False, "limits", cap_response.headers[refusals.RULE_HEADER],
                              cap_response.headers[refusals.REASON_HEADER])
        record = self._base_record("decision", flow_id, client, method, target, verdict)
        if target is None:
            record["url"] = _safe_text(flow.request.pretty_url if method != "CONNECT" else
                                       (flow.request.data.authority or b"").decode("latin-1"))
        record["status"] = status or (cap_response.status_code if cap_response else (None if verdict.allowed else 403))
        verdict_word = "report" if verdict.report_only else ("allow" if verdict.allowed else "refuse")
        self.metrics.decisions[(verdict_word, verdict.rule)] += 1
        return self._write(record)

    def _audit_connection_refusal(self, conn: connection.Connection, status: int, rule: str, reason: str) -> None:
        """A refusal proxy/bounds.py made before any flow existed (head too big, too slow, unparseable)."""
        ip = conn.peername[0] if conn.peername else ""
        client = ip[7:] if ip.startswith("::ffff:") and "." in ip else ip
        verdict = Verdict(False, "limits" if rule.startswith("limits.") else "form", rule, reason)
        record = self._base_record("decision", uuid.uuid4().hex, client, None, None, verdict)
        record["status"] = status
        self.metrics.decisions[("refuse", rule)] += 1
        self.metrics.refusals[rule] += 1
        self._write(record)

    def _audit_unwritable(self) -> http.Response:
        """Fail closed: a request is let through only once its decision line is written. While the log
        cannot take lines, allowed requests are refused with 503, /readyz fails, and a probe tries a
        line every second (README, "Audit log and admin endpoint")."""
        self._start_audit_probe()
        return self._refuse_other(503, "audit", "the audit log cannot be written, and egresswall does not let "
                                                "through what it cannot record")

    def _start_audit_probe(self) -> None:
        # Started by the failure itself, not by the next request: with /readyz failing, no traffic may
        # come to notice that the disk has room again.
        if self._audit_probe is None or self._audit_probe.done():
            with contextlib.suppress(RuntimeError):  # no event loop (an addon driven by hand)
                self._audit_probe = asyncio.get_running_loop().create_task(self._probe_audit())

    async def _probe_audit(self) -> None:
        while not self.audit.probe():
            await asyncio.sleep(1)

    def _audit_refused_tunnel(self, tunnel: Tunnel, rule: str, reason: str) -> None:
        verdict = Verdict(False, "tls", rule, reason, addresses=tunnel.verdict.addresses)
        record = self._base_record("decision", tunnel.id + "-tls", tunnel.client, "CONNECT", tunnel.target, verdict)
        record["status"] = None
        self.metrics.decisions[("refuse", rule)] += 1
        self._write(record)

    def _base_record(self, event: str, flow_id: str, client: str, method: str, target: Target | None,
                     verdict: Verdict) -> dict[str, Any]:
        policy = self.policy
        path = None
        if target is not None and target.path:
            path = target.path if policy.log_query_strings else target.path.split("?", 1)[0]
        return {
            "time": round(time.time(), 6), "event": event, "id": flow_id, "client": client, "role": verdict.role,
            "method": method, "scheme": target.scheme if target else None, "host": target.host if target else None,
            "port": target.port if target else None, "path": path, "addresses": list(verdict.addresses),
            "connect": verdict.pinned, "verdict": "report" if verdict.report_only else (
                "allow" if verdict.allowed else "refuse"),
            "stage": verdict.stage, "rule": verdict.rule, "reason": verdict.reason, "mode": policy.mode,
        }

    def _write(self, record: dict[str, Any]) -> bool:
        if not self.audit.write(record):
            self.metrics.audit_failures += 1
            self._start_audit_probe()
            return False
        return True


def _per_worker(share: int, limit: int) -> str:
    return f" (this worker's share of {limit} over {share} workers)" if share > 1 else ""


# Bytes a header value may not carry (RFC 9110, 5.5): mitmproxy keeps an obs-fold as "\r\n " inside the
# value and passes a bare CR on, and an upstream may read either as the start of another header.
_BAD_VALUE_BYTES = re.compile(rb"[\r\n\x00]")


def _malformed(flow: http.HTTPFlow) -> tuple[str, str] | None:
    """(rule, reason) for a request mitmproxy already refused as malformed, or whose header values
    hold CR, LF (an obs-fold) or NUL; None for a well-formed one."""
    if flow.error is not None:
        return "http:invalid-request", _safe_text(f"mitmproxy refused the request: {flow.error.msg}", 400)
    for name, value in flow.request.headers.fields:
        if _BAD_VALUE_BYTES.search(value):
            kind = "a line folded onto the next (obs-fold)" if b"\n" in value else "a bare CR or NUL"
            return "http:header-value", _safe_text(f"the header {name.decode('latin-1')!r} holds {kind}; "
                                                   "egresswall does not forward headers an upstream may split", 400)
    return None


def _flow_id(flow: http.HTTPFlow) -> str:
    return flow.id or uuid.uuid4().hex


def _client_ip(client: connection.Client) -> str:
    ip = client.peername[0] if client.peername else ""
    return ip[7:] if ip.startswith("::ffff:") and "." in ip else ip


def _safe_text(text: str, limit: int = 300) -> str:
    text = text.encode("ascii", "backslashreplace").decode("ascii")
    return text if len(text) <= limit else text[:limit] + "..."


def _is_local_address(address: str) -> bool:
    """True when this host owns the address (binding to it succeeds): the proxy's wildcard listener
    answers on every such address."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))
        return True
    except OSError:
        return False


