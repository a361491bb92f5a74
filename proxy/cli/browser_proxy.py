"""The proxy ``browse`` and ``browser-server`` put the browser behind: a running egresswall named with
``--proxy``, or one started in this process (``EmbeddedProxy``) from the policy options."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from browser.launch import ContainmentError, LaunchPlan, plan_launch
from policy.model import REQUIRED
from proxy.listeners import authority

from .embedded import EmbeddedProxy
from .options import add_policy_options, overrides_from, parse_hostport, policy_options_given, policy_path


def add_proxy_choice(parser: argparse.ArgumentParser) -> None:
    add_policy_options(parser, default_policy=None)  # so an explicit --policy can be told from the default
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


@dataclass
class BrowserProxy:
    address: str  # HOST:PORT, an IPv6 address in brackets
    embedded: EmbeddedProxy | None
    plan: LaunchPlan


@contextlib.contextmanager
def browser_proxy(args: argparse.Namespace, require_sessions: bool = False) -> Iterator[BrowserProxy]:
    """The proxy (named or embedded) and the launch plan both commands start from; on the way out the
    plan's files are removed and an embedded proxy is stopped. ``require_sessions``: the embedded proxy
    requires a session of every client (``browse``: its one client is the browser it reads with)."""
    address, embedded, ca_files = _proxy_from_args(args, require_sessions)
    try:
        plan = plan_launch(address, ca_files=ca_files, sandbox=False if args.no_sandbox else None)
    except BaseException:
        if embedded:
            embedded.stop()
        raise
    try:
        yield BrowserProxy(address, embedded, plan)
    finally:
        plan.cleanup()
        if embedded:
            embedded.stop()


def _proxy_from_args(args: argparse.Namespace, require_sessions: bool = False
                     ) -> tuple[str, EmbeddedProxy | None, list[str]]:
    """(proxy address, the embedded proxy or None, CA files Chromium should accept for interception)."""
    if args.proxy:
        if policy_options_given(args):
            raise ContainmentError("--proxy and --policy (or policy options) exclude each other: the running "
                                   "proxy has its own policy")
        if args.upstream_ca:
            raise ContainmentError("--upstream-ca is for the in-process proxy; a running proxy has its own settings")
        return authority(*args.proxy), None, [args.proxy_ca] if args.proxy_ca else []
    if args.proxy_ca:
        raise ContainmentError("--proxy-ca goes with --proxy; the in-process proxy makes its own CA")
    overrides = overrides_from(args)
    if require_sessions:
        overrides.session = REQUIRED
    embedded = EmbeddedProxy(policy_path(args), overrides, upstream_ca=args.upstream_ca).start()
    ca_files = [embedded.ca_file] if embedded.intercepts_anything() else []
    return embedded.address, embedded, ca_files
