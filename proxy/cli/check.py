"""``egresswall check URL...``: why a URL is allowed or refused (exit 0 allowed, 1 refused)."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from dataclasses import replace

from policy.addresses import parse_client_address
from policy.decision import Request, Verdict, refuse_form, role_of
from policy.hosts import HostFormError, parse_url
from policy.model import Policy
from policy.resolver import DnsResolver, resolve_and_decide
from policy.sessions import required_refusal
from policy.wire import TCHAR
from proxy.hints import hint_for
from proxy.records import verdict_word

from .errors import UsageError
from .options import add_policy_options, load_from_args
from .run import upstream_words

EXIT_ALLOWED, EXIT_REFUSED = 0, 1


def register(sub: argparse._SubParsersAction) -> None:
    check = sub.add_parser("check", help="explain why a URL is allowed or refused (exit 0 allowed, 1 refused)")
    check.add_argument("url", nargs="+")
    add_policy_options(check)
    check.add_argument("--client", help="the client address (chooses a role)")
    check.add_argument("--method", default="GET", type=_method,
                       help="the request's method (default GET; a tunnel's requests are judged as their CONNECT)")
    check.add_argument("--json", action="store_true", help="one JSON object per URL")
    check.set_defaults(func=cmd_check, intermixed=True)  # URLs may follow the options too


_TOKEN = re.compile(TCHAR + "{1,32}")  # RFC 9110 5.6.2: a method is a token


def _method(text: str) -> str:
    if not _TOKEN.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not an HTTP method (a token of letters, digits and "
                                         "!#$%&'*+-.^_`|~)")
    return text.upper()  # as the proxy judges it: policy methods match without regard to case


def cmd_check(args: argparse.Namespace) -> int:
    if args.client:
        try:
            args.client = parse_client_address(args.client)
        except ValueError as err:
            raise UsageError(str(err)) from None  # says the client given and why it is no address
    policy = load_from_args(args)
    resolver = DnsResolver.for_policy(policy)
    results = [asyncio.run(_check_one(policy, resolver, url, args)) for url in args.url]
    for url, method, verdict, resolution in results:
        if args.json:
            # Only with an upstream (the interface stays as it was without): nothing is pinned, as in the audit log.
            extra = {"pinned": None, "upstream": _upstream_json(policy)} if policy.upstream else {}
            print(json.dumps(_verdict_json(url, method, verdict, resolution) | extra))
        else:
            _print_verdict(url, method, verdict, resolution, policy)
    return EXIT_ALLOWED if all(v.allowed for _, _, v, _ in results) else EXIT_REFUSED


async def _check_one(policy: Policy, resolver: DnsResolver, url: str, args: argparse.Namespace):
    """(url, the method of the request that decided — CONNECT for a tunnel, as the proxy's record says —,
    verdict, resolution). Where the policy (or the client's role) requires a session, the proxy answers a request
    without one 407 before the policy decides: so does check, and its reason says what the policy would do for a
    session that grants the URL."""
    try:
        target = parse_url(as_sent(url))
    except HostFormError as err:
        return url, args.method, refuse_form(err), None
    url, method, verdict, resolution = await _decided(policy, resolver, url, target, args)
    required = required_refusal(policy, role_of(policy, args.client))
    if required is None:
        return url, method, verdict, resolution
    would = "allows" if verdict.allowed else "refuses"
    return url, method, replace(required, reason=f"{required.reason}; for a session that grants it, the policy "
                                                 f"{would} it ({verdict.rule_id}: {verdict.reason})"), resolution


async def _decided(policy: Policy, resolver: DnsResolver, url: str, target, args: argparse.Namespace):
    """The policy's decision, as the proxy makes it once the request's session (if any) has let it through."""
    if target.scheme == "http":
        request = Request(target=target, method=args.method, client=args.client)
        verdict, resolution = await resolve_and_decide(policy, request, resolver)
        return url, args.method, verdict, resolution
    # ws://, https:// and wss:// are decided as a browser sends them through a proxy: CONNECT host:port first,
    # exactly as the proxy decides that CONNECT (an https tunnel: no method, path or WebSocket to see). Only
    # where egresswall then reads what the tunnel carries (ws:// to a plain-HTTP port, an intercepted host) is
    # the request inside decided too; both must pass. (A wss:// was judged as a WebSocket with scheme wss,
    # which the proxy never sees in a passed-through tunnel: check and proxy disagreed both ways.)
    connect = Request(target=replace(target, scheme="https", path=""), method="CONNECT", client=args.client,
                      tunnel=True)
    verdict, resolution = await resolve_and_decide(policy, connect, resolver)
    passed_through = target.scheme != "ws" and not policy.intercepts(target.host)
    if not verdict.allowed or passed_through:
        return url, "CONNECT", verdict, resolution
    request = Request(target=target, method=args.method, client=args.client, websocket=target.scheme in ("ws", "wss"))
    verdict, resolution = await resolve_and_decide(policy, request, resolver)
    return url, args.method, verdict, resolution


def as_sent(url: str) -> str:
    """The URL as a browser puts it on the wire, which is what the proxy decides: without its fragment (never
    sent), a space in its path or query percent-encoded (review round 22: check refused both ``form:url`` where
    the proxy allowed the request a browser made of them). A user name and password stay: the proxy refuses them
    on a request line (``form:userinfo``), and check says so (tests/test_host_form_parity.py)."""
    return url.split("#", 1)[0].replace(" ", "%20")


def _verdict_word(verdict: Verdict) -> str:
    if verdict.report_only:
        return "ALLOWED (report mode; enforce would refuse)"
    return "ALLOWED" if verdict.allowed else "REFUSED"


def _upstream_json(policy: Policy) -> dict:
    assert policy.upstream is not None
    return {"proxy": policy.upstream.url, "resolution": policy.upstream.resolution}


def _print_verdict(url: str, method: str, verdict: Verdict, resolution, policy: Policy) -> None:
    sent = [("sent", as_sent(url))] if as_sent(url) != url else []
    rows = [("url", url), *sent, ("method", method), ("verdict", _verdict_word(verdict)), ("stage", verdict.stage),
            ("rule", verdict.rule),
            ("rule_id", verdict.rule_id), ("reason", verdict.reason)]
    if verdict.role:
        rows.append(("role", verdict.role))
    if resolution is not None and resolution.cnames:
        rows.append(("cnames", " -> ".join(resolution.cnames)))
    if verdict.addresses:
        rows.append(("resolved", ", ".join(verdict.addresses)))
    if verdict.pinned and policy.upstream is None:
        rows.append(("pinned", verdict.pinned))
    elif verdict.pinned:
        rows.append(("checked", f"{verdict.pinned} (not pinned: the upstream resolves the name itself)"))
    if policy.upstream is not None and verdict.allowed:
        rows.append(("upstream", upstream_words(policy)))
    if not verdict.allowed:
        rows.append(("hint", _hint(url, verdict)))
    for key, value in rows:
        print(f"{key:<9} {value}")
    print()


def _hint(url: str, verdict: Verdict) -> str:
    """The hint the proxy's refusal would carry (proxy/hints.py): what would change the answer."""
    try:
        target = parse_url(as_sent(url))
        return hint_for(verdict, target.host, target.port)
    except HostFormError:
        return hint_for(verdict)


def _verdict_json(url: str, method: str, verdict: Verdict, resolution) -> dict:
    """The audit record's vocabulary (proxy/audit-record.schema.json): verdict allow / refuse / report; a
    refusal adds the proxy's ``hint``."""
    hint = {} if verdict.allowed else {"hint": _hint(url, verdict)}
    sent = {"sent": as_sent(url)} if as_sent(url) != url else {}
    return {"url": url} | sent | {"method": method, "verdict": verdict_word(verdict), "allowed": verdict.allowed,
            "stage": verdict.stage, "rule": verdict.rule, "rule_id": verdict.rule_id, "reason": verdict.reason,
            "role": verdict.role,
            "cnames": list(resolution.cnames) if resolution else [], "addresses": list(verdict.addresses),
            "pinned": verdict.pinned} | hint
