"""``egresswall run --workers N``: N proxy processes share one listen port (SO_REUSEPORT).

mitmproxy runs one event loop on one core; the kernel spreads incoming connections over the
workers, each of which builds its own decision state from the policy file and watches it. The
supervisor (this module) owns the admin listener — ``/metrics`` is the sum over workers
(``proxy/metrics_sum.py``), ``/readyz`` is ready when every worker is — forwards SIGHUP/SIGUSR1/SIGTERM,
and restarts a worker that dies. Every worker appends whole lines to the same audit log (one ``write`` per line on an
O_APPEND file), so the log stays one log. Connection caps are shared out: each worker enforces
1/N of them, which holds on average because the kernel hashes connections evenly.

A worker gets its configuration as a JSON document on its standard input and reports that it is
ready (or why it is not) as one JSON line on an inherited pipe: ``proxy/worker_config.py`` describes
both. Start-up stops at once, with the reason, when a worker fails, dies, or a stop signal arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable

from .admin import AdminServer
from .listeners import ADMIN, PROXY, ListenError, check_free
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics_sum import carry, is_page, sum_metrics
from .run_config import RunConfig
from .worker_config import FAILED, WorkerConfig, WorkerReport

START_TIMEOUT = 60.0  # seconds for every worker to report


class WorkerStartError(Exception):
    """The pool did not start: ``str()`` is one line for people; ``exit_status`` what to exit with."""

    def __init__(self, message: str, exit_status: int) -> None:
        super().__init__(message)
        self.exit_status = exit_status


class Worker:
    def __init__(self, index: int, config: RunConfig) -> None:
        self.index, self.config = index, config
        self.process: asyncio.subprocess.Process | None = None
        self.admin: str | None = None  # its admin listener's Unix socket, once it has reported ready
        self.report: WorkerReport | None = None  # what it said at its last start (None: nothing yet)
        self.reported = asyncio.Event()
        self.last_metrics = ""  # what it reported last, carried over when it is restarted
        self.restarts = 0
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        self.reported.clear()
        self.admin, self.report = None, None
        read_end, write_end = os.pipe()
        try:
            # -P: the working directory must not shadow egresswall's packages. A long line must not kill
            # the relay of this worker's messages (limit).
            self.process = await asyncio.create_subprocess_exec(
                sys.executable, "-P", "-m", "proxy.cli.worker", stdin=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, pass_fds=(write_end,), limit=1 << 20)
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)  # the worker holds it now: end of file here when it exits
        for job in (self._read_report(read_end), self._relay_stderr()):
            task = asyncio.get_running_loop().create_task(job)
            self._tasks.add(task)  # the loop keeps only a weak reference to a task
            task.add_done_callback(self._tasks.discard)
        assert self.process.stdin is not None
        self.process.stdin.write(WorkerConfig(self.config, write_end).to_json().encode())
        with contextlib.suppress(ConnectionError):  # it died already: its report and exit status say so
            await self.process.stdin.drain()
        self.process.stdin.close()

    async def _read_report(self, fd: int) -> None:
        reader = asyncio.StreamReader()
        loop = asyncio.get_running_loop()
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                    os.fdopen(fd, "rb", buffering=0))
        try:
            line = await reader.readline()
        finally:
            transport.close()
        try:
            self.report = WorkerReport.from_line(line) if line else None
        except ValueError as err:
            self.report = WorkerReport(FAILED, error=f"worker {self.index} sent a malformed report ({err})", exit=1)
        if self.ready:
            self.admin = self.config.admin_socket
        self.reported.set()

    async def _relay_stderr(self) -> None:
        """Pass the worker's messages on, prefixed with its number."""
        assert self.process is not None and self.process.stderr is not None
        async for raw in self.process.stderr:
            line = raw.decode(errors="replace").rstrip("\n")
            print(f"[worker {self.index}] {line}", file=sys.stderr, flush=True)

    @property
    def ready(self) -> bool:
        return self.report is not None and self.report.event != FAILED


class Supervisor:
    def __init__(self, config: RunConfig, workers: int,
                 on_ready: Callable[[tuple[str, int], tuple[str, int] | None], None] | None = None) -> None:
        """``config``: what every worker runs (its ``admin`` is the supervisor's own listener);
        ``on_ready(listen, admin)`` is called once every worker has reported ready."""
        self.config, self.count, self.on_ready = config, workers, on_ready
        self.listen, self.admin_address = config.listen, config.admin
        self.workers: list[Worker] = []
        self.sessions = None
        api = None
        if config.admin_token_file:
            from .sessions.api import SessionApi, read_token_file
            from .sessions.service import SessionService
            from .sessions.store_url import open_store

            self.sessions = SessionService(open_store(config.session_store), configured=True)
            api = SessionApi(self.sessions, read_token_file(config.admin_token_file))
        self.admin = AdminServer({"/healthz": lambda: (200, "text/plain", "ok\n"), "/readyz": self._readyz,
                                  "/metrics": self._metrics}, api)
        self.stopping = False
        self.stop_signal: signal.Signals | None = None
        self._stop_requested = asyncio.Event()
        self.carried = ""  # the counters and histograms of workers that were restarted (a metrics page)
        self.sockets = ""  # a directory only this user may enter, for the workers' admin sockets

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):  # before any worker exists: no window without them
            loop.add_signal_handler(sig, self._stop, sig)
        for sig in (signal.SIGHUP, signal.SIGUSR1):
            loop.add_signal_handler(sig, self._forward, sig)
        self.listen = _choose_listen_port(*self.listen)
        admin = None
        if self.admin_address is not None:
            try:
                admin = await self.admin.start(*self.admin_address)
            except OSError as err:
                raise ListenError(ADMIN, self.admin_address, err) from err
        try:
            try:
                self.sockets = _socket_folder()
                await self._start_workers(admin)
            except WorkerStartError as err:
                print(f"egresswall: {err}", file=sys.stderr, flush=True)
                await self._stop_all()
                await self.admin.stop()
                return err.exit_status
            if self.on_ready is not None:
                self.on_ready(self.listen, admin)
            await self._supervise()
            await self.admin.stop()
        finally:
            if self.sockets:
                shutil.rmtree(self.sockets, ignore_errors=True)
        print(f"egresswall: stopped at {_utc_now()}", file=sys.stderr, flush=True)
        return 0

    async def _start_workers(self, admin: tuple[str, int] | None) -> None:
        """Start every worker and wait until each has reported ready. Stops at once, with the reason,
        when one reports a failure or dies, or when a stop signal arrives."""
        # The session API is the supervisor's (on its admin listener, over the shared store); workers only judge.
        # Each worker's admin listener is a Unix socket: a loopback port of one worker's would be open to a
        # client of another through the proxy (a worker knows only its own ports to refuse them).
        config = dataclasses.replace(self.config, listen=self.listen, admin=None, reuse_port=True,
                                     worker_count=self.count,
                                     extra_self_endpoints=tuple(self.admin.addresses) if admin else (),
                                     admin_token_file=None)
        self.workers = [Worker(i, dataclasses.replace(config, admin_socket=os.path.join(self.sockets, f"worker-{i}")))
                        for i in range(self.count)]
        for worker in self.workers:
            if self.stopping:
                break
            await worker.start()
        stop = asyncio.ensure_future(self._stop_requested.wait())
        pending = {asyncio.ensure_future(w.reported.wait()): w for w in self.workers if w.process}
        deadline = _loop_time() + START_TIMEOUT
        try:
            while pending and not self.stopping:
                done, _ = await asyncio.wait({stop, *pending}, timeout=max(0.0, deadline - _loop_time()),
                                             return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    raise WorkerStartError(f"the workers did not start within {START_TIMEOUT:g} seconds; "
                                           "stopping them", 1)
                for task in done - {stop}:
                    worker = pending.pop(task)
                    if not worker.ready:
                        raise WorkerStartError(await self._why_not_started(worker), _exit_status(worker))
        finally:
            stop.cancel()
            for task in pending:
                task.cancel()
        if self.stopping:
            name = self.stop_signal.name if self.stop_signal else "a stop request"
            raise WorkerStartError(f"start-up interrupted by {name}; the workers were stopped",
                                   128 + (self.stop_signal or signal.SIGTERM))

    async def _why_not_started(self, worker: Worker) -> str:
        if worker.report is not None and worker.report.error:
            return f"worker {worker.index} could not start: {worker.report.error}"
        assert worker.process is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(worker.process.wait(), 5)
        return (f"worker {worker.index} exited during start-up (status {worker.process.returncode}); "
                "its messages above say why")

    async def _stop_all(self) -> None:
        self.stopping = True
        self._forward(signal.SIGTERM)
        await asyncio.gather(*(w.process.wait() for w in self.workers if w.process))

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
                why = f" ({worker.report.error})" if worker.report is not None and worker.report.error else ""
                print(f"egresswall: worker {worker.index} exited with {task.result()}{why}; "
                      f"restarting it in {delay:g}s", file=sys.stderr, flush=True)
                await asyncio.sleep(delay)
                if self.stopping:  # SIGTERM during the pause: do not start what nobody will stop
                    break
                self._carry_over(worker)
                # Its first load then holds the file to what a reload does (settled): a file caught half-written
                # (one ending at a line's end) is what the other workers' watchers are still waiting out.
                worker.config = dataclasses.replace(worker.config, restarted=True)
                await worker.start()

    def _carry_over(self, worker: Worker) -> None:
        """Counters must not go down when a worker restarts from zero: keep what it had counted."""
        self.carried = carry(self.carried, worker.last_metrics)
        worker.last_metrics = ""

    def _stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        if not self.stopping:
            print(f"egresswall: {signal.Signals(sig).name} received: stopping {len(self.workers)} worker(s)",
                  file=sys.stderr, flush=True)
        self.stopping, self.stop_signal = True, signal.Signals(sig)
        self._stop_requested.set()
        self._forward(signal.SIGTERM)

    def _forward(self, sig: int) -> None:
        for worker in self.workers:
            if worker.process and worker.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.send_signal(sig)

    # ---- admin --------------------------------------------------------------------------------

    async def _readyz(self) -> tuple[int, str, str]:
        missing = [w.index for w in self.workers if not w.ready or w.process is None
                   or w.process.returncode is not None]
        texts = await asyncio.gather(*(_fetch(w.admin, "/readyz") for w in self.workers if w.admin))
        problems = [t.strip() for t in texts if not t.startswith("ready")]
        problems += [f"worker {w.index}: {w.report.error}" for w in self.workers
                     if w.index in missing and w.report is not None and w.report.error]
        if missing or problems or self.stopping:
            return 503, "text/plain", f"not ready: workers down {missing}; {'; '.join(problems)}\n"
        # A worker that refused a reload is ready on its last good policy, and says so: passed on, once.
        notes = dict.fromkeys(t.strip().partition("; the last reload was refused")[2] for t in texts)
        kept = "".join(f"; the last reload was refused{note}" for note in notes if note)
        return 200, "text/plain", f"ready; {self.count} workers{kept}\n"

    async def _metrics(self) -> tuple[int, str, str]:
        texts = []
        fetched = await asyncio.gather(*(_fetch(worker.admin, "/metrics") for worker in self.workers))
        for worker, text in zip(self.workers, fetched, strict=True):
            if is_page(text):
                worker.last_metrics = text
            texts.append(worker.last_metrics)  # an unreachable worker counts with what it last said
        if self.sessions is not None:  # the session API is the supervisor's: its counts are added to the workers'
            texts.append(self.sessions.metrics.session_api_page())
        return 200, METRICS_CONTENT_TYPE, sum_metrics(texts, self.carried)


# A Unix socket's path holds at most 107 bytes (sun_path); the longest a worker's takes inside its folder
_SOCKET_PATH_MAX, _LONGEST_SOCKET_NAME = 107, len("/egresswall-workers-xxxxxxxx/worker-99999")


def _socket_folder() -> str:
    """A new directory only this user may enter (mode 0700), for the workers' admin sockets: in the temporary
    directory, or in /tmp where a long TMPDIR would leave a socket's path too long to bind."""
    parents = [tempfile.gettempdir(), "/tmp"]
    for parent in parents:
        if len(parent) + _LONGEST_SOCKET_NAME <= _SOCKET_PATH_MAX:
            try:
                return tempfile.mkdtemp(prefix="egresswall-workers-", dir=parent)
            except OSError as err:
                raise WorkerStartError(f"cannot make a private directory for the workers' admin sockets in {parent} "
                                       f"({err.strerror}); set TMPDIR to a writable directory", 1) from None
    raise WorkerStartError(f"the temporary directory {parents[0]} is too long a path for the workers' admin sockets "
                           f"(a socket's path holds {_SOCKET_PATH_MAX} bytes) and /tmp is too; set TMPDIR to a "
                           "shorter one", 1)


def _choose_listen_port(host: str, port: int) -> tuple[str, int]:
    """Every worker must bind the same port: choose it here for port 0, and check a given one is free
    (a port another program holds is an error now, in one line, not N workers failing one by one)."""
    if port != 0:
        check_free(PROXY, host, port)
        return host, port
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.bind((host, 0))
            return host, probe.getsockname()[1]
    except OSError as err:
        raise ListenError(PROXY, (host, port), err) from err


def _exit_status(worker: Worker) -> int:
    if worker.report is not None and worker.report.exit is not None:
        return worker.report.exit
    return 1


def _loop_time() -> float:
    return asyncio.get_running_loop().time()


def _utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


FETCH_TIMEOUT = 0.5  # a worker's admin answer on this machine: anything slower is down


async def _fetch(admin_socket: str | None, path: str) -> str:
    """A GET to a worker's admin listener, a Unix socket, bounded in time. On the supervisor's event loop and
    never blocking it: a worker that does not answer (stopped, its loop busy) stalled every admin route, the
    session API included, for each scrape in flight (review round 19)."""
    if admin_socket is None:
        return ""
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(FETCH_TIMEOUT):
            reader, writer = await asyncio.open_unix_connection(admin_socket)
            writer.write(f"GET {path} HTTP/1.0\r\n\r\n".encode())
            data = await reader.read()  # to the end: HTTP/1.0, the worker closes
        return data.partition(b"\r\n\r\n")[2].decode(errors="replace")
    except (OSError, TimeoutError) as err:
        return f"unreachable: {err or 'no answer in ' + str(FETCH_TIMEOUT) + 's'}"
    finally:
        if writer is not None:
            writer.close()
