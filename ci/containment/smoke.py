"""The containment smoke test's runs, and its command line (``ci/containment-smoke``).

A run builds a fresh lab, starts egresswall with a policy, makes the browser (the probe page in the
contained Chromium, or ``--client simple``) try every target, collects the evidence, tears the lab
down and judges. The positive runs must pass; each negative run weakens one thing and must be
reported as a failure by the check that catches that weakening.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from lab_util import lab_skip_reason, remove_stale_namespaces

from containment import topology as T
from containment.certs import LabCerts, make_lab_certs
from containment.checks import Judgement, format_table, judge
from containment.lab import ContainmentLab, LabError

PROBE_DIR = T.ROOT / "browser" / "probe" / "page"  # served by the lab's public host under /probe/
PROBE_PAGE = "/probe/index.html"
# Over plain HTTP, so the page's http:// attempts are not stopped by Chromium's mixed-content blocking
# before they reach the proxy (the runner declares the origin secure for the service worker route).
# HTTPS with the lab CA is exercised by the https:// and wss:// targets.
PROBE_PAGE_URL = f"http://{T.PUBLIC_NAME}{PROBE_PAGE}"
LAB_OVERRIDES = ["--nameserver", T.LAB_DNS, "--allow-range", T.PUBLIC_RANGE]
OWN_POLICY_OVERRIDES = [*LAB_OVERRIDES, "--allow-host", f".{T.DOMAIN}"]


@dataclass(frozen=True)
class RunSpec:
    name: str
    description: str
    packet_filter: bool
    weaken: frozenset[str] = frozenset()
    allow_everything: bool = False
    catches: str | None = None  # negative runs: the check that must report the failure

    @property
    def negative(self) -> bool:
        return self.catches is not None

    @property
    def slug(self) -> str:  # the run's directory (short: Chromium's socket path lives below it)
        return self.name.replace("negative:", "neg-")


POSITIVE_RUNS = [
    RunSpec("contained", "packet filter on, every browser flag on", packet_filter=True),
    RunSpec("flags-only", "packet filter OFF: the browser's flags alone must hold", packet_filter=False),
]
NEGATIVE_RUNS = [
    RunSpec("negative:allow-everything", "proxy policy replaced by allow-everything, packet filter off",
            packet_filter=False, allow_everything=True, catches="stand-ins"),
    RunSpec("negative:loopback-bypass", "<-loopback> left out of the proxy bypass list, packet filter off",
            packet_filter=False, weaken=frozenset({"loopback-bypass"}), catches="browser-loopback"),
    RunSpec("negative:webrtc", "WebRTC IP handling policy left out, packet filter off",
            packet_filter=False, weaken=frozenset({"webrtc"}), catches="capture"),
]
RUNS = {spec.name: spec for spec in POSITIVE_RUNS + NEGATIVE_RUNS}


@dataclass
class RunResult:
    spec: RunSpec
    seconds: float
    judgement: Judgement | None = None
    error: str | None = None  # the lab could not run: never counts as a pass nor as a caught negative
    workdir: Path | None = None
    client_log: str = ""

    @property
    def passed(self) -> bool:
        return self.error is None and self.judgement is not None and self.judgement.passed

    @property
    def as_expected(self) -> bool:
        if self.error is not None or self.judgement is None:
            return False
        if not self.spec.negative:
            return self.judgement.passed
        return self.spec.catches in self.judgement.failed()

    def summary(self) -> str:
        if self.error:
            return f"LAB ERROR: {self.error.splitlines()[0]}"
        failed = self.judgement.failed() if self.judgement else []
        if not self.spec.negative:
            return "PASS" if self.passed else "FAIL (" + ", ".join(failed) + ")"
        if self.as_expected:
            return f"failed as it must, caught by {self.spec.catches} (failing: {', '.join(failed)})"
        return (f"NOT CAUGHT: expected check {self.spec.catches} to fail; failing: {', '.join(failed) or 'none'}")


@dataclass
class Options:
    client: str = "chromium"  # or "simple"
    policy: Path | None = None  # the user's own policy; None: the lab policy
    timeout: float = 90  # seconds for the whole probe in one run
    attempt_timeout: float = 8  # seconds per attempt (the probe's --timeout)
    keep: Path | None = None
    verbose: bool = False
    routes: list[str] = field(default_factory=list)


# ---- one run -------------------------------------------------------------------------------------

def targets_file(folder: Path) -> Path:
    """The simple client's targets: ``{key: url}``."""
    path = folder / "targets.json"
    path.write_text(json.dumps({t.key: t.url for t in T.TARGETS}, indent=1))
    return path


def probe_targets(routes: list[str]) -> dict[str, list[str]]:
    """The probe's targets file (browser/probe/README.md): ``{route: [url, ...]}``. Every http(s) target
    by every web route; WebSocket and STUN targets by their own routes; the redirecting page also by
    the runner's ``redirect`` route (a navigation that follows it)."""
    web = [t.url for t in T.TARGETS if t.url.startswith(("http:", "https:"))]
    special = {
        "websocket": [t.url for t in T.TARGETS if t.url.startswith(("ws:", "wss:"))],
        "webrtc-stun": [t.url for t in T.TARGETS if t.url.startswith("stun:")],
        "redirect": [t.url for t in T.TARGETS if t.extra.get("final_host")],
    }
    return {route: special.get(route, web) for route in routes if special.get(route, web)}


def probe_targets_file(folder: Path, routes: list[str]) -> Path:
    path = folder / "probe-targets.json"
    path.write_text(json.dumps({"_comment": "written by ci/containment-smoke", **probe_targets(routes)}, indent=1))
    return path


def policy_for(spec: RunSpec, options: Options, folder: Path) -> tuple[Path, list[str]]:
    if spec.allow_everything:
        path = folder / "allow-everything.yaml"
        path.write_text(T.allow_everything_policy_text())
        return path, []
    if options.policy is not None:
        return options.policy.resolve(), OWN_POLICY_OVERRIDES
    path = folder / "lab-policy.yaml"
    path.write_text(T.lab_policy_text())
    return path, []


def run_one(spec: RunSpec, options: Options, certs: LabCerts, workdir: Path) -> RunResult:
    started = time.monotonic()
    result = RunResult(spec, 0.0, workdir=workdir)
    report: list[dict] | None = None
    try:
        use_probe = options.client == "chromium"
        with ContainmentLab(workdir, certs, packet_filter=spec.packet_filter,
                            probe_dir=PROBE_DIR if use_probe else None) as lab:
            policy, overrides = policy_for(spec, options, workdir)
            lab.start_proxy(policy, overrides)
            out = workdir / "report.json"
            if use_probe:
                targets = probe_targets_file(workdir, options.routes)
                result.client_log = run_probe(lab, spec, options, targets, out)
            else:
                targets = targets_file(workdir)
                result.client_log = run_simple(lab, spec, options, certs, targets, out)
            if out.exists():
                report = json.loads(out.read_text())
            evidence = lab.finish()
        result.judgement = judge(report, evidence, targets=T.TARGETS, routes=options.routes,
                                 own_policy=options.policy is not None and not spec.allow_everything,
                                 probe_page_path=PROBE_PAGE if options.client == "chromium" else None)
    except LabError as err:
        result.error = str(err)
    except subprocess.SubprocessError as err:
        result.error = f"{type(err).__name__}: {err}"
    result.seconds = time.monotonic() - started
    return result


def _proxy_arg() -> str:
    return f"{T.PROXY_ADDR}:{T.PROXY_PORT}"


def run_simple(lab: ContainmentLab, spec: RunSpec, options: Options, certs: LabCerts, targets: Path,
               out: Path) -> str:
    argv = [lab.python, "-m", "containment.client", "--targets", str(targets), "--proxy", _proxy_arg(),
            "--out", str(out), "--cafile", str(certs.ca_file), "--timeout", str(options.attempt_timeout)]
    for w in sorted(spec.weaken):
        argv += ["--weaken", w]
    proc = subprocess.run(lab.netns.argv(lab.browser, argv), capture_output=True, text=True,
                          timeout=options.timeout, env=lab.env, cwd="/")
    if proc.returncode != 0:
        raise LabError(f"the simple client exited with {proc.returncode}:\n{proc.stderr[-2000:]}")
    return proc.stderr


def run_probe(lab: ContainmentLab, spec: RunSpec, options: Options, targets: Path, out: Path) -> str:
    argv = [lab.python, "-m", "browser.probe", "--page-url", PROBE_PAGE_URL, "--targets", str(targets), "--proxy",
            _proxy_arg(), "--out", str(out), "--timeout", str(options.attempt_timeout),
            "--trust-cert", str(lab.certs.ca_file)]
    for w in sorted(spec.weaken):
        argv += ["--weaken", w]
    if os.geteuid() == 0:
        # The lab runs the probe as root, where Chromium's sandbox cannot run: say so (the launcher refuses
        # otherwise). The compose-topology run (containment.compose_run) runs the browser sandboxed, as
        # its image's unprivileged user.
        argv.append("--no-sandbox")
    log = lab.dir / "probe.log"
    with open(log, "wb") as f:
        proc = lab.netns.popen(lab.browser, argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                               env={**lab.env, "PYTHONFAULTHANDLER": "1"})
        try:
            proc.wait(timeout=options.timeout)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGABRT)  # faulthandler writes where the probe was stuck into its log
            time.sleep(1)
            lab.netns.stop(proc)
            raise LabError(f"the probe did not finish within {options.timeout:.0f} s:\n"
                           + log.read_text(errors="replace")[-2000:]) from None
    text = log.read_text(errors="replace")
    if not out.exists():
        hint = ""
        if "did not load" in text or "answered 403" in text:
            hint = (f"\n(the probe page {PROBE_PAGE_URL} must be allowed: with --policy, your policy has to admit "
                    "plain HTTP on port 80 for the lab's names)")
        raise LabError(f"the probe exited with {proc.returncode} and wrote no report:\n{text[-3000:]}{hint}")
    return text


# ---- the command ---------------------------------------------------------------------------------

def run_all(specs: list[RunSpec], options: Options, stream=sys.stdout) -> list[RunResult]:
    remove_stale_workdirs()
    base = Path(tempfile.mkdtemp(prefix=f"egresswall-smoke-{os.getpid()}-"))
    os.chmod(base, 0o755)
    results = []
    try:
        certs = make_lab_certs(base / "certs", T.CERT_NAMES, [T.PUBLIC_WEB])
        for spec in specs:
            print(f"\n=== run {spec.name}: {spec.description}", file=stream, flush=True)
            result = run_one(spec, options, certs, base / spec.slug)
            results.append(result)
            if result.judgement is not None:
                print(format_table(result.judgement, only_failing=spec.negative), file=stream)
            if result.error:
                print(f"lab error: {result.error}", file=stream)
            if options.verbose and result.client_log:
                print("--- client log (tail)\n" + result.client_log[-3000:], file=stream)
            print(f"=== {spec.name}: {result.summary()}  [{result.seconds:.1f} s]", file=stream, flush=True)
    finally:
        try:
            if options.keep is not None:
                options.keep.mkdir(parents=True, exist_ok=True)
                # Not the runs' scratch space (a browser profile, with sockets in it).
                shutil.copytree(base, options.keep, dirs_exist_ok=True, ignore=shutil.ignore_patterns("t", "tmp"))
        except (OSError, shutil.Error) as err:
            print(f"containment-smoke: could not keep all evidence: {err}", file=sys.stderr)
        finally:
            shutil.rmtree(base, ignore_errors=True)
    return results


_interrupted = False


def _raise_interrupt(signum, frame):
    """The first SIGINT/SIGTERM/SIGHUP unwinds the run (every ``finally`` tears down); later ones wait."""
    global _interrupted
    if _interrupted:
        return
    _interrupted = True
    raise KeyboardInterrupt(f"signal {signum}")


def remove_stale_workdirs() -> None:
    """What runs that were killed left (SIGKILL leaves no chance to clean up): first their namespaces
    and the processes still running in them, then their work directories."""
    remove_stale_namespaces()
    for path in Path(tempfile.gettempdir()).glob("egresswall-smoke-*-*"):
        pid = path.name.split("-")[2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ci/containment-smoke",
        description="Prove that the contained browser reaches nothing but what the policy allows, in a "
                    "network-namespace lab (root; no route to the real network). See ci/README.md.")
    parser.add_argument("--policy", type=Path, metavar="FILE",
                        help="run against your own policy (the lab adds its nameserver, re-admits "
                             f"{T.PUBLIC_RANGE} and allows the lab's names .{T.DOMAIN})")
    parser.add_argument("--negative", action="store_true",
                        help="also run the weakened setups, each of which must be reported as a failure")
    parser.add_argument("--run", action="append", choices=sorted(RUNS), metavar="NAME",
                        help=f"run only these (repeatable): {', '.join(RUNS)}")
    parser.add_argument("--client", choices=["chromium", "simple"], default="chromium",
                        help="chromium: the probe page in the contained Chromium (the smoke test); simple: a "
                             "Python client that tests the lab itself")
    parser.add_argument("--timeout", type=float, default=120, help="seconds for one run's probe (default 120)")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="copy every run's evidence here")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the results as JSON")
    parser.add_argument("-v", "--verbose", action="store_true", help="print the client's log")
    args = parser.parse_args(argv)

    reason = lab_skip_reason("nft", "tcpdump")
    if reason:
        print(f"containment-smoke: cannot run: {reason}", file=sys.stderr)
        return 2
    if args.policy is not None and not args.policy.is_file():
        print(f"containment-smoke: no such policy file: {args.policy}", file=sys.stderr)
        return 2
    if args.client == "chromium" and not (PROBE_DIR.is_dir() and probe_routes()):
        print("containment-smoke: the probe (browser/probe/) is not there", file=sys.stderr)
        return 2
    specs = [RUNS[name] for name in args.run] if args.run else POSITIVE_RUNS + (NEGATIVE_RUNS if args.negative
                                                                                 else [])
    options = Options(client=args.client, policy=args.policy, timeout=args.timeout, keep=args.keep,
                      verbose=args.verbose, routes=probe_routes() if args.client == "chromium" else [])
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)
    started = time.monotonic()
    try:
        results = run_all(specs, options)
    except KeyboardInterrupt:
        print("containment-smoke: interrupted; the lab was torn down", file=sys.stderr)
        return 130
    total = time.monotonic() - started
    print("\n=== summary" + (f" (policy {args.policy})" if args.policy else " (the lab policy)"))
    for r in results:
        print(f"  {r.spec.name:<28} {r.seconds:6.1f} s  {r.summary()}")
    ok = all(r.as_expected for r in results)
    print(f"containment smoke test: {'PASSED' if ok else 'FAILED'} in {total:.1f} s")
    if args.json:
        args.json.write_text(json.dumps([{
            "run": r.spec.name, "negative": r.spec.negative, "catches": r.spec.catches, "seconds": round(r.seconds, 2),
            "as_expected": r.as_expected, "error": r.error,
            "failed_checks": r.judgement.failed() if r.judgement else None,
            "rows": [vars(row) for row in r.judgement.rows] if r.judgement else [],
        } for r in results], indent=1))
    if any(r.error for r in results):
        return 2
    return 0 if ok else 1


def probe_routes() -> list[str]:
    """The routes the probe says it attempts (every one must be reported)."""
    try:
        from browser import probe
    except ImportError:
        return []
    return list(getattr(probe, "ROUTES", []))


if __name__ == "__main__":
    sys.exit(main())
