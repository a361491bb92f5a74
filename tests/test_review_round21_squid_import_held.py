"""Review round 21 (third topic), held: `egresswall squid import` against the Debian squid on loopback.

A squid.conf with the constructs an import may misread — negation, port ranges, CONNECT acls, several ACLs on
a line (AND), an acl appended after the http_access line that uses it, dstdom_regex -i, src roles, method names
in lower case, and squid's last-line-inverse default — goes to a real ``squid -N`` (loopback port, a hosts file
resolving every name to 127.0.0.2, a dead loopback nameserver) and to ``import_conf``; every request squid
refuses must be refused by the imported policy (policy.decision in process, same answers). No IP literals are
asked (squid would match dstdomain on their PTR names: a documented difference). Squid connects, if at all,
to 127.0.0.2 only.
"""

from __future__ import annotations

import shutil
from itertools import product

import pytest
from squid_compat.importer import import_conf
from squid_files import hand_to_squid_user
from test_review_round21_squid_export import DEAD_NAMESERVER, PLUMBING
from test_squid_differential import SQUID, Squid, free_port, squid_refused_request, squid_workdir

from policy.decision import Request, Resolution, decide
from policy.hosts import parse_authority, parse_url

pytestmark = pytest.mark.integration

NAMES = ["allowed.lab.test", "www.allowed.lab.test", "evil.lab.test", "x.evil.lab.test", "api.lab.test",
         "x.api.lab.test", "other.lab.test", "lab.test"]
ASKED = NAMES[:-1] + ["WWW.Allowed.LAB.test.", "EVIL.lab.test"]
KINDS = [("GET", 80), ("post", 80), ("HEAD", 8080), ("GET", 25), ("CONNECT", 443), ("CONNECT", 8443),
         ("CONNECT", 25), ("PUT", 8500)]
CLIENTS = ["127.0.0.1", "127.0.0.5"]

CONF = """\
acl SSL_ports port 443
acl Safe_ports port 80 443 1025-65535
acl staff src 127.0.0.5
acl good dstdomain .allowed.lab.test
acl bad dstdom_regex -i ^(.*\\.)?evil\\.lab\\.test$
acl api dstdomain api.lab.test
acl writes method post put
acl mid port 8000-9000
http_access deny !Safe_ports
http_access deny CONNECT !SSL_ports
http_access deny bad !staff
http_access allow staff !writes mid
http_access deny api writes
http_access allow good
http_access allow staff api
acl good dstdomain other.lab.test
http_access deny !api
"""


def _ask(port: int, client: str, method: str, host: str, target_port: int) -> bool:
    authority = f"{host}:{target_port}"
    line = f"CONNECT {authority}" if method == "CONNECT" else f"{method} http://{authority}/p"
    return squid_refused_request(port, f"{line} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n".encode(),
                                 client)


def _egresswall_allows(policy, client: str, method: str, host: str, port: int) -> bool:
    tunnel = method == "CONNECT"
    target = parse_authority(f"{host}:{port}") if tunnel else parse_url(f"http://{host}:{port}/p")
    return decide(policy, Request(target, method, client, tunnel=tunnel),
                  Resolution(target.host, ("127.0.0.2",))).allowed


def test_imported_policy_never_admits_what_real_squid_refuses_holds() -> None:
    if SQUID is None:
        pytest.skip("squid is not installed")
    workdir = squid_workdir("r21c-import")
    try:
        (workdir / "hosts").write_text("".join(f"127.0.0.2 {name}\n" for name in NAMES))
        port = free_port()
        conf = workdir / "squid.conf"
        conf.write_text(PLUMBING.format(squid_port=port, dir=workdir, dns=DEAD_NAMESERVER) + CONF)
        hand_to_squid_user(workdir)
        result = import_conf(conf, readmit=["127.0.0.2/32"])
        squid = Squid(conf, port, workdir)
        try:
            probes = list(product(CLIENTS, KINDS, ASKED))
            refused = {probe: _ask(port, probe[0], probe[1][0], probe[2], probe[1][1]) for probe in probes}
        finally:
            squid.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    wider = [probe for probe in probes if refused[probe]
             and _egresswall_allows(result.policy, probe[0], probe[1][0], probe[2], probe[1][1])]
    both = [probe for probe in probes if not refused[probe]
            and _egresswall_allows(result.policy, probe[0], probe[1][0], probe[2], probe[1][1])]
    assert both, "the harness works: something passes both"
    assert not wider, f"the import admits what squid refuses: {wider[:10]}"
