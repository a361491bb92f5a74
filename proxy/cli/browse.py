"""``egresswall browse URL...``: read pages in the contained Chromium (exit 0 iff every URL was read).

With the in-process proxy (``--policy``) the pages are read under a session (``browse_session.py``) that
grants exactly the URLs given, plus what ``--subresources`` lets a page's own requests reach; that proxy
requires the session of its one client, the browser. A running proxy (``--proxy``) is used as it is.
"""

from __future__ import annotations

import argparse
import json
import sys

from browser.launch import launch
from browser.reader import PageReader, ProxyQuery, ReadLimits, format_markdown, format_text
from browser.session_connect import session_proxy
from policy.credentials import Credentials
from policy.hosts import split_host_port

from . import logs
from .browse_session import DEFAULT_SUBRESOURCES, SUBRESOURCES, browse_grants, reading_ttl
from .browser_proxy import add_proxy_choice, browser_proxy
from .errors import UsageError

EXIT_ALL_READ, EXIT_NOT_ALL_READ = 0, 1


def register(sub: argparse._SubParsersAction) -> None:
    browse = sub.add_parser("browse", help="read pages in the contained Chromium (exit 0 iff every URL was read)")
    browse.add_argument("url", nargs="+")
    add_proxy_choice(browse)
    browse.add_argument("--format", choices=["text", "markdown", "json"], default="text")
    browse.add_argument("--screenshot", metavar="FILE", help="PNG of each page (FILE-1.png, FILE-2.png... for several)")
    browse.add_argument("--max-chars", type=int, default=ReadLimits.max_chars, metavar="N",
                        help="characters of content per page, cut at a paragraph break "
                             f"(default {ReadLimits.max_chars})")
    browse.add_argument("--timeout", type=float, default=ReadLimits.timeout, metavar="S",
                        help=f"seconds per page (default {ReadLimits.timeout:g})")
    browse.add_argument("--max-links", type=int, default=ReadLimits.max_links, metavar="N",
                        help=f"URLs read per call; the rest are reported as not read (default {ReadLimits.max_links})")
    browse.add_argument("--subresources", choices=SUBRESOURCES, default=None,
                        help="in-process proxy: what a page's own requests may reach besides the URLs given: "
                             "same-site (hosts sharing a registrable domain with a URL), none (the URLs only) "
                             f"or policy (whatever the policy allows: no session) (default {DEFAULT_SUBRESOURCES})")
    browse.set_defaults(func=cmd_browse)


def cmd_browse(args: argparse.Namespace) -> int:
    from playwright.sync_api import sync_playwright

    logs.configure(quiet_libraries=("websockets",))
    try:
        limits = ReadLimits(max_chars=args.max_chars, timeout=args.timeout, max_links=args.max_links)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if args.proxy and args.subresources is not None:
        raise UsageError("--subresources needs the in-process proxy (--policy): browse cannot create a session "
                         "on a running proxy")
    grants = None
    if not args.proxy:
        to_read = args.url[:limits.max_links]
        try:
            grants = browse_grants(to_read, args.subresources or DEFAULT_SUBRESOURCES,
                                   reading_ttl(len(to_read), limits.timeout))
        except ValueError as err:
            raise UsageError(str(err)) from None
        for url, why in grants.not_granted:
            print(f"egresswall: not granted to the session, so the proxy will refuse it: {url}: {why}",
                  file=sys.stderr)
    with browser_proxy(args, require_sessions=grants is not None and grants.spec is not None) as proxy:
        refusals = proxy.embedded.refusals if proxy.embedded else ProxyQuery(*split_host_port(proxy.address))
        context_proxy = None
        session_id = None
        if proxy.embedded and grants is not None and grants.spec is not None:
            session, secret = proxy.embedded.create_session(grants.spec)
            session_id = session.id
            context_proxy = session_proxy(proxy.plan.proxy_server, Credentials(session.id, secret))
        try:
            with sync_playwright() as playwright:
                browser = launch(playwright, proxy.plan)
                try:
                    results = PageReader(browser, refusals, limits, context_proxy).read_all(args.url,
                                                                                           args.screenshot)
                finally:
                    browser.close()
        finally:
            if session_id is not None and proxy.embedded is not None:
                proxy.embedded.end_session(session_id)
    for index, result in enumerate(results):
        if args.format == "json":
            print(json.dumps(result.to_json(), ensure_ascii=False))
        else:
            if index:
                print("\n---\n")
            print(format_markdown(result) if args.format == "markdown" else format_text(result), end="")
    return EXIT_ALL_READ if all(r.read for r in results) else EXIT_NOT_ALL_READ
