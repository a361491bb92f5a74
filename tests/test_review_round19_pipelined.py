"""Review round 19 (h3): a ClientHello sent in the same write as the CONNECT head (and after blank lines, or
split with part in the CONNECT's write) is judged the same as one sent after the 200, on both transports."""

from __future__ import annotations

import socket
import time

import pytest
from proxyproc import both_transports
from rawclient import read_all
from tls_build import real_client_hello

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("internal_saw_nothing")]


def _refusals(proxy, rule_prefix="tls:", wait: float = 5) -> list[dict]:
    deadline = time.monotonic() + wait
    while True:
        found = [r for r in proxy.audit() if r.get("verdict") == "refuse" and r["rule"].startswith(rule_prefix)]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


@both_transports
@pytest.mark.parametrize("between", [b"", b"\r\n", b"\r\n\r\n", b"\n"], ids=["none", "crlf", "2crlf", "lf"])
@pytest.mark.parametrize("http_port", [False, True], ids=["tls-port", "http-port"])
def test_a_hello_pipelined_with_the_connect_for_another_name_is_refused(lab, start_proxy, between, http_port):
    port = lab.public.port if http_port else lab.public_tls.port
    proxy = start_proxy(lab.policy_text().replace("  connect: [", f"  connect: [{lab.public.port}, "))
    hello = real_client_hello("other.lab.example")
    head = f"CONNECT public.lab.example:{port} HTTP/1.1\r\nHost: public.lab.example:{port}\r\n\r\n".encode()
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(head + between + hello)
        answer = read_all(sock, 5)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:60]
    rest = answer.split(b"\r\n\r\n", 1)[1]
    assert rest[:1] in (b"\x15", b""), rest[:20]
    assert _refusals(proxy), proxy.audit()
