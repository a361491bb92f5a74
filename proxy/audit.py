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

import array
import contextlib
import errno
import fcntl
import json
import os
import select
import stat
import sys
import termios
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

Formatter = Callable[[dict[str, Any]], str]
PIPE_SIZE = 1 << 20  # bytes a pipe to the log holds (Linux's default pipe-max-size)
PARTIAL_WAIT = 0.2  # seconds a line taken in part may take to be finished before the write fails


def _pipe_room(fd: int) -> int:
    """The bytes a pipe can take now: its size less what its reader has not read yet."""
    try:
        unread = array.array("i", [0])
        fcntl.ioctl(fd, termios.FIONREAD, unread)
        return fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ) - unread[0]
    except OSError:
        return 1 << 30  # not known: written without the check (a write that would wait still fails)


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
        self._pipe = False  # a pipe or FIFO: a line is written only when the pipe has room for all of it
        self._cut = False  # the last line was cut short (a reader that stopped mid-line): the next one ends it
        self._lock = threading.Lock()
        self.reopen()

    def reopen(self) -> None:
        """Open the log again (SIGUSR1, after logrotate moved it). A FIFO is opened without waiting for a reader:
        with none, the log is unwritable (503 ``audit``) until the probe finds one (review round 23b: the open
        waited on the event loop, and every client with it)."""
        with self._lock:
            old = self._fd
            self._fd = None
            try:
                self._fd = self._open()
            except OSError as err:
                self._failed(err)
            if old is not None and old != self._fd and old != sys.stdout.fileno():
                os.close(old)
            if self._fd is None:
                return
            mode = os.fstat(self._fd).st_mode
            self._waits = stat.S_ISREG(mode)
            self._pipe = stat.S_ISFIFO(mode)
            self._nowait_write = True
            if self._pipe:  # (over /proc/sys/fs/pipe-max-size for a user: the pipe stays as it is)
                with contextlib.suppress(OSError):
                    fcntl.fcntl(self._fd, fcntl.F_SETPIPE_SZ, PIPE_SIZE)

    def _open(self) -> int:
        if self.path is None:
            return sys.stdout.fileno()
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
        with contextlib.suppress(OSError):
            if stat.S_ISFIFO(os.stat(self.path).st_mode):
                flags |= os.O_NONBLOCK  # ENXIO while nobody reads, never a wait; our own description, so kept
        return os.open(self.path, flags, 0o640)

    def write(self, record: dict[str, Any]) -> bool:
        for listener in self.listeners:
            listener(record)
        if self.select is not None and not self.select(record):
            return True
        line = (self.formatter(record).replace("\n", " ") + "\n").encode("utf-8", "backslashreplace")
        try:
            with self._lock:
                if self._fd is None:
                    raise OSError(errno.ENXIO, "the audit log is not open (a FIFO nobody reads)")
                if self._waits:
                    written = os.write(self._fd, line)
                else:
                    if self._cut:  # a line cut short before: end it, so that this one starts a line of its own
                        line = b"\n" + line
                    written = self._write_without_waiting(line)
                    self._cut = False
                if written != len(line):
                    self._undo_partial(written)
                    raise OSError(f"short write ({written} of {len(line)} bytes)")
        except OSError as err:
            self._failed(err)
            return False
        self.healthy = True
        self.written += 1
        return True

    def _failed(self, err: OSError) -> None:
        self.failures += 1
        if self.healthy:
            print(f"egresswall: audit log write failed: {err}", file=sys.stderr)
        self.healthy = False

    def _write_without_waiting(self, line: bytes) -> int:
        """``line`` to a pipe, socket or terminal, or OSError when it cannot take it now (its reader is not reading).
        A pipe with no room for the whole line is not written at all. A line taken in part (a socket, a pipe that
        another writer filled meanwhile) is finished within PARTIAL_WAIT seconds, never longer: past that it stays
        cut (the next line starts by ending it) and the write fails — it never waits for a stalled reader."""
        fd = self._fd
        assert fd is not None
        if self._pipe and len(line) > _pipe_room(fd):
            raise OSError(errno.EAGAIN, "the audit log's reader is not reading (its pipe has no room for the line)")
        written = self._write_some(fd, line, 0)
        if written == 0:
            raise OSError(errno.EAGAIN, "the audit log's reader is not reading (it takes no bytes)")
        deadline = time.monotonic() + PARTIAL_WAIT
        while written < len(line):
            left = deadline - time.monotonic()
            more = self._write_some(fd, line[written:], left) if left > 0 else 0
            if more == 0:
                self._cut = True
                raise OSError(errno.EAGAIN, f"the audit log's reader stopped reading after {written} bytes of a "
                                            f"{len(line)}-byte line")
            written += more
        return written

    def _write_some(self, fd: int, data: bytes, wait: float) -> int:
        """What the descriptor takes of ``data`` now (after waiting up to ``wait`` seconds for room): 0 for none."""
        if wait > 0:
            poller = select.poll()
            poller.register(fd, select.POLLOUT)
            if not poller.poll(int(wait * 1000) + 1):
                return 0
        if self._nowait_write:
            try:
                return os.pwritev(fd, [data], -1, os.RWF_NOWAIT)
            except BlockingIOError:
                return 0
            except OSError as err:
                if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ESPIPE):
                    raise
                self._nowait_write = False  # not for this kind of descriptor (a terminal): poll first from now on
        if wait <= 0:
            poller = select.poll()
            poller.register(fd, select.POLLOUT)
            if not poller.poll(0):
                return 0
        try:
            return os.write(fd, data)
        except BlockingIOError:  # a FIFO opened O_NONBLOCK
            return 0

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
        if self._fd is None:  # a FIFO nobody read when it was opened: has a reader come?
            self.reopen()
            if self._fd is None:
                return False
        record = {"time": rfc3339(time.time()), "event": "audit", "failures": self.failures,
                  "reason": "the audit log is writable again; 'failures' lines could not be written"}
        if self.select is None or self.select(record):
            return self.write(record)
        # A format with no line for this (squid's): judge the file by its free space, a pipe by its room, instead
        # of writing.
        try:
            if self._waits:
                space = os.fstatvfs(self._fd)
                self.healthy = space.f_bavail * space.f_frsize >= 64 * 1024
            elif self._pipe:
                self.healthy = _pipe_room(self._fd) >= 64 * 1024
        except OSError:
            pass
        return self.healthy

    def close(self) -> None:
        with self._lock:
            if self._fd is not None and self.path is not None:
                os.close(self._fd)
            self._fd = None

