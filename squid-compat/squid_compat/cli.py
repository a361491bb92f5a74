"""``egresswall squid import|export``: registered into the egresswall command line by proxy/cli.py."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    squid = sub.add_parser("squid", help="translate squid.conf access control to and from egresswall policies")
    commands = squid.add_subparsers(dest="squid_command", required=True)

    imp = commands.add_parser("import", help="a squid.conf's access control as an egresswall policy",
                              description="Translate the access-control part of a squid.conf (acl, http_access, "
                                          "include) into an egresswall policy. Warnings (file:line: reason) go to "
                                          "standard error and into comments in the policy.")
    imp.add_argument("conf", help="squid.conf")
    imp.add_argument("-o", "--output", metavar="FILE", help="write the policy here (default: standard output)")
    imp.add_argument("--readmit", action="append", default=[], metavar="CIDR",
                     help="re-admit this non-global range (addresses.allow), e.g. a lab's; repeatable")
    imp.add_argument("--quiet", action="store_true", help="print warnings only, not notes")
    imp.set_defaults(func=cmd_import)

    exp = commands.add_parser("export", help="a squid.conf access-control section enforcing an egresswall policy")
    exp.add_argument("policy", help="policy.yaml")
    exp.add_argument("-o", "--output", metavar="FILE", help="write squid.conf here (default: standard output)")
    exp.set_defaults(func=cmd_export)


def cmd_import(args: argparse.Namespace) -> int:
    from .conf import ConfError
    from .importer import import_conf
    from .report import WARNING

    try:
        result = import_conf(args.conf, args.readmit)
    except ConfError as err:
        print(f"egresswall: {err}", file=sys.stderr)
        return 2
    for note in result.notes:
        if note.level == WARNING or not args.quiet:
            print(note, file=sys.stderr)
    _write(args.output, result.yaml)
    warnings = len(result.warnings)
    print(f"egresswall: {args.conf}: imported; {warnings} warning(s)"
          + (f", policy written to {args.output}" if args.output else ""), file=sys.stderr)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from proxy.policy_file import load_policy_file  # the CLI reads files; squid_compat itself imports only policy

    from .exporter import export_policy

    _write(args.output, export_policy(load_policy_file(args.policy)))
    return 0


def _write(path: str | None, text: str) -> None:
    if path in (None, "-"):
        sys.stdout.write(text)
    else:
        Path(path).write_text(text, encoding="utf-8")
