"""One run of Playwright's ``launch-server``: the driver and the Chromium it launches with the plan.

The driver listens on 127.0.0.1 at a random port and an unguessable path; only the relay reaches it.
It exits when its browser does (Playwright closes the server with the browser), so ``exited`` is the
browser's end too. With a memory ceiling the driver is started inside the browser's own cgroup
(``cgroup.py``), and when it ends whatever is left in the group is killed and the group removed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import signal
from pathlib import Path

from .cgroup import BrowserCgroup
from .launch import ContainmentError, LaunchPlan, browser_command_line, verify_command_line

log = logging.getLogger("egresswall.browser")


class BrowserProcess:
    def __init__(self, plan: LaunchPlan, workdir: Path, cgroup: BrowserCgroup | None = None,
                 start_timeout: float = 60.0, port: int = 0) -> None:
        self.plan = plan
        self.port = port  # the driver's loopback port; 0: any free one
        self.workdir = workdir
        self.cgroup = cgroup
        self.start_timeout = start_timeout
        self.upstream: str | None = None  # the driver's endpoint, with its secret path
        self.oom_kills_at_start = 0
        self._driver: asyncio.subprocess.Process | None = None
        self.exited = asyncio.Event()
        self.exit_status: int | None = None
        self.exit_reason: str | None = None  # why it ended, said to its clients
        self.stopping = False  # stopped by the server, not died
        self._tasks: set[asyncio.Task] = set()  # held here: the loop keeps only weak references

    async def start(self) -> None:
        from playwright._impl._driver import compute_driver_executable, get_driver_env

        config = self.plan.server_config()
        config.update(host="127.0.0.1", port=self.port, wsPath="/" + secrets.token_urlsafe(24))
        config_file = self.workdir / "launch-server.json"
        config_file.touch(mode=0o600)
        config_file.write_text(json.dumps(config))
        node, cli = compute_driver_executable()
        argv = [node, cli, "launch-server", "--browser", "chromium", "--config", str(config_file)]
        if self.cgroup is not None:
            self.oom_kills_at_start = self.cgroup.oom_kills()
            argv = self.cgroup.enter_command(argv)
        self._driver = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, env=get_driver_env())
        self._spawn(self._watch(self._driver))
        assert self._driver.stdout is not None
        try:
            while True:
                line = await asyncio.wait_for(self._driver.stdout.readline(), self.start_timeout)
                if not line:
                    await self.exited.wait()
                    raise ContainmentError(f"the Playwright driver exited before the browser started "
                                           f"(status {self.exit_status})")
                text = line.decode(errors="replace").strip()
                if text.startswith("ws://"):
                    self.upstream = text
                    break
        except TimeoutError:
            raise ContainmentError(f"the browser did not start within {self.start_timeout:g} seconds") from None
        self._spawn(self._drain(self._driver.stdout))
        await self._verify()

    def _spawn(self, work) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _verify(self) -> None:
        argv = await asyncio.to_thread(browser_command_line, self.plan.user_data_dir)
        problems = ["the browser process was not found in /proc"] if argv is None else verify_command_line(argv,
                                                                                                           self.plan)
        if problems:
            raise ContainmentError("the launched Chromium is not contained: " + "; ".join(problems))

    async def _watch(self, driver: asyncio.subprocess.Process) -> None:
        self.exit_status = await driver.wait()
        if self.stopping:
            self.exit_reason = "the browser server is stopping"
        elif self.killed_at_ceiling():
            self.exit_reason = "the browser was killed by the kernel at its memory ceiling"
        else:
            self.exit_reason = "the browser exited (killed from outside, or it crashed)"
        self.exited.set()

    async def wait_exit(self, timeout: float) -> str | None:
        """Why the browser ended, if it ends within ``timeout`` seconds."""
        try:
            await asyncio.wait_for(self.exited.wait(), timeout)
        except TimeoutError:
            return None
        return self.exit_reason

    @staticmethod
    async def _drain(stream: asyncio.StreamReader) -> None:
        while await stream.readline():
            pass

    def killed_at_ceiling(self) -> bool:
        """Whether the kernel killed a process of this browser at its memory ceiling."""
        return self.cgroup is not None and self.cgroup.oom_kills() > self.oom_kills_at_start

    async def stop(self) -> None:
        """End the driver (Playwright closes the browser on SIGTERM), then anything left in the group."""
        self.stopping = True
        driver = self._driver
        if driver is not None and driver.returncode is None:
            driver.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.exited.wait(), 15)
            except TimeoutError:
                driver.kill()
                await self.exited.wait()
        await self.release()

    async def release(self) -> None:
        """After the driver ended: kill the rest of the browser tree in its group, remove the group."""
        if self.cgroup is not None:
            await asyncio.to_thread(self.cgroup.kill_all)
            await asyncio.to_thread(self.cgroup.remove)
