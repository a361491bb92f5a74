"""The shared session store: Redis (``--session-store redis://HOST:PORT/DB``), for ``--workers N`` and replicas.

Keys (``egresswall:`` prefix), each expiring ``RETAIN`` seconds after the session does:

* ``session:<id>``: the session record (``store.session_record``: the secret's digest, never the secret);
* ``session:<id>:usage``: a hash of counters (requests, request_bytes, response_bytes);
* ``session:<id>:hosts``: the set of distinct hosts reached;
* ``sessions``: the set of ids, for listing (pruned of ids whose record is gone).

``charge`` is atomic across processes: WATCH the usage and hosts keys, read them, judge with the pure
``judge_budgets``, then count in a MULTI/EXEC; when another process counted in between, EXEC fails and the
charge is judged again on the new counts. So a budget of N requests admits exactly N, whichever process
each arrives at. Every Redis error is ``StoreUnavailable`` (fail closed).
"""

from __future__ import annotations

import logging
import math
import time

import redis.asyncio as aioredis
from redis.exceptions import RedisError, WatchError

from policy.decision import Verdict
from policy.sessions import ENDED, Session, Usage, judge_budgets, refused

from .store import RETAIN, StoreUnavailable, redacted, session_from_record, session_record

PREFIX = "egresswall:"
log = logging.getLogger("egresswall.sessions")
TIMEOUT = 1.0  # seconds for one Redis round trip: a request waits at most this long before it is refused
MAX_RETRIES = 50  # charge attempts under contention before giving up (fail closed)


class RedisStore:
    kind = "redis"

    def __init__(self, url: str) -> None:
        self.url = url
        self.client = aioredis.from_url(url, socket_timeout=TIMEOUT, socket_connect_timeout=TIMEOUT,
                                        health_check_interval=0)
        self._healthy = True

    @property
    def healthy(self) -> bool:
        return self._healthy

    def _key(self, session_id: str, part: str = "") -> str:
        return f"{PREFIX}session:{session_id}" + (f":{part}" if part else "")

    async def _call(self, job):
        try:
            result = await job
        except (TimeoutError, RedisError, OSError) as err:
            raise self._unreachable(err) from None
        self._healthy = True
        return result

    def _unreachable(self, err: Exception) -> StoreUnavailable:
        """The failure for the refusal, which a proxy client reads (its 503 and X-Egresswall-Reason) and the audit
        record keeps: the kind of error only. Where the store is, and redis-py's words (which name its address),
        go to the operator's log, once each time the store stops answering (review round 19: a password given as
        ?password= was in every refusal)."""
        if self._healthy:
            log.warning("the session store %s cannot be reached: %s: %s", self.safe_url, type(err).__name__,
                        str(err)[:300])
        self._healthy = False
        return StoreUnavailable(f"the session store cannot be reached ({type(err).__name__})")

    def _unreadable(self, what: str, err: Exception | None = None) -> StoreUnavailable:
        """The store answered, but with something egresswall cannot read (not written by egresswall, or damaged):
        no session is judged on it, so the request is refused as if the store could not be reached (fail closed;
        review round 23: a record that was not JSON raised past the decision, and mitmproxy let the request on)."""
        log.warning("the session store %s holds %s that egresswall cannot read%s", self.safe_url, what,
                    f": {type(err).__name__}: {str(err)[:200]}" if err is not None else "")
        return StoreUnavailable(f"the session store holds {what} that egresswall cannot read")

    def _count(self, session_id: str, value: object) -> int:
        """A usage counter as the store answered it: absent (0) or a whole number that is not negative."""
        if value is None:
            return 0
        try:
            number = int(value)  # type: ignore[call-overload]
        except (TypeError, ValueError):
            number = -1
        if number < 0:
            raise self._unreadable(f"session {session_id}'s usage counters")
        return number

    def _usage(self, session_id: str, requests: object, hosts: object, up: object, down: object) -> Usage:
        return Usage(self._count(session_id, requests), self._count(session_id, hosts),
                     self._count(session_id, up), self._count(session_id, down))

    @property
    def safe_url(self) -> str:
        """The URL without a password or query, for messages."""
        return redacted(self.url)

    async def put(self, session: Session) -> None:
        at = _expire_at(session.expires)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.set(self._key(session.id), session_record(session), pxat=at)
            pipe.delete(self._key(session.id, "usage"), self._key(session.id, "hosts"))
            pipe.sadd(f"{PREFIX}sessions", session.id)
            await self._call(pipe.execute())

    async def get(self, session_id: str) -> Session | None:
        raw = await self._call(self.client.get(self._key(session_id)))
        if raw is None:
            return None
        try:
            session = session_from_record(raw)
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise self._unreadable(f"session {session_id}'s record", err) from None
        if session.id != session_id:  # another session's record under this id: its secret must not open this one
            raise self._unreadable(f"session {session_id}'s record (it names session {session.id[:40]!r})")
        return session

    async def delete(self, session_id: str) -> bool:
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(self._key(session_id))
            pipe.delete(self._key(session_id, "usage"), self._key(session_id, "hosts"))
            pipe.srem(f"{PREFIX}sessions", session_id)
            removed, _, _ = await self._call(pipe.execute())
        return bool(removed)

    async def set_expiry(self, session_id: str, expires: float) -> Session | None:
        from dataclasses import replace

        session = await self.get(session_id)
        if session is None:
            return None
        session = replace(session, expires=expires)
        at = _expire_at(expires)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.set(self._key(session_id), session_record(session), pxat=at, xx=True)
            pipe.pexpireat(self._key(session_id, "usage"), at)
            pipe.pexpireat(self._key(session_id, "hosts"), at)
            stored, _, _ = await self._call(pipe.execute())
        return session if stored else None

    async def usage(self, session_id: str) -> Usage:
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.hmget(self._key(session_id, "usage"), "requests", "request_bytes", "response_bytes")
            pipe.scard(self._key(session_id, "hosts"))
            (requests, up, down), hosts = await self._call(pipe.execute())
        return self._usage(session_id, requests, hosts, up, down)

    async def charge(self, session: Session, host: str, sent: int | None,
                     role: str | None = None) -> Verdict | None:
        usage_key, hosts_key, record_key = (self._key(session.id, "usage"), self._key(session.id, "hosts"),
                                            self._key(session.id))

        async def attempt(pipe) -> tuple[bool, Verdict | None]:
            # The record's own expiry, not the one ``session`` was read with: an extension since (PATCH) moved
            # it, and counters expiring at the old one would let the budgets start again from nothing while the
            # session lives on.
            remaining = await self._call(pipe.pttl(record_key))
            if remaining == -2:  # no such key
                return False, refused(ENDED, f"session {session.id} has ended", session, role)
            at = max(_expire_at(session.expires), math.ceil(time.time() * 1000) + max(remaining, 0))
            requests, up, down = await self._call(pipe.hmget(usage_key, "requests", "request_bytes",
                                                             "response_bytes"))
            seen = await self._call(pipe.sismember(hosts_key, host))
            hosts = await self._call(pipe.scard(hosts_key))
            usage = self._usage(session.id, requests, hosts, up, down)
            refusal = judge_budgets(session, usage, bool(seen), sent, role)
            if refusal is not None:
                return False, refusal
            pipe.multi()
            pipe.hincrby(usage_key, "requests", 1)
            if sent:
                pipe.hincrby(usage_key, "request_bytes", sent)
            pipe.sadd(hosts_key, host)
            pipe.pexpireat(usage_key, at)
            pipe.pexpireat(hosts_key, at)
            return True, None

        return await self._watched((usage_key, hosts_key, record_key), attempt)

    async def judge(self, session: Session, host: str, sent: int | None,
                    role: str | None = None) -> Verdict | None:
        """``charge``'s judgement on the counts as they are, in one round trip, counting nothing (the charge
        after the decision is the one that counts, atomically)."""
        usage_key, hosts_key = self._key(session.id, "usage"), self._key(session.id, "hosts")
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.exists(self._key(session.id))
            pipe.hmget(usage_key, "requests", "request_bytes", "response_bytes")
            pipe.sismember(hosts_key, host)
            pipe.scard(hosts_key)
            exists, (requests, up, down), seen, hosts = await self._call(pipe.execute())
        if not exists:
            return refused(ENDED, f"session {session.id} has ended", session, role)
        usage = self._usage(session.id, requests, hosts, up, down)
        return judge_budgets(session, usage, bool(seen), sent, role)

    async def charge_bytes(self, session_id: str, up: int, budget: int) -> int | None:
        key = self._key(session_id, "usage")

        async def attempt(pipe) -> tuple[bool, int | None]:
            total = self._count(session_id, await self._call(pipe.hget(key, "request_bytes"))) + up
            if total > budget:
                return False, total
            pipe.multi()
            pipe.hincrby(key, "request_bytes", up)
            pipe.pexpire(key, int(RETAIN * 1000), nx=True)
            return True, None

        return await self._watched((key,), attempt)

    async def _watched(self, keys: tuple[str, ...], attempt):
        """An optimistic transaction: ``attempt`` reads the watched ``keys`` and either queues its writes
        ((True, result): they are executed) or decides without writing ((False, result)). Another process's
        write to the keys in between runs it again on the new values (WATCH), up to MAX_RETRIES times."""
        for _ in range(MAX_RETRIES):
            async with self.client.pipeline(transaction=True) as pipe:
                try:
                    await self._call(pipe.watch(*keys))
                    write, result = await attempt(pipe)
                    if not write:
                        await pipe.reset()
                        return result
                    await pipe.execute()
                    self._healthy = True
                    return result
                except WatchError:
                    continue  # another process counted first: judge again on the new counts
                except (TimeoutError, RedisError, OSError) as err:
                    raise self._unreachable(err) from None
        raise StoreUnavailable(f"the session store stayed contended for {MAX_RETRIES} attempts")

    async def add_bytes(self, session_id: str, up: int, down: int) -> None:
        if not (up or down):
            return
        key = self._key(session_id, "usage")
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hincrby(key, "request_bytes", up)
            pipe.hincrby(key, "response_bytes", down)
            # The charge that admitted the request set the counters' expiry; a count arriving after the session
            # ended recreates the hash, which must not live for ever.
            pipe.pexpire(key, int(RETAIN * 1000), nx=True)
            await self._call(pipe.execute())

    async def ids(self, now: float) -> list[str]:
        try:
            found = sorted(m.decode() for m in await self._call(self.client.smembers(f"{PREFIX}sessions")))
        except UnicodeDecodeError as err:
            raise self._unreadable("a session id in its list", err) from None
        live = []
        for session_id in found:
            session = await self.get(session_id)
            if session is None:
                await self._call(self.client.srem(f"{PREFIX}sessions", session_id))
            elif now < session.expires:
                live.append(session_id)
        return live

    async def ping(self) -> bool:
        """Whether the store answers PING with PONG (redis-py's answer: anything else is False, not ready)."""
        try:
            return await self._call(self.client.ping()) is True
        except StoreUnavailable:
            return False

    async def close(self) -> None:
        await self.client.aclose()


def _expire_at(expires: float) -> int:
    return math.ceil((expires + RETAIN) * 1000)
