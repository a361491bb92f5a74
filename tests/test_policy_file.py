"""proxy/policy_file.py: a policy file is read once, never blocks, and is used only when whole.

Real files in a temporary directory (a FIFO, a directory, a device link, a file being written); the
parse itself is policy.loader's, tested in test_policy_loader.py.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from policy.errors import PolicyError
from proxy.policy_file import (
    DEFAULT_POLICY,
    SETTLE_SECONDS,
    Unsettled,
    load_policy_file,
    read_policy_file,
)

GOOD = "version: 1\ndefault: deny\nhosts:\n  allow:\n    - a.example.com\n"


def aged(path: Path, seconds: float) -> Path:
    """Make the file look last written `seconds` ago."""
    then = time.time() - seconds
    os.utime(path, (then, then))
    return path


def test_the_bundled_default_is_package_data() -> None:
    assert DEFAULT_POLICY.is_file() and DEFAULT_POLICY.name == "default.yaml"
    read = read_policy_file()
    assert read.source == str(DEFAULT_POLICY) and read.text == DEFAULT_POLICY.read_text()
    assert load_policy_file().source == str(DEFAULT_POLICY)


def test_a_file_ending_with_a_newline_is_taken_at_once(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(GOOD)
    started = time.monotonic()
    read = read_policy_file(path, wait=False)
    assert read.text == GOOD and read.source == str(path) and read.identity.size == len(GOOD)
    assert time.monotonic() - started < 0.5


def test_no_final_newline_is_taken_once_settled(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(GOOD.rstrip("\n"))
    with pytest.raises(Unsettled) as info:
        read_policy_file(path, wait=False)
    assert "does not end with a newline" in str(info.value) and "may be half-written" in str(info.value)
    assert 0 < info.value.settles_in <= SETTLE_SECONDS
    aged(path, SETTLE_SECONDS + 1)  # written a while ago: whole
    assert read_policy_file(path, wait=False).text == GOOD.rstrip("\n")


def test_waiting_reader_takes_a_fresh_file_after_the_settle_time(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(GOOD.rstrip("\n"))
    started = time.monotonic()
    policy = load_policy_file(path)  # as the first load and lint do
    assert SETTLE_SECONDS - 0.2 <= time.monotonic() - started < SETTLE_SECONDS + 1.0
    assert [r.pattern.name for r in policy.allow.rules] == ["a.example.com"]


def test_the_time_seen_unchanged_counts_across_tries(tmp_path: Path) -> None:
    """A modification time in the future (clock skew) gives no credit; the reader's own observation does."""
    path = tmp_path / "p.yaml"
    path.write_text(GOOD.rstrip("\n"))
    future = time.time() + 3600
    os.utime(path, (future, future))
    with pytest.raises(Unsettled) as first:
        read_policy_file(path, wait=False)
    time.sleep(SETTLE_SECONDS + 0.05)
    with pytest.raises(Unsettled):
        read_policy_file(path, wait=False)  # without the earlier observation: no credit
    assert read_policy_file(path, wait=False, unsettled=first.value).text == GOOD.rstrip("\n")


def test_a_change_restarts_the_settle_time(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(GOOD.rstrip("\n"))
    with pytest.raises(Unsettled) as first:
        read_policy_file(path, wait=False)
    time.sleep(SETTLE_SECONDS + 0.05)
    path.write_text(GOOD.rstrip("\n") + "  # more")  # a writer still at it
    with pytest.raises(Unsettled):
        read_policy_file(path, wait=False, unsettled=first.value)


def test_a_file_that_keeps_changing_is_refused_by_a_waiting_reader(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("version: 1")
    stop = threading.Event()

    def writer() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            path.write_text(f"version: 1\n# {n}")
            time.sleep(0.05)  # far inside the 2 s a file must stay still, even on a loaded machine

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        with pytest.raises(PolicyError) as info:
            read_policy_file(path)
    finally:
        stop.set()
        thread.join()
    assert "kept changing" in str(info.value)


@pytest.mark.parametrize("make, words", [
    (lambda p: os.mkfifo(p), "not a regular file"),
    (lambda p: p.mkdir(), "is a directory"),
    (lambda p: p.symlink_to("/dev/null"), "not a regular file"),
    (lambda p: p.write_bytes(b"version: 1\n# caf\xe9\n"), "cannot be read"),
    (lambda p: None, "no such file"),
])
def test_what_is_not_a_readable_file_fails_at_once(tmp_path: Path, make, words: str) -> None:
    path = tmp_path / "p.yaml"
    make(path)
    started = time.monotonic()
    with pytest.raises(PolicyError) as info:
        read_policy_file(path)  # a FIFO with no writer must not block the open
    assert words in str(info.value) and str(info.value).startswith(str(path))
    assert time.monotonic() - started < 1.0


def test_errors_in_the_text_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("version: 2\n")
    with pytest.raises(PolicyError) as info:
        load_policy_file(path)
    assert str(info.value) == f"{path}:1:10: version: got 2; expected 1"
