"""Which store ``--session-store`` names: ``memory`` (the default) or a Redis URL (``redis_store.py``)."""

from __future__ import annotations

from urllib.parse import urlsplit

from .store import MemoryStore, SessionStore

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
