"""``egresswall replay`` and ``egresswall suggest``: the command-line glue over proxy/replay.py and
proxy/suggest.py (which do the work and know nothing of argparse)."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from pathlib import Path

from proxy import replay, suggest
from proxy.audit_reader import Tally, parse_since, read_logs

from .errors import UsageError
from .options import load_policy_file

EXIT_OK, EXIT_CHANGED, EXIT_ERROR = 0, 1, 2


def register(sub: argparse._SubParsersAction) -> None:
    cmd = sub.add_parser("replay", help="re-decide the audit log's decisions with another policy; print what "
                                        "would change (exit 1 with --fail-on when it would)")
    cmd.add_argument("log", nargs="+", metavar="AUDIT.jsonl", help="audit log(s), oldest first; .gz is read too")
    cmd.add_argument("--policy", required=True, metavar="NEW.yaml", help="the edited policy to replay against")
    cmd.add_argument("--since", metavar="TIME", help="only decisions from this moment on: RFC 3339 "
                                                     "(2026-12-01T07:00:00Z) or a duration back from now (2h, 7d)")
    cmd.add_argument("--fail-on", choices=replay.FAIL_ON,
                     help="exit 1 when a decision would change this way: refuse (something let through would be "
                          "refused), allow (something refused would be let through), any (any verdict change)")
    cmd.add_argument("--at", metavar="TIME", help="judge rule expiry at this moment (RFC 3339, a date, or now) "
                                                  "instead of each record's own time")
    cmd.add_argument("--examples", type=_count, default=3, metavar="N", help="examples kept per kind of change")
    cmd.add_argument("--json", action="store_true", help="one JSON object")
    cmd.set_defaults(func=cmd_replay)

    cmd = sub.add_parser("suggest", help="propose a hosts.allow block from what the audit log shows was refused by "
                                         "host rules or let through by report mode")
    cmd.add_argument("log", nargs="+", metavar="AUDIT.jsonl", help="audit log(s); .gz is read too")
    cmd.add_argument("--policy", metavar="FILE", help="judge addresses by this policy's address rules (a lab's "
                                                      "re-admitted range) and leave out what it already allows")
    cmd.add_argument("--since", metavar="TIME", help="only decisions from this moment on (RFC 3339 or 2h, 7d)")
    cmd.add_argument("--owner", default=suggest.OWNER_PLACEHOLDER, help="owner: of every entry (default: "
                                                                        f"{suggest.OWNER_PLACEHOLDER!r})")
    cmd.add_argument("--expires", default=f"{suggest.DEFAULT_EXPIRY_DAYS}d", metavar="DATE|Nd|never",
                     help=f"expires: of every entry (default {suggest.DEFAULT_EXPIRY_DAYS}d from today)")
    cmd.add_argument("--domains", action="store_true", help="one .domain entry per registrable domain instead of "
                                                            "each name (never where public suffixes lie below it)")
    cmd.add_argument("-o", "--output", metavar="FILE", help="write the block here instead of to stdout")
    cmd.set_defaults(func=cmd_suggest)


def _count(text: str) -> int:
    """A whole number, 0 or more (argparse's type: its ValueError is a usage error naming the option)."""
    if not text.isascii() or not text.isdigit() or len(text) > 9:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number from 0 to 999999999")
    return int(text)


def _check_logs(paths: list[str]) -> None:
    for path in paths:
        if not Path(path).is_file():
            raise UsageError(f"{path}: not a readable file")


def _moment(text: str | None, option: str) -> datetime | None:
    if text is None:
        return None
    try:
        return parse_since(text, option=option, moment_only=option == "--at")
    except ValueError as err:
        raise UsageError(str(err)) from None  # it names the option and what it expected


def cmd_replay(args: argparse.Namespace) -> int:
    _check_logs(args.log)
    policy = load_policy_file(args.policy)
    since = _moment(args.since, "--since")
    at = _moment(args.at, "--at")
    items = Tally(read_logs(args.log))
    try:
        report = replay.replay(policy, items, since=since, at=at, examples=args.examples)
    except OSError as err:
        raise UsageError(f"cannot read the log: {err}") from None
    if args.json:
        print(json.dumps({"logs": args.log, "policy": args.policy, **report.as_json(),
                          "fail_on": args.fail_on, "fails": report.fails(args.fail_on)}))
    else:
        sys.stdout.write(replay.render_text(report, args.log, args.policy))
    if items.nothing_read():
        print(f"egresswall replay: {items.nothing_read()}", file=sys.stderr)
        return EXIT_ERROR
    if args.fail_on is not None and report.replayed == 0:
        # A gate pointed at the wrong file, or an empty one, vouches for nothing: it fails rather than pass.
        print("egresswall: replay --fail-on: no decision line was replayed, so the policy was checked against "
              "nothing", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_CHANGED if report.fails(args.fail_on) else EXIT_OK


def cmd_suggest(args: argparse.Namespace) -> int:
    _check_logs(args.log)
    policy = load_policy_file(args.policy) if args.policy else None
    try:
        expires = suggest.expiry_date(args.expires)
    except ValueError as err:
        raise UsageError(str(err)) from None  # it names the option and the value
    options = suggest.Options(owner=args.owner, expires=expires, domains=args.domains)
    since = _moment(args.since, "--since")
    items = Tally(read_logs(args.log))
    try:
        found = suggest.collect(items, policy=policy, since=since)
    except OSError as err:
        raise UsageError(f"cannot read the log: {err}") from None
    source = f"the address rules of {args.policy}" if policy else "the built-in rules (global unicast only)"
    text = suggest.render(found, options, args.log, source)
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    sys.stdout.flush()  # the block first, then what stderr says about it
    for warning in suggest.lint_warnings(text):
        print(f"egresswall suggest: lint warning: {warning}", file=sys.stderr)
    names = sum(len(found.suggested(role)) for role in found.allow)
    unread = sum(s.count for s in found.not_read.values())
    print(f"egresswall suggest: {names} name(s) suggested, {len(found.listed_apart())} listed apart, "
          f"{unread} line(s) not read (see the comments)", file=sys.stderr)
    if items.nothing_read():  # a block suggested from nothing is no answer: say so, and fail
        print(f"egresswall suggest: {items.nothing_read()}", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK
