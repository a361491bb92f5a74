"""``egresswall browser-server``: one contained Chromium that remote Playwright clients share.

Playwright's driver (the Node.js one shipped inside the ``playwright`` Python package) runs
``launch-server`` with the launcher's plan (``driver.py``): Chromium is launched server-side, with the
containment flags and the proxy. The driver listens on 127.0.0.1 at a random port and an unguessable
path; clients never reach it. They connect (``chromium.connect(ws_endpoint)``) to a relay (``relay.py``)
that parses every message of Playwright's protocol and refuses the calls that would change the proxy,
launch or connect another browser, or open a socket from the driver process (``protocol_filter.py``).

Under load (``ServerLimits``): contexts and connections are capped over all clients and per client,
admitted before anything reaches the browser (``caps.py``, ``tracker.py``); idle contexts and idle
connections are closed on the server's own clock; protocol messages are bounded in size and in number
in flight; the browser runs in a memory cgroup of its own where the host allows one (``cgroup.py``).
When the browser dies (killed at its ceiling, or from outside) its clients' connections are closed
with the reason and a new browser is started; the server keeps serving. Counters are served as
``GET /metrics`` on the same port (``metrics.py``).

It has NO authentication: anyone who can open a WebSocket to it drives a browser (and that browser's
egress is whatever the policy allows). Keep it on loopback or on a network only its clients reach;
binding a non-loopback address needs ``--allow-non-loopback``. WebSocket handshakes that carry an
``Origin`` header (every web page's do; Playwright clients' do not) are refused, so a page in some
other browser on the host cannot drive it.

Sessions (``session_connect.py``): a connection to ``/session/<id>?secret=<secret>`` (or with the
``X-Egresswall-Session`` header) gets contexts whose proxy carries that session's credentials, set here;
a malformed one is refused at the handshake (400), and the proxy judges the credentials themselves.
The per-client caps still count by address: an id the server cannot verify must not buy more slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from policy.addresses import cap_group
from policy.credentials import Credentials

from .caps import CapRefusal, Caps
from .cgroup import CgroupError, MemoryCeiling
from .driver import BrowserProcess
from .launch import ContainmentError, LaunchPlan
from .metrics import BrowserMetrics
from .relay import MAX_QUEUE, Ending, Relay, close_reason
from .session_connect import SESSION_HEADER, HandshakeRefusal, session_of_handshake, session_proxy

log = logging.getLogger("egresswall.browser")
MiB = 2**20
RESTART_BACKOFF_MAX = 30.0  # seconds between restarts of a browser that keeps dying


@dataclass(frozen=True)
class ServerLimits:
    """What one browser server lets its clients hold. The defaults suit a host (or container) with
    about 4 GiB for the browser: 8 contexts at a few hundred MB each under a 2 GiB ceiling."""

    max_contexts: int = 8  # contexts open (or opening) over all clients
    max_contexts_per_client: int = 2
    max_connections: int = 32
    max_connections_per_client: int = 8
    context_idle: float = 300.0  # seconds without a call on a context (or its pages...) before it is closed
    connection_idle: float = 600.0  # seconds without a call on a connection before it is closed
    # 32 MiB: a full-page PNG screenshot of a long page (1280 x 16000 px is typically 5-15 MB, 4/3 of
    # that in base64) or page.content() of a very large page; Playwright's own client limit is 256 MiB.
    max_message_bytes: int = 32 * MiB
    max_calls_in_flight: int = 64  # calls a connection has sent and not had answered
    browser_memory_max: int | None = 2 * 2**30  # the browser's cgroup limit; None: no ceiling of our own
    browser_cgroup_parent: Path | None = None  # where to create the browser's group; None: the server's own group

    def __post_init__(self) -> None:
        # (a per-client cap above the global one is allowed: the global one then decides)
        for name in ("max_contexts", "max_contexts_per_client", "max_connections", "max_connections_per_client",
                     "max_calls_in_flight"):
            if getattr(self, name) < 1:
                raise ValueError(f"{_option(name)} must be at least 1 (got {getattr(self, name)})")
        for name in ("context_idle", "connection_idle"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{_option(name)} must be a positive number of seconds (got {getattr(self, name)})")
        if self.max_message_bytes < 1 * MiB:
            raise ValueError(f"{_option('max_message_bytes')} below 1 MiB (1048576) would refuse ordinary pages and "
                             "screenshots")

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> ServerLimits:
        """From parsed command-line options named like the fields (an absent one keeps its default)."""
        return cls(**{f.name: options[f.name] for f in fields(cls) if f.name in options})


def _option(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def client_key(connection) -> str:
    """What the per-client caps count by: the peer's address, an IPv6 one by its /64 (``cap_group``).
    Session grants, when clients have them, key by the session here instead (the caps take any string)."""
    address = connection.remote_address
    host = str(address[0]) if address else "unknown"
    try:
        parsed = ipaddress.ip_address(host)
    except ValueError:
        return host
    return cap_group(str(parsed))


def check_bind_address(host: str, allow_non_loopback: bool) -> None:
    if is_loopback(host):
        return
    if not allow_non_loopback:
        raise ContainmentError(
            f"refusing to bind {host}: the browser server has no authentication, so anyone who can reach it "
            "drives the browser. Bind loopback, or pass --allow-non-loopback on a network only its clients reach.")
    log.warning("the browser server listens on %s with NO authentication: never publish it beyond the network "
                "its clients are on", host)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class BrowserServer:
    def __init__(self, plan: LaunchPlan, host: str = "127.0.0.1", port: int = 3000, start_timeout: float = 60.0,
                 limits: ServerLimits | None = None, key_of: Callable[[Any], str] = client_key,
                 sessions_refused: str | None = None, driver_port: int = 0,
                 own_endpoint: Callable[[str, int], None] | None = None) -> None:
        self.plan = plan
        # Told each (host, port) this server and its drivers listen on, as they start: an in-process proxy
        # refuses them (rule self), so a page whose policy admits loopback cannot drive its own browser.
        self.own_endpoint = own_endpoint
        # The Playwright driver's loopback port (0: any free one). A fixed one lets a pod's packet filter admit
        # it for the browser's own user only (compose/k8s/egress-lock.nft's driver_port).
        self.driver_port = driver_port
        # Why session connections are refused at the handshake (None: their credentials go to the proxy).
        self.sessions_refused = sessions_refused
        self.host, self.port = host, port
        self.start_timeout = start_timeout
        self.limits = limits or ServerLimits()
        self.key_of = key_of
        self.endpoint: str | None = None  # what clients connect to
        self.metrics = BrowserMetrics()
        self.context_caps = Caps(self.limits.max_contexts, self.limits.max_contexts_per_client, "contexts",
                                 "close one")
        self.connection_caps = Caps(self.limits.max_connections, self.limits.max_connections_per_client,
                                    "connections", "close one")
        self.relays: set[Relay] = set()
        self.browser: BrowserProcess | None = None
        self.ceiling: MemoryCeiling | None = None
        self.ready = asyncio.Event()
        self.stopping = False
        self._stop = asyncio.Event()
        self._oom_kills_seen = 0
        self._exits: list[float] = []
        self._background: set[asyncio.Task] = set()  # held here: the loop keeps only weak references

    def spawn(self, work) -> None:
        """Run ``work`` in the background (closing a connection, reaping a context)."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @property
    def refusals(self) -> int:
        return sum(self.metrics.calls_refused.values())

    async def run(self) -> None:
        from websockets.asyncio.server import serve

        workdir = Path(tempfile.mkdtemp(prefix="egresswall-server-"))
        self._prepare_ceiling()
        tasks: list[asyncio.Task] = []
        try:
            await self._start_browser(workdir)
            async with serve(self._handle, self.host, self.port, max_size=self.limits.max_message_bytes,
                             max_queue=MAX_QUEUE, ping_interval=None, process_request=self._process_request,
                             server_header=None) as server:
                bound = server.sockets[0].getsockname()
                if self.own_endpoint is not None:
                    for sock in server.sockets:
                        self.own_endpoint(*sock.getsockname()[:2])
                host = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
                self.endpoint = f"ws://{host}:{bound[1]}/"
                print(f"egresswall: browser server listening on {self.endpoint} (Chromium behind the proxy "
                      f"{self.plan.proxy_server}; no authentication: never publish it)", file=sys.stderr, flush=True)
                loop = asyncio.get_running_loop()
                for sig in (signal.SIGTERM, signal.SIGINT):
                    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                        loop.add_signal_handler(sig, self._stop.set)
                tasks = [asyncio.create_task(self._supervise(workdir)), asyncio.create_task(self._watch_limits())]
                stop = asyncio.create_task(self._stop.wait())
                done, _ = await asyncio.wait({*tasks, stop}, return_when=asyncio.FIRST_COMPLETED)
                stop.cancel()
                self.stopping = True
                for task in done - {stop}:
                    task.result()  # a browser that could not be started again (or a bug): the server ends
        finally:
            self.stopping = True
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, ContainmentError, CgroupError):
                    await task
            if self.browser is not None:
                await self.browser.stop()
            shutil.rmtree(workdir, ignore_errors=True)
            m = self.metrics
            log.info("browser server stopped: %d contexts opened, %d refused, %d closed when idle; %d browser exits",
                     m.contexts_opened, sum(m.contexts_refused.values()),
                     m.contexts_reaped["idle"] + m.contexts_reaped["connection_idle"], sum(m.browser_exits.values()))

    def stop(self) -> None:
        self._stop.set()

    # ---- the browser ----------------------------------------------------------------------------

    def _prepare_ceiling(self) -> None:
        limit = self.limits.browser_memory_max
        if limit is None:
            log.warning("no browser memory ceiling (--browser-memory-max off): the container's or host's memory "
                        "limit is the ceiling")
            return
        try:
            self.ceiling = MemoryCeiling.prepare(limit, self.limits.browser_cgroup_parent)
        except CgroupError as err:
            log.warning("browser memory ceiling not applied: %s; the container's or host's memory limit is the "
                        "ceiling", err)
            return
        log.info("browser memory ceiling: %d MiB (cgroup v%d, groups under %s)", limit // MiB, self.ceiling.version,
                 self.ceiling.parent)

    async def _start_browser(self, workdir: Path) -> None:
        try:
            group = self.ceiling.group() if self.ceiling is not None else None
        except CgroupError as err:  # it worked at start: fail closed rather than run without the ceiling
            raise ContainmentError(f"the browser's memory cgroup: {err}") from None
        browser = BrowserProcess(self.plan, workdir, group, self.start_timeout, self.driver_port)
        self.browser = browser
        self.metrics.browser_starts += 1
        self._oom_kills_seen = group.oom_kills() if group is not None else 0
        await browser.start()
        if self.own_endpoint is not None and browser.upstream is not None:
            driver = urlsplit(browser.upstream)
            assert driver.hostname is not None and driver.port is not None
            self.own_endpoint(driver.hostname, driver.port)
        self.ready.set()

    async def _supervise(self, workdir: Path) -> None:
        """Start a new browser each time one exits while serving (backing off if it keeps dying)."""
        while True:
            browser = self.browser
            assert browser is not None
            await browser.exited.wait()
            self.ready.clear()
            self._count_oom_kills()
            label = "memory_ceiling" if browser.killed_at_ceiling() else "unexpected"
            self.metrics.browser_exits[label] += 1
            log.warning("%s (driver status %s); starting a new one", browser.exit_reason, browser.exit_status)
            await browser.release()
            now = time.monotonic()
            self._exits = [t for t in self._exits if now - t < 60] + [now]
            if len(self._exits) >= 3:
                await asyncio.sleep(min(2.0 ** (len(self._exits) - 2), RESTART_BACKOFF_MAX))
            await self._start_browser(workdir)
            log.info("a new browser is serving")

    def _count_oom_kills(self) -> None:
        group = self.browser.cgroup if self.browser is not None else None
        if group is None:
            return
        kills = group.oom_kills()
        if kills > self._oom_kills_seen:
            self.metrics.oom_kills += kills - self._oom_kills_seen
            log.warning("the kernel killed %d process(es) of the browser at its memory ceiling of %d MiB (a page "
                        "that grew: its client sees the page crash)", kills - self._oom_kills_seen,
                        (self.limits.browser_memory_max or 0) // MiB)
            self._oom_kills_seen = kills

    # ---- idle limits and the ceiling's watch ----------------------------------------------------

    async def _watch_limits(self) -> None:
        limits = self.limits
        tick = min(1.0, limits.context_idle / 4, limits.connection_idle / 4)
        while True:
            await asyncio.sleep(tick)
            self._count_oom_kills()
            now = time.monotonic()
            for relay in list(self.relays):
                for context in relay.tracker.idle_contexts(now, limits.context_idle):
                    log.info("closing a context of %s: no call for %g s (the idle limit)", relay.peer,
                             limits.context_idle)
                    self.spawn(relay.reap(
                        context.guid, "idle", f"closed by the egresswall browser server: no call for "
                                              f"{limits.context_idle:g} s (its idle limit)"))
                if relay.ending is None and relay.tracker.idle_for(now) >= limits.connection_idle:
                    log.info("closing the connection of %s: no call for %g s (the idle limit)", relay.peer,
                             limits.connection_idle)
                    relay.end(Ending(1000, f"no call for {limits.connection_idle:g} s (the idle limit): closed by "
                                           "the server", "idle"))

    # ---- connections ----------------------------------------------------------------------------

    def _process_request(self, connection, request):
        if request.path == "/metrics":
            return connection.respond(200, self.render_metrics())
        if "Origin" in request.headers:
            # a handshake with an Origin header comes from a web page: refused (cross-site WebSocket)
            self.metrics.connections_refused["web_origin"] += 1
            return connection.respond(403, "egresswall browser-server: WebSocket connections from web pages are "
                                           "refused\n")
        session = self._session_of(request)
        if isinstance(session, HandshakeRefusal):
            self.metrics.connections_refused["session"] += 1
            return connection.respond(session.status, f"egresswall browser-server: {session.reason}\n")
        refusal = self._connection_refusal(self.key_of(connection))
        if refusal is not None:  # answered before the handshake; _handle takes the slot itself
            self.metrics.connections_refused[refusal.scope] += 1
            return connection.respond(503, f"egresswall browser-server: {refusal.reason}\n")
        return None

    def _session_of(self, request) -> Credentials | HandshakeRefusal | None:
        """The session a handshake names (its path or its header), or why the handshake is refused."""
        found = session_of_handshake(request.path, request.headers.get_all(SESSION_HEADER))
        if found is not None and not isinstance(found, HandshakeRefusal) and self.sessions_refused:
            return HandshakeRefusal(403, self.sessions_refused)
        return found

    def _connection_refusal(self, key: str) -> CapRefusal | None:
        probe = self.connection_caps.reserve(key)
        if isinstance(probe, CapRefusal):
            return probe
        probe.release()
        return None

    async def _handle(self, connection) -> None:
        key = self.key_of(connection)
        slot = self.connection_caps.reserve(key)
        if isinstance(slot, CapRefusal):  # lost a race with another handshake since _process_request
            self.metrics.connections_refused[slot.scope] += 1
            await connection.close(1013, close_reason(slot.reason))
            return
        relay: Relay | None = None
        try:
            self.metrics.connections_accepted += 1
            try:
                await asyncio.wait_for(self.ready.wait(), self.start_timeout + RESTART_BACKOFF_MAX)
            except TimeoutError:
                await connection.close(1013, "the browser is restarting; try again")
                return
            browser = self.browser
            assert browser is not None and browser.upstream is not None
            session = self._session_of(connection.request)  # checked in _process_request: not a refusal
            assert not isinstance(session, HandshakeRefusal)
            proxy = session_proxy(self.plan.proxy_server, session) if session is not None else None
            relay = Relay(self, connection, key, browser, proxy)
            self.relays.add(relay)
            await relay.run(browser.upstream)
        finally:
            slot.release()
            if relay is not None:
                self.relays.discard(relay)

    # ---- metrics --------------------------------------------------------------------------------

    def render_metrics(self) -> str:
        group = self.browser.cgroup if self.browser is not None else None
        gauges = {
            "contexts_open": ("Contexts open now.", sum(len(r.tracker.contexts) for r in self.relays)),
            "contexts_held": ("Context slots taken now (open, or opening).", self.context_caps.in_use),
            "contexts_max": ("The cap on contexts over all clients.", self.limits.max_contexts),
            "connections_open": ("Client connections open now.", self.connection_caps.in_use),
            "memory_ceiling_bytes": ("The browser's memory cgroup limit (0: none applied).",
                                     self.limits.browser_memory_max if self.ceiling is not None else 0),
            "memory_bytes": ("Memory the browser's cgroup holds now (0: no cgroup).",
                             group.usage() if group is not None else 0),
        }
        return self.metrics.render(gauges)
