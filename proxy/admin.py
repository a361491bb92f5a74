"""The admin listener: /healthz, /readyz and /metrics on their own socket, loopback by default.

A tiny HTTP/1.0 responder on asyncio streams: three GET routes do not need a framework, and the
admin port must stay up when the proxy is saturated.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

Route = Callable[[], tuple[int, str, str]]  # () -> (status, content type, body)
_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable", 400: "Bad Request"}


class AdminServer:
    def __init__(self, routes: dict[str, Route]) -> None:
        self.routes = routes
        self.server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> tuple[str, int]:
        self.server = await asyncio.start_server(self._serve, host, port)
        address = self.server.sockets[0].getsockname()
        return address[0], address[1]

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5)
            method, _, rest = head.split(b"\r\n", 1)[0].decode("latin-1").partition(" ")
            path = rest.split(" ", 1)[0].split("?", 1)[0]
            if method not in ("GET", "HEAD"):
                status, ctype, body = 405, "text/plain", "only GET\n"
            elif path in self.routes:
                status, ctype, body = self.routes[path]()
            else:
                status, ctype, body = 404, "text/plain", "not found\n"
            data = body.encode()
            writer.write(f"HTTP/1.0 {status} {_REASONS.get(status, '')}\r\nContent-Type: {ctype}\r\n"
                         f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode())
            if method != "HEAD":
                writer.write(data)
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()
