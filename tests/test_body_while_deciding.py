"""A request body that arrives while its request is still being decided is not read meanwhile.

The decision waits for the name's DNS answer, which whoever runs the name's nameserver can make slow (up
to ``resolver.timeout``). On mitmproxy's path the body was read meanwhile, and every piece read was queued
for the stream until the decision hook returned: one connection sending a chunked body at loopback speed
held 68 MB over a 10 MB limit in 0.9 s, more the longer the answer took; and below the limit, each
connection held its whole body outside the budget for buffered bodies. Now the client's reads wait while
its request is decided (proxy/mitm_patches.py, ``HeldReader``), and a chunked body is no longer parsed or
held once it has passed ``limits.max_request_body``. The fast path reads a body only after the decision.
Both transports; the proxy's memory is read from /proc, the nameserver is one of the test's own on
loopback that answers late.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import dns.message
import dns.name
import dns.rrset
from audit_watch import rss_kib
from labnet import PUBLIC_IP
from listening import stop_serving
from proxyproc import both_transports

LIMIT = 1 << 20
ANSWER_AFTER = 1.0  # seconds the nameserver waits before it answers an A question


class LateNameserver:
    """A UDP nameserver on loopback that answers every A question with PUBLIC_IP, ``answer_after`` seconds
    late."""

    def __init__(self, answer_after: float = ANSWER_AFTER) -> None:
        self.answer_after = answer_after
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                data, peer = self.sock.recvfrom(4096)
            except OSError:
                return
            if not data:
                return  # woken by stop_serving
            threading.Thread(target=self._answer, args=(data, peer), daemon=True).start()

    def _answer(self, data: bytes, peer: tuple[str, int]) -> None:
        query = dns.message.from_wire(data)
        response = dns.message.make_response(query)
        question = query.question[0]
        if question.rdtype == 1:
            time.sleep(self.answer_after)
            response.answer.append(dns.rrset.from_text(question.name, 5, "IN", "A", self.address_of(question.name)))
        with contextlib.suppress(OSError):  # closed meanwhile
            self.sock.sendto(response.to_wire(), peer)

    def address_of(self, name: dns.name.Name) -> str:
        return PUBLIC_IP

    def close(self) -> None:
        stop_serving(self.sock, self._thread)


def late_policy(lab, nameserver: LateNameserver, timeout: float, max_request_body: int) -> str:
    """Default allow, the lab's origin open to plain HTTP, names resolved by ``nameserver`` (late)."""
    return (f"version: 1\ndefault: allow\nports:\n  http: [{lab.public.port}]\n"
            f"addresses:\n  allow: [{PUBLIC_IP}/32]\n"
            f"resolver:\n  nameservers: ['{nameserver.address}']\n  timeout: {timeout:g}\n"
            f"limits:\n  max_request_body: {max_request_body}\n")


@both_transports
def test_a_chunked_body_sent_while_its_decision_waits_holds_no_more_than_the_limit(lab, start_proxy, transport):
    nameserver = LateNameserver()
    try:
        proxy = start_proxy(late_policy(lab, nameserver, 3, LIMIT))
        before = rss_kib(proxy.process.pid)
        name = f"late{time.monotonic_ns()}.lab.example"
        authority = f"{name}:{lab.public.port}"
        piece = b"100000\r\n" + b"x" * (1 << 20) + b"\r\n"  # 1 MiB chunks
        sent, peak = 0, before
        with socket.create_connection((proxy.host, proxy.port), timeout=5) as sock:
            sock.sendall(f"POST http://{authority}/up HTTP/1.1\r\nHost: {authority}\r\n"
                         "Transfer-Encoding: chunked\r\n\r\n".encode())
            sock.settimeout(0.05)
            started = time.monotonic()
            while time.monotonic() - started < ANSWER_AFTER + 0.5:
                try:
                    sent += sock.send(piece)
                except TimeoutError:
                    pass
                except OSError:
                    break  # refused and closed
                peak = max(peak, rss_kib(proxy.process.pid))
        grown_mib = (peak - before) / 1024
        # The proxy held about the limit of them at most (on mitmproxy's path it once held them all: 60 MiB
        # and more; it now reads nothing while deciding, as the fast path).
        assert grown_mib < 16, f"the proxy grew {grown_mib:.0f} MiB while the decision waited ({sent >> 20} MiB sent)"
        refused = [r for r in proxy.audit() if r.get("host") == name and r["rule"] == "limits.max_request_body"]
        assert len(refused) == 1 and refused[0]["status"] == 413, proxy.audit()[-3:]
        assert not [p for _, p, _ in lab.public.requests if p == "/up"]
    finally:
        nameserver.close()


BODY = 6 << 20  # under the limit below: each body is one the proxy would take
CLIENTS = 16
SLOW_ANSWER = 2.0


@both_transports
def test_bodies_sent_while_their_decisions_wait_are_not_read_meanwhile(lab, start_proxy, transport):
    """16 connections each send a 6 MiB body (under an 8 MiB limit) while their names take 2 s to resolve.
    mitmproxy's path read them all meanwhile and held them for the waiting streams, outside the budget for
    buffered bodies: the proxy grew by about their sum (96 MiB). Now nothing is read until the decision,
    and then each body goes to the origin whole."""
    nameserver = LateNameserver(SLOW_ANSWER)
    try:
        proxy = start_proxy(late_policy(lab, nameserver, 4, 8 << 20))
        before = rss_kib(proxy.process.pid)
        answers: list[bytes] = []
        body = b"y" * BODY
        path = f"/held-{time.monotonic_ns()}"  # the lab's origin serves every test of the session

        def post(index: int) -> None:
            authority = f"late{index}x{time.monotonic_ns()}.lab.example:{lab.public.port}"
            with socket.create_connection((proxy.host, proxy.port), timeout=15) as sock:
                sock.sendall(f"POST http://{authority}{path} HTTP/1.1\r\nHost: {authority}\r\n"
                             f"Content-Length: {BODY}\r\nConnection: close\r\n\r\n".encode() + body)
                answer = b""
                while chunk := sock.recv(65536):
                    answer += chunk
                answers.append(answer)

        threads = [threading.Thread(target=post, args=(i,), daemon=True) for i in range(CLIENTS)]
        for thread in threads:
            thread.start()
        started, peak = time.monotonic(), before
        while time.monotonic() - started < SLOW_ANSWER - 0.2:  # the decisions are all still waiting
            peak = max(peak, rss_kib(proxy.process.pid))
            time.sleep(0.02)
        for thread in threads:
            thread.join(30)
        grown_mib = (peak - before) / 1024
        assert grown_mib < 32, (f"the proxy grew {grown_mib:.0f} MiB while {CLIENTS} decisions waited "
                                f"({CLIENTS * BODY >> 20} MiB of bodies sent)")
        got = f"got {BODY} bytes".encode()
        assert len(answers) == CLIENTS and all(a.startswith(b"HTTP/1.1 200") and a.endswith(got) for a in answers), (
            [a[:80] + b"..." + a[-20:] for a in answers])
        assert len([p for _, p, _ in lab.public.requests if p == path]) == CLIENTS
    finally:
        nameserver.close()
