"""Errors, never tracebacks (issue 14 item 1), through the real command line: a command that fails
prints one line that says what failed and what to do, and exits 2 for usage and environment errors;
an unexpected exception is one line that says it is a bug and where the traceback was written."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.integration


def egresswall(*args: str, timeout: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "proxy.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port another program listens on."""
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def one_line(result: subprocess.CompletedProcess) -> str:
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("egresswall: "), result.stderr
    assert "Traceback" not in result.stderr and "--mode" not in result.stderr, result.stderr
    return lines[0]


@pytest.mark.parametrize("listener, extra", [
    ("proxy", []), ("proxy", ["--fast-tunnels"]), ("proxy", ["--workers", "2"]),
    ("admin", []), ("admin", ["--workers", "2"]),
])
def test_a_taken_port_is_one_line_at_once(tmp_path: Path, taken_port: int, listener: str, extra: list[str]) -> None:
    listen, admin = ("127.0.0.1:0", "127.0.0.1:0")
    if listener == "proxy":
        listen = f"127.0.0.1:{taken_port}"
    else:
        admin = f"127.0.0.1:{taken_port}"
    started = time.monotonic()
    result = egresswall("run", "--listen", listen, "--admin", admin, "--log", str(tmp_path / "audit.jsonl"), *extra)
    took = time.monotonic() - started
    line = one_line(result)
    assert result.returncode == 2
    assert line.startswith(f"egresswall: the {listener} listener cannot listen on 127.0.0.1:{taken_port}: "
                           "address already in use; another program already listens there"), line
    assert ("--listen HOST:PORT" if listener == "proxy" else "--admin HOST:PORT (or --no-admin)") in line
    assert took < 8, f"took {took:.1f}s"  # it used to wait out a 10-second poll


def test_browser_server_on_a_taken_port_is_one_line_before_any_browser_starts(taken_port: int) -> None:
    started = time.monotonic()
    result = egresswall("browser-server", "--port", str(taken_port), "--proxy", "127.0.0.1:9")
    took = time.monotonic() - started
    line = one_line(result)
    assert result.returncode == 2
    assert line.startswith(f"egresswall: the browser server listener cannot listen on 127.0.0.1:{taken_port}: "
                           "address already in use"), line
    assert "--host and --port" in line and took < 8


def test_an_address_of_no_interface_is_one_line() -> None:
    # 192.0.2.1 (TEST-NET-1) is on no interface here: the bind fails locally, nothing is sent.
    result = egresswall("run", "--listen", "192.0.2.1:3128", "--no-admin")
    line = one_line(result)
    assert result.returncode == 2 and "cannot assign requested address; no interface of this machine" in line


@pytest.mark.parametrize("args, words", [
    (["run", "--log", "/nonexistent-dir/audit.jsonl"],
     "--log /nonexistent-dir/audit.jsonl: the audit log cannot be opened: no such file or directory"),
    (["run", "--confdir", "/proc/egresswall-ca"],
     "--confdir /proc/egresswall-ca: cannot be used as mitmproxy's CA directory"),
    (["run", "--workers", "0"], "--workers 0: at least 1"),
    (["check", "--nameserver", "127.0.0.1:0", "https://a.example/"], "--nameserver 127.0.0.1:0: got"),
    (["browse", "--max-chars", "0", "https://a.example/"], "--max-chars, --timeout and --max-links must be positive"),
    (["squid", "export", "/nonexistent.yaml"], "/nonexistent.yaml: no such file"),
])
def test_environment_and_usage_errors_are_one_line_exit_2(args: list[str], words: str) -> None:
    result = egresswall(*args, "--listen", "127.0.0.1:0") if args[0] == "run" else egresswall(*args)
    line = one_line(result)
    assert result.returncode == 2 and words in line, line


def test_a_usage_error_is_argparse_s_two_lines_and_exit_2() -> None:
    result = egresswall("run", "--listen", "nonsense")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "argument --listen: expected HOST:PORT" in result.stderr


@pytest.mark.parametrize("args, unknown, command, usage", [
    (["lint", "policy/default.yaml", "--bogus"], "--bogus", "egresswall lint",
     "usage: egresswall lint [-h] [--strict] file"),
    (["check", "--bogus", "http://a.example/"], "--bogus", "egresswall check",
     "usage: egresswall check [-h] [--policy FILE]"),
    (["squid", "import", "--bogus", "squid.conf"], "--bogus", "egresswall squid import",
     "usage: egresswall squid import [-h]"),
    (["replay", "--default", "deny", "a.jsonl", "--policy", "p.yaml"], "--default", "egresswall replay",
     "usage: egresswall replay [-h] --policy NEW.yaml"),
    (["run", "--no-adm"], "--no-adm", "egresswall run", "usage: egresswall run [-h] [--policy FILE]"),
])
def test_an_unknown_option_prints_that_command_s_usage_and_exits_2(args: list[str], unknown: str, command: str,
                                                                   usage: str) -> None:
    result = egresswall(*args)
    assert result.returncode == 2 and "Traceback" not in result.stderr and result.stdout == ""
    assert result.stderr.startswith(usage), result.stderr  # not "usage: egresswall [-h] [--version] {lint} ..."
    assert result.stderr.splitlines()[-1] == (f"{command}: error: unrecognized arguments: {unknown} "
                                              f"(see {command} --help)"), result.stderr


@pytest.mark.parametrize("args", [
    ["lint", "policy/default.yaml"],
    ["check", "http://10.0.0.1/"],  # an IP literal: never resolved, and check connects nowhere
    ["replay", "LOG", "--policy", "policy/default.yaml"],
    ["suggest", "LOG"],
])
def test_output_to_a_reader_that_went_away_exits_141_quietly(args: list[str], tmp_path: Path) -> None:
    """``egresswall replay ... | head -1``: the reader closed the pipe; no traceback, no bug report, status 141
    (128 + SIGPIPE) as a shell reports for a process SIGPIPE ended. (It was 'internal error, a bug in
    egresswall: BrokenPipeError', exit 70.)"""
    log = tmp_path / "audit.jsonl"
    log.write_text('{"time": 17}\n')
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written
    try:
        done = subprocess.run([sys.executable, "-m", "proxy.cli", *[str(log) if a == "LOG" else a for a in args]],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=60,
                              env={**os.environ, "TMPDIR": str(tmp_path)})
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (141, "")
    assert not list(tmp_path.glob("egresswall-bug-*"))


def test_a_pipe_into_head_ends_quietly_with_141(tmp_path: Path) -> None:
    urls = " ".join(f"http://10.0.{i // 250}.{i % 250 + 1}/" for i in range(3000))  # far more than a pipe holds
    done = subprocess.run(["bash", "-c", f"{sys.executable} -m proxy.cli check {urls} | head -1; "
                                         "echo \"status ${PIPESTATUS[0]}\""],
                          capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.stdout == "url       http://10.0.0.1/\nstatus 141\n" and done.stderr == "", done.stderr
    assert not list(tmp_path.glob("egresswall-bug-*"))


def test_an_unexpected_exception_says_it_is_a_bug_and_where_the_traceback_is(tmp_path: Path) -> None:
    # A planted bug: lint's rule checker raises. main() must not show the traceback, but keep it.
    code = ("import sys\nimport proxy.cli.lint as cmd\n"
            "def boom(policy):\n    raise RuntimeError('planted for the test')\n"
            "cmd.lint = boom\nfrom proxy.cli import main\nsys.exit(main(sys.argv[1:]))")
    result = subprocess.run([sys.executable, "-c", code, "lint", "policy/default.yaml"], capture_output=True,
                            text=True, cwd=ROOT, timeout=60, env={**os.environ, "TMPDIR": str(tmp_path)})
    line = one_line(result)
    assert result.returncode == 70
    assert "internal error, a bug in egresswall: RuntimeError: planted for the test" in line
    (details,) = tmp_path.glob("egresswall-bug-*.txt")
    assert str(details) in line
    text = details.read_text()
    assert "Traceback (most recent call last)" in text and "RuntimeError: planted for the test" in text
