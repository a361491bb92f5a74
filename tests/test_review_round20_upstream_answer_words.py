"""Review round 20 (a helper's: upstream proxy): the upstream proxy's own bytes in egresswall's 502 for a tunnel
(fast front).

README (refusals): "nothing an upstream server sent reaches a refusal's body or headers ... a response head that
cannot be parsed is a 502 saying 'egresswall could not relay the upstream's response', and the parser's words,
which quote the upstream, are in the audit record's error only". The front's CONNECT through an upstream proxy
(``proxy/upstream_connect.py`` ``_open``) puts h11's words — which quote the upstream's status line — into the
reason of the 502 it answers (``X-Egresswall-Reason`` and the body): "the upstream proxy ... failed: illegal
status line: bytearray(b'...')". mitmproxy's upstream mode answers the CONNECT 200 before it asks the upstream,
so it has no such 502 (its tunnel record names the error).
"""

from __future__ import annotations

import socket
import time

import pytest
from fake_upstream_proxy import OK, FakeUpstream
from rawclient import read_all

pytestmark = pytest.mark.integration

MARK = "UPSTREAM-CHOSEN-WORDS"


@pytest.mark.parametrize("transport", ["fast"], indirect=True)
@pytest.mark.parametrize("line", [f"HTTP/1.1 2OO {MARK}", f"{MARK} " + "x" * 3000, f"HTTP/1.1 200\x01{MARK}"])
def test_the_upstream_proxys_unparseable_answer_is_not_quoted_to_the_client(lab, start_proxy, transport,
                                                                            line) -> None:
    def answer(head: bytes, inside: bool) -> bytes:
        return (line + "\r\n\r\n").encode("latin-1") if head.startswith(b"CONNECT ") else OK

    up = FakeUpstream(answer)
    try:
        proxy = start_proxy(lab.policy_text(f"upstream:\n  proxy: http://127.0.0.1:{up.port}\n"
                                            "  resolution: upstream\n"))
        with socket.create_connection((proxy.host, proxy.port), timeout=5) as sock:
            sock.sendall(f"CONNECT public.lab.example:{lab.public_tls.port} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            got = read_all(sock, 5)
        time.sleep(0.2)
        assert got.startswith(b"HTTP/1.1 502"), got[:200]
        closed = [r for r in proxy.audit() if r["event"] == "tunnel"]
        assert closed and MARK in (closed[0]["error"] or ""), closed  # the record keeps the upstream's words
        head = got.split(b"\r\n\r\n")[0]
        print(f"\n{len(head)} byte head: {head[:400]!r}")
        assert MARK.encode() not in got, got[:600]  # ...the client's answer does not
        assert b"X-Egresswall-Rule: connect:upstream" in got  # and its hint names the upstream, not an address
        assert b"the upstream proxy egresswall forwards through did not answer or refused" in got
    finally:
        up.close()


@pytest.mark.parametrize("transport", ["fast", "mitmproxy"], indirect=True)
def test_a_plain_request_through_an_upstream_that_is_down_names_the_upstream(lab, start_proxy, transport) -> None:
    """A newcomer's check (round 20): a plain request through a dead upstream got rule connect and the hint 'the
    checked address did not accept the connection', though nothing connected to was checked (mitmproxy's path
    carries plain HTTP with an upstream, on both transports)."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    proxy = start_proxy(lab.policy_text(f"upstream:\n  proxy: http://127.0.0.1:{port}\n  resolution: upstream\n"))
    plain = proxy.raw(f"GET http://public.lab.example:{lab.public.port}/x HTTP/1.1\r\nHost: public.lab.example:"
                      f"{lab.public.port}\r\nConnection: close\r\n\r\n".encode())
    assert plain.startswith(b"HTTP/1.1 502"), plain
    assert b"X-Egresswall-Rule: connect:upstream" in plain and b"checked address" not in plain, plain


@pytest.mark.parametrize("transport", ["fast"], indirect=True)
def test_an_upstream_that_refuses_egresswalls_credentials_gets_a_hint_naming_them(lab, start_proxy, transport) -> None:
    up = FakeUpstream(lambda head, inside: b"HTTP/1.1 407 Proxy Authentication Required\r\nContent-Length: 0\r\n\r\n")
    try:
        proxy = start_proxy(lab.policy_text(f"upstream:\n  proxy: http://127.0.0.1:{up.port}\n"
                                            "  resolution: upstream\n"))
        with socket.create_connection((proxy.host, proxy.port), timeout=5) as sock:
            sock.sendall(f"CONNECT public.lab.example:{lab.public_tls.port} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            got = read_all(sock, 5)
        assert got.startswith(b"HTTP/1.1 502") and b"check upstream.credentials_file" in got, got[:600]
    finally:
        up.close()
