"""Network namespaces for lab tests, always torn down.

A ``NetnsLab`` names every namespace ``ewt-<pid>-<random>-<name>``, so runs never collide and a
namespace left behind by a killed run is recognisable: the next lab removes ``ewt-<pid>-*`` namespaces
whose pid is gone. ``close()`` (or leaving the ``with`` block) stops the processes the lab started and
deletes its namespaces, also when a test failed. Veth pairs are created directly inside the lab's
namespaces, so nothing is ever added to the machine's own network namespace.

Needs root and iproute2; ``lab_skip_reason()`` says why a lab cannot run here.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence

PREFIX = "ewt"
_STALE = re.compile(rf"^{PREFIX}-(\d+)-[0-9a-f]+-\S+$")


def lab_skip_reason(*tools: str) -> str | None:
    """Why a namespace lab cannot run here (not root, a tool missing), or None when it can."""
    if os.geteuid() != 0:
        return "needs root: the lab creates network namespaces and installs packet filters"
    missing = [tool for tool in ("ip", *tools) if shutil.which(tool) is None]
    if missing:
        return f"needs {', '.join(missing)} (ci/install.sh --lab installs iproute2 and nftables)"
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10, check=True)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def namespace_pids(ns: str) -> list[int]:
    """The processes running in ``ns`` (``ip netns pids``)."""
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10)
    return [int(pid) for pid in out.stdout.split() if pid.isdigit()]


def kill_namespace_processes(ns: str, grace: float = 3.0) -> None:
    """Stop every process still running in one of the lab's own namespaces: SIGTERM, then SIGKILL.

    Only ever called on namespaces a lab created (its own, or a stale ``ewt-<dead pid>-*`` one), so
    every process found there was started by a lab run: a browser's helpers, a capture, a server.
    """
    pids = namespace_pids(ns)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline:
            time.sleep(0.05)
            pids = [pid for pid in pids if _pid_alive(pid) and not _is_zombie(pid)]
        if not pids:
            return


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def remove_stale_namespaces() -> None:
    """Delete lab namespaces whose creating process no longer exists (a run that was killed)."""
    for name in list_namespaces():
        match = _STALE.match(name)
        if match and not _pid_alive(int(match.group(1))):
            kill_namespace_processes(name)
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)


class NetnsLab:
    """A set of network namespaces and the processes running in them."""

    def __init__(self, timeout: float = 10.0) -> None:
        self.prefix = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
        self.timeout = timeout
        self.namespaces: list[str] = []
        self.processes: list[subprocess.Popen] = []
        self._groups: set[int] = set()  # pids of processes started as process-group leaders
        remove_stale_namespaces()

    def __enter__(self) -> NetnsLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- building ----------------------------------------------------------------------------------

    def add_namespace(self, name: str) -> str:
        """Create ``<prefix>-<name>`` with its loopback up; returns the namespace's full name."""
        ns = f"{self.prefix}-{name}"
        self._ip("netns", "add", ns)
        self.namespaces.append(ns)
        self._ip("-n", ns, "link", "set", "lo", "up")
        return ns

    def add_veth(self, ns_a: str, if_a: str, ns_b: str, if_b: str) -> None:
        """A veth pair with one end in each namespace (created there directly), both ends up."""
        self._ip("link", "add", if_a, "netns", ns_a, "type", "veth", "peer", "name", if_b, "netns", ns_b)
        self._ip("-n", ns_a, "link", "set", if_a, "up")
        self._ip("-n", ns_b, "link", "set", if_b, "up")

    def add_address(self, ns: str, ifname: str, cidr: str) -> None:
        """Assign an address; IPv6 addresses skip duplicate address detection so they work at once."""
        extra = ["nodad"] if ":" in cidr else []
        self._ip("-n", ns, "addr", "add", cidr, "dev", ifname, *extra)

    # -- running -----------------------------------------------------------------------------------

    @staticmethod
    def argv(ns: str, argv: Sequence[str], uid: int | None = None, gid: int | None = None) -> list[str]:
        """The command line that runs ``argv`` in ``ns``, as ``uid`` (no supplementary groups) if given."""
        prefix = ["ip", "netns", "exec", ns]
        if uid is not None:
            gid = uid if gid is None else gid
            prefix += ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]
        return [*prefix, *argv]

    def run(
        self,
        ns: str,
        argv: Sequence[str],
        *,
        uid: int | None = None,
        check: bool = True,
        timeout: float | None = None,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(ns, argv, uid),
            capture_output=True,
            text=True,
            input=input,
            timeout=timeout or self.timeout,
            check=check,
            cwd="/",
        )

    def popen(self, ns: str, argv: Sequence[str], *, uid: int | None = None, **kwargs) -> subprocess.Popen:
        """Start a long-running process in ``ns``; ``close()`` stops it.

        With ``start_new_session=True`` the process leads a process group of its own, and ``stop()``
        and ``close()`` signal the whole group (a browser and its helpers, a driver and its children).
        """
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        kwargs.setdefault("cwd", "/")
        proc = subprocess.Popen(self.argv(ns, argv, uid), **kwargs)
        if kwargs.get("start_new_session"):
            self._groups.add(proc.pid)
        self.processes.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen, grace: float = 3.0) -> int | None:
        """Stop one process the lab started (its group too, if it leads one): SIGTERM, then SIGKILL."""
        self._signal(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self._signal(proc, signal.SIGKILL)
            proc.wait(timeout=grace)
        if proc.pid in self._groups:  # helpers that outlive the leader
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        return proc.returncode

    def _signal(self, proc: subprocess.Popen, sig: int) -> None:
        if proc.pid in self._groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
        elif proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)

    # -- teardown ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the lab's processes, then delete its namespaces (and with them the veth pairs).

        Whatever still runs inside a lab namespace after that (a helper that left its process group)
        is stopped too before the namespace is deleted, so no process keeps a namespace alive.
        """
        for proc in self.processes:
            self._signal(proc, signal.SIGTERM)
        for proc in self.processes:
            try:
                proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                self._signal(proc, signal.SIGKILL)
                proc.wait(timeout=3)
            if proc.pid in self._groups:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
        self.processes.clear()
        self._groups.clear()
        for ns in reversed(self.namespaces):
            kill_namespace_processes(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        self.namespaces.clear()

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], capture_output=True, text=True, timeout=self.timeout, check=True)
