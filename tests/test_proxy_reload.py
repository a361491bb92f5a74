"""Hot reload: a valid edit applies once the file has stayed unchanged for SETTLE_SECONDS (SIGHUP at once), an
invalid one keeps the last good policy and says where the error is, a ConfigMap-style symlink swap is seen,
and open tunnels are not cut."""

from __future__ import annotations

import os
import re
import signal
import ssl
import time
from pathlib import Path

import pytest
from metrics_page import value

from proxy.policy_file import SETTLE_SECONDS

pytestmark = pytest.mark.integration
WATCHED = SETTLE_SECONDS + 1.5  # the watcher applies an edit within this: settled, then a beat or two


def wait_for(predicate, timeout: float = 1.0, interval: float = 0.05) -> float:
    """Poll until predicate() is true; returns the seconds it took, fails after timeout."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(interval)
    raise AssertionError(f"not true within {timeout}s")


def metric(proxy, name: str, **labels: str) -> float:
    body = proxy.admin("/metrics")[1]
    found = value(body, name, **labels)
    assert found is not None, f"{name} {labels} is not on the page"
    return found


def reloads(proxy) -> tuple[float, float]:
    """(successful, refused) reloads, from /metrics."""
    return (metric(proxy, "egresswall_policy_reloads_total", result="success"),
            metric(proxy, "egresswall_policy_reloads_total", result="failure"))


def status_of(proxy, lab, path="/") -> int:
    return proxy.get(f"http://public.lab.example:{lab.public.port}{path}")[0]


def test_valid_edit_applies_once_the_file_has_settled(lab, start_proxy):
    """A file that ends with a newline may still be half-written (a writer that pauses at a line's end): the
    watcher takes an edit once it has stayed unchanged for SETTLE_SECONDS, and within a beat or two after."""
    proxy = start_proxy(lab.policy_text())
    assert status_of(proxy, lab) == 200
    written = time.monotonic()
    proxy.policy_path.write_text(lab.policy_text("hosts:\n  deny:\n    - public.lab.example\n"))
    wait_for(lambda: status_of(proxy, lab) == 403, timeout=WATCHED)
    assert time.monotonic() - written >= SETTLE_SECONDS - 0.3, "taken before it had settled"
    assert reloads(proxy) == (1, 0)


def test_the_last_successful_reload_time_moves_on_success_and_not_on_failure(lab, start_proxy):
    """Issue 14 item 7: egresswall_policy_last_reload_success_timestamp_seconds is the start-up load's time,
    then the last good reload's; a refused reload leaves it (and counts a failure)."""
    stamp = "egresswall_policy_last_reload_success_timestamp_seconds"
    before_start = time.time()
    proxy = start_proxy(lab.policy_text())
    loaded = metric(proxy, stamp)
    assert before_start - 1 <= loaded <= time.time()
    time.sleep(0.05)
    before_reload = time.time()
    proxy.policy_path.write_text(lab.policy_text("hosts:\n  deny:\n    - public.lab.example\n"))
    wait_for(lambda: reloads(proxy) == (1, 0), timeout=WATCHED)
    reloaded = metric(proxy, stamp)
    assert before_reload <= reloaded <= time.time() and reloaded > loaded
    proxy.policy_path.write_text(lab.policy_text("hosts:\n  allwo: []\n"))
    wait_for(lambda: reloads(proxy) == (1, 1), timeout=WATCHED)
    assert metric(proxy, stamp) == reloaded
    assert metric(proxy, "egresswall_policy_loaded") == 1  # the last good policy is still in force


def test_invalid_edit_keeps_the_last_good_policy_and_logs_the_location(lab, start_proxy):
    proxy = start_proxy(lab.policy_text("hosts:\n  deny:\n    - public.lab.example\n"))
    assert status_of(proxy, lab) == 403
    proxy.policy_path.write_text(lab.policy_text("hosts:\n  deny:\n    - public.lab.example\n  allwo: []\n"))
    wait_for(lambda: "reload refused" in proxy.stderr, timeout=WATCHED)
    assert f"{proxy.policy_path}:" in proxy.stderr and "unknown key 'allwo'" in proxy.stderr
    line = [ln for ln in proxy.stderr.splitlines() if "reload refused" in ln][0]
    assert re.search(rf"{re.escape(str(proxy.policy_path))}:\d+:\d+: hosts.allwo: unknown key 'allwo'", line), line
    assert status_of(proxy, lab) == 403  # still the old policy
    assert reloads(proxy) == (0, 1)
    status, body = proxy.admin("/readyz")
    # Ready (the last good policy is in force), and saying the edit was refused, with where (review round 22).
    assert status == 200 and "the last reload was refused" in body and "unknown key 'allwo'" in body, body
    proxy.policy_path.write_text(lab.policy_text("hosts:\n  deny:\n    - public.lab.example\n"))
    wait_for(lambda: "the last reload was refused" not in proxy.admin("/readyz")[1], timeout=WATCHED)


def test_deleted_or_half_written_file_keeps_the_last_good_policy(lab, start_proxy):
    proxy = start_proxy(lab.policy_text("hosts:\n  deny:\n    - public.lab.example\n"))
    proxy.policy_path.write_text("version: 1\nhosts:\n  deny: [")
    # No final newline: waited for (it may be half-written) and, once settled, refused as invalid YAML.
    wait_for(lambda: "reload refused" in proxy.stderr, timeout=WATCHED + 1)
    os.unlink(proxy.policy_path)
    proxy.signal(signal.SIGHUP)
    time.sleep(0.5)
    assert status_of(proxy, lab) == 403


def test_a_complete_file_without_a_final_newline_loads_reloads_and_lints_alike(lab, start_proxy):
    """VS Code saves without a final newline. Such a file is taken once it has stayed unchanged for
    proxy.policy_file.SETTLE_SECONDS (it may be half-written before): by the first load, by the watcher's
    reload, by SIGHUP and by lint alike — never refused for the missing newline."""
    proxy = start_proxy(lab.policy_text().rstrip("\n"))  # the first load waits for it, then takes it
    assert status_of(proxy, lab) == 200
    written = time.monotonic()
    proxy.policy_path.write_text(lab.policy_text("hosts:\n  deny:\n    - public.lab.example").rstrip("\n"))
    took = wait_for(lambda: status_of(proxy, lab) == 403, timeout=SETTLE_SECONDS + 2.0)
    assert time.monotonic() - written >= SETTLE_SECONDS - 0.3, "taken before it had settled"
    assert took < SETTLE_SECONDS + 2.0
    assert reloads(proxy) == (1, 0)
    assert "reload refused" not in proxy.stderr
    # SIGHUP on a fresh edit: not refused either, taken once settled.
    proxy.policy_path.write_text(lab.policy_text().rstrip("\n"))
    proxy.signal(signal.SIGHUP)
    wait_for(lambda: status_of(proxy, lab) == 200, timeout=SETTLE_SECONDS + 2.0)
    assert "reload refused" not in proxy.stderr
    # lint decides the same on the same file, also right after a write (it waits for the file to settle).
    import subprocess
    import sys

    proxy.policy_path.write_text(lab.policy_text().rstrip("\n"))
    result = subprocess.run([sys.executable, "-m", "proxy.cli", "lint", str(proxy.policy_path)], capture_output=True,
                            text=True, timeout=60, cwd=Path(__file__).resolve().parent.parent)
    assert result.returncode == 0 and ": valid;" in result.stdout, result.stdout + result.stderr


def test_configmap_symlink_swap_is_seen(lab, tmp_path):
    # Kubernetes mounts a ConfigMap as policy.yaml -> ..data/policy.yaml, ..data -> ..2026_01_01_v1;
    # an update writes a new timestamped dir and swaps ..data atomically (rename of a symlink).
    root = tmp_path / "configmap"
    (root / "..v1").mkdir(parents=True)
    (root / "..v1" / "policy.yaml").write_text(lab.policy_text())
    os.symlink("..v1", root / "..data")
    os.symlink("..data/policy.yaml", root / "policy.yaml")
    from proxyproc import ProxyProcess

    proxy = ProxyProcess(["--policy", str(root / "policy.yaml")], tmp_path / "audit-cm.jsonl")
    try:
        assert status_of(proxy, lab) == 200
        (root / "..v2").mkdir()
        (root / "..v2" / "policy.yaml").write_text(lab.policy_text("hosts:\n  deny:\n    - public.lab.example\n"))
        os.symlink("..v2", root / "..data_tmp")
        os.replace(root / "..data_tmp", root / "..data")
        wait_for(lambda: status_of(proxy, lab) == 403, timeout=WATCHED)
    finally:
        proxy.stop()


def test_sighup_reloads_at_once(lab, start_proxy):
    proxy = start_proxy(lab.policy_text())
    assert status_of(proxy, lab) == 200
    proxy.policy_path.write_text(lab.policy_text("hosts:\n  deny:\n    - public.lab.example\n"))
    proxy.signal(signal.SIGHUP)
    wait_for(lambda: status_of(proxy, lab) == 403, timeout=1.0)


def test_open_tunnel_survives_a_reload(lab, start_proxy):
    proxy = start_proxy(lab.policy_text())
    sock, status, _ = proxy.connect(f"public.lab.example:{lab.public_tls.port}")
    assert status == 200
    context = ssl.create_default_context(cafile=str(lab.cert_file))
    with context.wrap_socket(sock, server_hostname="public.lab.example") as tls:
        for i, deny in enumerate([False, True]):
            if deny:
                proxy.policy_path.write_text(lab.policy_text("hosts:\n  deny:\n    - public.lab.example\n"))
                proxy.signal(signal.SIGHUP)
                wait_for(lambda: status_of(proxy, lab) == 403, timeout=1.0)
            tls.sendall(f"GET /in-tunnel-{i} HTTP/1.1\r\nHost: public.lab.example\r\n\r\n".encode())
            data = b""
            while not data.endswith(f"/in-tunnel-{i}".encode()):
                chunk = tls.recv(4096)
                assert chunk, "tunnel was closed"
                data += chunk
    # New tunnels follow the new policy.
    sock, status, _ = proxy.connect(f"public.lab.example:{lab.public_tls.port}")
    sock.close()
    assert status == 403


def test_first_load_must_succeed(tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 2\n")
    result = subprocess.run([sys.executable, "-m", "proxy.cli", "run", "--policy", str(bad), "--listen",
                             "127.0.0.1:0", "--no-admin"], capture_output=True, text=True, timeout=30,
                            cwd=Path(__file__).resolve().parent.parent)
    assert result.returncode == 2
    assert f"{bad}:1:10: version: got 2; expected 1" in result.stderr


def test_a_sighup_reload_of_a_big_policy_leaves_the_proxy_answering_while_it_loads(lab, start_proxy):
    """A big allowlist takes seconds to load. SIGHUP's handler runs on the event loop, so the reload it
    asks for is done in a thread, as the watcher's is: requests are still decided (by the last good
    policy) while the file is parsed, and the new policy applies once it is whole. Loaded on the loop,
    nothing at all would be answered until the load was over."""
    names = "".join(f"    - n{i}.bulk{i % 97}.example.com\n" for i in range(150_000))
    big = lab.policy_text("hosts:\n  allow:\n    - public.lab.example\n" + names)
    proxy = start_proxy(big)
    assert status_of(proxy, lab) == 200
    proxy.policy_path.write_text(big.replace("hosts:\n", "hosts:\n  deny:\n    - public.lab.example\n", 1))
    proxy.signal(signal.SIGHUP)  # before the watcher's next beat: this reload is SIGHUP's
    answered_while_loading = 0
    while "policy reloaded" not in proxy.stderr:
        status = status_of(proxy, lab)
        if "policy reloaded" in proxy.stderr:
            break
        assert status == 200, "decided by the new policy before it was reported loaded"
        answered_while_loading += 1
    assert answered_while_loading >= 3, f"only {answered_while_loading} request(s) answered during the reload"
    wait_for(lambda: status_of(proxy, lab) == 403, timeout=5.0)
    assert reloads(proxy) == (1, 0)


@pytest.mark.parametrize("bad", [
    "hosts:\n  deny: &x [public.lab.example, *x]\n",  # a list that holds itself: its walk never ended
    "hosts:\n  deny:\n    - &a [a.example, a.example, a.example, a.example, a.example, a.example]\n"
    + "".join(f"    - &{n} [{', '.join([f'*{p}'] * 6)}]\n" for p, n in zip("abcdefg", "bcdefgh", strict=True)),
])
def test_an_edit_with_aliases_that_never_end_is_refused_and_the_next_edit_applies(lab, start_proxy, bad):
    """A policy whose YAML aliases expand without end (or into millions of values) was walked for as long as
    that took — forever for a list that names itself — and the reloader, which runs one reload at a time,
    never reloaded again. Now it is refused with where the alias is, the last good policy stays, and the
    next good edit applies."""
    proxy = start_proxy(lab.policy_text("hosts:\n  deny:\n    - public.lab.example\n"))
    assert status_of(proxy, lab) == 403
    proxy.policy_path.write_text(lab.policy_text(bad))
    wait_for(lambda: "reload refused" in proxy.stderr, timeout=5.0)
    line = [ln for ln in proxy.stderr.splitlines() if "reload refused" in ln][0]
    assert re.search(rf"{re.escape(str(proxy.policy_path))}:\d+:\d+: .*YAML alias", line), line
    assert status_of(proxy, lab) == 403 and reloads(proxy) == (0, 1)
    proxy.policy_path.write_text(lab.policy_text())
    wait_for(lambda: status_of(proxy, lab) == 200, timeout=5.0)
    assert reloads(proxy) == (1, 1)


def test_a_rewrite_that_keeps_the_size_and_puts_the_modification_time_back_is_seen(lab, start_proxy):
    """``touch -r`` after a rewrite, or a copy that keeps times: the same inode, size and modification time. The
    watcher reads the inode's change time too (review round 22, a helper's note: before, only SIGHUP loaded it)."""
    allow = lab.policy_text("hosts:\n  deny:\n    - other.lab.example\n")
    deny = allow.replace("- other.lab.example", "- '*.lab.example'  ")  # the same size: public.lab.example denied
    assert len(deny) == len(allow)
    proxy = start_proxy(allow)
    assert status_of(proxy, lab) == 200
    path = proxy.policy_path
    time.sleep(SETTLE_SECONDS + 0.5)  # past the first load's settling
    before = os.stat(path)
    with open(path, "r+") as handle:  # the same inode
        handle.write(deny)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    wait_for(lambda: status_of(proxy, lab) == 403, timeout=WATCHED + 1)
