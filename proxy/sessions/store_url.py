"""Which store ``--session-store`` names: ``memory`` (the default) or a Redis URL (``redis_store.py``)."""

from __future__ import annotations

from urllib.parse import urlsplit

from .store import MemoryStore, SessionStore, redacted

__all__ = ["check_store_url", "open_store", "redacted", "store_endpoint"]

REDIS_PORT = 6379


def check_store_url(text: str) -> str:
    """``memory`` or ``redis://[:password@]HOST:PORT[/DB]`` (``rediss://`` for TLS, ``unix:///path``);
    ValueError with what was expected."""
    if text == "memory":
        return text
    scheme, sep, rest = text.partition("://")
    if scheme not in ("redis", "rediss", "unix") or not sep or not rest:
        raise ValueError("expected 'memory' or redis://HOST:PORT/DB (rediss:// for TLS, unix:///path/to/socket)")
    if scheme != "unix":
        where = rest.rpartition("@")[2].split("/", 1)
        if not where[0] or (len(where) > 1 and where[1] and not where[1].isdigit()):
            raise ValueError("expected redis://HOST:PORT/DB with a numeric database")
    return text


def open_store(url: str | None) -> SessionStore:
    if url in (None, "memory"):
        return MemoryStore()
    from .redis_store import RedisStore  # only a deployment that asks for Redis imports its client

    return RedisStore(check_store_url(url))


def store_endpoint(url: str | None) -> tuple[str, int] | None:
    """(host, port) a Redis store is reached at over TCP — egresswall's own endpoint, which no client may
    reach through the proxy (it could grant itself sessions) — or None (memory, a unix socket)."""
    if url in (None, "memory") or url.startswith("unix://"):
        return None
    parts = urlsplit(check_store_url(url))
    if not parts.hostname:
        return None
    return parts.hostname, parts.port or REDIS_PORT
