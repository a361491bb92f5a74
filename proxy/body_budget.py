"""The process-wide budget for request bodies egresswall buffers (``limits.max_buffered_request_bodies``).

A chunked request body is read whole before the upstream sees any of it (``limits.max_request_body``
bounds one body), so each one is held in memory while it arrives. Without a bound over all of them a
client with ``limits.max_connections_per_client`` slow uploads holds that many times
``limits.max_request_body`` (2.5 GiB with the defaults), and several clients more. Both transports
reserve a body's bytes here as they buffer them and give them back when egresswall no longer holds them
(the request was sent or refused, or its connection died): a reservation over the budget is refused,
and the request with it.

* The budget: ``limits.max_buffered_request_bodies`` bytes; with N workers each worker has 1/N of it
  (rounded up), as each has 1/N of every connection cap (``proxy/admission.py``).
* A client's share: a quarter of the budget, but never less than one body at ``limits.max_request_body``
  (when the budget holds one): one client (one address) cannot take all of it and shut every other
  client's uploads out (four clients at their share fill it), yet can always send one body the policy
  allows. The budget refused is 503
  (egresswall is busy), a client over its own share 429 (that client is); the rule is
  ``limits.max_buffered_request_bodies`` either way.

No mitmproxy import: the gate owns one, and it is tested with plain values.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from policy.addresses import cap_group
from policy.model import Limits

RULE = "limits.max_buffered_request_bodies"
CLIENT_SHARE = 4  # a client may hold 1/CLIENT_SHARE of the budget


@dataclass(frozen=True)
class BudgetRefusal:
    status: int  # 503: the budget is full; 429: the client's share of it is
    rule: str
    reason: str


class BodyBudget:
    """Bytes of request bodies buffered now, in all and by client. ``on_change`` is told the total at
    each change (the metrics gauge)."""

    def __init__(self, share: int = 1, on_change: Callable[[int], None] | None = None) -> None:
        self.share = share
        self.total = 0
        self.per_client: Counter[str] = Counter()
        self._on_change = on_change

    def limits_of(self, limits: Limits) -> tuple[int, int]:
        """(this worker's budget, a client's share of it) in bytes."""
        budget = -(-limits.max_buffered_request_bodies // self.share)
        return budget, max(budget // CLIENT_SHARE, min(budget, limits.max_request_body))

    def reserve(self, client: str, size: int, limits: Limits) -> BudgetRefusal | None:
        """Count ``size`` more bytes for ``client``, or say why not (then nothing is counted)."""
        if size <= 0:
            return None
        budget, per_client = self.limits_of(limits)
        if self.total + size > budget:
            return BudgetRefusal(503, RULE, f"egresswall is already buffering {self.total} bytes of request bodies, "
                                            f"its limit is {budget} ({RULE}{self._per_worker(limits)}); this "
                                            f"request's body would take {size} more: retry later")
        group = cap_group(client)  # an IPv6 client by its /64, as the connection caps count it
        held = self.per_client[group]
        if held + size > per_client:
            who = f"client {client} is" if group == client else f"clients in {group} (counted as one) are"
            return BudgetRefusal(429, RULE, f"{who} already buffering {held} bytes of request bodies, "
                                            f"its share is {per_client} (a quarter of {RULE}"
                                            f"{self._per_worker(limits)}, or one body at limits.max_request_body "
                                            f"if that is more); this request's body would take {size} "
                                            "more: retry when its other uploads have gone")
        self.total += size
        self.per_client[group] += size
        self._changed()
        return None

    def release(self, client: str, size: int) -> None:
        if size <= 0:
            return
        group = cap_group(client)
        self.total -= size
        self.per_client[group] -= size
        if self.per_client[group] <= 0:
            del self.per_client[group]
        self._changed()

    def hold(self, client: str) -> BodyHold:
        """What one body holds, to be given back once whatever way its request ends."""
        return BodyHold(self, client)

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self.total)

    def _per_worker(self, limits: Limits) -> str:
        if self.share == 1:
            return ""
        return f": this worker's share of {limits.max_buffered_request_bodies} over {self.share} workers"


class BodyHold:
    """The bytes one buffered body holds of the budget. ``release`` gives them all back and may be called
    any number of times (each exit path of a request calls it; only the first gives anything back)."""

    def __init__(self, budget: BodyBudget, client: str) -> None:
        self.budget, self.client = budget, client
        self.held = 0

    def add(self, size: int, limits: Limits) -> BudgetRefusal | None:
        refused = self.budget.reserve(self.client, size, limits)
        if refused is None:
            self.held += max(0, size)
        return refused

    def release(self) -> None:
        held, self.held = self.held, 0
        self.budget.release(self.client, held)
