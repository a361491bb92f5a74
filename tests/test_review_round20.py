"""Review round 20: an HTTP/2 connection preface inside an intercepted tunnel gets the answer its record names.

egresswall refuses ``PRI * HTTP/2.0`` inside an intercepted tunnel (spoken over HTTP/1.1) with ``505
http:version`` in mitmproxy's ``requestheaders`` hook and writes that refusal's record. mitmproxy's own
DisableH2C addon then killed the flow in the ``request`` hook, so the client read nothing while the audit log
said it was answered 505 (bytes_down 564). ``proxy.mitm_core.DisableH2C`` leaves a flow egresswall has
answered alone; the mitmdump shim gives stock mitmdump's instance the same hook.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from intercept_client import RecordingTlsOrigin, open_intercepted, read_until_quiet
from labnet import PUBLIC_IP, self_signed
from proxyproc import ROOT, TRANSPORTS, ProxyProcess

pytestmark = pytest.mark.integration

HOST = "public.lab.example"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00"


@pytest.fixture(scope="module")
def origin(tmp_path_factory):
    context, cert = self_signed([HOST], str(tmp_path_factory.mktemp("r20cert")))
    server = RecordingTlsOrigin(context)
    server.cert = cert
    yield server
    server.close()


def _policy(lab, origin) -> str:
    return ("version: 1\nmode: enforce\ndefault: deny\n"
            f"hosts:\n  allow:\n    - host: {HOST}\n      intercept: true\n"
            f"ports:\n  connect: [{origin.port}]\n"
            f"addresses:\n  allow: [{PUBLIC_IP}/32]\n"
            f"resolver:\n  nameservers: ['{lab.dns.address}']\n  timeout: 1\n")


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def proxy(lab, origin, tmp_path_factory, request):
    folder = tmp_path_factory.mktemp("r20preface")
    policy = folder / "policy.yaml"
    policy.write_text(_policy(lab, origin))
    process = ProxyProcess(["--policy", str(policy), "--confdir", str(folder / "ca"), "--upstream-ca",
                            str(origin.cert), *TRANSPORTS[request.param]], folder / "audit.jsonl")
    yield process
    process.stop()
    assert "Traceback" not in process.stderr, process.stderr[-2000:]


def _preface_answer(proxy, origin, alpn) -> bytes:
    tls, _ = open_intercepted(proxy, HOST, origin.port, alpn=alpn)
    with contextlib.closing(tls):
        tls.sendall(PREFACE)
        return read_until_quiet(tls, 3)


@pytest.mark.parametrize("alpn", [None, ["http/1.1"]], ids=["no-alpn", "http/1.1"])
def test_an_http2_preface_in_an_intercepted_tunnel_gets_the_505_its_record_names(proxy, origin, alpn):
    seen = len(origin.heads)
    answer = _preface_answer(proxy, origin, alpn)
    assert answer.startswith(b"HTTP/1.1 505 "), answer
    (refused,) = [r for r in proxy.audit() if r["event"] == "decision" and r["verdict"] == "refuse"
                  and r["rule"] == "http:version" and r["method"] == "PRI"][-1:]
    assert refused["status"] == 505
    assert len(origin.heads) == seen  # the origin never heard of it


def test_the_mitmdump_shim_answers_the_preface_too(lab, origin, tmp_path):
    policy, log = tmp_path / "policy.yaml", tmp_path / "audit.jsonl"
    policy.write_text(_policy(lab, origin))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [str(Path(sys.executable).with_name("mitmdump")),
         "-q", "--listen-host", "127.0.0.1", "--listen-port", str(port),
         "-s", str(ROOT / "proxy" / "mitmdump_addon.py"), "--set", f"egresswall_policy={policy}",
         "--set", f"egresswall_log={log}", "--set", f"confdir={tmp_path / 'ca'}",
         "--set", f"ssl_verify_upstream_trusted_ca={origin.cert}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            time.sleep(0.2)

        class Shim:
            host = "127.0.0.1"

        Shim.port = port
        answer = _preface_answer(Shim, origin, ["http/1.1"])
        assert answer.startswith(b"HTTP/1.1 505 "), answer
        records = [json.loads(line) for line in log.read_text().splitlines()]
        assert [r["rule"] for r in records if r["verdict"] == "refuse"] == ["http:version"]
    finally:
        process.terminate()
        process.wait(10)


# ---- a deny rule's websocket and intercept keys (a helper's review, round 20) ------------------------------------
#
# ``websocket`` is a condition like ``ports`` (policy/decision.py ``_conditions_hold``): on a deny rule,
# ``websocket: false`` meant "deny, except WebSocket upgrades", so an upgrade to the denied host (curl, most
# libraries) fell to ``default: allow``, its name was looked up and it reached the host; lint said nothing.
# ``intercept: true`` on a deny rule was ignored (only allow rules decrypt), so its paths stayed unread in HTTPS.
# Both are load errors now, saying why.

DENY_WEBSOCKET_FALSE = "hosts:\n  deny:\n    - host: denied.lab.example\n      websocket: false\n"


def test_a_deny_rule_with_websocket_false_does_not_load_and_says_why(tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text("version: 1\ndefault: allow\n" + DENY_WEBSOCKET_FALSE +
                      "roles:\n  - name: r\n    clients: [10.0.0.0/8]\n    hosts:\n      deny:\n"
                      "        - host: b.example.com\n          intercept: true\n          paths: [/admin]\n")
    done = subprocess.run([sys.executable, "-m", "proxy.cli", "lint", str(policy)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert ":6:18: hosts.deny[0].websocket: a deny rule refuses a WebSocket upgrade" in done.stderr, done.stderr
    assert "would exempt upgrades from it (let them through)" in done.stderr
    assert ":13:22: roles[0].hosts.deny[0].intercept: intercept applies to allow rules" in done.stderr, done.stderr


def test_the_proxy_does_not_start_on_a_deny_rule_with_websocket_false(lab, tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text(lab.policy_text(DENY_WEBSOCKET_FALSE))
    before = len(lab.dns.queries)  # the lab is the session's: other tests ask for the name too
    done = subprocess.run([sys.executable, "-m", "proxy.cli", "run", "--policy", str(policy), "--listen",
                           "127.0.0.1:0", "--admin", "127.0.0.1:0"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "hosts.deny[0].websocket" in done.stderr, (done.returncode, done.stderr)
    assert "denied.lab.example" not in {name for name, _ in lab.dns.queries[before:]}
