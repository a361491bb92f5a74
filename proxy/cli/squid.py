"""``egresswall squid import|export``: squid.conf access control to and from egresswall policies."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from squid_compat.conf import ConfError
from squid_compat.exporter import export_policy
from squid_compat.importer import NON_GLOBAL_RANGES, import_conf
from squid_compat.report import WARNING, printable

from policy.addresses import parse_cidr

from .options import load_policy_file


def register(sub: argparse._SubParsersAction) -> None:
    squid = sub.add_parser("squid", help="translate squid.conf access control to and from egresswall policies")
    commands = squid.add_subparsers(dest="squid_command", required=True)

    imp = commands.add_parser("import", help="a squid.conf's access control as an egresswall policy",
                              description="Translate the access-control part of a squid.conf (acl, http_access, "
                                          "include) into an egresswall policy. Warnings (file:line: reason) go to "
                                          "standard error and into comments in the policy.")
    imp.add_argument("conf", help="squid.conf")
    imp.add_argument("-o", "--output", metavar="FILE", help="write the policy here (default: standard output)")
    imp.add_argument("--readmit", action="append", default=[], metavar="CIDR", type=_cidr,
                     help="re-admit this non-global range (addresses.allow), e.g. a lab's; repeatable")
    imp.add_argument("--quiet", action="store_true", help="print warnings only, not notes")
    imp.epilog = ("Exit status: 0 when a policy was written; 1 when it was written but admits nothing squid allows "
                  "(for every client), or the squid.conf has no http_access line; 2 when the squid.conf cannot be "
                  "read or squid would refuse to start on it (an unknown directive, a missing include).")
    imp.set_defaults(func=cmd_import)

    exp = commands.add_parser("export", help="a squid.conf access-control section enforcing an egresswall policy")
    exp.add_argument("policy", help="policy.yaml")
    exp.add_argument("-o", "--output", metavar="FILE", help="write squid.conf here (default: standard output)")
    exp.set_defaults(func=cmd_export)


def _cidr(text: str) -> str:
    """A --readmit value: an address range, or a usage error saying what was wrong."""
    try:
        parse_cidr(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not an address range ({err})") from None
    return text


def cmd_import(args: argparse.Namespace) -> int:
    try:
        result = import_conf(args.conf, args.readmit)
    except ConfError as err:
        for line in str(err).split("\n"):  # each line escaped: it quotes file names and squid.conf text
            print(f"egresswall: {printable(line)}", file=sys.stderr)
        return 2
    for note in result.notes:
        if note.level == WARNING or not args.quiet or note.category == NON_GLOBAL_RANGES:  # always said
            print(note, file=sys.stderr)
    _write(args.output, result.yaml)
    warnings = len(result.warnings)
    written = f", policy written to {args.output}" if args.output else ""
    conf = printable(args.conf)
    if result.failure:
        # An allow-nothing policy is safe but useless: an operator must not deploy it believing it is a
        # translation. The policy is still written, for reading; the exit status says it failed.
        print(f"egresswall: {conf}: import FAILED: {result.failure}; {warnings} warning(s) above say why{written}",
              file=sys.stderr)
        return 1
    print(f"egresswall: {conf}: imported; {warnings} warning(s){written}", file=sys.stderr)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    _write(args.output, export_policy(load_policy_file(args.policy)))
    return 0


def _write(path: str | None, text: str) -> None:
    if path in (None, "-"):
        sys.stdout.write(text)
    else:
        Path(path).write_text(text, encoding="utf-8")
