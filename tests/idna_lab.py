"""The lab of the IDNA 2008 tests (review round 20): three names only IDNA 2008 reads — one allowed, one denied by
name, one that resolves to the internal stand-in — an intercepted name under the allowed one, a TLS origin for
them, and a proxy on each transport with that policy."""

from __future__ import annotations

from collections.abc import Iterator

from dnslab import Record
from intercept_client import RecordingTlsOrigin
from labnet import PUBLIC_IP, self_signed
from proxyproc import TRANSPORTS, ProxyProcess

ALLOWED = "xn--fa-hia.lab.example"      # faß.lab.example
REFUSED = "xn--strae-oqa.lab.example"   # straße.lab.example, denied by name
INTERNAL = "xn--gro-7ka.lab.example"    # groß.lab.example, resolves to the internal stand-in
INTERCEPTED = f"intercepted.{ALLOWED}"


def tls_origin(folder: str) -> Iterator[RecordingTlsOrigin]:
    """A recording TLS origin with a certificate for the allowed and the intercepted name (``origin.cert``)."""
    context, cert = self_signed([ALLOWED, INTERCEPTED], folder)
    server = RecordingTlsOrigin(context)
    server.cert = cert
    yield server
    server.close()


def proxy_on(lab, origin: RecordingTlsOrigin, folder, transport: str) -> Iterator[ProxyProcess]:
    """The names in the lab's DNS and a proxy on ``transport`` whose policy denies REFUSED, intercepts INTERCEPTED
    and allows CONNECT to the origin's port and the plain public port. On the way out: no traceback, and nothing
    reached but the public address."""
    for name, address in ((ALLOWED, PUBLIC_IP), (REFUSED, PUBLIC_IP), (INTERNAL, "127.0.0.3"),
                          (INTERCEPTED, PUBLIC_IP)):
        lab.dns.set(name, [Record("A", address)])
    policy = folder / "policy.yaml"
    policy.write_text(lab.policy_text(
        f"hosts:\n  deny:\n    - host: {REFUSED}\n  allow:\n    - host: {INTERCEPTED}\n"
        "      intercept: true\n").replace(f"connect: [443, {lab.public_tls.port}]",
                                          f"connect: [443, {lab.public_tls.port}, {origin.port}, {lab.public.port}]"))
    process = ProxyProcess(["--policy", str(policy), "--confdir", str(folder / "ca"), "--upstream-ca",
                            str(origin.cert), *TRANSPORTS[transport]], folder / "audit.jsonl")
    process.transport = transport
    yield process
    process.stop()
    assert "Traceback" not in process.stderr, process.stderr[-2000:]
    assert not [e for e in process.outbound() if e["host"] != PUBLIC_IP], process.outbound()
