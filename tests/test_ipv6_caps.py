"""Per-client connection caps count an IPv6 client by its /64.

One IPv6 host is routinely given a whole /64 and can take a fresh source address for every connection;
counting by exact address would let it multiply ``limits.max_connections_per_client`` by 2**64. The
integration test runs the real proxy and its clients in a network namespace of their own (``unshare
--net``), where several addresses of two /64s are put on the namespace's loopback; nothing leaves it.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lab_util import lab_skip_reason

from browser.server import client_key
from policy.addresses import cap_group

ROOT = Path(__file__).resolve().parent.parent

ipv6 = st.integers(0, 2**128 - 1).map(ipaddress.IPv6Address).filter(
    lambda a: a.ipv4_mapped is None and not a.is_loopback)


@given(ipv6, ipv6)
def test_two_ipv6_clients_share_a_cap_exactly_when_they_share_a_64(a, b):
    assert (cap_group(str(a)) == cap_group(str(b))) == (int(a) >> 64 == int(b) >> 64)
    network = ipaddress.IPv6Network(cap_group(str(a)))
    assert network.prefixlen == 64 and a in network


@given(st.integers(0, 2**32 - 1).map(ipaddress.IPv4Address))
def test_an_ipv4_client_is_counted_by_itself_however_it_is_written(a):
    assert cap_group(str(a)) == str(a)
    assert cap_group(f"::ffff:{a}") == str(a)


def test_loopback_and_session_keys_are_their_own_group():
    assert cap_group("::1") == "::1"
    assert cap_group("unknown") == "unknown"
    assert cap_group("fe80::1%eth0") == "fe80::/64"


def test_the_browser_server_counts_ipv6_clients_by_64_too():
    class Peer:
        def __init__(self, address):
            self.remote_address = address

    assert client_key(Peer(("2001:db8:1:2::a", 1, 0, 0))) == client_key(Peer(("2001:db8:1:2::b", 1, 0, 0)))
    assert client_key(Peer(("2001:db8:1:3::a", 1, 0, 0))) == "2001:db8:1:3::/64"


# Runs as root inside `unshare --net`: loopback up, five addresses on it, the real proxy, raw clients.
NAMESPACE_SCRIPT = textwrap.dedent("""
    import json, socket, subprocess, sys, time
    from pathlib import Path
    sys.path.insert(0, ROOT)
    from tests.proxyproc import ProxyProcess
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    SAME = ["2001:db8:1:2::a", "2001:db8:1:2::b", "2001:db8:1:2:ffff::c"]
    OTHER = "2001:db8:1:3::a"
    for address in [*SAME, OTHER]:
        subprocess.run(["ip", "-6", "addr", "add", address + "/128", "dev", "lo", "nodad"], check=True)
    work = Path(WORK)
    policy = work / "policy.yaml"
    policy.write_text("version: 1\\ndefault: allow\\nhosts:\\n  deny: [denied.example]\\n"
                      "limits:\\n  max_connections_per_client: 2\\n")
    proxy = ProxyProcess(["--policy", str(policy), "--listen", "[::1]:0"], work / "audit.jsonl")
    def connect(source):
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.bind((source, 0))
        sock.connect(("::1", proxy.port))
        return sock
    def answer(sock):
        sock.sendall(b"CONNECT denied.example:443 HTTP/1.1\\r\\nHost: denied.example:443\\r\\n\\r\\n")
        data = b""
        while b"\\r\\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
        return data.split(b"\\r\\n", 1)[0].decode()
    try:
        held = [connect(SAME[0]), connect(SAME[1])]
        time.sleep(0.5)  # both accepted and counted before the third arrives
        third = answer(connect(SAME[2]))
        other = answer(connect(OTHER))
        time.sleep(0.5)
        print(json.dumps({"third": third, "other": other, "audit": proxy.audit()}))
    finally:
        proxy.stop()
""")


@pytest.mark.skipif(lab_skip_reason("unshare") is not None, reason=str(lab_skip_reason("unshare")))
def test_a_client_with_a_64_cannot_multiply_its_cap_by_changing_its_address(tmp_path):
    script = NAMESPACE_SCRIPT.replace("ROOT", repr(str(ROOT))).replace("WORK", repr(str(tmp_path)))
    out = subprocess.run(["unshare", "--net", "--", sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert " 429 " in result["third"] + " ", result
    assert " 403 " in result["other"] + " ", result  # admitted: refused by the policy, not by the cap
    caps = [r for r in result["audit"] if r.get("rule") == "limits.max_connections_per_client"]
    assert len(caps) == 1 and caps[0]["client"] == "2001:db8:1:2:ffff::c", result["audit"]
    assert "2001:db8:1:2::/64" in caps[0]["reason"]
