"""``egresswall lint FILE``: validate a policy file and warn about rules that cannot match."""

from __future__ import annotations

import argparse

from policy.lint import LintWarning, lint, notes
from policy.model import Policy
from policy.patterns import PatternKind

from ..suggest import is_public_suffix
from .options import load_policy_file


def register(sub: argparse._SubParsersAction) -> None:
    lint_cmd = sub.add_parser("lint", help="validate a policy file and warn about rules that cannot match")
    lint_cmd.add_argument("file")
    lint_cmd.add_argument("--strict", action="store_true", help="exit 1 when there are warnings")
    lint_cmd.set_defaults(func=cmd_lint)


def cmd_lint(args: argparse.Namespace) -> int:
    policy = load_policy_file(args.file)
    warnings = sorted(lint(policy) + public_suffix_rules(policy),  # in file order, as errors are shown
                      key=lambda w: (w.origin.line, w.origin.column))
    for warning in warnings:
        print(f"warning: {warning}")
    for note in notes(policy):
        print(f"note: {note}")
    rules = sum(1 for _ in policy.all_host_rules())
    print(f"{args.file}: valid; {rules} host rule(s), {len(policy.roles)} role(s), {len(warnings)} warning(s)")
    return 1 if warnings and args.strict else 0


def public_suffix_rules(policy: Policy) -> list[LintWarning]:
    """Allow rules that take in every name under a public suffix (``.com``, ``*.co.uk``, ``.github.io``): names
    under it belong to many owners (the Public Suffix List, bundled with publicsuffixlist; read here, in the CLI,
    because the policy core does no I/O). ``suggest`` never proposes one; lint says so of one written by hand."""
    out = []
    for prefix, table in [("", policy.allow)] + [(f"role {role.name}: ", role.allow) for role in policy.roles]:
        for rule in table.rules:
            if rule.pattern.kind is not PatternKind.EXACT and is_public_suffix(rule.pattern.name):
                out.append(LintWarning(rule.origin, f"{prefix}allow {rule.pattern.text} takes in every name under "
                                                    f"the public suffix {rule.pattern.name}, which many owners share; "
                                                    "name the owner's domain (example."
                                                    f"{rule.pattern.name}) instead"))
    return out
