"""The deployment files (compose/) keep the containment promises they make.

No Docker engine or cluster runs here, so every Dockerfile, the compose file and every Kubernetes
manifest is parsed and checked against the invariants of the sidecar deployment:

- the browser has no route out except through the proxy: in compose it is only on `internal: true`
  networks, which no service but the proxy bridges to a network with a route out; in Kubernetes it is
  either in a pod whose egress-lock init container applies compose/k8s/egress-lock.nft (whose
  `define`s match the pod: the proxy's uid and ports), or in a pod a NetworkPolicy lets reach only the
  proxy's port;
- the browser server publishes no port;
- every container drops all capabilities, runs as a non-root user on a read-only root filesystem,
  without privilege escalation — except the egress-lock init container, which holds NET_ADMIN alone and
  says why in a comment;
- health checks point at real endpoints (/healthz on the port the proxy's --admin names, the port the
  browser server's --port names);
- the policy reaches the proxy at the path it watches (ConfigMap key = basename of --policy, mounted as
  the directory of --policy, never with subPath), and the ruleset reaches the init container likewise;
- the Dockerfiles install only by running ci/install.sh.

Each checker returns a list of problems. The tests assert the shipped files have none, and that broken
copies (mutated in memory) do have the problem each checker is for — so none of them passes vacuously.
"""

from __future__ import annotations

import copy
import ipaddress
import json
import re
import shlex
import shutil
from pathlib import Path, PurePosixPath

import pytest
import yaml
from kustomize import kubectl_or_skip, render

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_DIR = ROOT / "compose"
K8S_DIR = COMPOSE_DIR / "k8s"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
RULESET = K8S_DIR / "egress-lock.nft"
DOCKERFILES = sorted(p for p in COMPOSE_DIR.glob("Dockerfile.*") if not p.name.endswith(".dockerignore"))
BASE_IMAGE = "python:3.12-slim-bookworm"

# -- small parsers ---------------------------------------------------------------------------------


def option(argv: list[str], name: str) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in an argument list."""
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return str(argv[i + 1])
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def host_port(value: str | None) -> tuple[str, int]:
    assert value, "no HOST:PORT given"
    host, _, port = value.rpartition(":")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def is_wildcard(host: str) -> bool:
    return host in ("0.0.0.0", "::", "")


def nft_defines(text: str) -> dict[str, str]:
    return dict(re.findall(r"^define\s+(\w+)\s*=\s*(.+?)\s*$", text, re.M))


def nft_ports(value: str) -> set[int]:
    return {int(p) for p in re.findall(r"\d+", value)}


def nonroot_user(user: object) -> bool:
    """A compose `user:` / Dockerfile USER value that is set and is not root (by name or uid 0)."""
    if user is None:
        return False
    name = str(user).split(":", 1)[0].strip()
    return name not in ("", "0", "root")


# -- Dockerfiles -----------------------------------------------------------------------------------

INSTALL_SCRIPT = "ci/install.sh"
INSTALL_FLAGS = {"--browser", "--squid", "--lab", "--all", "--no-venv", "--python"}
# The one RUN flag allowed: the build machine's CA bundle as a secret file for pip (ci/images.sh), which
# installs nothing by itself and which no image keeps. Every other mount or network option is refused.
BUILD_CA_SECRET = "--mount=type=secret,id=build-ca,required=false"
# RUN may call the install script, or these, which create users and directories and install nothing.
NON_INSTALLING = {"useradd", "groupadd", "mkdir", "chown", "chmod", "ln", "true"}
# Words that mean "installing by another route" wherever they appear in a RUN (also inside sh -c '...').
OTHER_INSTALLERS = {
    "pip", "pip3", "pipx", "uv", "easy_install", "conda", "mamba", "apt", "apt-get", "aptitude", "dpkg",
    "curl", "wget", "npm", "npx", "yarn", "pnpm", "corepack", "playwright", "git", "gem", "apk", "yum",
    "dnf", "microdnf", "cargo", "go", "bun", "deno", "ensurepip",
}


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with comments dropped and continuation lines joined."""
    instructions, pending = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = (pending + stripped).strip()
        pending = ""
        keyword, _, rest = full.partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
    if pending.strip():
        keyword, _, rest = pending.strip().partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
    return instructions


def _shell_commands(command: str) -> list[list[str]]:
    """Split a shell command line into simple commands (at &&, ||, ;, |, &) as word lists."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    commands, current = [], []
    for token in lexer:
        if token and set(token) <= set(";&|"):
            if current:
                commands.append(current)
            current = []
        else:
            current.append(token)
    if current:
        commands.append(current)
    return commands


def _run_problems(rest: str) -> tuple[list[str], bool]:
    """Problems with one RUN instruction, and whether it ran the install script."""
    problems, ran_script = [], False
    if rest.startswith(BUILD_CA_SECRET + " "):
        rest = rest[len(BUILD_CA_SECRET):].strip()
    if rest.startswith("--"):
        return [f"RUN with flags ({rest.split()[0]}): mounts and network options are another route in"], False
    if "<<" in rest:
        return ["RUN with a heredoc: a script the check cannot read"], False
    if rest.startswith("["):
        try:
            commands = [[str(word) for word in json.loads(rest)]]
        except json.JSONDecodeError:
            return [f"RUN with an unreadable exec form: {rest}"], False
    else:
        try:
            commands = _shell_commands(rest)
        except ValueError as err:
            return [f"RUN that does not parse as a shell command ({err}): {rest}"], False
    if "$(" in rest or "`" in rest:
        problems.append(f"RUN with command substitution: {rest}")
    for words in commands:
        while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
            words = words[1:]  # FOO=bar cmd
        if not words:
            continue
        program = words[0]
        every_word = [w for word in words for w in word.split()]
        for word in every_word:
            if PurePosixPath(word).name in OTHER_INSTALLERS:
                problems.append(f"RUN installs by another route ({PurePosixPath(word).name}): {rest}")
        if program in (INSTALL_SCRIPT, "./" + INSTALL_SCRIPT):
            ran_script = True
            for flag in words[1:]:
                if flag not in INSTALL_FLAGS and not flag.startswith("--venv="):
                    problems.append(f"ci/install.sh called with an option it does not have: {flag}")
        elif program not in NON_INSTALLING:
            problems.append(f"RUN runs {program!r}, which is neither ci/install.sh nor a non-installing step")
    return problems, ran_script


def dockerfile_problems(text: str, root_image: bool = False) -> list[str]:
    """Everything that breaks "installs only through ci/install.sh, runs as non-root"."""
    problems, stages, ran_script, user, args = [], set(), False, None, {}
    for keyword, rest in dockerfile_instructions(text):
        if keyword == "ARG":
            name, _, default = rest.partition("=")
            args[name.strip()] = default.strip()
        elif keyword == "FROM":
            words = [w for w in rest.split() if not w.startswith("--")]  # --platform=...
            # FROM ${BASE}: a build argument chooses the base; its default is what a Docker user pulls.
            image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)), words[0])
            if image not in stages and image.split("@", 1)[0] != BASE_IMAGE:
                problems.append(f"FROM {image}: images are based on {BASE_IMAGE} only")
            if len(words) == 3 and words[1].upper() == "AS":
                stages.add(words[2])
        elif keyword == "ADD":
            problems.append(f"ADD {rest}: ADD fetches URLs and unpacks archives; use COPY for local files")
        elif keyword == "COPY":
            source = option(rest.split(), "--from")
            if source is not None and source not in stages:
                problems.append(f"COPY --from={source}: copies files out of another image")
        elif keyword == "RUN":
            run_problems, ran = _run_problems(rest)
            problems += run_problems
            ran_script = ran_script or ran
        elif keyword == "USER":
            user = rest
        elif keyword == "ONBUILD":
            problems.append(f"ONBUILD {rest}: a deferred step the check cannot see")
    if not ran_script:
        problems.append("no RUN ci/install.sh: the image must install through the install script")
    if not root_image and not nonroot_user(user):
        problems.append(f"the image's final USER is {user!r}, not a non-root user")
    return problems


def dockerfile_exec(text: str, keyword: str) -> list[str]:
    (value,) = [rest for kw, rest in dockerfile_instructions(text) if kw == keyword][-1:]
    return json.loads(value)


# Dockerfile.netlock runs `nft` as root with NET_ADMIN (see its header); every other image is non-root.
ROOT_IMAGES = {"Dockerfile.netlock"}


def test_there_are_dockerfiles_for_the_proxy_and_the_browser():
    names = {path.name for path in DOCKERFILES}
    assert {"Dockerfile.proxy", "Dockerfile.browser"} <= names


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_installs_only_through_the_install_script(path):
    assert dockerfile_problems(path.read_text(), root_image=path.name in ROOT_IMAGES) == []


def test_browser_image_installs_the_browser_through_the_script():
    runs = [rest for kw, rest in dockerfile_instructions((COMPOSE_DIR / "Dockerfile.browser").read_text())
            if kw == "RUN" and INSTALL_SCRIPT in rest]
    assert any("--browser" in rest.split() for rest in runs)


def _install_flags(text: str) -> set[str]:
    """The apt-level options ci/install.sh is called with anywhere in ``text`` (--all expanded)."""
    flags = set()
    for match in re.finditer(r"ci/install\.sh([^\n;&|]*)", text):
        flags |= {w for w in match.group(1).split() if w.startswith("--") and not w.startswith("--venv")}
    if "--all" in flags:
        flags |= {"--browser", "--squid", "--lab"}
    return flags - {"--all", "--no-venv", "--python"}


def test_ci_takes_every_install_step_the_images_take():
    """The images' install steps are ones CI runs: .ci/run → make test → ci/install.sh --all."""
    ci = (ROOT / ".ci" / "run").read_text()
    if "make test" in ci:
        makefile = (ROOT / "Makefile").read_text()
        ci = re.search(r"^test:.*\n((?:\t.*\n?)+)", makefile, re.M).group(1)
    ci_flags = _install_flags(ci)
    assert ci_flags, "CI does not run ci/install.sh"
    for path in DOCKERFILES:
        runs = "\n".join(rest for kw, rest in dockerfile_instructions(path.read_text()) if kw == "RUN")
        assert _install_flags(runs) <= ci_flags, f"{path.name} installs what CI never installs"


def test_netlock_image_installs_nftables_through_the_script_and_runs_nft():
    text = (COMPOSE_DIR / "Dockerfile.netlock").read_text()
    runs = [rest for kw, rest in dockerfile_instructions(text) if kw == "RUN" and INSTALL_SCRIPT in rest]
    assert any(flag in rest.split() for rest in runs for flag in ("--lab", "--all"))
    assert dockerfile_exec(text, "ENTRYPOINT") == ["nft"]


GOOD = """FROM python:3.12-slim-bookworm
COPY . /src
RUN ci/install.sh --browser --venv=/opt/venv
RUN useradd --uid 10002 browser && mkdir -p /x
USER 10002
"""


@pytest.mark.parametrize(
    "broken",
    [
        GOOD + "RUN pip install requests\n",
        GOOD + "RUN python -m pip install requests\n",
        GOOD + "RUN apt-get update && apt-get install -y curl\n",
        GOOD + "RUN curl -fsSL https://example.com/x.sh | sh\n",
        GOOD + "RUN wget -qO- https://example.com/x\n",
        GOOD + "RUN ci/install.sh --browser && npm install -g playwright\n",
        GOOD + "RUN ci/install.sh \\\n    && playwright install chromium\n",
        GOOD + 'RUN sh -c "pip install x"\n',
        GOOD + 'RUN ["pip", "install", "x"]\n',
        GOOD + "RUN mkdir /x; dpkg -i /tmp/x.deb\n",
        GOOD + "RUN echo $(curl https://example.com)\n",
        GOOD + "RUN --mount=type=bind,from=node:20,target=/n cp -r /n /usr/local\n",
        GOOD + "RUN --mount=type=secret,id=build-ca,required=false pip install x\n",
        GOOD + "RUN --mount=type=secret,id=other,required=false ci/install.sh\n",
        GOOD.replace("FROM python:3.12-slim-bookworm", "ARG BASE=node:20\nFROM ${BASE}"),
        GOOD.replace("FROM python:3.12-slim-bookworm", "FROM ${BASE}"),
        GOOD + "ADD https://example.com/chromium.tar.gz /opt/\n",
        GOOD + "ADD local.tar.gz /opt/\n",
        GOOD + "COPY --from=node:20 /usr/local/bin/node /usr/local/bin/\n",
        GOOD + "RUN ci/install.sh --download-chrome\n",
        GOOD.replace("python:3.12-slim-bookworm", "mcr.microsoft.com/playwright/python:v1.50.0"),
        GOOD.replace("RUN ci/install.sh --browser --venv=/opt/venv\n", ""),
        GOOD.replace("USER 10002", "USER root"),
        GOOD.replace("USER 10002", "USER 0:0"),
        GOOD.replace("USER 10002\n", ""),
    ],
)
def test_dockerfile_check_catches_other_install_routes_and_root(broken):
    assert dockerfile_problems(GOOD) == []
    assert dockerfile_problems(broken) != []


# -- docker compose --------------------------------------------------------------------------------


def load_compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def service_argv(service: dict) -> list[str]:
    """The container's argv: compose's entrypoint/command over the image's ENTRYPOINT/CMD."""
    entrypoint, command = [], []
    if "build" in service:
        context = COMPOSE_DIR / service["build"].get("context", ".")
        text = (context / service["build"].get("dockerfile", "Dockerfile")).read_text()
        entrypoint, command = dockerfile_exec(text, "ENTRYPOINT"), dockerfile_exec(text, "CMD")
    entrypoint = service.get("entrypoint", entrypoint)
    command = service.get("command", command)
    return _words(entrypoint) + _words(command)


def _words(value: str | list) -> list[str]:
    return shlex.split(value) if isinstance(value, str) else [str(x) for x in value]


def find_service(doc: dict, subcommand: str) -> tuple[str, dict]:
    found = [(name, svc) for name, svc in doc["services"].items()
             if subcommand in service_argv(svc)[:2]]
    assert len(found) == 1, f"expected one service running `egresswall {subcommand}`, found {len(found)}"
    return found[0]


def service_networks(service: dict) -> list[str]:
    networks = service.get("networks", [])
    return list(networks) if isinstance(networks, dict | list) else []


def compose_problems(doc: dict, raw_text: str = "") -> list[str]:
    problems = []
    proxy_name, proxy = find_service(doc, "run")
    _, browser = find_service(doc, "browser-server")
    networks = doc.get("networks") or {}
    internal = {name for name, net in networks.items() if (net or {}).get("internal") is True}
    proxy_argv, browser_argv = service_argv(proxy), service_argv(browser)

    # The browser's only way out is the proxy.
    if "network_mode" in browser:
        problems.append(f"browser: network_mode {browser['network_mode']!r} bypasses the internal network")
    browser_nets = service_networks(browser)
    if not browser_nets:
        problems.append("browser: on no declared network (compose would put it on `default`, with a route out)")
    for net in browser_nets:
        if net not in internal:
            problems.append(f"browser: network {net!r} is not `internal: true`, it has a route out")
            continue
        for name, svc in doc["services"].items():
            if name == proxy_name or net not in service_networks(svc):
                continue
            if any(other not in internal for other in service_networks(svc)) or "network_mode" in svc:
                problems.append(f"{name}: bridges the browser's network {net!r} to a network with a route out")
        if net not in service_networks(proxy):
            problems.append(f"proxy: not on the browser's network {net!r}")
    if not any(net not in internal for net in service_networks(proxy)):
        problems.append("proxy: on no network with a route out")
    if browser.get("ports"):
        problems.append("browser: publishes ports; the browser server has no authentication")

    # The browser is pointed at the proxy by name and port, and the proxy listens where it can be reached.
    listen_host, listen_port = host_port(option(proxy_argv, "--listen"))
    if option(browser_argv, "--proxy") != f"{proxy_name}:{listen_port}":
        problems.append(f"browser: --proxy {option(browser_argv, '--proxy')} is not {proxy_name}:{listen_port}")
    if not is_wildcard(listen_host):
        problems.append(f"proxy: --listen {listen_host} is not reachable from the browser's network")
    admin_host, admin_port = host_port(option(proxy_argv, "--admin"))
    if not is_loopback(admin_host):
        problems.append(f"proxy: --admin {admin_host} is reachable from the browser's network")

    # Health checks against real endpoints.
    health = " ".join(str(x) for x in (proxy.get("healthcheck") or {}).get("test", []))
    if f"http://{admin_host}:{admin_port}/healthz" not in health:
        problems.append(f"proxy: healthcheck does not GET /healthz on the admin address {admin_host}:{admin_port}")
    browser_port = option(browser_argv, "--port")
    health = " ".join(str(x) for x in (browser.get("healthcheck") or {}).get("test", []))
    if not browser_port or not re.search(rf"['\"]127\.0\.0\.1['\"],\s*{browser_port}\b", health):
        problems.append(f"browser: healthcheck does not connect to the browser server's port {browser_port}")

    # The policy: a read-only directory mount holding the file --policy names.
    problems += compose_policy_mount_problems(proxy, option(proxy_argv, "--policy"))

    # Chromium needs shared memory and scratch space on a read-only root filesystem.
    if not browser.get("shm_size"):
        problems.append("browser: no shm_size (Chromium crashes pages with Docker's 64 MB /dev/shm)")
    if "/tmp" not in (browser.get("tmpfs") or []):
        problems.append("browser: no tmpfs on /tmp")

    # Every container: hardened and bounded.
    for name, svc in doc["services"].items():
        if "ALL" not in (svc.get("cap_drop") or []):
            problems.append(f"{name}: does not cap_drop ALL")
        for cap in svc.get("cap_add") or []:
            if not re.search(rf"^\s*(-\s*)?.*\b{re.escape(cap)}\b.*#", raw_text, re.M):
                problems.append(f"{name}: cap_add {cap} without a comment saying why")
        if not nonroot_user(svc.get("user")):
            problems.append(f"{name}: user {svc.get('user')!r} is not a non-root user")
        if svc.get("read_only") is not True:
            problems.append(f"{name}: root filesystem is not read_only")
        if not any(str(opt).replace("=", ":") in ("no-new-privileges:true", "no-new-privileges")
                   for opt in svc.get("security_opt") or []):
            problems.append(f"{name}: no no-new-privileges")
        if svc.get("privileged"):
            problems.append(f"{name}: privileged")
        for key in ("pid", "ipc", "network_mode"):
            if svc.get(key) == "host":
                problems.append(f"{name}: {key}: host")
        limits = ((svc.get("deploy") or {}).get("resources") or {}).get("limits") or {}
        for key, alt in (("mem_limit", "memory"), ("cpus", "cpus"), ("pids_limit", "pids")):
            if key not in svc and alt not in limits:
                problems.append(f"{name}: no {key} limit")
        if svc.get("restart") in (None, "no"):
            problems.append(f"{name}: no restart policy")
        health = svc.get("healthcheck") or {}
        if not health.get("test") or health.get("disable"):
            problems.append(f"{name}: no healthcheck")
    return problems


def compose_policy_mount_problems(proxy: dict, policy_path: str | None) -> list[str]:
    if not policy_path:
        return ["proxy: no --policy"]
    target_dir, filename = str(PurePosixPath(policy_path).parent), PurePosixPath(policy_path).name
    for volume in proxy.get("volumes") or []:
        if isinstance(volume, str):
            parts = volume.split(":")
            volume = {"type": "bind", "source": parts[0], "target": parts[1],
                      "read_only": len(parts) > 2 and "ro" in parts[2].split(",")}
        if volume.get("target") == policy_path:
            return ["proxy: the policy is a single-file mount; an editor's save (write + rename) never "
                    "reaches the container, so the proxy never reloads it: mount its directory"]
        if volume.get("target") != target_dir:
            continue
        problems = []
        if not volume.get("read_only"):
            problems.append("proxy: the policy directory is mounted writable")
        source = (COMPOSE_DIR / volume["source"]).resolve()
        if not (source / filename).is_file():
            problems.append(f"proxy: the mounted directory {volume['source']} holds no {filename}")
        return problems
    return [f"proxy: nothing is mounted at {target_dir}, the directory of --policy {policy_path}"]


def test_compose_file_keeps_its_promises():
    assert compose_problems(load_compose(), COMPOSE_FILE.read_text()) == []


def test_compose_says_why_the_browser_publishes_no_port():
    comments = "\n".join(re.findall(r"#.*", COMPOSE_FILE.read_text()))
    assert "NO `ports:`" in comments and "no authentication" in comments


def test_compose_policy_is_the_kubernetes_policy():
    (configmap,) = [d for d in k8s_docs() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == POLICY_CM]
    assert configmap["data"]["policy.yaml"] == (COMPOSE_DIR / "policy" / "policy.yaml").read_text()


def test_compose_policy_loads():
    policy_file = pytest.importorskip("proxy.policy_file")
    policy_file.load_policy_file(COMPOSE_DIR / "policy" / "policy.yaml")


def _set(path: list, value):
    def mutate(doc):
        target = doc
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return mutate


def _delete(path: list):
    def mutate(doc):
        target = doc
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]
    return mutate


def _append(path: list, value):
    def mutate(doc):
        target = doc
        for key in path:
            target = target[key]
        target.append(value)
    return mutate


def _replace_arg(service: str, old: str, new: str):
    def mutate(doc):
        command = doc["services"][service]["command"]
        command[command.index(old)] = new
    return mutate


COMPOSE_BREAKS = {
    "browser network not internal": (_set(["networks", "browsernet", "internal"], False), "route out"),
    "browser joins egress": (_append(["services", "browser", "networks"], "egress"), "route out"),
    "browser on host network": (_set(["services", "browser", "network_mode"], "host"), "network_mode"),
    "browser on no network": (_delete(["services", "browser", "networks"]), "no declared network"),
    "browser publishes a port": (_set(["services", "browser", "ports"], ["3000:3000"]), "publishes"),
    "a caller bridges the networks": (
        _set(["services", "caller"], {"image": "example/caller", "networks": ["browsernet", "egress"]}),
        "bridges",
    ),
    "proxy has no way out": (_set(["services", "proxy", "networks"], ["browsernet"]), "no network with a route"),
    "proxy admin on the network": (_replace_arg("proxy", "127.0.0.1:3131", "0.0.0.0:3131"), "--admin"),
    "browser pointed elsewhere": (_replace_arg("browser", "proxy:3128", "proxy:8080"), "--proxy"),
    "proxy keeps capabilities": (_delete(["services", "proxy", "cap_drop"]), "cap_drop ALL"),
    "cap_add without a comment": (_set(["services", "browser", "cap_add"], ["SYS_ADMIN"]), "comment"),
    "browser runs as root": (_set(["services", "browser", "user"], "0:0"), "non-root"),
    "proxy has no user": (_delete(["services", "proxy", "user"]), "non-root"),
    "writable root fs": (_set(["services", "browser", "read_only"], False), "read_only"),
    "no no-new-privileges": (_set(["services", "proxy", "security_opt"], []), "no-new-privileges"),
    "privileged": (_set(["services", "browser", "privileged"], True), "privileged"),
    "no memory limit": (_delete(["services", "browser", "mem_limit"]), "mem_limit"),
    "no pids limit": (_delete(["services", "proxy", "pids_limit"]), "pids_limit"),
    "no restart": (_delete(["services", "proxy", "restart"]), "restart"),
    "healthcheck on the wrong port": (
        _set(["services", "proxy", "healthcheck", "test"], ["CMD", "python", "-c", "http://127.0.0.1:3128/healthz"]),
        "/healthz",
    ),
    "healthcheck on the wrong path": (
        _set(["services", "proxy", "healthcheck", "test"], ["CMD", "python", "-c", "http://127.0.0.1:3131/health"]),
        "/healthz",
    ),
    "browser healthcheck elsewhere": (
        _set(["services", "browser", "healthcheck", "test"], ["CMD", "python", "-c", "('127.0.0.1', 9222)"]),
        "browser server's port",
    ),
    "no shm_size": (_delete(["services", "browser", "shm_size"]), "shm_size"),
    "single-file policy mount": (
        _set(["services", "proxy", "volumes", 0], "./policy/policy.yaml:/etc/egresswall/policy.yaml:ro"),
        "single-file",
    ),
    "writable policy mount": (_set(["services", "proxy", "volumes", 0, "read_only"], False), "writable"),
    "policy mounted elsewhere": (_set(["services", "proxy", "volumes", 0, "target"], "/policy"), "nothing is mounted"),
}


@pytest.mark.parametrize("case", COMPOSE_BREAKS, ids=list(COMPOSE_BREAKS))
def test_compose_check_catches(case):
    mutate, expected = COMPOSE_BREAKS[case]
    doc = copy.deepcopy(load_compose())
    mutate(doc)
    problems = compose_problems(doc, COMPOSE_FILE.read_text())
    assert any(expected in p for p in problems), problems


# -- Kubernetes --------------------------------------------------------------------------------------

POLICY_CM = "egresswall-policy"


def k8s_manifest_files() -> list[Path]:
    return sorted(p for p in K8S_DIR.rglob("*.yaml") if p.name != "kustomization.yaml")


def k8s_docs() -> list[dict]:
    return [doc for path in k8s_manifest_files() for doc in yaml.safe_load_all(path.read_text()) if doc]


def kustomizations() -> dict[Path, dict]:
    return {p.parent: yaml.safe_load(p.read_text()) for p in K8S_DIR.rglob("kustomization.yaml")}


def generated_configmaps() -> dict[str, dict[str, Path]]:
    """ConfigMap name → {key: file} for every configMapGenerator (a file's key is its name)."""
    out = {}
    for where, kustomization in kustomizations().items():
        for gen in kustomization.get("configMapGenerator") or []:
            files = {}
            for entry in gen.get("files") or []:
                key, path = entry.split("=", 1) if "=" in entry else (Path(entry).name, entry)
                files[key] = where / path
            out[gen["name"]] = files
    return out


def configmap_keys(docs: list[dict], generated: dict[str, dict[str, Path]]) -> dict[str, set[str]]:
    """ConfigMap name → its keys, for the ConfigMaps written out and the generated ones."""
    keys = {d["metadata"]["name"]: set((d.get("data") or {}) | (d.get("binaryData") or {}))
            for d in docs if d["kind"] == "ConfigMap"}
    return keys | {name: set(files) for name, files in generated.items()}


def all_containers(pod: dict) -> list[tuple[str, dict]]:
    return [("initContainers", c) for c in pod.get("initContainers") or []] + \
        [("containers", c) for c in pod.get("containers") or []]


def is_lock_container(kind: str, container: dict) -> bool:
    return kind == "initContainers" and (container.get("command") or [""])[0] == "nft"


def argv_of(container: dict) -> list[str]:
    return [str(x) for x in (container.get("command") or []) + (container.get("args") or [])]


def egresswall_role(container: dict) -> str | None:
    argv = argv_of(container)
    if argv[:1] == ["egresswall"] and len(argv) > 1:
        return argv[1]
    return None


def container_security_problems(kind: str, container: dict, raw_text: str) -> list[str]:
    name, problems = container["name"], []
    sc = container.get("securityContext") or {}
    caps = sc.get("capabilities") or {}
    if "ALL" not in (caps.get("drop") or []):
        problems.append(f"{name}: capabilities do not drop ALL")
    if sc.get("readOnlyRootFilesystem") is not True:
        problems.append(f"{name}: readOnlyRootFilesystem is not true")
    if sc.get("allowPrivilegeEscalation") is not False:
        problems.append(f"{name}: allowPrivilegeEscalation is not false")
    if sc.get("privileged"):
        problems.append(f"{name}: privileged")
    if is_lock_container(kind, container):
        if list(caps.get("add") or []) != ["NET_ADMIN"]:
            problems.append(f"{name}: the egress-lock init container must add NET_ADMIN and nothing else")
        if not re.search(r"NET_ADMIN.*#|#.*NET_ADMIN", raw_text):
            problems.append(f"{name}: NET_ADMIN without a comment saying why")
        return problems
    if caps.get("add"):
        problems.append(f"{name}: adds capabilities {caps['add']}")
    if sc.get("runAsNonRoot") is not True:
        problems.append(f"{name}: runAsNonRoot is not true")
    if not isinstance(sc.get("runAsUser"), int) or sc["runAsUser"] == 0:
        problems.append(f"{name}: no explicit non-root runAsUser (the packet filter tells users apart by uid)")
    return problems


def pod_problems(pod: dict, raw_text: str) -> list[str]:
    problems = []
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            problems.append(f"pod: {key}")
    if pod.get("automountServiceAccountToken") is not False:
        problems.append("pod: mounts a service account token the containers do not need")
    if ((pod.get("securityContext") or {}).get("seccompProfile") or {}).get("type") != "RuntimeDefault":
        problems.append("pod: no RuntimeDefault seccomp profile")
    for kind, container in all_containers(pod):
        problems += container_security_problems(kind, container, raw_text)
    return problems


def volume_for_mount(pod: dict, container: dict, directory: str) -> tuple[dict | None, dict | None]:
    for mount in container.get("volumeMounts") or []:
        if mount["mountPath"] == directory:
            volumes = {v["name"]: v for v in pod.get("volumes") or []}
            return mount, volumes.get(mount["name"])
    return None, None


def configmap_file_problems(pod: dict, container: dict, path: str, cm_keys: dict[str, set[str]],
                            what: str) -> list[str]:
    """``path`` reaches ``container`` from a ConfigMap: a directory mount (no subPath) with that key."""
    directory, filename = str(PurePosixPath(path).parent), PurePosixPath(path).name
    name = container["name"]
    mount, volume = volume_for_mount(pod, container, directory)
    if mount is None:
        for m in container.get("volumeMounts") or []:
            if m["mountPath"] == path:
                return [f"{name}: {what} is mounted as a single file (subPath); ConfigMap updates never reach it"]
        return [f"{name}: nothing is mounted at {directory}, the directory of {what} {path}"]
    problems = []
    if mount.get("subPath") or mount.get("subPathExpr"):
        problems.append(f"{name}: {what} mounted with subPath; ConfigMap updates never reach it")
    if not mount.get("readOnly"):
        problems.append(f"{name}: {what} is mounted writable")
    cm = (volume or {}).get("configMap")
    if not cm:
        return [*problems, f"{name}: {directory} is not a ConfigMap volume"]
    items = cm.get("items")
    visible = {item["path"]: item["key"] for item in items} if items else {k: k for k in cm_keys.get(cm["name"], ())}
    if cm["name"] not in cm_keys:
        problems.append(f"{name}: the ConfigMap {cm['name']} for {what} is not defined")
    elif filename not in visible or visible[filename] not in cm_keys[cm["name"]]:
        problems.append(f"{name}: the ConfigMap {cm['name']} has no key {filename} for {what} {path}")
    return problems


ADMIN_PATHS = {"livenessProbe": ("/healthz",), "readinessProbe": ("/readyz", "/healthz")}


def container_port(container: dict, port: int | str | None) -> int | None:
    """A probe's or Service's port as a number (a name is looked up in the container's ports)."""
    if isinstance(port, str):
        named = {p.get("name"): p["containerPort"] for p in container.get("ports") or []}
        return named.get(port)
    return port


def probe_problems(container: dict, admin_port: int) -> list[str]:
    """The proxy's probes GET the admin listener's real endpoints."""
    name, problems = container["name"], []
    for probe_name, paths in ADMIN_PATHS.items():
        get = (container.get(probe_name) or {}).get("httpGet")
        if not get:
            problems.append(f"{name}: {probe_name} is not an HTTP check of the admin listener")
        elif container_port(container, get.get("port")) != admin_port or get.get("path") not in paths:
            problems.append(f"{name}: {probe_name} GETs {get.get('path')} on {get.get('port')}, "
                            f"not {' or '.join(paths)} on the admin port {admin_port}")
    return problems


def proxy_problems(pod: dict, container: dict, cm_keys: dict[str, set[str]]) -> list[str]:
    argv = argv_of(container)
    problems = configmap_file_problems(pod, container, option(argv, "--policy") or "", cm_keys, "--policy")
    admin_host, admin_port = host_port(option(argv, "--admin"))
    problems += probe_problems(container, admin_port)
    if is_loopback(admin_host):
        problems.append(f"{container['name']}: --admin on loopback, where the kubelet's HTTP probes cannot reach")
    return problems


def browser_probe_problems(container: dict) -> list[str]:
    argv = argv_of(container)
    host, port = option(argv, "--host") or "127.0.0.1", int(option(argv, "--port") or 3000)
    problems = []
    for probe_name in ("livenessProbe", "readinessProbe"):
        probe = container.get(probe_name) or {}
        if "tcpSocket" in probe:
            if container_port(container, probe["tcpSocket"].get("port")) != port:
                problems.append(f"{container['name']}: {probe_name} checks port {probe['tcpSocket'].get('port')}, "
                                f"not the server's --port {port}")
            if is_loopback(host):
                problems.append(f"{container['name']}: {probe_name} is a kubelet TCP check of a loopback server")
        elif "exec" in probe:
            command = " ".join(probe["exec"].get("command") or [])
            if not re.search(rf"\b{port}\b", command):
                problems.append(f"{container['name']}: {probe_name} does not check the server's --port {port}")
        else:
            problems.append(f"{container['name']}: no {probe_name}")
    return problems


def lock_problems(pod: dict, defines: dict[str, str], cm_keys: dict[str, set[str]],
                  generated: dict[str, dict[str, Path]]) -> list[str]:
    """A sidecar pod: the init container applies egress-lock.nft, and the ruleset fits the pod."""
    problems = []
    locks = [c for kind, c in all_containers(pod) if is_lock_container(kind, c)]
    if len(locks) != 1:
        return [f"pod: {len(locks)} egress-lock init containers, expected 1"]
    (lock,) = locks
    path = option(argv_of(lock), "-f") or ""
    problems += configmap_file_problems(pod, lock, path, cm_keys, "the ruleset")
    _, volume = volume_for_mount(pod, lock, str(PurePosixPath(path).parent))
    cm_name = ((volume or {}).get("configMap") or {}).get("name")
    source = generated.get(cm_name, {}).get(PurePosixPath(path).name)
    if source is None or source.resolve() != RULESET.resolve():
        problems.append(f"{lock['name']}: does not apply {RULESET.relative_to(ROOT)} (from {cm_name}: {source})")

    containers = [c for kind, c in all_containers(pod) if kind == "containers"]
    proxies = [c for c in containers if egresswall_role(c) == "run"]
    if len(proxies) != 1:
        return [*problems, f"pod: {len(proxies)} proxy containers beside the egress lock, expected 1"]
    (proxy,) = proxies
    proxy_uid = (proxy.get("securityContext") or {}).get("runAsUser")
    if str(proxy_uid) != defines.get("proxy_uid"):
        problems.append(f"egress-lock.nft proxy_uid {defines.get('proxy_uid')} is not the proxy's "
                        f"runAsUser {proxy_uid}")
    for c in containers:
        if c is not proxy and (c.get("securityContext") or {}).get("runAsUser") == proxy_uid:
            problems.append(f"{c['name']}: runs as the proxy's uid {proxy_uid}, which the packet filter lets out")
    listen_host, listen_port = host_port(option(argv_of(proxy), "--listen"))
    _, admin_port = host_port(option(argv_of(proxy), "--admin"))
    if str(listen_port) != defines.get("proxy_port"):
        problems.append(f"egress-lock.nft proxy_port {defines.get('proxy_port')} is not the proxy's --listen port")
    if str(admin_port) != defines.get("admin_port"):
        problems.append(f"egress-lock.nft admin_port {defines.get('admin_port')} is not the proxy's --admin port")
    if not is_loopback(listen_host):
        problems.append(f"{proxy['name']}: --listen {listen_host}: in the sidecar shape the proxy serves the pod only")
    local_ports = nft_ports(defines.get("pod_local_ports", ""))
    if admin_port in local_ports:
        problems.append("egress-lock.nft pod_local_ports opens the admin port")
    for c in containers:
        if egresswall_role(c) == "browser-server":
            argv = argv_of(c)
            if option(argv, "--proxy") != f"127.0.0.1:{listen_port}":
                problems.append(f"{c['name']}: --proxy {option(argv, '--proxy')} is not the sidecar "
                                f"127.0.0.1:{listen_port}")
            if int(option(argv, "--port") or 0) not in local_ports:
                problems.append(f"{c['name']}: --port is not in egress-lock.nft's pod_local_ports")
            if not is_loopback(option(argv, "--host") or "127.0.0.1"):
                problems.append(f"{c['name']}: listens beyond the pod's loopback without authentication")
            # Its relay reaches the Playwright driver on loopback: at a port the filter admits, for its own user
            # only (a random port is refused, and the browser server cannot start its browser).
            if option(argv, "--driver-port") != defines.get("driver_port"):
                problems.append(f"{c['name']}: --driver-port {option(argv, '--driver-port')} is not egress-lock.nft's "
                                f"driver_port {defines.get('driver_port')}")
            if str((c.get("securityContext") or {}).get("runAsUser")) != defines.get("browser_uid"):
                problems.append(f"{c['name']}: runAsUser is not egress-lock.nft's browser_uid "
                                f"{defines.get('browser_uid')}, the one user that reaches the driver's port")
            if int(option(argv, "--driver-port") or 0) in local_ports:
                problems.append(f"{c['name']}: the driver's port is in pod_local_ports, open to every container")
    return problems


def network_policies_for(labels: dict, docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] == "NetworkPolicy"
            and all(labels.get(k) == v for k, v in (d["spec"]["podSelector"].get("matchLabels") or {}).items())
            and not d["spec"]["podSelector"].get("matchExpressions")]


def browser_pool_problems(deployment: dict, docs: list[dict]) -> list[str]:
    """A browser pod without a proxy beside it: NetworkPolicy egress only to the proxy pods' port."""
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    proxies = [d for d in docs if d["kind"] == "Deployment"
               and any(egresswall_role(c) == "run" for c in d["spec"]["template"]["spec"]["containers"])]
    proxy_ports = {host_port(option(argv_of(c), "--listen"))[1]
                   for d in proxies for c in d["spec"]["template"]["spec"]["containers"] if egresswall_role(c) == "run"}
    proxy_labels = [d["spec"]["template"]["metadata"]["labels"] for d in proxies]
    policies = [p for p in network_policies_for(labels, docs) if "Egress" in p["spec"].get("policyTypes", [])]
    if not policies:
        return [f"{deployment['metadata']['name']}: no NetworkPolicy bounds the browser pods' egress"]
    problems = []
    for policy in policies:
        for rule in policy["spec"].get("egress") or []:
            peers = rule.get("to") or []
            ports = rule.get("ports") or []
            if not peers or not ports:
                problems.append(f"{policy['metadata']['name']}: an egress rule open to every peer or every port")
            for peer in peers:
                selector = (peer.get("podSelector") or {}).get("matchLabels")
                if set(peer) != {"podSelector"} or not selector or not any(
                        all(pl.get(k) == v for k, v in selector.items()) for pl in proxy_labels):
                    problems.append(f"{policy['metadata']['name']}: browser pods may reach {peer}, not only the proxy")
            for port in ports:
                if port.get("protocol", "TCP") != "TCP" or port.get("port") not in proxy_ports:
                    problems.append(f"{policy['metadata']['name']}: browser pods may reach port {port}")
    return problems


def k8s_problems(docs: list[dict], raw_text: str, defines: dict[str, str],
                 generated: dict[str, dict[str, Path]] | None = None) -> list[str]:
    generated = generated_configmaps() if generated is None else generated
    cm_keys = configmap_keys(docs, generated)
    problems = []
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    if not deployments:
        problems.append("no Deployment")
    for deployment in deployments:
        pod = deployment["spec"]["template"]["spec"]
        name = deployment["metadata"]["name"]
        problems += [f"{name}/{p}" for p in pod_problems(pod, raw_text)]
        roles = {egresswall_role(c): c for c in pod.get("containers") or []}
        if "run" in roles:
            problems += [f"{name}/{p}" for p in proxy_problems(pod, roles["run"], cm_keys)]
        if "browser-server" in roles:
            problems += [f"{name}/{p}" for p in browser_probe_problems(roles["browser-server"])]
            if "run" in roles:
                problems += [f"{name}/{p}" for p in lock_problems(pod, defines, cm_keys, generated)]
            else:
                problems += browser_pool_problems(deployment, docs)
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        policies = [p for p in network_policies_for(labels, docs) if "Egress" in p["spec"].get("policyTypes", [])]
        if not policies:
            problems.append(f"{name}: no NetworkPolicy bounds the pod's egress")
        for policy in policies:
            for rule in policy["spec"].get("egress") or []:
                if not rule.get("to") or not rule.get("ports"):
                    problems.append(f"NetworkPolicy {policy['metadata']['name']}: an egress rule open to every "
                                    "peer or every port")
    if not any(not (d["spec"]["podSelector"] or {}) and set(d["spec"].get("policyTypes", [])) == {"Ingress", "Egress"}
               and not d["spec"].get("ingress") and not d["spec"].get("egress")
               for d in docs if d["kind"] == "NetworkPolicy"):
        problems.append("no default-deny NetworkPolicy: a pod nobody wrote a policy for could reach anything")
    for service in (d for d in docs if d["kind"] == "Service"):
        problems += service_problems(service, docs)
    return problems


def service_problems(service: dict, docs: list[dict]) -> list[str]:
    """A Service selects pods of one Deployment and exposes only ports they declare (never admin)."""
    selector = service["spec"]["selector"]
    targets = [d for d in docs if d["kind"] == "Deployment"
               and all(d["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in selector.items())]
    name = service["metadata"]["name"]
    if len(targets) != 1:
        return [f"Service {name}: selects {len(targets)} Deployments"]
    containers = targets[0]["spec"]["template"]["spec"]["containers"]
    declared = {p.get("name"): p["containerPort"] for c in containers for p in c.get("ports") or []}
    problems = []
    for port in service["spec"]["ports"]:
        target = port.get("targetPort", port["port"])
        number = declared.get(target, target)
        if number not in declared.values():
            problems.append(f"Service {name}: port {port['port']} goes to {target}, which no container declares")
        for c in containers:
            if egresswall_role(c) == "run":
                _, admin_port = host_port(option(argv_of(c), "--admin"))
                if number == admin_port:
                    problems.append(f"Service {name}: exposes the proxy's admin port")
                elif number != host_port(option(argv_of(c), "--listen"))[1]:
                    problems.append(f"Service {name}: port {number} is not the proxy's --listen port")
    return problems


def k8s_raw_text() -> str:
    return "\n".join(p.read_text() for p in k8s_manifest_files())


def test_kubernetes_manifests_keep_their_promises():
    assert k8s_problems(k8s_docs(), k8s_raw_text(), nft_defines(RULESET.read_text())) == []


def test_every_kubernetes_file_parses_and_is_part_of_a_kustomization():
    listed: dict[Path, Path] = {}
    for where, kustomization in kustomizations().items():
        assert kustomization["kind"] in ("Kustomization", "Component"), where
        for entry in (kustomization.get("resources") or []) + (kustomization.get("components") or []):
            path = (where / entry).resolve()
            assert path.exists(), f"{where}/kustomization.yaml lists {entry}, which does not exist"
            listed[path] = where
        for files in generated_configmaps().values():
            for path in files.values():
                assert path.is_file(), f"a configMapGenerator names {path}, which does not exist"
    for path in k8s_manifest_files():
        assert all(isinstance(d, dict) and "kind" in d for d in yaml.safe_load_all(path.read_text()) if d), path
        assert path.resolve() in listed, f"{path.relative_to(ROOT)} is in no kustomization"
    root = kustomizations()[K8S_DIR]
    shapes = {p.name for p in K8S_DIR.iterdir() if (p / "kustomization.yaml").exists()}
    assert shapes == {"sidecar", "shared"}
    assert len(root.get("components") or []) == 1, "the root kustomization picks exactly one shape"


def test_policy_configmap_key_is_the_path_the_proxy_watches():
    docs = k8s_docs()
    (configmap,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == POLICY_CM]
    policy_paths = {option(argv_of(c), "--policy") for d in docs if d["kind"] == "Deployment"
                    for c in d["spec"]["template"]["spec"]["containers"] if egresswall_role(c) == "run"}
    assert len(policy_paths) == 1
    assert set(configmap["data"]) == {PurePosixPath(policy_paths.pop()).name}
    # A generated ConfigMap would get a hash suffix: a new name per edit rolls pods instead of reloading.
    assert POLICY_CM not in generated_configmaps()


def test_ruleset_defines_match_the_sidecar_pod_and_say_what_they_are():
    defines = nft_defines(RULESET.read_text())
    assert {"proxy_uid", "proxy_port", "admin_port"} <= set(defines)
    assert generated_configmaps()["egresswall-egress-lock"] == {"egress-lock.nft": RULESET}


def test_namespace_pod_security_is_relaxed_only_by_the_sidecar_shape():
    (namespace,) = [d for d in k8s_docs() if d["kind"] == "Namespace"]
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    sidecar = kustomizations()[K8S_DIR / "sidecar"]
    assert "enforce: privileged" in sidecar["patches"][0]["patch"]
    assert "enforce" not in json.dumps(kustomizations()[K8S_DIR / "shared"])


def _k8s(mutate_docs):
    docs = copy.deepcopy(k8s_docs())
    mutate_docs(docs)
    return k8s_problems(docs, k8s_raw_text(), nft_defines(RULESET.read_text()))


def _deployment(docs, name):
    return next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == name)


def _container(docs, deployment, name, kind="containers"):
    pod = _deployment(docs, deployment)["spec"]["template"]["spec"]
    return next(c for c in pod[kind] if c["name"] == name)


def _sc(deployment, name, key, value, kind="containers"):
    def mutate(docs):
        _container(docs, deployment, name, kind)["securityContext"][key] = value
    return mutate


def _arg(deployment, name, old, new):
    def mutate(docs):
        command = _container(docs, deployment, name)["command"]
        command[command.index(old)] = new
    return mutate


def _mount(deployment, name, volume, key, value, kind="containers"):
    def mutate(docs):
        mount = next(m for m in _container(docs, deployment, name, kind)["volumeMounts"] if m["name"] == volume)
        mount[key] = value
    return mutate


def _pod(deployment, key, value):
    def mutate(docs):
        _deployment(docs, deployment)["spec"]["template"]["spec"][key] = value
    return mutate


def _drop_kind(kind, name):
    def mutate(docs):
        docs[:] = [d for d in docs if not (d["kind"] == kind and d["metadata"]["name"] == name)]
    return mutate


def _policy_key(docs):
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == POLICY_CM)
    cm["data"] = {"default.yaml": cm["data"]["policy.yaml"]}


def _browser_pool_egress(peer):
    def mutate(docs):
        policy = next(d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "browser-pool")
        policy["spec"]["egress"].append({"to": [peer], "ports": [{"protocol": "UDP", "port": 53}]})
    return mutate


def _lock_path(docs):
    init = _container(docs, "link-reader", "egress-lock", "initContainers")
    init["command"] = ["nft", "-f", "/etc/egresswall-lock/other.nft"]


K8S_BREAKS = {
    "writable root fs": (_sc("link-reader", "browser", "readOnlyRootFilesystem", False), "readOnlyRootFilesystem"),
    "privilege escalation": (_sc("link-reader", "app", "allowPrivilegeEscalation", True), "allowPrivilegeEscalation"),
    "capabilities kept": (_sc("link-reader", "egresswall", "capabilities", {}), "drop ALL"),
    "browser adds a capability": (
        _sc("link-reader", "browser", "capabilities", {"drop": ["ALL"], "add": ["SYS_ADMIN"]}), "adds capabilities"),
    "runs as root": (_sc("browser-pool", "browser", "runAsUser", 0), "runAsUser"),
    "runAsNonRoot off": (_sc("egresswall", "egresswall", "runAsNonRoot", False), "runAsNonRoot"),
    "lock takes more than NET_ADMIN": (
        _sc("link-reader", "egress-lock", "capabilities", {"drop": ["ALL"], "add": ["NET_ADMIN", "SYS_ADMIN"]},
            "initContainers"), "NET_ADMIN and nothing else"),
    "lock keeps all capabilities": (_sc("link-reader", "egress-lock", "capabilities", {"add": ["NET_ADMIN"]},
                                        "initContainers"), "drop ALL"),
    "browser shares the proxy's uid": (_sc("link-reader", "browser", "runAsUser", 10001), "proxy's uid"),
    "proxy uid differs from the ruleset": (_sc("link-reader", "egresswall", "runAsUser", 10005), "proxy_uid"),
    "proxy port differs from the ruleset": (_arg("link-reader", "egresswall", "127.0.0.1:3128", "127.0.0.1:8888"),
                                            "proxy_port"),
    "admin port differs from the ruleset": (_arg("link-reader", "egresswall", "0.0.0.0:3131", "0.0.0.0:3132"),
                                            "admin_port"),
    "sidecar proxy listens on the pod IP": (_arg("link-reader", "egresswall", "127.0.0.1:3128", "0.0.0.0:3128"),
                                            "serves the pod only"),
    "browser bypasses the sidecar": (_arg("link-reader", "browser", "127.0.0.1:3128", "10.0.0.5:3128"), "--proxy"),
    "browser listens on the pod IP": (_arg("link-reader", "browser", "127.0.0.1", "0.0.0.0"), "beyond the pod"),
    "no lock init container": (_pod("link-reader", "initContainers", []), "egress-lock init containers"),
    "lock applies another file": (_lock_path, "no key other.nft"),
    "policy key renamed": (_policy_key, "no key policy.yaml"),
    "policy mounted with subPath": (_mount("link-reader", "egresswall", "policy", "subPath", "policy.yaml"),
                                    "subPath"),
    "policy mounted writable": (_mount("egresswall", "egresswall", "policy", "readOnly", False), "writable"),
    "policy ConfigMap missing": (_drop_kind("ConfigMap", POLICY_CM), "not defined"),
    "liveness on the wrong path": (
        lambda docs: _container(docs, "link-reader", "egresswall")["livenessProbe"]["httpGet"].update(path="/health"),
        "livenessProbe"),
    "readiness on the proxy port": (
        lambda docs: _container(docs, "egresswall", "egresswall")["readinessProbe"]["httpGet"].update(port=3128),
        "readinessProbe"),
    "browser probe on another port": (
        lambda docs: _container(docs, "browser-pool", "browser")["livenessProbe"]["tcpSocket"].update(port=9222),
        "not the server's --port"),
    "hostNetwork": (_pod("link-reader", "hostNetwork", True), "hostNetwork"),
    "service account token": (_pod("egresswall", "automountServiceAccountToken", True), "service account"),
    "browser pool may resolve DNS": (
        _browser_pool_egress({"namespaceSelector": {}, "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}),
        "not only the proxy"),
    "browser pool egress unbounded": (
        lambda docs: [_drop_kind("NetworkPolicy", name)(docs) for name in ("browser-pool", "default-deny")],
        "bounds the browser pods"),
    "browser pool egress to any port": (
        lambda docs: next(d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "browser-pool")[
            "spec"]["egress"][0].pop("ports"),
        "every peer or every port"),
    "sidecar pod egress opened": (
        lambda docs: next(d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "link-reader")[
            "spec"]["egress"].append({}),
        "every peer or every port"),
    "no default deny": (_drop_kind("NetworkPolicy", "default-deny"), "default-deny"),
    "service exposes the admin port": (
        lambda docs: next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "egresswall")[
            "spec"]["ports"].append({"name": "admin", "port": 3131, "targetPort": "admin"}),
        "admin port"),
}


@pytest.mark.parametrize("case", K8S_BREAKS, ids=list(K8S_BREAKS))
def test_kubernetes_check_catches(case):
    mutate, expected = K8S_BREAKS[case]
    problems = _k8s(mutate)
    assert any(expected in p for p in problems), problems


def test_lock_check_catches_a_comment_free_net_admin():
    docs = k8s_docs()
    raw = re.sub(r"#.*", "", k8s_raw_text())
    assert any("NET_ADMIN without a comment" in p for p in k8s_problems(docs, raw, nft_defines(RULESET.read_text())))


def test_lock_check_catches_an_opened_admin_port():
    defines = {**nft_defines(RULESET.read_text()), "pod_local_ports": "{ 3000, 3131 }"}
    assert any("opens the admin port" in p for p in k8s_problems(k8s_docs(), k8s_raw_text(), defines))


def test_lock_check_catches_a_ruleset_that_is_not_the_lab_file(tmp_path):
    generated = copy.deepcopy(generated_configmaps())
    other = tmp_path / "egress-lock.nft"
    other.write_text(RULESET.read_text())
    generated["egresswall-egress-lock"]["egress-lock.nft"] = other
    problems = k8s_problems(k8s_docs(), k8s_raw_text(), nft_defines(RULESET.read_text()), generated)
    assert any("does not apply compose/k8s/egress-lock.nft" in p for p in problems), problems


# -- the rendered output, where kubectl is at hand -------------------------------------------------


@pytest.mark.parametrize("shape", ["sidecar", "shared"])
def test_kustomize_renders_each_shape_and_it_keeps_the_promises(shape, tmp_path):
    kubectl_or_skip()
    tree = tmp_path / "k8s"
    shutil.copytree(K8S_DIR, tree)
    root = tree / "kustomization.yaml"
    text = root.read_text()
    text = re.sub(r"^components:\n(\s+#?\s*- \w+\n)+", f"components:\n  - {shape}\n", text, flags=re.M)
    root.write_text(text)
    docs = [d for d in yaml.safe_load_all(render(tree)) if d]
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {"egresswall"}
    # Map the hashed ConfigMap name kustomize generated back to the ruleset file it came from.
    (lock_cm,) = [d for d in docs if d["kind"] == "ConfigMap" and "egress-lock.nft" in d.get("data", {})]
    assert lock_cm["data"]["egress-lock.nft"] == RULESET.read_text()
    generated = {lock_cm["metadata"]["name"]: {"egress-lock.nft": RULESET}}
    assert k8s_problems(docs, k8s_raw_text(), nft_defines(RULESET.read_text()), generated) == []
    roles = {egresswall_role(c) for d in docs if d["kind"] == "Deployment"
             for c in d["spec"]["template"]["spec"]["containers"]}
    assert {"run", "browser-server"} <= roles
    (namespace,) = [d for d in docs if d["kind"] == "Namespace"]
    enforce = namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
    assert enforce == ("privileged" if shape == "sidecar" else "restricted")


# -- the Kubernetes schemas, offline (kubernetes-validate ships them) ---------------------------------

K8S_VERSION = "1.30"  # the oldest Kubernetes release the manifests are written for


def schema_problems(doc: dict, version: str = K8S_VERSION) -> list[str]:
    """What the Kubernetes JSON schema of ``doc``'s kind says is wrong with it (strict: unknown fields too)."""
    import kubernetes_validate

    name = f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as err:
        where = "/".join(str(p) for p in err.path)
        return [f"{name}: {where}: {err.message}"]
    except kubernetes_validate.SchemaNotFoundError as err:
        return [f"{name}: no schema ({err})"]
    return []


@pytest.mark.parametrize("path", k8s_manifest_files(), ids=lambda p: str(p.relative_to(K8S_DIR)))
def test_every_kubernetes_manifest_passes_the_kubernetes_schema(path):
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    assert docs
    assert [p for doc in docs for p in schema_problems(doc)] == []


def _doc(kind: str, name: str) -> dict:
    return copy.deepcopy(next(d for d in k8s_docs() if d["kind"] == kind and d["metadata"]["name"] == name))


@pytest.mark.parametrize("mutate, expected", [
    (lambda d: d["spec"].update(replica=3), "Additional properties are not allowed ('replica'"),
    (lambda d: d["spec"].update(replicas="three"), "'three' is not of type 'integer'"),
    (lambda d: d["spec"]["template"]["spec"]["containers"][0].update(securityContext={"runAsUser": "x"}),
     "'x' is not of type 'integer'"),
    (lambda d: d["spec"]["template"]["spec"]["containers"][0].pop("name"), "'name' is a required property"),
])
def test_schema_check_catches(mutate, expected):
    doc = _doc("Deployment", "egresswall")
    assert schema_problems(doc) == []
    mutate(doc)
    assert any(expected in p for p in schema_problems(doc)), schema_problems(doc)


# -- the shared shape: many replicas, one state ------------------------------------------------------------

SHARED_DIR = K8S_DIR / "shared"
CA_SECRET = "egresswall-ca"


def shared_docs() -> list[dict]:
    return [d for p in sorted(SHARED_DIR.glob("*.yaml")) if p.name != "kustomization.yaml"
            for d in yaml.safe_load_all(p.read_text()) if d]


def shared_problems(docs: list[dict]) -> list[str]:
    """The shared shape scales: several replicas behind a Service, a PodDisruptionBudget and an autoscaler
    for them, readiness on /readyz, the CA from one Secret (never made per pod), the policy from the
    ConfigMap, and one Redis for the state the replicas share."""
    problems = []
    proxies = [d for d in docs if d["kind"] == "Deployment"
               and any(egresswall_role(c) == "run" for c in d["spec"]["template"]["spec"]["containers"])]
    if len(proxies) != 1:
        return [f"{len(proxies)} proxy Deployments, expected 1"]
    (proxy,) = proxies
    name, labels = proxy["metadata"]["name"], proxy["spec"]["template"]["metadata"]["labels"]
    pod = proxy["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if egresswall_role(c) == "run"]

    def selects(selector: dict) -> bool:
        return bool(selector) and all(labels.get(k) == v for k, v in selector.items())

    if (proxy["spec"].get("replicas") or 1) < 2:
        problems.append(f"{name}: {proxy['spec'].get('replicas')} replica(s): not a shape that scales")
    if not any(d["kind"] == "Service" and selects(d["spec"]["selector"]) for d in docs):
        problems.append(f"{name}: no Service in front of the replicas")
    hpas = [d for d in docs if d["kind"] == "HorizontalPodAutoscaler" and d["spec"]["scaleTargetRef"]["name"] == name]
    if not hpas or hpas[0]["spec"].get("minReplicas", 1) < 2:
        problems.append(f"{name}: no HorizontalPodAutoscaler that keeps at least two replicas")
    pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget" and selects(d["spec"]["selector"]["matchLabels"])]
    if not pdbs or pdbs[0]["spec"].get("maxUnavailable", 0) == 0 and pdbs[0]["spec"].get("minAvailable", 0) == 0:
        problems.append(f"{name}: no PodDisruptionBudget that keeps replicas up during a drain")
    if ((container.get("readinessProbe") or {}).get("httpGet") or {}).get("path") != "/readyz":
        problems.append(f"{name}: readiness is not /readyz")

    confdir = option(argv_of(container), "--confdir")
    if not confdir:
        problems.append(f"{name}: no --confdir: each replica would make a CA of its own in ~/.mitmproxy")
    else:
        mount, volume = volume_for_mount(pod, container, confdir)
        secret = (volume or {}).get("secret") or {}
        if secret.get("secretName") != CA_SECRET:
            problems.append(f"{name}: --confdir {confdir} is not the Secret {CA_SECRET}")
        else:
            if secret.get("optional") is not False:
                problems.append(f"{name}: the CA Secret is not required: a pod without it would make its own CA")
            files = {item["path"] for item in secret.get("items") or []}
            if not {"mitmproxy-ca.pem", "mitmproxy-dhparam.pem"} <= files:
                problems.append(f"{name}: the CA Secret lacks mitmproxy-ca.pem or mitmproxy-dhparam.pem: mitmproxy "
                                f"would write into --confdir")
        if not (mount or {}).get("readOnly"):
            problems.append(f"{name}: --confdir is writable: nothing may make or change the CA in a pod")
    policy = option(argv_of(container), "--policy") or ""
    _, policy_volume = volume_for_mount(pod, container, str(PurePosixPath(policy).parent))
    if ((policy_volume or {}).get("configMap") or {}).get("name") != POLICY_CM:
        problems.append(f"{name}: the policy is not the ConfigMap {POLICY_CM}")

    for deployment in docs:
        if deployment["kind"] != "Deployment" or deployment is proxy:
            continue
        for c in deployment["spec"]["template"]["spec"]["containers"]:
            if egresswall_role(c) == "browser-server":
                ca = option(argv_of(c), "--proxy-ca")
                _, volume = volume_for_mount(deployment["spec"]["template"]["spec"], c,
                                             str(PurePosixPath(ca or "/").parent))
                secret = (volume or {}).get("secret") or {}
                items = {item["key"] for item in secret.get("items") or []}
                if secret.get("secretName") != CA_SECRET or items != {"mitmproxy-ca-cert.pem"}:
                    problems.append(f"{deployment['metadata']['name']}: the browser does not trust the shared CA's "
                                    "certificate from the Secret (and only the certificate)")
    redis = [d for d in docs if d["kind"] == "Deployment" and any(
        (c.get("command") or [""])[0] == "redis-server" for c in d["spec"]["template"]["spec"]["containers"])]
    if len(redis) != 1 or redis[0]["spec"].get("replicas") != 1:
        problems.append("no single Redis Deployment for the replicas' shared session store")
    return problems


def test_shared_shape_scales_with_one_state():
    assert shared_problems(shared_docs()) == []


SHARED_BREAKS = {
    "one replica": (lambda docs: _proxy_of(docs)["spec"].update(replicas=1), "not a shape that scales"),
    "ca per pod": (lambda docs: _proxy_container(docs)["command"].remove("--confdir"), "make a CA of its own"),
    "ca in an emptyDir": (lambda docs: _volume(docs, "interception-ca").update(secret=None, emptyDir={}),
                          "is not the Secret egresswall-ca"),
    "optional ca": (lambda docs: _volume(docs, "interception-ca")["secret"].update(optional=True),
                    "the CA Secret is not required"),
    "writable ca": (lambda docs: [m.update(readOnly=False) for m in _proxy_container(docs)["volumeMounts"]
                                  if m["name"] == "interception-ca"], "--confdir is writable"),
    "readiness on healthz": (lambda docs: _proxy_container(docs)["readinessProbe"]["httpGet"].update(path="/healthz"),
                             "readiness is not /readyz"),
    "no pdb": (lambda docs: docs.remove(next(d for d in docs if d["kind"] == "PodDisruptionBudget")),
               "no PodDisruptionBudget"),
    "no hpa": (lambda docs: docs.remove(next(d for d in docs if d["kind"] == "HorizontalPodAutoscaler")),
               "no HorizontalPodAutoscaler"),
    "no redis": (lambda docs: docs.remove(next(d for d in docs if d["metadata"]["name"] == "egresswall-redis"
                                               and d["kind"] == "Deployment")), "no single Redis"),
}


def _proxy_of(docs: list[dict]) -> dict:
    return next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "egresswall")


def _proxy_container(docs: list[dict]) -> dict:
    return _proxy_of(docs)["spec"]["template"]["spec"]["containers"][0]


def _volume(docs: list[dict], name: str) -> dict:
    return next(v for v in _proxy_of(docs)["spec"]["template"]["spec"]["volumes"] if v["name"] == name)


@pytest.mark.parametrize("case", SHARED_BREAKS, ids=list(SHARED_BREAKS))
def test_shared_shape_check_catches(case):
    mutate, expected = SHARED_BREAKS[case]
    docs = shared_docs()
    mutate(docs)
    assert any(expected in p for p in shared_problems(docs)), shared_problems(docs)


# -- the stop: open tunnels get the policy's tunnel_grace, and the deployment waits for it ------------------

# After limits.tunnel_grace egresswall closes what is still open and records it within about 3 s more (README,
# the start-up paragraph; proxy/runner.py ``stop``: 2 s for the closing records, 1 s for the fast front), then
# shuts down. The deployment must wait at least this much longer than tunnel_grace before its SIGKILL.
STOP_MARGIN = 5
COMPOSE_README = COMPOSE_DIR / "README.md"
DEPLOYED_POLICY = COMPOSE_DIR / "policy" / "policy.yaml"


def duration_seconds(value: str | int | float | None, default: float) -> float:
    """A compose duration (``60s``, ``1m30s``, ``500ms``) in seconds; ``default`` when unset."""
    if value is None:
        return default
    if isinstance(value, int | float):
        return float(value)
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", value)
    assert parts and "".join(n + u for n, u in parts) == value, f"not a compose duration: {value!r}"
    return sum(float(n) * units[u] for n, u in parts)


def deployed_tunnel_grace(text: str) -> float:
    from policy.loader import parse_policy

    return parse_policy(text, "policy.yaml").limits.tunnel_grace


def stop_grace_problems(compose_doc: dict, docs: list[dict], tunnel_grace: float) -> list[str]:
    """Every deployment of the proxy waits for tunnel_grace and the stop's own seconds before SIGKILL."""
    problems = []
    name, proxy = find_service(compose_doc, "run")
    wait = duration_seconds(proxy.get("stop_grace_period"), 10)  # Docker's default
    if wait < tunnel_grace + STOP_MARGIN:
        problems.append(f"compose {name}: stop_grace_period {wait:g} s is less than limits.tunnel_grace "
                        f"{tunnel_grace:g} s + {STOP_MARGIN} s: Docker kills the proxy before it has closed and "
                        "recorded the open tunnels")
    for deployment in (d for d in docs if d["kind"] == "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        if not any(egresswall_role(c) == "run" for c in pod.get("containers") or []):
            continue
        wait = pod.get("terminationGracePeriodSeconds", 30)  # Kubernetes' default
        if wait < tunnel_grace + STOP_MARGIN:
            problems.append(f"{deployment['metadata']['name']}: terminationGracePeriodSeconds {wait} is less than "
                            f"limits.tunnel_grace {tunnel_grace:g} s + {STOP_MARGIN} s: the kubelet kills the "
                            "proxy before it has closed and recorded the open tunnels")
    return problems


def test_every_deployment_waits_for_the_proxys_stop():
    """The policy gives open tunnels limits.tunnel_grace on SIGTERM; docker compose and the kubelet must not
    SIGKILL the proxy before it has closed and recorded them (compose/README.md, "Stopping")."""
    (configmap,) = [d for d in k8s_docs() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == POLICY_CM]
    grace = deployed_tunnel_grace(configmap["data"]["policy.yaml"])
    assert grace >= 30, "the deployments promise open tunnels most of their 60 s grace period"
    assert stop_grace_problems(load_compose(), k8s_docs(), grace) == []


def test_compose_readme_states_the_stop_numbers_the_files_hold():
    text = " ".join(COMPOSE_README.read_text().split())
    grace = deployed_tunnel_grace(DEPLOYED_POLICY.read_text())
    _, proxy = find_service(load_compose(), "run")
    assert f"tunnel_grace: {grace:g}" in text
    assert f"stop_grace_period: {proxy['stop_grace_period']}" in text
    for deployment in (d for d in k8s_docs() if d["kind"] == "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        if any(egresswall_role(c) == "run" for c in pod["containers"]):
            assert f"terminationGracePeriodSeconds: {pod['terminationGracePeriodSeconds']}" in text


@pytest.mark.parametrize("case", ["compose default", "compose short", "sidecar default", "shared short",
                                  "long tunnel_grace"])
def test_stop_grace_check_catches(case):
    compose_doc, docs, grace = copy.deepcopy(load_compose()), copy.deepcopy(k8s_docs()), 50.0
    _, proxy = find_service(compose_doc, "run")
    if case == "compose default":
        proxy.pop("stop_grace_period")
    elif case == "compose short":
        proxy["stop_grace_period"] = "52s"
    elif case == "sidecar default":
        _deployment(docs, "link-reader")["spec"]["template"]["spec"].pop("terminationGracePeriodSeconds")
    elif case == "shared short":
        _deployment(docs, "egresswall")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 54
    else:
        grace = 58.0
    assert stop_grace_problems(compose_doc, docs, grace), case


# -- the deployed policy is the bundled default, but for the changes it names ------------------------------

def _flatten(value, path=()) -> dict[tuple, object]:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flatten(item, (*path, key)).items()}
    return {path: value}


def test_deployed_policy_is_the_bundled_default_but_for_the_changes_it_names():
    """compose/policy/policy.yaml says it "starts as the bundled default (policy/default.yaml)" and names how it
    differs: every other key is the default's, and each difference is named in its comments and in
    compose/README.md."""
    deployed = _flatten(yaml.safe_load(DEPLOYED_POLICY.read_text()))
    bundled = _flatten(yaml.safe_load((ROOT / "policy" / "default.yaml").read_text()))
    differ = sorted(k for k in deployed.keys() | bundled.keys() if deployed.get(k, ...) != bundled.get(k, ...))
    assert differ == [("limits", "tunnel_grace")]
    comments = " ".join(re.findall(r"#(.*)", DEPLOYED_POLICY.read_text()))
    readme = " ".join(COMPOSE_README.read_text().split())
    for key in differ:
        assert ".".join(key) in comments and f"`{'.'.join(key)}`" in readme, key


# -- the compose README's Kubernetes instructions against the manifests ----------------------------------

def test_compose_readme_reads_the_audit_log_of_each_shapes_proxy():
    """Each shape's proxy Deployment and container have a `kubectl exec` line in compose/README.md."""
    shown = set(re.findall(r"kubectl exec -n egresswall deploy/([\w-]+) -c ([\w-]+) -- tail -f (\S+)",
                           COMPOSE_README.read_text()))
    wanted = set()
    for deployment in (d for d in k8s_docs() if d["kind"] == "Deployment"):
        for c in deployment["spec"]["template"]["spec"]["containers"]:
            if egresswall_role(c) == "run":
                wanted.add((deployment["metadata"]["name"], c["name"], option(argv_of(c), "--log")))
    assert len(wanted) == 2 and shown == wanted


def browser_client_problems(policy: dict, label: str = "egresswall.io/browser-client",
                            rules: list[dict] | None = None) -> list[str]:
    """Who reaches the unauthenticated browser servers (or, with ``label`` and ``rules``, another port): every
    ingress peer requires the client pod label, and a peer in another namespace is one the namespace's label
    selects too (never every namespace)."""
    problems = []
    for rule in policy["spec"].get("ingress") or [] if rules is None else rules:
        peers = rule.get("from")
        if not peers:
            problems.append("an ingress rule open to every peer")
        for peer in peers or []:
            pods = (peer.get("podSelector") or {}).get("matchLabels") or {}
            if pods.get(label) != "true" or set(peer) - {"podSelector", "namespaceSelector"}:
                problems.append(f"peer {peer} does not require the {label} pod label")
            if "namespaceSelector" in peer and not (peer["namespaceSelector"] or {}).get("matchLabels"):
                problems.append(f"peer {peer} admits every namespace")
    return problems


def test_browser_pool_admits_labelled_clients_of_labelled_namespaces_only():
    (policy,) = [d for d in k8s_docs() if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "browser-pool"]
    assert browser_client_problems(policy) == []
    peers = policy["spec"]["ingress"][0]["from"]
    assert any("namespaceSelector" in p for p in peers), "callers in another namespace are never admitted"
    label = "kubectl label namespace my-app egresswall.io/browser-client=true"
    assert label in COMPOSE_README.read_text()


def test_the_sidecars_app_port_admits_labelled_callers_of_labelled_namespaces_only():
    (policy,) = [d for d in k8s_docs() if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "link-reader"]
    app = [rule for rule in policy["spec"]["ingress"] if {"protocol": "TCP", "port": 8080} in rule.get("ports", [])]
    assert len(app) == 1 and browser_client_problems(policy, "egresswall.io/link-reader-client", app) == []
    assert any("namespaceSelector" in p for p in app[0]["from"]), "callers in another namespace are never admitted"
    assert "kubectl label namespace my-app egresswall.io/link-reader-client=true" in COMPOSE_README.read_text()


@pytest.mark.parametrize("peer", [{"namespaceSelector": {}},
                                  {"namespaceSelector": {},
                                   "podSelector": {"matchLabels": {"egresswall.io/browser-client": "true"}}},
                                  {"podSelector": {}},
                                  {"ipBlock": {"cidr": "0.0.0.0/0"}}])
def test_browser_client_check_catches(peer):
    (policy,) = [copy.deepcopy(d) for d in k8s_docs()
                 if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "browser-pool"]
    policy["spec"]["ingress"][0]["from"].append(peer)
    assert browser_client_problems(policy)


def _readme_images_overlay() -> str:
    block = re.search(r"```yaml\n(apiVersion: kustomize\.config\.k8s\.io/v1beta1\nkind: Kustomization\n.*?)```",
                      COMPOSE_README.read_text(), re.S)
    assert block, "compose/README.md shows no kustomization with an images: override"
    return block.group(1)


@pytest.mark.parametrize("source", ["readme overlay", "kustomization comment"])
@pytest.mark.parametrize("shape", ["sidecar", "shared"])
def test_the_images_override_points_every_shipped_image_at_your_registry(shape, source, tmp_path):
    """Nothing publishes egresswall/proxy, /browser or /netlock, nor the sidecar's placeholder app image:
    compose/README.md's `images:` override (as an overlay, or uncommented in compose/k8s/kustomization.yaml)
    replaces every one of them in what kustomize renders for either shape."""
    kubectl_or_skip()
    tree = tmp_path / "egresswall" / "compose" / "k8s"
    shutil.copytree(K8S_DIR, tree)
    root = tree / "kustomization.yaml"
    text = re.sub(r"^components:\n(\s+#?\s*- \w+\n)+", f"components:\n  - {shape}\n", root.read_text(), flags=re.M)
    if source == "readme overlay":
        root.write_text(text)
        overlay = tmp_path / "overlay"
        overlay.mkdir()
        (overlay / "kustomization.yaml").write_text(_readme_images_overlay())
        target = overlay
    else:
        commented = re.search(r"^# images:\n(?:#   .*\n)+", text, re.M)
        assert commented, "compose/k8s/kustomization.yaml has no commented images: override"
        root.write_text(text.replace(commented.group(0), re.sub(r"^# ?", "", commented.group(0), flags=re.M)))
        target = tree
    images = {c["image"] for d in yaml.safe_load_all(render(target)) if d and d["kind"] == "Deployment"
              for kind in ("initContainers", "containers") for c in d["spec"]["template"]["spec"].get(kind) or []}
    ours = {i for i in images if not i.startswith("redis:")}
    assert ours and all(i.startswith("registry.example.com/") for i in ours), images
