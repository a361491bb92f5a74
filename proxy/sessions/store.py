"""Where sessions and their usage counters live: the interface, the record codec, and the in-memory store.

Every store answers the same questions (``SessionStore``). ``charge`` is the one that must be atomic: it
reads the usage, asks the pure ``judge_budgets`` (policy/sessions.py) whether one more request fits, and
counts it only if so — in memory that is one stretch of code without an ``await`` (asyncio runs one at a
time); in Redis (``proxy/sessions/redis_store.py``) a WATCH/MULTI transaction that is retried when another
process counted in between. A store that cannot be reached raises ``StoreUnavailable``: the gate refuses
session requests then (fail closed), and /readyz says so.

A session is kept ``RETAIN`` seconds past its expiry so that a late request is told ``session:expired``
rather than "no such session".
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from policy.decision import Verdict
from policy.sessions import ENDED, Session, Usage, judge_budgets, parse_session_spec, refused

RETAIN = 3600.0


class StoreUnavailable(Exception):
    """The store could not be asked (connection refused, timeout): ``str()`` says what happened."""


class SessionStore(Protocol):
    kind: str  # "memory" | "redis", for /readyz and the start-up line

    @property
    def healthy(self) -> bool: ...
    async def put(self, session: Session) -> None: ...
    async def get(self, session_id: str) -> Session | None: ...
    async def delete(self, session_id: str) -> bool: ...
    async def set_expiry(self, session_id: str, expires: float) -> Session | None: ...
    async def usage(self, session_id: str) -> Usage: ...
    # ``sent``: the request's bytes known at admission (its head and declared body), judged and charged with it,
    # so requests admitted at the same moment are judged on each other's bytes.
    async def charge(self, session: Session, host: str, sent: int | None,
                     role: str | None = None) -> Verdict | None: ...
    # Whether ``charge`` would refuse one more request now, without counting it: asked before the name is looked
    # up, so a session past a budget makes no lookup (a wildcard grant's names would carry data to DNS).
    async def judge(self, session: Session, host: str, sent: int | None,
                    role: str | None = None) -> Verdict | None: ...
    # ``up`` more bytes sent, charged only if the total stays within ``budget`` (atomically): None when charged,
    # else the total they would have made.
    async def charge_bytes(self, session_id: str, up: int, budget: int) -> int | None: ...
    async def add_bytes(self, session_id: str, up: int, down: int) -> None: ...
    async def ids(self, now: float) -> list[str]: ...
    async def ping(self) -> bool: ...
    async def close(self) -> None: ...


def session_record(session: Session) -> str:
    """A session as the stores keep it: JSON with the secret's digest, never the secret."""
    return json.dumps({"id": session.id, "secret_digest": session.secret_digest, "created": session.created,
                       "expires": session.expires, "spec": session.spec.as_json()}, sort_keys=True)


def session_from_record(text: str | bytes) -> Session:
    """The inverse of ``session_record``; the grants are parsed again by the same rules they were made with."""
    data: dict[str, Any] = json.loads(text)
    spec = parse_session_spec({"grants": data["spec"]["grants"], "budgets": data["spec"]["budgets"],
                               "ttl": data["spec"]["ttl"]})
    if not (isinstance(data["id"], str) and isinstance(data["secret_digest"], str)):
        raise ValueError("the record's id and secret digest are not text")
    return Session(data["id"], data["secret_digest"], _time(data["created"]), _time(data["expires"]), spec)


def _time(value: object) -> float:
    """A record's time: a finite number of seconds. NaN is never "at or past" an expiry, so a record saying it
    would be a session that never expires (review round 23); a string or a bool is no time either."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"the record's time {value!r} is not a finite number")
    return float(value)


@dataclass
class _Entry:
    session: Session
    usage: Usage = Usage()
    hosts: set[str] = field(default_factory=set)


class MemoryStore:
    """One process's sessions (the default). Lost at restart; not shared with other workers."""

    kind = "memory"

    def __init__(self, clock=None) -> None:
        import time

        self._clock = clock or time.time
        self._entries: dict[str, _Entry] = {}

    @property
    def healthy(self) -> bool:
        return True

    def _live(self, session_id: str) -> _Entry | None:
        entry = self._entries.get(session_id)
        if entry is not None and self._clock() >= entry.session.expires + RETAIN:
            del self._entries[session_id]
            return None
        return entry

    async def put(self, session: Session) -> None:
        self._entries[session.id] = _Entry(session)

    async def get(self, session_id: str) -> Session | None:
        entry = self._live(session_id)
        return entry.session if entry else None

    async def delete(self, session_id: str) -> bool:
        return self._entries.pop(session_id, None) is not None

    async def set_expiry(self, session_id: str, expires: float) -> Session | None:
        entry = self._live(session_id)
        if entry is None:
            return None
        from dataclasses import replace

        entry.session = replace(entry.session, expires=expires)
        return entry.session

    async def usage(self, session_id: str) -> Usage:
        entry = self._live(session_id)
        return entry.usage if entry else Usage()

    async def charge(self, session: Session, host: str, sent: int | None,
                     role: str | None = None) -> Verdict | None:
        refusal = await self.judge(session, host, sent, role)  # no await inside: judged and counted at once
        entry = self._live(session.id)
        if refusal is None and entry is not None:
            entry.hosts.add(host)
            u = entry.usage
            entry.usage = Usage(u.requests + 1, len(entry.hosts), u.request_bytes + (sent or 0), u.response_bytes)
        return refusal

    async def judge(self, session: Session, host: str, sent: int | None,
                    role: str | None = None) -> Verdict | None:
        entry = self._live(session.id)
        if entry is None:  # ended (DELETE) between its lookup and now
            return refused(ENDED, f"session {session.id} has ended", session, role)
        return judge_budgets(session, entry.usage, host in entry.hosts, sent, role)

    async def charge_bytes(self, session_id: str, up: int, budget: int) -> int | None:
        entry = self._live(session_id)
        u = entry.usage if entry is not None else Usage()
        if entry is None or u.request_bytes + up > budget:
            return u.request_bytes + up
        entry.usage = Usage(u.requests, u.hosts, u.request_bytes + up, u.response_bytes)
        return None

    async def add_bytes(self, session_id: str, up: int, down: int) -> None:
        entry = self._live(session_id)
        if entry is not None:
            u = entry.usage
            entry.usage = Usage(u.requests, u.hosts, u.request_bytes + up, u.response_bytes + down)

    async def ids(self, now: float) -> list[str]:
        return [sid for sid in list(self._entries) if self._live(sid) is not None and
                now < self._entries[sid].session.expires]

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        self._entries.clear()


def redacted(url: str) -> str:
    """The store's URL for a message: where redis-py connects (host, port and database, or a socket's path), read by
    redis-py's own parser, and nothing else. A password can sit in the userinfo (unix:// too), in the query
    (``?password=``), or hold a '#' or '@' that no split of the text tells from the host: so nothing is cut out
    of the text, the message is rebuilt from the parts that are never secret (review round 19)."""
    if url == "memory":
        return url
    scheme = url.partition("://")[0] if "://" in url else ""
    if scheme not in ("redis", "rediss", "unix"):
        return "(not a store URL)"
    from redis.connection import parse_url  # only a deployment that names a Redis store imports its client

    try:
        parts = parse_url(url)
    except (ValueError, TypeError):
        return f"{scheme}://(a URL redis-py cannot read)"
    db = parts.get("db")
    if "path" in parts:
        return f"unix://{parts['path']}" + (f"?db={db}" if db is not None else "")
    host = parts.get("host") or ""
    shown = f"[{host}]" if ":" in host else host
    port = f":{parts['port']}" if parts.get("port") is not None else ""
    return f"{scheme}://{shown}{port}" + (f"/{db}" if db is not None else "")
