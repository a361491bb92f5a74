"""``egresswall run``: the proxy with a policy, until SIGTERM; with ``--workers N`` a supervisor of N
proxy processes (``proxy/workers.py``)."""

from __future__ import annotations

import argparse
import asyncio
import errno
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from policy.model import Policy
from policy.resolver import DnsResolver
from proxy import event_loop
from proxy.listeners import authority
from proxy.open_files import raise_soft_limit
from proxy.run_config import RunConfig
from proxy.sessions.api import read_token_file
from proxy.sessions.store_url import check_store_url, redacted

from . import logs
from .errors import UsageError
from .options import add_policy_options, load_from_args, overrides_from, parse_hostport

if TYPE_CHECKING:
    from proxy.runner import ProxyRunner

DEFAULT_LISTEN = ("127.0.0.1", 3128)
MITMPROXY_CONF_DIR = "~/.mitmproxy"  # mitmproxy.options.CONF_DIR, without importing mitmproxy (tests check both agree)
DEFAULT_ADMIN = ("127.0.0.1", 3131)  # not 9090: that is Prometheus's own port (README, "Admin port")


def register(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser("run", help="run the proxy")
    add_policy_options(run)
    run.add_argument("--listen", type=parse_hostport, default=DEFAULT_LISTEN, metavar="HOST:PORT",
                     help=f"proxy listener (default {authority(*DEFAULT_LISTEN)})")
    run.add_argument("--admin", type=parse_hostport, default=DEFAULT_ADMIN, metavar="HOST:PORT",
                     help=f"admin listener with /healthz, /readyz, /metrics (default {authority(*DEFAULT_ADMIN)})")
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
    run.add_argument("--fast-http", action=argparse.BooleanOptionalAction, default=True,
                     help="relay plain-HTTP requests (absolute-form http://, not intercepted, no upgrade) in "
                          "egresswall's own front, parsed with h11, rather than through mitmproxy (default: on; "
                          "--no-fast-http hands them to mitmproxy)")
    run.add_argument("--uvloop", action=argparse.BooleanOptionalAction, default=True,
                     help="run on uvloop's event loop, in C (default: on; --no-uvloop runs the standard library's)")
    run.add_argument("--admin-token-file", metavar="FILE",
                     help="turn on the session API (/v1/sessions on the admin listener): clients of it send "
                          "Authorization: Bearer <the file's content>; the file must be mode 600. Without it the "
                          "API is off")
    run.add_argument("--session-store", metavar="URL",
                     help="where sessions and their budgets live: memory (default; this process only) or "
                          "redis://HOST:PORT/DB, shared by --workers and replicas")
    run.set_defaults(func=cmd_run)


def run_config_from(args: argparse.Namespace) -> RunConfig:
    if args.log not in (None, "-"):
        _check_log_file(args.log)
    if args.confdir:
        _check_confdir(args.confdir)
    if args.upstream_ca is not None and not os.path.isfile(args.upstream_ca):
        raise UsageError(f"--upstream-ca {args.upstream_ca}: no such file (a PEM bundle of CA certificates)")
    _check_sessions(args)
    return RunConfig(policy_path=args.policy, overrides=overrides_from(args), listen=args.listen,
                     admin=None if args.no_admin else args.admin, log_path=args.log, log_format=args.log_format,
                     confdir=args.confdir, upstream_ca=args.upstream_ca, fast_tunnels=args.fast_tunnels,
                     fast_http=args.fast_http, uvloop=args.uvloop,
                     admin_token_file=args.admin_token_file, session_store=args.session_store)


def _check_sessions(args: argparse.Namespace) -> None:
    """The session options, judged before anything starts, with the option's name in the message."""
    if args.admin_token_file is not None:
        try:
            read_token_file(args.admin_token_file)
        except ValueError as err:
            raise UsageError(f"--admin-token-file {args.admin_token_file}: {err}") from None
        if args.no_admin:
            raise UsageError("--admin-token-file serves the session API on the admin listener; drop --no-admin")
    if args.session_store is not None:
        try:
            check_store_url(args.session_store)
        except ValueError as err:
            raise UsageError(f"--session-store {redacted(args.session_store)}: {err}") from None
    shared = args.session_store not in (None, "memory")
    if args.workers > 1 and args.admin_token_file is not None and not shared:
        raise UsageError(f"--workers {args.workers} with sessions needs a shared store: each worker's memory holds "
                         "only its own; give --session-store redis://HOST:PORT/DB")


def cmd_run(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise UsageError(f"--workers {args.workers}: at least 1")
    logs.configure()
    raise_soft_limit()  # before the workers start: they inherit it (proxy/open_files.py)
    config = run_config_from(args)
    if args.workers > 1:
        # The supervisor never proxies: it does not import mitmproxy (proxy/run_config.py), only its workers do;
        # and a worker, which imports this module for serve(), does not import the supervisor.
        from proxy.workers import Supervisor

        policy = load_from_args(args)  # a policy that does not load fails here, once, with its file:line:column
        if policy.upstream is not None:
            raise UsageError(f"--workers {args.workers}: not supported with an upstream proxy "
                             f"({policy.upstream.url}); run one process (the upstream does the heavy lifting)")
        confdir = config.confdir or MITMPROXY_CONF_DIR

        def announce(listen: tuple[str, int], admin: tuple[str, int] | None) -> None:
            say(startup_line(listen, admin, policy, config, confdir, workers=args.workers))

        return event_loop.run(Supervisor(config, args.workers, on_ready=announce).run(), config.uvloop)
    from proxy.runner import ProxyRunner

    runner = ProxyRunner(config)  # loads the policy: a bad file fails here
    event_loop.run(serve(runner, lambda: say(startup_line_of(runner))), config.uvloop)
    return 0


def _check_log_file(path: str) -> None:
    """The audit log opens now, with the option's name in the error, not deep inside start-up."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640))
    except OSError as err:
        raise UsageError(f"--log {path}: the audit log cannot be opened: {err.strerror.lower()}; give a file in a "
                         "directory that exists and this user may write") from None


# What mitmproxy reads from a confdir that holds a CA already: then it writes nothing there (a shared CA mounted
# read-only from a Kubernetes Secret: compose/k8s/shared/proxy.yaml).
CA_FILES = ("mitmproxy-ca.pem", "mitmproxy-dhparam.pem")


def _check_confdir(path: str) -> None:
    """mitmproxy reports a CA directory it cannot create as an addon error with a traceback, and runs on
    without a CA: say it here instead, in one line. A directory it cannot write is fine when the CA is
    there already, readable (mitmproxy only reads it then)."""
    directory = Path(path).expanduser()
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        if all(os.access(directory / name, os.R_OK) for name in CA_FILES) and os.access(directory, os.X_OK):
            return
        if not os.access(directory, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    except OSError as err:
        raise UsageError(f"--confdir {path}: cannot be used as mitmproxy's CA directory: "
                         f"{(err.strerror or str(err)).lower()}; give a directory this user can create and write "
                         "(the CA's private key is made there: not a folder other users share), or one that holds "
                         "mitmproxy-ca.pem and mitmproxy-dhparam.pem it can read (a CA mounted read-only)") from None


async def serve(runner: ProxyRunner, on_ready: Callable[[], None]) -> None:
    """Run the proxy until it stops; ``on_ready`` once it listens (not at all when it fails to start)."""
    running = asyncio.ensure_future(runner.run())
    ready = asyncio.ensure_future(runner.ready.wait())
    await asyncio.wait({running, ready}, return_when=asyncio.FIRST_COMPLETED)
    if runner.ready.is_set():
        on_ready()
    ready.cancel()
    try:
        await running
    finally:
        asyncio.get_running_loop().set_exception_handler(_quiet_about_cancelled_tasks)


def _quiet_about_cancelled_tasks(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """After the proxy stopped, asyncio cancels the connection tasks still open; CPython before 3.12.2
    reports each such cancellation as "Exception in callback" with a traceback (its stream callback
    asks a cancelled task for its exception). A cancelled task at shutdown is not an error."""
    if isinstance(context.get("exception"), asyncio.CancelledError):
        return
    loop.default_exception_handler(context)


def startup_line_of(runner: ProxyRunner) -> str:
    assert runner.listen_address is not None and runner.master is not None
    return startup_line(runner.listen_address, runner.admin_address, runner.holder.policy, runner.config,
                        runner.master.options.confdir)


def startup_line(listen: tuple[str, int], admin: tuple[str, int] | None, policy: Policy, config: RunConfig,
                 confdir: str, workers: int | None = None) -> str:
    """The line that tells people what started: where it listens (``tests/proxyproc.py`` reads the
    first part), the policy, whom it asks for names, where the audit log goes, and the CA clients must
    trust when the policy intercepts TLS."""
    parts = [f"proxy on {authority(*listen[:2])}" + (f", admin on http://{authority(*admin[:2])}" if admin else "")
             + (f", {workers} workers" if workers else "")]
    parts.append(f"policy {policy.source} ({policy.mode}, default {policy.default})")
    parts.append(f"nameservers {_nameservers(policy)}")
    log = "standard output" if config.log_path in (None, "-") else config.log_path
    parts.append(f"audit log {log} ({config.log_format})")
    if policy.upstream is not None:
        parts.append(upstream_words(policy))
    if config.admin_token_file or config.session_store:
        api = "session API on" if config.admin_token_file else "session API off (no --admin-token-file)"
        parts.append(f"{api}, session store {redacted(config.session_store or 'memory')}")  # never a password
    if any(rule.intercept for rule in policy.all_host_rules()):
        parts.append(f"interception CA {Path(confdir).expanduser() / 'mitmproxy-ca-cert.pem'}")
    return "; ".join(parts)


def upstream_words(policy: Policy) -> str:
    """What an upstream proxy changes, said wherever the guarantee is stated (the startup line, ``check``)."""
    upstream = policy.upstream
    assert upstream is not None
    credentials = f", credentials from {upstream.credentials_file}" if upstream.credentials_file else ""
    return (f"upstream proxy {upstream.url}{credentials}: address guarantee WEAKENED, the upstream resolves names "
            "itself (egresswall decides on its own resolution but cannot pin the connection)")


def _nameservers(policy: Policy) -> str:
    if policy.resolver.nameservers:
        return _servers_text(policy.resolver.nameservers)
    found = DnsResolver.for_policy(policy).nameservers  # what the proxy will ask: /etc/resolv.conf's
    return f"{_servers_text(found) or 'none'} (from /etc/resolv.conf)"


def _servers_text(servers: Iterable[tuple[str, int]]) -> str:
    return ", ".join(ip if port == 53 else authority(ip, port) for ip, port in servers)


def say(line: str) -> None:
    print(f"egresswall: {line}", file=sys.stderr, flush=True)
