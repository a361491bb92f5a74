"""The guard no path can skip: every upstream connect goes to the pinned, re-checked address."""

from __future__ import annotations

import logging

from mitmproxy import connection, ctx, http
from mitmproxy.proxy.server_hooks import ServerConnectionHookData

from policy.hosts import HostFormError, normalise_host

from ..gate import Gate
from ..upstream_connect import resolve_upstream
from .connections import ConnectionTable
from .decision import VERDICT

log = logging.getLogger("egresswall.pinning")


class PinnedAddress(tuple):
    """``(checked ip, port)``, as mitmproxy connects to it, that still knows the name it was checked for.

    mitmproxy bounds a client connection's upstream connections per address (five, each held for its
    connection's life: ``ConnectionHandler.max_conns``). Pinned to one IP, every name behind a CDN shared
    that bound, and the sixth host a kept-alive client asked for waited for an old upstream connection
    to idle out. Hashed and compared with its name, the bound stays per name, as mitmproxy meant it."""

    name: str

    def __new__(cls, ip: str, port: int, name: str) -> PinnedAddress:
        address = super().__new__(cls, (ip, port))
        address.name = name
        return address

    def __eq__(self, other: object) -> bool:
        return tuple.__eq__(self, other) is True and getattr(other, "name", None) == self.name

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash((self[0], self[1], self.name))


class Pinning:
    def __init__(self, gate: Gate, table: ConnectionTable) -> None:
        self.gate, self.table = gate, table

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        """A kept upstream connection serves the next request only if it is connected to the address that
        request was pinned to. mitmproxy picks the connection to reuse by its label, (host, port) (put back
        by ``server_connected``), not by where it is connected: a name whose answer changed (both answers
        allowed) sent the next request down the connection to the address the name had before, one that
        request was never decided for, its record naming the other (after a reload that denies the old
        address, one no request may reach). Such a connection is relabelled, so that mitmproxy opens a new
        one, pinned as always; the old one idles out, or ``UpstreamPool`` closes it. Runs after
        ``DecisionAddon``, which pinned the request."""
        verdict = flow.metadata.get(VERDICT)
        if flow.response is not None or verdict is None or verdict.pinned is None or self.gate.policy.upstream:
            return  # refused, or nothing pinned (through an upstream proxy every connection is to it)
        if self.table.tunnels.get(flow.server_conn.id) is not None:
            return  # inside a tunnel: its one upstream connection was pinned for the CONNECT
        handler = ctx.master.addons.get("proxyserver").connections.get(flow.client_conn.id)
        if handler is None:
            return
        label = (flow.request.host, flow.request.port)
        for server in list(handler.transports):
            if (isinstance(server, connection.Server) and server.address == label and server.peername is not None
                    and server.peername[0] != verdict.pinned):
                # Server.__setattr__ refuses changes on an open connection (as in server_connected).
                server.__dict__["address"] = (f"{label[0]} (kept, connected to {server.peername[0]})", label[1])

    async def server_connect(self, data: ServerConnectionHookData) -> None:
        if data.server.address is None:
            return
        host, port = data.server.address[0], data.server.address[1]
        upstream = self.gate.policy.upstream
        if upstream is not None:
            # Upstream mode: every socket mitmproxy opens is to the upstream proxy, which connects on
            # (resolving the name itself: nothing to pin). The decision was made on egresswall's own
            # resolution before this; any other address here would be a connection around the upstream.
            data.server.error = self.gate.guard_upstream(host, port)
            if data.server.error is None:
                # Connected at the address its name resolves to now, checked not to be egresswall's own listener
                # (the front does the same); the name goes back on once connected, for connection reuse.
                resolved, why = await resolve_upstream(upstream, self.gate.is_self)
                if resolved is None:
                    data.server.error = why
                    return
                self.table.restore[data.server.id] = (host, port)
                data.server.address = (str(resolved[1][0]), port)
            return
        try:
            key_host, _ = normalise_host(host)
        except HostFormError as err:
            data.server.error = f"egresswall: refused connect to {host!r}: {err.reason}"
            return
        pinned = self.table.pin_for(data.client.id, key_host, port)
        if pinned is None:
            # No decision prepared this connect: a path the request hooks did not see. It is refused, never decided
            # here by the policy alone, which would pass over the request's form and session checks (review round
            # 23b; the suite never comes here).
            log.warning("egresswall: a connect to %s:%s that no decision prepared was refused", key_host, port)
            data.server.error = "egresswall: no decision was made for this connection; refused"
            return
        refused = self.gate.guard(pinned, port)
        if refused:
            data.server.error = refused  # the fast front's wording exactly: the tunnel records agree
            return
        self.table.restore[data.server.id] = (host, port)
        data.server.address = PinnedAddress(pinned, port, key_host)

    def server_connected(self, data: ServerConnectionHookData) -> None:
        original = self.table.restore.pop(data.server.id, None)
        if original is not None:
            # mitmproxy matches a reusable connection by (hostname, port); put the name back or every
            # keep-alive request opens a new connection. Server.__setattr__ refuses changes on an open
            # connection, so write the field directly: the socket stays connected to the checked IP
            # (``peername``), only the label used for reuse changes.
            data.server.__dict__["address"] = original

    def server_connect_error(self, data: ServerConnectionHookData) -> None:
        original = self.table.restore.pop(data.server.id, None)
        if original is not None:
            data.server.address = original
        tunnel = self.table.tunnels.pop(data.server.id, None)
        if tunnel is not None:  # the tunnel's connect failed: it ends here, with the reason
            # Regular mode connects before it answers the CONNECT, and answers 502; upstream mode answers 200
            # first and connects when the tunnel's first message comes.
            self.gate.tunnel_closed(tunnel, 0, 0, f"connect failed: {data.server.error or 'unknown error'}",
                                    200 if tunnel.established else 502)
