"""``egresswall run --workers N``: one port, one audit log, summed metrics, restarts, clean stop."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from metrics_page import families, total, value

from proxy.build import versions
from proxy.metrics import DNS_BUCKETS

pytestmark = pytest.mark.integration


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def decisions_total(proxy) -> float:
    return total(proxy.admin("/metrics")[1], "egresswall_decisions_total")


def check_summed_page(body: str, requests: int, started: float) -> None:
    """The supervisor's page (issue 14 item 7): counters and the DNS histogram added over the workers,
    one build_info series, the latest reload time, decisions by rule id."""
    page = families(body)
    assert value(body, "egresswall_decisions_total", verdict="allow", rule_id="default:allow") >= requests / 2
    assert value(body, "egresswall_decisions_total", verdict="refuse", rule_id="special-purpose 127.0.0.0/8") \
        >= requests / 2
    kind, samples = page["egresswall_dns_lookup_seconds"]
    assert kind == "histogram"
    assert [float(s.labels["le"]) for s in samples if s.name.endswith("_bucket")] == [*DNS_BUCKETS, float("inf")]
    assert value(body, "egresswall_dns_lookup_seconds_count") >= requests  # one lookup per request, summed
    assert value(body, "egresswall_dns_lookup_seconds_bucket", le="+Inf") == \
        value(body, "egresswall_dns_lookup_seconds_count")
    _, samples = page["egresswall_build_info"]
    assert [(s.labels, s.value) for s in samples] == [(versions(), 1)]  # one series, not one per worker
    assert started - 1 <= value(body, "egresswall_policy_last_reload_success_timestamp_seconds") <= time.time()
    assert value(body, "egresswall_policy_loaded") == 1


def wait_ready(proxy, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proxy.admin("/readyz")[0] == 200:
            return
        time.sleep(0.2)
    raise AssertionError("the worker pool did not become ready")


def test_workers_share_one_port_one_log_and_summed_metrics(lab, start_proxy):
    started = time.time()
    proxy = start_proxy(lab.policy_text(), "--workers", "2")
    wait_ready(proxy)
    assert len(children(proxy.process.pid)) == 2
    statuses = [proxy.get(f"http://{host}:{lab.public.port}/w{i}")[0]
                for i, host in enumerate(["public.lab.example", "internal.lab.example"] * 10)]
    assert statuses == [200, 403] * 10
    time.sleep(0.3)
    records = proxy.audit()
    assert sorted(r["path"] for r in records if r["event"] == "decision") == sorted(f"/w{i}" for i in range(20))
    assert decisions_total(proxy) == 20
    check_summed_page(proxy.admin("/metrics")[1], 20, started)
    # The workers run under the test's network guard too (tests/proxyproc.py WORKER_GUARD): their connects to
    # the origin and their DNS queries are seen, and every one of them went to loopback.
    assert any(e["port"] == lab.public.port for e in proxy.outbound()), proxy.guard_events()
    assert proxy.datagrams() and all(e["host"].startswith("127.") for e in proxy.datagrams() + proxy.outbound())

    # A worker that dies is restarted, and the counters it had do not vanish from the sum.
    os.kill(children(proxy.process.pid)[0], signal.SIGKILL)
    time.sleep(1.0)
    wait_ready(proxy)
    assert len(children(proxy.process.pid)) == 2
    assert decisions_total(proxy) >= 20
    check_summed_page(proxy.admin("/metrics")[1], 20, started)  # what the dead worker counted is carried
    assert proxy.get(f"http://public.lab.example:{lab.public.port}/after")[0] == 200

    pids = children(proxy.process.pid)
    proxy.signal(signal.SIGTERM)
    assert proxy.process.wait(20) == 0
    for pid in pids:  # no worker outlives the supervisor
        status = Path(f"/proc/{pid}/status")
        assert not status.exists() or "zombie" in status.read_text()


def test_abbreviated_options_are_refused(tmp_path):
    import sys

    result = subprocess.run([sys.executable, "-m", "proxy.cli", "run", "--no-adm"], capture_output=True, text=True,
                            timeout=60, cwd=Path(__file__).resolve().parent.parent)
    assert result.returncode == 2 and "unrecognized arguments: --no-adm" in result.stderr


# ---- the structured path between supervisor and worker (proxy/worker_config.py) ---------------------

ROOT = Path(__file__).resolve().parent.parent


def start_worker(config_for_fd) -> tuple[subprocess.Popen, int]:
    """``python -P -m proxy.cli.worker`` as the supervisor starts it: its configuration on stdin, the
    write end of a pipe inherited; returns the process and the read end."""
    import sys

    read_end, write_end = os.pipe()
    process = subprocess.Popen([sys.executable, "-P", "-m", "proxy.cli.worker"], stdin=subprocess.PIPE,
                               stderr=subprocess.PIPE, pass_fds=(write_end,), cwd=ROOT)
    os.close(write_end)
    process.stdin.write(config_for_fd(write_end).to_json().encode())
    process.stdin.close()
    return process, read_end


def read_report(fd: int, timeout: float = 60):
    import select

    from proxy.worker_config import WorkerReport

    with os.fdopen(fd, "rb") as pipe:
        assert select.select([pipe], [], [], timeout)[0], "the worker reported nothing"
        line = pipe.readline()
    return WorkerReport.from_line(line)


def test_a_worker_takes_its_configuration_on_stdin_and_reports_ready_on_its_pipe(tmp_path):
    from policy.loader import Overrides
    from proxy.runner import RunConfig
    from proxy.worker_config import READY, WorkerConfig

    policy = tmp_path / "policy.yaml"
    policy.write_text("version: 1\ndefault: deny\n")
    run = RunConfig(str(policy), Overrides(allow_hosts=["a.example"]), listen=("127.0.0.1", 0),
                    admin=("127.0.0.1", 0), log_path=str(tmp_path / "audit.jsonl"))
    worker, fd = start_worker(lambda write_end: WorkerConfig(run, write_end))
    try:
        report = read_report(fd)
        assert report.event == READY and report.pid == worker.pid
        # The addresses it reported are the ones it serves on.
        status, body = _get(report.admin, "/readyz")
        assert status == 200 and body.startswith("ready"), body
        with socket.create_connection(report.listen, timeout=5) as sock:
            sock.sendall(b"GET http://b.example/ HTTP/1.1\r\nHost: b.example\r\n\r\n")
            assert sock.recv(100).startswith(b"HTTP/1.1 403")  # the override and the default were applied
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(20) == 0
    stderr = worker.stderr.read().decode()
    assert "proxy on" not in stderr  # the human start-up line is the supervisor's, not parsed from workers


def test_a_worker_that_cannot_listen_says_why_on_its_pipe(tmp_path):
    from policy.loader import Overrides
    from proxy.runner import RunConfig
    from proxy.worker_config import FAILED, WorkerConfig

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()
        run = RunConfig(None, Overrides(), listen=taken, admin=None, log_path=str(tmp_path / "audit.jsonl"))
        worker, fd = start_worker(lambda write_end: WorkerConfig(run, write_end))
        report = read_report(fd)
        assert worker.wait(20) == 2
    assert report.event == FAILED and report.exit == 2
    assert f"cannot listen on 127.0.0.1:{taken[1]}: address already in use" in report.error
    assert worker.stderr.read() == b""  # said once, on the pipe: the supervisor prints it


def test_a_worker_refuses_a_malformed_configuration(tmp_path):
    import sys

    done = subprocess.run([sys.executable, "-P", "-m", "proxy.cli.worker"], input=b'{"run": {}, "ready_fd": 1}',
                          capture_output=True, cwd=ROOT, timeout=60, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 70 and b"a bug in egresswall" in done.stderr and b"Traceback" not in done.stderr
    (details,) = tmp_path.glob("egresswall-bug-*.txt")
    assert "fields differ from RunConfig" in details.read_text()


def test_workers_interrupted_during_start_up_stop_at_once_with_the_reason(tmp_path):
    import sys

    process = subprocess.Popen([sys.executable, "-m", "proxy.cli", "run", "--workers", "2", "--listen", "127.0.0.1:0",
                                "--admin", "127.0.0.1:0", "--log", str(tmp_path / "audit.jsonl")],
                               stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        deadline = time.monotonic() + 30
        while len(children(process.pid)) < 2:  # both workers exist; neither has had time to start
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=15)
        took = time.monotonic() - sent
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "proxy on" not in stderr, stderr  # it really was interrupted during start-up
    assert "start-up interrupted by SIGTERM" in stderr and "Traceback" not in stderr, stderr
    assert process.returncode == 128 + signal.SIGTERM and took < 8, (process.returncode, took)


def _get(address, path: str) -> tuple[int, str]:
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(f"GET {path} HTTP/1.0\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


def _tcp_listening_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on, from /proc (its socket inodes matched to the LISTEN rows)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:  # state LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_no_worker_listens_where_a_client_of_another_worker_could_reach_it(lab, start_proxy):
    """Each worker's admin listener was a loopback port that only that worker refused (rule ``self``): with a
    policy that admits loopback, a client whose connection landed on another worker got the first one's
    /metrics and /readyz through the proxy (review round 17). Workers now serve their admin listener on a Unix
    socket in a directory only the supervisor's user may enter; every TCP port of the pool is refused."""
    policy = lab.policy_text().replace(f"allow: [{lab.public.host}/32]", "allow: [127.0.0.0/8]")
    policy = policy.replace(f"  http: {sorted({80, lab.public.port})}", "  http: ['1-65535']")
    policy = policy.replace(f"  connect: {sorted({443, lab.public_tls.port})}", "  connect: ['1-65535']")
    proxy = start_proxy(policy, "--workers", "2")
    wait_ready(proxy)
    workers = children(proxy.process.pid)
    assert len(workers) == 2
    for pid in workers:
        assert _tcp_listening_ports(pid) == {proxy.port}, "a worker listens on a TCP port of its own"
    ports = set().union(*(_tcp_listening_ports(pid) for pid in [proxy.process.pid, *workers]))
    assert ports == {proxy.port, proxy.admin_port}
    for port in sorted(ports):
        for attempt in range(8):  # connections land on either worker
            status, headers, _ = proxy.get(f"http://127.0.0.1:{port}/metrics")
            assert (status, headers.get("x-egresswall-rule")) == (403, "self"), (port, attempt, status, headers)
    assert proxy.admin("/readyz")[0] == 200  # and the supervisor still reads each worker's
    paths = [line.split()[-1] for line in Path("/proc/net/unix").read_text().splitlines()
             if "/egresswall-workers-" in line]
    (folder,) = {os.path.dirname(path) for path in paths}
    assert len(set(paths)) == 2 and os.stat(folder).st_mode & 0o777 == 0o700, paths
    proxy.signal(signal.SIGTERM)
    assert proxy.process.wait(20) == 0
    assert not os.path.exists(folder)


def test_a_worker_that_cannot_restart_says_why(lab, start_proxy):
    """A worker that died while the policy file was broken (the reload was refused; the others keep the last
    good policy) could not start again, and the supervisor said only 'worker 0 exited with 2', and /readyz
    'not ready: workers down [0]; ' (review round 17). Both now carry the worker's own reason."""
    proxy = start_proxy(lab.policy_text(), "--workers", "2")
    wait_ready(proxy)
    proxy.policy_path.write_text("version: 1\ndefault: [\n")
    victim = children(proxy.process.pid)[0]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and "exited with 2 (" not in proxy.stderr:
        time.sleep(0.2)
    (line,) = [line for line in proxy.stderr.splitlines() if "exited with 2 (" in line][:1]
    assert "policy" in line and "restarting it" in line, line
    status, body = proxy.admin("/readyz")
    assert status == 503 and "workers down" in body and "policy" in body.split("workers down", 1)[1], body
    # the worker that kept the last good policy still serves
    assert proxy.get(f"http://public.lab.example:{lab.public.port}/still")[0] == 200


def test_workers_start_when_tmpdir_is_too_long_a_path_for_a_socket(lab, tmp_path):
    """A Unix socket's path holds 107 bytes: with a TMPDIR of 70 characters or more the workers' admin sockets could
    not be bound, and `run --workers 2` ended with an internal error (review round 17). Their folder goes to /tmp
    then."""
    from proxyproc import ProxyProcess

    long_tmp = tmp_path / ("t" * 100)
    long_tmp.mkdir()
    policy = tmp_path / "policy.yaml"
    policy.write_text(lab.policy_text())
    proxy = ProxyProcess(["--policy", str(policy), "--workers", "2"], tmp_path / "audit.jsonl",
                         env={"TMPDIR": str(long_tmp)})
    try:
        wait_ready(proxy)
        assert proxy.get(f"http://public.lab.example:{lab.public.port}/long-tmp")[0] == 200
        assert "internal error" not in proxy.stderr
    finally:
        proxy.stop()


def test_a_refused_reload_is_said_by_the_supervisors_readyz(lab, start_proxy):
    """Each worker refuses an invalid edit and keeps the last good policy; the supervisor's /readyz stays 200 and
    says the reload was refused and why, once, as one worker's would (review round 22)."""
    proxy = start_proxy(lab.policy_text(), "--workers", "2")
    wait_ready(proxy)
    proxy.policy_path.write_text(lab.policy_text("hosts:\n  allwo: []\n"))
    proxy.signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and "the last reload was refused" not in proxy.admin("/readyz")[1]:
        time.sleep(0.1)
    status, body = proxy.admin("/readyz")
    assert status == 200 and body.startswith("ready; 2 workers; the last reload was refused"), body
    assert body.count("unknown key 'allwo'") == 1, body
    assert proxy.get(f"http://public.lab.example:{lab.public.port}/kept")[0] == 200
