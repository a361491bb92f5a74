"""Review round 23, exhaustion: what held. One misbehaving client does not deny service to others, memory stays
bounded, and each refusal or close leaves one record with a readable reason, on both transports."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
from audit_watch import AuditWatch, decisions, rss_kib
from dnslab import Behaviour
from proxyproc import both_transports, parse_response, read_response
from test_review_round23_exhaust import _timed_get as timed_get

pytestmark = pytest.mark.integration


def _timed_get(proxy, url: str, timeout: float = 5) -> tuple[int, float]:
    status, took, _ = timed_get(proxy, url, timeout)
    return status, took


@both_transports
def test_one_client_waiting_on_silent_dns_for_many_names_does_not_delay_others_holds(lab, start_proxy):
    """40 connections from one client, each for a different name whose nameserver never answers: each gets its
    403 dns:timeout after resolver.timeout (1 s in the lab policy) with one record; meanwhile another client's
    requests are answered promptly."""
    names = [f"r23-stall-{i}.lab.example" for i in range(40)]
    for name in names:
        lab.dns.set(name, Behaviour(silent=True))
    proxy = start_proxy(lab.policy_text())
    audit = AuditWatch(proxy.log_path).mark()
    results: dict[str, tuple[int, float]] = {}

    def stalled(name: str) -> None:
        sock = socket.socket()
        sock.bind(("127.0.23.9", 0))
        sock.settimeout(10)
        started = time.monotonic()
        try:
            sock.connect((proxy.host, proxy.port))
            sock.sendall(f"GET http://{name}/ HTTP/1.1\r\nHost: {name}\r\nConnection: close\r\n\r\n".encode())
            results[name] = (parse_response(read_response(sock))[0], time.monotonic() - started)
        finally:
            sock.close()

    threads = [threading.Thread(target=stalled, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    time.sleep(0.2)
    latencies = [_timed_get(proxy, f"http://public.lab.example:{lab.public.port}/r23-dns-{i}") for i in range(5)]
    for thread in threads:
        thread.join(15)
    assert all(status == 200 for status, _ in latencies) and max(t for _, t in latencies) < 1.5, latencies
    assert sorted(results) == sorted(names) and all(status == 403 and took < 5 for status, took in results.values())
    records = audit.wait_for(lambda r: len([d for d in decisions(r) if d["client"] == "127.0.23.9"]) == 40)
    stalled_records = [d for d in decisions(records) if d["client"] == "127.0.23.9"]
    assert len(stalled_records) == 40 and {d["rule"] for d in stalled_records} == {"dns:timeout"}
    assert all("timed out" in d["reason"] for d in stalled_records)


@both_transports
def test_one_header_with_a_one_megabyte_value_is_refused_and_memory_stays_bounded_holds(lab, start_proxy):
    """One header value of 1 MB, sent by 10 connections at once: each is refused 431 (limits.max_header_bytes)
    with one record, the proxy's RSS grows by little, and another client is answered meanwhile."""
    proxy = start_proxy(lab.policy_text())
    audit = AuditWatch(proxy.log_path).mark()
    port = lab.public.port
    head = (f"GET http://public.lab.example:{port}/r23-big HTTP/1.1\r\nHost: public.lab.example:{port}\r\n"
            "X-Big: ").encode() + b"a" * (1 << 20) + b"\r\n\r\n"
    before = rss_kib(proxy.process.pid)
    answers: list[bytes] = []

    def big() -> None:
        sock = socket.socket()
        sock.bind(("127.0.23.10", 0))
        sock.settimeout(10)
        sock.connect((proxy.host, proxy.port))
        with sock:
            with contextlib.suppress(OSError):
                sock.sendall(head)
            answers.append(read_response(sock))

    threads = [threading.Thread(target=big) for _ in range(10)]
    for thread in threads:
        thread.start()
    status, took = _timed_get(proxy, f"http://public.lab.example:{port}/r23-meanwhile")
    for thread in threads:
        thread.join(15)
    assert status == 200 and took < 1.5
    assert len(answers) == 10 and all(a.startswith(b"HTTP/1.1 431") for a in answers), [a[:40] for a in answers]
    assert rss_kib(proxy.process.pid) - before < 20 * 1024
    records = audit.wait_for(lambda r: len([d for d in decisions(r) if d["client"] == "127.0.23.10"]) == 10)
    big_records = [d for d in decisions(records) if d["client"] == "127.0.23.10"]
    assert len(big_records) == 10 and {d["rule"] for d in big_records} == {"limits.max_header_bytes"}
    assert all(d["reason"] for d in big_records)


@both_transports
def test_many_connects_whose_clients_half_close_without_a_hello_end_at_once_holds(lab, start_proxy):
    """30 CONNECTs whose clients shut their sending side right after the CONNECT, never sending a ClientHello:
    each gets its 200 and then its tunnel ends (README: "a CONNECT whose client half-closed ends its tunnel
    once the 200 is out"), well before limits.header_timeout, each with its closing record; another client is
    answered meanwhile."""
    proxy = start_proxy(lab.policy_text(limits="limits:\n  header_timeout: 30\n"))
    audit = AuditWatch(proxy.log_path).mark()
    authority = f"public.lab.example:{lab.public_tls.port}"
    socks = []
    started = time.monotonic()
    for _ in range(30):
        sock = socket.socket()
        sock.bind(("127.0.23.11", 0))
        sock.settimeout(10)
        sock.connect((proxy.host, proxy.port))
        sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        sock.shutdown(socket.SHUT_WR)
        socks.append(sock)
    status, took = _timed_get(proxy, f"http://public.lab.example:{lab.public.port}/r23-meanwhile")
    answers = [read_response(sock) for sock in socks]
    ended = time.monotonic() - started
    for sock in socks:
        sock.close()
    assert status == 200 and took < 1.5
    assert all(a.startswith(b"HTTP/1.1 200") for a in answers) and ended < 10, ended
    records = audit.wait_for(lambda r: len([x for x in r if x["event"] == "tunnel"
                                            and x.get("client") == "127.0.23.11"]) == 30)
    closes = [x for x in records if x["event"] == "tunnel" and x.get("client") == "127.0.23.11"]
    assert len(closes) == 30, [x["event"] for x in records][:10]


@both_transports
def test_a_head_dripped_a_byte_every_quarter_second_within_the_header_timeout_is_served_holds(lab, start_proxy):
    """The good side of the slowloris bound: a short head dripped one byte every 0.25 s, done before
    limits.header_timeout, is answered normally (the bound cuts only heads still incomplete at the timeout)."""
    proxy = start_proxy(lab.policy_text(limits="limits:\n  header_timeout: 30\n"))
    head = f"GET http://public.lab.example:{lab.public.port}/d HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    head = head.replace(b"Host: x", f"Host: public.lab.example:{lab.public.port}".encode())
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        for i in range(len(head)):
            sock.send(head[i:i + 1])
            time.sleep(0.25 if i % 4 == 0 else 0.0)
        status = parse_response(read_response(sock))[0]
    assert status == 200
