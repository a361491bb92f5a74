"""The ``egresswall`` command line: the composition root. It imports every package (policy, proxy,
browser, squid_compat) and wires them into commands; nothing imports it.

One module per command (``check``, ``lint``, ``run``, ``browse``, ``browser_server``, ``squid``), the
options they share (``options``), how failures are told (``errors``), and the pieces that join
packages: the in-process proxy ``browse`` uses (``embedded``) and a worker of ``run --workers N``
(``worker``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from proxy.build import versions

from . import browse, browser_server, check, lint, operators, run, squid
from .errors import EXIT_INTERRUPTED, describe

COMMANDS = (check, lint, run, browse, browser_server, squid, operators)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="egresswall", description="An egress firewall for browsers and agents.")
    parser.add_argument("--version", action="version", version=version())
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    _no_abbreviations(parser)
    return parser


def version() -> str:
    built = versions()
    return f"egresswall {built['version']} (mitmproxy {built['mitmproxy']}, Python {built['python']})"


def _no_abbreviations(parser: argparse.ArgumentParser) -> None:
    """``--no-adm`` must not mean ``--no-admin``: options are spelt out."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _no_abbreviations(child)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # a usage error: argparse's usage line and message, exit 2
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as err:
        message, status = describe(err)
        for line in message.splitlines() or [""]:  # a policy with several problems: one line each
            print(f"egresswall: {line}", file=sys.stderr, flush=True)
        return status
