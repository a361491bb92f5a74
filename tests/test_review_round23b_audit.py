"""Review round 23b (ops): the audit log on a pipe or FIFO (proxy/audit.py, commit 4d893a0). These tests FAIL on
the tree they were written against (see each docstring)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import threading
import time

import pytest
from proxyproc import TRANSPORTS, ProxyProcess, parse_response, read_response

pytestmark = pytest.mark.integration


def _timed(proxy: ProxyProcess, data: bytes, timeout: float) -> tuple[int, float, bytes]:
    started = time.monotonic()
    try:
        with socket.create_connection((proxy.host, proxy.port), timeout=timeout) as sock:
            sock.sendall(data)
            answer = read_response(sock)
    except OSError:
        answer = b""
    status, _, body = parse_response(answer)
    return status, time.monotonic() - started, body


def _get(url: str) -> bytes:
    host = url.split("/")[2]
    return f"GET {url} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()


def _readyz(proxy: ProxyProcess, timeout: float = 3) -> tuple[int, float]:
    started = time.monotonic()
    try:
        with socket.create_connection((proxy.host, proxy.admin_port), timeout=timeout) as sock:
            sock.sendall(b"GET /readyz HTTP/1.0\r\n\r\n")
            status = parse_response(read_response(sock))[0]
    except OSError:
        status = 0
    return status, time.monotonic() - started


def _drain_in_background(reader: int) -> threading.Thread:
    def drain() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if not os.read(reader, 1 << 20):
                    time.sleep(0.02)
            except BlockingIOError:
                time.sleep(0.02)
            except OSError:
                return
    drainer = threading.Thread(target=drain, daemon=True)
    drainer.start()
    return drainer


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_a_long_line_taken_in_part_by_a_stalled_pipe_freezes_the_proxy(lab, tmp_path, transport):
    """README 'When the audit log cannot be written' / proxy/audit.py's docstring: a pipe "is written without
    waiting ...: a line it cannot take now is a failed write, which fails closed the documented way (503 audit,
    /readyz 503)". But AuditLog._write_without_waiting (proxy/audit.py:136-137) finishes a line the pipe took
    only in part with *blocking* os.write calls, on the assumption that "its reader is reading". A pipe takes part
    of a line longer than PIPE_BUF whenever it has any free page, reader or not: the reader stalled with the pipe
    all but full, one request whose decision line is over 4 KiB (a long URL, well under max_header_bytes) is
    written in part and the event loop then blocks in os.write until the reader reads again: every client, every
    tunnel and /readyz get no answer at all (the very freeze round 23 fixed for whole lines)."""
    fifo = tmp_path / "audit.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    filler = None
    proxy = None
    try:
        policy = tmp_path / "policy.yaml"
        policy.write_text(lab.policy_text())
        proxy = ProxyProcess(["--policy", str(policy), *TRANSPORTS[transport]], fifo)
        url = f"http://public.lab.example:{lab.public.port}/r23b-ops"
        assert _timed(proxy, _get(url + "-before"), 5)[0] == 200
        time.sleep(0.3)  # the request's closing record too
        with contextlib.suppress(BlockingIOError):
            while os.read(reader, 1 << 20):
                pass
        # The reader stalls with the pipe full but for one page: fill it with whole pages, free one page.
        filler = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        assert fcntl.fcntl(filler, fcntl.F_GETPIPE_SZ) == 1 << 20  # grown by the proxy
        page = b"#" * 4095 + b"\n"
        with contextlib.suppress(BlockingIOError):
            while True:
                os.write(filler, page)
        os.read(reader, 4096)  # one page free, the reader stalled
        long_url = url + "-" + "a" * 6000  # a decision line of about 6.5 KB
        status, took, _ = _timed(proxy, _get(long_url), 4)
        after, after_took, _ = _timed(proxy, _get(url + "-after"), 4)
        ready, ready_took = _readyz(proxy)
    finally:
        drainer = _drain_in_background(reader)
        if proxy is not None:
            proxy.stop()
        if filler is not None:
            os.close(filler)
        drainer.join(1)
        with contextlib.suppress(OSError):
            os.close(reader)
    assert after in (200, 503) and after_took < 3 and ready in (200, 503) and ready_took < 3, (
        f"after a {len(long_url)}-byte URL's decision line met a stalled audit pipe with one page free: that "
        f"request got {status} after {took:.1f}s, the next {after} after {after_took:.1f}s, /readyz {ready} after "
        f"{ready_took:.1f}s (0: no answer): the proxy froze in a blocking write")


def test_sigusr1_reopening_a_fifo_whose_reader_is_gone_freezes_the_proxy(lab, tmp_path):
    """README: "--log FILE ... SIGUSR1 reopens it"; proxy/audit.py's docstring (round 23) promises the log on a
    pipe never stops the event loop. AuditLog.reopen (proxy/audit.py:82), run on the event loop by SIGUSR1
    (proxy/runner.py:133), opens the path with a blocking os.open(O_WRONLY): on a FIFO whose reader has gone (a
    log shipper restarting, the usual moment for a reopen) that open waits until some reader opens it, and the
    whole proxy (clients, tunnels, /readyz) waits with it. Expected: the reopen fails or succeeds at once
    (O_NONBLOCK then ENXIO: the log stays failed, 503 audit), every client is answered within a few seconds."""
    fifo = tmp_path / "audit.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    proxy = None
    late_reader = None
    try:
        policy = tmp_path / "policy.yaml"
        policy.write_text(lab.policy_text())
        proxy = ProxyProcess(["--policy", str(policy), *TRANSPORTS["fast"]], fifo)
        url = f"http://public.lab.example:{lab.public.port}/r23b-reopen"
        assert _timed(proxy, _get(url + "-before"), 5)[0] == 200
        os.close(reader)
        reader = None
        refused, _, body = _timed(proxy, _get(url + "-no-reader"), 4)  # EPIPE: fails closed
        proxy.signal(signal.SIGUSR1)
        time.sleep(0.5)
        status, took, _ = _timed(proxy, _get(url + "-after-reopen"), 4)
        ready, ready_took = _readyz(proxy)
    finally:
        if reader is None:
            # Unblock a proxy stuck in open() so it can be stopped.
            late_reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
            _drain_in_background(late_reader)
        if proxy is not None:
            proxy.stop()
        for fd in (reader, late_reader):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
    assert refused == 503 and b"audit" in body, (refused, body[:200])
    assert status in (200, 503) and took < 3 and ready in (200, 503) and ready_took < 3, (
        f"after SIGUSR1 with the FIFO's reader gone a client got {status} after {took:.1f}s and /readyz {ready} "
        f"after {ready_took:.1f}s (0: no answer): the event loop is blocked in os.open of the FIFO")
