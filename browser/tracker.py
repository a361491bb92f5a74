"""One connection's contexts, calls in flight and idle clocks: the accounting behind the caps.

Sans-I/O: the relay feeds it each client call (``admit_call``) and each server message
(``observe``), with the time on the server's own clock, and acts on what it returns. A context's slot
(``caps.Slot``) is taken when ``Browser.newContext`` is admitted and given back when the call fails,
or when the server reports the context closed or disposed, or when the connection ends.

Idle means no call from the client on the object or anything under it (its pages, frames, handles...)
and no reply to one, for the limit; a call still in flight does not keep a context alive past it, so
an idle limit is a bound on how long a context can be held without work.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .caps import CapRefusal, Caps, Slot
from .metrics import BrowserMetrics
from .objects import ObjectTree, ServerMessage

CONTEXT = "BrowserContext"
# Calls that create a context (BrowserType.launchPersistentContext and Browser.newContextForReuse are
# refused by the protocol filter).
CONTEXT_OPENERS = {("Browser", "newContext")}


@dataclass(eq=False)
class OpenContext:
    guid: str
    slot: Slot
    last_active: float
    closing: str | None = None  # why the relay asked the browser to close it (a metrics label)


@dataclass(frozen=True)
class CallRefusal:
    reason: str
    scope: str  # "client" / "server" (a cap), or "in_flight", "call_id"


@dataclass
class Seen:
    """What one server message meant for the relay."""

    swallow: bool = False  # a reply to the relay's own call: the client never asked
    unexpected_context: str | None = None  # a context created without an admitted newContext


@dataclass
class ConnectionTracker:
    key: str  # the client, for the per-client cap
    caps: Caps
    tree: ObjectTree
    max_in_flight: int
    now: float
    metrics: BrowserMetrics = field(default_factory=BrowserMetrics)

    def __post_init__(self) -> None:
        self.last_active = self.now
        self.contexts: dict[str, OpenContext] = {}
        self.pending_opens: dict[int | str, Slot] = {}
        self.in_flight: dict[int | str, str | None] = {}  # call id → the context it acts on
        self.own_calls: dict[int, str] = {}  # the relay's calls (negative ids) → the context they close
        self._next_own_id = -1

    # ---- the client's side ----------------------------------------------------------------------

    def admit_call(self, call_id: int | str | None, guid: str, method: str, now: float) -> CallRefusal | None:
        """Count a client call that passed the protocol filter; a refusal means it must not be sent."""
        context = self.tree.ancestor_of_type(guid, CONTEXT)
        if method.startswith("__"):  # __waitInfo__, __abort__: notes about other calls, never answered
            self._touch(context, now)
            return None
        if call_id is not None:
            if call_id in self.in_flight or call_id in self.own_calls:
                return CallRefusal(f"call id {call_id!r} is already in flight on this connection", "call_id")
            if len(self.in_flight) >= self.max_in_flight:
                return CallRefusal(f"{len(self.in_flight)} calls in flight on this connection (the limit); wait "
                                   "for replies", "in_flight")
        if (self.tree.type_of(guid), method) in CONTEXT_OPENERS:
            if call_id is None:
                return CallRefusal("newContext without a call id", "call_id")
            slot = self.caps.reserve(self.key)
            if isinstance(slot, CapRefusal):
                self.metrics.contexts_refused[slot.scope] += 1
                return CallRefusal(slot.reason, slot.scope)
            self.pending_opens[call_id] = slot
        if call_id is not None:
            self.in_flight[call_id] = context
        self._touch(context, now)
        return None

    def own_call(self, context: str, why: str) -> int:
        """An id for the relay's own ``close`` of ``context``, closed because of ``why`` (a metrics label).
        The relay's ids are below zero, and a client call with an id in flight is refused, so the two
        never meet."""
        while self._next_own_id in self.in_flight:
            self._next_own_id -= 1
        call_id = self._next_own_id
        self._next_own_id -= 1
        self.own_calls[call_id] = context
        if context in self.contexts:
            self.contexts[context].closing = why
        return call_id

    # ---- the server's side ----------------------------------------------------------------------

    @property
    def want_result(self) -> dict[int | str, Slot]:
        return self.pending_opens

    def observe(self, message: ServerMessage, now: float) -> Seen:
        if message.call_id is not None:
            return self._reply(message, now)
        if message.method == "__create__" and (message.params or {}).get("type") == CONTEXT:
            self.tree.observe(message)
            guid = str((message.params or {}).get("guid"))
            # the reply naming it follows; a context nobody asked for is closed by the relay
            return Seen(unexpected_context=None if self.pending_opens else guid)
        for guid in self.tree.observe(message):
            self._closed(guid)
        if message.method == "close" and message.guid in self.contexts:
            self._closed(message.guid)
        return Seen()

    def _reply(self, message: ServerMessage, now: float) -> Seen:
        call_id = message.call_id
        assert call_id is not None
        if call_id in self.own_calls:
            context = self.own_calls.pop(call_id)
            if message.ok:
                self._closed(context)
            elif context in self.contexts:
                self.contexts[context].closing = None  # try again at the next check
            return Seen(swallow=True)
        context = self.in_flight.pop(call_id, None)
        slot = self.pending_opens.pop(call_id, None)
        if slot is not None:
            opened = (message.result or {}).get("context")
            guid = opened.get("guid") if isinstance(opened, dict) else None
            if message.ok and isinstance(guid, str) and self.tree.type_of(guid) == CONTEXT:
                self.contexts[guid] = OpenContext(guid, slot, now)
                self.metrics.contexts_opened += 1
            else:
                slot.release()
        self._touch(context, now)
        return Seen()

    def _closed(self, guid: str) -> None:
        context = self.contexts.pop(guid, None)
        if context is not None:
            context.slot.release()
            if context.closing is not None:
                self.metrics.contexts_reaped[context.closing] += 1

    # ---- clocks and the end ---------------------------------------------------------------------

    def _touch(self, context: str | None, now: float) -> None:
        self.last_active = now
        if context is not None and context in self.contexts:
            self.contexts[context].last_active = now

    def idle_contexts(self, now: float, limit: float) -> list[OpenContext]:
        return [c for c in self.contexts.values() if c.closing is None and now - c.last_active >= limit]

    def idle_for(self, now: float) -> float:
        return now - self.last_active

    def release_all(self) -> None:
        """The connection ended: every slot it held is free (the driver closes what was left open)."""
        for context in list(self.contexts.values()):
            context.slot.release()
        for slot in self.pending_opens.values():
            slot.release()
        self.contexts.clear()
        self.pending_opens.clear()
        self.in_flight.clear()
        self.own_calls.clear()
