"""The embedded proxy: a minimal mitmproxy Master with only the core addons egresswall needs.

mitmdump loads some 36 addons; this loads five of mitmproxy's core ones and egresswall's own
(proxy/addons/), which measured about 1.6x its throughput. One Master per process (mitmproxy keeps
process-wide state, and proxy/mitm_patches.py patches it for this one gate). The public port is the
front's (proxy/front.py): it admits every connection and either relays a passed-through TLS tunnel
itself or hands the connection to mitmproxy's listener-less handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import signal
import socket
from collections.abc import Callable

from .mitm_core import Master, core_addons  # isort: skip  (first: before mitmproxy.master is imported)
from mitmproxy import options as mitm_options

from policy.addresses import unwrap_mapped

from . import mitm_patches
from .addons import egresswall_addons, patch_state_for
from .addons.tunnel_watch import close_every_client, record_open
from .admin import AdminServer
from .audit import AuditLog, json_line
from .front import Front
from .gate import Gate
from .listeners import ADMIN, PROXY, ListenError
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import Metrics
from .peers import is_local_address
from .refusals import one_line
from .reload import PolicyHolder
from .run_config import RunConfig
from .sessions.api import SessionApi, read_token_file
from .sessions.service import SessionService
from .sessions.store_url import open_store, store_endpoint
from .upstream import basic_authorization, read_credentials

log = logging.getLogger("egresswall")


class ProxyRunner:
    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.metrics = Metrics()
        self.holder = PolicyHolder(config.policy_path, config.overrides, on_reload=self._on_reload,
                                   settled_only=config.restarted)
        self.audit = AuditLog(config.log_path, *_log_format(config.log_format))
        self.sessions = SessionService(open_store(config.session_store), self.metrics,
                                       configured=bool(config.admin_token_file or config.session_store))
        self.gate = Gate(self.holder, self.audit, self.metrics, share=config.worker_count, sessions=self.sessions)
        for host, port in config.extra_self_endpoints:
            self.gate.self_endpoints.add((endpoint_host(host), port))
        self.patch_state = patch_state_for(self.gate, first_byte_timer=False)  # the front bounds first bytes
        upstream = self.holder.policy.upstream
        # Read now, so a missing or world-readable file fails before anything listens (and in the caller).
        self.upstream_credentials = read_credentials(upstream) if upstream else None
        api = SessionApi(self.sessions, read_token_file(config.admin_token_file)) if config.admin_token_file else None
        self.admin = AdminServer({"/healthz": self._healthz, "/readyz": self._readyz,
                                  "/metrics": self._metrics}, api)
        self._session_watch: asyncio.Task | None = None
        self.master: Master | None = None
        self.front: Front | None = None
        self.listen_address: tuple[str, int] | None = None
        self.admin_address: tuple[str, int] | None = None
        self.ready = asyncio.Event()
        self._stopping = False

    def _on_reload(self, ok: bool, detail: str) -> None:
        self.metrics.reloaded(ok)

    # ---- admin routes -------------------------------------------------------------------------

    def _healthz(self) -> tuple[int, str, str]:
        return 200, "text/plain", "ok\n"

    def _readyz(self) -> tuple[int, str, str]:
        problems = []
        if self.listen_address is None:
            problems.append("proxy listener is not up")
        if not self.audit.healthy:
            problems.append("the audit log cannot be written")
        if self.gate.draining:
            problems.append("shutting down")
        if not self.sessions.store.healthy:
            problems.append(f"the session store ({self.sessions.store.kind}) cannot be reached; session requests "
                            "are refused (session:store-unavailable)")
        if problems:
            return 503, "text/plain", "not ready: " + "; ".join(problems) + "\n"
        # Still ready (the last good policy is in force), but a refused edit is said where a probe's owner looks.
        refused = self.holder.last_error
        kept = f"; the last reload was refused, the policy in force is the last good one: {one_line(refused)}" \
            if refused else ""
        return 200, "text/plain", f"ready; policy {self.holder.policy.source}{kept}\n"

    def _metrics(self) -> tuple[int, str, str]:
        return 200, METRICS_CONTENT_TYPE, self.metrics.render()

    # ---- lifecycle ----------------------------------------------------------------------------

    async def run(self) -> None:
        outside = asyncio.all_tasks()  # the caller's tasks (its own, awaiting this one): never cancelled here
        if self.config.reuse_port:
            _listen_with_reuse_port()
        mitm_patches.install(self.patch_state)
        await self._learn_store_addresses()  # before anything listens: no request may reach the store
        opts = mitm_options.Options()
        self.master = Master(opts, event_loop=asyncio.get_running_loop())
        # mitmproxy's NextLayer comes before egresswall's addons: their next_layer hook has the final say.
        self.master.addons.add(*core_addons(), *egresswall_addons(self.gate, fronted=True,
                                                                  upstream_credentials=self.upstream_credentials))
        host, port = self.config.listen
        # The front owns the public port and hands mitmproxy what it does not relay itself; mitmproxy's
        # own listener is an internal one on loopback (counted as egresswall itself), closed once the front
        # is up (_close_internal_listener): every connection comes through the front. With an upstream
        # proxy mitmproxy runs in upstream mode: every request and tunnel it forwards goes to the upstream.
        upstream = self.holder.policy.upstream
        updates = dict(listen_host="127.0.0.1", listen_port=0,
                       mode=[f"upstream:{upstream.url}" if upstream else "regular"])
        if self.config.confdir:
            updates["confdir"] = self.config.confdir
        if self.config.upstream_ca:
            updates["ssl_verify_upstream_trusted_ca"] = self.config.upstream_ca
        opts.update(**updates)
        loop = asyncio.get_running_loop()
        for sig, handler in ((signal.SIGTERM, _logged(signal.SIGTERM, self.request_stop)),
                             (signal.SIGINT, _logged(signal.SIGINT, self.request_stop)),
                             (signal.SIGHUP, self.holder.request_reload), (signal.SIGUSR1, self.audit.reopen)):
            # Outside the main thread (tests embed the runner) signals are the caller's business.
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, handler)
        master_task = asyncio.create_task(self.master.run())
        try:
            if await self._wait_listening(master_task):  # False: asked to stop during start-up
                authorization = basic_authorization(self.upstream_credentials) if self.upstream_credentials else None
                self.front = Front(self.gate, self._handoff, relay_tunnels=self.config.fast_tunnels,
                                   upstream_authorization=authorization, relay_http=self.config.fast_http)
                try:
                    self.listen_address = await self.front.start(host, port, reuse_port=self.config.reuse_port)
                except OSError as err:
                    raise ListenError(PROXY, (host, port), err) from err
                self.gate.self_endpoints.add((endpoint_host(self.listen_address[0]), self.listen_address[1]))
                if self.config.admin_socket is not None:
                    await self.admin.start_unix(self.config.admin_socket)
                elif self.config.admin is not None:
                    try:
                        self.admin_address = await self.admin.start(*self.config.admin)
                    except OSError as err:
                        raise ListenError(ADMIN, self.config.admin, err) from err
                    for address in self.admin.addresses:  # a name may have bound more than one
                        self.gate.self_endpoints.add((endpoint_host(address[0]), address[1]))
                self._close_internal_listener()
                self.holder.start_watching(self.config.watch_interval)
                self._session_watch = asyncio.get_running_loop().create_task(self._watch_sessions())
                self.ready.set()  # the command line tells people (and a supervisor) where it listens
            await master_task
        except BaseException:
            if not master_task.done():  # a listener failed: close the ones that opened, and stop mitmproxy
                if self.front is not None:
                    self.front.stop_accepting()
                if self.master.addons.get("proxyserver").listen_addrs():  # (stopping a failed one fails again)
                    self.master.options.update(server=False)
                self.master.shutdown()
                with contextlib.suppress(Exception):
                    await master_task
            raise
        finally:
            self.holder.stop_watching()
            if self._session_watch is not None:
                self._session_watch.cancel()
            await self.admin.stop()
            with contextlib.suppress(Exception):
                await self.sessions.store.close()
            await _end_own_tasks(outside, 1.0)
            self.audit.close()
            mitm_patches.uninstall()

    async def _watch_sessions(self, every: float = 2.0) -> None:
        """Keep /readyz and the sessions gauge current: ask the store every few seconds (a store that
        came back is noticed without a request having to fail first)."""
        from .sessions.store import StoreUnavailable

        while True:
            await self._learn_store_addresses()
            if self.sessions.enabled(self.holder.policy):
                try:
                    if await self.sessions.store.ping():
                        self.metrics.sessions_in_store(len(await self.sessions.store.ids(self.sessions.clock())))
                except StoreUnavailable:
                    pass
            await asyncio.sleep(every)

    async def _learn_store_addresses(self) -> None:
        """The session store's addresses become egresswall's own endpoints (refused to every client, rule
        ``self``): one that reached Redis through the proxy could write itself a session. A name is looked
        up again every few seconds (``_watch_sessions``) and every address it ever had stays refused."""
        endpoint = store_endpoint(self.config.session_store)
        if endpoint is None:
            return
        host, port = endpoint
        try:
            found = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as err:
            log.warning("the session store %s:%s did not resolve (%s); it is refused once it does", host, port, err)
            return
        for *_, sockaddr in found:
            address = unwrap_mapped(str(sockaddr[0]).split("%", 1)[0])
            self.gate.store_endpoints.add((address, port))
            if is_local_address(address):
                # A store on this host may listen on more of its addresses than the URL names (Debian binds
                # 127.0.0.1 and ::1, a container image every address): that port is the store on any of them.
                self.gate.store_endpoints.add(("*", port))

    async def _wait_listening(self, master_task: asyncio.Task) -> bool:
        """True once mitmproxy's internal listener is up; False when it stopped first (a stop asked for
        during start-up). A listener that failed raises ``ListenError`` at once: mitmproxy keeps the
        failure on its server instance and, without its errorcheck addon, runs on without a listener."""
        assert self.master is not None
        server = self.master.addons.get("proxyserver")
        while not master_task.done():
            addresses = server.listen_addrs()
            if addresses:
                for address in addresses:
                    self.gate.self_endpoints.add((endpoint_host(address[0]), address[1]))
                return True
            failure = next((i.last_exception for i in server.servers if i.last_exception is not None), None)
            if failure is not None:
                listen = (self.master.options.listen_host, self.master.options.listen_port)
                raise ListenError(PROXY, listen, failure)
            await asyncio.sleep(0.01)
        master_task.result()  # what stopped it, if anything failed
        return False

    def _close_internal_listener(self) -> None:
        """Once the front listens, mitmproxy's own listener (127.0.0.1, a free port) stops accepting: its
        server instance is needed only for ``handle_stream``, which takes the front's hand-overs. Left
        open it was a second way in beside the front, reachable by any local client (a browser in the same
        pod): a silent connection there was held for limits.idle_timeout instead of
        limits.first_byte_timeout, and closed without a record. (mitmproxy still owns the server objects
        and closes them again when it stops, which is harmless.)"""
        assert self.master is not None
        for instance in self.master.addons.get("proxyserver").servers:
            for server in getattr(instance, "_servers", ()):  # asyncio's or uvloop's Server: TCP only in our modes
                server.close()

    def _handoff(self, sock: socket.socket, prefix: bytes, done: Callable[[], None]) -> None:
        """Give an accepted connection to mitmproxy as if its own listener had accepted it, with the
        bytes the front already read put back in front of the rest. The front admitted it; ``done`` gives
        the admission back once mitmproxy has finished with the connection (or could not take it)."""
        assert self.master is not None
        instances = list(self.master.addons.get("proxyserver").servers)
        if not instances:  # shutting down: mitmproxy's listener is gone, and so is this connection
            sock.close()
            done()
            return
        instance = instances[0]
        loop = asyncio.get_running_loop()

        async def handled(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await instance.handle_stream(reader, writer)
            except asyncio.CancelledError:
                writer.transport.abort()  # a stop ended it (_end_own_tasks): asyncio's stream callback would log
            finally:                      # the cancellation as an error
                done()

        async def attach() -> None:
            reader = asyncio.StreamReader(loop=loop)
            if prefix:
                reader.feed_data(prefix)
            try:
                await loop.connect_accepted_socket(lambda: asyncio.StreamReaderProtocol(reader, handled), sock)
            except OSError:
                sock.close()
                done()

        loop.create_task(attach())

    def request_stop(self) -> None:
        if not self._stopping:
            self._stopping = True
            asyncio.get_running_loop().create_task(self.stop())

    async def stop(self) -> None:
        """Stop accepting, let open connections finish for up to the grace period, then close."""
        assert self.master is not None
        self.gate.admission.draining = True
        if self.front is not None:
            self.front.stop_accepting()
        self.master.options.update(server=False)  # closes the listening sockets
        grace = self.holder.policy.limits.tunnel_grace
        started = asyncio.get_running_loop().time()
        deadline = started + grace
        if self.ready.is_set():
            log.info("draining: no new connections; %d open connection(s) get up to %gs to finish "
                     "(limits.tunnel_grace)", self.gate.admission.total, grace)
        while self.gate.admission.total > 0 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        cut = self.gate.admission.total
        if cut:
            # Close what is still open, here, so that each tunnel, WebSocket and exchange writes its closing record
            # (error: egresswall stopped) while the audit log is open; shutting mitmproxy down cut them unrecorded.
            self.gate.stopping_cut = True
            if self.front is not None:
                self.front.cut_open()
            close_every_client()
            recorded_by = asyncio.get_running_loop().time() + 2
            while self.gate.admission.total > 0 and asyncio.get_running_loop().time() < recorded_by:
                await asyncio.sleep(0.05)
            if self.gate.admission.total > 0:  # a connect that hangs, an exchange waiting on its origin
                if self.front is not None:
                    await self.front.end_open(1.0)
                record_open()
        took = asyncio.get_running_loop().time() - started
        if not self.ready.is_set():
            log.info("stopped during start-up, at %s", _utc_now())
        elif cut:
            log.info("stopped at %s after %.1fs; %d connection(s) still open at the end of the grace period "
                     "were closed", _utc_now(), took, cut)
        else:
            log.info("stopped at %s after %.1fs; every connection had finished", _utc_now(), took)
        self.master.shutdown()


async def _end_own_tasks(outside: set[asyncio.Task], timeout: float) -> None:
    """Before the audit log closes and mitmproxy's patches come off: every task the proxy started that is still
    running (a connection mitmproxy's shutdown left going) is cancelled and given ``timeout`` to end, so that a
    record it writes as it goes finds the log open and the patches it runs through still in place. ``outside``:
    the tasks that were running before the proxy started (its caller's), left alone."""
    current = asyncio.current_task()
    tasks = [task for task in asyncio.all_tasks() if task is not current and task not in outside and not task.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)


def _logged(sig: signal.Signals, handler):
    """A stop signal's handler that says which signal asked for the stop."""
    def on_signal() -> None:
        log.info("%s received", sig.name)
        handler()
    return on_signal


def _utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _listen_with_reuse_port() -> None:
    """mitmproxy opens its listener with ``asyncio.start_server`` and no way to pass options; a
    worker process sets SO_REUSEPORT on every listener it opens so the kernel spreads connections
    over the workers. Only worker processes call this."""
    original = asyncio.start_server
    if getattr(original, "egresswall_reuse_port", False):
        return

    async def start_server(*args, **kwargs):
        kwargs.setdefault("reuse_port", True)
        return await original(*args, **kwargs)

    start_server.egresswall_reuse_port = True  # type: ignore[attr-defined]
    asyncio.start_server = start_server


def endpoint_host(host: str) -> str:
    """A listener's address as the gate's self endpoints hold it: "*" for a wildcard (every address here)."""
    return "*" if host in ("0.0.0.0", "::", "") else host


def _log_format(name: str):
    """(formatter, selector) for ``--log-format``: JSON lines, or squid's native access log."""
    if name == "squid":
        from squid_compat.access_log import select_squid_records, squid_line

        return squid_line, select_squid_records
    return json_line, None
