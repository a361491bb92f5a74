"""``egresswall run --workers N``: N proxy processes share one listen port (SO_REUSEPORT).

mitmproxy runs one event loop on one core; the kernel spreads incoming connections over the
workers, each of which builds its own decision state from the policy file and watches it. The
supervisor (this module) owns the admin listener — ``/metrics`` is the sum over workers,
``/readyz`` is ready when every worker is — forwards SIGHUP/SIGUSR1/SIGTERM, and restarts a worker
that dies. Every worker appends whole lines to the same audit log (one ``write`` per line on an
O_APPEND file), so the log stays one log. Connection caps are shared out: each worker enforces
1/N of them, which holds on average because the kernel hashes connections evenly.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import socket
import sys
from collections import OrderedDict

from .admin import AdminServer

_STARTED = re.compile(r"proxy on (\S+):(\d+)(?:, admin on http://(\S+):(\d+))?")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{.*\})?) (\S+)$")
_ALL_MUST_HOLD = {"egresswall_policy_loaded"}  # gauges where the pool is only as good as its worst worker


class Worker:
    def __init__(self, index: int, argv: list[str]) -> None:
        self.index, self.argv = index, argv
        self.process: asyncio.subprocess.Process | None = None
        self.admin: tuple[str, int] | None = None
        self.started = asyncio.Event()

    async def start(self) -> None:
        self.started.clear()
        self.admin = None
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy.cli", *self.argv, stderr=asyncio.subprocess.PIPE)
        asyncio.get_running_loop().create_task(self._relay_stderr())

    async def _relay_stderr(self) -> None:
        """Pass the worker's messages on (prefixed) and learn its admin port from its start line."""
        assert self.process is not None and self.process.stderr is not None
        async for raw in self.process.stderr:
            line = raw.decode(errors="replace").rstrip("\n")
            match = _STARTED.search(line)
            if match and match.group(4):
                self.admin = (match.group(3), int(match.group(4)))
                self.started.set()
                continue
            print(f"[worker {self.index}] {line}", file=sys.stderr, flush=True)


class Supervisor:
    def __init__(self, worker_argv: list[str], workers: int, listen: tuple[str, int],
                 admin: tuple[str, int] | None) -> None:
        self.worker_argv, self.count, self.listen, self.admin_address = worker_argv, workers, listen, admin
        self.workers: list[Worker] = []
        self.admin = AdminServer({"/healthz": lambda: (200, "text/plain", "ok\n"), "/readyz": self._readyz,
                                  "/metrics": self._metrics})
        self.stopping = False
        self._cached_metrics: tuple[float, str] = (0.0, "")

    async def run(self) -> int:
        host, port = self.listen
        if port == 0:  # every worker must bind the same port: choose it here
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
                probe.bind((host, 0))
                port = probe.getsockname()[1]
            self.listen = (host, port)
        admin = None
        if self.admin_address is not None:
            admin = await self.admin.start(*self.admin_address)
        also_self = ["--also-self", f"{admin[0]}:{admin[1]}"] if admin else []
        argv = [*self.worker_argv, "--listen", f"{host}:{port}", "--admin", "127.0.0.1:0", "--reuse-port",
                "--worker-count", str(self.count), *also_self]
        self.workers = [Worker(i, argv) for i in range(self.count)]
        for worker in self.workers:
            await worker.start()
        await asyncio.wait_for(asyncio.gather(*(w.started.wait() for w in self.workers)), timeout=60)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop)
        for sig in (signal.SIGHUP, signal.SIGUSR1):
            loop.add_signal_handler(sig, self._forward, sig)
        print(f"egresswall: proxy on {host}:{port}" + (f", admin on http://{admin[0]}:{admin[1]}" if admin else "")
              + f", {self.count} workers", file=sys.stderr, flush=True)
        await self._supervise()
        await self.admin.stop()
        return 0

    async def _supervise(self) -> None:
        while True:
            waits = {asyncio.ensure_future(w.process.wait()): w for w in self.workers if w.process}
            done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            if self.stopping:
                await asyncio.gather(*(w.process.wait() for w in self.workers if w.process))
                return
            for task in done:
                worker = waits[task]
                print(f"egresswall: worker {worker.index} exited with {task.result()}; restarting it",
                      file=sys.stderr, flush=True)
                await asyncio.sleep(0.5)  # a worker that fails at once must not spin the CPU
                await worker.start()

    def _stop(self) -> None:
        self.stopping = True
        self._forward(signal.SIGTERM)

    def _forward(self, sig: int) -> None:
        for worker in self.workers:
            if worker.process and worker.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.send_signal(sig)

    # ---- admin --------------------------------------------------------------------------------

    def _readyz(self) -> tuple[int, str, str]:
        missing = [w.index for w in self.workers if w.admin is None or w.process is None
                   or w.process.returncode is not None]
        texts = [_fetch(w.admin, "/readyz") for w in self.workers if w.admin]
        problems = [t for t in texts if not t.startswith("ready")]
        if missing or problems or self.stopping:
            return 503, "text/plain", f"not ready: workers down {missing}; {'; '.join(problems)}\n"
        return 200, "text/plain", f"ready; {self.count} workers\n"

    def _metrics(self) -> tuple[int, str, str]:
        texts = [_fetch(w.admin, "/metrics") for w in self.workers if w.admin]
        return 200, "text/plain; version=0.0.4; charset=utf-8", sum_metrics(texts)


def _fetch(address: tuple[str, int] | None, path: str) -> str:
    """A blocking GET to a worker's admin listener on loopback (short, bounded)."""
    if address is None:
        return ""
    try:
        with socket.create_connection(address, timeout=2) as sock:
            sock.sendall(f"GET {path} HTTP/1.0\r\n\r\n".encode())
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        return data.partition(b"\r\n\r\n")[2].decode(errors="replace")
    except OSError as err:
        return f"unreachable: {err}"


def sum_metrics(texts: list[str]) -> str:
    """Add the workers' samples up, series by series; comments come from the first worker."""
    order: OrderedDict[str, list[str]] = OrderedDict()  # family comment lines, in first-seen order
    values: dict[str, list[float]] = {}
    family = ""
    for text in texts:
        for line in text.splitlines():
            if line.startswith("# "):
                family = line.split()[2]
                order.setdefault(family, [])
                if line not in order[family]:
                    order[family].append(line)
                continue
            match = _SAMPLE.match(line)
            if match:
                key = match.group(1)
                values.setdefault(key, []).append(float(match.group(2)))
                order.setdefault(family, [])
                if key not in order[family]:
                    order[family].append(key)
    out = []
    for fam, lines in order.items():
        for line in lines:
            if line.startswith("# "):
                out.append(line)
            else:
                samples = values[line]
                total = min(samples) if fam in _ALL_MUST_HOLD else sum(samples)
                out.append(f"{line} {total:g}")
    return "\n".join(out) + "\n"


