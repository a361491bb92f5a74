"""The compose topology, run from the images' root filesystems in the containment lab.

``compose/docker-compose.yml`` is read for each service's image, user, command, tmpfs mounts, volumes,
networks and health check; the images' root filesystems and configs come from ``ci/images.sh``
(``build/images/``). The proxy runs in the lab's proxy namespace, which has both of compose's networks
(``browsernet``, to the browser, and ``egress``, to the lab's "internet"); the browser server runs in the
browser namespace, which has ``browsernet`` only: no route anywhere but its own link, as an
``internal: true`` network gives a container. Each runs as its image's user with a read-only root, no
capabilities and no-new-privs (``container.py``). Then:

* ``health``: compose's health check commands, run in each container as its user, report healthy;
* ``containers``: /proc shows each service's process as compose says (argv, uid and gid, every capability
  set empty, no-new-privs, a read-only root, the tmpfs mounts);
* ``server``: a Playwright client in the browser container (its own Playwright, so the versions match)
  reads the lab article through the browser server, and /proc shows that server's renderers sandboxed;
* the probe page, in a sandboxed Chromium of the browser image as its user, tries every way out; the
  containment smoke test's checks judge it (``stand-ins``, ``browser-loopback``, ``capture``, ``audit``,
  ``allowed``, ``probe``, ``browser``);
* ``network``: a process in the browser container that ignores every browser flag (what a compromised
  renderer would be) connects straight to the lab's hosts: nothing may leave, and nothing may leave the
  browser namespace on any interface but browsernet.

The negative twin attaches the browser to ``egress`` too (a compose file with that mistake): it must be
reported as a leak (``network`` and ``stand-ins`` fail).

The policy: compose/policy/policy.yaml with the lab's one addition, ``addresses.allow: [198.18.0.0/15]``
(the lab's "public" range); its nameservers are the container's resolv.conf, which names the lab DNS.

    python -m containment.compose_run [--images DIR] [--negative] [--keep DIR]    (root; ci/compose-lab)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from lab_util import lab_skip_reason
from unprivileged import chromium_processes, sandbox_problems

from containment import topology as T
from containment.certs import make_lab_certs
from containment.checks import CHECKS, Check, Judgement, format_table, judge
from containment.container import Container, ContainerSpec, Mount, spec_from_compose
from containment.lab import ContainmentLab, LabError
from containment.smoke import PROBE_DIR, PROBE_PAGE, PROBE_PAGE_URL, probe_routes, probe_targets

COMPOSE_FILE = T.ROOT / "compose" / "docker-compose.yml"
IMAGES_DIR = T.ROOT / "build" / "images"
LAB_IN, LAB_OUT = "/run/egresswall-lab", "/run/egresswall-lab-out"  # the lab's own mounts (probe only)
DOCKER_DNS = "127.0.0.11"  # what Docker writes into a container's resolv.conf; nothing answers it here
SERVER_PORT = 3000
EXTRA_CHECKS = {
    "health": "compose's health checks report healthy",
    "containers": "each process runs as compose says: user, command, no capabilities, read-only root, tmpfs",
    "server": "the browser server read the lab article, its renderers sandboxed",
    "network": "nothing leaves the browser's namespace but TCP to the proxy",
}
CHECKS.update(EXTRA_CHECKS)

# A client in the browser container: read the article through the server, say so, and keep the page open
# until told (so /proc can be read while the renderer runs).
SERVER_CLIENT = """
import json, sys
from playwright.sync_api import sync_playwright
with sync_playwright() as p:
    browser = p.chromium.connect(sys.argv[1])
    page = browser.new_page()
    response = page.goto(sys.argv[2], timeout=30000)
    print(json.dumps({"status": response.status if response else None, "title": page.title(),
                      "text": page.inner_text("body")}), flush=True)
    sys.stdin.read()
    browser.close()
"""
# A process that ignores every browser flag: straight to the lab's hosts, TCP and UDP.
DIRECT_CLIENT = """
import json, socket, sys
out = []
for host, port, proto in json.loads(sys.argv[1]):
    kind = socket.SOCK_STREAM if proto == "tcp" else socket.SOCK_DGRAM
    s = socket.socket(socket.AF_INET, kind)
    s.settimeout(3)
    try:
        if proto == "tcp":
            s.connect((host, port)); outcome = "connected"
        else:
            s.sendto(b"egresswall-direct", (host, port)); outcome = "sent"
    except OSError as err:
        outcome = f"{type(err).__name__}: {err.strerror or err}"
    finally:
        s.close()
    out.append({"target": f"{host}:{port}/{proto}", "outcome": outcome})
print(json.dumps(out))
"""
DIRECT_TARGETS = [(T.PUBLIC_WEB, 80, "tcp"), (T.INTERNAL["rfc1918-10"], 80, "tcp"), (T.INTERNAL["metadata"], 80, "tcp"),
                  (T.LAB_DNS, 53, "udp"), (T.PUBLIC_STUN, T.STUN_PORT, "udp")]


@dataclass
class ComposeResult:
    name: str
    seconds: float = 0.0
    judgement: Judgement | None = None
    error: str | None = None
    details: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.error is None and self.judgement is not None and self.judgement.passed


# ---- reading the compose file ------------------------------------------------------------------------

def load_compose(path: Path = COMPOSE_FILE) -> dict:
    return yaml.safe_load(path.read_text())


def image_dir(service: dict, images: Path) -> Path:
    """``egresswall/proxy:0.1.0`` → ``images/proxy`` (ci/images.sh's layout)."""
    return images / service["image"].split("/")[-1].split(":")[0]


def service_spec(doc: dict, name: str, images: Path, volumes: Path) -> ContainerSpec:
    service = doc["services"][name]
    where = image_dir(service, images)
    image = json.loads((where / "image.json").read_text())
    if isinstance(image, list):
        image = image[0]
    spec = spec_from_compose(name, service, image, where / "rootfs")
    for volume in service.get("volumes") or []:
        if isinstance(volume, str):
            source, target, *rest = volume.split(":")
            volume = {"type": "bind" if source.startswith((".", "/")) else "volume", "source": source,
                      "target": target, "read_only": bool(rest) and "ro" in rest[0].split(",")}
        if volume["type"] == "bind":
            source = (COMPOSE_FILE.parent / volume["source"]).resolve()
        else:  # a named volume: a directory of the run's, owned like the image's directory (as Docker does)
            source = volumes / volume["source"]
            if not source.exists():
                source.mkdir(parents=True)
                inside = where / "rootfs" / volume["target"].lstrip("/")
                if inside.is_dir():
                    os.chown(source, inside.stat().st_uid, inside.stat().st_gid)
        spec.mounts.append(Mount(volume["target"], "bind", str(source), bool(volume.get("read_only"))))
    return spec


def lab_policy(compose_policy: Path) -> str:
    """The deployed policy, with the lab's public range re-admitted (the one change the lab needs)."""
    policy = yaml.safe_load(compose_policy.read_text())
    addresses = policy.setdefault("addresses", {}) or {}
    policy["addresses"] = addresses
    addresses["allow"] = list(addresses.get("allow") or []) + [T.PUBLIC_RANGE]
    return "# compose/policy/policy.yaml with the lab's public range re-admitted (compose_run)\n" + \
        yaml.safe_dump(policy, sort_keys=False)


# ---- one run ---------------------------------------------------------------------------------------------

def wait_healthy(container: Container, timeout: float) -> tuple[bool, str]:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if container.proc.poll() is not None:
            return False, f"exited with {container.proc.returncode}:\n{container.log_text()[-2000:]}"
        try:
            done = container.healthcheck()
            if done.returncode == 0:
                return True, "healthy"
            last = (done.stdout + done.stderr).strip()[-500:]
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            last = str(err)[-500:]
        time.sleep(1)
    return False, f"not healthy after {timeout:.0f} s: {last}\n{container.log_text()[-2000:]}"


def process_problems(container: Container) -> list[str]:
    """What /proc says is not as compose says about the service's process."""
    spec, pid = container.spec, container.main_pid()
    if pid is None:
        return [f"{spec.name}: no process"]
    problems = []
    status = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                  if ":\t" in line)
    argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    # The image's entrypoint is a console script: the kernel runs its interpreter with the script's path.
    shown = argv[1:] if argv and Path(argv[0]).name.startswith("python") else argv
    if [Path(shown[0]).name, *shown[1:]] != [Path(spec.argv[0]).name, *spec.argv[1:]]:
        problems.append(f"{spec.name}: runs {argv}, compose says {spec.argv}")
    uids, gids = status["Uid"].split(), status["Gid"].split()
    if set(uids) != {str(spec.uid)} or set(gids) != {str(spec.gid)}:
        problems.append(f"{spec.name}: uid {uids} gid {gids}, compose says {spec.uid}:{spec.gid}")
    if status.get("Groups", "").strip():
        problems.append(f"{spec.name}: supplementary groups {status['Groups']}")
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        if int(status[cap], 16):
            problems.append(f"{spec.name}: {cap} {status[cap]}: compose drops ALL capabilities")
    if status.get("NoNewPrivs") != "1":
        problems.append(f"{spec.name}: NoNewPrivs {status.get('NoNewPrivs')}: compose says no-new-privileges")
    mounts = {}
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        mounts[fields[4]] = (fields[5].split(","), fields[sep + 1])
    root_options, _ = mounts.get("/", ([], ""))
    if spec.read_only and "ro" not in root_options:
        problems.append(f"{spec.name}: the root filesystem is mounted {root_options}, compose says read_only")
    for mount in spec.mounts:
        options, fstype = mounts.get(mount.target, ([], ""))
        if mount.kind == "tmpfs" and fstype != "tmpfs":
            problems.append(f"{spec.name}: {mount.target} is not a tmpfs ({fstype or 'not mounted'})")
        if mount.kind == "bind" and mount.read_only and "ro" not in options:
            problems.append(f"{spec.name}: {mount.target} is writable, compose says read_only")
    try:
        (root_dir,) = {os.readlink(f"/proc/{pid}/root")}
        if root_dir != "/":
            problems.append(f"{spec.name}: root is {root_dir}")
    except OSError as err:
        problems.append(f"{spec.name}: {err}")
    return problems


def read_through_server(browser: Container, url: str) -> tuple[dict | None, list[str], str]:
    """(the page the server read, what /proc says is not sandboxed, the client's stderr)."""
    argv = browser.exec_argv(["python", "-c", SERVER_CLIENT, f"ws://127.0.0.1:{SERVER_PORT}/", url])
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=browser.spec.env, cwd="/")
    try:
        line = proc.stdout.readline()
        page = json.loads(line) if line.strip() else None
        problems = sandbox_problems(chromium_processes(browser.spec.uid)) if page else ["no page"]
        proc.stdin.close()
        proc.wait(timeout=30)
    except (subprocess.TimeoutExpired, ValueError) as err:
        proc.kill()
        return None, [str(err)], ""
    return page, problems, proc.stderr.read()


def run_compose(name: str, images: Path, workdir: Path, *, browser_on_egress: bool,
                probe_timeout: float = 150, attempt_timeout: float = 8) -> ComposeResult:
    started = time.monotonic()
    result = ComposeResult(name)
    doc = load_compose()
    if browser_on_egress:  # the negative twin: the compose file with the browser on the egress network too
        doc["services"]["browser"]["networks"] = [*doc["services"]["browser"]["networks"], "egress"]
    nets = doc["networks"]
    internal = {n for n, spec in nets.items() if (spec or {}).get("internal")}
    routed = set(nets) - internal
    extra: list[Check] = []
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        os.chmod(workdir, 0o755)
        certs = make_lab_certs(workdir / "certs", T.CERT_NAMES, [T.PUBLIC_WEB])
        proxy_spec = service_spec(doc, "proxy", images, workdir / "volumes")
        browser_spec = service_spec(doc, "browser", images, workdir / "volumes")
        if set(proxy_spec.networks) != {*internal, *routed} or not internal:
            raise LabError(f"the proxy must be on the internal and the routed network: {proxy_spec.networks}")
        on_routed = bool(set(browser_spec.networks) & routed)
        with ContainmentLab(workdir / "lab", certs, packet_filter=False, probe_dir=PROBE_DIR, browser_routes=False,
                            browser_egress=on_routed, loopback_watch_ports=T.LOOPBACK_TCP_PORTS) as lab:
            # The proxy: its policy directory (the lab's copy) in place of ./policy, the lab DNS as resolver.
            policy_dir = workdir / "policy"
            policy_dir.mkdir()
            (policy_dir / "policy.yaml").write_text(lab_policy(COMPOSE_FILE.parent / "policy" / "policy.yaml"))
            for mount in proxy_spec.mounts:
                if mount.source == str((COMPOSE_FILE.parent / "policy").resolve()):
                    mount.source = str(policy_dir)
            proxy_spec.nameservers = [T.LAB_DNS]
            proxy = Container(lab.netns, lab.proxy, proxy_spec, workdir / "proxy", lab.env)
            audit_dir = next(m.source for m in proxy_spec.mounts if m.target == "/var/log/egresswall")
            lab.audit_path = Path(audit_dir) / "audit.jsonl"
            lab.proxy_err = proxy.log
            healthy = {"proxy": wait_healthy(proxy, 60)}

            # The browser: "proxy" resolves to the proxy's browsernet address; the lab's files for the probe.
            browser_spec.hosts = {"proxy": T.PROXY_ADDR}
            browser_spec.nameservers = [DOCKER_DNS]
            lab_in, lab_out = workdir / "lab-in", workdir / "lab-out"
            lab_in.mkdir()
            lab_out.mkdir()
            os.chown(lab_out, browser_spec.uid, browser_spec.gid)
            shutil.copy(certs.ca_file, lab_in / "lab-ca.pem")
            routes = probe_routes()
            (lab_in / "targets.json").write_text(json.dumps(probe_targets(routes)))
            browser_spec.mounts += [Mount(LAB_IN, "bind", str(lab_in), True), Mount(LAB_OUT, "bind", str(lab_out))]
            browser = Container(lab.netns, lab.browser, browser_spec, workdir / "browser", lab.env)
            healthy["browser"] = wait_healthy(browser, 90)
            check = Check("health", all(ok for ok, _ in healthy.values()))
            check.problems = [f"{n}: {why}" for n, (ok, why) in healthy.items() if not ok]
            extra.append(check)
            if not check.passed:
                raise LabError("; ".join(check.problems))

            check = Check("containers", True, process_problems(proxy) + process_problems(browser))
            check.passed = not check.problems
            extra.append(check)

            page, problems, client_err = read_through_server(browser, f"http://{T.PUBLIC_NAME}/public/page.html")
            check = Check("server", True, list(problems))
            if not page or page.get("status") != 200:
                check.problems.append(f"the browser server did not read the lab article: {page} {client_err[-800:]}")
            check.passed = not check.problems
            result.details["server_page"] = page
            extra.append(check)

            probe = browser.exec(["python", "-m", "browser.probe", "--page-url", PROBE_PAGE_URL, "--targets",
                                  f"{LAB_IN}/targets.json", "--proxy", f"proxy:{T.PROXY_PORT}", "--out",
                                  f"{LAB_OUT}/report.json", "--timeout", str(attempt_timeout), "--trust-cert",
                                  f"{LAB_IN}/lab-ca.pem"], timeout=probe_timeout)
            (workdir / "probe.log").write_text(probe.stdout + probe.stderr)
            report_file = lab_out / "report.json"
            report = json.loads(report_file.read_text()) if report_file.exists() else None

            direct = browser.exec(["python", "-c", DIRECT_CLIENT, json.dumps(DIRECT_TARGETS)], timeout=60)
            attempts = json.loads(direct.stdout) if direct.returncode == 0 else []
            result.details["direct"] = attempts
            browser.stop()
            proxy.stop(timeout=60)  # before the evidence is read: its audit log is then complete (the
            # deployed policy gives open tunnels limits.tunnel_grace, 50 s, and docker-compose.yml waits 60)
            evidence = lab.finish()
            browser_counters = evidence.browser_counters
        judgement = judge(report, evidence, targets=T.TARGETS, routes=routes, own_policy=True,
                          probe_page_path=PROBE_PAGE)
        if report is None:
            judgement.checks.append(Check("probe", False, [f"the probe wrote no report: {probe.stderr[-1500:]}"]))
        check = Check("network", True)
        if direct.returncode != 0:
            check.problems.append(f"the direct client failed: {direct.stderr[-800:]}")
        for attempt in attempts:
            if not attempt["outcome"].startswith("OSError: Network is unreachable"):
                check.problems.append(f"{attempt['target']} straight from the browser container: {attempt['outcome']}")
        if browser_counters.get("egress-sent"):
            check.problems.append(f"{browser_counters['egress-sent']} packet(s) left the browser namespace on the "
                                  "egress network")
        check.passed = not check.problems
        extra.append(check)
        judgement.checks = extra + judgement.checks
        result.judgement = judgement
    except LabError as err:
        result.error = str(err)
    except (subprocess.SubprocessError, OSError) as err:
        result.error = f"{type(err).__name__}: {err}"
    result.seconds = time.monotonic() - started
    return result


RUNS = {"compose": False, "negative:browser-on-egress": True}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ci/compose-lab", description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=Path, default=IMAGES_DIR, help="ci/images.sh's output (build/images)")
    parser.add_argument("--negative", action="store_true", help="also the twin with the browser on egress: "
                        "it must be reported as a leak")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="copy the runs' evidence here")
    args = parser.parse_args(argv)
    reason = lab_skip_reason("nft", "tcpdump", "nsenter", "unshare")
    if reason:
        print(f"compose-lab: cannot run: {reason}", file=sys.stderr)
        return 2
    missing = [n for n in ("proxy", "browser") if not (args.images / n / "rootfs").is_dir()]
    if missing:
        print(f"compose-lab: no root filesystem for {', '.join(missing)} in {args.images}: run make images",
              file=sys.stderr)
        return 2
    base = Path(tempfile.mkdtemp(prefix=f"egresswall-compose-{os.getpid()}-"))
    os.chmod(base, 0o755)
    ok = True
    try:
        for name, on_egress in RUNS.items():
            if on_egress and not args.negative:
                continue
            print(f"\n=== {name}", flush=True)
            result = run_compose(name, args.images, base / re.sub(r"\W", "-", name), browser_on_egress=on_egress)
            if result.judgement is not None:
                print(format_table(result.judgement, only_failing=on_egress))
            if on_egress:
                caught = result.judgement is not None and {"network", "stand-ins"} <= set(result.judgement.failed())
                summary = "the leak was reported" if caught else f"NOT CAUGHT ({result.error or 'no failure'})"
                ok = ok and caught
            else:
                summary = "PASS" if result.passed else f"FAIL {result.error or result.judgement.failed()}"
                ok = ok and result.passed
            print(f"=== {name}: {summary}  [{result.seconds:.1f} s]", flush=True)
    finally:
        if args.keep:
            shutil.copytree(base, args.keep, dirs_exist_ok=True, symlinks=True,
                            ignore=shutil.ignore_patterns("t", "rootfs"))
        shutil.rmtree(base, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
