"""Plain requests through an upstream proxy (two open items of review round 20).

The Host header names the decided host, as the request line does: the upstream is asked for exactly the name
egresswall checked (README, *Chaining to an upstream proxy*: "The upstream is asked for the normalised name
egresswall decided (A-label, lower case, no trailing dot)"); an upstream that routes by Host, not by the absolute
URI, would otherwise look up the client's spelling. And a TRACE carries no credentials."""

from __future__ import annotations

import pytest
from fake_upstream_proxy import FakeUpstream, creds_file, header, upstream_policy
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


@pytest.mark.parametrize("transport", list(TRANSPORTS), indirect=True)
@pytest.mark.parametrize("method", ["TRACE", "trace"])
def test_a_trace_goes_to_the_upstream_without_its_credentials(lab, start_proxy, tmp_path, transport, method) -> None:
    """RFC 9110 9.3.8: a client must not send stored credentials in a TRACE, whose answer echoes the request (an
    open item of review round 20: an upstream answering a TRACE at Max-Forwards: 0 itself, echoing it unmasked,
    showed egresswall's upstream password to the client). A GET on the same proxy still carries them."""
    up = FakeUpstream()
    try:
        proxy = start_proxy(upstream_policy(lab, up, creds=creds_file(tmp_path)))
        port = lab.public.port
        for verb in (method, "GET"):
            proxy.raw((f"{verb} http://public.lab.example:{port}/t HTTP/1.1\r\nHost: public.lab.example:{port}\r\n"
                       "Max-Forwards: 0\r\nConnection: close\r\n\r\n").encode())
        heads = {head.split(b" ", 1)[0].upper(): head for _, head in up.heads}
        assert set(heads) == {b"TRACE", b"GET"}, up.heads
        assert header(heads[b"TRACE"], "proxy-authorization") == [], heads[b"TRACE"]
        assert header(heads[b"GET"], "proxy-authorization"), heads[b"GET"]
    finally:
        up.close()
