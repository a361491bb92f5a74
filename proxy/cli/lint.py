"""``egresswall lint FILE``: validate a policy file and warn about rules that cannot match."""

from __future__ import annotations

import argparse

from policy.lint import lint, notes

from .options import load_policy_file


def register(sub: argparse._SubParsersAction) -> None:
    lint_cmd = sub.add_parser("lint", help="validate a policy file and warn about rules that cannot match")
    lint_cmd.add_argument("file")
    lint_cmd.add_argument("--strict", action="store_true", help="exit 1 when there are warnings")
    lint_cmd.set_defaults(func=cmd_lint)


def cmd_lint(args: argparse.Namespace) -> int:
    policy = load_policy_file(args.file)
    warnings = lint(policy)
    for warning in warnings:
        print(f"warning: {warning}")
    for note in notes(policy):
        print(f"note: {note}")
    rules = sum(1 for _ in policy.all_host_rules())
    print(f"{args.file}: valid; {rules} host rule(s), {len(policy.roles)} role(s), {len(warnings)} warning(s)")
    return 1 if warnings and args.strict else 0
