"""Chromium's sandbox: on for an unprivileged user, and as root a launch is refused unless ``--no-sandbox``
says so. The sandboxed path runs as an unprivileged user (the suite runs as root in CI: it drops to
``TEST_UID`` with setpriv, no capabilities), and ``/proc`` shows that its renderers are sandboxed: a
seccomp-bpf filter and namespaces of their own. The same check on a ``--no-sandbox`` browser fails, so it
can fail."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from unprivileged import (
    AS_ROOT,
    TEST_UID,
    chromium_processes,
    sandbox_problems,
    unprivileged_argv,
)

from browser import launch as launcher
from browser.launch import ContainmentError, plan_launch

ROOT = Path(__file__).resolve().parents[1]
ARTICLE = ("<html><head><title>Sandbox article</title></head><body><article><h1>Sandbox article</h1>"
           "<p>Read by a Chromium whose renderers are sandboxed, as an unprivileged user.</p>"
           "<p>The second paragraph is here so the reader has a body to print.</p></article></body></html>")


# ---- the plan ---------------------------------------------------------------------------------------

def test_as_root_a_launch_without_no_sandbox_is_refused_with_one_clear_line(monkeypatch):
    monkeypatch.setattr(launcher, "running_as_root", lambda: True)
    for sandbox in (None, True):
        with pytest.raises(ContainmentError) as refused:
            plan_launch("127.0.0.1:3128", sandbox=sandbox)
        message = str(refused.value)
        assert "\n" not in message
        assert "running as root" in message and "sandbox cannot run as root" in message
        assert "--no-sandbox" in message and "unprivileged user" in message


def test_as_root_no_sandbox_stated_is_obeyed_and_logged(monkeypatch, caplog):
    monkeypatch.setattr(launcher, "running_as_root", lambda: True)
    with caplog.at_level(logging.WARNING, logger="egresswall.browser"):
        plan = plan_launch("127.0.0.1:3128", sandbox=False)
    try:
        assert not plan.chromium_sandbox and plan.args.count("--no-sandbox") == 1
        assert plan.server_config()["chromiumSandbox"] is False
        assert "sandbox is OFF by request" in caplog.text
    finally:
        plan.cleanup()


def test_an_unprivileged_user_gets_the_sandbox(monkeypatch):
    monkeypatch.setattr(launcher, "running_as_root", lambda: False)
    for sandbox in (None, True):
        plan = plan_launch("127.0.0.1:3128", sandbox=sandbox)
        try:
            assert plan.chromium_sandbox and "--no-sandbox" not in plan.args
            assert plan.launch_options()["chromium_sandbox"] is True
            assert plan.server_config()["chromiumSandbox"] is True
        finally:
            plan.cleanup()


def test_no_sandbox_cannot_come_in_as_an_extra_argument():
    with pytest.raises(ContainmentError, match="would change containment"):
        plan_launch("127.0.0.1:3128", sandbox=False, extra_args=["--no-sandbox"])


# ---- the commands, as root ------------------------------------------------------------------------------

def run_cli(*args: str, argv_wrapper=None, env=None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "proxy.cli", *args]
    if argv_wrapper is not None:
        argv = argv_wrapper(argv)
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.skipif(not AS_ROOT, reason="the refusal is for root")
@pytest.mark.parametrize("command", [["browse", "http://public.lab.example/"], ["browser-server", "--port", "0"]])
def test_as_root_the_commands_refuse_without_no_sandbox_and_say_why(command, lab, tmp_path):
    done = run_cli(*command, "--proxy", "127.0.0.1:9", timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("egresswall: running as root"), done.stderr
    assert "--no-sandbox" in lines[0]
    # With --policy the in-process proxy was started first: it is stopped again, and the line is the same.
    policy = tmp_path / "policy.yaml"
    policy.write_text(lab.policy_text())
    done = run_cli(*command, "--policy", str(policy), timeout=60)
    assert done.returncode == 2 and "egresswall: running as root" in done.stderr, done.stderr


# ---- the sandboxed path, as an unprivileged user ----------------------------------------------------------

@pytest.fixture
def user_home():
    """A HOME and TMPDIR the test user owns (Chromium writes its NSS database and profile there), outside
    pytest's own directory, which only root may enter."""
    home = Path(tempfile.mkdtemp(prefix="egresswall-user-", dir="/tmp"))
    if AS_ROOT:
        os.chown(home, TEST_UID, TEST_UID)
    yield home
    shutil.rmtree(home, ignore_errors=True)


def as_user(argv: list[str]) -> list[str]:
    return unprivileged_argv(argv) if AS_ROOT else argv


def user_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    return {**env, "HOME": str(home), "TMPDIR": str(home), "PYTHONDONTWRITEBYTECODE": "1"}


@pytest.mark.integration
def test_sandboxed_chromium_as_an_unprivileged_user_reads_the_lab_article(lab, start_proxy, user_home):
    proxy = start_proxy(lab.policy_text())
    lab.public.serve("/page/sandbox-article", ARTICLE)
    url = f"http://public.lab.example:{lab.public.port}/page/sandbox-article"
    done = run_cli("browse", url, "--proxy", f"{proxy.host}:{proxy.port}", "--format", "json",
                   argv_wrapper=as_user, env=user_env(user_home))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["read"] and result["title"] == "Sandbox article"
    assert "renderers are sandboxed" in result["content"]
    assert "sandbox is OFF" not in done.stderr
    assert any(d["host"] == "public.lab.example" and d["verdict"] == "allow" for d in proxy.decisions())


class UserBrowserServer:
    """``egresswall browser-server`` as the test user, on a loopback port of its choosing."""

    def __init__(self, proxy: str, home: Path, *extra: str) -> None:
        self.log = home / f"server{'-'.join(extra)}.log"
        self._err = open(self.log, "wb")  # noqa: SIM115 - open for the process's life
        argv = as_user([sys.executable, "-m", "proxy.cli", "browser-server", "--port", "0", "--proxy", proxy,
                        *extra])
        self.process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self._err,
                                        env=user_env(home), start_new_session=True)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            match = re.search(r"listening on (ws://\S+)", self.log.read_text(errors="replace"))
            if match:
                self.endpoint = match.group(1)
                return
            if self.process.poll() is not None:
                break
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"browser-server did not start:\n{self.log.read_text(errors='replace')}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait(timeout=10)
        self._err.close()


def read_through_server(server: UserBrowserServer, url: str) -> tuple[str, dict[int, str], list[str]]:
    """Open ``url`` in the server's browser; return the page's text and, read while it is open, the
    user's Chromium processes and what /proc says is not sandboxed about them."""
    from playwright.sync_api import sync_playwright

    uid = TEST_UID if AS_ROOT else os.getuid()
    with sync_playwright() as playwright:
        browser = playwright.chromium.connect(server.endpoint)
        try:
            page = browser.new_page()
            page.goto(url, timeout=30_000)
            text = page.inner_text("article")
            processes = chromium_processes(uid)
            return text, processes, sandbox_problems(processes)
        finally:
            browser.close()


@pytest.mark.integration
def test_browser_server_renderers_are_sandboxed_as_proc_shows(lab, start_proxy, user_home):
    proxy = start_proxy(lab.policy_text())
    lab.public.serve("/page/sandbox-article", ARTICLE)
    url = f"http://public.lab.example:{lab.public.port}/page/sandbox-article"
    address = f"{proxy.host}:{proxy.port}"

    server = UserBrowserServer(address, user_home)
    try:
        text, processes, problems = read_through_server(server, url)
    finally:
        server.stop()
    assert "renderers are sandboxed" in text
    assert "renderer" in processes.values(), processes
    assert problems == []
    assert "sandbox is OFF" not in server.log.read_text(errors="replace")

    # The negative control: the same user's server with --no-sandbox, and the same check must object.
    weak = UserBrowserServer(address, user_home, "--no-sandbox")
    try:
        text, processes, problems = read_through_server(weak, url)
    finally:
        weak.stop()
    assert "renderers are sandboxed" in text
    problems = " ".join(problems)
    assert "Seccomp is '0', not 2" in problems and "shares the browser's user namespace" in problems
    assert "sandbox is OFF by request" in weak.log.read_text(errors="replace")
