"""Review round 19: the admin listener, the session store's URL, hot reload and --workers (a helper's adversarial
review; each test failed before its fix).

- A request the admin listener cannot parse was logged by aiohttp with a traceback quoting its bytes: an
  Authorization line ending in a bare LF put the admin token into the proxy's log (proxy/admin.py).
- A Redis password given as ``?password=`` (which redis-py reads) was in the start-up line, and with the store
  down in every ``session:store-unavailable`` refusal: the 503 body, X-Egresswall-Reason, the audit record
  (proxy/sessions/redis_store.py, store_url.redacted).
- A policy file swapped for a 512 MiB sparse file took the proxy from 76 MiB to 1.6 GiB before the reload was
  refused (proxy/policy_file.py, MAX_POLICY_BYTES).
- With --workers the supervisor asked its workers for /metrics and /readyz with blocking sockets on its event
  loop: one stopped worker and ten scrapes held /healthz (and the session API) for 5 s (proxy/workers.py).
- A connection cap over N workers is each worker's 1/N rounded up: README now says a client may hold up to N-1
  more; the test holds that bound.
"""

from __future__ import annotations

import base64
import concurrent.futures
import os
import signal
import socket
import time
import urllib.request

import pytest
from proxyproc import ProxyProcess
from rawclient import read_all
from session_client import TOKEN, token_file
from test_proxy_workers import children, wait_ready

from proxy.sessions.store_url import redacted

pytestmark = pytest.mark.integration


def _raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(data)
        return read_all(sock, 5)


def test_a_malformed_admin_request_puts_no_token_and_no_traceback_in_the_log(lab, tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text(lab.policy_text())
    proxy = ProxyProcess(["--policy", str(policy), "--admin-token-file", str(token_file(tmp_path))],
                         tmp_path / "audit.jsonl")
    try:
        answer = _raw(proxy.admin_port, b"GET /v1/sessions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                      + TOKEN.encode() + b"\n\r\nConnection: close\r\n\r\n")
        assert answer.startswith(b"HTTP/1.") and b" 400 " in answer.split(b"\r\n", 1)[0]
        _raw(proxy.admin_port, b"GET v1/sessions HTTP/1.0\r\n\r\n")  # no token at all: a traceback all the same
        time.sleep(0.5)
        log = proxy.stderr + proxy.log_path.read_text()
    finally:
        proxy.stop()
    assert TOKEN not in log, "the admin token was written to the proxy's log"
    assert "Traceback" not in log, log[-2000:]


def test_a_redis_password_in_the_query_reaches_no_client_and_no_log(lab, tmp_path):
    with socket.socket() as probe:  # a loopback port with nothing listening: the store is down
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    password = "s3cret-redis-password"
    policy = tmp_path / "policy.yaml"
    policy.write_text(lab.policy_text())
    proxy = ProxyProcess(["--policy", str(policy), "--admin-token-file", str(token_file(tmp_path)),
                          "--session-store", f"redis://127.0.0.1:{closed_port}?password={password}"],
                         tmp_path / "audit.jsonl")
    try:
        credentials = base64.b64encode(b"sabcdef0123456789abcdef01:whatever").decode()
        status, headers, body = proxy.get(f"http://public.lab.example:{lab.public.port}/",
                                          {"Proxy-Authorization": f"Basic {credentials}"})
        time.sleep(0.3)
        stderr, audit = proxy.stderr, proxy.log_path.read_text()
    finally:
        proxy.stop()
    assert status == 503
    assert password not in body.decode(errors="replace") + " ".join(headers.values()), \
        "a proxy client was told the session store's password"
    assert password not in audit, "the audit log holds the session store's password"
    assert password not in stderr, "the start-up line (or another log line) holds the session store's password"


def _rss_mib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status").read().splitlines():  # noqa: SIM115 - /proc, read whole at once
        if line.startswith("VmRSS"):
            return int(line.split()[1]) // 1024
    raise AssertionError("no VmRSS")


def test_a_huge_sparse_policy_file_is_refused_without_reading_it_into_memory(lab, start_proxy, tmp_path):
    proxy = start_proxy(lab.policy_text("hosts:\n  deny:\n    - denied.lab.example\n"))
    pid = proxy.process.pid
    before = _rss_mib(pid)
    sparse = tmp_path / "sparse.yaml"
    with open(sparse, "wb") as f:
        f.truncate(512 << 20)
    link = tmp_path / "link"
    os.symlink(sparse, link)
    os.replace(link, proxy.policy_path)  # the rename-over an operator (or a ConfigMap swap) does
    peak = before
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and "reload refused" not in proxy.stderr:
        peak = max(peak, _rss_mib(pid))
        time.sleep(0.05)
    assert "reload refused" in proxy.stderr
    assert proxy.get(f"http://denied.lab.example:{lab.public.port}/")[0] == 403  # the last good policy holds
    assert proxy.admin("/healthz")[0] == 200
    assert peak - before < 256, f"a refused 512 MiB policy file took the proxy from {before} to {peak} MiB"


def _held(proxy, n: int) -> int:
    """Open n silent connections from one client; how many the proxy keeps (neither answered nor closed)."""
    socks = [socket.create_connection((proxy.host, proxy.port), timeout=2) for _ in range(n)]
    try:
        time.sleep(2.6)  # a refusal at accept is sent once the client has had 2 s to name its target
        held = 0
        for sock in socks:
            sock.setblocking(False)
            try:
                sock.recv(4096)
            except BlockingIOError:
                held += 1
        return held
    finally:
        for sock in socks:
            sock.close()


def test_a_client_holds_at_most_n_minus_1_connections_over_its_cap_across_n_workers(lab, start_proxy):
    proxy = start_proxy(lab.policy_text(limits="limits:\n  max_connections_per_client: 1\n"), "--workers", "2")
    wait_ready(proxy)
    # README: each of N workers enforces 1/N of the cap rounded up, so up to N-1 more than the cap (and never more)
    assert _held(proxy, 8) <= 2


def test_a_stopped_worker_does_not_stall_the_supervisors_admin_listener(lab, start_proxy):
    proxy = start_proxy(lab.policy_text(), "--workers", "2")
    wait_ready(proxy)
    victim = children(proxy.process.pid)[0]

    def took(path: str) -> float:
        started = time.monotonic()
        with urllib.request.urlopen(f"http://127.0.0.1:{proxy.admin_port}{path}", timeout=30) as answer:
            answer.read()
        return time.monotonic() - started

    os.kill(victim, signal.SIGSTOP)
    try:
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            scrapes = [pool.submit(took, "/metrics") for _ in range(10)]
            time.sleep(0.1)
            healthz = pool.submit(took, "/healthz").result()
            concurrent.futures.wait(scrapes)
    finally:
        os.kill(victim, signal.SIGCONT)
    assert healthz < 1.0, f"/healthz took {healthz:.1f}s while a worker was stopped and /metrics was scraped"


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:pw@127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("redis://user:pw@store:6379/2?password=pw&db=3", "redis://store:6379/3"),  # where redis-py connects
    ("rediss://store?password=pw#frag", "rediss://store"),
    ("unix:///run/redis.sock?password=pw", "unix:///run/redis.sock"),
    ("unix://:pw@/run/redis.sock", "unix:///run/redis.sock"),  # redis-py reads a unix URL's userinfo too
    ("redis://u:pw#w@h:1/0", "redis://(a URL redis-py cannot read)"),  # no split shows part of the password
    ("redis://h:1/0?password=pw@b", "redis://h:1/0"),
    ("redis://[::1]:6380/1", "redis://[::1]:6380/1"),
    ("memory", "memory"),
])
def test_a_store_url_is_shown_without_its_password(url: str, shown: str) -> None:
    assert redacted(url) == shown and "pw" not in redacted(url)


def test_a_restarted_worker_does_not_enforce_a_file_still_being_written(lab, start_proxy):
    """The policy file is being rewritten (each write ends at a line's end, the deny rule gone: a file caught
    half-written says less) when a worker dies. Its siblings' watchers wait for the file to settle and keep the
    deny rule; the restarted worker's first load took the file as it was, and let the denied host through. It
    now holds the file to what a reload does (a helper's suspicion, round 19)."""
    good = lab.policy_text("hosts:\n  deny:\n    - denied.lab.example\n")
    proxy = start_proxy(good, "--workers", "2")
    wait_ready(proxy)
    os.kill(children(proxy.process.pid)[0], signal.SIGKILL)
    allowed, deadline, n = 0, time.monotonic() + 5, 0
    while time.monotonic() < deadline:
        n += 1
        proxy.policy_path.write_text(lab.policy_text(f"# still being written {n}\n"))  # no deny rule, yet
        for _ in range(3):
            status = proxy.get(f"http://denied.lab.example:{lab.public.port}/")[0]
            allowed += status == 200
        time.sleep(0.1)
    proxy.policy_path.write_text(good)
    assert allowed == 0, f"{allowed} requests to the denied host were let through while the file was being written"
