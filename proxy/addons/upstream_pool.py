"""A client connection keeps a bounded number of upstream connections open on mitmproxy's path.

mitmproxy keeps every upstream connection a client connection opened, one per host name, until the
upstream closes it or it idles out (``limits.idle_timeout``). A kept-alive client asking for many names
(any number of them may resolve to one address) made the proxy hold a socket for each: hundreds from one
client connection, and from a few of them the process's file descriptors. The fast path keeps one. Here,
before another is opened, the oldest are closed so that at most ``MAX_OPEN`` stay open. On an HTTP/1
client connection at most one upstream connection is in use at a time (mitmproxy reads the next request
only once the response before it is done), so the ones closed are idle: a later request to their host
simply connects again, decided and pinned as always.
"""

from __future__ import annotations

from mitmproxy import connection, ctx
from mitmproxy.proxy.server_hooks import ServerConnectionHookData

MAX_OPEN = 4  # upstream connections one client connection keeps open, the new one included


class UpstreamPool:
    def __init__(self) -> None:
        # client connection id -> {server connection id: server connection}, oldest first
        self.open: dict[str, dict[str, connection.Server]] = {}

    def server_connect(self, data: ServerConnectionHookData) -> None:
        kept = self.open.get(data.client.id)
        if not kept or len(kept) < MAX_OPEN:
            return
        handler = ctx.master.addons.get("proxyserver").connections.get(data.client.id)
        for server_id in list(kept)[: len(kept) - MAX_OPEN + 1]:
            server = kept.pop(server_id)
            if handler is not None and server in handler.transports:
                handler.close_connection(server)  # as mitmproxy closes one itself: its layers see it closed

    def server_connected(self, data: ServerConnectionHookData) -> None:
        self.open.setdefault(data.client.id, {})[data.server.id] = data.server

    def server_disconnected(self, data: ServerConnectionHookData) -> None:
        kept = self.open.get(data.client.id)
        if kept is not None:
            kept.pop(data.server.id, None)

    def client_disconnected(self, client: connection.Client) -> None:
        self.open.pop(client.id, None)
