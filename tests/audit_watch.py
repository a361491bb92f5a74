"""Read a running proxy's audit log from a point on, and its process's resource use (for the
hardening tests)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path


class AuditWatch:
    """``mark()`` remembers where the log ends; ``since()`` returns the records written after it."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.offset = 0

    def mark(self) -> AuditWatch:
        self.offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        return self

    def since(self) -> list[dict]:
        if not self.log_path.exists():
            return []
        with open(self.log_path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        # Whole lines only: a reader may see a line while the proxy's one write of it is still being copied in
        # (the tail after the last newline; CI read one half-written and failed on its JSON).
        whole = data[:data.rfind(b"\n") + 1]
        return [json.loads(line) for line in whole.splitlines() if line.strip()]

    def wait_for(self, predicate: Callable[[list[dict]], bool], timeout: float = 10) -> list[dict]:
        """The records since the mark, once ``predicate`` holds for them (or when ``timeout`` passes)."""
        deadline = time.monotonic() + timeout
        while True:
            records = self.since()
            if predicate(records) or time.monotonic() > deadline:
                return records
            time.sleep(0.05)


def decisions(records: list[dict]) -> list[dict]:
    return [r for r in records if r["event"] == "decision"]


def refusals(records: list[dict]) -> list[dict]:
    return [r for r in records if r["verdict"] == "refuse"]


def rules(records: list[dict]) -> list[str]:
    return [r["rule"] for r in decisions(records)]


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def _tree(pid: int) -> list[str]:
    """A proxy's process and its worker processes."""
    return [str(pid), *Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def tree_kib(pid: int, field: str = "VmRSS") -> int:
    """A /proc status figure (VmRSS, or the peak VmHWM) summed over the proxy and its worker processes."""
    return sum(int(line.split()[1]) for process in _tree(pid)
               for line in Path(f"/proc/{process}/status").read_text().splitlines() if line.startswith(f"{field}:"))


def tree_cpu_seconds(pid: int) -> float:
    """User and system CPU of the proxy and its worker processes."""
    ticks = 0
    for process in _tree(pid):
        fields = Path(f"/proc/{process}/stat").read_text().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")
