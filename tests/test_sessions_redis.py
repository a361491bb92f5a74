"""Sessions shared by several proxy processes through one real redis-server (Debian's, on loopback):
a session created through one process's admin API is honoured by the other, a budget of N admits exactly
N across both, and an unreachable store refuses session requests (fail closed) and fails /readyz."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from labnet import PUBLIC_IP
from metrics_page import value
from proxyproc import ProxyProcess, both_transports
from rawclient import read_all
from session_client import api, create, get, token_file

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("redis-server") is None,
                                 reason="needs Debian's redis-server (ci/install.sh --redis)")]


class RedisServer:
    """A redis-server of the test's own: loopback only, no persistence, its files in a temp dir."""

    def __init__(self, folder: Path, port: int | None = None, host: str = "127.0.0.1", bind: str = "") -> None:
        self.folder = folder
        self.host = host
        self.port = port or _free_port()
        self.process = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", bind or host,
                                         "--save", "", "--appendonly", "no", "--dir", str(folder)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((host, self.port), timeout=1) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(64).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def command(self, *words: str) -> bytes:
        """One command straight to the server (not through the proxy), its raw reply."""
        with socket.create_connection((self.host, self.port), timeout=5) as sock:
            sock.sendall(b"".join(b"$%d\r\n%s\r\n" % (len(w), w.encode()) for w in words)
                         .join([b"*%d\r\n" % len(words), b""]))
            return sock.recv(4096)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path)
    yield server
    server.stop()


def policy_file(lab, folder: Path) -> Path:
    path = folder / "policy.yaml"
    path.write_text(lab.policy_text("session: required\n"))
    return path


@pytest.fixture
def two_proxies(lab, redis_server, tmp_path):
    policy, token = policy_file(lab, tmp_path), token_file(tmp_path)
    started = [ProxyProcess(["--policy", str(policy), "--admin-token-file", str(token), "--session-store",
                             redis_server.url], tmp_path / f"audit-{i}.jsonl") for i in range(2)]
    yield started
    for proxy in started:
        proxy.stop()
        allowed = {PUBLIC_IP, "127.0.0.1"}  # the lab's upstream, and the redis-server
        assert not [e for e in proxy.outbound() if e["host"] not in allowed], proxy.outbound()


def test_a_session_created_through_one_process_is_honoured_by_the_other(lab, two_proxies):
    first, second = two_proxies
    session = create(first.admin_port, {"hosts": ["public.lab.example"]})
    url = f"http://public.lab.example:{lab.public.port}/shared"
    assert get(second, url, session)[:3:2] == (200, b"hello from public /shared")
    status, headers, _ = get(second, f"http://other.lab.example:{lab.public.port}/x", session)
    assert status == 403 and headers["x-egresswall-rule"] == "session:not-granted"
    status, _, view = api(second.admin_port, "GET", f"/v1/sessions/{session['id']}")
    assert status == 200 and view["usage"]["requests"] == 1
    assert api(second.admin_port, "DELETE", f"/v1/sessions/{session['id']}")[0] == 204
    assert get(first, url, session)[0] == 407  # ended through the other process: refused here too
    records = [r for r in second.audit() if r.get("session") == session["id"]]
    assert records and session["secret"] not in json.dumps(records)


def test_a_request_budget_of_n_admits_exactly_n_across_both_processes(lab, two_proxies):
    budget = 7
    session = create(two_proxies[0].admin_port, {"hosts": ["public.lab.example"]}, budgets={"requests": budget})
    url = f"http://public.lab.example:{lab.public.port}/race"

    def one(i: int) -> int:
        return get(two_proxies[i % 2], url, session)[0]

    # One request through each process first (so both are seen admitting under the shared budget, whatever
    # the scheduling), then the rest at once, spread over both: the store's atomic count must hold.
    statuses = [one(0), one(1)]
    assert statuses == [200, 200]
    with ThreadPoolExecutor(max_workers=8) as pool:
        statuses += list(pool.map(one, range(2, 24)))
    assert statuses.count(200) == budget, statuses
    assert statuses.count(403) == 24 - budget
    admitted = [r for proxy in two_proxies for r in proxy.decisions()
                if r.get("session") == session["id"] and r["verdict"] == "allow"]
    assert len(admitted) == budget
    assert {p for p in two_proxies if any(r.get("session") == session["id"] and r["verdict"] == "allow"
                                          for r in p.decisions())} == set(two_proxies)  # both admitted some
    assert api(two_proxies[1].admin_port, "GET", f"/v1/sessions/{session['id']}")[2]["usage"]["requests"] == budget


def test_an_unreachable_store_refuses_session_requests_and_fails_readyz(lab, two_proxies, redis_server):
    proxy = two_proxies[0]
    session = create(proxy.admin_port, {"hosts": ["public.lab.example"]})
    url = f"http://public.lab.example:{lab.public.port}/store-down"
    assert get(proxy, url, session)[0] == 200
    redis_server.stop()
    status, headers, body = get(proxy, url, session)
    assert status == 503 and headers["x-egresswall-rule"] == "session:store-unavailable"
    assert json.loads(body)["error"] == "unavailable"
    status, text = proxy.admin("/readyz")
    assert status == 503 and "session store" in text
    status, _, body = api(proxy.admin_port, "POST", "/v1/sessions", {"grants": {"hosts": ["public.lab.example"]}})
    assert status == 503 and body["error"] == "unavailable"
    assert [p for _, p, _ in lab.public.requests].count("/store-down") == 1
    refused = [r for r in proxy.decisions() if r["rule"] == "session:store-unavailable"]
    assert refused and refused[0]["verdict"] == "refuse"
    # The store comes back (empty: nothing was saved): /readyz recovers by itself.
    back = RedisServer(redis_server.folder, redis_server.port)
    try:
        deadline = time.monotonic() + 10
        while proxy.admin("/readyz")[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proxy.admin("/readyz")[0] == 200
    finally:
        back.stop()


def test_workers_share_sessions_through_the_supervisors_admin_api(lab, redis_server, tmp_path):
    policy, token = policy_file(lab, tmp_path), token_file(tmp_path)
    proxy = ProxyProcess(["--policy", str(policy), "--workers", "2", "--admin-token-file", str(token),
                          "--session-store", redis_server.url], tmp_path / "audit.jsonl")
    try:
        session = create(proxy.admin_port, {"urls": [f"http://public.lab.example:{lab.public.port}/w"]},
                         budgets={"requests": 3})
        statuses = [get(proxy, f"http://public.lab.example:{lab.public.port}/w", session)[0] for _ in range(5)]
        assert statuses == [200, 200, 200, 403, 403]
        assert get(proxy, f"http://public.lab.example:{lab.public.port}/w")[0] == 407
        status, text = proxy.admin("/metrics")
        assert status == 200 and value(text, "egresswall_sessions_created_total") == 1  # counted once, by the API
        assert value(text, "egresswall_session_refusals_total", reason="session:budget-requests") == 2
    finally:
        proxy.stop()


def test_workers_with_sessions_in_memory_are_refused_at_start(lab, tmp_path):
    from proxyproc import ROOT

    policy, token = policy_file(lab, tmp_path), token_file(tmp_path)
    done = subprocess.run([sys.executable, "-m", "proxy.cli", "run", "--policy", str(policy), "--workers", "2",
                           "--admin-token-file", str(token)], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert done.returncode != 0 and "--session-store redis://" in done.stderr


def _store_is_refused_through_the_proxy(lab, start_proxy, store: RedisServer, authority: str) -> ProxyProcess:
    """The store's port admitted by the policy; a CONNECT to ``authority`` and a plain POST carrying a Redis
    command both get 403 ``self``, and the store never sees the command."""
    text = lab.policy_text().replace("  connect: [", f"  connect: [{store.port}, ").replace(
        "  http: [", f"  http: [{store.port}, ")
    proxy = start_proxy(text, "--session-store", store.url)
    target = f"{authority}:{store.port}"
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        head = sock.recv(4096)
        if head.startswith(b"HTTP/1.1 200"):
            sock.sendall(b"*3\r\n$3\r\nSET\r\n$5\r\npwned\r\n$1\r\n1\r\n")
            read_all(sock, timeout=2)
    assert head.startswith(b"HTTP/1.1 403"), head
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(f"POST http://{target}/ HTTP/1.1\r\nHost: {target}\r\nContent-Length: 34\r\n\r\n"
                     "*3\r\n$3\r\nSET\r\n$5\r\npwned\r\n$1\r\n2\r\n\r\n".encode())
        plain = read_all(sock, timeout=5)
    assert plain.startswith(b"HTTP/1.1 403"), plain
    assert store.command("EXISTS", "pwned") == b":0\r\n"
    refused = [r for r in proxy.decisions() if r["verdict"] == "refuse"]
    assert [r["rule"] for r in refused] == ["self", "self"], refused
    assert all("egresswall's session store" in r["reason"] for r in refused)
    return proxy


@both_transports
@pytest.mark.parametrize("authority", [PUBLIC_IP, "public.lab.example"])
def test_the_session_store_is_egresswall_s_own_endpoint_even_where_the_policy_admits_its_address(
        lab, tmp_path, start_proxy, authority):
    """A client that reached Redis through the proxy could write itself a session. The store sits at an
    address and port this policy admits (the lab's public address, its port in ports.connect and
    ports.http), and is still refused with rule ``self``, by CONNECT and by plain HTTP."""
    store = RedisServer(tmp_path, host=PUBLIC_IP)
    try:
        _store_is_refused_through_the_proxy(lab, start_proxy, store, authority)
    finally:
        store.stop()


@both_transports
@pytest.mark.parametrize("authority", [PUBLIC_IP, "public.lab.example"])
def test_a_store_on_this_host_is_refused_at_every_address_it_listens_on(lab, tmp_path, start_proxy, authority):
    """The store was refused only at the address its URL names: a redis-server on this host that also listens
    on another of its addresses (Debian's binds 127.0.0.1 and ::1, a container image every address) was
    reached there through the proxy, and a client wrote itself a session (review round 17). A store on this
    host is refused on its port at every address of this host."""
    store = RedisServer(tmp_path, host="127.0.0.1", bind=f"127.0.0.1 {PUBLIC_IP}")
    try:
        proxy = _store_is_refused_through_the_proxy(lab, start_proxy, store, authority)
        # the lab's upstream on the same address, another port, is still reached
        assert proxy.get(f"http://{authority}:{lab.public.port}/after")[0] == 200
    finally:
        store.stop()
