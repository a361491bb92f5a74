"""Review round 21, topic "operators": what was tried and held (kept as regressions).

The policy file's YAML corners, `egresswall check --json` against what a running proxy decides with the same
policy and the same DNS answers (both transports), and hot reloads that must keep the last good policy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from proxyproc import ProxyProcess, both_transports

from policy.errors import PolicyError
from policy.loader import parse_policy
from proxy.policy_file import SETTLE_SECONDS

REPO = Path(__file__).resolve().parent.parent
WATCHED = SETTLE_SECONDS + 2.0


def wait_for(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"not true within {timeout}s")


# ---- YAML corners: refused with a position, or read as written ------------------------------------------------

@pytest.mark.parametrize("text", [
    "version: 1\n---\ndefault: allow\n",                              # a second document
    "version: 1\ndefault: deny\n...\ndefault: allow\n",                # text after the document end
    "version: 1\ndefault: deny\n'default': allow\n",                   # a duplicate, quoted
    "version: 1\ndefault: deny\n\"def\\x61ult\": allow\n",             # a duplicate, escaped
    "version: 1\ndefault: deny\n? default\n: allow\n",                 # a duplicate, explicit key
    "version: 1\nhosts:\n  deny:\n    - host: a.example.com\n      host: b.example.com\n",
    "version: 1\nhosts:\n  deny: [a.example.com]\n  deny: []\n",
    "version: 1\n\tdefault: allow\n",                                  # a tab
    "version: 1\ndefault: allow\x00\n",                                # a NUL
    "version: 1\n\ufeffdefault: allow\n",                              # a BOM inside: a key that is not 'default'
    "version: 1\nbase: &b {deny: [a.example.com]}\nhosts:\n  <<: *b\n",
    "version: 1\nhosts: {deny: !!set {a.example.com: null}}\n",
    "version: 1\nhosts: {deny: [\"10.0.0.0/8\"]}\n",                   # a CIDR in a host list
    "version: 1\nhosts: {deny: [\"a.example.com:443\"]}\n",            # a port in a host pattern
    "version: 1\nhosts: {deny: [\"fe80::1%eth0\"]}\n",                 # a zone id
    "version: 1\nhosts: {deny: [\"a\u200d.example.com\"]}\n",          # a joiner
    "version: 1\naddresses: {deny: [8.8.8.8/8]}\n",                    # host bits
    "version: 1\naddresses: {deny: [\"010.0.0.1\"]}\n",                # octal
    "version: 1\nroles: [{name: a, clients: [10.1.2.3/8]}]\n",
    "version: 1\nhosts: {deny: [{host: a.example.com, methods: [delete]}]}\n",
    "version: 1\nhosts:\n  deny:\n    - host: a.example.com\n      expires: 2027-06-30T24:00\n",
    "version: 1\nports: {http: [\"\u0668\u0660-\u0668\u0661\"]}\n",  # Arabic-Indic digits
])
def test_a_policy_the_loader_must_refuse_is_refused_with_a_position(text):
    with pytest.raises(PolicyError) as caught:
        parse_policy(text, "p.yaml")
    assert "p.yaml:" in str(caught.value)


@pytest.mark.parametrize(("text", "denied"), [
    ("version: 1\r\ndefault: allow\r\nhosts:\r\n  deny:\r\n    - a.example.com\r\n", "a.example.com"),  # CRLF
    ("\ufeffversion: 1\ndefault: allow\nhosts: {deny: [a.example.com]}\n", "a.example.com"),           # BOM first
    ("version: 1\nhosts: {deny: [A.Example.COM.]}\n", "a.example.com"),                                # case, dot
    ("version: 1\nhosts: {deny: [b\u00fccher.example]}\n", "xn--bcher-kva.example"),                    # U-label
    ("version: 1\nhosts: {deny: [\"a\uff0eexample\u3002com\"]}\n", "a.example.com"),                    # IDNA dots
    ("version: 1\nx: &l [a.example.com]\n", None),                                                        # unknown key
])
def test_a_policy_is_read_as_a_browser_reads_its_hosts(text, denied):
    if denied is None:
        with pytest.raises(PolicyError):
            parse_policy(text, "p.yaml")
        return
    policy = parse_policy(text, "p.yaml")
    assert [rule.pattern.name for rule in policy.deny.rules] == [denied]


# ---- check --json against the running proxy ------------------------------------------------------------------

def _differential_policy(lab) -> str:
    port = lab.public.port
    return lab.policy_text(
        "hosts:\n"
        "  deny:\n"
        "    - denied.lab.example\n"
        f"    - {{host: other.lab.example, ports: [{port}]}}\n"
        "    - {host: public.lab.example, paths: ['/admin'], methods: [DELETE]}\n"
        "  allow:\n"
        "    - PUBLIC.lab.example.\n"
        "    - .other.lab.example\n"
        "    - mixed.lab.example\n"
        "    - alias.lab.example\n"
        "    - alias2.lab.example\n"
        "    - mapped.lab.example\n"
        "    - {host: expired.lab.example, expires: 2020-01-01}\n", default="deny")


@both_transports
def test_check_json_and_the_proxy_agree_on_verdict_and_rule(lab, start_proxy, tmp_path):
    """For each URL, `egresswall check URL --json` and the proxy's decision record (same policy file, same
    DnsLab answers) give the same verdict and rule_id. Held on both transports."""
    proxy = start_proxy(_differential_policy(lab))
    port, tls = lab.public.port, lab.public_tls.port
    plain = [f"http://public.lab.example:{port}/x", f"http://PUBLIC.LAB.EXAMPLE.:{port}/x",
             f"http://public.lab.example:{port}/admin", f"http://other.lab.example:{port}/",
             f"http://denied.lab.example:{port}/", f"http://unlisted.lab.example:{port}/",
             f"http://mixed.lab.example:{port}/", f"http://alias.lab.example:{port}/",
             f"http://alias2.lab.example:{port}/", f"http://mapped.lab.example:{port}/",
             f"http://expired.lab.example:{port}/", f"http://127.0.0.2:{port}/", "http://public.lab.example:81/",
             f"http://xn--bcher-kva.lab.example:{port}/"]
    tunnels = [f"https://public.lab.example:{tls}/", f"https://other.lab.example:{tls}/",
               f"https://denied.lab.example:{tls}/", f"https://unlisted.lab.example:{tls}/",
               "https://public.lab.example:8443/"]
    checked = subprocess.run([sys.executable, "-m", "proxy.cli", "check", "--json", "--policy",
                              str(proxy.policy_path), *plain, *tunnels], capture_output=True, text=True,
                             cwd=REPO, timeout=60)
    said = {row["url"]: row for row in map(json.loads, checked.stdout.splitlines())}
    assert len(said) == len(plain) + len(tunnels), checked.stderr
    disagreements = []
    for url in plain + tunnels:
        before = len(proxy.decisions())
        if url in plain:
            proxy.get(url)
        else:
            sock, _, _ = proxy.connect(url.split("/")[2])
            sock.close()
        wait_for(lambda before=before: len(proxy.decisions()) > before, 5)
        record = proxy.decisions()[before]
        mine = (record["verdict"], record["rule_id"])
        theirs = (said[url]["verdict"], said[url]["rule_id"])
        if mine != theirs:
            disagreements.append((url, "proxy", mine, "check", theirs))
    assert not disagreements, disagreements


@both_transports
def test_a_deny_rule_for_wss_only_lets_a_passed_through_tunnel_through_as_check_says(lab, start_proxy):
    """The premise of test_review_round21_operators.py::
    test_a_deny_rule_for_wss_only_on_a_passed_through_host_is_warned_of:
    the proxy opens the tunnel such a rule reads as refusing, as `check wss://` says (they agree)."""
    proxy = start_proxy(lab.policy_text("hosts:\n  deny:\n    - {host: public.lab.example, schemes: [wss]}\n"))
    sock, status, _ = proxy.connect(f"public.lab.example:{lab.public_tls.port}")
    sock.close()
    assert status == 200


# ---- hot reload ----------------------------------------------------------------------------------------------

def _status(proxy, lab) -> int:
    return proxy.get(f"http://public.lab.example:{lab.public.port}/")[0]


def test_a_configmap_swap_to_an_invalid_policy_keeps_the_last_good_one(lab, tmp_path):
    """Kubernetes style: policy.yaml -> ..data/policy.yaml, ..data -> a timestamped directory. A swap of ..data to
    a directory whose policy is invalid is refused (logged with file:line:column, counted a failure), the old
    policy stays in force and /readyz stays 200; the next valid swap applies."""
    good, bad, fixed = (tmp_path / name for name in ("..2026_1", "..2026_2", "..2026_3"))
    for folder in (good, bad, fixed):
        folder.mkdir()
    (good / "policy.yaml").write_text(lab.policy_text("hosts:\n  deny:\n    - public.lab.example\n"))
    (bad / "policy.yaml").write_text(lab.policy_text("hosts:\n  deny:\n    - public.lab.example\n  alow: []\n"))
    (fixed / "policy.yaml").write_text(lab.policy_text())
    os.symlink(good.name, tmp_path / "..data")
    link = tmp_path / "cm.yaml"
    os.symlink("..data/policy.yaml", link)
    proxy = ProxyProcess(["--policy", str(link)], tmp_path / "audit-cm.jsonl")
    try:
        assert _status(proxy, lab) == 403

        def swap(to: Path) -> None:
            os.symlink(to.name, tmp_path / "..data_tmp")
            os.replace(tmp_path / "..data_tmp", tmp_path / "..data")

        swap(bad)
        wait_for(lambda: "reload refused" in proxy.stderr, WATCHED)
        assert "cm.yaml:15:3: hosts.alow" in proxy.stderr and "unknown key 'alow'" in proxy.stderr
        assert _status(proxy, lab) == 403
        assert proxy.admin("/readyz")[0] == 200
        swap(fixed)
        wait_for(lambda: _status(proxy, lab) == 200, WATCHED + 1)
    finally:
        proxy.stop()
        leaks = [e for e in proxy.outbound() + proxy.datagrams()
                 if not e["host"].startswith("127.") and e["host"] != "::1"]
        assert not leaks, leaks


@pytest.mark.parametrize("edit", [
    "upstream: {proxy: 'http://127.0.0.1:9', resolution: upstream}\n",  # validates; a reload cannot change it
    "hosts:\n  deny:\n    - public.lab.example\n  allow:\n    - {host: a.lab.example, id: x}\n"
    "    - {host: b.lab.example, id: x}\n",                              # a duplicate id, found after the schema
])
def test_a_reload_refused_after_the_schema_applies_nothing_of_it(lab, start_proxy, edit):
    """A file that passes the schema but is refused later (a duplicate rule id; an upstream a reload cannot
    change) leaves the whole last good policy in force: its deny rule, in the same file, is not applied."""
    proxy = start_proxy(lab.policy_text())
    assert _status(proxy, lab) == 200
    text = lab.policy_text(edit if edit.startswith("hosts") else "hosts:\n  deny:\n    - public.lab.example\n" + edit)
    proxy.policy_path.write_text(text)
    wait_for(lambda: "reload refused" in proxy.stderr, WATCHED)
    assert _status(proxy, lab) == 200
    assert proxy.admin("/readyz")[0] == 200


def test_sighup_during_a_truncating_rewrite_keeps_the_last_good_policy(lab, start_proxy):
    """A SIGHUP that lands while a shell rewrites the file in place (truncated, then written in two pieces)
    never applies the half written so far: the deny list cut short is not enforced."""
    import signal
    deny = "hosts:\n  deny:\n    - public.lab.example\n    - other.lab.example\n"
    proxy = start_proxy(lab.policy_text(deny))
    full = lab.policy_text(deny)
    half = full[: full.index("    - other")] + "    - other.lab."  # cut mid-line: no final newline
    with open(proxy.policy_path, "w") as handle:
        handle.write(half)
        handle.flush()
        proxy.signal(signal.SIGHUP)
        time.sleep(0.5)
        assert _status(proxy, lab) == 403
        assert proxy.get(f"http://other.lab.example:{lab.public.port}/")[0] == 403
        handle.write("example\n")  # the rest of the file
    time.sleep(0.3)
    assert proxy.get(f"http://other.lab.example:{lab.public.port}/")[0] == 403
