"""``egresswall browse URL...``: read pages in the contained Chromium (exit 0 iff every URL was read)."""

from __future__ import annotations

import argparse
import json

from browser.launch import launch
from browser.reader import PageReader, ProxyQuery, ReadLimits, format_markdown, format_text
from policy.hosts import split_host_port

from . import logs
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
    browse.set_defaults(func=cmd_browse)


def cmd_browse(args: argparse.Namespace) -> int:
    from playwright.sync_api import sync_playwright

    logs.configure(quiet_libraries=("websockets",))
    try:
        limits = ReadLimits(max_chars=args.max_chars, timeout=args.timeout, max_links=args.max_links)
    except ValueError as err:
        raise UsageError(str(err)) from None
    with browser_proxy(args) as proxy:
        refusals = proxy.embedded.refusals if proxy.embedded else ProxyQuery(*split_host_port(proxy.address))
        with sync_playwright() as playwright:
            browser = launch(playwright, proxy.plan)
            try:
                results = PageReader(browser, refusals, limits).read_all(args.url, args.screenshot)
            finally:
                browser.close()
    for index, result in enumerate(results):
        if args.format == "json":
            print(json.dumps(result.to_json(), ensure_ascii=False))
        else:
            if index:
                print("\n---\n")
            print(format_markdown(result) if args.format == "markdown" else format_text(result), end="")
    return EXIT_ALL_READ if all(r.read for r in results) else EXIT_NOT_ALL_READ
