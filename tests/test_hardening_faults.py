"""Faults: a broken dependency makes egresswall refuse, never allow.

* DNS down, slow (answers after the timeout), SERVFAIL, truncated, garbage: refused, each with its
  own reason, never cached as a success.
* The policy file deleted, replaced by a directory, unreadable, caught half-written: the last good
  policy keeps enforcing. "Unreadable" cannot be chmod 000: these tests run as root, and root reads
  through any mode bits. So the file is made unreadable the ways root still meets: a FIFO (opening it
  blocks until a writer comes: before proxy fix, that hung the event loop and with it every
  connection), a symlink to a device, and bytes that are not UTF-8.
* A SIGHUP storm while requests flow: still enforcing, no crash.
* The audit log's disk full (a 64 KiB tmpfs when root can mount one, /dev/full otherwise): requests
  that would be allowed are refused with 503 until the log takes lines again (README: "Audit log and
  admin endpoint"), /readyz fails, the failure metric rises; every line written is whole JSON.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from audit_watch import AuditWatch, decisions
from dnslab import Behaviour, DnsLab, Record
from labnet import PUBLIC_IP

from proxy.policy_file import SETTLE_SECONDS

pytestmark = pytest.mark.integration


def wait_for(predicate, timeout: float = 3.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"not true within {timeout}s")


def metric(proxy, name: str) -> float:
    _, body = proxy.admin("/metrics")
    total = 0.0
    for line in body.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


# ---- DNS -----------------------------------------------------------------------------------------------

class LateDns(DnsLab):
    """Answers every query correctly, but ``delay`` seconds late (past the resolver's timeout)."""

    delay = 1.6

    def _answer(self, data: bytes, tcp: bool) -> bytes | None:
        time.sleep(self.delay)
        return super()._answer(data, tcp)


FAULT_ZONE = {
    "silent.lab.example": Behaviour(silent=True),
    "servfail.lab.example": Behaviour(rcode="SERVFAIL"),
    "truncated.lab.example": Behaviour(truncated=True),
    "garbage.lab.example": Behaviour(garbage=True),
    "refused.lab.example": Behaviour(rcode="REFUSED"),
}


@pytest.fixture(scope="module")
def faulty_dns():
    with DnsLab(FAULT_ZONE) as dns:
        yield dns


def _dns_policy(lab, nameserver: str) -> str:
    return lab.policy_text().replace(f"'{lab.dns.address}'", f"'{nameserver}'")


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize(("name", "rule", "words"), [
    ("silent.lab.example", "dns:timeout", "timed out"),
    ("servfail.lab.example", "dns:servfail", "SERVFAIL"),
    ("truncated.lab.example", "dns:error", "truncated.lab.example"),
    # This garbage's header bytes count thousands of records: refused at once, unparsed (policy/resolver.py's
    # bound). Garbage that counts few is dropped by dnspython, as a spoofed reply is, and times out.
    ("garbage.lab.example", "dns:error", "a broken or hostile nameserver"),
    ("refused.lab.example", "dns:error", "REFUSED"),
])
def test_dns_fault_refuses_with_its_own_reason(lab, faulty_dns, start_proxy, name, rule, words):
    proxy = start_proxy(_dns_policy(lab, faulty_dns.address))
    forwarded = len(lab.public.requests)
    audit = AuditWatch(proxy.log_path).mark()
    for _ in range(2):  # a failure is never remembered as an answer
        status, headers, _ = proxy.get(f"http://{name}:{lab.public.port}/")
        assert status == 403 and headers["x-egresswall-rule"] == rule
    refusals = decisions(audit.since())
    assert [(d["verdict"], d["stage"], d["rule"]) for d in refusals] == [("refuse", "resolve", rule)] * 2
    assert words in refusals[0]["reason"] and name in refusals[0]["reason"]
    assert len(lab.public.requests) == forwarded
    assert metric(proxy, "egresswall_dns_errors_total") >= 2


def test_dns_server_down_refuses(lab, start_proxy):
    proxy = start_proxy(_dns_policy(lab, f"127.0.0.1:{_free_udp_port()}"))
    for url in (f"http://public.lab.example:{lab.public.port}/", f"https://public.lab.example:{lab.public_tls.port}"):
        if url.startswith("https"):
            sock, status, headers = proxy.connect(url.split("/")[2])
            sock.close()
        else:
            status, headers, _ = proxy.get(url)
        assert status == 403 and headers["x-egresswall-rule"].startswith("dns:")
    reasons = [d["reason"] for d in proxy.decisions()]
    assert len(reasons) == 2 and all("public.lab.example" in r for r in reasons)


def test_dns_answer_after_the_timeout_is_not_used(lab, start_proxy):
    with LateDns({"late.lab.example": [Record("A", PUBLIC_IP)]}) as late:
        proxy = start_proxy(_dns_policy(lab, late.address))
        started = time.monotonic()
        status, headers, _ = proxy.get(f"http://late.lab.example:{lab.public.port}/")
        assert status == 403 and headers["x-egresswall-rule"] == "dns:timeout"
        assert time.monotonic() - started < 5
        time.sleep(LateDns.delay)  # the late answer arrives now; it must not be cached as the name's answer
        status, headers, _ = proxy.get(f"http://late.lab.example:{lab.public.port}/")
        assert status == 403 and headers["x-egresswall-rule"] == "dns:timeout"


# ---- the policy file ----------------------------------------------------------------------------------

GOOD_EXTRA = "hosts:\n  deny:\n    - denied.lab.example\n    - other.lab.example\n"


def _enforcing_the_good_policy(proxy, lab) -> None:
    port = lab.public.port
    assert proxy.get(f"http://public.lab.example:{port}/")[0] == 200
    assert proxy.get(f"http://denied.lab.example:{port}/")[0] == 403
    assert proxy.get(f"http://other.lab.example:{port}/")[0] == 403
    assert proxy.get(f"http://internal.lab.example:{port}/")[0] == 403


def _replace_with_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _replace_with_directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _replace_with_device_link(path: Path) -> None:
    path.unlink()
    path.symlink_to("/dev/null")


def _replace_with_invalid_utf8(path: Path) -> None:
    path.write_bytes(path.read_bytes().replace(b"denied.lab.example", b"denied.lab.\xff\xfe") )


FILE_FAULTS = {
    "deleted": lambda path: path.unlink(),
    "directory": _replace_with_directory,
    "fifo": _replace_with_fifo,
    "device-symlink": _replace_with_device_link,
    "invalid-utf8": _replace_with_invalid_utf8,
    "dangling-symlink": lambda path: (path.unlink(), path.symlink_to(path.with_name("nowhere.yaml"))),
    "empty": lambda path: path.write_text(""),
}


def _restore(path: Path, text: str) -> None:
    if path.is_symlink() or path.is_file() or path.is_fifo():
        path.unlink()
    elif path.is_dir():
        path.rmdir()
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@pytest.mark.parametrize("fault", sorted(FILE_FAULTS))
def test_policy_file_fault_keeps_the_last_good_policy(lab, start_proxy, fault):
    text = lab.policy_text(GOOD_EXTRA)
    proxy = start_proxy(text)
    _enforcing_the_good_policy(proxy, lab)
    FILE_FAULTS[fault](proxy.policy_path)
    # (an empty file is refused once it has stayed empty for SETTLE_SECONDS: it may be a write just begun)
    wait_for(lambda: metric(proxy, 'egresswall_policy_reloads_total{result="failure"}') >= 1,
             timeout=SETTLE_SECONDS + 3)
    proxy.signal(signal.SIGHUP)  # an explicit reload meets the same fault
    wait_for(lambda: metric(proxy, 'egresswall_policy_reloads_total{result="failure"}') >= 2)
    started = time.monotonic()
    _enforcing_the_good_policy(proxy, lab)
    assert time.monotonic() - started < 5, "the proxy stalled on the broken policy file"
    assert proxy.admin("/readyz")[0] == 200
    # A good file again: the next reload takes it (here, one that also denies public.lab.example).
    _restore(proxy.policy_path, lab.policy_text(GOOD_EXTRA + "    - public.lab.example\n"))
    proxy.signal(signal.SIGHUP)
    wait_for(lambda: proxy.get(f"http://public.lab.example:{lab.public.port}/")[0] == 403)
    assert proxy.process.poll() is None


def test_policy_caught_half_written_at_a_line_end_is_not_loaded_by_the_watcher(lab, start_proxy):
    """A writer that pauses at the end of a line (a shell loop of ``echo >>``, a script flushing line by line)
    leaves a file that ends with a newline: it was loaded after the watcher's 0.1 s look, and its deny list cut
    short let public.lab.example through for the rest of the pause (review round 15). The watcher now loads an
    edit only once the file has stayed unchanged for SETTLE_SECONDS, a final newline or not."""
    from proxy.policy_file import SETTLE_SECONDS

    deny = "hosts:\n  deny:\n    - other.lab.example\n    - public.lab.example\n"
    proxy = start_proxy(lab.policy_text(deny))
    url = f"http://public.lab.example:{lab.public.port}/half-written"
    assert proxy.get(url)[0] == 403
    whole = lab.policy_text(deny.replace("    - public", "    - third.lab.example\n    - public"))
    cut = whole.index("    - public.lab.example\n")
    seen = []
    with open(proxy.policy_path, "r+") as f:  # in place: truncated, the first lines, a pause, the rest
        f.truncate(0)
        f.write(whole[:cut])
        f.flush()
        pause_ends = time.monotonic() + SETTLE_SECONDS - 0.4
        while time.monotonic() < pause_ends:
            seen.append(proxy.get(url)[0])
            time.sleep(0.05)
        f.write(whole[cut:])
    assert seen and set(seen) == {403}, f"let through while the file was half-written: {seen}"
    wait_for(lambda: metric(proxy, 'egresswall_policy_reloads_total{result="success"}') == 1,
             timeout=SETTLE_SECONDS + 3)
    assert proxy.get(url)[0] == 403 and proxy.get(f"http://third.lab.example:{lab.public.port}/")[0] == 403
    assert metric(proxy, 'egresswall_policy_reloads_total{result="failure"}') == 0


@pytest.mark.parametrize("cut", ["mid-host", "mid-key"])
def test_policy_caught_half_written_is_not_loaded(lab, start_proxy, cut):
    """A non-atomic write, paused half way long enough for the watcher to look (and for a SIGHUP). Cut
    "mid-host", the first half is valid YAML that denies 'other.lab.ex' instead of other.lab.example: loading
    it would widen the policy. A file without a final newline is used only once it has stayed unchanged for
    proxy.policy_file.SETTLE_SECONDS; a writer that finishes within that is never seen half way."""
    from proxy.policy_file import SETTLE_SECONDS

    text = lab.policy_text(GOOD_EXTRA)
    proxy = start_proxy(text)
    _enforcing_the_good_policy(proxy, lab)
    new = lab.policy_text(GOOD_EXTRA.replace("    - other.lab.example\n", "    - other.lab.example\n"
                                             "    - public.lab.example\n"))
    at = new.index("other.lab.example") + len("other.lab.ex") if cut == "mid-host" else new.index("deny:") + 3
    with open(proxy.policy_path, "w") as f:  # in place, as a naive editor or `cat > file` does
        f.write(new[:at])
        f.flush()
        started = time.monotonic()
        wait_for(lambda: "may be half-written" in proxy.stderr)
        proxy.signal(signal.SIGHUP)
        time.sleep(0.3)
        _enforcing_the_good_policy(proxy, lab)
        assert metric(proxy, 'egresswall_policy_reloads_total{result="failure"}') == 0  # waited for, not refused
        paused = time.monotonic() - started
        assert paused < SETTLE_SECONDS - 0.2, f"the checks took {paused:.1f}s: too slow to show anything"
        f.write(new[at:])
    wait_for(lambda: proxy.get(f"http://public.lab.example:{lab.public.port}/")[0] == 403)
    assert proxy.get(f"http://other.lab.example:{lab.public.port}/")[0] == 403
    assert metric(proxy, 'egresswall_policy_reloads_total{result="success"}') == 1


def test_sighup_storm_while_requests_flow(lab, start_proxy):
    """Hundreds of SIGHUPs, some while the file is being swapped between two valid versions and one
    invalid one, while four clients send allowed and refused requests: every answer is one of the
    policies' answers, never an error, and the proxy stays up."""
    texts = [lab.policy_text(GOOD_EXTRA), lab.policy_text(GOOD_EXTRA + "    - mixed.lab.example\n"),
             "version: 1\nhosts: [\n"]
    proxy = start_proxy(texts[0])
    port = lab.public.port
    stop = threading.Event()
    outcomes: list[tuple[str, int]] = []
    lock = threading.Lock()

    def client(n: int) -> None:
        hosts = ["public.lab.example", "denied.lab.example", "internal.lab.example", "other.lab.example"]
        i = 0
        while not stop.is_set():
            host = hosts[(i + n) % len(hosts)]
            try:
                status = proxy.get(f"http://{host}:{port}/storm{n}-{i}")[0]
            except OSError as err:
                status = f"error {err}"
            with lock:
                outcomes.append((host, status))
            i += 1

    def swapper() -> None:
        i = 0
        while not stop.is_set():
            tmp = proxy.policy_path.with_suffix(".tmp")
            tmp.write_text(texts[i % 3])
            os.replace(tmp, proxy.policy_path)
            i += 1
            time.sleep(0.05)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(4)] + [threading.Thread(target=swapper)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(400):
            proxy.signal(signal.SIGHUP)
            time.sleep(0.01)
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert proxy.process.poll() is None, proxy.stderr[-2000:]
    expected = {"public.lab.example": {200}, "denied.lab.example": {403}, "internal.lab.example": {403},
                "other.lab.example": {403}}
    wrong = [(host, status) for host, status in outcomes if status not in expected[host]]
    assert not wrong and len(outcomes) > 100, wrong[:10]
    assert metric(proxy, 'egresswall_policy_reloads_total{result="success"}') > 10
    assert metric(proxy, 'egresswall_policy_reloads_total{result="failure"}') > 0
    assert len(proxy.decisions()) == len(outcomes)
    _restore(proxy.policy_path, texts[0])
    proxy.signal(signal.SIGHUP)
    _enforcing_the_good_policy(proxy, lab)


# ---- the audit log's disk full ---------------------------------------------------------------------------

@contextlib.contextmanager
def small_tmpfs(where: Path, size: str = "64k"):
    where.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
                            capture_output=True, text=True, timeout=10)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip()}); the /dev/full case covers this")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=10)


def _fill(folder: Path) -> Path:
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 4096)
    return filler


def _whole_json_lines(path: Path) -> list[dict]:
    data = path.read_bytes()
    assert data == b"" or data.endswith(b"\n"), "the log ends in half a line"
    return [json.loads(line) for line in data.splitlines()]  # raises on any line that is not whole JSON


def _assert_fails_closed(proxy, lab, attempts: int = 10) -> None:
    port = lab.public.port
    forwarded = len(lab.public.requests)
    for i in range(attempts):
        status, headers, _ = proxy.get(f"http://public.lab.example:{port}/while-full-{i}")
        assert status == 503 and headers["x-egresswall-rule"] == "audit", (status, headers)
    assert proxy.get(f"http://internal.lab.example:{port}/")[0] == 403  # refusals stay refusals
    sock, status, headers = proxy.connect(f"public.lab.example:{lab.public_tls.port}")
    sock.close()
    assert status == 503 and headers["x-egresswall-rule"] == "audit"
    assert len(lab.public.requests) == forwarded, "a request went through that the audit log did not record"
    status, body = proxy.admin("/readyz")
    assert status == 503 and "audit log" in body
    assert metric(proxy, "egresswall_audit_write_failures_total") >= attempts


def test_audit_disk_full_fails_closed_and_recovers_tmpfs(lab, start_proxy, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    with small_tmpfs(tmp_path / "auditfs") as folder:
        log = folder / "audit.jsonl"
        from proxyproc import ProxyProcess

        policy = tmp_path / "p.yaml"
        policy.write_text(lab.policy_text())
        proxy = ProxyProcess(["--policy", str(policy)], log)
        try:
            assert proxy.get(f"http://public.lab.example:{lab.public.port}/before")[0] == 200
            filler = _fill(folder)
            # The log's last page may still have room: requests go through until a line does not fit.
            wait_for(lambda: proxy.get(f"http://public.lab.example:{lab.public.port}/filling")[0] == 503, timeout=30)
            _assert_fails_closed(proxy, lab)
            filler.unlink()
            wait_for(lambda: proxy.admin("/readyz")[0] == 200, timeout=5)
            assert proxy.get(f"http://public.lab.example:{lab.public.port}/after")[0] == 200
            records = _whole_json_lines(log)
            recovered = [r for r in records if r["event"] == "audit"]
            # (a short probe line may fit, and report recovery, before a decision line does again)
            assert recovered and recovered[-1]["failures"] >= 10
            allowed = {d["path"] for d in records if d["event"] == "decision" and d["verdict"] == "allow"}
            served = {path for _, path, _ in lab.public.requests}
            assert {"/before", "/after"} <= allowed
            assert not {p for p in served if p.startswith(("/filling", "/while-full"))} - allowed
        finally:
            proxy.stop()
            leaks = [e for e in proxy.outbound() if not e["host"].startswith("127.")]
            assert not leaks


def test_audit_device_full_fails_closed_and_recovers_on_reopen(lab, start_proxy, tmp_path):
    """/dev/full behind the log's name (every write: ENOSPC); a real file put back and SIGUSR1 (the
    logrotate signal) reopen it, and the probe brings the proxy back."""
    log = tmp_path / "audit-full.jsonl"
    log.symlink_to("/dev/full")
    from proxyproc import ProxyProcess

    policy = tmp_path / "p.yaml"
    policy.write_text(lab.policy_text())
    proxy = ProxyProcess(["--policy", str(policy)], log)
    try:
        _assert_fails_closed(proxy, lab)
        log.unlink()
        proxy.signal(signal.SIGUSR1)
        wait_for(lambda: proxy.admin("/readyz")[0] == 200, timeout=5)
        assert proxy.get(f"http://public.lab.example:{lab.public.port}/after")[0] == 200
        records = _whole_json_lines(log)
        assert records[0]["event"] == "audit" and records[0]["failures"] >= 10
        assert [d["path"] for d in records if d["event"] == "decision"] == ["/after"]
    finally:
        proxy.stop()
