"""What a session may still move through this worker's open tunnels and WebSockets, counted as the bytes move.

A passed-through TLS tunnel or a WebSocket under a session carries bytes that are no requests, so its
session's byte budgets were held only by the gate's sweep, which charges them to the store and reads the
total once a second: until then, any number of bytes moved, one second of a fast link past the budget
(review finding). The sweep now also leaves an allowance here: the budget less what the store has counted
and less what moved since it was counted. Each relay takes every chunk from it before relaying the chunk; a
chunk that would carry the session past a budget is not relayed, and everything open under the session in
this worker is ended at once (``crossed``).

An allowance starts unread and takes nothing until a look has read the store: the gate answers a tunnel,
and lets a WebSocket relay, only once that first look has read it (every one opened while it is on its way
waits for it), and refuses them when the store did not answer it (``Gate._allowance_known``). Workers and
replicas each hold their own allowance, read from the one store: N of them together can pass a budget by at
most N - 1 times what was left at their last looks.
"""

from __future__ import annotations

from collections.abc import Callable

from policy.sessions import Usage

UP, DOWN = "up", "down"
# A relay's own word for the cut, should the gate's refusal not reach the record (it replaces this one).
BUDGET_CUT = "the next chunk would have passed its session's byte budget"


class ByteAllowance:
    """``up``/``down``: bytes the session may still send/receive (None: no budget that way). ``crossed``
    gets the direction and the count the session would have reached when a chunk would pass a budget; the
    allowance stays spent from then on (nothing more is relayed under it)."""

    def __init__(self, up: int | None, down: int | None, crossed: Callable[[str, int], None],
                 read: bool = True) -> None:
        self.budgets = {UP: up, DOWN: down}
        self.left = dict(self.budgets)
        self.crossed = crossed
        self.spent = False
        self.spent_way: str | None = None  # the way whose budget a chunk would have passed (UP or DOWN)
        self.holders = 0  # open tunnels and WebSockets sharing it (the gate drops it at 0)
        # The store's usage has been read into it (``refresh``). The gate makes one unread and lets nothing
        # under it relay until a look has read it (``Gate._allowance_known``); an unread one takes nothing.
        self.read = read

    @property
    def up(self) -> int | None:
        return self.left[UP]

    @property
    def down(self) -> int | None:
        return self.left[DOWN]

    def take(self, key: str, size: int) -> bool:
        """Count ``size`` bytes about to be relayed ``key`` (UP: from the client): False when they would carry
        the session past its budget that way (they must not be relayed). Once spent, nothing more is taken, and
        each refusal is said to ``crossed`` again: what opened or moved since the first ends too."""
        if not self.read:
            return False  # what is left is not known: the gate ends what is open under it (a store not answering)
        left = self.left[key]
        if left is None and not self.spent:
            return True
        if self.spent or size > (left or 0):
            if not self.spent:
                self.spent, self.spent_way = True, key
            budget = self.budgets[key]
            if budget is None:  # spent the other way: no count to report this way
                key, budget, left = self._spent_way()
            self.crossed(key, budget - (left or 0) + size)
            return False
        self.left[key] = left - size
        return True

    def reserve(self, key: str, size: int) -> bool:
        """Take ``size`` bytes for a request judged now (a plain request's declared body), or say it does not fit
        (False: that request is refused, and nothing else is ended, as ``take`` would end it)."""
        left = self.left[key]
        if self.spent or (left is not None and size > left):
            return False
        if left is not None:
            self.left[key] = left - size
        return True

    def needed(self, key: str, size: int) -> int:
        """The count the session would reach with ``size`` more bytes ``key`` (for the refusal's words)."""
        budget = self.budgets[key]
        return size if budget is None else budget - (self.left[key] or 0) + size

    def used(self) -> Usage:
        """The bytes the session has moved each way as this allowance knows them (the budget less what is left;
        the whole budget the way it was spent), for judging a request before its name is looked up."""
        used = {}
        for key in (UP, DOWN):
            budget = self.budgets[key]
            spent = self.spent and key == self.spent_way
            used[key] = 0 if budget is None else budget if spent else budget - (self.left[key] or 0)
        return Usage(request_bytes=used[UP], response_bytes=used[DOWN])

    def _spent_way(self) -> tuple[str, int, int]:
        """(way, budget, left) of a budget this allowance has: for a refusal said after it is spent."""
        key = UP if self.budgets[UP] is not None else DOWN
        budget = self.budgets[key]
        assert budget is not None
        return key, budget, self.left[key] or 0

    def refresh(self, usage: Usage, since_counted: tuple[int, int]) -> None:
        """What is left after the store's ``usage`` and the bytes moved here since they were counted
        (``since_counted``: up, down). A negative remainder is kept as 0: the sweep's own check ends it."""
        self.read = True
        for key, counted, since in ((UP, usage.request_bytes, since_counted[0]),
                                    (DOWN, usage.response_bytes, since_counted[1])):
            budget = self.budgets[key]
            if budget is not None:
                self.left[key] = max(0, budget - counted - since)
