"""The audit log, metrics and lifecycle of the real proxy."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from metrics_page import families, value
from proxyproc import both_transports

from proxy.build import versions
from proxy.metrics import DNS_BUCKETS

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parent.parent


@both_transports
def test_one_decision_line_per_request_under_1000_requests(lab, start_proxy):
    proxy = start_proxy(lab.policy_text("hosts:\n  deny:\n    - denied.lab.example\n"))
    hosts = ["public.lab.example", "denied.lab.example", "internal.lab.example"]
    sent: list[str] = []
    lock = threading.Lock()

    def worker(n: int) -> None:
        conn = http.client.HTTPConnection(proxy.host, proxy.port, timeout=10)
        for i in range(n):
            host = hosts[i % 3]
            url = f"http://{host}:{lab.public.port}/r{threading.get_ident()}-{i}"
            try:
                conn.request("GET", url, headers={"Host": f"{host}:{lab.public.port}"})
                conn.getresponse().read()
            except (http.client.HTTPException, OSError):
                conn.close()
                conn = http.client.HTTPConnection(proxy.host, proxy.port, timeout=10)
                conn.request("GET", url, headers={"Host": f"{host}:{lab.public.port}"})
                conn.getresponse().read()
            with lock:
                sent.append(url.split(f":{lab.public.port}")[1])
        conn.close()

    threads = [threading.Thread(target=worker, args=(125,)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(sent) == 1000
    time.sleep(0.3)
    lines = proxy.log_path.read_text().splitlines()
    records = [json.loads(line) for line in lines]  # every line is whole JSON
    decisions = [r for r in records if r["event"] == "decision"]
    assert sorted(r["path"] for r in decisions) == sorted(sent)
    by_verdict = {v: sum(1 for r in decisions if r["verdict"] == v) for v in ("allow", "refuse")}
    allowed = sum(1 for r in decisions if r["host"] == "public.lab.example")
    assert allowed == 8 * 42 and by_verdict == {"allow": allowed, "refuse": 1000 - allowed}
    responses = [r for r in records if r["event"] == "response"]
    assert len(responses) == allowed and all(r["status"] == 200 and r["bytes_down"] > 0 for r in responses)
    required = {"time", "client", "method", "scheme", "host", "port", "path", "addresses", "pinned", "verdict",
                "rule", "reason", "mode", "status"}
    assert all(required <= set(r) for r in decisions)


@both_transports
def test_audit_log_hides_query_strings_and_credentials(lab, start_proxy):
    proxy = start_proxy(lab.policy_text())
    proxy.get(f"http://public.lab.example:{lab.public.port}/p?token=SECRET",
              {"Authorization": "Bearer SECRET", "Cookie": "session=SECRET"})
    text = proxy.log_path.read_text()
    assert "SECRET" not in text and '"path":"/p"' in text


def test_passthrough_tunnel_bytes_are_counted(lab, start_proxy):
    proxy = start_proxy(lab.policy_text())
    sock, status, _ = proxy.connect(f"public.lab.example:{lab.public_tls.port}")
    assert status == 200
    context = ssl.create_default_context(cafile=str(lab.cert_file))
    with context.wrap_socket(sock, server_hostname="public.lab.example") as tls:
        tls.sendall(b"GET /bytes/200000 HTTP/1.1\r\nHost: public.lab.example\r\nConnection: close\r\n\r\n")
        received = 0
        while chunk := tls.recv(65536):
            received += len(chunk)
    assert received > 200000
    time.sleep(0.3)
    tunnels = [r for r in proxy.audit() if r["event"] == "tunnel"]
    assert len(tunnels) == 1
    assert tunnels[0]["bytes_down"] > 200000 and tunnels[0]["bytes_up"] > 0  # TLS records, counted untouched
    assert tunnels[0]["pinned"] == "127.0.0.2"


@both_transports
def test_metrics_count_decisions_by_rule_id_and_show_dns_buckets_build_and_reload_time(lab, start_proxy):
    """Issue 14 item 7 through the real proxy: the page parses with prometheus_client's parser; a decision
    is counted by its rule's stable id (the YAML ``id:``, a derived id, a fixed refusal name), never by
    ``file:line`` and never by the name a client asked for; DNS latency is a histogram."""
    started = time.time()
    proxy = start_proxy(lab.policy_text("hosts:\n  allow:\n    - host: public.lab.example\n      id: lab-public\n"
                                        "  deny:\n    - other.lab.example\n"))
    assert proxy.get(f"http://public.lab.example:{lab.public.port}/")[0] == 200
    assert proxy.get(f"http://other.lab.example:{lab.public.port}/")[0] == 403
    assert proxy.get(f"http://internal.lab.example:{lab.public.port}/")[0] == 403
    assert proxy.get(f"http://missing.lab.example:{lab.public.port}/")[0] == 403
    status, body = proxy.admin("/metrics")
    assert status == 200
    page = families(body)
    _, samples = page["egresswall_decisions"]
    decisions = {(s.labels["verdict"], s.labels["rule_id"]): s.value for s in samples}
    assert decisions[("allow", "lab-public")] == 1
    assert decisions[("refuse", "hosts.deny:other.lab.example")] == 1
    assert decisions[("refuse", "special-purpose 127.0.0.0/8")] == 1
    assert sum(decisions.values()) == 4
    assert [r["rule_id"] for r in proxy.decisions()].count("lab-public") == 1  # the same id as the record's
    labels = [v for _, family in page.values() for s in family for k, v in s.labels.items() if k != "le"]
    assert not [v for v in labels if "policy.yaml" in v or re.search(r":\d+\b", v)], labels  # no file:line
    assert not [v for v in labels if "internal.lab.example" in v or "missing.lab.example" in v], labels

    kind, samples = page["egresswall_dns_lookup_seconds"]
    assert kind == "histogram"
    les = [float(s.labels["le"]) for s in samples if s.name.endswith("_bucket")]
    assert les == [*DNS_BUCKETS, float("inf")]
    assert value(body, "egresswall_dns_lookup_seconds_count") == 3  # public, internal, missing; not other
    assert value(body, "egresswall_dns_lookup_seconds_bucket", le="+Inf") == 3
    assert sum(s.value for s in page["egresswall_dns_errors"][1]) == 1

    _, samples = page["egresswall_build_info"]
    assert [(s.labels, s.value) for s in samples] == [(versions(), 1)]
    assert started - 1 <= value(body, "egresswall_policy_last_reload_success_timestamp_seconds") <= time.time()
    assert value(body, "egresswall_policy_loaded") == 1
    assert "egresswall_open_tunnels" in page
    assert proxy.admin("/healthz") == (200, "ok\n")
    assert proxy.admin("/readyz")[0] == 200


@both_transports
def test_sigusr1_reopens_the_log_for_logrotate(lab, start_proxy):
    proxy = start_proxy(lab.policy_text())
    proxy.get(f"http://public.lab.example:{lab.public.port}/before")
    rotated = proxy.log_path.with_suffix(".1")
    os.rename(proxy.log_path, rotated)
    proxy.signal(signal.SIGUSR1)
    time.sleep(0.3)
    proxy.get(f"http://public.lab.example:{lab.public.port}/after")
    time.sleep(0.2)
    assert "/before" in rotated.read_text() and "/after" not in rotated.read_text()
    assert "/after" in proxy.log_path.read_text()


def test_sigterm_lets_an_open_tunnel_finish_then_exits(lab, start_proxy):
    proxy = start_proxy(lab.policy_text(limits="limits:\n  tunnel_grace: 5\n"))
    sock, status, _ = proxy.connect(f"public.lab.example:{lab.public_tls.port}")
    assert status == 200
    context = ssl.create_default_context(cafile=str(lab.cert_file))
    tls = context.wrap_socket(sock, server_hostname="public.lab.example")
    proxy.signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(OSError):  # no longer accepting
        socket.create_connection((proxy.host, proxy.port), timeout=2).close()
    tls.sendall(b"GET /during-shutdown HTTP/1.1\r\nHost: public.lab.example\r\nConnection: close\r\n\r\n")
    data = b""
    while chunk := tls.recv(4096):
        data += chunk
    tls.close()
    assert data.endswith(b"/during-shutdown")
    assert proxy.process.wait(10) == 0


def start_mitmdump(policy_text: str, tmp_path: Path) -> tuple[subprocess.Popen, int, Path]:
    """Stock mitmdump with the shim and ``policy_text``, listening on a free loopback port."""
    policy, log = tmp_path / "policy.yaml", tmp_path / "audit.jsonl"
    policy.write_text(policy_text)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([str(Path(sys.executable).with_name("mitmdump")), "-q", "--listen-host", "127.0.0.1",
                                "--listen-port", str(port), "-s", str(ROOT / "proxy" / "mitmdump_addon.py"), "--set",
                                f"egresswall_policy={policy}", "--set", f"egresswall_log={log}"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.2)
    return process, port, log


def test_mitmdump_shim_runs_the_same_addon(lab, tmp_path):
    process, port, log = start_mitmdump(lab.policy_text(), tmp_path)
    try:
        from proxyproc import parse_response, read_response

        def get(host: str) -> int:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(f"GET http://{host}:{lab.public.port}/shim HTTP/1.1\r\nHost: {host}:{lab.public.port}\r\n"
                             "Connection: close\r\n\r\n".encode())
                return parse_response(read_response(sock))[0]

        assert get("public.lab.example") == 200
        assert get("internal.lab.example") == 403
        records = [json.loads(line) for line in log.read_text().splitlines()]
        assert {r["host"] for r in records if r["event"] == "decision"} == {"public.lab.example",
                                                                             "internal.lab.example"}
    finally:
        process.terminate()
        process.wait(10)


def test_mitmdump_shim_gets_the_limits_the_embedded_runner_gets(lab, tmp_path):
    """Stock mitmdump with the shim: limits.idle_timeout is mitmproxy's tcp_timeout there too, and the
    half-head deadline holds. (limits.first_byte_timeout needs the front: mitmdump closes a silent
    connection at the idle timeout.)"""
    process, port, log = start_mitmdump(lab.policy_text(limits="limits:\n  header_timeout: 1\n  idle_timeout: 3\n"),
                                        tmp_path)
    try:
        from proxyproc import read_response

        with socket.create_connection(("127.0.0.1", port), timeout=10) as silent:
            started = time.monotonic()
            assert silent.recv(1) == b""  # closed by limits.idle_timeout (mitmproxy's default would be 600 s)
            assert time.monotonic() - started < 8
        with socket.create_connection(("127.0.0.1", port), timeout=10) as half:
            half.sendall(f"GET http://public.lab.example:{lab.public.port}/ HTTP/1.1\r\nHost: pub".encode())
            assert read_response(half).startswith(b"HTTP/1.1 408 ")
    finally:
        process.terminate()
        process.wait(10)

