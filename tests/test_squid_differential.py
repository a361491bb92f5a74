"""Real squid against egresswall running ``squid import`` of the same squid.conf, on loopback.

For each configuration, every request of a corpus (names, IP literals, ports, methods, CONNECT, two
client addresses) goes to a real squid 5 (``squid -N``) and to the real ``egresswall run`` proxy with
the imported policy. Both resolve names through one DnsLab; squid reads it on port 53 of a loopback
address (``dns_nameservers`` takes no port), egresswall through ``--nameserver``.

Every disagreement must be one where egresswall refuses what squid allows, for a reason category
listed in squid-compat/README.md; egresswall allowing what squid refuses fails the test. The table is
printed (``pytest -s``) and written to ``squid-agreement.txt`` in the test's temporary directory.

Network: every address in play is loopback. Names resolve to 127.0.0.2 (the "public" upstream,
re-admitted with ``--readmit``), 127.0.0.3 (an internal stand-in) or nothing; IP literals are loopback
too. Each squid.conf starts by refusing any destination outside 127.0.0.0/8 and ::1, so even a bug
could not make squid connect elsewhere, and the egresswall process runs with the test guard that
refuses non-loopback connects.
"""

from __future__ import annotations

import http.server
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from itertools import product
from pathlib import Path

import netaddr
import pytest
from dnslab import DnsLab, Record
from labnet import StandIn, Upstream
from proxyproc import parse_response
from squid_compat.acls import Probe as SquidProbe
from squid_compat.addrsets import cidrs
from squid_compat.exporter import export_policy
from squid_compat.importer import import_conf
from squid_files import hand_to_squid_user

from policy.decision import Request, Resolution, decide
from policy.hosts import HostFormError, parse_authority, parse_url
from policy.loader import parse_policy

pytestmark = pytest.mark.integration

SQUID = "/usr/sbin/squid" if Path("/usr/sbin/squid").exists() else shutil.which("squid")
DNS_HOST = "127.53.0.53"  # squid asks port 53 of this loopback address
PUBLIC, INTERNAL, LITERAL = "127.0.0.2", "127.0.0.3", "127.0.0.4"
CLIENTS = ["127.0.0.1", "127.0.0.5"]  # squid's predefined localhost, and another loopback source

ZONE = {
    "public.lab.test": [PUBLIC], "allowed.lab.test": [PUBLIC], "www.allowed.lab.test": [PUBLIC],
    "deep.www.allowed.lab.test": [PUBLIC], "exact.lab.test": [PUBLIC], "sub.exact.lab.test": [PUBLIC],
    "blocked.lab.test": [PUBLIC], "x.blocked.lab.test": [PUBLIC], "ok.blocked.lab.test": [PUBLIC],
    "regex.lab.test": [PUBLIC], "a.regex.lab.test": [PUBLIC], "xregex.lab.test": [PUBLIC],
    "api.lab.test": [PUBLIC], "other.lab.test": [PUBLIC], "internal.lab.test": [INTERNAL],
    "mixed.lab.test": [PUBLIC, INTERNAL],
}
# Hosts as clients write them: case and a trailing dot included; nx.lab.test does not resolve.
HOSTS = ["allowed.lab.test", "WWW.Allowed.LAB.test", "deep.www.allowed.lab.test.", "exact.lab.test",
         "sub.exact.lab.test", "blocked.lab.test", "x.blocked.lab.test", "ok.blocked.lab.test", "regex.lab.test",
         "a.regex.lab.test", "xregex.lab.test", "api.lab.test", "other.lab.test", "internal.lab.test",
         "mixed.lab.test", "nx.lab.test", LITERAL, INTERNAL, "[::1]"]

# Reason categories for "egresswall refuses what squid allows" (squid-compat/README.md explains each).
CATEGORIES = {"non-global-address", "every-address", "dns-fail-closed", "host-form", "deny-overlap",
              "conditional-default", "https-form", "expressiveness", "undecided"}

GUARD = "acl lab_guard dst {ranges}\nhttp_access deny lab_guard\n"

CONFIGS = {
    # Debian's idioms, an allowlist for localhost and everything for "localnet", internal ranges refused.
    "allowlist": """\
acl localnet src 127.0.0.5/32
acl SSL_ports port 443 {port}
acl Safe_ports port 80 21 443 70 210 1025-65535 280 488 591 777
acl CONNECT method CONNECT
acl internal dst 127.0.0.3/32 10.0.0.0/8 169.254.0.0/16
acl allowed dstdomain .allowed.lab.test exact.lab.test 127.0.0.4
{guard}http_access deny !Safe_ports
http_access deny CONNECT !SSL_ports
http_access allow localhost manager
http_access deny manager
http_access deny internal
http_access allow localnet
http_access allow localhost allowed
http_access deny all
""",
    # A blocklist ending in a deny line: the implicit default is allow. squid allows ok.blocked.lab.test
    # before refusing .blocked.lab.test; egresswall checks deny rules first (stricter, reported).
    "blocklist": """\
acl blocked dstdomain .blocked.lab.test
acl exception dstdomain ok.blocked.lab.test
acl internal dst 127.0.0.3
acl Safe_ports port 80 443 1025-65535
{guard}http_access deny !Safe_ports
http_access allow exception
http_access deny blocked
http_access deny internal
""",
    # Methods, a regex, CONNECT only to some ports, negation; ACLs come from an included file.
    "methods-regex-include": """\
include {dir}/acls.conf
{guard}http_access allow CONNECT tls rx
http_access deny CONNECT
http_access deny api !readonly
http_access allow rx readonly
http_access allow api
http_access deny all
""",
    # Destinations as the allowlist (dst: squid matches ANY answer), a port range, a client role.
    "dst-allowlist": """\
acl lab dst 127.0.0.2/32 127.0.0.4/32
acl client5 src 127.0.0.5
acl high port 1025-65535
{guard}http_access deny !high
http_access allow client5 lab
http_access allow lab CONNECT
http_access deny all
""",
    # A corporate squid.conf (issue 14): client classes by src, Debian's port idioms, dstdomain lists read
    # from files, a private dst deny, a url_regex deny (which must not empty the policy: tunnels cannot
    # match it), a parent proxy and ssl_bump (not translated; this squid, built with GnuTLS, ignores
    # ssl_bump with an error and bumps nothing, as egresswall does).
    "corporate": """\
acl localnet src 127.0.0.5/32
acl buildagents src 127.0.0.1/32
acl SSL_ports port 443 {port}
acl Safe_ports port 80 443 1025-65535
acl CONNECT method CONNECT
acl build_sites dstdomain "{dir}/build-domains.txt"
acl staff_sites dstdomain "{dir}/staff-domains.txt"
acl private_nets dst 127.0.0.3/32 10.0.0.0/8 172.16.0.0/12 192.168.0.0/16 169.254.0.0/16
acl executables url_regex -i \\.(exe|msi|bat)$
{guard}http_access deny !Safe_ports
http_access deny CONNECT !SSL_ports
http_access deny private_nets
http_access deny executables
http_access allow buildagents build_sites
http_access deny buildagents
http_access allow localnet staff_sites
http_access deny all
cache_peer 127.0.0.9 parent 3999 0 no-query default
ssl_bump peek all
ssl_bump splice all
""",
    # squid's own reading (review round 17): ACL names in any case (acl blocked and acl BLOCKED are one ACL;
    # deny ALL is all), a comment and a blank line inside a continuation (skipped, the line goes on), method
    # names in lower case, an access line without ACLs (skipped, not an allow-all), a value file whose line has
    # two words (one value, never matching) or a form feed (not a separator), a no-break space inline (not a
    # separator), a non-contiguous netmask (its leading ones: 127.0.0.4/30 takes in client 127.0.0.5).
    "squid-syntax": """\
acl Safe_ports port 80 443 1025-65535
acl blocked dstdomain .blocked.lab.test \\
# a comment inside a continuation: squid skips it and keeps joining

    a.regex.lab.test
acl BLOCKED dstdomain other.lab.test
acl writes method post put
acl far src 127.0.0.4/255.255.255.253
acl sites dstdomain "{dir}/syntax-sites.txt" .allowed.lab.test\u00a0.lab.test
{guard}http_access deny !Safe_ports
http_access deny blocked
http_access deny writes
http_access deny far
http_access allow sites
http_access allow   # TODO: the build farm
http_access deny ALL
""",
    # A dstdom_regex with alternation matches either side anywhere: not confined to exact.lab.test.
    "regex-alternation": """\
acl Safe_ports port 80 443 1025-65535
acl sites dstdomain regex.lab.test
acl rx dstdom_regex ^api\\.|\\.exact\\.lab\\.test$
{guard}http_access deny !Safe_ports
http_access allow sites
http_access deny rx
http_access allow all
""",
    # Values squid drops from an ACL (its splay tree holds no two overlapping values): the wider src range listed
    # second ("because of this '127.0.0.0/8' is ignored"), so client 127.0.0.1 is not "near"; a dstdomain value
    # below one listed before it (nothing lost). Regexes are a list in squid: both kept.
    "overlaps": """\
acl Safe_ports port 80 443 1025-65535
acl near src 127.0.0.5/32 127.0.0.0/8
acl sites dstdomain .allowed.lab.test www.allowed.lab.test exact.lab.test
acl rx dstdom_regex ^regex\\.lab\\.test$ ^(.*\\.)?regex\\.lab\\.test$
{guard}http_access deny !Safe_ports
http_access allow near sites
http_access allow near rx
http_access deny all
""",
}
DOMAIN_FILES = {"build-domains.txt": ".allowed.lab.test\napi.lab.test\n",
                "staff-domains.txt": "exact.lab.test\n.regex.lab.test\n.allowed.lab.test\n",
                "syntax-sites.txt": "exact.lab.test .xregex.lab.test\nregex.lab.test   # the name itself\n"
                                    ".deep.www.allowed.lab.test\x0c.lab.test\n"}
INCLUDED = """\
acl readonly method GET HEAD
acl rx dstdom_regex -i ^(.*\\.)?regex\\.lab\\.test$
acl api dstdomain api.lab.test
acl tls port 443 {port}
"""

PLUMBING = """\
http_port 127.0.0.1:{squid_port}
pid_filename {dir}/squid.pid
cache_log {dir}/cache.log
access_log stdio:{dir}/access.log
cache deny all
cache_mem 8 MB
coredump_dir {dir}
dns_nameservers {dns}
hosts_file {dir}/hosts
pinger_enable off
netdb_filename none
icp_port 0
htcp_port 0
shutdown_lifetime 0 seconds
connect_timeout 5 seconds
"""


@dataclass(frozen=True)
class Probe:
    config: str
    client: str
    method: str
    host: str
    port: int

    @property
    def kind(self) -> str:
        return "connect" if self.method == "CONNECT" else ("https" if self.port == 443 else "http")

    def request_bytes(self) -> bytes:
        authority = f"{self.host}:{self.port}"
        if self.method == "CONNECT":
            return f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode()
        scheme = "https" if self.port == 443 else "http"
        body = "Content-Length: 0\r\n" if self.method == "POST" else ""
        return (f"{self.method} {scheme}://{authority}/p HTTP/1.1\r\nHost: {authority}\r\n{body}"
                "Connection: close\r\n\r\n").encode()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ask(proxy: tuple[str, int], probe: Probe) -> tuple[int, dict[str, str]]:
    """Send one request from the probe's client address; the status and headers of the answer."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(15)
        sock.bind((probe.client, 0))
        sock.connect(proxy)
        sock.sendall(probe.request_bytes())
        head = b""
        while b"\r\n\r\n" not in head:
            try:
                chunk = sock.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not chunk:
                break
            head += chunk
    status, headers, _ = parse_response(head)
    return status, headers


def squid_refused(status: int, headers: dict[str, str]) -> bool:
    return status == 403 and headers.get("x-squid-error", "").startswith("ERR_ACCESS_DENIED")


def egresswall_refused(status: int, headers: dict[str, str]) -> bool:
    """A refusal carries egresswall's rule header. Rule ``connect`` is not one: the request was allowed and
    the connect to the checked address failed (the front's own 502 says so; mitmproxy's 502 page has no
    header at all)."""
    return headers.get("x-egresswall-rule", "connect") != "connect"


class Squid:
    """squid -N in the foreground, in its own process group, stopped by the fixture's finalizer."""

    def __init__(self, conf: Path, port: int, workdir: Path) -> None:
        self.port, self.workdir = port, workdir
        self.output = open(workdir / "squid.out", "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen([SQUID, "-N", "-f", str(conf)], stdout=self.output, stderr=self.output,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"squid exited: {self.log()}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"squid did not start: {self.log()}")

    def log(self) -> str:
        out = []
        for name in ("squid.out", "cache.log"):
            path = self.workdir / name
            if path.exists():
                out.append(path.read_text(errors="replace")[-3000:])
        return "\n".join(out)

    def stop(self) -> None:
        if self.output.closed:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(5)
        self.output.close()


@pytest.fixture
def start_squid():
    """start_squid(conf, port, workdir) → a running squid; every squid started is stopped at teardown."""
    started: list[Squid] = []

    def start(conf: Path, port: int, workdir: Path) -> Squid:
        squid = Squid(conf, port, workdir)
        started.append(squid)
        return squid

    yield start
    for squid in started:
        squid.stop()


@pytest.fixture(scope="module")
def squid_lab(tmp_path_factory):
    if SQUID is None:
        pytest.skip("squid is not installed (make test installs it)")
    zone = {name: [Record("A", ip) for ip in ips] for name, ips in ZONE.items()}
    try:
        dns = DnsLab(zone, host=DNS_HOST, port=53)
    except OSError as err:
        pytest.skip(f"squid needs a DNS server on port 53 of a loopback address ({err}); run as root")
    public = Upstream(PUBLIC, "public")
    internal = StandIn(INTERNAL, public.port)
    literal = _literal_upstream(public.port)
    with dns:
        yield dns, public, internal
    literal.shutdown()
    literal.server_close()
    public.close()
    internal.close()


def _literal_upstream(port: int) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_POST = do_HEAD = do_GET

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer((LITERAL, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _guard() -> str:
    lab = netaddr.IPSet(["127.0.0.0/8", "::1/128"])
    outside = netaddr.IPSet(["0.0.0.0/0", "::/0"]) - lab - netaddr.IPSet(["::ffff:0:0/96"])
    ranges = cidrs(outside)
    return "".join(f"acl lab_guard dst {' '.join(ranges[i:i + 8])}\n" for i in range(0, len(ranges), 8)) + \
        "http_access deny lab_guard\n"


def squid_workdir(name: str) -> Path:
    """squid (started as root) works as its cache_effective_user, which cannot enter pytest's private
    temporary directories: its files live in a directory of their own, handed to that user."""
    workdir = Path(tempfile.mkdtemp(prefix=f"ew-squid-{name}-"))
    for log in ("cache.log", "access.log", "hosts"):
        (workdir / log).touch()
    hand_to_squid_user(workdir)
    return workdir


def write_config(name: str, workdir: Path, squid_port: int, upstream_port: int) -> Path:
    # hosts stays empty: squid reads no /etc/hosts, every name comes from the DnsLab.
    (workdir / "acls.conf").write_text(INCLUDED.format(port=upstream_port))
    for file_name, text in DOMAIN_FILES.items():
        (workdir / file_name).write_text(text)
    body = CONFIGS[name].format(port=upstream_port, dir=workdir, guard=_guard())
    conf = workdir / "squid.conf"
    conf.write_text(PLUMBING.format(squid_port=squid_port, dir=workdir, dns=DNS_HOST) + body)
    return conf


def corpus(config: str, upstream_port: int) -> list[Probe]:
    kinds = [("GET", upstream_port), ("POST", upstream_port), ("HEAD", upstream_port), ("GET", 25),
             ("CONNECT", upstream_port), ("CONNECT", 8443), ("GET", 443)]
    return [Probe(config, client, method, host, port)
            for host, (method, port), client in product(HOSTS, kinds, CLIENTS)]


def pure_decision(policy, probe: Probe) -> bool:
    """egresswall's decision without the proxy, with the DnsLab's answers: the real proxy must agree."""
    try:
        target = parse_authority(f"{probe.host}:{probe.port}") if probe.method == "CONNECT" else parse_url(
            f"{'https' if probe.port == 443 else 'http'}://{probe.host}:{probe.port}/p")
    except HostFormError:
        return False
    answers = tuple(ZONE.get(target.host, ()))
    if target.ip is None and not answers:
        return False
    request = Request(target, probe.method, probe.client, tunnel=probe.method == "CONNECT")
    return decide(policy, request, None if target.ip is not None else Resolution(target.host, answers)).allowed


def category(result, probe: Probe, egress_headers: dict[str, str]) -> str | None:
    """Why egresswall refused what squid allowed, or None when no stated reason applies."""
    rule = egress_headers.get("x-egresswall-rule", "")
    if rule.startswith("dns:"):
        return "dns-fail-closed"
    if rule.startswith("form:"):
        return "host-form"
    name = probe.host.rstrip(".").strip("[]").lower()
    answers = ZONE.get(name, [])
    if rule.startswith(("special-purpose", "outside-global", "address-deny", "cloud-metadata")):
        return "every-address" if len(answers) > 1 else (
            "non-global-address" if not rule.startswith("address-deny") else None)
    # A host or port rule: the import must have said so, as a loss or an undecided squid answer.
    outcome = result.squid_outcome(probe.client, probe.kind, probe.method, probe.port, name, answers)
    if not outcome.allowed:
        return "undecided" if "allow" in outcome.actions else None
    if _undecided_for_its_class(result, probe, name):
        return "undecided"
    for loss in result.losses:
        if _covers(result, loss, probe, name):
            return loss.category
    return None


def _undecided_for_its_class(result, probe: Probe, name: str) -> bool:
    """squid's answer for the request class the host falls in (not for the host itself) is undecided: a
    regex egresswall cannot read is evaluated on one host exactly, on a class of hosts not at all."""
    region = result.region_of(name)
    named = result.space.methods[:-1]
    method = probe.method if probe.method in named or probe.kind == "connect" else result.space.other_method
    class_probe = SquidProbe(netaddr.IPAddress(probe.client), probe.kind, method, probe.port, region.host)
    outcome = result.program.evaluate(class_probe, result.context)
    return not outcome.allowed and "allow" in outcome.actions


def _covers(result, loss, probe: Probe, name: str) -> bool:
    cell = loss.cell
    if cell.kind != probe.kind or not (cell.low <= probe.port <= cell.high):
        return False
    named = result.space.methods[:-1]
    if probe.kind != "connect" and cell.method != (probe.method if probe.method in named else
                                                   result.space.other_method):
        return False
    client = next(c for c in result.space.clients if c.name() == loss.client)
    if netaddr.IPAddress(probe.client) not in client.addresses:
        return False
    return result.region_of(name).key == loss.region.key


def test_squid_and_egresswall_agree(squid_lab, tmp_path, start_proxy, start_squid) -> None:
    dns, public, internal = squid_lab
    rows: list[tuple[Probe, bool, bool, str | None]] = []
    problems: list[str] = []
    for name in CONFIGS:
        workdir = squid_workdir(name)
        squid_port = free_port()
        conf = write_config(name, workdir, squid_port, public.port)
        result = import_conf(conf, readmit=[f"{PUBLIC}/32", f"{LITERAL}/32"])
        (tmp_path / f"{name}.squid.conf").write_text(conf.read_text())
        (tmp_path / f"{name}.imported.yaml").write_text(result.yaml)
        probes = corpus(name, public.port)
        squid = start_squid(conf, squid_port, workdir)
        try:
            squid_answers = {probe: ask(("127.0.0.1", squid_port), probe) for probe in probes}
        finally:
            squid.stop()
            (tmp_path / f"{name}.access.log").write_text((workdir / "access.log").read_text(errors="replace"))
            shutil.rmtree(workdir, ignore_errors=True)
        before = len(internal.connections)
        proxy = start_proxy(result.yaml, "--nameserver", f"{DNS_HOST}:53", name=f"{name}.yaml")
        egress_answers = {probe: ask((proxy.host, proxy.port), probe) for probe in probes}
        proxy.stop()
        if len(internal.connections) != before:
            problems.append(f"{name}: egresswall connected to the internal stand-in")
        for probe in probes:
            squid_allows = not squid_refused(*squid_answers[probe])
            egress_allows = not egresswall_refused(*egress_answers[probe])
            if egress_allows != pure_decision(result.policy, probe):
                problems.append(f"{name}: the proxy and the policy decide {probe} differently")
            reason = None
            if squid_allows and not egress_allows:
                reason = category(result, probe, egress_answers[probe][1])
                if reason not in CATEGORIES:
                    problems.append(f"{name}: {probe}: egresswall refuses without a stated reason "
                                    f"({egress_answers[probe][1].get('x-egresswall-reason')})")
            elif egress_allows and not squid_allows:
                problems.append(f"{name}: {probe}: egresswall ALLOWS what squid refuses")
            rows.append((probe, squid_allows, egress_allows, reason))
    table = agreement_table(rows)
    print("\n" + table)
    (tmp_path / "squid-agreement.txt").write_text(table)
    assert len(rows) >= 200
    assert not problems, "\n".join(problems[:40]) + "\n\n" + table


def agreement_table(rows: list[tuple[Probe, bool, bool, str | None]]) -> str:
    configs = list(dict.fromkeys(probe.config for probe, *_ in rows))
    reasons = sorted({reason for *_, reason in rows if reason})
    header = ["config", "requests", "both allow", "both refuse", "egresswall stricter",
              "egresswall more permissive", *reasons]
    lines = []
    for config in [*configs, "total"]:
        mine = [row for row in rows if config in ("total", row[0].config)]
        counts = Counter(reason for *_, reason in mine if reason)
        lines.append([config, len(mine), sum(1 for _, s, e, _ in mine if s and e),
                      sum(1 for _, s, e, _ in mine if not s and not e), sum(1 for _, s, e, _ in mine if s and not e),
                      sum(1 for _, s, e, _ in mine if e and not s), *(counts[r] for r in reasons)])
    widths = [max(len(str(x)) for x in column) for column in zip(header, *lines, strict=True)]
    text = [" | ".join(str(x).ljust(w) for x, w in zip(header, widths, strict=True))]
    text.append("-+-".join("-" * w for w in widths))
    text += [" | ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)) for line in lines]
    return "squid vs egresswall (squid import), real squid and the real proxy\n" + "\n".join(text) + "\n"


def test_reverse_dns_names_are_a_documented_difference(squid_lab, start_squid) -> None:
    """squid matches dstdomain against an IP-literal URL's reverse (PTR) name, here from its hosts_file;
    egresswall never looks one up, because whoever owns an address chooses its PTR name. This is the one
    known case where egresswall admits what squid refuses (squid-compat/README.md, "reverse DNS"); it is
    kept out of the corpus above and pinned here, so that any change to it is seen."""
    _, public, _ = squid_lab
    workdir = squid_workdir("ptr")
    squid_port = free_port()
    conf = workdir / "squid.conf"
    conf.write_text(PLUMBING.format(squid_port=squid_port, dir=workdir, dns=DNS_HOST) + _guard()
                    + "acl named dstdomain ptr.lab.test\nhttp_access deny named\nhttp_access allow all\n")
    (workdir / "hosts").write_text(f"{PUBLIC} ptr.lab.test\n")
    result = import_conf(conf, readmit=[f"{PUBLIC}/32", f"{LITERAL}/32"])
    squid = start_squid(conf, squid_port, workdir)
    try:
        by_ptr = ask(("127.0.0.1", squid_port), Probe("ptr", "127.0.0.1", "GET", PUBLIC, public.port))
        without = ask(("127.0.0.1", squid_port), Probe("ptr", "127.0.0.1", "GET", LITERAL, public.port))
    finally:
        squid.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    assert squid_refused(*by_ptr) and not squid_refused(*without)
    assert "reverse (PTR)" in result.yaml
    for address in (PUBLIC, LITERAL):
        assert pure_decision(result.policy, Probe("ptr", "127.0.0.1", "GET", address, public.port))


EXPORTED = """\
version: 1
default: allow
ports: {connect: [443, "1025-65535"], http: [80, "1025-65535"]}
hosts:
  deny:
    - host: .nx.lab.test
      paths: ["/admin"]
    - .bücher.lab.test
"""


def test_squid_enforces_the_exported_path_and_unicode_denials(squid_lab, start_squid) -> None:
    """Real squid with `squid export`'s file (review round 17): the path deny held only until a backslash ending
    the line before it joined it into an ACL, and a deny of .bücher.lab.test held only for the A-label spelling.
    nx.lab.test does not resolve, so only the host and path lines decide (squid never connects)."""
    workdir = squid_workdir("export")
    squid_port = free_port()
    conf = workdir / "squid.conf"
    conf.write_text(PLUMBING.format(squid_port=squid_port, dir=workdir, dns=DNS_HOST) + _guard()
                    + export_policy(parse_policy(EXPORTED, "p.yaml")))
    requests = {
        "GET http://nx.lab.test/admin": True, "GET http://www.nx.lab.test/admin/x": True,
        "GET http://nx.lab.test/a/../admin": True, "GET http://nx.lab.test/ok": False,
        "GET http://xn--bcher-kva.lab.test/": True, "GET http://bücher.lab.test/": True,
        "GET http://BÜCHER.lab.test/": True, "CONNECT bücher.lab.test:443": True,
        "GET http://nx-other.lab.test/": False,
    }
    squid = start_squid(conf, squid_port, workdir)
    try:
        answers = {line: _ask_raw(squid_port, line) for line in requests}
    finally:
        squid.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    wrong = [f"{line}: squid {'refused' if refused else 'did not refuse'}"
             for line, refused in answers.items() if refused != requests[line]]
    assert not wrong, "\n".join(wrong)


def _ask_raw(port: int, line: str) -> bool:
    """Send one request line (UTF-8 bytes as written) to squid; True when squid refused it by access control."""
    method, target = line.split(" ", 1)
    host = target.split("/")[2] if "://" in target else target
    return squid_refused_request(port, f"{method} {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
                                 .encode())


def squid_refused_request(port: int, request: bytes, client: str | None = None) -> bool:
    """Send one request to the squid on ``port`` (from ``client``'s address when given); True when squid refused
    it by access control."""
    with socket.socket() as sock:
        sock.settimeout(15)
        if client is not None:
            sock.bind((client, 0))
        sock.connect(("127.0.0.1", port))
        sock.sendall(request)
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(65536)
            if not chunk:
                break
            head += chunk
    status, headers, _ = parse_response(head)
    return squid_refused(status, headers)
