"""Slots under a global cap and a cap per client, taken before anything is spawned.

A slot is taken (``reserve``) when a client asks for a context (or a connection), before the request
reaches the browser, and counts against both caps from that moment until it is released: when the
context failed to open, closed, or was reaped. So concurrent opens cannot overshoot (the check and the
count are one step on the event loop), and a refused open never reaches the browser. Single-threaded
by design: everything runs on the server's event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class CapRefusal:
    scope: str  # "client" or "server": which cap refused
    reason: str


@dataclass(eq=False)
class Slot:
    caps: Caps
    key: str
    released: bool = False

    def release(self) -> None:
        """Give the slot back (idempotent: a context that both closes and is reaped frees one slot)."""
        if not self.released:
            self.released = True
            self.caps._give_back(self.key)


@dataclass
class Caps:
    limit: int  # over all clients
    per_client: int
    noun: str = "contexts"
    advice: str = "close one"
    in_use: int = 0
    by_client: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.limit < 1 or self.per_client < 1:
            raise ValueError(f"caps on {self.noun} must be at least 1 (got {self.limit} and {self.per_client})")

    def reserve(self, key: str) -> Slot | CapRefusal:
        mine = self.by_client.get(key, 0)
        if mine >= self.per_client:
            return CapRefusal("client", f"{mine} of {self.per_client} {self.noun} in use for this client; "
                                        f"{self.advice}")
        if self.in_use >= self.limit:
            return CapRefusal("server", f"{self.in_use} of {self.limit} {self.noun} in use on this server; "
                                        "try again later")
        self.in_use += 1
        self.by_client[key] = mine + 1
        return Slot(self, key)

    def held_by(self, key: str) -> int:
        return self.by_client.get(key, 0)

    def _give_back(self, key: str) -> None:
        self.in_use -= 1
        left = self.by_client[key] - 1
        if left:
            self.by_client[key] = left
        else:
            del self.by_client[key]  # the table holds only clients with slots: it cannot grow without bound
