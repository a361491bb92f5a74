"""Inside an allowed tunnel: nothing is relayed before the gate has judged a whole first message.

``next_layer`` puts a ``TunnelStart`` in front of every allowed tunnel. A passed-through TLS tunnel
whose ClientHello the gate accepts becomes a counted byte relay; an intercepted one, or HTTP inside a
CONNECT to a plain-HTTP port, goes back to mitmproxy's own layer choice — now with the whole message
in hand, so a first byte sent alone can no longer make it a raw TCP relay — and every request inside
is decided by ``requestheaders``. ``tls_clienthello`` checks the SNI of intercepted tunnels again, and
gives the origin the decided host as SNI and only HTTP's ALPN offers (no client-chosen bytes on the way).
"""

from __future__ import annotations

import asyncio
import time

from mitmproxy import ctx, http
from mitmproxy.flow import Error
from mitmproxy.proxy import layer as mlayer
from mitmproxy.proxy.layers import HttpLayer
from mitmproxy.proxy.layers.http import HTTPMode
from mitmproxy.proxy.layers.tls import HTTP_ALPNS
from mitmproxy.proxy.server_hooks import ServerConnectionHookData
from mitmproxy.tls import ClientHelloData

from ..first_bytes import FirstBytes
from ..gate import Gate, Tunnel
from ..tls_hello import HelloError, read_client_hello
from .connections import ConnectionTable
from .tunnel_layers import MAX_SERVER_FIRST, CountedRelay, Refused, TunnelStart

DECIDED = "egresswall_tunnel_decided"
# mitmproxy's words for a flow ended by its client or killed (egresswall's cuts kill): no failure on the way out
_NOT_OUTWARD = ("Client disconnected", Error.KILLED_MESSAGE)


class TunnelWatch:
    def __init__(self, gate: Gate, table: ConnectionTable) -> None:
        self.gate, self.table = gate, table
        self.begun: set[str] = set()  # tunnels (their server ids) whose first bytes came: TunnelStart bounds them

    def http_connected(self, flow: http.HTTPFlow) -> None:
        """mitmproxy asks for a tunnel's layer only at the client's first byte, so a client that sent nothing after
        the 200 met no ``limits.header_timeout`` (only the idle timeout, 120 s by default) and its line said it had
        closed (review round 17). The bound is kept from here until the first byte, as the front keeps it."""
        tunnel = self.table.tunnels.get(flow.server_conn.id)
        if tunnel is None:
            return
        remaining = max(0.0, self.gate.policy.limits.header_timeout - (time.monotonic() - tunnel.started))
        asyncio.get_running_loop().call_later(remaining, self._first_bytes_due, flow.server_conn.id,
                                              flow.client_conn.id)

    def _first_bytes_due(self, server_id: str, client_id: str) -> None:
        if server_id in self.begun:
            self.begun.discard(server_id)
            return
        tunnel = self.table.tunnels.pop(server_id, None)
        if tunnel is None:
            return  # it ended before
        self.gate.tunnel_start_timed_out(tunnel, 0)
        close_client(client_id)

    def next_layer(self, nextlayer: mlayer.NextLayer) -> None:
        context = nextlayer.context
        tunnel = self.table.tunnels.get(context.server.id)
        if tunnel is None:
            return  # not a tunnel of ours
        if context.server.__dict__.get(DECIDED):
            if tunnel.intercept and context.client.tls_established:
                # Inside the decrypted TLS of an intercepted host: HTTP, parsed and decided request by
                # request — never mitmproxy's guess, which takes a first line that is not three letters,
                # or an upstream that speaks first, for raw TCP.
                nextlayer.layer = HttpLayer(context, HTTPMode.transparent)
            return
        context.server.__dict__[DECIDED] = True
        server_id = context.server.id
        self.begun.add(server_id)

        def choose(judged: FirstBytes) -> mlayer.Layer:
            if judged.refused:
                self.table.tunnels.pop(server_id, None)
                return Refused(context, judged.answer)
            if judged.kind == "tls" and not tunnel.intercept:
                relay = CountedRelay(context, lambda up, down, err: self._relay_done(server_id, tunnel, up, down, err),
                                     self.gate.retry_watch(judged, b""), judged.hello_size,
                                     self.gate.policy.limits.header_timeout,
                                     lambda rule, reason, up, down: self._retry_refused(server_id, tunnel, rule,
                                                                                        reason, up, down),
                                     tunnel.allowance)
                tunnel.cut = lambda: close_client(context.client.id)
                tunnel.moved = lambda: (relay.bytes_up, relay.bytes_down)
                return relay
            # HTTP inside: egresswall chooses the layer itself (mitmproxy's own choice would take a request
            # line whose first bytes are not three letters, or an upstream that speaks first, for raw TCP).
            if judged.kind == "http":
                return HttpLayer(context, HTTPMode.transparent)
            # Intercepted TLS: mitmproxy's TLS layers, chosen on the whole ClientHello; what they decrypt
            # comes back to next_layer above, which puts HTTP there.
            return mlayer.NextLayer(context)

        def timed_out(seen: int) -> None:
            self.table.tunnels.pop(server_id, None)
            self.gate.tunnel_start_timed_out(tunnel, seen)

        def cut_short(seen: int, by_client: bool) -> None:
            self.table.tunnels.pop(server_id, None)
            if by_client:
                self.gate.tunnel_cut_short(tunnel, seen)
            else:
                self.gate.tunnel_closed(tunnel, seen, 0, "the server closed the connection before the client's first "
                                                         "message was complete")

        def server_first(sent: int) -> None:
            self.table.tunnels.pop(server_id, None)
            self.gate.refuse_tunnel(tunnel, "http:server-first",
                                    f"the server sent {sent} bytes before the client's first message (a TLS "
                                    f"ClientHello or an HTTP request head) was complete, more than {MAX_SERVER_FIRST}: "
                                    "neither TLS nor HTTP has the server speak first")

        # The bound runs from the tunnel's opening (mitmproxy asks for a layer only at the first byte).
        remaining = max(0.0, self.gate.policy.limits.header_timeout - (time.monotonic() - tunnel.started))
        nextlayer.layer = TunnelStart(context, self.gate.first_message(tunnel),
                                      lambda first, chunk: self.gate.tunnel_start(tunnel, first, chunk), choose,
                                      remaining, timed_out, cut_short, server_first)

    def _relay_done(self, server_id: str, tunnel: Tunnel, up: int, down: int, error: str | None) -> None:
        self.table.tunnels.pop(server_id, None)
        self.gate.tunnel_closed(tunnel, up, down, error)

    def _retry_refused(self, server_id: str, tunnel: Tunnel, rule: str, reason: str, up: int, down: int) -> None:
        self.table.tunnels.pop(server_id, None)
        self.gate.refuse_tunnel(tunnel, rule, reason, up, down)

    def tls_clienthello(self, data: ClientHelloData) -> None:
        """Intercepted tunnels: the SNI must name the CONNECT host here too (read strictly); the origin is
        offered HTTP's ALPN protocols only, and the decided host as its SNI."""
        tunnel = self.table.tunnels.get(data.context.server.id)
        if tunnel is None:
            return
        try:
            hello = read_client_hello(data.client_hello.raw_bytes(wrap_in_record=True))
            problem = None if hello is None or hello.sni in (None, tunnel.target.host) else (
                f"TLS SNI {hello.sni} does not match the CONNECT host {tunnel.target.host}")
            rule = "tls:sni"
        except HelloError as err:
            problem, rule = err.reason, err.rule
        if problem:
            self.table.tunnels.pop(data.context.server.id, None)
            self.gate.refuse_tunnel(tunnel, rule, problem)
            data.context.client.error = problem  # mitmproxy closes the connection
            data.ignore_connection = False
            return
        # mitmproxy offers the origin what the client offered, and names it as the client spelled it: client-chosen
        # bytes to the granted origin that no budget is charged. Only HTTP's offers go on (egresswall reads only
        # HTTP inside).
        client = data.context.client
        client.alpn_offers = [offer for offer in client.alpn_offers if offer in HTTP_ALPNS]
        if not tunnel.target.is_ip:  # and its SNI names the decided host, not the client's spelling (PuBlIc.)
            data.context.server.sni = tunnel.target.host

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        self.table.failed_inside.pop(flow.client_conn.id, None)  # a request came after the one that failed

    def error(self, flow: http.HTTPFlow) -> None:
        """A request inside a tunnel failed on the way out (its connect, an upstream proxy that did not open the
        tunnel): mitmproxy answers 502 and closes, and the tunnel's closing line names why. A client that went
        away, or a cut egresswall made (the tunnel's own line names it), is not such a failure."""
        error = flow.error.msg if flow.error is not None else ""
        if flow.client_conn.id in self.table.tunneled and error and not error.startswith(_NOT_OUTWARD):
            self.table.failed_inside[flow.client_conn.id] = error

    def server_disconnected(self, data: ServerConnectionHookData) -> None:
        # A tunnel that never reached the relay (intercepted, HTTP inside) gets its closing line here. It stays
        # in the table until its client connection closes (``forget_client``): mitmproxy opens a new connection
        # to the origin for the client's next request inside the tunnel (an origin's keep-alive timeout closes
        # the first one), and that request is still the tunnel's — its target, its checks and its session —
        # never a plain request decided as if no CONNECT had come before it.
        tunnel = self.table.tunnels.get(data.server.id)
        if tunnel is not None:
            self.gate.tunnel_closed(tunnel, 0, 0, None)


def close_every_client() -> None:
    """A stop's end of the grace period: close every client connection mitmproxy holds, at once (aborted: a
    client that does not read must not hold its close), so that each tunnel's and WebSocket's end is seen and
    recorded before the process goes."""
    for handler in list(ctx.master.addons.get("proxyserver").connections.values()):
        io = handler.transports.get(handler.client)
        if io is not None and io.writer is not None:
            io.writer.transport.abort()


def record_open() -> None:
    """A stop: what mitmproxy has not ended since ``close_every_client`` gets its record now, while the audit log
    is open: exchanges and WebSockets (``AuditTrail.record_open``) and tunnels (bytes unknown here: 0)."""
    ctx.master.addons.get("audittrail").record_open()
    watch = ctx.master.addons.get("tunnelwatch")
    for tunnel in list(watch.table.tunnels.values()):
        watch.gate.tunnel_closed(tunnel, 0, 0, "stopped")


def close_client(client_id: str) -> None:
    """Close a client connection from outside mitmproxy's layers (its session ended): its socket is closed,
    mitmproxy sees the end as a client that went, and the relay reports (``Gate.tunnel_closed``)."""
    handler = ctx.master.addons.get("proxyserver").connections.get(client_id)
    if handler is None:
        return
    io = handler.transports.get(handler.client)
    if io is not None and io.writer is not None:
        io.writer.close()
