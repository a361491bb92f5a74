"""The audit log: one JSON line per decision and one per closed response or tunnel.

Each line is written with a single ``os.write`` on a file opened with O_APPEND, so a crash (even
``kill -9``) never leaves half a line and concurrent writers never interleave inside one. The
file is reopened on request (SIGUSR1) so logrotate can move it away.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

Formatter = Callable[[dict[str, Any]], str]


def json_line(record: dict[str, Any]) -> str:
    return json.dumps(record, separators=(",", ":"), ensure_ascii=True, default=str)


class AuditLog:
    """Writes records to a file (or standard output when path is None or '-')."""

    def __init__(self, path: str | None = None, formatter: Formatter = json_line,
                 select: Callable[[dict[str, Any]], bool] | None = None) -> None:
        self.path = None if path in (None, "-") else path
        self.formatter = formatter
        self.select = select  # which records to write (None: all); squid's format has no decision lines
        self.failures = 0  # lines that could not be written; readiness fails while the last write failed
        self.healthy = True
        self.written = 0
        self.listeners: list[Callable[[dict[str, Any]], None]] = []  # in-process readers (the page reader)
        self._fd: int | None = None
        self._lock = threading.Lock()
        self.reopen()

    def reopen(self) -> None:
        with self._lock:
            old = self._fd
            if self.path is None:
                self._fd = sys.stdout.fileno()
            else:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
            if old is not None and old != self._fd and old != sys.stdout.fileno():
                os.close(old)

    def write(self, record: dict[str, Any]) -> bool:
        for listener in self.listeners:
            listener(record)
        if self.select is not None and not self.select(record):
            return True
        line = (self.formatter(record).replace("\n", " ") + "\n").encode("utf-8", "backslashreplace")
        try:
            with self._lock:
                assert self._fd is not None
                written = os.write(self._fd, line)
            if written != len(line):
                raise OSError(f"short write ({written} of {len(line)} bytes)")
        except OSError as err:
            self.failures += 1
            if self.healthy:
                print(f"egresswall: audit log write failed: {err}", file=sys.stderr)
            self.healthy = False
            return False
        self.healthy = True
        self.written += 1
        return True

    def close(self) -> None:
        with self._lock:
            if self._fd is not None and self.path is not None:
                os.close(self._fd)
            self._fd = None


def now() -> float:
    return time.time()
