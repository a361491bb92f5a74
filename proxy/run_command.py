"""``egresswall run``: the proxy with a policy, until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
    run.add_argument("--upstream-ca", metavar="FILE",
                     help="CA bundle to verify intercepted upstreams with, besides the system's (private CAs, labs)")
    run.add_argument("--workers", type=int, default=1, metavar="N",
                     help="proxy processes sharing the listen port (SO_REUSEPORT); default 1")
    run.add_argument("--fast-tunnels", action=argparse.BooleanOptionalAction, default=True,
                     help="relay passed-through TLS tunnels in egresswall's own front rather than through "
                          "mitmproxy (default: on; --no-fast-tunnels hands them to mitmproxy)")
    # Set by the supervisor for its workers; not for operators.
    run.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)
    run.add_argument("--worker-count", type=int, default=1, help=argparse.SUPPRESS)
    run.add_argument("--also-self", type=parse_hostport, action="append", default=[], help=argparse.SUPPRESS)
    run.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    from .cli import overrides_from

    if args.workers < 1:
        raise ValueError("--workers must be at least 1")
    if args.workers > 1:
        return _run_supervisor(args)
    if args.reuse_port:
        _die_with_supervisor()
    logging.basicConfig(level=logging.INFO, format="egresswall: %(message)s")
    logging.getLogger("mitmproxy").setLevel(logging.WARNING)  # one line per connection is not for operators
    config = RunConfig(policy_path=args.policy, overrides=overrides_from(args), listen=args.listen,
                       admin=None if args.no_admin else args.admin, log_path=args.log, log_format=args.log_format,
                       confdir=args.confdir, upstream_ca=args.upstream_ca, reuse_port=args.reuse_port,
                       worker_count=args.worker_count,
                       fast_tunnels=args.fast_tunnels,
                       extra_self_endpoints=tuple(args.also_self))
    runner = ProxyRunner(config)
    asyncio.run(runner.run())
    return 0


def _run_supervisor(args: argparse.Namespace) -> int:
    """Start N workers with the same policy options; the supervisor keeps the admin listener."""
    from .cli import load_from_args
    from .workers import Supervisor

    load_from_args(args)  # a policy that does not load fails here, once, with its file:line:column
    argv = _worker_argv(args.raw_argv)
    return asyncio.run(Supervisor(argv, args.workers, args.listen, None if args.no_admin else args.admin).run())


def _worker_argv(argv: list[str]) -> list[str]:
    """The command line minus what the supervisor decides for each worker."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in ("--workers", "--listen", "--admin"):
            skip = "=" not in arg
            continue
        if name == "--no-admin":
            continue
        out.append(arg)
    return out


def _die_with_supervisor() -> None:
    """A worker must not outlive its supervisor (it would keep serving the port unsupervised): ask the
    kernel for SIGTERM when the parent dies (Linux prctl PR_SET_PDEATHSIG)."""
    import ctypes
    import os
    import signal

    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the supervisor died before the request took effect
        raise SystemExit("egresswall: worker started without its supervisor")
