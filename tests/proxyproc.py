"""Start the real proxy (``egresswall run``) in a subprocess for a test, and talk to it."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Runs inside the proxy process before egresswall starts. It records every outbound connect and every
# getaddrinfo call on a name, and refuses (without sending a packet) any connect that is not to loopback:
# a bug that tried to reach a real address shows up as a failed test, never as traffic.
GUARD_PRELUDE = """
import asyncio, ipaddress, json, os, socket
import asyncio.selector_events as _selector_events
import uvloop as _uvloop
_guard_path = GUARD_PATH
def _loop_name():
    try:
        return type(asyncio.get_running_loop()).__name__
    except RuntimeError:
        return None
def _record(kind, host, port):
    with open(_guard_path, "a") as f:
        f.write(json.dumps({"kind": kind, "host": str(host), "port": port, "loop": _loop_name()}) + "\\n")
def _is_ip(host):
    try:
        ipaddress.ip_address(str(host).split("%")[0]); return True
    except ValueError:
        return False
def _connecting(host, port):
    _record("connect", host, port)
    if not (_is_ip(host) and ipaddress.ip_address(str(host).split("%")[0]).is_loopback):
        raise OSError("test guard: refusing a connect to a non-loopback address " + str(host))
def _resolving(host, port):
    if host is not None and not _is_ip(host if isinstance(host, str) else host.decode()):
        _record("getaddrinfo", host, port)
_orig_gai = socket.getaddrinfo
def _gai(host, port, *a, **k):
    _resolving(host, port)
    return _orig_gai(host, port, *a, **k)
socket.getaddrinfo = _gai
_orig_cc = asyncio.BaseEventLoop.create_connection
async def _cc(self, protocol_factory, host=None, port=None, *a, **k):
    if host is not None:
        _connecting(host, port)
    return await _orig_cc(self, protocol_factory, host, port, *a, **k)
asyncio.BaseEventLoop.create_connection = _cc
# A UDP endpoint with remote_addr the same way (checked before the loop resolves the name, as above).
_orig_cde = asyncio.BaseEventLoop.create_datagram_endpoint
async def _cde(self, protocol_factory, local_addr=None, remote_addr=None, **k):
    if remote_addr is not None and k.get("family", 0) != socket.AF_UNIX:
        _connecting(remote_addr[0], remote_addr[1])
    return await _orig_cde(self, protocol_factory, local_addr, remote_addr, **k)
asyncio.BaseEventLoop.create_datagram_endpoint = _cde
# loop.sock_connect too: proxy/front.py connects its tunnels with it, past create_connection.
# (A create_connection is recorded twice, once per layer; the checks look at addresses, not counts.)
_orig_sc = _selector_events.BaseSelectorEventLoop.sock_connect
async def _sc(self, sock, address):
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        _connecting(address[0], address[1])
    return await _orig_sc(self, sock, address)
_selector_events.BaseSelectorEventLoop.sock_connect = _sc
# And the socket's own connect (proxy/dial.py connects that way, past the loop): every TCP connect a
# Python socket object makes.
_orig_connect, _orig_connect_ex = socket.socket.connect, socket.socket.connect_ex
def _socket_connect(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6):
        _connecting(address[0], address[1])
    return _orig_connect(self, address)
def _socket_connect_ex(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6):
        _connecting(address[0], address[1])
    return _orig_connect_ex(self, address)
socket.socket.connect, socket.socket.connect_ex = _socket_connect, _socket_connect_ex
# Datagrams: the socket's own sendto (the standard loop's UDP transport sends with it), and dnspython's
# asyncio datagram socket, whose transport on uvloop sends in C past every patch here. Recorded as
# "datagram": the proxy's DNS queries go to the lab's own resolver on loopback, and nowhere else.
def _sending(host, port):
    _record("datagram", host, port)
    if not (_is_ip(host) and ipaddress.ip_address(str(host).split("%")[0]).is_loopback):
        raise OSError("test guard: refusing a datagram to a non-loopback address " + str(host))
_orig_sendto = socket.socket.sendto
def _socket_sendto(self, data, *rest):
    if self.family in (socket.AF_INET, socket.AF_INET6) and rest and isinstance(rest[-1], tuple):
        _sending(rest[-1][0], rest[-1][1])
    return _orig_sendto(self, data, *rest)
socket.socket.sendto = _socket_sendto
import dns._asyncio_backend as _dns_asyncio
_orig_dns_sendto = _dns_asyncio._DatagramSocket.sendto
async def _dns_sendto(self, what, destination, timeout):
    if destination is not None:
        _sending(destination[0], destination[1])
    return await _orig_dns_sendto(self, what, destination, timeout)
_dns_asyncio._DatagramSocket.sendto = _dns_sendto
# uvloop's loop (the proxy's default, proxy/event_loop.py) is C and resolves with libuv, past the patches
# above: the loops it makes are a subclass that records and refuses the same way.
class _GuardedLoop(_uvloop.Loop):
    async def create_connection(self, protocol_factory, host=None, port=None, *a, **k):
        if host is not None:
            _connecting(host, port)
        return await super().create_connection(protocol_factory, host, port, *a, **k)
    async def sock_connect(self, sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            _connecting(address[0], address[1])
        return await super().sock_connect(sock, address)
    async def getaddrinfo(self, host, port, *a, **k):
        _resolving(host, port)
        return await super().getaddrinfo(host, port, *a, **k)
    # A UDP endpoint with remote_addr: uvloop connects it in C, which no patch above sees (the standard
    # loop's goes through the patches above).
    async def create_datagram_endpoint(self, protocol_factory, local_addr=None, remote_addr=None, **k):
        if remote_addr is not None and k.get("family", 0) != socket.AF_UNIX:
            _connecting(remote_addr[0], remote_addr[1])
        return await super().create_datagram_endpoint(protocol_factory, local_addr, remote_addr, **k)
_uvloop.new_event_loop = _GuardedLoop
"""
# The workers of `run --workers N` are processes of their own (proxy/workers.py starts them with
# `python -P -m proxy.cli.worker`): each is started with the same guard, writing to the same file, so what a
# worker connects to is seen too.
WORKER_GUARD = """
import asyncio as _asyncio_for_workers
_start_process = _asyncio_for_workers.create_subprocess_exec
_worker_code = WORKER_PRELUDE + chr(10).join(["", "import runpy",
                                              "runpy.run_module('proxy.cli.worker', run_name='__main__')"])
async def _guarded_worker(program, *args, **kwargs):
    if tuple(args[:3]) == ("-P", "-m", "proxy.cli.worker"):
        args = ("-P", "-c", _worker_code, *args[3:])
    return await _start_process(program, *args, **kwargs)
_asyncio_for_workers.create_subprocess_exec = _guarded_worker
"""
# The start-up line, "proxy on HOST:PORT, admin on http://HOST:PORT; ...": an IPv6 host in brackets.
_HOST = r"(?:\[(?P<{0}6>[0-9a-fA-F:.]+)\]|(?P<{0}>[^\s:;,\[\]]+))"
_ADDRESS = re.compile(rf"proxy on {_HOST.format('host')}:(?P<port>\d+)"
                      rf"(?:, admin on http://{_HOST.format('admin')}:(?P<admin_port>\d+))?")


# The two transports every enforcement, hardening and smuggling suite runs against: egresswall's own
# front relaying tunnels and plain HTTP itself (proxy/front.py, proxy/fast_http.py), and mitmproxy's
# layers for both.
TRANSPORTS = {"fast": ["--fast-tunnels", "--fast-http"], "mitmproxy": ["--no-fast-tunnels", "--no-fast-http"]}
# A test that starts its own proxy (conftest's start_proxy) runs on both transports with this mark.
both_transports = pytest.mark.parametrize("transport", list(TRANSPORTS), indirect=True)


class ProxyProcess:
    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None,
                 prelude: str = "") -> None:
        """``prelude``: test code run in the proxy process after the guard, before egresswall starts (to
        count work inside it)."""
        self.log_path = log_path
        self.guard_path = log_path.with_suffix(".guard")
        guard = GUARD_PRELUDE.replace("GUARD_PATH", repr(str(self.guard_path)))
        prelude = guard + WORKER_GUARD.replace("WORKER_PRELUDE", repr(guard)) + prelude
        command = [sys.executable, "-c", prelude + "\nimport sys\nfrom proxy.cli import main\n"
                   "sys.exit(main(sys.argv[1:]))", "run", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0",
                   "--log", str(log_path), *args]
        self.stderr_path = log_path.with_suffix(".stderr")
        self._stderr = open(self.stderr_path, "wb")  # noqa: SIM115 - kept open for the process's life
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self._stderr,
                                        env={**os.environ, **(env or {})})
        self.host, self.port, self.admin_port = self._wait_started()

    def _wait_started(self, timeout: float = 30) -> tuple[str, int, int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.stderr_path.read_text(errors="replace")
            match = _ADDRESS.search(text)
            if match:
                return match["host6"] or match["host"], int(match["port"]), int(match["admin_port"] or 0)
            if self.process.poll() is not None:
                raise RuntimeError(f"proxy exited with {self.process.returncode}:\n{text}")
            time.sleep(0.05)
        raise RuntimeError(f"proxy did not start:\n{self.stderr_path.read_text(errors='replace')}")

    def guard_events(self) -> list[dict]:
        """What the guard inside the proxy process saw: outbound connects, datagrams and getaddrinfo calls."""
        if not self.guard_path.exists():
            return []
        return [json.loads(line) for line in self.guard_path.read_text().splitlines() if line.strip()]

    def outbound(self) -> list[dict]:
        return [e for e in self.guard_events() if e["kind"] == "connect"]

    def datagrams(self) -> list[dict]:
        """UDP datagrams the proxy sent (its DNS queries), each with its destination."""
        return [e for e in self.guard_events() if e["kind"] == "datagram"]

    def getaddrinfo_names(self) -> list[str]:
        return [e["host"] for e in self.guard_events() if e["kind"] == "getaddrinfo"]

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def audit(self) -> list[dict]:
        """The audit lines written so far; a line still being written (no newline yet) is not one of them."""
        lines = self.log_path.read_text().split("\n")
        return [json.loads(line) for line in lines[:-1] if line.strip()]

    def decisions(self) -> list[dict]:
        return [r for r in self.audit() if r["event"] == "decision"]

    def signal(self, sig: int) -> None:
        self.process.send_signal(sig)

    def stop(self, timeout: float = 15) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._stderr.close()
        return self.process.returncode

    # ---- clients ------------------------------------------------------------------------------

    def raw(self, data: bytes, timeout: float = 10) -> bytes:
        """Send raw bytes to the proxy and read until it closes or the response is complete."""
        with socket.create_connection((self.host, self.port), timeout=timeout) as sock:
            sock.sendall(data)
            return read_response(sock)

    def get(self, url: str, headers: dict[str, str] | None = None, method: str = "GET",
            body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
        host = url.split("/")[2]
        given = headers or {}
        # A Host among ``headers`` stands in for the URL's (one Host header, as a client sends it).
        lines = [f"{method} {url} HTTP/1.1"] + ([] if "host" in map(str.lower, given) else [f"Host: {host}"])
        lines += ["Connection: close"] + [f"{k}: {v}" for k, v in given.items()]
        if body:
            lines.append(f"Content-Length: {len(body)}")
        return parse_response(self.raw(("\r\n".join(lines) + "\r\n\r\n").encode() + body))

    def connect(self, authority: str, timeout: float = 10) -> tuple[socket.socket, int, dict[str, str]]:
        """Open a CONNECT tunnel; returns the socket (caller closes), the status and headers."""
        sock = socket.create_connection((self.host, self.port), timeout=timeout)
        sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(4096)
            if not chunk:
                break
            head += chunk
        status, headers, _ = parse_response(head)
        return sock, status, headers

    def admin(self, path: str) -> tuple[int, str]:
        with socket.create_connection((self.host, self.admin_port), timeout=10) as sock:
            sock.sendall(f"GET {path} HTTP/1.0\r\n\r\n".encode())
            status, _, body = parse_response(read_response(sock))
            return status, body.decode()


def read_response(sock: socket.socket) -> bytes:
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            break
        if not chunk:
            break
        data += chunk
        head, sep, body = data.partition(b"\r\n\r\n")
        if sep:
            length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
            if length and len(body) >= int(length.group(1)):
                break
    return data


def parse_response(data: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    if not lines or not lines[0].startswith("HTTP/"):
        return 0, {}, data
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        key, _, value = line.partition(":")
        headers[key.strip().lower()] = value.strip()
    return status, headers, body


def proxy_with_origins(lab, folder: Path, origin_ports: Iterable[int], transport: str, limits: str) -> ProxyProcess:
    """The lab policy with the scripted origins' ports added to ports.http and ``limits`` (YAML), on
    ``transport`` (a TRANSPORTS key); the caller stops it and checks its outbound connections."""
    ports = sorted({80, lab.public.port, *origin_ports})
    text = lab.policy_text(limits=limits).replace(f"  http: {sorted({80, lab.public.port})}", f"  http: {ports}")
    policy = folder / "policy.yaml"
    policy.write_text(text)
    process = ProxyProcess(["--policy", str(policy), *TRANSPORTS[transport]], folder / "audit.jsonl")
    process.transport = transport
    return process


def serve_module_proxy(folder: Path, policy_text: str, transport: str) -> Iterator[ProxyProcess]:
    """For a module-scoped fixture (``yield from``): a proxy on ``transport`` (a TRANSPORTS key) with
    ``policy_text``, stopped after the module, and then checked to have connected to the lab's public
    address only."""
    from labnet import PUBLIC_IP

    policy = folder / "policy.yaml"
    policy.write_text(policy_text)
    process = ProxyProcess(["--policy", str(policy), *TRANSPORTS[transport]], folder / "audit.jsonl")
    process.transport = transport
    yield process
    process.stop()
    assert not [e for e in process.outbound() if e["host"] != PUBLIC_IP], process.outbound()
