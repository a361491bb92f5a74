"""``egresswall browser-server``: one contained Chromium that remote Playwright clients share.

Playwright's driver (the Node.js one shipped inside the ``playwright`` Python package) runs
``launch-server`` with the launcher's plan: Chromium is launched once, server-side, with the
containment flags and the proxy. The driver listens on 127.0.0.1 at a random port and an unguessable
path; clients never reach it. They connect (``chromium.connect(ws_endpoint)``) to a relay that parses
every message of Playwright's protocol and refuses the calls that would change the proxy, launch or
connect another browser, or open a socket from the driver process (``protocol_filter.py``).

It has NO authentication: anyone who can open a WebSocket to it drives a browser (and that browser's
egress is whatever the policy allows). Keep it on loopback or on a network only its clients reach;
binding a non-loopback address needs ``--allow-non-loopback``. WebSocket handshakes that carry an
``Origin`` header (every web page's do; Playwright clients' do not) are refused, so a page in some
other browser on the host cannot drive it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import secrets
import signal
import sys
import tempfile
from pathlib import Path

from .launch import ContainmentError, LaunchPlan, browser_command_line, verify_command_line
from .protocol_filter import ProtocolFilter

log = logging.getLogger("egresswall.browser")


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
    def __init__(self, plan: LaunchPlan, host: str = "127.0.0.1", port: int = 3000,
                 start_timeout: float = 60.0) -> None:
        self.plan = plan
        self.host, self.port = host, port
        self.start_timeout = start_timeout
        self.upstream: str | None = None  # the driver's own endpoint, with its secret path
        self.endpoint: str | None = None  # what clients connect to
        self.refusals = 0
        self._driver: asyncio.subprocess.Process | None = None
        self._stop = asyncio.Event()

    async def run(self) -> None:
        from websockets.asyncio.server import serve

        workdir = Path(tempfile.mkdtemp(prefix="egresswall-server-"))
        try:
            await self._start_driver(workdir)
            await self._verify_browser()
            async with serve(self._relay, self.host, self.port, max_size=None, ping_interval=None,
                             process_request=_refuse_web_origins, server_header=None) as server:
                bound = server.sockets[0].getsockname()
                host = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
                self.endpoint = f"ws://{host}:{bound[1]}/"
                print(f"egresswall: browser server listening on {self.endpoint} (Chromium behind the proxy "
                      f"{self.plan.proxy_server}; no authentication: never publish it)", file=sys.stderr, flush=True)
                loop = asyncio.get_running_loop()
                for sig in (signal.SIGTERM, signal.SIGINT):
                    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                        loop.add_signal_handler(sig, self._stop.set)
                driver_exit = asyncio.create_task(self._driver.wait())
                stop = asyncio.create_task(self._stop.wait())
                done, _ = await asyncio.wait({driver_exit, stop}, return_when=asyncio.FIRST_COMPLETED)
                if driver_exit in done:
                    raise ContainmentError(f"the browser exited (driver status {driver_exit.result()})")
                stop.cancel()
        finally:
            await self._stop_driver()
            for file in workdir.iterdir():
                file.unlink()
            workdir.rmdir()

    def stop(self) -> None:
        self._stop.set()

    async def _start_driver(self, workdir: Path) -> None:
        from playwright._impl._driver import compute_driver_executable, get_driver_env

        config = self.plan.server_config()
        config.update(host="127.0.0.1", port=0, wsPath="/" + secrets.token_urlsafe(24))
        config_file = workdir / "launch-server.json"
        config_file.touch(mode=0o600)
        config_file.write_text(json.dumps(config))
        node, cli = compute_driver_executable()
        self._driver = await asyncio.create_subprocess_exec(
            node, cli, "launch-server", "--browser", "chromium", "--config", str(config_file),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, env=get_driver_env())
        assert self._driver.stdout is not None
        try:
            while True:
                line = await asyncio.wait_for(self._driver.stdout.readline(), self.start_timeout)
                if not line:
                    raise ContainmentError(f"the Playwright driver exited before the browser started "
                                           f"(status {await self._driver.wait()})")
                text = line.decode(errors="replace").strip()
                if text.startswith("ws://"):
                    self.upstream = text
                    break
        except TimeoutError:
            raise ContainmentError(f"the browser did not start within {self.start_timeout:g} seconds") from None
        asyncio.get_running_loop().create_task(self._drain(self._driver.stdout))

    async def _verify_browser(self) -> None:
        argv = await asyncio.to_thread(browser_command_line, self.plan.user_data_dir)
        problems = ["the browser process was not found in /proc"] if argv is None else verify_command_line(argv,
                                                                                                           self.plan)
        if problems:
            raise ContainmentError("the launched Chromium is not contained: " + "; ".join(problems))

    @staticmethod
    async def _drain(stream: asyncio.StreamReader) -> None:
        while await stream.readline():
            pass

    async def _stop_driver(self) -> None:
        driver = self._driver
        if driver is None or driver.returncode is not None:
            return
        driver.send_signal(signal.SIGTERM)  # Playwright closes the browser on SIGTERM
        try:
            await asyncio.wait_for(driver.wait(), 15)
        except TimeoutError:
            driver.kill()
            await driver.wait()

    async def _relay(self, client) -> None:
        from websockets.asyncio.client import connect
        from websockets.exceptions import ConnectionClosed, InvalidStatus

        assert self.upstream is not None
        user_agent = client.request.headers.get("User-Agent")  # the driver checks the client's version in it
        peer = client.remote_address
        try:
            upstream = await connect(self.upstream, max_size=None, ping_interval=None, open_timeout=30,
                                     user_agent_header=user_agent, compression=None)
        except InvalidStatus as err:
            body = err.response.body.decode(errors="replace")[:300] if err.response.body else ""
            await client.close(1011, f"the browser server refused the connection: {body}"[:120])
            return
        except OSError as err:
            await client.close(1011, f"the browser is not reachable: {err}"[:120])
            return
        protocol = ProtocolFilter()
        log.info("client %s connected", peer)

        async def client_to_server() -> None:
            async for message in client:
                refusal = protocol.from_client(message)
                if refusal is None:
                    await upstream.send(message)
                    continue
                self.refusals += 1
                log.warning("refused from %s: %s", peer, refusal.reason)
                reply = refusal.reply()
                if reply is None:
                    await client.close(1008, refusal.reason[:120])
                    return
                await client.send(reply)

        async def server_to_client() -> None:
            async for message in upstream:
                protocol.from_server(message)
                await client.send(message)

        tasks = [asyncio.create_task(client_to_server()), asyncio.create_task(server_to_client())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, ConnectionClosed):
                    await task
            await upstream.close()
            await client.close()
            log.info("client %s disconnected", peer)


def _refuse_web_origins(connection, request):
    """A handshake with an Origin header comes from a web page: refused (cross-site WebSocket)."""
    if "Origin" in request.headers:
        return connection.respond(403, "egresswall browser-server: WebSocket connections from web pages are "
                                       "refused\n")
    return None

