"""The audit log on a pipe whose reader stops reading (proxy/audit.py): a line the pipe cannot take now is a
failed write, at once — never a write that waits and stops the event loop with every client on it (review
round 23) — and the log is healthy again once the reader reads. A real pipe, in process."""

from __future__ import annotations

import contextlib
import os
import threading
import time

import pytest

from proxy.audit import AuditLog

RECORD = {"event": "decision", "reason": "x" * 300}
END = b'y"}\n'  # how the long line ends


@pytest.fixture
def pipe():
    read_end, write_end = os.pipe()
    path = f"/proc/self/fd/{write_end}"  # the pipe's write end, opened as a path is (O_APPEND, like a FIFO)
    yield read_end, path
    for fd in (read_end, write_end):
        os.close(fd)


def _fill(log: AuditLog, most: int = 100_000) -> int:
    """Write until a line is refused; how many were taken. In a thread: a write that waits for the reader (the
    defect) fails the test instead of hanging it (the fixture's close of the read end then ends the write)."""
    taken: list[int] = []

    def fill() -> None:
        for count in range(most):
            if not log.write(RECORD):
                taken.append(count)
                return

    writer = threading.Thread(target=fill, daemon=True)
    writer.start()
    writer.join(15)
    assert not writer.is_alive(), "a write to the full pipe waited for its reader"
    assert taken, f"the pipe took {most} lines with nobody reading"
    return taken[0]


@pytest.mark.parametrize("nowait", [True, False], ids=["rwf-nowait", "poll-first"])
def test_a_full_pipe_fails_the_write_at_once_and_a_reader_heals_it(pipe, nowait):
    read_end, path = pipe
    log = AuditLog(path)
    log._nowait_write = nowait  # the kernel's RWF_NOWAIT, and the poll taken where it has none
    started = time.monotonic()
    taken = _fill(log)
    assert taken > 100 and time.monotonic() - started < 10
    assert not log.healthy and log.failures == 1
    started = time.monotonic()
    assert not log.write(RECORD) and time.monotonic() - started < 0.5  # the next fails at once too
    drained = b""
    while len(drained) < 64 * 1024:
        drained += os.read(read_end, 1 << 20)
    assert log.probe() and log.healthy
    lines = drained.split(b"\n")
    assert all(line.startswith(b'{"event":"decision"') for line in lines[:-1])  # whole lines only


def test_a_line_taken_in_part_is_finished_while_its_reader_reads(pipe):
    read_end, path = pipe
    log = AuditLog(path)
    _fill(log)
    got = bytearray()

    def read_slowly() -> None:
        os.set_blocking(read_end, False)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and END not in got[-1000:]:
            try:
                got.extend(os.read(read_end, 4096))
            except BlockingIOError:
                time.sleep(0.001)

    reader = threading.Thread(target=read_slowly)
    reader.start()
    long = {"event": "decision", "reason": "y" * 200_000}  # over PIPE_BUF: may be taken in part
    deadline = time.monotonic() + 4
    while not log.write(long):
        assert time.monotonic() < deadline, "the log never took the long line while its reader read"
        time.sleep(0.01)
    reader.join()
    assert b'"reason":"' + b"y" * 200_000 + b'"}\n' in bytes(got)


def test_a_fifo_without_a_reader_is_opened_without_waiting_and_healed_by_its_reader(tmp_path):
    fifo = tmp_path / "audit.fifo"
    os.mkfifo(fifo)
    started = time.monotonic()
    log = AuditLog(str(fifo))  # nobody reads: the open must not wait for a reader
    assert time.monotonic() - started < 1 and not log.healthy
    assert not log.write(RECORD) and not log.probe()
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert log.probe() and log.healthy and log.write(RECORD)
        assert os.read(reader, 1 << 16).count(b"\n") == 2  # the probe's line and the record
    finally:
        os.close(reader)
        log.close()


def test_a_line_cut_by_a_reader_that_stops_is_ended_by_the_next_one(monkeypatch):
    """Standard output a socket (journald's stream), which takes part of a long line, and its reader stops: the
    write fails after PARTIAL_WAIT (never waits longer), and the next line written starts by ending the cut one,
    so every later line is whole."""
    import socket
    import sys

    ours, theirs = socket.socketpair()

    class Stdout:
        @staticmethod
        def fileno() -> int:
            return ours.fileno()

    monkeypatch.setattr(sys, "stdout", Stdout())
    try:
        log = AuditLog(None)
        started = time.monotonic()
        assert not log.write({"event": "decision", "reason": "z" * 4_000_000})
        assert time.monotonic() - started < 2 and not log.healthy
        theirs.setblocking(False)
        got = bytearray()
        with contextlib.suppress(BlockingIOError):
            while chunk := theirs.recv(1 << 20):
                got.extend(chunk)
        assert got and not got.endswith(b"\n")  # cut
        assert log.write(RECORD)
        more = theirs.recv(1 << 20)
        assert more.startswith(b'\n{"event":"decision"') and more.endswith(b"\n")
    finally:
        ours.close()
        theirs.close()
