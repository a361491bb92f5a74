"""``python -m browser.probe --page-url URL --targets targets.json --proxy HOST:PORT [--weaken ...]``

Prints the report (a JSON list, one object per attempt) or writes it to ``--out``. Exit status 0 when
the probe ran and reported every attempt (whatever the outcomes: judging them is the lab's job),
2 when it could not run."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from ..launch import ContainmentError
from .runner import ProbeError, load_targets, run_probe


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m browser.probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--page-url", required=True, help="where a lab host serves browser/probe/page/index.html")
    parser.add_argument("--targets", required=True, metavar="FILE", help="targets file (see browser/probe/README.md)")
    parser.add_argument("--proxy", required=True, metavar="HOST:PORT", help="the egresswall proxy")
    parser.add_argument("--weaken", action="append", default=[], choices=["loopback-bypass", "webrtc"],
                        help="turn a containment switch OFF (negative tests only); repeatable")
    parser.add_argument("--out", metavar="FILE", help="write the report here instead of standard output")
    parser.add_argument("--timeout", type=float, default=10, metavar="S", help="seconds per attempt (default 10)")
    parser.add_argument("--trust-cert", action="append", default=[], metavar="FILE",
                        help="accept TLS certificates with this certificate's key (a lab host's, the proxy's CA)")
    parser.add_argument("--no-sandbox", action="store_true", help="start Chromium without its sandbox (logged)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="probe: %(message)s", stream=sys.stderr)
    try:
        report = run_probe(args.page_url, load_targets(args.targets), args.proxy, frozenset(args.weaken), args.timeout,
                           trust_cert_files=args.trust_cert, sandbox=False if args.no_sandbox else None)
    except (ProbeError, ContainmentError) as err:
        print(f"probe: {err}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=2)
    if args.out:
        with open(args.out, "w") as out:
            out.write(text + "\n")
    else:
        print(text)
    counts: dict[str, int] = {}
    for row in report:
        counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
    print("probe: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
