"""PolicyHolder.request_reload (SIGHUP's): one reload at a time, requests during one coalesce into one more,
a big file is loaded off the event loop, and a reload that fails keeps the last good policy. In process."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from proxy.reload import PolicyHolder

SMALL = "version: 1\nmode: enforce\ndefault: deny\nhosts:\n  allow:\n    - a.example\n"


def _big(extra: str = "") -> str:
    """Over the 1 MB mark past which a reload is done in a thread."""
    names = "".join(f"    - n{i}.bulk.example.com\n" for i in range(45_000))
    return f"version: 1\nmode: enforce\ndefault: deny\nhosts:\n  allow:\n{extra}{names}"


def _holder(path: Path, text: str) -> tuple[PolicyHolder, list[tuple[bool, str]], list[str]]:
    path.write_text(text)
    reloads: list[tuple[bool, str]] = []
    threads: list[str] = []

    def on_reload(ok: bool, detail: str) -> None:
        reloads.append((ok, detail))
        threads.append(threading.current_thread().name)

    return PolicyHolder(str(path), on_reload=on_reload), reloads, threads


async def _settled(holder: PolicyHolder) -> None:
    while holder._reloading is not None and not holder._reloading.done():
        await asyncio.sleep(0.01)


def test_requests_during_a_reload_coalesce_into_one_more_reload(tmp_path):
    holder, reloads, threads = _holder(tmp_path / "p.yaml", _big())

    async def main() -> None:
        holder.request_reload()
        await asyncio.sleep(0.05)  # the first reload has read the file and is parsing it, in its thread
        (tmp_path / "p.yaml").write_text(_big("    - b.example\n"))
        for _ in range(4):  # a burst of SIGHUPs while it is still loading
            holder.request_reload()
        await _settled(holder)

    asyncio.run(main())
    assert [ok for ok, _ in reloads] == [True, True]  # the first, and one more for the four during it
    assert all(name != "MainThread" for name in threads), "a big file was loaded on the event loop's thread"
    assert holder.policy.allow.rules[0].pattern.text == "b.example"


def test_a_small_file_is_reloaded_on_the_loop_and_a_bad_one_keeps_the_last_good_policy(tmp_path):
    holder, reloads, threads = _holder(tmp_path / "p.yaml", SMALL)

    async def main() -> None:
        (tmp_path / "p.yaml").write_text(SMALL.replace("a.example", "c.example"))
        holder.request_reload()
        await _settled(holder)
        (tmp_path / "p.yaml").write_text(SMALL + "  deny: [[\n")
        holder.request_reload()
        await _settled(holder)

    asyncio.run(main())
    assert [ok for ok, _ in reloads] == [True, False]
    assert threads == ["MainThread", "MainThread"]
    assert holder.policy.allow.rules[0].pattern.text == "c.example"
    assert holder.last_error is not None


def test_a_reload_that_meets_a_bug_is_refused_once_and_keeps_the_last_good_policy(tmp_path, monkeypatch):
    """An exception that is no PolicyError (a bug of ours: a YAML merge key once raised ValueError from deep in
    the loader) is refused like an invalid file: counted as a failed reload, the last good policy kept, and
    that version of the file not tried again every watcher beat (it was: a traceback three times a second)."""
    import proxy.reload

    holder, reloads, _ = _holder(tmp_path / "p.yaml", SMALL)
    real_parse = proxy.reload.parse_policy
    calls = []

    def parse(text, source, overrides=None):
        calls.append(text)
        if "c.example" in text:
            raise ValueError("2 patterns for 1 items")
        return real_parse(text, source, overrides)

    monkeypatch.setattr(proxy.reload, "parse_policy", parse)
    (tmp_path / "p.yaml").write_text(SMALL.replace("a.example", "c.example"))
    assert holder.changed()
    assert holder.reload() is False
    assert not holder.changed(), "the same file would be tried again on the next beat"
    assert reloads == [(False, holder.last_error)]
    assert "internal error, a bug in egresswall: ValueError" in reloads[0][1]
    assert holder.policy.allow.rules[0].pattern.text == "a.example"
    (tmp_path / "p.yaml").write_text(SMALL.replace("a.example", "d.example"))  # the next edit applies
    assert holder.changed() and holder.reload() is True
    assert holder.policy.allow.rules[0].pattern.text == "d.example" and len(calls) == 2
