"""Review round 22, topic ``addresses``: what was tried and HELD (every test here passes on the tree it was written
against).

In process: the classifier against every IPv6 wrapping of every refused IPv4 block with the wrapping's own prefix (and
``::/0``) re-admitted; host spellings of the internal stand-in through ``parse_url`` and ``precheck``. Against the
real proxy on both transports (the loopback DnsLab): A/AAAA mixes where one answer is internal (each wrapping), CNAME
chains to internal names, long chains, loops, every DNS failure, TTL-0 rebinding between the decision and the
connect, and IP-literal spellings; each refusal with a reason, exactly one decision record, and no connect but to
the lab's public stand-in.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import time

import pytest
from dnslab import Behaviour, Record
from hypothesis import given
from hypothesis import strategies as st
from labnet import INTERNAL_IP, PUBLIC_IP
from proxyproc import TRANSPORTS, ProxyProcess, parse_response, read_response

from policy.addresses import SPECIAL_PURPOSE_V4, AddressRules
from policy.decision import Request, precheck
from policy.hosts import HostFormError, parse_url
from policy.loader import parse_policy

# --- in process -------------------------------------------------------------------------------------

_REFUSED_V4 = [ipaddress.IPv4Network(b.cidr) for b in SPECIAL_PURPOSE_V4]


def _wrap(kind: str, v4: ipaddress.IPv4Address) -> str:
    value = int(v4)
    if kind == "mapped":
        return str(ipaddress.IPv6Address((0xFFFF << 32) | value))
    if kind == "compatible":
        return str(ipaddress.IPv6Address(value))
    if kind == "nat64":
        return str(ipaddress.IPv6Address((0x64FF9B << 96) | value))
    if kind == "6to4":
        return str(ipaddress.IPv6Address((0x2002 << 112) | (value << 80) | 1))
    if kind == "teredo":
        return str(ipaddress.IPv6Address((0x20010000 << 96) | (0x4136E378 << 64) | (value ^ 0xFFFFFFFF)))
    if kind == "isatap":
        return str(ipaddress.IPv6Address((0x26000000 << 96) | (0x5EFE << 32) | value))
    raise AssertionError(kind)


_PREFIX = {"mapped": "::/0", "compatible": "::/96", "nat64": "64:ff9b::/96", "6to4": "2002::/16",
           "teredo": "2001::/32", "isatap": "2600::/64"}


@st.composite
def _refused_v4(draw) -> ipaddress.IPv4Address:
    network = draw(st.sampled_from(_REFUSED_V4))
    return network[draw(st.integers(0, network.num_addresses - 1))]


@given(_refused_v4(), st.sampled_from(sorted(_PREFIX)), st.booleans())
def test_no_wrapping_of_a_refused_ipv4_passes_when_its_prefix_or_everything_is_readmitted_holds(v4, kind, everything):
    """mapped, IPv4-compatible, NAT64, 6to4, Teredo (obfuscated client) and ISATAP: the IPv4 inside must pass
    on its own, even with the wrapping's prefix, or all of IPv6, in addresses.allow."""
    if kind == "compatible" and int(v4) <= 1:
        return  # :: and ::1: re-admitted only by naming them (tests/test_review_round22_addresses.py)
    rules = AddressRules(allow=["::/0" if everything else _PREFIX[kind]])
    verdict = rules.check(_wrap(kind, v4))
    assert not verdict.allowed, (str(v4), kind, verdict)
    assert verdict.reason


@pytest.mark.parametrize("kind", sorted(_PREFIX))
def test_cloud_metadata_in_any_wrapping_is_refused_under_any_readmission_holds(kind):
    rules = AddressRules(allow=["::/0", "169.254.0.0/16", _PREFIX[kind]])
    verdict = rules.check(_wrap(kind, ipaddress.IPv4Address("169.254.169.254")))
    assert not verdict.allowed and verdict.rule.startswith("cloud-metadata"), verdict


_LAB_POLICY = parse_policy(f"version: 1\ndefault: allow\naddresses:\n  allow: [{PUBLIC_IP}/32]\n")

# Spellings of the internal stand-in (127.0.0.3) and of other non-global hosts a URL parser may accept.
HOST_SPELLINGS = [
    "2130706435", "0x7f000003", "0x7f.0.0.3", "0177.0.0.3", "127.3", "127.0.3", "0x7f.3", "127.0.0.03",
    "127.0.0.3.", "127.0.0.3..", "[127.0.0.3]", "[::ffff:127.0.0.3]", "[::ffff:7f00:3]", "[0:0:0:0:0:ffff:7f00:3]",
    "[::127.0.0.3]", "[::7f00:3]", "[64:ff9b::127.0.0.3]", "[2002:7f00:3::]", "[fe80::1%25eth0]", "[fe80::1%eth0]",
    "[::1]", "[::]", "0", "0.0.0.0", "%31%32%37.0.0.3", "127.0.0.3%2e", "１２７．０．０．３", "127。0。0。3",
    "127．0．0．3", "𝟏𝟐𝟕.𝟎.𝟎.𝟑", "127.0.0.3\u00ad", "①②⑦.0.0.3", "169.254.169.254", "[::ffff:169.254.169.254]",
    "0xa9.0xfe.0xa9.0xfe", "2852039166", "[fd00:ec2::254]", "100.64.0.1", "[fc00::1]", "[fec0::1]",
    "localhost", "localhost.", "LOCALHOST", "ｌｏｃａｌｈｏｓｔ", "db.internal", "printer.local", "router.home.arpa",
]


@pytest.mark.parametrize("host", HOST_SPELLINGS)
def test_a_spelling_of_a_non_global_host_is_never_allowed_in_process_holds(host):
    try:
        target = parse_url(f"http://{host}/x")
    except HostFormError as err:
        assert err.reason
        return
    verdict = precheck(_LAB_POLICY, Request(target))
    assert not verdict.allowed, (host, target, verdict)
    assert verdict.reason


# --- against the real proxy ---------------------------------------------------------------------------

WRAPPED_AAAA = {
    "mapped": "::ffff:127.0.0.3", "compatible": "::7f00:3", "nat64": "64:ff9b::7f00:3",
    "nat64-local": "64:ff9b:1::7f00:3", "6to4": "2002:7f00:3::1", "teredo": "2001:0:4136:e378:8000:63bf:80ff:fffc",
    "isatap": "2600::5efe:7f00:3", "translated": "::ffff:0:7f00:3", "link-local": "fe80::1", "ula": "fd00::1",
    "site-local": "fec0::1", "loopback6": "::1", "unspecified6": "::", "multicast6": "ff02::1",
    "aws6": "fd00:ec2::254",
}
INTERNAL_A = {
    "zero": "0.0.0.0", "this-net": "0.1.2.3", "metadata": "169.254.169.254", "cgnat": "100.64.0.1",
    "bench": "198.18.0.1", "ietf": "192.0.0.1", "reserved": "240.0.0.1", "broadcast": "255.255.255.255",
    "multicast": "224.0.0.1", "rfc1918a": "10.0.0.1", "rfc1918b": "172.16.0.1", "rfc1918c": "192.168.0.1",
    "proxy-loopback": "127.0.0.1", "internal": INTERNAL_IP,
}


def _zone() -> dict[str, Behaviour | list[Record]]:
    zone: dict[str, Behaviour | list[Record]] = {}
    for key, address in WRAPPED_AAAA.items():
        zone[f"r22a-aaaa-{key}.lab.example"] = [Record("A", PUBLIC_IP), Record("AAAA", address)]
    for key, address in INTERNAL_A.items():
        zone[f"r22a-a-{key}.lab.example"] = [Record("A", PUBLIC_IP), Record("A", address)]
    # a chain of eight CNAMEs, the last to the internal stand-in; and one through a name refused by form
    for i in range(7):
        zone[f"r22a-long{i}.lab.example"] = [Record("CNAME", f"r22a-long{i + 1}.lab.example")]
    zone["r22a-long7.lab.example"] = [Record("A", INTERNAL_IP)]
    zone["r22a-via-internal.lab.example"] = [Record("CNAME", "hop.r22a.internal")]
    zone["hop.r22a.internal"] = [Record("CNAME", "public.lab.example")]
    zone["r22a-to-localhost.lab.example"] = [Record("CNAME", "localhost")]
    zone["localhost"] = [Record("A", PUBLIC_IP)]
    zone["r22a-loop-a.lab.example"] = [Record("CNAME", "r22a-loop-b.lab.example")]
    zone["r22a-loop-b.lab.example"] = [Record("CNAME", "r22a-loop-a.lab.example")]
    zone["r22a-dangling.lab.example"] = [Record("CNAME", "r22a-nowhere.lab.example")]
    zone["r22a-servfail.lab.example"] = Behaviour(rcode="SERVFAIL")
    zone["r22a-refused.lab.example"] = Behaviour(rcode="REFUSED")
    zone["r22a-silent.lab.example"] = Behaviour(silent=True)
    zone["r22a-truncated.lab.example"] = Behaviour(truncated=True)
    zone["r22a-garbage.lab.example"] = Behaviour(garbage=True)
    zone["r22a-empty.lab.example"] = Behaviour(records=[])
    zone["r22a-beside.lab.example"] = Behaviour(records=[Record("A", PUBLIC_IP)],
                                                beside=[Record("CNAME", "db.internal")])
    return zone


ADDRESS_NAMES = ([f"r22a-aaaa-{k}.lab.example" for k in WRAPPED_AAAA]
                 + [f"r22a-a-{k}.lab.example" for k in INTERNAL_A] + ["r22a-long0.lab.example"])
RESOLVE_NAMES = ["r22a-via-internal.lab.example", "r22a-to-localhost.lab.example", "r22a-loop-a.lab.example",
                 "r22a-dangling.lab.example", "r22a-nxdomain.lab.example", "r22a-servfail.lab.example",
                 "r22a-refused.lab.example", "r22a-silent.lab.example", "r22a-truncated.lab.example",
                 "r22a-garbage.lab.example", "r22a-empty.lab.example", "r22a-beside.lab.example"]


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def proxy(lab, tmp_path_factory, request):
    for name, behaviour in _zone().items():
        lab.dns.set(name, behaviour)
    folder = tmp_path_factory.mktemp("r22addr")
    policy = folder / "policy.yaml"
    policy.write_text(lab.policy_text())
    process = ProxyProcess(["--policy", str(policy), *TRANSPORTS[request.param]], folder / "audit.jsonl")
    process.transport = request.param
    yield process
    process.stop()
    # Only the public stand-in, and the lab's DNS server (a truncated answer is asked again over TCP).
    allowed = {PUBLIC_IP, lab.dns.host}
    assert not [e for e in process.outbound() if e["host"] not in allowed], process.outbound()
    assert not [e for e in process.datagrams() if e["host"] != lab.dns.host], process.datagrams()
    assert "Traceback" not in process.stderr, process.stderr[-2000:]


def _records(proxy, host: str, count: int, wait: float = 3.0) -> list[dict]:
    deadline = time.monotonic() + wait
    while True:
        found = [r for r in proxy.decisions() if r.get("host") == host]
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def _connect_status(proxy, authority: str) -> tuple[int, dict[str, str]]:
    with contextlib.closing(socket.create_connection((proxy.host, proxy.port), timeout=10)) as sock:
        sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        status, headers, _ = parse_response(read_response(sock))
    return status, headers


def _refused_both_ways(lab, proxy, name: str, stage: str) -> None:
    before = len(lab.internal.connections) + len(lab.internal_tls.connections)
    status, headers, body = proxy.get(f"http://{name}:{lab.public.port}/r22", {"Accept": "application/json"})
    assert status == 403, (name, status, body)
    assert headers.get("x-egresswall-reason"), headers
    connect, connect_headers = _connect_status(proxy, f"{name}:{lab.public_tls.port}")
    assert connect == 403, (name, connect)
    assert connect_headers.get("x-egresswall-reason")
    records = _records(proxy, name, 2)
    assert [(r["method"], r["verdict"], r["stage"]) for r in records] == [
        ("GET", "refuse", stage), ("CONNECT", "refuse", stage)], records
    assert all(r.get("reason") for r in records), records
    assert all(not r.get("pinned") for r in records), records
    assert len(lab.internal.connections) + len(lab.internal_tls.connections) == before


@pytest.mark.integration
@pytest.mark.parametrize("name", ADDRESS_NAMES)
def test_a_name_with_one_internal_answer_is_refused_at_the_address_stage_holds(lab, proxy, name):
    _refused_both_ways(lab, proxy, name, "address")


@pytest.mark.integration
@pytest.mark.parametrize("name", RESOLVE_NAMES)
def test_a_chain_to_a_refused_name_or_a_failed_lookup_is_refused_at_the_resolve_stage_holds(lab, proxy, name):
    _refused_both_ways(lab, proxy, name, "resolve")


@pytest.mark.integration
def test_ttl0_rebinding_between_decisions_never_reaches_the_internal_address_holds(lab, proxy):
    """Each answer is checked when it is given; what is connected is the address that was checked."""
    name = f"r22a-rebind-{proxy.transport}.lab.example"
    lab.dns.set(name, Behaviour(sequence=[[Record("A", PUBLIC_IP, ttl=0)], [Record("A", INTERNAL_IP, ttl=0)],
                                          [Record("A", PUBLIC_IP, ttl=0)]]))
    before = len(lab.internal.connections)
    first = proxy.get(f"http://{name}:{lab.public.port}/r22-first")
    second = proxy.get(f"http://{name}:{lab.public.port}/r22-second")
    assert (first[0], second[0]) == (200, 403), (first, second)
    assert len(lab.internal.connections) == before
    records = _records(proxy, name, 2)
    assert [(r["verdict"], r.get("pinned")) for r in records[:2]] == [("allow", PUBLIC_IP), ("refuse", None)]


LITERALS = ["[::ffff:0:7f00:3]", "[::7f00:3]", "[64:ff9b::7f00:3]", "[2002:7f00:3::]", "[fe80::1%25eth0]",
            "[127.0.0.3]", "127.0.0.3.", "127.3", "0x7f.0.0.3", "2130706435", "%31%32%37.0.0.3", "[::ffff:127.0.0.3]"]


@pytest.mark.integration
@pytest.mark.parametrize("host", LITERALS)
def test_an_ip_literal_spelling_of_an_internal_host_is_refused_with_one_record_holds(lab, proxy, host):
    before_records = len(proxy.decisions())
    before = len(lab.internal.connections) + len(lab.internal_tls.connections)
    status, headers, body = proxy.get(f"http://{host}:{lab.public.port}/r22")
    assert status in (400, 403), (host, status, body)
    assert headers.get("x-egresswall-reason"), headers
    deadline = time.monotonic() + 3
    while len(proxy.decisions()) == before_records and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    new = proxy.decisions()[before_records:]
    assert len(new) == 1 and new[0]["verdict"] == "refuse" and new[0].get("reason"), new
    connect, _ = _connect_status(proxy, f"{host}:{lab.public_tls.port}")
    assert connect in (400, 403), (host, connect)
    assert len(lab.internal.connections) + len(lab.internal_tls.connections) == before
