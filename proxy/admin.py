"""The admin listener: /healthz, /readyz, /metrics and (with a token file) the session API, loopback by default.

Served by aiohttp on its own socket. The plain routes keep their small interface — a mapping of path to a
function ``() -> (status, content type, body)`` — so what builds a body can change without touching the
server; the session API (``proxy/sessions/api.py``) adds its own routes when it is on.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import stat
from collections.abc import Awaitable, Callable
from typing import Protocol

from .aiohttp_web import HttpProcessingError, web  # aiohttp's server without its client

Answer = tuple[int, str, str]  # (status, content type, body)
# () -> answer, or an awaitable of one (the supervisor's routes ask its workers, which must not block its loop)
Route = Callable[[], Answer | Awaitable[Answer]]
MAX_BODY = 64 * 1024  # an admin request body (a session's grants) is small
# aiohttp bounds a head's size but not how long it may take to arrive, and keeps connections alive for
# an hour: an admin connection lives at most this long (a scraper simply reconnects), and at most this
# many are open at once, so a client that drips a head can hold neither memory nor the port.
CONNECTION_LIFETIME = 10.0
MAX_CONNECTIONS = 64


class _UnparsedRequestInOneLine(logging.Filter):
    """aiohttp logs a request it cannot parse (answered 400) with a traceback that quotes the request's bytes: an
    Authorization line ending in a bare LF put the admin token into the proxy's log, and any client of the port
    could write tracebacks there at will (review round 19). Such a record becomes one line that quotes nothing
    the client sent; a handler's own failure (a 500) keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        failure = record.exc_info[1] if record.exc_info else None
        if isinstance(failure, HttpProcessingError):
            record.msg, record.args = f"admin listener: answered {failure.code} to a request it could not parse", ()
            record.exc_info = record.exc_text = record.stack_info = None
        return True


_UNPARSED = _UnparsedRequestInOneLine()


class ExtraRoutes(Protocol):
    def register(self, app: web.Application) -> None: ...


class AdminServer:
    def __init__(self, routes: dict[str, Route], api: ExtraRoutes | None = None) -> None:
        self.routes = routes
        self.api = api
        self.runner: web.AppRunner | None = None
        self.server: asyncio.Server | None = None
        self.open_connections = 0
        # Every (address, port) it listens on: a host name binds each address it resolves to ("localhost"
        # is 127.0.0.1 and ::1 on most systems), and each is egresswall itself to the connect guard.
        self.addresses: list[tuple[str, int]] = []

    def application(self) -> web.Application:
        logging.getLogger("aiohttp.server").addFilter(_UNPARSED)  # once: a logger holds a filter at most once
        app = web.Application(client_max_size=MAX_BODY)
        for path, route in self.routes.items():
            app.router.add_get(path, _plain(route))  # HEAD too
        if self.api is not None:
            self.api.register(app)
        return app

    async def start(self, host: str, port: int) -> tuple[str, int]:
        self.runner = web.AppRunner(self.application(), access_log=None, handle_signals=False)
        await self.runner.setup()
        assert self.runner.server is not None
        self.server = await asyncio.get_running_loop().create_server(
            self._bounded(self.runner.server), host, port, reuse_address=True)
        self.addresses = [sock.getsockname()[:2] for sock in self.server.sockets]
        return self.addresses[0]

    async def start_unix(self, path: str) -> None:
        """Listen on a Unix socket at ``path`` (a worker's admin listener, read by its supervisor); a socket left
        there by this worker's previous run is replaced."""
        self.runner = web.AppRunner(self.application(), access_log=None, handle_signals=False)
        await self.runner.setup()
        assert self.runner.server is not None
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)
        self.server = await asyncio.get_running_loop().create_unix_server(self._bounded(self.runner.server), path)

    def _bounded(self, protocol_factory: web.Server) -> Callable[[], asyncio.Protocol]:
        """aiohttp's protocol for each connection, with a lifetime and a cap on how many are open."""
        return lambda: _Bounded(self, protocol_factory())

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


class _Bounded(asyncio.Protocol):
    """One admin connection: aiohttp's own protocol inside (every event handed on), ended when it has
    lived CONNECTION_LIFETIME seconds, whatever it still has to send, and refused at once beyond MAX_CONNECTIONS
    open."""

    def __init__(self, server: AdminServer, inner: asyncio.Protocol) -> None:
        self.server = server
        self.inner = inner

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.server.open_connections += 1
        self.inner.connection_made(transport)
        if self.server.open_connections > MAX_CONNECTIONS:
            transport.abort()
        else:
            # abort, not close: close waits to send what is queued, which a client that never reads holds forever
            asyncio.get_running_loop().call_later(CONNECTION_LIFETIME, transport.abort)  # no-op once closed

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.open_connections -= 1
        self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


def _plain(route: Route):
    async def handle(request: web.Request) -> web.Response:
        answer = route()
        status, ctype, body = await answer if inspect.isawaitable(answer) else answer
        return web.Response(status=status, body=body.encode(), headers={"Content-Type": ctype,
                                                                         "Cache-Control": "no-store"})
    return handle
