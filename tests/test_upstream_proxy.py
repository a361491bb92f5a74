"""Upstream proxy chaining (issue 17 item 3), through the real proxy and a real squid on loopback.

egresswall → squid (Debian's, ``squid -N``, Basic authentication by ``basic_ncsa_auth`` against a
password file) → a loopback origin. squid resolves names from a hosts file of its own, in which every
lab name points at the public stand-in: so a request that reached squid would be served, and what keeps
a refused request from being served is egresswall alone, deciding on its own resolution (the lab
DnsLab, where internal.lab.example is the non-global stand-in 127.0.0.3). squid's access log is the
witness: the allowed requests are there, with the user egresswall authenticated as, and a refused one
never is.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from labnet import PUBLIC_IP
from proxyproc import ROOT, read_response
from squid_files import hand_to_squid_user
from test_squid_differential import SQUID, Squid, _guard, free_port

pytestmark = pytest.mark.integration

NCSA_AUTH = "/usr/lib/squid/basic_ncsa_auth"
USER, PASSWORD = "egress", "s3cret-pw"
LAB_NAMES = ("public.lab.example", "denied.lab.example", "internal.lab.example", "mixed.lab.example")

SQUID_CONF = """\
http_port 127.0.0.1:{port}
pid_filename {dir}/squid.pid
cache_log {dir}/cache.log
access_log stdio:{dir}/access.log
buffered_logs off
cache deny all
{extra}cache_mem 8 MB
coredump_dir {dir}
dns_nameservers 127.0.0.1
hosts_file {dir}/hosts
pinger_enable off
netdb_filename none
icp_port 0
htcp_port 0
shutdown_lifetime 0 seconds
connect_timeout 5 seconds
auth_param basic program {auth} {dir}/passwd
auth_param basic realm egresswall-lab
{guard}acl authed proxy_auth REQUIRED
{access}"""
ONLY_AUTHED = "http_access allow authed\nhttp_access deny all\n"


def start_squid_with_auth(prefix: str, hosts: str, access: str = ONLY_AUTHED, extra: str = "") -> Iterator[Squid]:
    """A squid on 127.0.0.1 that asks for Basic authentication as USER, names resolved from ``hosts`` (a hosts
    file's text), ``access`` its http_access lines; stopped and removed on the way out."""
    if SQUID is None or not Path(NCSA_AUTH).exists() or shutil.which("openssl") is None:
        pytest.skip("needs Debian's squid with basic_ncsa_auth, and openssl (make test installs them)")
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    hashed = subprocess.run(["openssl", "passwd", "-apr1", PASSWORD], capture_output=True, text=True,
                            check=True).stdout.strip()
    (workdir / "passwd").write_text(f"{USER}:{hashed}\n")
    (workdir / "hosts").write_text(hosts)
    for name in ("cache.log", "access.log"):
        (workdir / name).touch()
    port = free_port()
    conf = workdir / "squid.conf"
    conf.write_text(SQUID_CONF.format(port=port, dir=workdir, auth=NCSA_AUTH, guard=_guard(), access=access,
                                      extra=extra))
    hand_to_squid_user(workdir)
    running = Squid(conf, port, workdir)
    yield running
    running.stop()
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def squid(tmp_path_factory):
    """A squid on 127.0.0.1 that answers only after Basic authentication as USER."""
    yield from start_squid_with_auth("ew-squid-upstream-", "".join(f"{PUBLIC_IP} {name}\n" for name in LAB_NAMES))


def access_log(squid: Squid) -> list[str]:
    return (squid.workdir / "access.log").read_text(errors="replace").splitlines()


def wait_for_line(squid: Squid, needle: str, timeout: float = 5) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [line for line in access_log(squid) if needle in line]
        if found:
            return found[-1]
        time.sleep(0.05)
    raise AssertionError(f"squid's access log has no line with {needle!r}:\n" + "\n".join(access_log(squid)))


def credentials_file(tmp_path: Path, text: str = f"{USER}:{PASSWORD}\n", mode: int = 0o600) -> Path:
    path = tmp_path / "upstream-credentials"
    path.write_text(text)
    path.chmod(mode)
    return path


def upstream_policy(lab, squid: Squid, credentials: Path, resolution: str = "  resolution: upstream\n") -> str:
    text = lab.policy_text(
        "hosts:\n  deny: [denied.lab.example]\n"
        f"upstream:\n  proxy: http://127.0.0.1:{squid.port}\n{resolution}  credentials_file: {credentials}\n")
    # CONNECT to the plain-HTTP stand-in too (HTTP inside a tunnel, as ws:// arrives).
    return re.sub(r"(?m)^  connect: \[", f"  connect: [{lab.public.port}, ", text, count=1)


@pytest.mark.parametrize("tunnels", ["--fast-tunnels", "--no-fast-tunnels"])
def test_requests_go_through_squid_and_refused_ones_never_reach_it(lab, squid, start_proxy, tmp_path,
                                                                   tunnels) -> None:
    """Both tunnel paths: the front's own CONNECT to squid, and mitmproxy's upstream mode."""
    proxy = start_proxy(upstream_policy(lab, squid, credentials_file(tmp_path)), tunnels)
    line = next(line for line in proxy.stderr.splitlines() if "proxy on" in line)
    assert f"upstream proxy http://127.0.0.1:{squid.port}" in line and "WEAKENED" in line

    # Plain HTTP: decided by egresswall, then sent to squid in absolute form with egresswall's credentials.
    http_url = f"http://public.lab.example:{lab.public.port}/via-squid"
    seen_before = len(lab.public.requests)
    status, _, body = proxy.get(http_url, headers={"Proxy-Authorization": "Basic Y2xpZW50OnNlY3JldA=="})
    assert status == 200 and body == b"hello from public /via-squid"
    logged = wait_for_line(squid, "/via-squid")
    assert f" {USER} " in logged and "TCP_MISS/200" in logged  # squid authenticated egresswall, and served it
    origin_headers = {k.lower() for k in lab.public.requests[seen_before][2]}
    assert "proxy-authorization" not in origin_headers and "via" in origin_headers  # it came by squid

    # A TLS tunnel: egresswall decides the CONNECT, squid opens it, the TLS inside is the origin's own.
    sock, status, _ = proxy.connect(f"public.lab.example:{lab.public_tls.port}")
    assert status == 200
    context = ssl.create_default_context(cafile=str(lab.cert_file))
    with context.wrap_socket(sock, server_hostname="public.lab.example") as tls:
        tls.sendall(b"GET /tunnelled HTTP/1.1\r\nHost: public.lab.example\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := tls.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 OK") and answer.endswith(b"hello from public-tls /tunnelled")
    tunnel_line = wait_for_line(squid, f"CONNECT public.lab.example:{lab.public_tls.port}")
    assert f" {USER} " in tunnel_line

    # HTTP inside a CONNECT to a plain-HTTP port (how Chromium sends ws://): always mitmproxy's path, each
    # request decided inside; squid's credentials go on the CONNECT, never into the tunnel to the origin.
    seen_before = len(lab.public.requests)
    sock, status, _ = proxy.connect(f"public.lab.example:{lab.public.port}")
    assert status == 200
    with sock:
        sock.sendall(f"GET /inside HTTP/1.1\r\nHost: public.lab.example:{lab.public.port}\r\n"
                     "Connection: close\r\n\r\n".encode())
        inside = read_response(sock)
    assert inside.endswith(b"hello from public /inside"), inside
    assert f" {USER} " in wait_for_line(squid, f"CONNECT public.lab.example:{lab.public.port}")
    origin_headers = {k.lower() for k in lab.public.requests[seen_before][2]}
    assert "proxy-authorization" not in origin_headers

    # Refused by host, and by address (egresswall's DNS says 127.0.0.3; squid's hosts file would have served
    # it): every one answered by egresswall, and not one of them in squid's log.
    refused = [("GET", f"http://denied.lab.example:{lab.public.port}/no", "denied.lab.example"),
               ("GET", f"http://internal.lab.example:{lab.public.port}/no", "internal.lab.example"),
               ("GET", f"http://mixed.lab.example:{lab.public.port}/no", "mixed.lab.example"),
               ("CONNECT", f"denied.lab.example:{lab.public_tls.port}", "denied.lab.example"),
               ("CONNECT", f"internal.lab.example:{lab.public_tls.port}", "internal.lab.example")]
    for method, target, _ in refused:
        if method == "GET":
            status, headers, _ = proxy.get(target)
        else:
            sock, status, headers = proxy.connect(target)
            sock.close()
        assert status == 403 and "x-egresswall-rule" in headers, (target, status, headers)
    # An allowed request after the refused ones: once it is in the log, anything sent before it would be too.
    proxy.get(f"http://public.lab.example:{lab.public.port}/last")
    wait_for_line(squid, "/last")
    log = "\n".join(access_log(squid))
    for _, _, host in refused:
        assert host not in log, f"{host} reached squid:\n{log}"
    allowed = [r for r in proxy.decisions() if r["verdict"] == "allow"]
    assert allowed and all(r["pinned"] is None and r["addresses"] == [PUBLIC_IP] for r in allowed)  # not pinned
    stages = {(r["host"], r["method"]): r["stage"] for r in proxy.decisions() if r["verdict"] == "refuse"}
    assert stages[("denied.lab.example", "GET")] == "host" and stages[("internal.lab.example", "GET")] == "address"
    assert stages[("internal.lab.example", "CONNECT")] == "address"
    # Every socket the proxy opened went to squid: none to the origin, none to the stand-in.
    assert {(e["host"], e["port"]) for e in proxy.outbound()} == {("127.0.0.1", squid.port)}


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "proxy.cli", "run", "--listen", "127.0.0.1:0", "--no-admin",
                           "--log", os.devnull, *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout)


def test_without_resolution_upstream_it_refuses_to_start_in_one_line(lab, squid, tmp_path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(upstream_policy(lab, squid, credentials_file(tmp_path), resolution=""))
    done = _run("--policy", str(policy))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"egresswall: {policy}:") and "upstream.resolution: upstream" in lines[0]
    assert "cannot pin" in lines[0]


def test_the_flag_does_not_stand_in_for_the_policy_saying_so(lab, squid, tmp_path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(lab.policy_text())
    done = _run("--policy", str(policy), "--upstream", f"http://127.0.0.1:{squid.port}")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "given by command line --upstream" in done.stderr and "upstream.resolution: upstream" in done.stderr


def test_credentials_never_on_the_command_line(lab, squid, tmp_path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(lab.policy_text("upstream:\n  resolution: upstream\n"))
    done = _run("--policy", str(policy), "--upstream", f"http://{USER}:{PASSWORD}@127.0.0.1:{squid.port}")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "credentials in the proxy URL are never accepted" in done.stderr and PASSWORD not in done.stderr


def test_a_world_readable_credentials_file_is_refused(lab, squid, tmp_path) -> None:
    policy = tmp_path / "policy.yaml"
    credentials = credentials_file(tmp_path, mode=0o644)
    policy.write_text(upstream_policy(lab, squid, credentials))
    done = _run("--policy", str(policy))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert f"upstream.credentials_file {credentials}: readable by every user (mode 0644)" in done.stderr


def test_the_credentials_file_flag_works_and_workers_are_refused(lab, squid, start_proxy, tmp_path) -> None:
    credentials = credentials_file(tmp_path)
    policy_text = lab.policy_text("upstream:\n  resolution: upstream\n")
    proxy = start_proxy(policy_text, "--upstream", f"http://127.0.0.1:{squid.port}",
                        "--upstream-credentials-file", str(credentials))
    status, _, body = proxy.get(f"http://public.lab.example:{lab.public.port}/by-flags")
    assert status == 200 and body == b"hello from public /by-flags"
    assert f" {USER} " in wait_for_line(squid, "/by-flags")
    policy = tmp_path / "workers.yaml"
    policy.write_text(policy_text)
    done = _run("--policy", str(policy), "--upstream", f"http://127.0.0.1:{squid.port}", "--workers", "2")
    assert done.returncode == 2 and "not supported with an upstream proxy" in done.stderr


def test_wrong_credentials_reach_squid_and_it_says_no(lab, squid, start_proxy, tmp_path) -> None:
    """The control: squid really checks the password, so the 200s above prove the file's credentials were sent."""
    proxy = start_proxy(upstream_policy(lab, squid, credentials_file(tmp_path, f"{USER}:wrong\n")))
    status, _, _ = proxy.get(f"http://public.lab.example:{lab.public.port}/wrong-password")
    assert status == 407
    assert "TCP_DENIED/407" in wait_for_line(squid, "/wrong-password")
    # A tunnel squid refuses: the client's CONNECT is answered only after squid's, with its status in the reason.
    sock, status, headers = proxy.connect(f"public.lab.example:{lab.public_tls.port}")
    sock.close()
    assert status == 502 and "refused the tunnel: 407" in headers["x-egresswall-reason"]
    assert "TCP_DENIED/407" in wait_for_line(squid, f"CONNECT public.lab.example:{lab.public_tls.port}")
    closed = [r for r in proxy.audit() if r["event"] == "tunnel" and r["method"] == "CONNECT"]
    assert any("refused the tunnel: 407" in (r.get("error") or "") for r in closed), closed
    # mitmproxy's upstream mode answers the CONNECT first and asks squid at the first message: the tunnel then
    # closes, and its record says why.
    proxy = start_proxy(upstream_policy(lab, squid, credentials_file(tmp_path, f"{USER}:wrong\n")),
                        "--no-fast-tunnels")
    sock, status, _ = proxy.connect(f"public.lab.example:{lab.public_tls.port}")
    assert status == 200
    with pytest.raises((ssl.SSLError, OSError)):
        ssl.create_default_context(cafile=str(lab.cert_file)).wrap_socket(sock, server_hostname="public.lab.example")
    sock.close()
    deadline = time.monotonic() + 5
    while not (closed := [r for r in proxy.audit() if r["event"] == "tunnel"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert closed and "refused HTTP CONNECT request: 407" in closed[0]["error"], closed


def test_a_reload_cannot_change_the_upstream(lab, squid, start_proxy, tmp_path) -> None:
    proxy = start_proxy(upstream_policy(lab, squid, credentials_file(tmp_path)))
    proxy.policy_path.write_text(lab.policy_text())  # the upstream block removed
    deadline = time.monotonic() + 10
    while "a reload cannot change it" not in proxy.stderr and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "policy reload refused" in proxy.stderr and "a reload cannot change it" in proxy.stderr
    status, _, _ = proxy.get(f"http://public.lab.example:{lab.public.port}/still-via-squid")
    assert status == 200
    wait_for_line(squid, "/still-via-squid")


def test_check_says_the_address_guarantee_is_weakened(lab, squid, tmp_path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(upstream_policy(lab, squid, credentials_file(tmp_path)))
    done = subprocess.run([sys.executable, "-m", "proxy.cli", "check", "--policy", str(policy),
                           f"http://public.lab.example:{lab.public.port}/"], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "checked   127.0.0.2 (not pinned: the upstream resolves the name itself)" in done.stdout
    assert "WEAKENED" in done.stdout and "\npinned" not in done.stdout
    done = subprocess.run([sys.executable, "-m", "proxy.cli", "check", "--json", "--policy", str(policy),
                           f"http://public.lab.example:{lab.public.port}/"], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    answer = json.loads(done.stdout)
    assert answer["pinned"] is None and answer["addresses"] == [PUBLIC_IP]
    assert answer["upstream"] == {"proxy": f"http://127.0.0.1:{squid.port}", "resolution": "upstream"}


def test_squid_log_socket_is_the_one_named(squid) -> None:
    """The fixture's squid answers on its port (a sanity check of the witness itself)."""
    with socket.create_connection(("127.0.0.1", squid.port), timeout=5) as sock:
        sock.sendall(b"GET http://public.lab.example/ HTTP/1.1\r\nHost: public.lab.example\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 407")


def test_an_intercepted_host_through_squid(lab, squid, start_proxy, tmp_path) -> None:
    """Interception (mitmproxy's path): TLS to egresswall's certificate, each request inside decided, then
    TLS to the origin through squid's tunnel, verified against the lab's CA."""
    policy = upstream_policy(lab, squid, credentials_file(tmp_path)).replace(
        "hosts:\n  deny: [denied.lab.example]\n",
        "hosts:\n  allow:\n    - host: public.lab.example\n      paths: [/ok/]\n      intercept: true\n")
    proxy = start_proxy(policy.replace("default: allow", "default: deny"), "--confdir", str(tmp_path / "ca"),
                        "--upstream-ca", str(lab.cert_file))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # egresswall's own interception CA
    answers = {}
    for path in ("/ok/intercepted", "/not-ok"):
        sock, status, _ = proxy.connect(f"public.lab.example:{lab.public_tls.port}")
        assert status == 200
        with context.wrap_socket(sock, server_hostname="public.lab.example") as tls:
            tls.sendall(f"GET {path} HTTP/1.1\r\nHost: public.lab.example:{lab.public_tls.port}\r\n"
                        "Connection: close\r\n\r\n".encode())
            answers[path] = read_response(tls)
    assert answers["/ok/intercepted"].startswith(b"HTTP/1.1 200")
    assert answers["/ok/intercepted"].endswith(b"hello from public-tls /ok/intercepted")
    assert answers["/not-ok"].startswith(b"HTTP/1.1 403") and b"x-egresswall-rule" in answers["/not-ok"].lower()
    assert f" {USER} " in wait_for_line(squid, f"CONNECT public.lab.example:{lab.public_tls.port}")
    assert not any(path == "/not-ok" for _, path, _ in lab.public_tls.requests)  # refused inside, never sent
    assert {(e["host"], e["port"]) for e in proxy.outbound()} == {("127.0.0.1", squid.port)}


def test_the_mitmdump_shim_refuses_an_upstream_policy(tmp_path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("version: 1\nupstream:\n  proxy: http://127.0.0.1:3129\n  resolution: upstream\n")
    done = subprocess.run([str(Path(sys.executable).with_name("mitmdump")), "-q", "--listen-host", "127.0.0.1",
                           "--listen-port", "0", "-s", str(ROOT / "proxy" / "mitmdump_addon.py"), "--set",
                           f"egresswall_policy={policy}"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode != 0
    assert "the mitmdump shim does not chain to one: use `egresswall run`" in done.stdout + done.stderr
