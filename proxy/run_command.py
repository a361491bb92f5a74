"""``egresswall run``: the proxy with a policy, until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging

from .runner import ProxyRunner, RunConfig


def parse_hostport(text: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """``HOST:PORT``, ``[v6]:PORT`` or ``:PORT``."""
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
    else:
        host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host or default_host, int(port)


def register(sub: argparse._SubParsersAction) -> None:
    from .cli import add_policy_options

    run = sub.add_parser("run", help="run the proxy")
    add_policy_options(run)
    run.add_argument("--listen", type=parse_hostport, default=("127.0.0.1", 3128), metavar="HOST:PORT",
                     help="proxy listener (default 127.0.0.1:3128)")
    run.add_argument("--admin", type=parse_hostport, default=("127.0.0.1", 9090), metavar="HOST:PORT",
                     help="admin listener with /healthz, /readyz, /metrics (default 127.0.0.1:9090)")
    run.add_argument("--no-admin", action="store_true", help="no admin listener")
    run.add_argument("--log", metavar="FILE", help="audit log file (default: standard output); SIGUSR1 reopens it")
    run.add_argument("--log-format", choices=["json", "squid"], default="json")
    run.add_argument("--confdir", help="mitmproxy's configuration directory (its CA, for interception)")
    run.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    from .cli import overrides_from

    logging.basicConfig(level=logging.INFO, format="egresswall: %(message)s")
    logging.getLogger("mitmproxy").setLevel(logging.WARNING)  # one line per connection is not for operators
    config = RunConfig(policy_path=args.policy, overrides=overrides_from(args), listen=args.listen,
                       admin=None if args.no_admin else args.admin, log_path=args.log, log_format=args.log_format,
                       confdir=args.confdir)
    runner = ProxyRunner(config)
    asyncio.run(runner.run())
    return 0
