"""The same CONNECT decisions through both transports — the fast front's relay and mitmproxy's layers —
leave the same audit records, apart from ids and times: one gate decides and records for both."""

from __future__ import annotations

import socket
import time

import pytest
from labnet import PUBLIC_IP
from metrics_page import value
from proxyproc import ProxyProcess
from tls_build import client_hello

pytestmark = pytest.mark.integration
VOLATILE = {"id", "time", "duration_ms"}


def policy_text(lab) -> str:
    return (f"version: 1\nmode: enforce\ndefault: allow\nhosts:\n  deny: [denied.lab.example]\n"
            f"ports:\n  http: [80]\n  connect: [443, '1024-65535']\n"
            f"addresses:\n  allow: [{PUBLIC_IP}/32]\n"
            f"resolver:\n  nameservers: ['{lab.dns.address}']\n  timeout: 1\n"
            f"limits:\n  max_connections_per_client: 2\n")


def connect(proxy: ProxyProcess, authority: str, hello: bytes | None = None) -> tuple[int, bytes]:
    """CONNECT, then (if answered 200) send ``hello`` and read until the tunnel closes."""
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(4096)
            if not chunk:
                return 0, head
            head += chunk
        status = int(head.split()[1])
        rest = b""
        if status == 200 and hello is not None:
            sock.sendall(hello)
            try:
                while chunk := sock.recv(65536):
                    rest += chunk
            except (ConnectionResetError, TimeoutError):
                pass
        return status, rest


def scenario(proxy: ProxyProcess, lab) -> list[int]:
    tls = lab.public_tls.port
    statuses = [
        connect(proxy, f"public.lab.example:{tls}", client_hello(b"public.lab.example"))[0],  # allowed
        connect(proxy, f"denied.lab.example:{tls}")[0],  # refused by host
        connect(proxy, f"internal.lab.example:{tls}")[0],  # refused by address
        connect(proxy, f"public.lab.example:{tls}", client_hello(b"other.lab.example"))[0],  # SNI
        connect(proxy, f"{proxy.host}:{proxy.port}")[0],  # the proxy itself
    ]
    wait_for_gauge(proxy, 0)  # the connections above are closed and released
    held = [socket.create_connection((proxy.host, proxy.port)) for _ in range(2)]  # the client's cap is 2
    wait_for_gauge(proxy, 2)  # admitted at accept, before they send a byte
    statuses.append(connect(proxy, f"public.lab.example:{tls}")[0])  # refused by the cap, at accept
    for sock in held:
        sock.close()
    return statuses


def wait_for_gauge(proxy: ProxyProcess, count: int) -> None:
    deadline = time.monotonic() + 10
    while value(proxy.admin("/metrics")[1], "egresswall_open_connections") != count and time.monotonic() < deadline:
        time.sleep(0.05)


def comparable(proxy: ProxyProcess) -> list[dict]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(proxy.audit()) < 9:
        time.sleep(0.1)
    records = [r for r in proxy.audit() if r["rule"] != "limits.first_byte_timeout"]
    out = []
    for record in records:
        record = {k: v for k, v in record.items() if k not in VOLATILE}
        if record["host"] == PUBLIC_IP or (record.get("port") and record["host"] in ("127.0.0.1",)):
            record["port"] = "<proxy port>"
        if record["reason"] and "egresswall's own listener" in record["reason"]:
            record["reason"] = "<self>"
        out.append(record)
    return sorted(out, key=lambda r: (r["host"] or "", r["event"], r["rule"], r["stage"]))


def test_both_transports_record_the_same_connect_decisions(lab, tmp_path):
    results = {}
    for path, args in (("front", []), ("mitmproxy", ["--no-fast-tunnels"])):
        policy = tmp_path / "policy.yaml"  # one file for both: rules name their file and line
        policy.write_text(policy_text(lab))
        listen = ["--listen", f"{PUBLIC_IP}:0", "--admin", f"{PUBLIC_IP}:0"]
        proxy = ProxyProcess(["--policy", str(policy), *listen, *args], tmp_path / f"{path}.jsonl")
        try:
            statuses = scenario(proxy, lab)
        finally:
            proxy.stop()
        assert statuses == [200, 403, 403, 200, 403, 429], (path, statuses)
        results[path] = comparable(proxy)
    front, mitm = results["front"], results["mitmproxy"]
    rules = sorted(r["rule"] for r in front if r["verdict"] == "refuse")
    assert rules == sorted(["tls:sni", "special-purpose 127.0.0.0/8", "self", "limits.max_connections_per_client",
                            next(r["rule"] for r in front if r["host"] == "denied.lab.example")]), rules
    cap = next(r for r in front if r["rule"] == "limits.max_connections_per_client")
    assert cap["host"] == "public.lab.example" and cap["port"] == lab.public_tls.port  # named, refused at accept
    assert front == mitm


def cut_short(proxy: ProxyProcess, lab, sent: bytes) -> None:
    """An allowed CONNECT whose client closes after its 200, having sent ``sent`` of its first message."""
    authority = f"public.lab.example:{lab.public_tls.port}"
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(4096)
        assert head.startswith(b"HTTP/1.1 200"), head
        if sent:
            sock.sendall(sent)
            time.sleep(0.3)  # read by the proxy before the close


def closing_lines(proxy: ProxyProcess, count: int) -> list[dict]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len([r for r in proxy.audit() if r["event"] == "tunnel"]) < count:
        time.sleep(0.05)
    return [{k: v for k, v in r.items() if k not in VOLATILE} for r in proxy.audit() if r["event"] == "tunnel"]


def test_a_tunnel_its_client_closes_before_its_first_message_is_whole_ends_the_same_on_both(lab, tmp_path):
    """Closed after the 200 with nothing sent, and with half a ClientHello sent: the same closing line (its
    reason and the bytes that came) whichever transport carried the tunnel."""
    hello = client_hello(b"public.lab.example")
    results = {}
    for path, args in (("front", []), ("mitmproxy", ["--no-fast-tunnels"])):
        policy = tmp_path / "policy.yaml"
        policy.write_text(policy_text(lab))
        proxy = ProxyProcess(["--policy", str(policy), "--listen", f"{PUBLIC_IP}:0", "--admin", f"{PUBLIC_IP}:0",
                              *args], tmp_path / f"cut-{path}.jsonl")
        try:
            cut_short(proxy, lab, b"")
            cut_short(proxy, lab, hello[:40])
            results[path] = closing_lines(proxy, 2)
        finally:
            proxy.stop()
    front = results["front"]
    assert [(r["bytes_up"], r["error"]) for r in front] == [
        (0, "the client closed the tunnel before its first message was complete"),
        (40, "the client closed the tunnel before its first message was complete")], front
    assert results["mitmproxy"] == front
