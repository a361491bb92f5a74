"""Counting a streamed message's bytes as mitmproxy relays them.

A streamed body is never kept on the flow (``raw_content`` stays empty), so what went through is counted on
the way: for the response record's ``bytes_up`` / ``bytes_down`` and a session's byte budgets, charged from it.
"""

from __future__ import annotations

from collections.abc import Callable

UP = "egresswall_up"  # flow.metadata: {"bytes": n}, a streamed request body's bytes as they went upstream
DOWN = "egresswall_down"  # flow.metadata: {"bytes": n}, a response body's bytes as they went to the client


def counting_stream(metadata: dict, key: str) -> Callable[[bytes], bytes]:
    """A ``stream`` callable for mitmproxy that passes each chunk on as it is and adds its length to
    ``metadata[key]["bytes"]`` (set to 0 here)."""
    counted = {"bytes": 0}
    metadata[key] = counted

    def count(chunk: bytes) -> bytes:
        counted["bytes"] += len(chunk)
        return chunk

    return count
