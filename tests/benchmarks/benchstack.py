"""The processes the side-by-side benchmarks run on loopback, each from a config the run writes: nginx as
the upstream, Debian's squid (forward-only) and egresswall with default settings.

Shared by ``bench_proxy.py`` (``make bench``) and ``bench_pageload.py`` (``make bench-pageload``), so both
compare against the same squid and the same egresswall. Everything listens on 127.0.0.x.
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_port(host: str, port: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listening on {host}:{port}")


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536), hard))


class Processes:
    """The run's child processes, each logging to WORK/NAME.out, stopped together (SIGTERM, then kill)."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.procs: list[subprocess.Popen] = []

    def spawn(self, args: list[str], name: str, **kw) -> subprocess.Popen:
        log = open(self.work / f"{name}.out", "wb")  # noqa: SIM115 - lives as long as the process
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, preexec_fn=raise_fd_limit, **kw)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def start_nginx(procs: Processes, http_block: str, listens: Iterable[tuple[str, int]]) -> subprocess.Popen:
    """nginx in the foreground, one worker, every temp path in the work folder; ``http_block`` is the
    inside of ``http { }`` (servers, log formats); returns once every (address, port) accepts."""
    work = procs.work
    conf = work / "nginx.conf"
    conf.write_text(f"""
daemon off; worker_processes 1; pid {work}/nginx.pid; error_log {work}/nginx-error.log;
events {{ worker_connections 8192; }}
http {{
  client_body_temp_path {work}/nb; proxy_temp_path {work}/np; fastcgi_temp_path {work}/nf;
  uwsgi_temp_path {work}/nu; scgi_temp_path {work}/ns;
{http_block}
}}
""")
    proc = procs.spawn(["nginx", "-c", str(conf), "-e", str(work / "nginx-error.log")], "nginx")
    for host, port in listens:
        wait_port(host, port)
    return proc


def start_squid(procs: Processes, port: int, hosts: dict[str, str], http_ports: Sequence[int],
                tls_ports: Sequence[int]) -> subprocess.Popen:
    """squid as a forward proxy only: no cache, names from a hosts file (so it needs no DNS server),
    CONNECT to ``tls_ports`` only, every client allowed (the comparison is of speed, not of policy)."""
    work = procs.work
    os.chmod(work, 0o777)  # squid drops to its own user and must write its logs here
    hosts_file = work / "hosts"
    hosts_file.write_text("".join(f"{address} {name}\n" for name, address in hosts.items()))
    conf = work / "squid.conf"
    conf.write_text(f"""
http_port 127.0.0.1:{port}
pid_filename {work}/squid.pid
cache deny all
cache_mem 0 MB
access_log stdio:{work}/squid-access.log
cache_log {work}/squid-cache.log
hosts_file {hosts_file}
dns_nameservers 127.0.0.1
acl SSL_ports port {" ".join(map(str, tls_ports))}
acl Safe_ports port {" ".join(map(str, [*http_ports, *tls_ports]))}
acl CONNECT method CONNECT
http_access deny !Safe_ports
http_access deny CONNECT !SSL_ports
http_access allow all
shutdown_lifetime 1 seconds
max_filedescriptors 65536
""")
    proc = procs.spawn(["squid", "-N", "-f", str(conf)], "squid")
    wait_port("127.0.0.1", port, 30)
    return proc


def egresswall_policy(allow: Sequence[str], addresses: Sequence[str], http_ports: Sequence[int],
                      tls_ports: Sequence[int], nameserver: str, deny: Sequence[str] = ()) -> str:
    """An enforcing, default-deny policy that allows ``allow`` and re-admits the loopback ``addresses``
    the lab's names resolve to (loopback is refused unless an address rule says otherwise)."""
    lines = ["version: 1", "mode: enforce", "default: deny", "hosts:"]
    if deny:
        lines += ["  deny:"] + [f'    - "{name}"' for name in deny]
    lines += ["  allow:"] + [f"    - {name}" for name in allow]
    lines += ["addresses:", f"  allow: [{', '.join(addresses)}]",
              "ports:", f"  http: [{', '.join(map(str, http_ports))}]",
              f"  connect: [{', '.join(map(str, tls_ports))}]",
              "resolver:", f'  nameservers: ["{nameserver}"]',
              "limits:", "  max_connections: 20000", "  max_connections_per_client: 20000", ""]
    return "\n".join(lines)


def start_egresswall(procs: Processes, port: int, admin: int | None, policy_text: str, workers: int = 1,
                     name: str = "egresswall", options: tuple[str, ...] | list[str] = ()) -> subprocess.Popen:
    """``egresswall run`` with default settings (the fast front relays passed-through tunnels and plain HTTP)
    plus ``options``, and an audit log at WORK/audit.jsonl (WORK/audit-NAME.jsonl for another ``name``);
    ``admin`` None: no admin listener; ``workers`` > 1 adds ``--workers``."""
    policy = procs.work / "policy.yaml"
    policy.write_text(policy_text)
    log = procs.work / ("audit.jsonl" if name == "egresswall" else f"audit-{name}.jsonl")
    args = [sys.executable, "-m", "proxy.cli", "run", "--policy", str(policy), "--listen", f"127.0.0.1:{port}",
            *(["--admin", f"127.0.0.1:{admin}"] if admin is not None else ["--no-admin"]), "--log", str(log),
            *options]
    if workers > 1:
        args += ["--workers", str(workers)]
    proc = procs.spawn(args, name, cwd=ROOT)
    wait_port("127.0.0.1", port, 60)
    time.sleep(1.0 if workers > 1 else 0)  # let every worker bind, not just the first
    return proc
