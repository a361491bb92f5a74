"""What a newcomer sees first (issue 14 item 6), through the real command line: ``--version``; the
start-up line (nameservers, where the audit log goes, the interception CA, a valid URL for an IPv6 admin
address); what SIGTERM logs."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.integration
INTERCEPTING = ("version: 1\ndefault: deny\nhosts:\n  allow:\n    - host: intercepted.example\n"
                "      intercept: true\nresolver:\n  nameservers: ['127.0.0.1:5353', '::1']\n")


def test_version_from_the_installed_script_and_the_module() -> None:
    script = Path(sys.executable).with_name("egresswall")
    for command in ([str(script)], [sys.executable, "-m", "proxy.cli"]):
        done = subprocess.run([*command, "--version"], capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert done.returncode == 0, done.stderr
        assert re.fullmatch(r"egresswall \d+\.\d+\S* \(mitmproxy 12\.\S+, Python 3\.\d+\.\d+\)\n", done.stdout)


def test_the_start_up_line_names_nameservers_audit_log_and_interception_ca(start_proxy, tmp_path: Path) -> None:
    confdir = tmp_path / "ca"
    proxy = start_proxy(INTERCEPTING, "--confdir", str(confdir))
    line = next(line for line in proxy.stderr.splitlines() if "proxy on" in line)
    assert f"policy {proxy.policy_path} (enforce, default deny)" in line
    assert "nameservers 127.0.0.1:5353, ::1;" in line  # port 53 is not spelt out
    assert f"audit log {proxy.log_path} (json)" in line
    ca = confdir / "mitmproxy-ca-cert.pem"
    assert line.endswith(f"interception CA {ca}") and ca.is_file()


def test_no_interception_no_ca_and_resolv_conf_is_named(start_proxy) -> None:
    proxy = start_proxy("version: 1\ndefault: deny\n")
    line = next(line for line in proxy.stderr.splitlines() if "proxy on" in line)
    assert "(from /etc/resolv.conf)" in line and "interception CA" not in line


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no ::1 here")
def test_an_ipv6_admin_address_is_printed_as_a_url_that_works(start_proxy) -> None:
    proxy = start_proxy("version: 1\ndefault: deny\n", "--listen", "[::1]:0", "--admin", "[::1]:0")
    match = re.search(r"proxy on \[::1\]:(\d+), admin on (http://\[::1\]:\d+);", proxy.stderr)
    assert match, proxy.stderr
    assert proxy.host == "::1" and proxy.port == int(match.group(1))
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(match.group(2) + "/healthz", timeout=10) as answer:  # the printed URL itself
        assert answer.status == 200 and answer.read() == b"ok\n"


def test_sigterm_logs_that_it_drains_and_when_it_stopped(start_proxy) -> None:
    proxy = start_proxy("version: 1\ndefault: deny\nlimits:\n  tunnel_grace: 1\n")
    idle = socket.create_connection((proxy.host, proxy.port))  # an open connection while it drains
    try:
        proxy.signal(signal.SIGTERM)
        assert proxy.process.wait(30) == 0
    finally:
        idle.close()
    lines = proxy.stderr.splitlines()
    assert "egresswall: SIGTERM received" in lines, lines
    draining = next(line for line in lines if "draining" in line)
    assert re.fullmatch(r"egresswall: draining: no new connections; \d+ open connection\(s\) get up to \d+s to "
                        r"finish \(limits\.tunnel_grace\)", draining)
    assert re.fullmatch(r"egresswall: stopped at \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z after \d+\.\ds; "
                        r"1 connection\(s\) still open at the end of the grace period were closed", lines[-1]), lines
    assert "Traceback" not in proxy.stderr
