"""Port lists as operators write them: numbers and inclusive ranges ("1025-65535", squid's habit).

A policy keeps ports as a frozenset of numbers, so a check stays one set lookup; ranges are expanded once
at load time (identical lists share one set) and compressed again whenever ports are shown to a human.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache

MIN_PORT, MAX_PORT = 1, 65535


def parse_port_list(values: Iterable[int | str]) -> frozenset[int]:
    """``[80, 443, "1025-65535"]`` → the set of ports; ValueError names the bad entry."""
    values = tuple(values)
    for value in values:
        if type(value) not in (int, str):  # the cache's key: 443.0 == 443 (and True == 1) would find 443's set
            _bounds(value)
            raise ValueError(f"got {value!r}; expected a port number or a range such as '1025-65535'")
    return _expand(values)


@cache
def _expand(values: tuple[int | str, ...]) -> frozenset[int]:
    ports: set[int] = set()
    for value in values:
        low, high = _bounds(value)
        ports.update(range(low, high + 1))
    return frozenset(ports)


def _bounds(value: int | str) -> tuple[int, int]:
    if isinstance(value, bool):
        raise ValueError(f"got {value!r}; expected a port number or a range such as '1025-65535'")
    if isinstance(value, int):
        low = high = value
    else:
        first, dash, last = str(value).partition("-")
        if not dash or not first.isdigit() or not last.isdigit():
            raise ValueError(f"got {value!r}; expected a port number or a range such as '1025-65535'")
        low, high = int(first), int(last)
    if not (MIN_PORT <= low <= MAX_PORT and MIN_PORT <= high <= MAX_PORT):
        raise ValueError(f"got {value!r}; ports are {MIN_PORT}-{MAX_PORT}")
    if low > high:
        raise ValueError(f"got {value!r}; the range is empty (the first port is greater than the last)")
    return low, high


def port_runs(ports: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted runs of consecutive ports: {80, 81, 82, 443} → [(80, 82), (443, 443)]."""
    runs: list[tuple[int, int]] = []
    for port in sorted(set(ports)):
        if runs and port == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], port)
        else:
            runs.append((port, port))
    return runs


def ports_text(ports: Iterable[int]) -> str:
    """``80, 443, 1025-65535``: runs of three or more ports are shown as a range."""
    if isinstance(ports, frozenset):
        return _frozen_ports_text(ports)  # a policy's port sets: computed once, not per refusal
    return _ports_text(ports)


@cache
def _frozen_ports_text(ports: frozenset[int]) -> str:
    return _ports_text(ports)


def _ports_text(ports: Iterable[int]) -> str:
    parts: list[str] = []
    for low, high in port_runs(ports):
        if high - low >= 2:
            parts.append(f"{low}-{high}")
        else:
            parts.extend(str(port) for port in range(low, high + 1))
    return ", ".join(parts)
