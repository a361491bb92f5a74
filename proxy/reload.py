"""Hot reload: the policy in force, swapped atomically; an invalid file never replaces a good one.

The watcher polls the file's identity (the resolved path, inode, size and mtime) instead of
using inotify, because a Kubernetes ConfigMap update swaps a symlink (``..data``) rather than
writing the file, and polling sees that the same way it sees an edit. SIGHUP reloads at once. Either
way a big file is loaded in a thread, so the event loop goes on serving while it is parsed, and one
reload runs at a time (a SIGHUP during a reload asks for one more after it, however many arrive).
The file is read by ``proxy/policy_file.py`` (once, never blocking, only when whole): a file that may
still be half-written is neither loaded nor counted as a failed reload; it is tried again each beat. The
watcher loads an edit once the file has stayed unchanged for ``SETTLE_SECONDS`` (a writer that pauses at the
end of a line leaves a file that ends with a newline and may say less than it will: a deny list cut short);
SIGHUP, the operator's word that the file is whole, loads it at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from policy.errors import PolicyError
from policy.loader import Overrides, parse_policy
from policy.model import Policy

from .policy_file import FileIdentity, Unsettled, identity, load_policy_file, read_policy_file

log = logging.getLogger("egresswall.reload")
__all__ = ["FileIdentity", "PolicyHolder", "identity"]


class PolicyHolder:
    """Holds the policy in force. Readers take ``holder.policy`` once per decision; a reload
    replaces the reference in one assignment, so a decision never sees half of two policies."""

    def __init__(self, path: str | None, overrides: Overrides | None = None,
                 on_reload: Callable[[bool, str], None] | None = None, settled_only: bool = False) -> None:
        self.path = path
        self.overrides = overrides
        self.on_reload = on_reload
        # The first load must succeed (fail closed); a file that may be half-written is waited for. A worker
        # started again after it died (``settled_only``) holds every file to that, as the watcher's reload does:
        # it must not enforce a half-written file its siblings' watchers are still waiting out.
        self.policy: Policy = load_policy_file(path, overrides, settled_only=settled_only)
        self.last_error: str | None = None
        self._seen = identity(str(self.policy.source))
        self._unsettled: Unsettled | None = None  # a file still to be tried once it has settled
        self._task: asyncio.Task | None = None
        self._reloading: asyncio.Task | None = None  # the reload in progress (SIGHUP's or the watcher's)
        self._again = False  # a SIGHUP came during it: reload once more when it is done

    def reload(self, settled_only: bool = False) -> bool:
        """Load the file again; keep the last good policy if the new one is invalid (or not yet whole).
        ``settled_only`` (the watcher's): only a file left unchanged for ``SETTLE_SECONDS`` is loaded, whether
        or not it ends with a newline; SIGHUP is the operator saying the file is whole, and loads it at once."""
        seen = identity(str(self.policy.source))
        try:
            read = read_policy_file(self.path, wait=False, unsettled=self._unsettled, settled_only=settled_only)
            new = parse_policy(read.text, read.source, self.overrides)
            if new.upstream != self.policy.upstream:
                # mitmproxy's mode (regular or upstream, and to where) is fixed when the proxy starts.
                raise PolicyError(read.source, 0, 0, "upstream",
                                  f"the upstream proxy changed ({_upstream_text(self.policy)} -> "
                                  f"{_upstream_text(new)}); a reload cannot change it: restart egresswall")
        except Unsettled as err:
            if self._unsettled is None or self._unsettled.identity != err.identity:
                log.info("policy not reloaded yet, keeping the last good policy: %s", err.summary)
            self._unsettled = err
            return False
        except PolicyError as err:
            self._refused(seen, str(err))
            log.error("policy reload refused, keeping the last good policy: %s", err.summary)
            return False
        except Exception as err:  # a bug of ours: refused like an invalid file, once per edit, not once a beat
            self._refused(seen, f"{self.path}: internal error, a bug in egresswall: {type(err).__name__}: {err}")
            log.exception("policy reload refused by an internal error, keeping the last good policy")
            return False
        self._seen, self._unsettled = seen, None
        self.policy = new
        self.last_error = None
        log.info("policy reloaded from %s", new.source)
        if self.on_reload:
            self.on_reload(True, new.source)
        return True

    def _refused(self, seen: FileIdentity | None, error: str) -> None:
        """A reload refused: this version of the file is not tried again until it changes."""
        self._seen, self._unsettled = seen, None
        self.last_error = error
        if self.on_reload:
            self.on_reload(False, error)

    def request_reload(self) -> None:
        """SIGHUP: reload now, off the event loop when the file is big (loading a million names takes
        seconds, and a signal handler runs on the loop). Requests during a reload coalesce into one more."""
        if self._reloading is not None and not self._reloading.done():
            self._again = True
            return
        self._reloading = asyncio.get_running_loop().create_task(self._reload_until_settled())

    async def _reload_until_settled(self) -> None:
        while True:
            self._again = False
            try:
                await self._reload_off_loop()
            except Exception:  # a reload that fails unexpectedly keeps the last good policy, like a refused one
                log.exception("policy reload error")
            if not self._again:
                return

    async def _reload_off_loop(self, settled_only: bool = False) -> bool:
        if _is_large(identity(str(self.policy.source))):
            return await asyncio.to_thread(self.reload, settled_only)
        return self.reload(settled_only)

    async def _reload_from_watcher(self) -> None:
        if self._reloading is not None and not self._reloading.done():
            return  # a SIGHUP's reload is reading the file already; the next beat looks again
        self._reloading = asyncio.get_running_loop().create_task(self._reload_off_loop(settled_only=True))
        await self._reloading
        if self._again:  # a SIGHUP came meanwhile: it asked for the file at once, not once it has settled
            self.request_reload()

    def changed(self) -> bool:
        return self._unsettled is not None or identity(str(self.policy.source)) != self._seen

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
                        await self._reload_from_watcher()
            except Exception:  # never let the watcher die: a dead watcher means no more reloads
                log.exception("policy watcher error")


def _upstream_text(policy: Policy) -> str:
    upstream = policy.upstream
    if upstream is None:
        return "none"
    return upstream.url + (f" with credentials from {upstream.credentials_file}" if upstream.credentials_file else "")


def _is_large(ident: FileIdentity | None) -> bool:
    """Big allowlists load in a thread so traffic is not stalled while they are parsed."""
    return ident is not None and ident.size > 1_000_000
