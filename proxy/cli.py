"""The ``egresswall`` command line. The one module that imports every package."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence

from policy.decision import Request, Verdict, refuse_form
from policy.hosts import HostFormError, parse_url
from policy.lint import lint
from policy.loader import DEFAULT_POLICY, Overrides, PolicyError, load_policy, parse_nameserver
from policy.model import Policy
from policy.resolver import DnsResolver, resolve_and_decide

EXIT_ALLOWED, EXIT_REFUSED, EXIT_ERROR = 0, 1, 2


def add_policy_options(parser: argparse.ArgumentParser) -> None:
    """The options every command that takes a policy accepts; they add to the file (labs, tests)."""
    group = parser.add_argument_group("policy")
    group.add_argument("--policy", default=str(DEFAULT_POLICY), metavar="FILE",
                       help="policy file (default: the bundled policy/default.yaml)")
    group.add_argument("--default", choices=["allow", "deny"], help="replace the policy's default action")
    group.add_argument("--mode", choices=["enforce", "report"], help="replace the policy's mode")
    group.add_argument("--allow-host", action="append", default=[], metavar="PATTERN",
                       help="add a host allow rule (example.com, *.example.com, .example.com); repeatable")
    group.add_argument("--deny-host", action="append", default=[], metavar="PATTERN", help="add a host deny rule")
    group.add_argument("--allow-range", action="append", default=[], metavar="CIDR",
                       help="re-admit an address range (the only way a non-global address passes)")
    group.add_argument("--deny-range", action="append", default=[], metavar="CIDR", help="refuse an address range")
    group.add_argument("--nameserver", action="append", default=[], metavar="IP[:PORT]",
                       help="ask this nameserver (replaces the policy's list); repeatable")


def overrides_from(args: argparse.Namespace) -> Overrides:
    for ns in args.nameserver:
        parse_nameserver(ns)  # a bad flag is an error here, with the flag's own words
    return Overrides(default=args.default, mode=args.mode, allow_hosts=args.allow_host, deny_hosts=args.deny_host,
                     allow_ranges=args.allow_range, deny_ranges=args.deny_range, nameservers=args.nameserver)


def load_from_args(args: argparse.Namespace) -> Policy:
    return load_policy(args.policy, overrides_from(args))


# ---- check -------------------------------------------------------------------------------------------

def cmd_check(args: argparse.Namespace) -> int:
    policy = load_from_args(args)
    resolver = DnsResolver.for_policy(policy)
    results = [asyncio.run(_check_one(policy, resolver, url, args)) for url in args.url]
    for url, verdict, resolution in results:
        if args.json:
            print(json.dumps(_verdict_json(url, verdict, resolution)))
        else:
            _print_verdict(url, verdict, resolution)
    return EXIT_ALLOWED if all(v.allowed for _, v, _ in results) else EXIT_REFUSED


async def _check_one(policy: Policy, resolver: DnsResolver, url: str, args: argparse.Namespace):
    try:
        target = parse_url(url)
    except HostFormError as err:
        return url, refuse_form(err), None
    tunnel = target.scheme in ("https", "wss") and not policy.intercepts(target.host)
    request = Request(target=target, method=args.method.upper(), client=args.client, tunnel=tunnel,
                      websocket=target.scheme in ("ws", "wss"))
    verdict, resolution = await resolve_and_decide(policy, request, resolver)
    return url, verdict, resolution


def _verdict_word(verdict: Verdict) -> str:
    if verdict.report_only:
        return "ALLOWED (report mode; enforce would refuse)"
    return "ALLOWED" if verdict.allowed else "REFUSED"


def _print_verdict(url: str, verdict: Verdict, resolution) -> None:
    rows = [("url", url), ("verdict", _verdict_word(verdict)), ("stage", verdict.stage), ("rule", verdict.rule),
            ("reason", verdict.reason)]
    if verdict.role:
        rows.append(("role", verdict.role))
    if resolution is not None and resolution.cnames:
        rows.append(("cnames", " -> ".join(resolution.cnames)))
    if verdict.addresses:
        rows.append(("resolved", ", ".join(verdict.addresses)))
    if verdict.pinned:
        rows.append(("connect", verdict.pinned))
    for key, value in rows:
        print(f"{key:<9} {value}")
    print()


def _verdict_json(url: str, verdict: Verdict, resolution) -> dict:
    return {"url": url, "allowed": verdict.allowed, "report_only": verdict.report_only, "stage": verdict.stage,
            "rule": verdict.rule, "reason": verdict.reason, "role": verdict.role,
            "cnames": list(resolution.cnames) if resolution else [], "addresses": list(verdict.addresses),
            "connect": verdict.pinned}


# ---- lint --------------------------------------------------------------------------------------------

def cmd_lint(args: argparse.Namespace) -> int:
    policy = load_policy(args.file)
    warnings = lint(policy)
    for warning in warnings:
        print(f"warning: {warning}")
    rules = sum(1 for _ in policy.all_host_rules())
    print(f"{args.file}: valid; {rules} host rule(s), {len(policy.roles)} role(s), {len(warnings)} warning(s)")
    return 1 if warnings and args.strict else 0


# ---- entry point -------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="egresswall", description="An egress firewall for browsers and agents.")
    sub = parser.add_subparsers(dest="command", required=True)

    check = sub.add_parser("check", help="explain why a URL is allowed or refused (exit 0 allowed, 1 refused)")
    check.add_argument("url", nargs="+")
    add_policy_options(check)
    check.add_argument("--client", help="the client address (chooses a role)")
    check.add_argument("--method", default="GET")
    check.add_argument("--json", action="store_true", help="one JSON object per URL")
    check.set_defaults(func=cmd_check)

    lint_cmd = sub.add_parser("lint", help="validate a policy file and warn about rules that cannot match")
    lint_cmd.add_argument("file")
    lint_cmd.add_argument("--strict", action="store_true", help="exit 1 when there are warnings")
    lint_cmd.set_defaults(func=cmd_lint)

    for register in _optional_commands():
        register(sub)
    _no_abbreviations(parser)
    return parser


def _no_abbreviations(parser: argparse.ArgumentParser) -> None:
    """``--no-adm`` must not mean ``--no-admin``: options are spelt out, which also lets the worker
    supervisor rebuild a worker's command line without guessing."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _no_abbreviations(child)


def _optional_commands():
    """Commands whose modules pull in heavier dependencies register themselves here."""
    from proxy import run_command

    yield run_command.register
    from browser import cli as browser_cli

    yield browser_cli.register
    from squid_compat import cli as squid_cli

    yield squid_cli.register
    from proxy import operator_cli

    yield operator_cli.register


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.raw_argv = list(argv if argv is not None else sys.argv[1:])  # for commands that start copies of themselves
    try:
        return args.func(args)
    except PolicyError as err:
        print(f"egresswall: {err}", file=sys.stderr)
        return EXIT_ERROR
    except ValueError as err:
        print(f"egresswall: {err}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
