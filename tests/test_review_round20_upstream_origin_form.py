"""Review round 20 (a helper's: upstream proxy): an origin-form request to egresswall goes to the upstream proxy
in origin form.

README (*Chaining to an upstream proxy*): "Plain HTTP goes to the upstream in absolute form ... The upstream
is asked for the normalised name egresswall decided (A-label, lower case, no trailing dot)". A client may send
a plain request to egresswall in origin form (``GET /path`` with a ``Host`` header): without an upstream,
egresswall decides it on the Host header and forwards it to the pinned address. With an upstream, mitmproxy's
upstream mode sends it to the upstream proxy as it came: origin form, the client's Host spelling, and without
egresswall's ``Proxy-Authorization``. ``proxy/addons/upstream.py`` ``UpstreamForwarding.requestheaders`` reads
"no authority" as "inside a tunnel" and leaves it alone.

An origin-form request is, to a forward proxy, a request for the proxy itself: squid answers its own internal
objects to it (``/squid-internal-mgr/...``, its cache manager; Debian's default squid.conf has
``http_access allow localhost manager``), which egresswall records as a request to the host it decided.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from fake_upstream_proxy import FakeUpstream, header
from labnet import PUBLIC_IP
from proxyproc import TRANSPORTS
from test_upstream_proxy import ONLY_AUTHED, credentials_file, start_squid_with_auth

pytestmark = pytest.mark.integration

# Debian's default order: the cache manager from localhost, then the proxy's own users.
MANAGER_FIRST = "http_access allow localhost manager\nhttp_access deny manager\n" + ONLY_AUTHED


@pytest.fixture(scope="module")
def squid_with_manager():
    yield from start_squid_with_auth(
        "ew-squid-r20-", f"{PUBLIC_IP} public.lab.example\n127.0.0.1 squid-r20.lab.example\n", MANAGER_FIRST,
        extra="visible_hostname squid-r20.lab.example\n")


def _policy(lab, port: int, credentials: Path) -> str:
    return lab.policy_text(f"upstream:\n  proxy: http://127.0.0.1:{port}\n  resolution: upstream\n"
                           f"  credentials_file: {credentials}\n")


@pytest.mark.parametrize("transport", list(TRANSPORTS), indirect=True)
def test_an_origin_form_request_reaches_squids_cache_manager(lab, squid_with_manager, start_proxy, tmp_path,
                                                             transport) -> None:
    """egresswall decides GET http://public.lab.example:PORT/squid-internal-mgr/info (allowed by default) and
    squid serves its own cache manager page to it: a request egresswall never decided reached the upstream."""
    proxy = start_proxy(_policy(lab, squid_with_manager.port, credentials_file(tmp_path)))
    answer = proxy.raw((f"GET /squid-internal-mgr/info HTTP/1.1\r\nHost: public.lab.example:{lab.public.port}\r\n"
                        "Connection: close\r\n\r\n").encode())
    decided = [r for r in proxy.decisions() if r["path"] == "/squid-internal-mgr/info"]
    assert decided and decided[0]["host"] == "public.lab.example", decided  # what egresswall decided and records
    # What must hold: the upstream is asked for http://public.lab.example:PORT/squid-internal-mgr/info (absolute
    # form, as README says), which squid fetches from the lab origin (404 there) — never squid's own page.
    assert b"Squid Object Cache" not in answer and b"Cache Manager" not in answer, answer[:600]


@pytest.mark.parametrize("transport", list(TRANSPORTS), indirect=True)
def test_an_origin_form_request_goes_to_the_upstream_in_absolute_form_with_the_decided_name(lab, start_proxy,
                                                                                              tmp_path,
                                                                                              transport) -> None:
    """A hostile upstream on loopback records what it is asked."""
    up = FakeUpstream()
    try:
        proxy = start_proxy(_policy(lab, up.port, credentials_file(tmp_path)))
        answer = proxy.raw((f"GET /n HTTP/1.1\r\nHost: PUBLIC.Lab.Example.:{lab.public.port}\r\n"
                            "Connection: close\r\n\r\n").encode())
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
        time.sleep(0.2)
        (_, head), = up.heads
        line = head.split(b"\r\n", 1)[0].decode()
        assert line == f"GET http://public.lab.example:{lab.public.port}/n HTTP/1.1", head  # today: GET /n HTTP/1.1
        assert header(head, "proxy-authorization"), head  # today: none (the request came without egresswall's)
    finally:
        up.close()
