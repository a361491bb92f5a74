"""What the commands share: the one set of policy options, HOST:PORT values, and the one place the
command line loads a policy file (so a change of loader is a change here)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from policy.hosts import split_host_port
from policy.loader import Overrides, parse_nameserver
from policy.model import Policy
from proxy.policy_file import DEFAULT_POLICY
from proxy.policy_file import load_policy_file as _load_policy_file

from .errors import UsageError

# The destinations of the options add_policy_options declares that add to (or replace parts of) the file.
_OVERRIDE_OPTIONS = ("default", "mode", "allow_host", "deny_host", "allow_range", "deny_range", "nameserver",
                     "upstream", "upstream_credentials_file")


def add_policy_options(parser: argparse.ArgumentParser, default_policy: Path | None = DEFAULT_POLICY) -> None:
    """The options every command that takes a policy accepts; they add to the file (labs, tests).
    ``default_policy=None``: no --policy means none was given (``browse`` then may use ``--proxy``)."""
    group = parser.add_argument_group("policy")
    group.add_argument("--policy", default=None if default_policy is None else str(default_policy), metavar="FILE",
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
    group.add_argument("--upstream", metavar="http://HOST:PORT",
                       help="forward through this HTTP proxy (replaces upstream.proxy; the policy must still say "
                            "upstream.resolution: upstream). Never credentials here: see --upstream-credentials-file")
    group.add_argument("--upstream-credentials-file", metavar="FILE",
                       help="file holding user:password for the upstream proxy (replaces upstream.credentials_file)")


def overrides_from(args: argparse.Namespace) -> Overrides:
    for ns in args.nameserver:
        try:
            parse_nameserver(ns)  # a bad flag is an error here, with the flag's own words
        except ValueError as err:
            raise UsageError(f"--nameserver {ns}: {err}") from None
    credentials = args.upstream_credentials_file
    return Overrides(default=args.default, mode=args.mode, allow_hosts=args.allow_host, deny_hosts=args.deny_host,
                     allow_ranges=args.allow_range, deny_ranges=args.deny_range, nameservers=args.nameserver,
                     upstream=args.upstream,
                     upstream_credentials_file=os.path.abspath(credentials) if credentials else None)


def policy_options_given(args: argparse.Namespace) -> bool:
    """Whether any policy option was given on the command line (--policy included)."""
    return args.policy is not None or any(getattr(args, name) for name in _OVERRIDE_OPTIONS)


def policy_path(args: argparse.Namespace) -> str:
    return args.policy or str(DEFAULT_POLICY)


def load_policy_file(path: str | Path, overrides: Overrides | None = None) -> Policy:
    """The command line's one call into the loader (which reads the file once, in proxy/policy_file.py)."""
    return _load_policy_file(path, overrides)


def load_from_args(args: argparse.Namespace) -> Policy:
    return load_policy_file(policy_path(args), overrides_from(args))


def parse_hostport(text: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """``HOST:PORT``, ``[v6]:PORT`` or ``:PORT`` (the default host); port 0 picks a free one."""
    try:
        host, port = split_host_port(text, min_port=0)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT (an IPv6 address in brackets, [::1]:3128): "
                                         f"{err}") from None
    return host or default_host, port
