"""A memory cgroup of its own for the browser: the kernel kills inside it, and nothing else.

The driver and Chromium start inside a new group (``egresswall-browser-<server pid>-<n>``) under the
server's own cgroup (or a parent the operator names), with a memory limit: when the browser tree
reaches it, the kernel's OOM killer picks a process *in that group*. Chromium gives its renderers the
highest ``oom_score_adj`` (300, against 0 for the browser process), so the usual victim is the page that
grew: its renderer dies, the client sees the page crash, other pages live on. If the browser process
itself is chosen, the browser exits, its clients see their contexts closed, and the server starts a
new one. The group is not set to ``memory.oom.group`` (which would kill every client's pages for one
page's allocation) and gets no swap.

cgroup v2 needs the memory controller enabled for the parent's children (``cgroup.subtree_control``),
which a group with processes of its own cannot have: a server alone in its group moves itself into a
leaf child first (``_delegate_memory``). v1 needs the memory hierarchy mounted and writable. Where
neither holds, the server says so once at start and the container's (or host's) limit is the ceiling.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

PREFIX = "egresswall-browser-"
SERVER_LEAF = "egresswall-server"  # cgroup v2: where the server moves itself to delegate memory (see below)
MIN_CEILING = 128 * 2**20  # Chromium and the driver alone take about 300 MB: less cannot work
_SIZE = re.compile(r"(?i)(\d{1,16})\s*(|b|k|kb|kib|m|mb|mib|g|gb|gib|t|tb|tib)")
_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


class CgroupError(Exception):
    """Why a memory group could not be made or used (said once, in a sentence)."""


def parse_memory_size(text: str) -> int | None:
    """``2G``, ``512MiB``, ``1073741824`` → bytes (powers of 1024); ``0``/``off``/``none`` → None (no
    ceiling). Anything else is a ValueError: a typo must not silently remove the ceiling."""
    value = text.strip()
    if value.lower() in ("0", "off", "none"):
        return None
    match = _SIZE.fullmatch(value)
    if not match:
        raise ValueError(f"not a memory size: {text!r} (examples: 2G, 768M, 1073741824, off)")
    size = int(match.group(1)) * _UNITS[match.group(2)[:1].lower()]
    if size < MIN_CEILING:
        raise ValueError(f"a browser memory ceiling of {size} bytes is below {MIN_CEILING // 2**20} MiB: "
                         "Chromium cannot start in it")
    return size


# ---- where the server's groups are --------------------------------------------------------------

@dataclass(frozen=True)
class Mount:
    root: str  # the part of the hierarchy mounted here
    point: str
    fstype: str
    super_options: frozenset[str]


def parse_mountinfo(text: str) -> list[Mount]:
    mounts = []
    for line in text.splitlines():
        fields = line.split(" ")
        if "-" not in fields:
            continue
        dash = fields.index("-")
        if dash < 6 or len(fields) < dash + 4:
            continue
        root, point = _unescape(fields[3]), _unescape(fields[4])
        mounts.append(Mount(root, point, fields[dash + 1], frozenset(fields[dash + 3].split(","))))
    return mounts


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """``/proc/self/cgroup`` → controller (``memory``; ``""`` for the v2 hierarchy) → path."""
    paths: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for controller in parts[1].split(","):
            paths.setdefault(controller, parts[2])
    return paths


def locate(proc_cgroup: str, mountinfo: str) -> tuple[int, Path] | str:
    """(cgroup version, the server's own memory group directory), or why there is none."""
    paths, mounts = parse_proc_cgroup(proc_cgroup), parse_mountinfo(mountinfo)
    reasons = []
    if "" in paths:
        for mount in mounts:
            if mount.fstype == "cgroup2":
                own = _inside(mount, paths[""])
                if own is None:
                    continue
                controllers = _read(own / "cgroup.controllers").split()
                if "memory" in controllers:
                    return 2, own
                reasons.append(f"cgroup v2 at {mount.point} has no memory controller for this process")
    if "memory" in paths:
        for mount in mounts:
            if mount.fstype == "cgroup" and "memory" in mount.super_options:
                own = _inside(mount, paths["memory"])
                if own is not None:
                    return 1, own
        reasons.append("cgroup v1's memory hierarchy is not mounted where this process can see its group")
    return "; ".join(reasons) or "no cgroup hierarchy with a memory controller"


def _inside(mount: Mount, path: str) -> Path | None:
    root = mount.root.rstrip("/")
    if path != root and not path.startswith(root + "/"):
        return None
    own = Path(mount.point + path[len(root):])
    return own if own.is_dir() else None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def version_of(parent: Path) -> int:
    if (parent / "cgroup.controllers").exists():
        return 2
    if (parent / "memory.limit_in_bytes").exists():
        return 1
    raise CgroupError(f"{parent} is not a memory cgroup (neither cgroup.controllers nor memory.limit_in_bytes)")


# ---- the browser's group ------------------------------------------------------------------------

@dataclass
class MemoryCeiling:
    """Where the browsers' groups go, checked once at start; ``group()`` makes one per browser."""

    parent: Path
    version: int
    limit: int
    _made: int = 0

    @classmethod
    def prepare(cls, limit: int, parent: Path | None = None) -> MemoryCeiling:
        """Check that a group can be made here (one is made and removed again), or CgroupError."""
        explicit = parent
        if parent is None:
            found = locate(_read(Path("/proc/self/cgroup")), _read(Path("/proc/self/mountinfo")))
            if isinstance(found, str):
                raise CgroupError(found)
            version, parent = found
        else:
            version = version_of(parent)
        ceiling = cls(parent, version, limit)
        if version == 2:
            ceiling._delegate_memory(own_group=explicit is None)
        ceiling.remove_stale()
        ceiling.group().remove()
        return ceiling

    def _delegate_memory(self, own_group: bool) -> None:
        """cgroup v2 lets a group's children have a memory limit only when the group enables the
        controller for them, and a group with processes of its own cannot. When the server is alone in
        its own group (a systemd unit with ``Delegate=``, a container of its own), it moves itself into a
        leaf child, ``egresswall-server``, as systemd advises for delegated groups, and enables it."""
        control = self.parent / "cgroup.subtree_control"
        if "memory" in _read(control).split():
            return
        try:
            control.write_text("+memory")
            return
        except OSError as err:
            first = err
        alone = own_group and first.errno == errno.EBUSY and _read(self.parent / "cgroup.procs").split() == [
            str(os.getpid())]
        if alone:
            leaf = self.parent / SERVER_LEAF
            try:
                leaf.mkdir(exist_ok=True)
                (leaf / "cgroup.procs").write_text(str(os.getpid()))
                control.write_text("+memory")
                return
            except OSError as err:
                first = err
        why = ("the group has processes besides this server (cgroup v2 enables controllers only for groups "
               "without processes of their own): give the server a delegated group of its own, or name one with "
               "--browser-cgroup-parent" if first.errno == errno.EBUSY else first.strerror)
        raise CgroupError(f"cannot enable the memory controller for children of {self.parent}: {why}")

    def group(self) -> BrowserCgroup:
        self._made += 1
        path = self.parent / f"{PREFIX}{os.getpid()}-{self._made}"
        try:
            path.mkdir()
        except OSError as err:
            raise CgroupError(f"cannot create {path}: {err.strerror}") from None
        group = BrowserCgroup(path, self.version)
        try:
            group.set_limit(self.limit)
        except OSError as err:
            group.remove()
            raise CgroupError(f"cannot set the memory limit of {path}: {err.strerror}") from None
        return group

    def remove_stale(self) -> None:
        """Empty groups an earlier server left behind (it was killed before it could remove them)."""
        for path in self.parent.glob(PREFIX + "*"):
            match = re.fullmatch(re.escape(PREFIX) + r"(\d+)-\d+", path.name)
            if match and int(match.group(1)) != os.getpid() and not _alive(int(match.group(1))):
                with contextlib.suppress(OSError):  # not empty, or not ours to remove: left alone
                    path.rmdir()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class BrowserCgroup:
    path: Path
    version: int

    def set_limit(self, limit: int) -> None:
        if self.version == 2:
            (self.path / "memory.max").write_text(str(limit))
            _write_if_present(self.path / "memory.swap.max", "0")
            _write_if_present(self.path / "memory.oom.group", "0")
        else:
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
            _write_if_present(self.path / "memory.memsw.limit_in_bytes", str(limit))  # no swap past it
            _write_if_present(self.path / "memory.swappiness", "0")

    def enter_command(self, argv: list[str]) -> list[str]:
        """``argv`` started from inside the group: a shell writes its own pid to ``cgroup.procs`` and
        execs the command, so the driver and everything it starts are in the group from their first
        instruction (no window in which Chromium runs outside it)."""
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs"), *argv]

    def oom_kills(self) -> int:
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        for line in _read(self.path / name).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
        return 0

    def usage(self) -> int:
        text = _read(self.path / ("memory.current" if self.version == 2 else "memory.usage_in_bytes")).strip()
        return int(text) if text.isdigit() else 0

    def pids(self) -> list[int]:
        return [int(p) for p in _read(self.path / "cgroup.procs").split() if p.isdigit()]

    def kill_all(self, timeout: float = 10.0) -> None:
        """SIGKILL what is left of the browser in the group (renderers orphaned by a killed browser),
        until the group is empty."""
        deadline = time.monotonic() + timeout
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)

    def remove(self) -> None:
        for _ in range(100):  # a group is removable once its last process is reaped
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as err:
                if err.errno != errno.EBUSY:
                    return
                time.sleep(0.05)


def _write_if_present(path: Path, value: str) -> None:
    if path.exists():
        with contextlib.suppress(OSError):  # an optional refinement (swap accounting may be off)
            path.write_text(value)
