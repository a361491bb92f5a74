"""Review round 22, topic "explain": what was tried and held (kept as regressions).

`egresswall check --json` against the proxy's decision records for paths with dot segments, percent-encoding and
';', methods in odd case, IP literals in brackets and report mode (both transports); hot reloads of a file with a
BOM and CRLF line ends, a file replaced by a directory, and an edit that reverts within the settle window.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from proxyproc import both_transports

from proxy.policy_file import SETTLE_SECONDS

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("internal_saw_nothing")]

REPO = Path(__file__).resolve().parent.parent
WATCHED = SETTLE_SECONDS + 2.5


def wait_for(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"not true within {timeout}s")


DENY = ("hosts:\n  deny:\n    - {host: public.lab.example, paths: [/admin]}\n"
        "    - {host: public.lab.example, methods: [DELETE]}\n    - {host: 127.0.0.2, paths: [/secret]}\n")


@both_transports
@pytest.mark.parametrize("mode", ["enforce", "report"])
def test_check_and_the_proxy_agree_on_paths_methods_and_literals_holds(lab, start_proxy, mode):
    """Each (method, URL) decided by `check --json --method M` and by the proxy (same policy, same DnsLab) gives
    the same verdict and rule_id: dot segments, %2e, %61, ';' parameters, '//' in paths, a lowercase method, a
    bracketed IPv4-mapped IPv6 literal, in enforce and in report mode. Held on both transports."""
    proxy = start_proxy(lab.policy_text(DENY, mode=mode))
    p = lab.public.port
    base = f"http://public.lab.example:{p}"
    cases = [("GET", f"{base}/a/../admin"), ("GET", f"{base}/%61dmin"), ("GET", f"{base}/admin;x=1"),
             ("GET", f"{base}//admin"), ("GET", f"{base}/./admin"), ("GET", f"{base}/x/%2e%2e/admin"),
             ("GET", f"{base}/ADMIN"), ("GET", f"{base}/admin%2fx"), ("delete", f"{base}/"), ("dElEtE", f"{base}/y"),
             ("GET", f"http://127.0.0.2:{p}/secret"), ("GET", f"http://[::ffff:127.0.0.2]:{p}/secret"),
             ("GET", f"http://127.0.0.2:{p}/%73ecret"), ("GET", f"{base}/ok")]
    disagreements = []
    for method, url in cases:
        done = subprocess.run([sys.executable, "-m", "proxy.cli", "check", "--json", "--method", method, "--policy",
                               str(proxy.policy_path), url], capture_output=True, text=True, cwd=REPO, timeout=60)
        said = json.loads(done.stdout)
        before = len(proxy.decisions())
        proxy.get(url, method=method)
        wait_for(lambda before=before: len(proxy.decisions()) > before, 5)
        record = proxy.decisions()[before]
        if (record["verdict"], record["rule_id"]) != (said["verdict"], said["rule_id"]):
            disagreements.append((method, url, record["verdict"], record["rule_id"], said["verdict"], said["rule_id"]))
    assert not disagreements, disagreements


def _status(proxy, lab) -> int:
    return proxy.get(f"http://public.lab.example:{lab.public.port}/")[0]


def test_a_reload_of_a_file_with_a_bom_and_crlf_line_ends_applies_holds(lab, start_proxy):
    """A policy saved with a UTF-8 BOM and CRLF line ends (a Windows editor) reloads like any other file."""
    proxy = start_proxy(lab.policy_text())
    assert _status(proxy, lab) == 200
    text = "\ufeff" + lab.policy_text("hosts:\n  deny:\n    - public.lab.example\n").replace("\n", "\r\n")
    proxy.policy_path.write_bytes(text.encode("utf-8"))
    wait_for(lambda: _status(proxy, lab) == 403, WATCHED + 1)
    assert "reload refused" not in proxy.stderr


def test_a_file_replaced_by_a_directory_keeps_the_last_good_policy_holds(lab, start_proxy):
    """The policy file removed and a directory made at its name: the reload is refused (logged), the deny rule
    in force stays, /readyz stays 200; a good file put back is applied."""
    proxy = start_proxy(lab.policy_text("hosts:\n  deny:\n    - public.lab.example\n"))
    assert _status(proxy, lab) == 403
    os.unlink(proxy.policy_path)
    os.mkdir(proxy.policy_path)
    wait_for(lambda: "reload refused" in proxy.stderr, WATCHED)
    assert "is a directory" in proxy.stderr
    assert _status(proxy, lab) == 403
    assert proxy.admin("/readyz")[0] == 200
    shutil.rmtree(proxy.policy_path)
    proxy.policy_path.write_text(lab.policy_text())
    wait_for(lambda: _status(proxy, lab) == 200, WATCHED + 1)


def test_an_edit_that_reverts_within_the_settle_window_is_never_applied_holds(lab, start_proxy):
    """An edit that opens a host, reverted 0.5 s later: the opened host is never let through meanwhile or after."""
    deny = lab.policy_text("hosts:\n  deny:\n    - public.lab.example\n")
    proxy = start_proxy(deny)
    proxy.policy_path.write_text(lab.policy_text())
    seen = []
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        seen.append(_status(proxy, lab))
    proxy.policy_path.write_text(deny)
    deadline = time.monotonic() + WATCHED
    while time.monotonic() < deadline:
        seen.append(_status(proxy, lab))
        time.sleep(0.1)
    assert set(seen) == {403}, seen
