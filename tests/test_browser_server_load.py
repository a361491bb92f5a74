"""The real ``egresswall browser-server`` under load, with real Chromium and Playwright's Python client,
all on loopback: caps past the limit from six client addresses, idle contexts and connections closed,
oversized messages, a browser killed with ``kill -9``, and a page that allocates past the memory ceiling.

Each client gets its own loopback address (127.0.0.N) through a small TCP forwarder, because the
per-client caps count by the client's address and Playwright's client cannot choose its source address.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from pathlib import Path

import pytest
from test_browser_server import ServerProcess

pytestmark = pytest.mark.integration
MiB = 2**20


@pytest.fixture
def serve(lab, start_proxy, tmp_path):
    """serve(*options) → a running browser server behind the real proxy, stopped (cleanly) after the test."""
    started: list[ServerProcess] = []
    proxy = start_proxy(lab.policy_text())

    def start(*options: str) -> ServerProcess:
        server = ServerProcess(f"{proxy.host}:{proxy.port}", tmp_path / f"server-{len(started)}.stderr", *options)
        started.append(server)
        return server

    yield start
    for server in started:
        assert server.stop() == 0, server.stderr


class FromAddress:
    """127.0.0.1:<port> → the server, connecting from ``source`` (another loopback address)."""

    def __init__(self, endpoint: str, source: str) -> None:
        match = re.fullmatch(r"ws://([\d.]+):(\d+)/", endpoint)
        assert match, endpoint
        self.target = (match.group(1), int(match.group(2)))
        self.source = source
        self.endpoint = ""
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> FromAddress:
        self._server = await asyncio.start_server(self._forward, "127.0.0.1", 0)
        self.endpoint = f"ws://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target, local_addr=(self.source, 0))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


async def eventually(check, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.2)


def driver_and_chromium(server: ServerProcess) -> tuple[int, int]:
    """The driver process the server started, and the Chromium browser process the driver started."""
    def children(pid: int) -> list[int]:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]

    for driver in children(server.process.pid):
        for child in children(driver):
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            if argv[0].endswith(b"/chromium") and not any(a.startswith(b"--type=") for a in argv):
                return driver, child
    raise AssertionError("no Chromium under the browser server")


# ---- caps ------------------------------------------------------------------------------------------

def test_six_clients_past_a_cap_of_four_get_four_contexts_and_the_rest_are_refused(lab, serve):
    from playwright.async_api import Error, async_playwright

    server = serve("--max-contexts", "4", "--max-contexts-per-client", "2")
    page_url = f"http://public.lab.example:{lab.public.port}/hello"

    async def scenario() -> list[int]:
        resident = []
        async with async_playwright() as playwright, contextlib.AsyncExitStack() as stack:
            routes = [await stack.enter_async_context(FromAddress(server.endpoint, f"127.0.0.{20 + n}"))
                      for n in range(6)]
            browsers = await asyncio.gather(*(playwright.chromium.connect(r.endpoint, timeout=60_000)
                                              for r in routes))
            resident.append(server.resident_bytes())
            for round_number in range(3):
                # every client asks for two contexts at once: twelve opens against a cap of four
                asked = await asyncio.gather(*(browser.new_context() for browser in browsers for _ in range(2)),
                                             return_exceptions=True)
                opened = [c for c in asked if not isinstance(c, BaseException)]
                refused = [e for e in asked if isinstance(e, BaseException)]
                assert len(opened) == 4 and len(refused) == 8, asked
                for error in refused:
                    assert isinstance(error, Error), error
                    assert "refused this call: 4 of 4 contexts in use on this server; try again later" in str(error)
                assert sum(len(browser.contexts) for browser in browsers) == 4
                metrics = server.metrics()
                assert metrics["egresswall_browser_contexts_open"] == 4
                assert metrics['egresswall_browser_contexts_refused_total{cap="server"}'] == 8 * (round_number + 1)
                pages = await asyncio.gather(*(context.new_page() for context in opened))
                await asyncio.gather(*(page.goto(page_url) for page in pages))
                assert {await page.inner_text("body") for page in pages} == {"hello from public /hello"}
                await asyncio.gather(*(context.close() for context in opened))
                await eventually(lambda: server.metrics()["egresswall_browser_contexts_held"] == 0,
                                 what="every slot given back")
                resident.append(server.resident_bytes())
            # the per-client cap: one address with two contexts open cannot have a third
            first, second = await browsers[0].new_context(), await browsers[0].new_context()
            with pytest.raises(Error, match="2 of 2 contexts in use for this client; close one"):
                await browsers[0].new_context()
            other = await browsers[1].new_context()  # another address still can
            for context in (first, second, other):
                await context.close()
            for browser in browsers:
                await browser.close()
        return resident

    resident = asyncio.run(scenario())
    print("browser-server resident set (MiB) at the start and after each round of 12 opens: "
          + ", ".join(f"{r / MiB:.1f}" for r in resident))
    # flat: what one round leaves behind is small against a context (hundreds of MB in the browser)
    assert resident[-1] - resident[1] < 24 * MiB, resident
    metrics = server.metrics()
    assert metrics["egresswall_browser_contexts_opened_total"] == 4 * 3 + 3
    assert metrics['egresswall_browser_contexts_refused_total{cap="client"}'] == 1
    assert "2 of 2 contexts in use for this client" in server.stderr


# ---- idle limits -----------------------------------------------------------------------------------

def test_an_idle_context_and_an_idle_connection_are_closed_and_their_slots_freed(serve):
    from playwright.async_api import Error, async_playwright

    server = serve("--context-idle", "2", "--connection-idle", "6", "--max-contexts-per-client", "1",
                   "--max-connections-per-client", "1")

    async def scenario() -> None:
        async with async_playwright() as playwright:
            browser = await playwright.chromium.connect(server.endpoint, timeout=60_000)
            with pytest.raises(Error, match="(?s)503 .*1 of 1 connections in use for this client; close one"):
                await playwright.chromium.connect(server.endpoint, timeout=60_000)
            disconnected = asyncio.Event()
            browser.on("disconnected", lambda _: disconnected.set())
            context = await browser.new_context()
            page = await context.new_page()
            await page.set_content("<p>idle</p>")
            closed = asyncio.Event()
            context.on("close", lambda _: closed.set())
            started = time.monotonic()
            # a call left waiting does not keep the context past its idle limit: it fails with the reason
            with pytest.raises(Error, match=r"no call for 2 s \(its idle limit\)"):
                await page.wait_for_timeout(30_000)
            await asyncio.wait_for(closed.wait(), 20)
            idle = time.monotonic() - started
            print(f"the idle context was closed after {idle:.1f} s (limit 2 s)")
            assert 1.5 <= idle < 20
            with pytest.raises(Error):
                await page.title()
            # its slot is free: the per-client cap of one admits the next context
            again = await browser.new_context()
            await (await again.new_page()).set_content("<p>again</p>")
            await again.close()
            metrics = server.metrics()
            assert metrics['egresswall_browser_contexts_reaped_total{reason="idle"}'] == 1
            assert metrics["egresswall_browser_contexts_held"] == 0
            # then nothing at all: the connection goes after its own limit
            started = time.monotonic()
            await asyncio.wait_for(disconnected.wait(), 30)
            print(f"the idle connection was closed after {time.monotonic() - started:.1f} s (limit 6 s)")
            assert time.monotonic() - started >= 4
            # and its connection slot is free again, once the server has wound the connection down (the
            # client sees the close frame first, while the server still closes the browser's side)
            await eventually(lambda: server.metrics()["egresswall_browser_connections_open"] == 0,
                             what="the idle connection's slot to be given back")
            browser = await playwright.chromium.connect(server.endpoint, timeout=60_000)
            await browser.close()
        await eventually(lambda: server.metrics()['egresswall_browser_connections_closed_total{reason="idle"}'] == 1)

    asyncio.run(scenario())
    assert "no call for 2 s (the idle limit)" in server.stderr
    assert "no call for 6 s (the idle limit)" in server.stderr


# ---- Chromium's sandbox -----------------------------------------------------------------------------

def test_a_client_cannot_turn_the_sandbox_off(serve):
    """Launch options never reach the driver: launch calls are refused whole (the driver denies them
    too), ``chromiumSandbox`` and sandbox switches are refused in any call, and Playwright's
    ``x-playwright-launch-options`` handshake header is not forwarded (no second browser, same flags)."""
    import json

    from playwright.async_api import async_playwright
    from websockets.asyncio.client import connect

    server = serve()
    _, chromium = driver_and_chromium(server)
    argv = Path(f"/proc/{chromium}/cmdline").read_bytes()

    async def raw_calls() -> list[str]:
        from importlib.metadata import version

        user_agent = f"Playwright/{version('playwright')} (x64; test) python/3"
        async with connect(server.endpoint, user_agent_header=user_agent, max_size=None) as ws:
            await ws.send(json.dumps({"id": 1, "guid": "", "method": "initialize", "params": {"sdkLanguage": "python"},
                                      "metadata": {}}))
            initializer = None
            while initializer is None:
                message = json.loads(await asyncio.wait_for(ws.recv(), 30))
                if message.get("method") == "__create__" and message["params"]["type"] == "Playwright":
                    initializer = message["params"]["initializer"]
            calls = [(initializer["chromium"]["guid"], "launch", {"chromiumSandbox": False, "args": ["--no-sandbox"]}),
                     (initializer["preLaunchedBrowser"]["guid"], "newContext", {"chromiumSandbox": False}),
                     (initializer["preLaunchedBrowser"]["guid"], "newContext", {"x": {"args": ["--no-sandbox"]}})]
            answers = []
            for number, (guid, method, params) in enumerate(calls, start=2):
                await ws.send(json.dumps({"id": number, "guid": guid, "method": method, "params": params,
                                          "metadata": {}}))
                while True:
                    message = json.loads(await asyncio.wait_for(ws.recv(), 30))
                    if message.get("id") == number:
                        answers.append(message["error"]["error"]["message"])
                        break
            return answers

    launch, sandbox_option, sandbox_switch = asyncio.run(raw_calls())
    assert "BrowserType.launch: launching or connecting browsers is the server's business" in launch
    assert "'chromiumSandbox'" in sandbox_option and "'--no-sandbox'" in sandbox_switch

    async def with_header() -> None:
        options = json.dumps({"chromiumSandbox": False, "args": ["--disable-gpu-sandbox"], "headless": False})
        async with async_playwright() as playwright:
            browser = await playwright.chromium.connect(server.endpoint, timeout=60_000,
                                                        headers={"x-playwright-launch-options": options})
            page = await (await browser.new_context()).new_page()
            await page.set_content("<p>same browser</p>")
            await browser.close()

    asyncio.run(with_header())
    assert driver_and_chromium(server)[1] == chromium
    assert Path(f"/proc/{chromium}/cmdline").read_bytes() == argv and b"--disable-gpu-sandbox" not in argv


# ---- bounded messages ------------------------------------------------------------------------------

def test_an_oversized_message_closes_that_connection_only(serve):
    from playwright.async_api import Error, async_playwright

    server = serve("--max-message-bytes", str(1 * MiB), "--max-contexts-per-client", "3")

    async def scenario() -> None:
        async with async_playwright() as playwright:
            async def page_of_its_own():
                browser = await playwright.chromium.connect(server.endpoint, timeout=60_000)
                page = await (await browser.new_context()).new_page()
                await page.set_content("<p>ok</p>")
                return browser, page

            (bystander, bystander_page), (sender, sender_page), (reader, reader_page) = await asyncio.gather(
                page_of_its_own(), page_of_its_own(), page_of_its_own())
            # client → server: 2 MB of page content
            with pytest.raises(Error, match="exceeds limit"):
                await sender_page.set_content("<p>" + "x" * (2 * MiB) + "</p>")
            # server → client: a 2 MB string out of the page
            with pytest.raises(Error, match="a message from the browser over 1048576 bytes"):
                await reader_page.evaluate("'y'.repeat(2 * 1024 * 1024)")
            await eventually(lambda: not sender.is_connected() and not reader.is_connected(), what="both closed")
            # the other connection did not notice
            assert await bystander_page.evaluate("1 + 1") == 2
            assert await bystander_page.inner_text("p") == "ok"
            assert len(await bystander_page.evaluate("'z'.repeat(512 * 1024)")) == 512 * 1024
            await eventually(lambda: server.metrics()["egresswall_browser_contexts_held"] == 1,
                             what="the closed connections' contexts given back")
            await bystander.close()

    asyncio.run(scenario())
    metrics = server.metrics()
    assert metrics['egresswall_browser_connections_closed_total{reason="oversized_from_client"}'] == 1
    assert metrics['egresswall_browser_connections_closed_total{reason="oversized_from_browser"}'] == 1


# ---- a browser killed from outside -----------------------------------------------------------------

def test_a_browser_killed_with_kill_9_is_reported_closed_and_the_next_open_works(serve):
    from playwright.async_api import Error, async_playwright

    server = serve("--max-contexts-per-client", "1")  # the next open proves the slot came back

    async def scenario() -> None:
        async with async_playwright() as playwright:
            browser = await playwright.chromium.connect(server.endpoint, timeout=60_000)
            context = await browser.new_context(viewport={"width": 1280, "height": 800})
            page = await context.new_page()
            # the default message limit (32 MiB) fits a full-page screenshot of a long page of noise
            await page.set_content("<body style=margin:0><canvas id=c width=1280 height=3000></canvas><script>"
                                   "const c = document.getElementById('c').getContext('2d');"
                                   "const d = c.createImageData(1280, 3000);"
                                   "for (let i = 0; i < d.data.length; i++) d.data[i] = (i % 4 == 3) ? 255 : "
                                   "Math.random() * 256; c.putImageData(d, 0, 0);</script>")
            shot = await page.screenshot(full_page=True)
            print(f"a full-page screenshot of 1280x3000 px of noise: {len(shot) / MiB:.1f} MiB of PNG")
            assert len(shot) > 4 * MiB
            closed = asyncio.Event()
            context.on("close", lambda _: closed.set())
            driver, chromium = driver_and_chromium(server)
            os.kill(chromium, signal.SIGKILL)
            await asyncio.wait_for(closed.wait(), 30)
            with pytest.raises(Error, match="the browser exited .*reconnect"):
                await page.title()
            await eventually(lambda: not browser.is_connected(), what="the client's browser disconnected")
            # the next open: a new connection, a new browser, the same cap
            browser = await playwright.chromium.connect(server.endpoint, timeout=90_000)
            page = await (await browser.new_context()).new_page()
            await page.set_content("<p>the next open</p>")
            assert await page.inner_text("p") == "the next open"
            assert driver_and_chromium(server)[1] != chromium
            await browser.close()

    asyncio.run(scenario())
    assert server.process.poll() is None
    metrics = server.metrics()
    assert metrics['egresswall_browser_browser_exits_total{reason="unexpected"}'] == 1
    assert metrics["egresswall_browser_browser_starts_total"] == 2
    assert metrics['egresswall_browser_connections_closed_total{reason="browser_exited"}'] == 1
    assert "the browser exited (killed from outside, or it crashed)" in server.stderr


# ---- the memory ceiling ----------------------------------------------------------------------------

ALLOCATE = "() => { const kept = []; for (;;) { const b = new Uint8Array(16 << 20); b.fill(1); kept.push(b); } }"


def test_a_page_past_the_memory_ceiling_is_killed_and_reported_and_the_server_survives(serve):
    from playwright.async_api import Error, async_playwright

    server = serve("--browser-memory-max", "768M")
    if "browser memory ceiling not applied" in server.stderr:
        reason = re.search(r"browser memory ceiling not applied: (.*)", server.stderr)
        pytest.skip(f"this machine offers no writable memory cgroup: {reason.group(1) if reason else '?'}")
    assert "browser memory ceiling: 768 MiB" in server.stderr
    _, chromium = driver_and_chromium(server)
    memory_line = [line for line in Path(f"/proc/{chromium}/cgroup").read_text().splitlines()
                   if line.split(":")[1] in ("memory", "")]
    assert any("/egresswall-browser-" in line for line in memory_line), memory_line

    async def scenario() -> None:
        async with async_playwright() as playwright:
            browser = await playwright.chromium.connect(server.endpoint, timeout=60_000)
            context = await browser.new_context()
            victim, bystander = await context.new_page(), await context.new_page()
            await bystander.set_content("<p>still here</p>")
            crashed = asyncio.Event()
            victim.on("crash", lambda _: crashed.set())
            with pytest.raises(Error, match="crashed|closed"):
                await victim.evaluate(ALLOCATE)
            await eventually(lambda: server.metrics()["egresswall_browser_oom_kills_total"] >= 1, 30,
                             "the kernel's kill to be counted")
            if browser.is_connected():
                # the usual case: the kernel killed the renderer that grew (the highest oom_score_adj)
                assert crashed.is_set()
                assert await bystander.inner_text("p") == "still here"
            else:  # the browser process itself was chosen: its clients see a closed browser
                browser = await playwright.chromium.connect(server.endpoint, timeout=90_000)
                context = await browser.new_context()
            page = await context.new_page()
            await page.set_content("<p>after</p>")
            assert await page.inner_text("p") == "after"
            await browser.close()

    asyncio.run(scenario())
    assert server.process.poll() is None
    print("after the kill:", {k: v for k, v in server.metrics().items() if "oom" in k or "memory" in k})
    assert re.search(r"the kernel killed \d+ process\(es\) of the browser at its memory ceiling of 768 MiB",
                     server.stderr)
