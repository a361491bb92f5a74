"""``--session-store``: which URLs are accepted, and where a Redis store is reached (egresswall's own endpoint)."""

from __future__ import annotations

import pytest

from proxy.sessions.store_url import check_store_url, store_endpoint


@pytest.mark.parametrize(("url", "endpoint"), [
    ("redis://127.0.0.1:6380/0", ("127.0.0.1", 6380)),
    ("redis://:secret@redis:7000/2", ("redis", 7000)),
    ("rediss://store.internal/0", ("store.internal", 6379)),
    ("redis://[2001:db8::5]:6379/1", ("2001:db8::5", 6379)),
    ("redis://REDIS.Example/0", ("redis.example", 6379)),
    ("unix:///run/redis.sock", None),
    ("memory", None),
    (None, None),
])
def test_the_store_endpoint_is_where_its_client_connects(url, endpoint):
    assert store_endpoint(url) == endpoint


@pytest.mark.parametrize("url", ["redis://", "http://redis:6379/0", "redis://host:6379/db", "redis"])
def test_a_store_url_that_is_not_redis_or_memory_is_refused_with_what_was_expected(url):
    with pytest.raises(ValueError, match="expected"):
        check_store_url(url)
