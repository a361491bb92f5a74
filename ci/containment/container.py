"""Run one compose service from its image's exported root filesystem, the way a container engine would.

No container engine runs here, so this does the part of one that the containment claims rest on, from
what ``compose/docker-compose.yml`` and the image (``build/images/NAME/image.json``, written by
``ci/images.sh``) say:

* a network namespace of the lab's (the service's networks);
* a mount namespace whose root is the image's root filesystem, made with ``pivot_root`` (a chroot would
  keep Chromium's sandbox from creating its namespaces) and mounted read-only for ``read_only: true``;
  a fresh ``/proc`` for a PID namespace of its own, ``/sys`` read-only, a small ``/dev`` (null, zero, full,
  random, urandom, tty, pts, a ``/dev/shm`` of ``shm_size``), the ``tmpfs:`` mounts (mode 1777, nosuid,
  nodev, noexec, as Docker's), the ``volumes:`` (bind mounts, read-only where compose says so; a named
  volume is a directory of the run's), and ``/etc/hosts``, ``/etc/resolv.conf``, ``/etc/hostname``;
* PID 1 is a small init that reaps children and passes on SIGTERM (``init: true``);
* the process is the image's ENTRYPOINT with compose's ``command:``, in the image's working directory and
  environment, as compose's ``user:`` with no supplementary groups, every capability set empty (the
  bounding set too: ``cap_drop: [ALL]``) and no-new-privs (``no-new-privileges:true``), set by the image's
  own ``setpriv``.

Not emulated: cgroup limits (mem_limit, cpus, pids_limit), Docker's seccomp and AppArmor profiles, its
embedded DNS (service names resolve through ``/etc/hosts`` instead), user namespaces (none by default in
Docker either), restart policies.

``python -m containment.container CONFIG.json`` is the init; ``Container`` starts it and runs commands
inside (``exec``, like ``docker compose exec``).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
MNT_DETACH = 2
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
TMPFS_OPTIONS = "mode=1777,nosuid,nodev,noexec"  # Docker's for a tmpfs: mount


@dataclass
class Mount:
    target: str
    kind: str  # "tmpfs" or "bind"
    source: str = ""
    read_only: bool = False
    options: str = ""


@dataclass
class ContainerSpec:
    """One service, as compose and its image describe it."""

    name: str
    rootfs: str
    argv: list[str]
    uid: int
    gid: int
    env: dict[str, str]
    workdir: str = "/"
    read_only: bool = True
    mounts: list[Mount] = field(default_factory=list)
    shm_size: str = "64m"
    hosts: dict[str, str] = field(default_factory=dict)  # name -> address, for /etc/hosts
    nameservers: list[str] = field(default_factory=list)
    hostname: str = ""
    healthcheck: list[str] = field(default_factory=list)  # compose's test, CMD form: the argv
    networks: list[str] = field(default_factory=list)


def parse_size(text: str) -> str:
    """Compose's ``1gb`` / ``512m`` as a tmpfs ``size=`` value."""
    value = str(text).strip().lower().removesuffix("b")
    return value if value[-1:] in ("k", "m", "g") else value + "k"


def spec_from_compose(name: str, service: dict, image: dict, rootfs: Path) -> ContainerSpec:
    """The emulation's reading of a compose service and its image (``buildah inspect`` JSON)."""
    config = (image.get("Docker") or {}).get("config") or image.get("OCIv1", {}).get("config") or {}
    entrypoint = service.get("entrypoint", config.get("Entrypoint") or [])
    command = service.get("command", config.get("Cmd") or [])
    words = (shlex.split(entrypoint) if isinstance(entrypoint, str) else list(entrypoint)) + \
        (shlex.split(command) if isinstance(command, str) else list(command))
    user = str(service.get("user") or config.get("User") or "0")
    uid, _, gid = user.partition(":")
    env = dict(item.split("=", 1) for item in config.get("Env") or [])
    env.update({k: str(v) for k, v in (service.get("environment") or {}).items()})
    mounts = [Mount(str(t).split(":")[0], "tmpfs", options=TMPFS_OPTIONS) for t in service.get("tmpfs") or []]
    test = ((service.get("healthcheck") or {}).get("test")) or []
    if test[:1] == ["CMD"]:
        test = test[1:]
    elif test[:1] == ["CMD-SHELL"]:
        test = ["/bin/sh", "-c", test[1]]
    return ContainerSpec(
        name=name, rootfs=str(rootfs), argv=[str(w) for w in words], uid=int(uid), gid=int(gid or uid),
        env=env, workdir=config.get("WorkingDir") or "/", read_only=service.get("read_only") is True,
        mounts=mounts, shm_size=parse_size(service.get("shm_size", "64m")), hostname=name,
        healthcheck=[str(w) for w in test], networks=list(service.get("networks") or []))


# ---- the host side -------------------------------------------------------------------------------------

class Container:
    """A started service: its init runs in ``ns`` (a lab namespace) and the service's process under it."""

    def __init__(self, netns, ns: str, spec: ContainerSpec, workdir: Path, env: dict[str, str]) -> None:
        self.netns, self.ns, self.spec = netns, ns, spec
        workdir.mkdir(parents=True, exist_ok=True)
        self.dir = workdir
        self.config = workdir / f"{spec.name}.container.json"
        self.config.write_text(json.dumps(asdict(spec)))
        self.log = workdir / f"{spec.name}.log"
        python = sys.executable
        argv = ["unshare", "--mount", "--pid", "--fork", "--propagation", "private", "--",
                python, "-m", "containment.container", str(self.config)]
        with open(self.log, "wb") as out:
            self.proc = netns.popen(ns, argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def init_pid(self) -> int | None:
        """The host PID of the container's init (the child of ``unshare``)."""
        try:
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        except OSError:
            return None
        return int(children[0]) if children else None

    def main_pid(self) -> int | None:
        """The host PID of the service's own process (the init's child)."""
        init = self.init_pid()
        if init is None:
            return None
        try:
            children = Path(f"/proc/{init}/task/{init}/children").read_text().split()
        except OSError:
            return None
        return int(children[0]) if children else None

    def stop(self, timeout: float = 20) -> None:
        """``docker compose stop``: SIGTERM to the service's process (the init passes it on too), then wait
        for the init to end; whatever is left is killed with the lab's namespaces."""
        init, main = self.init_pid(), self.main_pid()
        for pid in (main, init):
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
                break
        deadline = time.monotonic() + timeout
        while init is not None and Path(f"/proc/{init}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        self.netns.stop(self.proc)

    def exec_argv(self, argv: list[str], uid: int | None = None) -> list[str]:
        """``docker compose exec``: ``argv`` inside the container, as its user (or ``uid``), no capabilities."""
        init = self.init_pid()
        if init is None:
            raise RuntimeError(f"{self.spec.name}: the container is not running:\n{self.log_text()[-2000:]}")
        uid = self.spec.uid if uid is None else uid
        gid = self.spec.gid if uid == self.spec.uid else uid
        return ["nsenter", f"--target={init}", "--mount", "--pid", "--net", "--root", "--wd=/", "--",
                *drop_privileges(uid, gid), *argv]

    def exec(self, argv: list[str], timeout: float = 60, uid: int | None = None,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.exec_argv(argv, uid), capture_output=True, text=True, timeout=timeout,
                              env={**self.spec.env, **(env or {})}, cwd="/")

    def healthcheck(self, timeout: float = 10) -> subprocess.CompletedProcess[str]:
        """Compose's health check command, run in the container as its user."""
        return self.exec(self.spec.healthcheck, timeout=timeout)


def drop_privileges(uid: int, gid: int) -> list[str]:
    """setpriv: this uid and gid, no supplementary groups, every capability set empty, no-new-privs."""
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--inh-caps=-all",
            "--ambient-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]


# ---- the init (inside the new mount and PID namespaces) -------------------------------------------------

def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


def _ensure(path: Path, directory: bool) -> None:
    """A mount point (made in the root filesystem before it is made read-only)."""
    if directory:
        path.mkdir(parents=True, exist_ok=True)
    elif not path.exists() and not path.is_symlink():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()


def build_root(spec: ContainerSpec, scratch: Path) -> Path:
    root = Path(spec.rootfs)
    _sh("mount", "--make-rprivate", "/")
    _sh("mount", "--bind", str(root), str(root))
    for name in ("proc", "sys", "dev", "tmp"):
        _ensure(root / name, True)
    for mount in spec.mounts:
        _ensure(root / mount.target.lstrip("/"), mount.kind == "tmpfs" or Path(mount.source).is_dir())
    for name in ("hosts", "resolv.conf", "hostname"):
        target = root / "etc" / name
        if target.is_symlink():
            target.unlink()
        _ensure(target, False)

    _sh("mount", "-t", "proc", "-o", "nosuid,nodev,noexec", "proc", str(root / "proc"))
    _sh("mount", "--rbind", "/sys", str(root / "sys"))
    _sh("mount", "-o", "remount,bind,ro,nosuid,nodev,noexec", str(root / "sys"))
    dev = root / "dev"
    _sh("mount", "-t", "tmpfs", "-o", "mode=0755,nosuid,size=1m", "egresswall-dev", str(dev))
    for name in DEVICES:
        (dev / name).touch()
        _sh("mount", "--bind", f"/dev/{name}", str(dev / name))
    (dev / "pts").mkdir()
    _sh("mount", "-t", "devpts", "-o", "newinstance,ptmxmode=0666,nosuid,noexec", "devpts", str(dev / "pts"))
    (dev / "shm").mkdir()
    _sh("mount", "-t", "tmpfs", "-o", f"mode=1777,nosuid,nodev,noexec,size={spec.shm_size}", "shm", str(dev / "shm"))
    for link, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2"), ("ptmx", "pts/ptmx")):
        (dev / link).symlink_to(target)

    scratch.mkdir(parents=True, exist_ok=True)
    (scratch / "hosts").write_text("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n" +
                                   "".join(f"{address}\t{name}\n" for name, address in spec.hosts.items()))
    (scratch / "resolv.conf").write_text("".join(f"nameserver {ns}\n" for ns in spec.nameservers) or "\n")
    (scratch / "hostname").write_text(spec.hostname + "\n")
    for name in ("hosts", "resolv.conf", "hostname"):
        _sh("mount", "--bind", "-o", "ro", str(scratch / name), str(root / "etc" / name))
    for mount in spec.mounts:
        target = str(root / mount.target.lstrip("/"))
        if mount.kind == "tmpfs":
            _sh("mount", "-t", "tmpfs", "-o", mount.options or TMPFS_OPTIONS, "tmpfs", target)
        else:
            _sh("mount", "--bind", mount.source, target)
            if mount.read_only:
                _sh("mount", "-o", "remount,bind,ro", target)
    if spec.read_only:
        _sh("mount", "-o", "remount,bind,ro", str(root))
    return root


def pivot_into(root: Path) -> None:
    """``pivot_root(root, root)`` and detach the old root: what runc does. Not chroot: the kernel refuses a
    process in a chroot new user namespaces, which Chromium's sandbox is made of."""
    libc = ctypes.CDLL(None, use_errno=True)
    number = SYS_PIVOT_ROOT.get(platform.machine())
    if number is None:
        raise OSError(f"pivot_root: unknown system call number on {platform.machine()}")
    os.chdir(root)
    if libc.syscall(number, b".", b".") != 0:
        raise OSError(ctypes.get_errno(), "pivot_root")
    if libc.umount2(b".", MNT_DETACH) != 0:
        raise OSError(ctypes.get_errno(), "umount2 of the old root")
    os.chdir("/")


def init(config_path: str) -> int:
    spec_data = json.loads(Path(config_path).read_text())
    spec_data["mounts"] = [Mount(**m) for m in spec_data["mounts"]]
    spec = ContainerSpec(**spec_data)
    root = build_root(spec, Path(config_path).with_suffix(".etc"))
    argv = [*drop_privileges(spec.uid, spec.gid), *spec.argv]
    pivot_into(root)
    child = os.fork()
    if child == 0:
        os.chdir(spec.workdir)
        os.execvpe(argv[0], argv, {**spec.env, "HOSTNAME": spec.hostname})
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, lambda signum, frame: os.kill(child, signum))
    while True:
        pid, status = os.wait()
        if pid == child:
            return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(init(sys.argv[1]))
