"""``EmbeddedProxy``: egresswall in a background thread of this process, for ``browse`` and
``browser-server`` given a policy instead of ``--proxy``.

It joins the proxy (``ProxyRunner``) and the browser's page reader (``AuditRefusals``): the one place
where those two meet, so it lives in the command line, the composition root.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
from pathlib import Path

from browser.reader import AuditRefusals
from policy.loader import Overrides
from policy.model import Policy
from policy.sessions import Session, SessionSpec
from proxy.listeners import authority
from proxy.runner import ProxyRunner, RunConfig, endpoint_host


class EmbeddedProxy:
    """egresswall (``ProxyRunner``) on 127.0.0.1:<free port> in a background thread, with a fresh
    mitmproxy CA of its own and its refusals collected for the page reader."""

    def __init__(self, policy_path: str, overrides: Overrides, upstream_ca: str | None = None,
                 log_path: str | None = None, confdir: str | None = None) -> None:
        self._own_confdir = confdir is None
        self.confdir = confdir or tempfile.mkdtemp(prefix="egresswall-ca-")
        config = RunConfig(policy_path, overrides, listen=("127.0.0.1", 0), admin=None,
                           log_path=log_path or os.devnull, confdir=self.confdir, upstream_ca=upstream_ca)
        self.runner = ProxyRunner(config)  # loads the policy here: a bad file fails in the caller's thread
        self.refusals = AuditRefusals()
        self.runner.audit.listeners.append(self.refusals.record)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def policy(self) -> Policy:
        return self.runner.holder.policy

    @property
    def address(self) -> str:
        assert self.runner.listen_address is not None
        return authority(*self.runner.listen_address[:2])

    @property
    def ca_file(self) -> str:
        return str(Path(self.confdir) / "mitmproxy-ca-cert.pem")

    def intercepts_anything(self) -> bool:
        return any(rule.intercept for rule in self.policy.all_host_rules())

    def create_session(self, spec: SessionSpec, timeout: float = 10.0) -> tuple[Session, str]:
        """A session in this proxy's store (as ``POST /v1/sessions`` makes one), and its secret."""
        session, secret = self.runner.sessions.new_session(spec)
        self._on_loop(self.runner.sessions.store.put(session), timeout)
        self.runner.sessions.metrics.session_created()
        return session, secret

    def end_session(self, session_id: str, timeout: float = 10.0) -> None:
        if self._on_loop(self.runner.sessions.store.delete(session_id), timeout):
            self.runner.sessions.metrics.session_ended()

    def _on_loop(self, work, timeout: float):
        """Run a coroutine on the proxy's own loop (its store is that loop's) and wait for its answer."""
        if self._loop is None or not self.runner.ready.is_set():
            work.close()
            raise RuntimeError("the in-process proxy is not running")
        return asyncio.run_coroutine_threadsafe(work, self._loop).result(timeout)

    def start(self, timeout: float = 30.0) -> EmbeddedProxy:
        """Return once the proxy listens; raise what kept it from starting (a ``ListenError``, say)."""
        started = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                task = loop.create_task(self.runner.run())
                loop.call_soon(lambda: loop.create_task(_signal_when_ready(self.runner, task, started)))
                loop.run_until_complete(task)
            except BaseException as err:  # reported to the starting thread
                self._error = err
            finally:
                started.set()
                loop.close()

        self._thread = threading.Thread(target=run, name="egresswall-proxy", daemon=True)
        self._thread.start()
        if not started.wait(timeout):
            self.stop()
            raise TimeoutError(f"the in-process proxy did not start within {timeout:g} seconds")
        if not self.runner.ready.is_set():  # it ended during start-up: wait for the thread to say why
            self._thread.join(timeout)
            self.stop()
            raise self._error or RuntimeError("the in-process proxy stopped during start-up")
        return self

    def refuse_endpoint(self, host: str, port: int) -> None:
        """Count (host, port) as egresswall's own (rule ``self``): a listener of this process the proxy must never
        carry a client to, such as the browser server in front of the browser this proxy contains. Safe from
        any thread (the gate is the proxy loop's)."""
        endpoint = (endpoint_host(host), port)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.runner.gate.self_endpoints.add, endpoint)

    def stop(self, timeout: float = 15.0) -> None:
        if self._thread is not None and self._thread.is_alive() and self._loop is not None:
            self._loop.call_soon_threadsafe(self.runner.request_stop)
            self._thread.join(timeout)
        if self._own_confdir:
            shutil.rmtree(self.confdir, ignore_errors=True)

    def __enter__(self) -> EmbeddedProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def _signal_when_ready(runner: ProxyRunner, task: asyncio.Task, started: threading.Event) -> None:
    while not runner.ready.is_set() and not task.done():
        await asyncio.sleep(0.02)
    started.set()
