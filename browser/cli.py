"""``egresswall browse`` and ``egresswall browser-server``: command-line glue.

Like ``proxy/cli.py`` this module may import the proxy: ``EmbeddedProxy`` runs egresswall in a
background thread of this process for commands given ``--policy`` (the rest of ``browser/`` needs only
a proxy address).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

from .launch import ContainmentError, plan_launch
from .reader import AuditRefusals, PageReader, ProxyQuery, ReadLimits, format_markdown, format_text

log = logging.getLogger("egresswall.browser")
EXIT_ALL_READ, EXIT_NOT_ALL_READ, EXIT_ERROR = 0, 1, 2


class EmbeddedProxy:
    """egresswall (``ProxyRunner``) on 127.0.0.1:<free port> in a background thread, with a fresh
    mitmproxy CA of its own and its refusals collected for the page reader."""

    def __init__(self, policy_path: str, overrides, upstream_ca: str | None = None, log_path: str | None = None,
                 confdir: str | None = None) -> None:
        from proxy.runner import ProxyRunner, RunConfig

        self._own_confdir = confdir is None
        self.confdir = confdir or tempfile.mkdtemp(prefix="egresswall-ca-")
        config = RunConfig(policy_path, overrides, listen=("127.0.0.1", 0), admin=None,
                           log_path=log_path or os.devnull, confdir=self.confdir, upstream_ca=upstream_ca)
        self.runner = ProxyRunner(config)  # loads the policy here: a bad file fails in the caller's thread
        self.refusals = AuditRefusals()
        self.runner.audit.listeners.append(self.refusals.record)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def policy(self):
        return self.runner.holder.policy

    @property
    def address(self) -> str:
        assert self.runner.listen_address is not None
        host, port = self.runner.listen_address[:2]
        return f"{host}:{port}"

    @property
    def ca_file(self) -> str:
        return str(Path(self.confdir) / "mitmproxy-ca-cert.pem")

    def intercepts_anything(self) -> bool:
        return any(rule.intercept for rule in self.policy.all_host_rules())

    def start(self, timeout: float = 30.0) -> EmbeddedProxy:
        started = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                task = loop.create_task(self.runner.run())
                loop.call_soon(lambda: loop.create_task(_signal_when_ready(self.runner, task, started)))
                loop.run_until_complete(task)
            except BaseException as err:  # reported to the starting thread
                self._error = err
            finally:
                started.set()
                loop.close()

        self._thread = threading.Thread(target=run, name="egresswall-proxy", daemon=True)
        self._thread.start()
        if not started.wait(timeout) or self._error is not None or self.runner.listen_address is None:
            raise RuntimeError(f"the in-process proxy did not start: {self._error or 'timeout'}")
        return self

    def stop(self, timeout: float = 15.0) -> None:
        if self._thread is not None and self._thread.is_alive() and self._loop is not None:
            self._loop.call_soon_threadsafe(self.runner.request_stop)
            self._thread.join(timeout)
        if self._own_confdir:
            shutil.rmtree(self.confdir, ignore_errors=True)

    def __enter__(self) -> EmbeddedProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def _signal_when_ready(runner, task: asyncio.Task, started: threading.Event) -> None:
    while not runner.ready.is_set() and not task.done():
        await asyncio.sleep(0.02)
    started.set()


# ---- shared options ------------------------------------------------------------------------------

def _add_proxy_choice(parser: argparse.ArgumentParser) -> None:
    from proxy.cli import add_policy_options
    from proxy.run_command import parse_hostport

    add_policy_options(parser)
    parser.set_defaults(policy=None)  # so an explicit --policy can be told from the default
    group = parser.add_argument_group("proxy")
    group.add_argument("--proxy", type=parse_hostport, metavar="HOST:PORT",
                       help="use this running egresswall instead of starting one in-process with --policy")
    group.add_argument("--proxy-ca", metavar="FILE",
                       help="with --proxy: the proxy's CA certificate (mitmproxy-ca-cert.pem) when it intercepts TLS")
    group.add_argument("--upstream-ca", metavar="FILE",
                       help="in-process proxy: also trust this CA for intercepted upstreams (labs, private CAs)")
    parser.add_argument("--no-sandbox", action="store_true",
                        help="start Chromium without its sandbox (logged). As root it must be given: "
                             "Chromium's sandbox cannot run as root")


def _proxy_from_args(args: argparse.Namespace) -> tuple[str, EmbeddedProxy | None, list[str]]:
    """(proxy address, the embedded proxy or None, CA files Chromium should accept for interception)."""
    from proxy.cli import overrides_from

    policy_given = args.policy is not None or args.allow_host or args.deny_host or args.allow_range or (
        args.deny_range or args.nameserver or args.default or args.mode)
    if args.proxy:
        if policy_given:
            raise ContainmentError("--proxy and --policy (or policy options) exclude each other: the running "
                                   "proxy has its own policy")
        if args.upstream_ca:
            raise ContainmentError("--upstream-ca is for the in-process proxy; a running proxy has its own settings")
        host, port = args.proxy
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return authority, None, [args.proxy_ca] if args.proxy_ca else []
    if args.proxy_ca:
        raise ContainmentError("--proxy-ca goes with --proxy; the in-process proxy makes its own CA")
    from policy.loader import DEFAULT_POLICY

    embedded = EmbeddedProxy(args.policy or str(DEFAULT_POLICY), overrides_from(args), upstream_ca=args.upstream_ca)
    embedded.start()
    ca_files = [embedded.ca_file] if embedded.intercepts_anything() else []
    return embedded.address, embedded, ca_files


def _logging() -> None:
    logging.basicConfig(level=logging.INFO, format="egresswall: %(message)s", stream=sys.stderr)
    logging.getLogger("mitmproxy").setLevel(logging.WARNING)
    logging.getLogger("websockets").setLevel(logging.WARNING)


# ---- browse --------------------------------------------------------------------------------------

def cmd_browse(args: argparse.Namespace) -> int:
    from playwright.sync_api import sync_playwright

    from .launch import launch

    _logging()
    try:
        limits = ReadLimits(max_chars=args.max_chars, timeout=args.timeout, max_links=args.max_links)
    except ValueError as err:
        print(f"egresswall: {err}", file=sys.stderr)
        return EXIT_ERROR
    prepared = _prepare(args)
    if prepared is None:
        return EXIT_ERROR
    address, embedded, plan = prepared
    host, _, port = address.rpartition(":")
    refusals = embedded.refusals if embedded else ProxyQuery(host.strip("[]"), int(port))
    try:
        with sync_playwright() as playwright:
            browser = launch(playwright, plan)
            try:
                results = PageReader(browser, refusals, limits).read_all(args.url, args.screenshot)
            finally:
                browser.close()
    except ContainmentError as err:
        print(f"egresswall: {err}", file=sys.stderr)
        return EXIT_ERROR
    finally:
        plan.cleanup()
        if embedded:
            embedded.stop()
    for index, result in enumerate(results):
        if args.format == "json":
            print(json.dumps(result.to_json(), ensure_ascii=False))
        else:
            if index:
                print("\n---\n")
            print(format_markdown(result) if args.format == "markdown" else format_text(result), end="")
    return EXIT_ALL_READ if all(r.read for r in results) else EXIT_NOT_ALL_READ


def _prepare(args: argparse.Namespace):
    """The proxy (named or embedded) and the launch plan both commands start from; None after an error
    was printed (an embedded proxy that was started is stopped again)."""
    embedded = None
    try:
        address, embedded, ca_files = _proxy_from_args(args)
        plan = plan_launch(address, ca_files=ca_files, sandbox=False if args.no_sandbox else None)
    except ContainmentError as err:
        if embedded:
            embedded.stop()
        print(f"egresswall: {err}", file=sys.stderr)
        return None
    return address, embedded, plan


# ---- browser-server ------------------------------------------------------------------------------

def cmd_browser_server(args: argparse.Namespace) -> int:
    from .server import BrowserServer, check_bind_address

    _logging()
    try:
        check_bind_address(args.host, args.allow_non_loopback)
    except ContainmentError as err:
        print(f"egresswall: {err}", file=sys.stderr)
        return EXIT_ERROR
    prepared = _prepare(args)
    if prepared is None:
        return EXIT_ERROR
    _, embedded, plan = prepared
    server = BrowserServer(plan, args.host, args.port)
    try:
        asyncio.run(server.run())
    except ContainmentError as err:
        print(f"egresswall: {err}", file=sys.stderr)
        return EXIT_ERROR
    finally:
        plan.cleanup()
        if embedded:
            embedded.stop()
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    browse = sub.add_parser("browse", help="read pages in the contained Chromium (exit 0 iff every URL was read)")
    browse.add_argument("url", nargs="+")
    _add_proxy_choice(browse)
    browse.add_argument("--format", choices=["text", "markdown", "json"], default="text")
    browse.add_argument("--screenshot", metavar="FILE", help="PNG of each page (FILE-1.png, FILE-2.png... for several)")
    browse.add_argument("--max-chars", type=int, default=ReadLimits.max_chars, metavar="N",
                        help="characters of content per page, cut at a paragraph break "
                             f"(default {ReadLimits.max_chars})")
    browse.add_argument("--timeout", type=float, default=ReadLimits.timeout, metavar="S",
                        help=f"seconds per page (default {ReadLimits.timeout:g})")
    browse.add_argument("--max-links", type=int, default=ReadLimits.max_links, metavar="N",
                        help=f"URLs read per call; the rest are reported as not read (default {ReadLimits.max_links})")
    browse.set_defaults(func=cmd_browse)

    server = sub.add_parser("browser-server", help="a shared, contained Chromium for remote Playwright clients "
                                                   "(no authentication: never publish it)")
    server.add_argument("--port", type=int, default=3000)
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--allow-non-loopback", action="store_true",
                        help="allow binding a non-loopback address (the server has NO authentication)")
    _add_proxy_choice(server)
    server.set_defaults(func=cmd_browser_server)
