"""The ``egresswall`` command line: the composition root. It imports every package (policy, proxy,
browser, squid_compat) and wires them into commands; nothing imports it.

One module per command (``check``, ``lint``, ``run``, ``browse``, ``browser_server``, ``squid``), the
options they share (``options``), how failures are told (``errors``), and the pieces that join
packages: the in-process proxy ``browse`` uses (``embedded``) and a worker of ``run --workers N``
(``worker``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import select
import sys
from collections.abc import Sequence

from proxy.build import versions

from .errors import EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, describe

# Each command and the module that registers it, in the order --help lists them. The parser is built with
# the one command named on the command line only, so that `run` (and each of its workers) does not import
# the browser, Playwright's helpers, the squid translator or the audit-log tools it never uses: each costs
# memory in every process (README, "Speed"). With no command named (--help, --version, a mistyped name)
# every command is registered, so argparse lists them all.
COMMANDS = {"check": "check", "lint": "lint", "run": "run", "browse": "browse", "browser-server": "browser_server",
            "squid": "squid", "replay": "operators", "suggest": "operators"}


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="egresswall", description="An egress firewall for browsers and agents.")
    parser.add_argument("--version", action="version", version=version())
    sub = parser.add_subparsers(dest="command", required=True)
    named = _command_named(sys.argv[1:] if argv is None else argv)
    for module in [COMMANDS[named]] if named else dict.fromkeys(COMMANDS.values()):
        importlib.import_module(f"{__name__}.{module}").register(sub)
    _no_abbreviations(parser)
    return parser


def _command_named(argv: Sequence[str]) -> str | None:
    """The command on the command line: the first argument that is not an option (the top level takes
    none with a value), when it is one of COMMANDS."""
    first = next((arg for arg in argv if not arg.startswith("-")), None)
    return first if first in COMMANDS else None


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


def _command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)command the command line chose: ``squid import``'s, not ``egresswall``'s."""
    while True:
        chosen = next((action for action in parser._actions if isinstance(action, argparse._SubParsersAction)), None)
        name = getattr(args, chosen.dest, None) if chosen is not None else None
        if name not in (chosen.choices if chosen is not None else {}):
            return parser
        parser = chosen.choices[name]


def _parse_intermixed(parser: argparse.ArgumentParser, args: argparse.Namespace,
                      argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """A command whose positionals may come after its options (``check URL --json URL2``): argparse takes a
    positional list only where it starts, so the command's own parser reads its arguments again, intermixed."""
    command = _command_parser(parser, args)
    rest = argv[argv.index(args.command) + 1:]  # the top level takes no option with a value (_command_named)
    reread, unknown = command.parse_known_intermixed_args(rest)
    reread.command = args.command
    return reread, unknown


def _stdout_reader_gone() -> bool:
    """Whether standard output is a pipe (or socket) whose reading end is closed: poll() reports POLLERR."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no file descriptor (a test's captured stdout)
        return False


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(argv)
    args, unknown = parser.parse_known_args(argv)  # a usage error: argparse's usage line and message, exit 2
    if unknown and getattr(args, "intermixed", False):
        args, unknown = _parse_intermixed(parser, args, sys.argv[1:] if argv is None else list(argv))
    if unknown:
        # argparse would report these with the top-level usage ("egresswall [-h] [--version] {lint} ..."), which
        # says nothing of the options the command does take: the command's own parser says it, with its usage.
        command = _command_parser(parser, args)
        command.error(f"unrecognized arguments: {' '.join(unknown)} (see {command.prog} --help)")
    try:
        status = args.func(args)
        sys.stdout.flush()  # a reader that went away (| head) shows here, not in the interpreter's flush at exit
        return status
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError as err:
        if not _stdout_reader_gone():
            message, status = describe(err)  # some other pipe: not the reader of our output
            print(f"egresswall: {message}", file=sys.stderr, flush=True)
            return status
        # `egresswall replay ... | head -1`: the reader has what it wanted. Quiet, with the status a shell gives
        # a process that SIGPIPE ended (128 + 13); stdout goes to /dev/null so the exit's flush cannot complain.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except Exception as err:
        message, status = describe(err)
        for line in message.splitlines() or [""]:  # a policy with several problems: one line each
            print(f"egresswall: {line}", file=sys.stderr, flush=True)
        return status
