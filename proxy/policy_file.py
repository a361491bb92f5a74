"""Reading a policy file: once, safely, and only when it is whole. (``policy/`` parses text; this reads it.)

* The file is opened so that nothing can block: O_NONBLOCK makes opening a FIFO return at once, and fstat on
  the opened descriptor judges what was opened (a directory, FIFO, socket or device is refused), not what
  the name pointed to a moment before. Reading the proxy's policy happens on its event loop.
* It is read once; every check (UTF-8, complete) is made on those same bytes, and those bytes are parsed.
* **Complete.** A file caught half-written usually ends mid-line, and its first half can be valid YAML
  that says less (a deny list cut short, a host name cut to another name). A file that ends with a newline
  is used as read by the first load, ``lint`` and SIGHUP. One that does not (VS Code saves files that way),
  and every file the watcher reloads (``settled_only``: a writer pausing at a line's end leaves a newline
  at the end), is used once it has been left unchanged for ``SETTLE_SECONDS``: its modification time is
  that old, or this reader has seen the same file (inode, size, modification time) for that long. Until
  then it is *unsettled*: the first load and ``lint`` wait for it (``wait=True``, at most a few settle
  periods while it keeps changing), and a reload (``wait=False``) keeps the last good policy and tries
  again on the watcher's next beat. So the first load, a reload and ``lint`` decide alike on the same
  bytes; the watcher only waits longer before it reads them. Writing policy files atomically (to another
  name, then renamed over) is safe at every byte.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from policy.errors import PolicyError
from policy.loader import Overrides, parse_policy
from policy.model import Policy

# The bundled default: package data of ``policy``, located through importlib.resources (a plain path for
# an ordinary install, which is what the CLI's --policy default needs to show).
DEFAULT_POLICY = Path(str(resources.files("policy").joinpath("default.yaml")))
SETTLE_SECONDS = 2.0
# A million host names are about 28 MiB of YAML (tests/benchmarks/bench_decision.py); parsing costs many times a
# file's size in memory. A larger file is refused unread: a reload that pointed at a 512 MiB sparse file took the
# proxy from 76 MiB to 1.6 GiB before it was refused (review round 19), and every worker reads it.
MAX_POLICY_BYTES = 64 << 20
_MAX_WAIT_PERIODS = 3  # a file without a final newline that keeps changing this long is refused


@dataclass(frozen=True)
class FileIdentity:
    """What changes when a file is edited or replaced (a ConfigMap swaps a symlink: the realpath changes). The
    inode's change time too: a rewrite that keeps the size and puts the modification time back (``touch -r``, a
    copy that preserves times) changes nothing else the watcher sees."""

    realpath: str
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int = 0


@dataclass(frozen=True)
class PolicyText:
    text: str
    source: str  # the name errors are reported by: the path as given
    identity: FileIdentity


class Unsettled(PolicyError):
    """The file changed too recently to tell it from a half-written one (it does not end with a newline, or
    the watcher holds every file to that)."""

    def __init__(self, source: str, identity: FileIdentity, since: float, why: str) -> None:
        self.identity, self.since = identity, since  # since: time.monotonic() from which it was unchanged
        super().__init__(source, 0, 0, "", f"{why}, so it may be half-written; it is used once it has stayed "
                                           f"unchanged for {SETTLE_SECONDS:g} s")

    @property
    def settles_in(self) -> float:
        return max(0.0, self.since + SETTLE_SECONDS - time.monotonic())


def identity(path: str | Path) -> FileIdentity | None:
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError:
        return None
    return FileIdentity(real, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def read_policy_file(path: str | Path | None = None, *, wait: bool = True,
                     unsettled: Unsettled | None = None, settled_only: bool = False) -> PolicyText:
    """The file's text (the bundled default when path is None), or PolicyError saying why not.

    ``wait=False`` raises ``Unsettled`` for a file without a final newline that changed too recently; pass
    that error back as ``unsettled`` on the next try, so that the time it has already been seen unchanged
    counts. ``settled_only``: every file is held to that, a final newline or not (the watcher's reload: a
    writer that pauses at the end of a line leaves a file that ends with one, and may say less than it will)."""
    path = Path(path) if path is not None else DEFAULT_POLICY
    deadline = time.monotonic() + SETTLE_SECONDS * _MAX_WAIT_PERIODS
    while True:
        try:
            return _read_once(path, unsettled, settled_only)
        except Unsettled as err:
            if not wait:
                raise
            if time.monotonic() + err.settles_in > deadline:
                what = "kept changing" if settled_only else "does not end with a newline and kept changing"
                raise PolicyError(str(path), 0, 0, "", f"{what} for {SETTLE_SECONDS * _MAX_WAIT_PERIODS:g} s, so it "
                                                       "may be half-written") from None
            unsettled = err
            time.sleep(err.settles_in + 0.01)


def load_policy_file(path: str | Path | None = None, overrides: Overrides | None = None, *,
                     wait: bool = True, settled_only: bool = False) -> Policy:
    """Read, validate and index a policy file (the bundled default when path is None); ``settled_only`` as for
    ``read_policy_file``."""
    read = read_policy_file(path, wait=wait, settled_only=settled_only)
    return parse_policy(read.text, read.source, overrides)


def _read_once(path: Path, unsettled: Unsettled | None, settled_only: bool = False) -> PolicyText:
    source = str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise PolicyError(source, 0, 0, "", "no such file") from None
    except IsADirectoryError:
        raise PolicyError(source, 0, 0, "", "is a directory, not a policy file") from None
    except OSError as err:
        raise PolicyError(source, 0, 0, "", f"cannot be read: {err}") from None
    try:
        before = os.fstat(fd)
        if stat.S_ISDIR(before.st_mode):
            raise PolicyError(source, 0, 0, "", "is a directory, not a policy file")
        if not stat.S_ISREG(before.st_mode):
            raise PolicyError(source, 0, 0, "", f"cannot be read: {path} is not a regular file "
                                                "(a FIFO, socket or device)")
        if before.st_size > MAX_POLICY_BYTES:
            raise PolicyError(source, 0, 0, "", _too_big(before.st_size))
        chunks, read = [], 0
        while read <= MAX_POLICY_BYTES and (chunk := os.read(fd, 1 << 20)):
            chunks.append(chunk)
            read += len(chunk)
        if read > MAX_POLICY_BYTES:  # it grew while it was read
            raise PolicyError(source, 0, 0, "", _too_big(read))
        after = os.fstat(fd)
    except OSError as err:
        raise PolicyError(source, 0, 0, "", f"cannot be read: {err}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise PolicyError(source, 0, 0, "", f"cannot be read: {err}") from None
    ident = FileIdentity(os.path.realpath(path), after.st_ino, after.st_size, after.st_mtime_ns, after.st_ctime_ns)
    changed_while_read = (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns) or (
        after.st_size != len(data))
    # An empty file counts as unfinished too: a writer that truncates and then writes (most editors, and
    # shell redirection) leaves it empty for a moment, and an empty read then is not the file's content.
    if not data.endswith(b"\n") or changed_while_read or settled_only:
        _check_settled(source, ident, changed_while_read, unsettled, data.endswith(b"\n"))
    return PolicyText(text, source, ident)


def _too_big(size: int) -> str:
    return (f"is {size} bytes, more than the {MAX_POLICY_BYTES >> 20} MiB ({MAX_POLICY_BYTES} bytes) a policy file "
            "may be (a million host names are about 28 MiB)")


def _check_settled(source: str, ident: FileIdentity, changed_while_read: bool, unsettled: Unsettled | None,
                   whole_lines: bool = False) -> None:
    now = time.monotonic()
    if changed_while_read:
        raise Unsettled(source, ident, now, "changed while it was read")
    age = time.time() - ident.mtime_ns / 1e9  # negative for a modification time in the future: no credit
    since = now - max(0.0, age)
    if unsettled is not None and unsettled.identity == ident:
        since = min(since, unsettled.since)  # this reader has seen it unchanged since then
    if now - since < SETTLE_SECONDS:
        what = "changed" if whole_lines else "does not end with a newline and changed"
        raise Unsettled(source, ident, since, f"{what} less than {SETTLE_SECONDS:g} s ago")
