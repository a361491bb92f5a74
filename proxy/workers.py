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

_STARTED = re.compile(r"^egresswall: proxy on (\S+):(\d+), admin on http://(\S+):(\d+),")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{.*\})?) (\S+)$")
_ALL_MUST_HOLD = {"egresswall_policy_loaded"}  # gauges where the pool is only as good as its worst worker


class Worker:
    def __init__(self, index: int, argv: list[str]) -> None:
        self.index, self.argv = index, argv
        self.process: asyncio.subprocess.Process | None = None
        self.admin: tuple[str, int] | None = None
        self.started = asyncio.Event()
        self.last_metrics = ""  # what it reported last, carried over when it is restarted
        self.restarts = 0

    async def start(self) -> None:
        self.started.clear()
        self.admin = None
        # -P: the working directory must not shadow egresswall's packages. A long line must not kill
        # the relay of this worker's messages (limit).
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-P", "-m", "proxy.cli", *self.argv, stderr=asyncio.subprocess.PIPE, limit=1 << 20)
        asyncio.get_running_loop().create_task(self._relay_stderr())

    async def _relay_stderr(self) -> None:
        """Pass the worker's messages on (prefixed) and learn its admin port from its start line."""
        assert self.process is not None and self.process.stderr is not None
        async for raw in self.process.stderr:
            line = raw.decode(errors="replace").rstrip("\n")
            match = None if self.started.is_set() else _STARTED.match(line)  # only its first start line
            if match:
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
        self.carried: dict[str, float] = {}  # counters of workers that were restarted

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):  # before any worker exists: no window without them
            loop.add_signal_handler(sig, self._stop)
        for sig in (signal.SIGHUP, signal.SIGUSR1):
            loop.add_signal_handler(sig, self._forward, sig)
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
        try:
            for worker in self.workers:
                await worker.start()
            await asyncio.wait_for(asyncio.gather(*(w.started.wait() for w in self.workers)), timeout=60)
        except (TimeoutError, OSError) as err:
            print(f"egresswall: workers did not start ({err or 'timed out'}); stopping them", file=sys.stderr)
            self._stop()
            await asyncio.gather(*(w.process.wait() for w in self.workers if w.process))
            await self.admin.stop()
            return 1
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
                worker.restarts += 1
                delay = min(30.0, 0.5 * 2 ** min(worker.restarts - 1, 6))  # a worker that keeps failing backs off
                print(f"egresswall: worker {worker.index} exited with {task.result()}; restarting it in {delay:g}s",
                      file=sys.stderr, flush=True)
                await asyncio.sleep(delay)
                if self.stopping:  # SIGTERM during the pause: do not start what nobody will stop
                    break
                self._carry_over(worker)
                await worker.start()

    def _carry_over(self, worker: Worker) -> None:
        """Counters must not go down when a worker restarts from zero: keep what it had counted."""
        for line in worker.last_metrics.splitlines():
            match = _SAMPLE.match(line)
            if match and _is_counter(match.group(1)):
                self.carried[match.group(1)] = self.carried.get(match.group(1), 0.0) + float(match.group(2))
        worker.last_metrics = ""

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
        texts = []
        for worker in self.workers:
            text = _fetch(worker.admin, "/metrics") if worker.admin else ""
            if text.startswith("# HELP"):
                worker.last_metrics = text
            texts.append(worker.last_metrics)  # an unreachable worker counts with what it last said
        return 200, "text/plain; version=0.0.4; charset=utf-8", sum_metrics(texts, self.carried)


def _fetch(address: tuple[str, int] | None, path: str) -> str:
    """A blocking GET to a worker's admin listener on loopback (short, bounded)."""
    if address is None:
        return ""
    try:
        with socket.create_connection(address, timeout=0.5) as sock:  # loopback: anything slower is down
            sock.sendall(f"GET {path} HTTP/1.0\r\n\r\n".encode())
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        return data.partition(b"\r\n\r\n")[2].decode(errors="replace")
    except OSError as err:
        return f"unreachable: {err}"


def _is_counter(series: str) -> bool:
    name = series.split("{", 1)[0]
    return name.endswith(("_total", "_sum", "_count"))


def sum_metrics(texts: list[str], carried: dict[str, float] | None = None) -> str:
    """Add the workers' samples up, series by series; comments come from the first worker. ``carried``
    holds the counters of workers that were restarted since."""
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
    for key in carried or {}:  # a series only a restarted worker had counted still counts
        if key not in values:
            values[key] = []
            order.setdefault(key.split("{", 1)[0], []).append(key)
    out = []
    for fam, lines in order.items():
        for line in lines:
            if line.startswith("# "):
                out.append(line)
            else:
                samples = values[line]
                total = min(samples) if fam in _ALL_MUST_HOLD else sum(samples) + (carried or {}).get(line, 0.0)
                out.append(f"{line} {int(total) if total.is_integer() else repr(total)}")
    return "\n".join(out) + "\n"


