"""The admin listener: /healthz, /readyz, /metrics and (with a token file) the session API, loopback by default.

Served by aiohttp on its own socket. The plain routes keep their small interface — a mapping of path to a
function ``() -> (status, content type, body)`` — so what builds a body can change without touching the
server; the session API (``proxy/sessions/api.py``) adds its own routes when it is on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from aiohttp import web

Route = Callable[[], tuple[int, str, str]]  # () -> (status, content type, body)
MAX_BODY = 64 * 1024  # an admin request body (a session's grants) is small


class ExtraRoutes(Protocol):
    def register(self, app: web.Application) -> None: ...


class AdminServer:
    def __init__(self, routes: dict[str, Route], api: ExtraRoutes | None = None) -> None:
        self.routes = routes
        self.api = api
        self.runner: web.AppRunner | None = None

    def application(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY)
        for path, route in self.routes.items():
            app.router.add_get(path, _plain(route))  # HEAD too
        if self.api is not None:
            self.api.register(app)
        return app

    async def start(self, host: str, port: int) -> tuple[str, int]:
        self.runner = web.AppRunner(self.application(), access_log=None, handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port, reuse_address=True)
        await site.start()
        address = self.runner.addresses[0]
        return address[0], address[1]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


def _plain(route: Route):
    async def handle(request: web.Request) -> web.Response:
        status, ctype, body = route()
        return web.Response(status=status, body=body.encode(), headers={"Content-Type": ctype,
                                                                         "Cache-Control": "no-store"})
    return handle
