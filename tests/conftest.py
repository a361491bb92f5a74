"""Shared fixtures: the loopback lab (DNS server, upstreams, internal stand-ins) and the real proxy."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from dnslab import Behaviour, DnsLab, Record  # noqa: E402
from labnet import INTERNAL_IP, PUBLIC_IP, StandIn, Upstream, self_signed  # noqa: E402
from proxyproc import TRANSPORTS, ProxyProcess  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests marked ``lab`` need root (network namespaces); say why when they cannot run."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        skip = pytest.mark.skip(reason="needs root and iproute2 for network namespaces (CI runs as root)")
        for item in items:
            if "lab" in item.keywords:
                item.add_marker(skip)


@dataclass
class Lab:
    dns: DnsLab
    public: Upstream  # 127.0.0.2, re-admitted by the test policy
    public_tls: Upstream
    internal: StandIn  # 127.0.0.3 on the SAME port as public: a wrong connect lands here
    internal_tls: StandIn
    cert_file: Path

    def policy_text(self, extra: str = "", default: str = "allow", mode: str = "enforce",
                    limits: str = "", connect_plain: bool = False) -> str:
        """The lab's policy; ``connect_plain`` lets a CONNECT reach the plain-HTTP origin too (as ws:// does)."""
        ports = sorted({80, self.public.port})
        tls_ports = sorted({443, self.public_tls.port} | ({self.public.port} if connect_plain else set()))
        return (f"version: 1\nmode: {mode}\ndefault: {default}\n"
                f"ports:\n  http: {ports}\n  connect: {tls_ports}\n"
                f"addresses:\n  allow: [{PUBLIC_IP}/32]\n"
                f"resolver:\n  nameservers: ['{self.dns.address}']\n  timeout: 1\n" + limits + extra)


LAB_ZONE = {
    "public.lab.example": [Record("A", PUBLIC_IP)],
    "other.lab.example": [Record("A", PUBLIC_IP)],
    "denied.lab.example": [Record("A", PUBLIC_IP)],
    "internal.lab.example": [Record("A", INTERNAL_IP)],
    "mixed.lab.example": [Record("A", PUBLIC_IP), Record("A", INTERNAL_IP)],
    "alias.lab.example": [Record("CNAME", "db.internal")],
    "db.internal": [Record("A", INTERNAL_IP)],
    "alias2.lab.example": [Record("CNAME", "internal.lab.example")],
    "mapped.lab.example": [Record("AAAA", "::ffff:127.0.0.3")],
    "rebind.lab.example": Behaviour(sequence=[[Record("A", PUBLIC_IP, ttl=0)], [Record("A", INTERNAL_IP, ttl=0)]]),
}


@pytest.fixture(scope="session")
def lab(tmp_path_factory) -> Iterator[Lab]:
    tls, cert_file = self_signed(["public.lab.example", "other.lab.example"],
                                 str(tmp_path_factory.mktemp("cert")))
    public = Upstream(PUBLIC_IP, "public")
    public_tls = Upstream(PUBLIC_IP, "public-tls", tls=tls)
    internal = StandIn(INTERNAL_IP, public.port)
    internal_tls = StandIn(INTERNAL_IP, public_tls.port)
    with DnsLab(LAB_ZONE) as dns:
        yield Lab(dns, public, public_tls, internal, internal_tls, cert_file)
    for server in (public, public_tls, internal, internal_tls):
        server.close()


@pytest.fixture
def transport(request) -> str | None:
    """Which transport ``start_proxy`` starts (a key of proxyproc.TRANSPORTS); None: the defaults. A test
    runs on both with ``@proxyproc.both_transports``."""
    return getattr(request, "param", None)


@pytest.fixture
def start_proxy(tmp_path, transport):
    """start_proxy(policy_text, *args) → a running ProxyProcess, stopped after the test."""
    started: list[ProxyProcess] = []
    chosen = TRANSPORTS[transport] if transport else []

    def start(policy_text: str, *args: str, name: str = "policy.yaml") -> ProxyProcess:
        policy = tmp_path / name
        policy.write_text(policy_text)
        proxy = ProxyProcess(["--policy", str(policy), *chosen, *args], tmp_path / f"audit-{len(started)}.jsonl")
        proxy.policy_path = policy
        started.append(proxy)
        return proxy

    yield start
    for proxy in started:
        proxy.stop()
        # Whatever the test did, the guard must never have seen an attempt to leave loopback.
        leaks = [e for e in proxy.outbound() + proxy.datagrams()
                 if not e["host"].startswith("127.") and e["host"] != "::1"]
        assert not leaks, f"the proxy tried to connect outside the lab: {leaks}"


@pytest.fixture
def internal_saw_nothing(lab):
    """No internal stand-in received a connection during the test (a module uses it with
    ``pytestmark = pytest.mark.usefixtures("internal_saw_nothing")``)."""
    before = len(lab.internal.connections) + len(lab.internal_tls.connections)
    yield
    assert len(lab.internal.connections) + len(lab.internal_tls.connections) == before, \
        "an internal stand-in received a connection"
