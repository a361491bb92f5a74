"""``egresswall browser-server``: a shared, contained Chromium for remote Playwright clients."""

from __future__ import annotations

import argparse
import asyncio
import errno
from pathlib import Path

from browser.cgroup import parse_memory_size
from browser.server import BrowserServer, ServerLimits, check_bind_address
from proxy.listeners import BROWSER_SERVER, ListenError, check_free

from . import logs
from .browser_proxy import add_proxy_choice, browser_proxy
from .errors import UsageError

_CANNOT_LISTEN = (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES)
# A session is created through a proxy's admin API; the in-process proxy of --policy has none, so no
# session could exist there and every request would be refused. Say so at the handshake instead.
EMBEDDED_NO_SESSIONS = ("this browser server runs its proxy in-process (--policy), which has no session API, so no "
                        "session exists here; run egresswall run --admin-token-file FILE and start the browser "
                        "server with --proxy HOST:PORT")


def register(sub: argparse._SubParsersAction) -> None:
    server = sub.add_parser("browser-server", help="a shared, contained Chromium for remote Playwright clients "
                                                   "(no authentication: never publish it)")
    server.add_argument("--port", type=int, default=3000)
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--driver-port", type=int, default=0, metavar="PORT",
                        help="the Playwright driver's port on 127.0.0.1, behind the relay (default 0: any free port; "
                             "a fixed one lets a pod's packet filter admit it for the browser's user only)")
    server.add_argument("--allow-non-loopback", action="store_true",
                        help="allow binding a non-loopback address (the server has NO authentication)")
    add_proxy_choice(server)
    _add_limits(server)
    server.set_defaults(func=cmd_browser_server)


def _memory_size(text: str) -> int | None:
    try:
        return parse_memory_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _add_limits(server: argparse.ArgumentParser) -> None:
    d = ServerLimits  # the defaults, named in each help text (browser/README.md has the why)
    limits = server.add_argument_group("limits (see browser/README.md)")
    limits.add_argument("--max-contexts", type=int, default=d.max_contexts, metavar="N",
                        help=f"contexts open at once over all clients (default {d.max_contexts})")
    limits.add_argument("--max-contexts-per-client", type=int, default=d.max_contexts_per_client, metavar="N",
                        help=f"contexts open at once per client address (default {d.max_contexts_per_client})")
    limits.add_argument("--max-connections", type=int, default=d.max_connections, metavar="N",
                        help=f"client connections over all clients (default {d.max_connections})")
    limits.add_argument("--max-connections-per-client", type=int, default=d.max_connections_per_client,
                        metavar="N", help=f"client connections per address (default {d.max_connections_per_client})")
    limits.add_argument("--context-idle", type=float, default=d.context_idle, metavar="S",
                        help=f"close a context after S seconds without a call (default {d.context_idle:g})")
    limits.add_argument("--connection-idle", type=float, default=d.connection_idle, metavar="S",
                        help=f"close a connection after S seconds without a call (default {d.connection_idle:g})")
    limits.add_argument("--max-message-bytes", type=int, default=d.max_message_bytes, metavar="N",
                        help=f"largest protocol message either way; bigger closes the connection "
                             f"(default {d.max_message_bytes})")
    limits.add_argument("--max-calls-in-flight", type=int, default=d.max_calls_in_flight, metavar="N",
                        help=f"unanswered calls per connection (default {d.max_calls_in_flight})")
    limits.add_argument("--browser-memory-max", type=_memory_size, default=d.browser_memory_max, metavar="SIZE",
                        help="the browser's memory cgroup limit, e.g. 2G, or off (default 2G)")
    limits.add_argument("--browser-cgroup-parent", type=Path, metavar="DIR",
                        help="create the browser's cgroup under DIR (default: the server's own cgroup)")


def cmd_browser_server(args: argparse.Namespace) -> int:
    logs.configure(quiet_libraries=("websockets",))
    check_bind_address(args.host, args.allow_non_loopback)
    if not 0 <= args.port <= 65535:  # before a proxy and a browser start (bind() said it after both had)
        raise UsageError(f"--port {args.port}: a port from 1 to 65535, or 0 (any free port)")
    if not 0 <= args.driver_port <= 65535 or (args.driver_port and args.driver_port == args.port):
        raise UsageError(f"--driver-port {args.driver_port}: a port from 1 to 65535 other than --port, or 0 (any "
                         "free port)")
    try:
        limits = ServerLimits.from_options(vars(args))
    except ValueError as err:
        raise UsageError(str(err)) from None
    # Before a proxy and a browser are started for nothing: the port is the operator's most likely mistake.
    check_free(BROWSER_SERVER, args.host, args.port)
    with browser_proxy(args) as proxy:
        server = BrowserServer(proxy.plan, args.host, args.port, limits=limits,
                               sessions_refused=EMBEDDED_NO_SESSIONS if proxy.embedded else None,
                               driver_port=args.driver_port,
                               own_endpoint=proxy.embedded.refuse_endpoint if proxy.embedded else None)
        try:
            asyncio.run(server.run())
        except OSError as err:
            if err.errno in _CANNOT_LISTEN:  # taken since the check above
                raise ListenError(BROWSER_SERVER, (args.host, args.port), err) from err
            raise
    return 0
