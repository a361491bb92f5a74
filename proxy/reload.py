"""Hot reload: the policy in force, swapped atomically; an invalid file never replaces a good one.

The watcher polls the file's identity (the resolved path, inode, size and mtime) instead of
using inotify, because a Kubernetes ConfigMap update swaps a symlink (``..data``) rather than
writing the file, and polling sees that the same way it sees an edit. SIGHUP reloads at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass

from policy.loader import Overrides, PolicyError, load_policy
from policy.model import Policy

log = logging.getLogger("egresswall.reload")


@dataclass(frozen=True)
class FileIdentity:
    realpath: str
    inode: int
    size: int
    mtime_ns: int


def identity(path: str) -> FileIdentity | None:
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError:
        return None
    return FileIdentity(real, st.st_ino, st.st_size, st.st_mtime_ns)


class PolicyHolder:
    """Holds the policy in force. Readers take ``holder.policy`` once per decision; a reload
    replaces the reference in one assignment, so a decision never sees half of two policies."""

    def __init__(self, path: str | None, overrides: Overrides | None = None,
                 on_reload: Callable[[bool, str], None] | None = None) -> None:
        self.path = path
        self.overrides = overrides
        self.on_reload = on_reload
        self.policy: Policy = load_policy(path, overrides)  # the first load must succeed: fail closed
        self.last_error: str | None = None
        self._seen = identity(str(self.policy.source))
        self._task: asyncio.Task | None = None

    def reload(self) -> bool:
        """Load the file again; keep the last good policy if the new one is invalid."""
        seen = identity(str(self.policy.source))
        try:
            _check_complete(str(self.policy.source))
            new = load_policy(self.path, self.overrides)
        except PolicyError as err:
            self._seen = seen
            self.last_error = str(err)
            log.error("policy reload refused, keeping the last good policy: %s", err)
            if self.on_reload:
                self.on_reload(False, str(err))
            return False
        self._seen = seen
        self.policy = new
        self.last_error = None
        log.info("policy reloaded from %s", new.source)
        if self.on_reload:
            self.on_reload(True, new.source)
        return True

    def changed(self) -> bool:
        return identity(str(self.policy.source)) != self._seen

    def start_watching(self, interval: float = 0.25) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch(interval))

    def stop_watching(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _watch(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                if self.changed():
                    # A writer may still be writing: wait one beat and require a stable identity.
                    before = identity(str(self.policy.source))
                    await asyncio.sleep(min(interval, 0.1))
                    if identity(str(self.policy.source)) == before:
                        await asyncio.to_thread(self.reload) if _is_large(before) else self.reload()
            except Exception:  # never let the watcher die: a dead watcher means no more reloads
                log.exception("policy watcher error")


def _check_complete(path: str) -> None:
    """Refuse a reload of a file that does not end with a newline. A file caught half-written almost
    always ends mid-line, and its first half can be valid YAML that says less (a deny list cut short,
    a host name cut to another name): the last good policy stays until the write is finished.
    (Writing policy files atomically, to another name and renamed over, is safe at every byte.)"""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return  # load_policy says why
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_size > 0 and os.pread(fd, 1, st.st_size - 1) != b"\n":
            raise PolicyError(path, 0, 0, "", "does not end with a newline, so it may be half-written; "
                                              "keeping the last good policy until it does")
    finally:
        os.close(fd)


def _is_large(ident: FileIdentity | None) -> bool:
    """Big allowlists load in a thread so traffic is not stalled while they are parsed."""
    return ident is not None and ident.size > 1_000_000
