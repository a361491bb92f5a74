"""The audit log: one JSON line per decision and one per closed response or tunnel.

Each line is written with a single ``os.write`` on a file opened with O_APPEND, so a crash (even
``kill -9``) never leaves half a line and concurrent writers never interleave inside one. The
file is reopened on request (SIGUSR1) so logrotate can move it away.

Standard output, the default, is usually a pipe (journald, a log shipper, ``| tee``). A reader that stops
reading fills it, and a blocking write there would stop the whole event loop — every client, every open
tunnel and the admin listener — with no answer at all (review round 23). So a pipe, socket or terminal is
written without waiting (``RWF_NOWAIT``; where the kernel has no such write for it, only when ``poll`` says it
takes bytes): a line it cannot take now is a failed write, which fails closed the documented way (503
``audit``, ``/readyz`` 503, the probe line once it takes lines again). A pipe is grown to 1 MiB where the
system allows, so a burst is not taken for a stall.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import select
import stat
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

Formatter = Callable[[dict[str, Any]], str]
PIPE_SIZE = 1 << 20  # bytes a pipe to the log holds (Linux's default pipe-max-size)


_second: tuple[int, str] = (0, "1970-01-01T00:00:00.")  # the last second formatted, and its text


def rfc3339(epoch: float) -> str:
    """UTC with milliseconds and a Z, e.g. 2026-12-01T07:12:03.042Z: the time of every record (two a request,
    so the second's text is kept: strftime was a few per cent of a worker's CPU under load). The same text
    as ``datetime.fromtimestamp(epoch, UTC)`` formatted, microseconds rounded as it rounds them."""
    global _second
    whole = int(epoch // 1)
    micro = round((epoch - whole) * 1e6)
    if micro >= 1_000_000:
        whole, micro = whole + 1, micro - 1_000_000
    cached = _second  # read once: another thread may format another second meanwhile
    if whole != cached[0]:
        cached = _second = (whole, datetime.fromtimestamp(whole, UTC).strftime("%Y-%m-%dT%H:%M:%S."))
    return f"{cached[1]}{micro // 1000:03d}Z"


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
        self._waits = True  # a regular file: its writes wait for the disk only
        self._nowait_write = True  # RWF_NOWAIT works on this descriptor (else poll before writing)
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
            mode = os.fstat(self._fd).st_mode
            self._waits = stat.S_ISREG(mode)
            self._nowait_write = True
            if stat.S_ISFIFO(mode):  # (over /proc/sys/fs/pipe-max-size for a user: the pipe stays as it is)
                with contextlib.suppress(OSError):
                    fcntl.fcntl(self._fd, fcntl.F_SETPIPE_SZ, PIPE_SIZE)

    def write(self, record: dict[str, Any]) -> bool:
        for listener in self.listeners:
            listener(record)
        if self.select is not None and not self.select(record):
            return True
        line = (self.formatter(record).replace("\n", " ") + "\n").encode("utf-8", "backslashreplace")
        try:
            with self._lock:
                assert self._fd is not None
                written = os.write(self._fd, line) if self._waits else self._write_without_waiting(line)
                if written != len(line):
                    self._undo_partial(written)
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

    def _write_without_waiting(self, line: bytes) -> int:
        """``line`` to a pipe, socket or terminal, or OSError when it takes nothing now (its reader is not reading).
        A line it took part of is finished: its reader is reading, and the next line must not start inside it."""
        fd = self._fd
        assert fd is not None
        if self._nowait_write:
            try:
                written = os.pwritev(fd, [line], -1, os.RWF_NOWAIT)
            except BlockingIOError:
                raise OSError(errno.EAGAIN, "the audit log's reader is not reading (its pipe is full)") from None
            except OSError as err:
                if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ESPIPE):
                    raise
                self._nowait_write = False  # not for this kind of descriptor: poll first from now on
                return self._write_without_waiting(line)
        else:
            poller = select.poll()
            poller.register(fd, select.POLLOUT)
            if not poller.poll(0):
                raise OSError(errno.EAGAIN, "the audit log's reader is not reading (it takes no bytes)")
            written = os.write(fd, line)
        while 0 < written < len(line):  # (a line over PIPE_BUF, taken in part: its reader is reading)
            written += os.write(fd, line[written:])
        return written

    def _undo_partial(self, written: int) -> None:
        """A full disk can take part of a line (tmpfs fills page by page). Cut it off again, so the
        next line does not start in the middle of this one: only when nobody appended after it (the
        file ends where our write ended), never on a pipe or terminal."""
        if self.path is None or written <= 0:
            return
        try:
            end = os.lseek(self._fd, 0, os.SEEK_CUR)  # O_APPEND: just past what we wrote
            if os.fstat(self._fd).st_size == end:
                os.ftruncate(self._fd, end - written)
        except OSError:
            pass

    def probe(self) -> bool:
        """While writes fail, try one line that says so; True once the log takes lines again. The
        line records how many lines were lost, in the log itself."""
        if self.healthy:
            return True
        record = {"time": rfc3339(time.time()), "event": "audit", "failures": self.failures,
                  "reason": "the audit log is writable again; 'failures' lines could not be written"}
        if self.select is None or self.select(record):
            return self.write(record)
        # A format with no line for this (squid's): judge the file by its free space instead of writing.
        try:
            if stat.S_ISREG(os.fstat(self._fd).st_mode):
                space = os.fstatvfs(self._fd)
                self.healthy = space.f_bavail * space.f_frsize >= 64 * 1024
        except OSError:
            pass
        return self.healthy

    def close(self) -> None:
        with self._lock:
            if self._fd is not None and self.path is not None:
                os.close(self._fd)
            self._fd = None

