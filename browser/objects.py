"""The objects one Playwright connection holds, as its server announced them, and the one reader of
the server's messages.

Playwright's server creates every object it hands a client with a ``__create__`` message on the
parent's guid (``{"guid": parent, "method": "__create__", "params": {"type", "initializer", "guid"}}``),
moves one with ``__adopt__`` and drops one (with everything under it) with ``__dispose__``. The protocol
filter needs each object's type; the context accounting needs each object's context. Both read this
tree, so a connection keeps one.

Replies (``{"id": N, "result": ...}``) can be megabytes (screenshots, page contents); they are read
by their prefix, never parsed whole, unless the relay asked to see the result (``want_result``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

# How Playwright's dispatcher serialises (JSON.stringify keeps key order): a reply starts with its
# id, an event with its guid and method. Anything else is parsed whole.
_REPLY_PREFIX = re.compile(r'\{"id":(-?\d{1,15}|"[^"\\]{0,200}")[,}]')  # Python's client: "abcd@5", JS: 5
_EVENT_PREFIX = re.compile(r'\{"guid":"([^"\\]{0,300})","method":"([A-Za-z_]{1,80})"')
_PARSED_EVENTS = ("__create__", "__adopt__")
MAX_DEPTH = 64  # parent links followed before giving up (the server's trees are a handful deep)


@dataclass(frozen=True)
class ServerMessage:
    """What the relay needs from one message of the server: a reply (``call_id``), or an event on
    ``guid`` (``method``, with ``params`` only for the events that shape the tree)."""

    call_id: int | str | None = None
    ok: bool = True  # a reply without an error
    result: dict[str, Any] | None = None  # only when asked for
    guid: str | None = None
    method: str | None = None
    params: dict[str, Any] | None = None


def read_server_message(text: str | bytes, want_result: Container[int | str] = ()) -> ServerMessage:
    """Classify one message of the server; replies to ids in ``want_result`` are parsed whole."""
    if isinstance(text, bytes):
        return ServerMessage()
    head = text[:400]
    reply = _REPLY_PREFIX.match(head)
    if reply:
        raw = reply.group(1)
        call_id: int | str = raw[1:-1] if raw.startswith('"') else int(raw)
        if call_id not in want_result:
            return ServerMessage(call_id=call_id, ok=not head.startswith('"error":', reply.end()))
        message = _loads(text)
        result = message.get("result") if isinstance(message.get("result"), dict) else None
        return ServerMessage(call_id=call_id, ok="error" not in message, result=result)
    event = _EVENT_PREFIX.match(head)
    if event and event.group(2) not in _PARSED_EVENTS:
        return ServerMessage(guid=event.group(1), method=event.group(2))
    message = _loads(text)
    if isinstance(message.get("id"), int | str) and not isinstance(message.get("id"), bool):
        result = message.get("result") if isinstance(message.get("result"), dict) else None
        return ServerMessage(call_id=message["id"], ok="error" not in message,
                             result=result if message["id"] in want_result else None)
    guid, method, params = message.get("guid"), message.get("method"), message.get("params")
    if not isinstance(guid, str) or not isinstance(method, str):
        return ServerMessage()
    return ServerMessage(guid=guid, method=method, params=params if isinstance(params, dict) else {})


def _loads(text: str) -> dict[str, Any]:
    try:
        message = json.loads(text)
    except ValueError:
        return {}
    return message if isinstance(message, dict) else {}


class ObjectTree:
    """guid → type and parent, for the objects of one connection (the root ``""`` is the connection)."""

    def __init__(self) -> None:
        self.types: dict[str, str] = {"": "Root"}
        self.parents: dict[str, str] = {}
        self._children: dict[str, set[str]] = {}

    def __len__(self) -> int:
        return len(self.types)

    def observe(self, message: ServerMessage) -> list[str]:
        """Apply a server event; returns the guids it removed (a dispose takes a whole subtree)."""
        params = message.params or {}
        if message.method == "__create__" and message.guid is not None and isinstance(params.get("guid"), str):
            self.create(params["guid"], str(params.get("type")), message.guid)
        elif message.method == "__adopt__" and message.guid is not None and isinstance(params.get("guid"), str):
            self.adopt(params["guid"], message.guid)
        elif message.method == "__dispose__" and message.guid:
            return self.dispose(message.guid)
        return []

    def create(self, guid: str, kind: str, parent: str) -> None:
        if guid == "" or guid == parent:
            return  # the root is not created, and nothing is its own parent
        if guid in self.types:
            self.dispose(guid)  # a reused guid starts a new object (and drops what was under the old one)
        known_parent = parent in self.types
        self.types[guid] = kind
        if known_parent:
            self.parents[guid] = parent
            self._children.setdefault(parent, set()).add(guid)

    def adopt(self, guid: str, parent: str) -> None:
        if guid not in self.types or parent not in self.types or self._is_ancestor(guid, parent):
            return
        old = self.parents.get(guid)
        if old is not None:
            self._children.get(old, set()).discard(guid)
        self.parents[guid] = parent
        self._children.setdefault(parent, set()).add(guid)

    def dispose(self, guid: str) -> list[str]:
        if guid not in self.types or guid == "":
            return []
        removed, stack = [], [guid]
        while stack:
            current = stack.pop()
            if self.types.pop(current, None) is None:
                continue
            removed.append(current)
            stack.extend(self._children.pop(current, ()))
            parent = self.parents.pop(current, None)
            if parent is not None and parent in self._children:
                self._children[parent].discard(current)
        return removed

    def type_of(self, guid: str) -> str | None:
        return self.types.get(guid)

    def ancestor_of_type(self, guid: str, kind: str) -> str | None:
        """The nearest object of type ``kind`` at or above ``guid`` (None when there is none)."""
        current: str | None = guid
        for _ in range(MAX_DEPTH):
            if current is None:
                return None
            if self.types.get(current) == kind:
                return current
            current = self.parents.get(current)
        return None

    def _is_ancestor(self, guid: str, of: str) -> bool:
        current: str | None = of
        for _ in range(MAX_DEPTH):
            if current is None:
                return False
            if current == guid:
                return True
            current = self.parents.get(current)
        return True  # too deep to tell: refuse the move
