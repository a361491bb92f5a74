"""Review round 20, a second pass over the round's own fixes (a helper's): what is still open at a stop gets
exactly one closing record, promptly (five of these failed before the stop ended what it cut: Front.end_open,
tunnel_watch.record_open, the runner's own tasks ended before the audit log closes).

Runner.stop (proxy/runner.py) waits limits.tunnel_grace, then cuts what is open (Front.cut_open,
tunnel_watch.close_every_client), waits up to 2 s for the closing records, and shuts mitmproxy down.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
from labnet import PUBLIC_IP
from proxyproc import both_transports

from proxy.gate import STOP_CUT

pytestmark = pytest.mark.integration

GRACE = "limits: {tunnel_grace: 1}\n"


def _stop(proxy) -> tuple[float, list[dict]]:
    started = time.monotonic()
    code = proxy.stop(timeout=30)
    took = time.monotonic() - started
    assert code == 0, proxy.stderr[-3000:]
    return took, [r for r in proxy.audit() if r["event"] != "decision"]


def _clean(proxy) -> None:
    """No traceback at the stop (an AssertionError is a record written after the audit log closed)."""
    assert "Traceback" not in proxy.stderr and "AssertionError" not in proxy.stderr, proxy.stderr[-3000:]


@both_transports
def test_a_plain_request_waiting_for_its_answer_at_a_stop_gets_its_record(lab, start_proxy):
    """The origin answers after 20 s (labnet /slow/20); the stop comes while egresswall waits for it."""
    proxy = start_proxy(lab.policy_text(limits=GRACE))
    sock = socket.create_connection((proxy.host, proxy.port), timeout=10)
    url = f"http://public.lab.example:{lab.public.port}/slow/20"
    sock.sendall(f"GET {url} HTTP/1.1\r\nHost: public.lab.example:{lab.public.port}\r\n\r\n".encode())
    time.sleep(0.5)  # decided, connected, sent: waiting for the answer
    took, records = _stop(proxy)
    sock.close()
    answers = [r for r in records if r["event"] == "response"]
    assert len(answers) == 1, (records, proxy.stderr[-2000:])
    assert answers[0]["error"] == STOP_CUT, answers
    assert took < 6, took
    _clean(proxy)


class _Flood:
    """A raw origin on the lab's public address: reads a little, then sends without end (a client that never
    reads fills its socket buffer)."""

    def __init__(self, tls) -> None:
        self.tls = tls
        self.listener = socket.create_server((PUBLIC_IP, 0))
        self.port = self.listener.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._flood, args=(conn,), daemon=True).start()

    def _flood(self, conn: socket.socket) -> None:
        try:
            tls = self.tls.wrap_socket(conn, server_side=True)
            while True:
                tls.sendall(b"z" * 16384)
        except OSError:
            return

    def close(self) -> None:
        self.listener.close()
        for conn in self.conns:
            conn.close()


class _Deaf:
    """A listener on the lab's public address whose accept queue is full: a connect to it hangs (SYNs dropped)."""

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind((PUBLIC_IP, 0))
        self.listener.listen(0)
        self.port = self.listener.getsockname()[1]
        self.fillers = []
        for _ in range(3):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex((PUBLIC_IP, self.port))
            self.fillers.append(s)
        time.sleep(0.3)

    def close(self) -> None:
        for s in self.fillers:
            s.close()
        self.listener.close()


def _with_connect_port(lab, port: int, limits: str = GRACE) -> str:
    tls_ports = sorted({443, lab.public_tls.port})
    return lab.policy_text(limits=limits).replace(f"  connect: {tls_ports}", f"  connect: {sorted({*tls_ports, port})}")


@both_transports
def test_a_tunnel_whose_client_never_reads_gets_its_record_at_a_stop(lab, start_proxy, tmp_path):
    import ssl

    from labnet import self_signed

    flood = _Flood(self_signed(["public.lab.example"], str(tmp_path))[0])
    try:
        proxy = start_proxy(_with_connect_port(lab, flood.port))
        sock, status, _ = proxy.connect(f"public.lab.example:{flood.port}")
        assert status == 200
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        tls = context.wrap_socket(sock, server_hostname="public.lab.example")  # handshake, then read nothing
        time.sleep(1)  # the origin floods; the client reads nothing
        took, records = _stop(proxy)
        tls.close()
        tunnels = [r for r in records if r["event"] == "tunnel"]
        assert len(tunnels) == 1 and tunnels[0]["error"] == STOP_CUT, records
        assert took < 6, took
        _clean(proxy)
    finally:
        flood.close()


@both_transports
def test_a_tunnel_whose_connect_hangs_at_a_stop_gets_its_record(lab, start_proxy):
    deaf = _Deaf()
    try:
        proxy = start_proxy(_with_connect_port(lab, deaf.port, "limits: {tunnel_grace: 1, connect_timeout: 20}\n"))
        sock = socket.create_connection((proxy.host, proxy.port), timeout=10)
        authority = f"public.lab.example:{deaf.port}"
        sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        time.sleep(0.5)
        took, all_records = _stop(proxy)
        sock.close()
        decisions = [r for r in proxy.audit() if r["event"] == "decision"]
        tunnels = [r for r in all_records if r["event"] == "tunnel"]
        assert decisions and decisions[0]["verdict"] == "allow", proxy.audit()
        assert len(tunnels) == 1, (proxy.audit(), proxy.stderr[-2000:])
        assert took < 6, took
        _clean(proxy)
    finally:
        deaf.close()


@both_transports
def test_an_idle_keep_alive_connection_gets_no_record_at_a_stop(lab, start_proxy):
    proxy = start_proxy(lab.policy_text(limits=GRACE))
    sock = socket.create_connection((proxy.host, proxy.port), timeout=10)
    url = f"http://public.lab.example:{lab.public.port}/x"
    sock.sendall(f"GET {url} HTTP/1.1\r\nHost: public.lab.example:{lab.public.port}\r\n\r\n".encode())
    data = b""
    while b"hello from" not in data:
        data += sock.recv(65536)
    took, records = _stop(proxy)
    sock.close()
    answers = [r for r in records if r["event"] == "response"]
    assert len(answers) == 1 and answers[0]["error"] is None and answers[0]["status"] == 200, records
    assert took < 6, took
    _clean(proxy)


INTERCEPTED = "public.lab.example"


@both_transports
@pytest.mark.parametrize("inside", ["nothing", "handshake", "one-request"])
def test_an_intercepted_tunnel_open_at_a_stop_gets_one_record(lab, start_proxy, tmp_path, inside):
    from intercept_client import RecordingTlsOrigin, open_intercepted
    from labnet import self_signed

    context, cert = self_signed([INTERCEPTED], str(tmp_path))
    origin = RecordingTlsOrigin(context)
    try:
        text = (_with_connect_port(lab, origin.port)
                + f"hosts:\n  allow:\n    - host: {INTERCEPTED}\n      intercept: true\n")
        proxy = start_proxy(text, "--confdir", str(tmp_path / "ca"), "--upstream-ca", str(cert))
        if inside == "nothing":
            sock, status, _ = proxy.connect(f"{INTERCEPTED}:{origin.port}")
            assert status == 200
        else:
            sock, _ = open_intercepted(proxy, INTERCEPTED, origin.port)
            if inside == "one-request":
                sock.sendall(f"GET /one HTTP/1.1\r\nHost: {INTERCEPTED}:{origin.port}\r\n\r\n".encode())
                data = b""
                while b"\r\n\r\n" not in data:
                    data += sock.recv(65536)
        time.sleep(0.3)
        took, records = _stop(proxy)
        sock.close()
        tunnels = [r for r in records if r["event"] == "tunnel"]
        assert len(tunnels) == 1, (proxy.audit(), proxy.stderr[-2000:])
        responses = [r for r in records if r["event"] == "response"]
        assert len(responses) == (1 if inside == "one-request" else 0), records
        assert took < 6, took
        _clean(proxy)
    finally:
        origin.close()


def _tls_tunnel(proxy, lab):
    import ssl

    sock, status, _ = proxy.connect(f"public.lab.example:{lab.public_tls.port}")
    assert status == 200
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    return context.wrap_socket(sock, server_hostname="public.lab.example")


@pytest.mark.parametrize("transport", ["fast"], indirect=True)
def test_workers_2_a_relaying_tunnel_gets_its_record_at_a_stop(lab, start_proxy, transport):
    proxy = start_proxy(lab.policy_text(limits=GRACE), "--workers", "2")
    tls = _tls_tunnel(proxy, lab)
    took, records = _stop(proxy)
    tls.close()
    tunnels = [r for r in records if r["event"] == "tunnel"]
    assert len(tunnels) == 1 and tunnels[0]["error"] == STOP_CUT, records
    assert took < 8, took
    _clean(proxy)


@both_transports
def test_hundreds_of_open_connections_each_get_one_record_at_a_stop(lab, start_proxy):
    proxy = start_proxy(lab.policy_text(limits=GRACE))
    tunnels = [_tls_tunnel(proxy, lab) for _ in range(150)]
    idle = []
    for _ in range(100):
        sock = socket.create_connection((proxy.host, proxy.port), timeout=10)
        sock.sendall(f"GET http://public.lab.example:{lab.public.port}/k HTTP/1.1\r\n"
                     f"Host: public.lab.example:{lab.public.port}\r\n\r\n".encode())
        data = b""
        while b"hello from" not in data:
            data += sock.recv(65536)
        idle.append(sock)
    took, records = _stop(proxy)
    for sock in tunnels + idle:
        sock.close()
    ids = [r["id"] for r in records if r["event"] == "tunnel"]
    assert len(ids) == 150 == len(set(ids)), len(ids)
    assert all(r["error"] == STOP_CUT for r in records if r["event"] == "tunnel")
    assert len([r for r in records if r["event"] == "response"]) == 100
    assert took < 8, took
    _clean(proxy)
