"""Running Chromium the way the tests' user allows, and running a command as an unprivileged user.

As root the launcher refuses a sandboxed Chromium (its sandbox cannot run as root) unless
``--no-sandbox`` is stated. Tests that run Chromium as whoever runs the suite therefore state it when
that is root (CI) — ``SANDBOX`` and ``NO_SANDBOX_ARGS`` — and the sandboxed path itself is tested as an
unprivileged user (``test_browser_sandbox.py``), which ``unprivileged_argv`` provides.

``unprivileged_argv`` needs root. It runs the command in a mount namespace of its own, as a uid with no
supplementary groups, no capabilities (setpriv: every set empty, bounding set too) and no-new-privs —
what compose's ``user:``, ``cap_drop: [ALL]`` and ``no-new-privileges`` give a container. The machine's
Python may live where other users cannot look (pyenv under /root, mode 700): a directory the user must
reach is then shown to it in that mount namespace only, by a tmpfs over the blocking directory that holds
bind mounts of just the paths needed. Nothing on the machine changes.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Sequence
from pathlib import Path

AS_ROOT = os.geteuid() == 0
SANDBOX: bool | None = False if AS_ROOT else None  # plan_launch(sandbox=...)
NO_SANDBOX_ARGS: list[str] = ["--no-sandbox"] if AS_ROOT else []  # egresswall browse / browser-server

TEST_UID = 10002  # the browser image's uid; it needs no passwd entry


def _blocking_ancestor(path: Path) -> Path | None:
    """The first directory on the way to ``path`` that other users cannot search, or None."""
    for parent in [*reversed(path.parents), path][1:]:
        try:
            mode = parent.stat().st_mode
        except OSError:
            return None
        if stat.S_ISDIR(mode) and not mode & stat.S_IXOTH:
            return parent
    return None


def views_needed(paths: Sequence[str | os.PathLike[str]]) -> dict[Path, list[Path]]:
    """Blocking directory -> the paths under it that the user must reach."""
    views: dict[Path, list[Path]] = {}
    for raw in paths:
        path = Path(raw).resolve()
        blocker = _blocking_ancestor(path)
        if blocker is not None:
            child = blocker / path.relative_to(blocker).parts[0] if path != blocker else blocker
            views.setdefault(blocker, [])
            if child not in views[blocker]:
                views[blocker].append(child)
    return views


def _mount_script(views: dict[Path, list[Path]], stash: str) -> str:
    lines = ["set -e", "mount --make-rprivate /", f"mount -t tmpfs -o mode=0700,size=1m egresswall-stash {stash}"]
    for n, (blocker, children) in enumerate(views.items()):
        for m, child in enumerate(children):
            lines += [f"mkdir -p {stash}/{n}-{m}", f"mount --bind '{child}' {stash}/{n}-{m}"]
        lines.append(f"mount -t tmpfs -o mode=0755,size=1m egresswall-view '{blocker}'")
        for m, child in enumerate(children):
            kind = "-d" if Path(f"{child}").is_dir() else "-f"
            make = f"mkdir -p '{child}'" if kind == "-d" else f"touch '{child}'"
            lines += [make, f"mount --move {stash}/{n}-{m} '{child}'"]
    return "\n".join(lines)


def unprivileged_argv(argv: Sequence[str], *, uid: int = TEST_UID, gid: int | None = None,
                      reach: Sequence[str | os.PathLike[str]] = ()) -> list[str]:
    """The command line that runs ``argv`` as ``uid`` with no capabilities; ``reach``: paths (besides
    this Python and the repository) the user must be able to read."""
    gid = uid if gid is None else gid
    root = Path(__file__).resolve().parents[1]
    needed = [sys.executable, os.path.realpath(sys.executable), sys.base_prefix, sys.prefix, root, *reach]
    drop = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--inh-caps=-all",
            "--ambient-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
    views = views_needed(needed)
    if not views:
        return [*drop, *argv]
    stash = "/mnt"  # covered by a tmpfs inside the new namespace only
    script = _mount_script(views, stash) + '\nexec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh", *drop, *argv]


# ---- what /proc says about a Chromium's sandbox ------------------------------------------------------

def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def _argv(pid: int) -> list[str]:
    """A process's arguments. Chromium's child processes rewrite theirs into one space-joined string."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        parts = [p.decode(errors="replace") for p in f.read().split(b"\0") if p]
    return parts[0].split(" ") + parts[1:] if len(parts) == 1 else parts


def chromium_processes(uid: int, executable: str = "/usr/lib/chromium/chromium") -> dict[int, str]:
    """pid -> process type ("browser", "renderer", "zygote", "utility", "gpu-process", ...) of the
    Chromium processes running as ``uid``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            if int(_status(pid)["Uid"].split()[0]) != uid:
                continue
            argv = _argv(pid)
        except (OSError, KeyError, ValueError):
            continue
        if not argv or Path(argv[0]).name != Path(executable).name:
            continue
        kind = next((a.split("=", 1)[1] for a in argv if a.startswith("--type=")), "browser")
        found[pid] = kind
    return found


def namespace(pid: int, kind: str) -> str:
    return os.readlink(f"/proc/{pid}/ns/{kind}")


def sandbox_problems(processes: dict[int, str]) -> list[str]:
    """What is not sandboxed, from /proc: every renderer must run under a seccomp-bpf filter
    (``Seccomp: 2``) with no-new-privs, in user, PID and network namespaces other than the browser
    process's (Chromium's namespace sandbox). Empty when they all are."""
    browsers = [pid for pid, kind in processes.items() if kind == "browser"]
    renderers = [pid for pid, kind in processes.items() if kind == "renderer"]
    if len(browsers) != 1:
        return [f"expected one browser process, found {len(browsers)}: {processes}"]
    if not renderers:
        return [f"no renderer process: {processes}"]
    problems = []
    browser = browsers[0]
    for pid in renderers:
        try:
            status = _status(pid)
            for field, want in (("Seccomp", "2"), ("NoNewPrivs", "1")):
                if status.get(field) != want:
                    problems.append(f"renderer {pid}: {field} is {status.get(field)!r}, not {want}")
            for kind in ("user", "pid", "net"):
                if namespace(pid, kind) == namespace(browser, kind):
                    problems.append(f"renderer {pid} shares the browser's {kind} namespace")
        except OSError as err:
            problems.append(f"renderer {pid}: {err}")
    return problems
