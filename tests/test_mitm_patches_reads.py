"""``HeldReader`` (proxy/mitm_patches.py): a client's reads wait while any of its requests is decided.

The integration test is test_body_while_deciding.py; this pins the reader's own rules in process: a read
under way when the hold starts completes, the next waits, several holds (HTTP/2 streams) all have to end,
and a cancel while waiting ends the read as mitmproxy's read loop expects (CancelledError)."""

from __future__ import annotations

import asyncio

import pytest

from proxy.mitm_patches import HeldReader


def _reader(*pieces: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    for piece in pieces:
        reader.feed_data(piece)
    return reader


def test_a_read_waits_until_every_hold_has_ended():
    async def scenario() -> list[str]:
        held = HeldReader(_reader(b"body"))
        held.hold()
        held.hold()  # two requests of one connection decided at once
        read = asyncio.ensure_future(held.read(10))
        await asyncio.sleep(0.01)
        seen = [f"after two holds: {'done' if read.done() else 'waiting'}"]
        held.release()
        await asyncio.sleep(0.01)
        seen.append(f"after one release: {'done' if read.done() else 'waiting'}")
        held.release()
        seen.append(f"after both: {await asyncio.wait_for(read, 1)!r}")
        return seen

    assert asyncio.run(scenario()) == ["after two holds: waiting", "after one release: waiting",
                                       "after both: b'body'"]


def test_a_read_under_way_when_the_hold_starts_completes_and_the_next_waits():
    async def scenario() -> tuple[bytes, bool]:
        stream = _reader()
        held = HeldReader(stream)
        first = asyncio.ensure_future(held.read(10))
        await asyncio.sleep(0.01)  # the read is under way, waiting for data
        held.hold()
        stream.feed_data(b"head")
        got = await asyncio.wait_for(first, 1)
        stream.feed_data(b"body")
        second = asyncio.ensure_future(held.read(10))
        await asyncio.sleep(0.01)
        waiting = not second.done()
        second.cancel()
        return got, waiting

    assert asyncio.run(scenario()) == (b"head", True)


def test_a_cancel_while_held_raises_cancelled_and_the_data_stays_unread():
    async def scenario() -> bytes:
        stream = _reader(b"unread")
        held = HeldReader(stream)
        held.hold()
        read = asyncio.ensure_future(held.read(10))
        await asyncio.sleep(0.01)
        read.cancel()
        with pytest.raises(asyncio.CancelledError):
            await read
        held.release()
        return await held.read(10)

    assert asyncio.run(scenario()) == b"unread"


def test_what_else_mitmproxy_asks_goes_to_the_wrapped_reader():
    async def scenario() -> tuple[bool, bytes, bool]:
        stream = _reader(b"x")
        stream.feed_eof()
        held = HeldReader(stream)
        before = held.at_eof()  # data still buffered
        got = await held.read(10)
        return before, got, held.at_eof()

    assert asyncio.run(scenario()) == (False, b"x", True)
