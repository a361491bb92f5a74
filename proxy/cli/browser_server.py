"""``egresswall browser-server``: a shared, contained Chromium for remote Playwright clients."""

from __future__ import annotations

import argparse
import asyncio
import errno

from browser.server import BrowserServer, check_bind_address
from proxy.listeners import BROWSER_SERVER, ListenError, check_free

from . import logs
from .browser_proxy import add_proxy_choice, browser_proxy

_CANNOT_LISTEN = (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES)


def register(sub: argparse._SubParsersAction) -> None:
    server = sub.add_parser("browser-server", help="a shared, contained Chromium for remote Playwright clients "
                                                   "(no authentication: never publish it)")
    server.add_argument("--port", type=int, default=3000)
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--allow-non-loopback", action="store_true",
                        help="allow binding a non-loopback address (the server has NO authentication)")
    add_proxy_choice(server)
    server.set_defaults(func=cmd_browser_server)


def cmd_browser_server(args: argparse.Namespace) -> int:
    logs.configure(quiet_libraries=("websockets",))
    check_bind_address(args.host, args.allow_non_loopback)
    # Before a proxy and a browser are started for nothing: the port is the operator's most likely mistake.
    check_free(BROWSER_SERVER, args.host, args.port)
    with browser_proxy(args) as proxy:
        server = BrowserServer(proxy.plan, args.host, args.port)
        try:
            asyncio.run(server.run())
        except OSError as err:
            if err.errno in _CANNOT_LISTEN:  # taken since the check above
                raise ListenError(BROWSER_SERVER, (args.host, args.port), err) from err
            raise
    return 0
