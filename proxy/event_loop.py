"""The event loop the proxy runs on: uvloop's (libuv, in C), not the standard library's.

A passed-through tunnel is mostly event-loop work: an accept, a few reads and writes, two transports,
a handful of timers. With the standard selector loop that overhead was the largest part of the
proxy's CPU per tunnel; uvloop is a drop-in ``asyncio`` loop (mitmproxy, aiohttp, dnspython and redis
run on it unchanged) that does the same in C. ``--no-uvloop`` runs the standard loop, to compare or
to rule the loop out when chasing a bug; both are tested (tests/test_event_loop.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import uvloop


def loop_factory(use_uvloop: bool = True) -> Callable[[], asyncio.AbstractEventLoop]:
    return uvloop.new_event_loop if use_uvloop else asyncio.new_event_loop


def run(main: Coroutine[Any, Any, Any], use_uvloop: bool = True) -> Any:
    """``asyncio.run`` on the chosen loop."""
    return asyncio.run(main, loop_factory=loop_factory(use_uvloop))
