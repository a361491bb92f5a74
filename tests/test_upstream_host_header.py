"""A plain request through an upstream proxy names the decided host in its Host header too, not only in its
request line (an open item of review round 20): the upstream is asked for exactly the name egresswall checked
(README, *Chaining to an upstream proxy*: "The upstream is asked for the normalised name egresswall decided
(A-label, lower case, no trailing dot)"). An upstream that routes by Host, not by the absolute URI, would
otherwise look up the client's spelling."""

from __future__ import annotations

import pytest
from fake_upstream_proxy import FakeUpstream, header, upstream_policy
from proxyproc import TRANSPORTS

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("transport", list(TRANSPORTS), indirect=True)
@pytest.mark.parametrize("spelling", ["PUBLIC.Lab.Example", "public.lab.example."])
def test_the_upstream_gets_the_decided_host_in_the_host_header(lab, start_proxy, transport, spelling) -> None:
    up = FakeUpstream()
    try:
        proxy = start_proxy(upstream_policy(lab, up))
        port = lab.public.port
        answer = proxy.raw((f"GET http://{spelling}:{port}/host HTTP/1.1\r\nHost: {spelling}:{port}\r\n"
                            "Connection: close\r\n\r\n").encode())
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
        heads = [head for _, head in up.heads if head.startswith(b"GET ")]
        assert heads, up.heads
        assert heads[0].split(b"\r\n", 1)[0] == f"GET http://public.lab.example:{port}/host HTTP/1.1".encode()
        assert header(heads[0], "host") == [f"public.lab.example:{port}"], heads[0]
    finally:
        up.close()
