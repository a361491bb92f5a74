"""Round 23, the contained Chromium: what a hostile page tried and what HELD.

Every run is a fresh network namespace (only ``lo``) and mount namespace (tests/review_round23_chromium_netns.py):
the real proxy, a small lab, the launcher's Chromium, TCP listeners on 0.0.0.0:PORT and [::]:PORT (so
every loopback address, v4 and v6, on the page's chosen port), UDP listeners on PORT, 443 and 80, and a
"system" DNS server on 127.0.0.53:53 that /etc/resolv.conf names (in that namespace only): any query it
logs is one the BROWSER made itself (the proxy asks only the lab's DnsLab). The policy lists PORT in
ports.http and ports.connect, so a refusal there comes from the address or host rules.

What held, on both transports: odd host spellings of loopback (hex, octal, short, decimal, 0, 0.0.0.0,
[::], mapped, trailing dots, sub.localhost, percent-encoded and full-width localhost, ideographic dots),
fetch keepalive, sendBeacon to [::1], EventSource, WebSocket (v4, v6, 0.0.0.0, wss://localhost, a name),
window.open, an iframe on [::1], <link rel=dns-prefetch/preconnect/prefetch/preload>, speculation rules
(prefetch and prerender), WebRTC with STUN and TURN (udp, tcp, turns) servers named and on loopback,
ftp: and file:, chrome:// in window.open, the proxy's own port and its admin port, and WebTransport
(HTTP/3 over UDP; from an https page, since it needs a secure context) to 127.0.0.1, [::1], a name and
port 443. No listener got a connection or a datagram, the browser sent no DNS query of its own, and
the proxy's audit shows each refusal.
"""

from __future__ import annotations

import os
import shutil

import pytest
from proxyproc import TRANSPORTS
from review_round23_chromium_netns import run_in_netns

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"),
                       reason="needs root, unshare and ip for a network namespace of its own"),
]


def fetch(url: str) -> str:
    return f"const r = await fetch('{url}', {{mode: 'no-cors'}}); return r.type + ' ' + r.status;"


def websocket(url: str) -> str:
    return (f"const s = new WebSocket('{url}'); return await new Promise((r) => {{ s.onopen = () => r('open'); "
            "s.onerror = () => r('error'); setTimeout(() => r('pending'), 4000); });")


def webtransport(url: str) -> str:
    return (f"const t = new WebTransport('{url}'); return await Promise.race([t.ready.then(() => 'ready'), "
            "new Promise((r) => setTimeout(() => r('pending'), 4000))]);")


WEBRTC = ("const pc = new RTCPeerConnection({iceServers: [{urls: ['stun:stun.r23.example:{PORT}', "
          "'stun:127.0.0.1:{PORT}']}, {urls: ['turn:127.0.0.1:{PORT}?transport=tcp', "
          "'turn:turn.r23.example:{PORT}?transport=udp', 'turns:127.0.0.1:{PORT}?transport=tcp'], username: 'u', "
          "credential: 'p'}]}); pc.createDataChannel('d'); const cands = []; pc.onicecandidate = (e) => "
          "{ if (e.candidate) cands.push(e.candidate.candidate); }; await pc.setLocalDescription(await "
          "pc.createOffer()); await new Promise((r) => setTimeout(r, 4000)); "
          "return 'candidates: ' + cands.join(' | ');")

# name -> (JavaScript, the host the proxy must refuse for it, or None when the browser itself stops it)
PAGE_ATTEMPTS = {
    "keepalive": ("const r = await fetch('http://127.0.0.1:{PORT}/ka', {method: 'POST', body: 'x', keepalive: true, "
                  "mode: 'no-cors'}); return r.type;", "127.0.0.1"),
    "beacon_v6": ("return navigator.sendBeacon('http://[::1]:{PORT}/beacon', 'x');", "::1"),
    "eventsource": ("const e = new EventSource('http://127.0.0.1:{PORT}/es'); return await new Promise((r) => "
                    "{ e.onopen = () => r('open'); e.onerror = () => { e.close(); r('error'); }; "
                    "setTimeout(() => r('pending'), 4000); });", "127.0.0.1"),
    "ws_v4": (websocket("ws://127.0.0.1:{PORT}/ws"), "127.0.0.1"),
    "ws_v6": (websocket("ws://[::1]:{PORT}/ws"), "::1"),
    "ws_zero": (websocket("ws://0.0.0.0:{PORT}/ws"), "0.0.0.0"),
    "wss_localhost": (websocket("wss://localhost:{PORT}/ws"), None),
    "ws_name": (websocket("ws://wsname.r23.example:{PORT}/"), "wsname.r23.example"),
    "hex": (fetch("http://0x7f.1:{PORT}/hex"), "127.0.0.1"),
    "octal": (fetch("http://0177.0.0.1:{PORT}/oct"), "127.0.0.1"),
    "short": (fetch("http://127.1:{PORT}/short"), "127.0.0.1"),
    "decimal": (fetch("http://2130706433:{PORT}/dec"), "127.0.0.1"),
    "zero": (fetch("http://0.0.0.0:{PORT}/zero"), "0.0.0.0"),
    "zero_short": (fetch("http://0:{PORT}/zero2"), "0.0.0.0"),
    "v6any": (fetch("http://[::]:{PORT}/v6any"), "::"),
    "mapped": (fetch("http://[::ffff:7f00:1]:{PORT}/mapped"), None),
    "localhost_dot": (fetch("http://localhost.:{PORT}/ld"), None),
    "sub_localhost": (fetch("http://sub.localhost:{PORT}/sl"), None),
    "pct_localhost": (fetch("http://%6c%6f%63%61%6c%68%6f%73%74:{PORT}/pct"), None),
    "fullwidth": (fetch("http://\uff4c\uff4f\uff43\uff41\uff4c\uff48\uff4f\uff53\uff54:{PORT}/fw"), None),
    "ideo_dots": (fetch("http://127\u30020\u30020\u30021:{PORT}/ideo"), "127.0.0.1"),
    "name_dot": (fetch("http://loop.lab.example.:{PORT}/nd"), "loop.lab.example"),
    "internal": (fetch("http://internal.lab.example:{PORT}/int"), "internal.lab.example"),
    "proxy_port": (fetch("http://127.0.0.1:{PPORT}/self"), "127.0.0.1"),
    "admin_port": (fetch("http://127.0.0.1:{APORT}/metrics"), "127.0.0.1"),
    "https_loop": (fetch("https://127.0.0.1:{PORT}/tls"), "127.0.0.1"),
    "webrtc": (WEBRTC, None),
    "popup": ("const w = window.open('http://127.0.0.1:{PORT}/popup'); return String(!!w);", "127.0.0.1"),
    "iframe": ("const i = document.createElement('iframe'); i.src = 'http://[::1]:{PORT}/frame'; "
               "document.body.appendChild(i); await new Promise((r) => setTimeout(r, 2000)); return 'added';", "::1"),
    "chrome_open": ("const w = window.open('chrome://net-internals/'); return String(!!w);", None),
    "file_fetch": (fetch("file:///etc/hostname"), None),
    "img_ftp": ("const i = new Image(); i.src = 'ftp://127.0.0.1:{PORT}/x'; return await new Promise((r) => "
                "{ i.onload = () => r('load'); i.onerror = () => r('error'); setTimeout(() => r('pending'), 3000); });",
                None),
}
HEAD = ('<link rel="dns-prefetch" href="//dnsprefetch.r23.example">'
        '<link rel="preconnect" href="http://preconnect.r23.example:{PORT}">'
        '<link rel="preconnect" href="http://127.0.0.1:{PORT}">'
        '<link rel="prefetch" href="http://prefetch.r23.example:{PORT}/p">'
        '<link rel="preload" as="fetch" crossorigin href="http://[::1]:{PORT}/preload">'
        '<script type="speculationrules">{"prefetch": [{"source": "list", "urls": '
        '["http://specprefetch.r23.example:{PORT}/s", "http://127.0.0.1:{PORT}/spec"]}], '
        '"prerender": [{"source": "list", "urls": ["http://127.0.0.1:{PORT}/prerender"]}]}'
        '</script>')
NAVIGATIONS = ["http://0.0.0.0:{PORT}/nav", "http://[::1]:{PORT}/nav", "http://localhost:{PORT}/nav",
               "http://0x7f000001:{PORT}/nav", "http://navname.r23.example:{PORT}/nav", "ftp://127.0.0.1:{PORT}/nav"]
WEBTRANSPORT = {"wt_v4": webtransport("https://127.0.0.1:{PORT}/wt"), "wt_v6": webtransport("https://[::1]:{PORT}/wt"),
                "wt_name": webtransport("https://wtname.r23.example:{PORT}/wt"),
                "wt_443": webtransport("https://127.0.0.1/wt")}
# Names only the browser's own resolver could ask about (the proxy never gets a request for them).
BROWSER_ONLY_NAMES = ("dnsprefetch.r23.example", "preconnect.r23.example", "stun.r23.example", "turn.r23.example",
                      "wtname.r23.example", "specprefetch.r23.example")


def nothing_reached(out: dict) -> None:
    assert out["tcp_hits"] == [], f"a loopback listener got a connection: {out['tcp_hits']}"
    assert out["udp_hits"] == [], f"a UDP listener got a datagram: {out['udp_hits']}"
    assert out["system_dns"] == [], f"the browser made DNS queries of its own: {out['system_dns']}"
    assert not {name for name, _ in out["lab_dns"]} & set(BROWSER_ONLY_NAMES), out["lab_dns"]
    leaving = [e for e in out["guard"] if e["kind"] in ("connect", "datagram")
               and not (e["host"].startswith("127.") or e["host"] == "::1")]
    assert not leaving, leaving


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_page_tricks_reach_no_loopback_listener_and_make_no_dns_of_their_own_holds(transport, tmp_path):
    attempts = {name: code for name, (code, _) in PAGE_ATTEMPTS.items()}
    out = run_in_netns({"transport": transport, "attempts": attempts, "head": HEAD, "navigations": NAVIGATIONS,
                        "settle": 3}, tmp_path, timeout=150)
    nothing_reached(out)
    port = out["port"]
    results = out["results"]
    assert set(results) == set(PAGE_ATTEMPTS), results
    for name in ("ws_v4", "ws_v6", "ws_zero", "wss_localhost", "ws_name", "eventsource"):
        assert results[name] == "error", (name, results[name])
    assert results["webrtc"] == "candidates: ", results["webrtc"]  # no UDP, not even a host candidate
    refused = {(d["host"], d["port"]) for d in out["decisions"] if d["verdict"] == "refuse"}
    allowed = [d for d in out["decisions"] if d["verdict"] == "allow"]
    assert {d["host"] for d in allowed} == {"public.lab.example"}, allowed
    for name, (_, host) in PAGE_ATTEMPTS.items():
        if host is None:
            continue
        wanted_port = out["proxy_port"] if name == "proxy_port" else out["admin_port"] if name == "admin_port" else port
        assert (host, wanted_port) in refused, (name, host, sorted(refused, key=str))
    # the localhost spellings were refused by their form, before any look-up
    assert any(d["rule_id"] == "form:localhost" for d in out["decisions"])
    for url, shown in out["navigations"].items():
        if url.startswith("ftp:"):
            assert "ERR_ABORTED" in shown["error"]
            continue
        assert shown["status"] == 403 and "egresswall refused this request." in shown["body"], (url, shown)


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_webtransport_from_a_secure_page_sends_no_udp_and_no_dns_holds(transport, tmp_path):
    """WebTransport is HTTP/3 (QUIC, UDP): an HTTP proxy cannot carry it, and --disable-quic does not
    name it. From an https page (it needs a secure context) it fails its handshake without a datagram."""
    out = run_in_netns({"transport": transport, "tls": True, "attempts": WEBTRANSPORT, "settle": 1}, tmp_path,
                       timeout=120)
    nothing_reached(out)
    assert set(out["results"]) == set(WEBTRANSPORT)
    for name, result in out["results"].items():
        assert result.startswith("error: WebTransportError"), (name, result)
