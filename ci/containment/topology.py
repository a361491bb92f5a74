"""The lab's fixed layout: namespaces, links, addresses, names, and the attempts the smoke test makes.

Three network namespaces joined by two veth pairs, and nothing else::

    browser ns                 proxy ns                          net ns ("the internet", the intranet)
    Chromium + probe  --veth-- egresswall  ---------veth-------  public lab hosts on 198.18.0.0/15,
    10.250.0.2                 10.250.0.1:3128                   internal stand-ins, lab DNS
    lo: loopback stand-in      10.251.0.1, fd00:251::1           10.251.0.2, fd00:251::2
                               lo: loopback stand-in

No namespace has a default route. The browser namespace routes only the lab's own host addresses, all
via the proxy's address; the proxy namespace does not forward, so a packet the browser sends past the
proxy goes on the wire (where the capture sees it) and is rejected there. The proxy namespace routes
the same addresses via the net namespace. An address outside this file is unreachable from every lab
namespace: the kernel refuses the send before a packet exists, so "allow everything" in the lab still
only ever reaches lab hosts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from dnslab import Behaviour, Record  # tests/dnslab.py (the package's __init__ puts tests/ on sys.path)

from policy.hosts import DEFAULT_PORTS

ROOT = Path(__file__).resolve().parents[2]

# ---- links ---------------------------------------------------------------------------------------

BROWSER_IF, PROXY_BROWSER_IF = "ewbr0", "ewpx0"  # browser ns <-> proxy ns
PROXY_NET_IF, NET_IF = "ewpx1", "ewnet0"  # proxy ns <-> net ns
BROWSER_ADDR, PROXY_ADDR = "10.250.0.2", "10.250.0.1"
BROWSER_LINK = 30
BROWSER_BROADCAST = "10.250.0.3"
PROXY_NET_ADDR, NET_ADDR = "10.251.0.1", "10.251.0.2"
PROXY_NET_ADDR6, NET_ADDR6 = "fd00:251::1", "fd00:251::2"
PROXY_PORT = 3128
# Only when a run attaches the browser to the egress network too (compose_run's negative twin).
BROWSER_EGRESS_IF, NET_EGRESS_IF = "ewbr1", "ewnet1"
BROWSER_EGRESS_ADDR, NET_EGRESS_ADDR = "10.252.0.2", "10.252.0.1"
ADMIN = "127.0.0.1:3131"  # the proxy's admin listener, on the proxy namespace's own loopback

# ---- lab hosts (all in the net ns) ---------------------------------------------------------------

PUBLIC_WEB = "198.18.0.10"  # HTTP :80, HTTPS :443, WebSocket /ws on both, redirect, the probe page
PUBLIC_STUN = "198.18.0.20"  # STUN on UDP 3478
LAB_DNS = "198.18.0.53"  # the lab's nameserver (UDP and TCP 53); the proxy's only resolver
PUBLIC_RANGE = "198.18.0.0/15"  # re-admitted by the lab policy's address rule
STUN_PORT = 3478

INTERNAL = {  # stand-in name -> address: "internal services" that must never see a packet
    "rfc1918-10": "10.20.0.10",
    "rfc1918-172": "172.16.0.10",
    "rfc1918-192": "192.168.0.10",
    "cgnat-100.64": "100.64.0.10",
    "metadata": "169.254.169.254",
    "ula-fd00": "fd00:20::10",
}
STANDIN_TCP_PORTS = (80, 443)
STANDIN_UDP_PORTS = (53, STUN_PORT)
LOOPBACK_TCP_PORTS = (80, 443)  # the loopback stand-ins in the browser and proxy namespaces
LOOPBACK_UDP_PORTS = (STUN_PORT,)

# What the browser and proxy namespaces may route to (via their one neighbour); nothing else.
LAB_HOSTS = [PUBLIC_WEB, PUBLIC_STUN, LAB_DNS, *INTERNAL.values()]
LAB_HOSTS_V4 = [a for a in LAB_HOSTS if ":" not in a]
LAB_HOSTS_V6 = [a for a in LAB_HOSTS if ":" in a]

# ---- the lab's DNS ---------------------------------------------------------------------------------

DOMAIN = "lab.example"
PUBLIC_NAME = f"public.{DOMAIN}"
NAT64_OF_CGNAT = "64:ff9b::6440:a"  # 64:ff9b::100.64.0.10, the NAT64 wrapping of an internal address

ZONE: dict[str, Behaviour | list[Record]] = {
    PUBLIC_NAME: [Record("A", PUBLIC_WEB)],  # a public name
    f"stun.{DOMAIN}": [Record("A", PUBLIC_STUN)],
    f"internal.{DOMAIN}": [Record("A", INTERNAL["rfc1918-10"])],  # an internal name
    f"mixed.{DOMAIN}": [Record("A", PUBLIC_WEB), Record("A", INTERNAL["rfc1918-10"])],  # answers both
    f"alias.{DOMAIN}": [Record("CNAME", f"intranet.{DOMAIN}")],  # a CNAME to an internal name
    f"intranet.{DOMAIN}": [Record("A", INTERNAL["rfc1918-172"])],
    f"mapped.{DOMAIN}": [Record("AAAA", f"::ffff:{INTERNAL['rfc1918-192']}")],  # IPv4-mapped
    f"nat64.{DOMAIN}": [Record("AAAA", NAT64_OF_CGNAT)],  # NAT64 wrapping
    f"metadata.{DOMAIN}": [Record("A", INTERNAL["metadata"])],
    f"ula.{DOMAIN}": [Record("AAAA", INTERNAL["ula-fd00"])],
    # Rebinding: public for the first lookup, internal for every later one, TTL 0 (never cached).
    f"rebind.{DOMAIN}": Behaviour(sequence=[[Record("A", PUBLIC_WEB, ttl=0)],
                                            [Record("A", INTERNAL["rfc1918-10"], ttl=0)]]),
}
CERT_NAMES = [PUBLIC_NAME, f"rebind.{DOMAIN}", f"mixed.{DOMAIN}", f"internal.{DOMAIN}"]

# ---- the attempts ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """One thing the browser is made to try.

    ``expect``: "allow" — a public lab page that must be read; "refuse" — every proxy decision for it
    must be a refusal whose reason names ``reason`` (the internal address, or the form); "rebind" —
    may be allowed while the name answers the public address, must be refused once it answers the
    internal one; "no-traffic" — not HTTP (WebRTC/STUN): nothing may leave, the proxy never sees it.
    ``addresses``: where it would land if it got through (which stand-in must stay silent).
    """

    key: str
    url: str
    expect: str
    reason: str = ""
    addresses: tuple[str, ...] = ()
    note: str = ""
    direct: bool = False  # Chromium sends it direct when the loopback bypass is not removed
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def host(self) -> str:
        return (urlsplit(self.url).hostname or "").lower()

    @property
    def port(self) -> int:
        if self.url.startswith("stun:"):
            return int(self.url.rpartition(":")[2])
        parts = urlsplit(self.url)
        if parts.port:
            return parts.port
        return DEFAULT_PORTS.get(parts.scheme, 0)


_I = INTERNAL
PUBLIC_HTTP = f"http://{PUBLIC_NAME}"
PUBLIC_HTTPS = f"https://{PUBLIC_NAME}"

TARGETS: list[Target] = [
    # Allowed: the lab's public web, which must be read (or the test proves nothing).
    Target("public_http", f"{PUBLIC_HTTP}/public/page.html", "allow", addresses=(PUBLIC_WEB,)),
    Target("public_https", f"{PUBLIC_HTTPS}/public/page.html", "allow", addresses=(PUBLIC_WEB,)),
    Target("public_ws", f"ws://{PUBLIC_NAME}/ws", "allow", addresses=(PUBLIC_WEB,)),
    Target("public_wss", f"wss://{PUBLIC_NAME}/ws", "allow", addresses=(PUBLIC_WEB,)),
    # Internal by name: each answer a different way of hiding an internal address.
    Target("internal_name", f"http://internal.{DOMAIN}/", "refuse", _I["rfc1918-10"], (_I["rfc1918-10"],)),
    Target("internal_name_https", f"https://internal.{DOMAIN}/", "refuse", _I["rfc1918-10"], (_I["rfc1918-10"],)),
    Target("mixed_name", f"http://mixed.{DOMAIN}/", "refuse", _I["rfc1918-10"], (_I["rfc1918-10"],),
           note="answers a public and an internal address"),
    Target("cname_internal", f"http://alias.{DOMAIN}/", "refuse", _I["rfc1918-172"], (_I["rfc1918-172"],),
           note="CNAME to an internal name"),
    Target("aaaa_mapped", f"http://mapped.{DOMAIN}/", "refuse", _I["rfc1918-192"], (_I["rfc1918-192"],),
           note="AAAA ::ffff:192.168.0.10"),
    Target("aaaa_nat64", f"http://nat64.{DOMAIN}/", "refuse", "64:ff9b::", (_I["cgnat-100.64"],),
           note="AAAA 64:ff9b::100.64.0.10"),
    Target("metadata_name", f"http://metadata.{DOMAIN}/latest/meta-data/", "refuse", _I["metadata"],
           (_I["metadata"],)),
    Target("ula_name", f"http://ula.{DOMAIN}/", "refuse", _I["ula-fd00"], (_I["ula-fd00"],)),
    Target("rebind_name", f"http://rebind.{DOMAIN}/", "rebind", _I["rfc1918-10"], (_I["rfc1918-10"],),
           note="public first, internal after, TTL 0"),
    # Internal by IP literal.
    Target("ipv4_10", f"http://{_I['rfc1918-10']}/", "refuse", _I["rfc1918-10"], (_I["rfc1918-10"],)),
    Target("ipv4_172", f"http://{_I['rfc1918-172']}/", "refuse", _I["rfc1918-172"], (_I["rfc1918-172"],)),
    Target("ipv4_192", f"http://{_I['rfc1918-192']}/", "refuse", _I["rfc1918-192"], (_I["rfc1918-192"],)),
    Target("ipv4_cgnat", f"http://{_I['cgnat-100.64']}/", "refuse", _I["cgnat-100.64"], (_I["cgnat-100.64"],)),
    Target("ipv6_ula", f"http://[{_I['ula-fd00']}]/", "refuse", _I["ula-fd00"], (_I["ula-fd00"],)),
    Target("ipv6_mapped", f"http://[::ffff:{_I['rfc1918-192']}]/", "refuse", _I["rfc1918-192"],
           (_I["rfc1918-192"],)),
    Target("ipv6_nat64", f"http://[{NAT64_OF_CGNAT}]/", "refuse", "64:ff9b::", (_I["cgnat-100.64"],)),
    Target("metadata_ip", f"http://{_I['metadata']}/latest/meta-data/", "refuse", _I["metadata"],
           (_I["metadata"],), direct=True),
    # This machine: Chromium sends these direct unless told <-loopback>.
    Target("localhost", "http://localhost/", "refuse", "localhost", ("127.0.0.1", "::1"), direct=True),
    Target("loopback_v4", "http://127.0.0.1/", "refuse", "127.0.0.1", ("127.0.0.1",), direct=True),
    Target("loopback_v6", "http://[::1]/", "refuse", "::1", ("::1",), direct=True),
    # A public page that redirects to an internal one.
    Target("redirect_internal", f"{PUBLIC_HTTP}/redirect?to=http://internal.{DOMAIN}/from-redirect", "refuse",
           _I["rfc1918-10"], (_I["rfc1918-10"],), note="302 from the public page",
           extra={"final_host": f"internal.{DOMAIN}"}),
    # WebSockets to internal hosts (they arrive at the proxy as CONNECT host:80 / host:443).
    Target("ws_internal", f"ws://internal.{DOMAIN}/ws", "refuse", _I["rfc1918-10"], (_I["rfc1918-10"],)),
    Target("wss_internal", f"wss://internal.{DOMAIN}/ws", "refuse", _I["rfc1918-10"], (_I["rfc1918-10"],)),
    # WebRTC: UDP that no proxy carries; the packet filter and the WebRTC policy must both stop it.
    Target("stun_public", f"stun:{PUBLIC_STUN}:{STUN_PORT}", "no-traffic", addresses=(PUBLIC_STUN,)),
    Target("stun_internal", f"stun:{_I['rfc1918-10']}:{STUN_PORT}", "no-traffic", addresses=(_I["rfc1918-10"],)),
]
TARGETS_BY_KEY = {t.key: t for t in TARGETS}


def lab_policy_text() -> str:
    """The lab policy: the open web (every address must still pass), 198.18.0.0/15 re-admitted."""
    return (
        "# The containment lab's policy: default allow, and only the lab's \"public\" range re-admitted.\n"
        "version: 1\nmode: enforce\ndefault: allow\n"
        f"addresses:\n  allow: [{PUBLIC_RANGE}]\n  refuse_cloud_metadata: true\n"
        "ports:\n  connect: [443, 80]\n  http: [80]\n"
        f"resolver:\n  nameservers: ['{LAB_DNS}']\n  timeout: 2\n  ttl_floor: 0\n"
    )


def allow_everything_policy_text() -> str:
    """The negative control: every address and host allowed. The lab's routes still confine it."""
    return (
        "# NEGATIVE RUN: allow everything. Containment must now be reported broken.\n"
        "version: 1\nmode: enforce\ndefault: allow\n"
        "addresses:\n  allow: [0.0.0.0/0, '::/0']\n  refuse_cloud_metadata: false\n"
        "ports:\n  connect: [443, 80]\n  http: [80]\n"
        f"resolver:\n  nameservers: ['{LAB_DNS}']\n  timeout: 2\n  ttl_floor: 0\n"
    )
