"""One client connection, relayed to the driver through the protocol filter and the context accounting.

Client → driver: each message is checked by ``ProtocolFilter`` (network options, launches, raw
channels...), then admitted by ``ConnectionTracker`` (context caps, calls in flight); a refused call gets
a protocol error back and never reaches the driver. Driver → client: each message updates the object tree
and the accounting; replies to the relay's own calls (the ``close`` of a reaped context) stay here.

Both directions are bounded: a message over ``max_message_bytes`` closes the connection (websockets
closes it with 1009 "message too big"), and websockets reads at most ``max_queue`` messages ahead on
either side, so a slow reader holds back the writer instead of growing the relay's memory.

When the client goes, the contexts it left open are closed (and awaited, briefly) before the connection
to the driver is, so a slot is given back only when its context is really gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from websockets.exceptions import ConnectionClosed

from .objects import ObjectTree, read_server_message
from .protocol_filter import ProtocolFilter, Refusal
from .session_connect import with_context_proxy
from .tracker import CONTEXT_OPENERS, ConnectionTracker

if TYPE_CHECKING:
    from .driver import BrowserProcess
    from .server import BrowserServer

log = logging.getLogger("egresswall.browser")
DRAIN_SECONDS = 10.0  # how long a departed client's contexts get to close
MAX_QUEUE = 4  # messages websockets reads ahead on each side


@dataclass(frozen=True)
class Ending:
    code: int
    reason: str  # for the client (a WebSocket close reason: at most 123 bytes)
    label: str  # connections_closed_total{reason=...}


def close_reason(text: str) -> str:
    return text.encode()[:123].decode(errors="ignore")


class Relay:
    def __init__(self, server: BrowserServer, client, key: str, browser: BrowserProcess,
                 context_proxy: dict[str, str] | None = None) -> None:
        self.server = server
        self.browser = browser  # the one this connection reaches (a restart brings another)
        self.client = client
        self.key = key
        self.peer = client.remote_address
        self.limits = server.limits
        self.tree = ObjectTree()
        self.protocol = ProtocolFilter(self.tree)
        self.tracker = ConnectionTracker(key, server.context_caps, self.tree, self.limits.max_calls_in_flight,
                                         time.monotonic(), server.metrics)
        self.upstream = None
        self.ending: Ending | None = None  # set when the relay itself ends the connection
        # A session connection's proxy option (with its credentials), set on every context it opens.
        self.context_proxy = context_proxy
        self.session = context_proxy["username"] if context_proxy else None

    # ---- what the server asks of a connection ---------------------------------------------------

    def end(self, ending: Ending) -> None:
        """Close the client connection (idle, browser gone...); ``run`` then winds the rest down."""
        if self.ending is None:
            self.ending = ending
            self.server.spawn(self.client.close(ending.code, close_reason(ending.reason)))

    async def reap(self, context: str, why: str, reason: str) -> None:
        """Ask the browser to close one of this connection's contexts; its slot is freed when it closed."""
        if self.upstream is None:
            return
        call_id = self.tracker.own_call(context, why)
        with contextlib.suppress(ConnectionClosed):
            await self.upstream.send(json.dumps({"id": call_id, "guid": context, "method": "close",
                                                 "params": {"reason": reason}, "metadata": {}}))

    # ---- the relay ------------------------------------------------------------------------------

    async def run(self, upstream_url: str) -> None:
        from websockets.asyncio.client import connect
        from websockets.exceptions import InvalidStatus

        user_agent = self.client.request.headers.get("User-Agent")  # the driver checks the client's version in it
        try:
            self.upstream = await connect(upstream_url, max_size=self.limits.max_message_bytes, max_queue=MAX_QUEUE,
                                          ping_interval=None, open_timeout=30, user_agent_header=user_agent,
                                          compression=None)
        except InvalidStatus as err:
            body = err.response.body.decode(errors="replace")[:300] if err.response.body else ""
            await self.client.close(1011, close_reason(f"the browser server refused the connection: {body}"))
            return
        except OSError as err:
            await self.client.close(1011, close_reason(f"the browser is not reachable: {err}"))
            return
        log.info("client %s connected%s", self.peer, f" with session {self.session}" if self.session else "")
        to_server = asyncio.create_task(self._client_to_server())
        to_client = asyncio.create_task(self._server_to_client())
        try:
            done, _ = await asyncio.wait({to_server, to_client}, return_when=asyncio.FIRST_COMPLETED)
            if to_server in done and to_client not in done and not self.server.stopping:
                await self._drain(to_client)
            ending = self.ending or await self._why_the_driver_closed(to_client)
        finally:
            for task in (to_server, to_client):
                task.cancel()
            for task in (to_server, to_client):
                with contextlib.suppress(asyncio.CancelledError, ConnectionClosed):
                    await task
            await self.upstream.close()
            self.tracker.release_all()
        if ending is not None:
            self.server.metrics.connections_closed[ending.label] += 1
            await self.client.close(ending.code, close_reason(ending.reason))
        await self.client.close()
        log.info("client %s disconnected%s", self.peer, f" ({ending.reason})" if ending else "")

    async def _client_to_server(self) -> None:
        assert self.upstream is not None
        try:
            async for message in self.client:
                verdict = self.protocol.check(message)
                if isinstance(verdict, Refusal):
                    self.server.metrics.calls_refused["filter"] += 1
                    if not await self._refuse(verdict):
                        return
                    continue
                refusal = self.tracker.admit_call(verdict.call_id, verdict.guid, verdict.method, time.monotonic())
                if refusal is not None:
                    self.server.metrics.calls_refused[refusal.scope] += 1
                    if not await self._refuse(Refusal(verdict.call_id, refusal.reason)):
                        return
                    continue
                if self.context_proxy is not None and (verdict.interface, verdict.method) in CONTEXT_OPENERS:
                    # After the filter (which refused any proxy the client sent): the server's proxy, with
                    # this connection's session, is the only one the context gets.
                    message = json.dumps(with_context_proxy(json.loads(message), self.context_proxy))
                try:
                    await self.upstream.send(message)
                except ConnectionClosed:
                    return  # the driver went: _server_to_client ends too, and says why
        except ConnectionClosed as closed:
            if closed.sent is not None and closed.sent.code == 1009 and self.ending is None:
                self.ending = Ending(1009, f"a message over {self.limits.max_message_bytes} bytes (the limit): "
                                           "connection closed", "oversized_from_client")
                log.warning("client %s sent a message over %d bytes: connection closed", self.peer,
                            self.limits.max_message_bytes)

    async def _refuse(self, refusal: Refusal) -> bool:
        """Answer a refused call; False when there was nothing to answer and the connection is closed."""
        log.warning("refused from %s: %s", self.peer, refusal.reason)
        reply = refusal.reply()
        if reply is None:
            self.end(Ending(1008, refusal.reason, "protocol"))
            return False
        await self.client.send(reply)
        return True

    async def _server_to_client(self) -> None:
        assert self.upstream is not None
        client_open = True
        async for message in self.upstream:
            seen = self.tracker.observe(read_server_message(message, self.tracker.want_result), time.monotonic())
            if seen.unexpected_context is not None:
                log.warning("a context was created for %s without newContext: closed", self.peer)
                self.server.metrics.contexts_refused["unexpected"] += 1
                self.server.spawn(self.reap(seen.unexpected_context, "unexpected", "not opened by newContext"))
            if seen.swallow or not client_open:
                continue
            try:
                await self.client.send(message)
            except ConnectionClosed:
                client_open = False  # keep reading: the contexts it left are being closed

    async def _drain(self, to_client: asyncio.Task) -> None:
        """The client went: close its contexts (and those still opening) and wait for them, briefly."""
        why = "connection_idle" if self.ending is not None and self.ending.label == "idle" else "disconnected"
        deadline = time.monotonic() + DRAIN_SECONDS
        while (self.tracker.contexts or self.tracker.pending_opens) and not to_client.done():
            for context in list(self.tracker.contexts.values()):
                if context.closing is None:
                    await self.reap(context.guid, why, "the client's connection ended")
            if time.monotonic() > deadline:
                log.warning("contexts of %s did not close within %g s; the driver closes them", self.peer,
                            DRAIN_SECONDS)
                return
            await asyncio.wait({to_client}, timeout=0.05)

    async def _why_the_driver_closed(self, to_client: asyncio.Task) -> Ending | None:
        if not to_client.done():
            return None  # the client left (or was closed by the relay): the driver did nothing
        assert self.upstream is not None
        sent = self.upstream.protocol.close_sent
        if sent is not None and sent.code == 1009:
            log.warning("the browser sent %s a message over %d bytes: connection closed", self.peer,
                        self.limits.max_message_bytes)
            return Ending(1009, f"a message from the browser over {self.limits.max_message_bytes} bytes (the "
                                "limit): connection closed", "oversized_from_browser")
        exit_reason = await self.browser.wait_exit(timeout=3.0)
        if exit_reason is not None:
            return Ending(1011, f"{exit_reason}; a new browser is starting: reconnect", "browser_exited")
        return Ending(1011, "the browser closed the connection", "driver_closed")
