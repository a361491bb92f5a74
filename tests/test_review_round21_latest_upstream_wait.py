"""Review round 21 (second pass): mitm_upstream_wait._receive_handshake_data (f24bb80), the 1xx skipping and the
64 KiB bound on mitmproxy's path, against the fast front's reading (proxy/upstream_connect.py ``_response``).

The module's docstring: "Its reading of the answer is the fast front's too: a 1xx answer before the final one is
skipped ..., and the answer's head is bounded by MAX_RESPONSE_HEAD". README ("Upstream proxy"): intercepted hosts
and --no-fast-tunnels go through mitmproxy's upstream mode "as on the front".
"""
from __future__ import annotations

import ssl
import time

import pytest
from fake_upstream_proxy import ESTABLISHED, upstream_policy
from labnet import PUBLIC_IP
from proxyproc import TRANSPORTS
from test_review_round21_upstream_wait import Scripted, _clean, _get, _tunnel_get

pytestmark = pytest.mark.integration


def _run(lab, start_proxy, pieces, limits="limits:\n  connect_timeout: 3\n  idle_timeout: 20\n"):
    up = Scripted(pieces, (PUBLIC_IP, lab.public.port))
    try:
        proxy = start_proxy(upstream_policy(lab, up, limits))
        started = time.monotonic()
        head, answer = _tunnel_get(lab, proxy)
        took = time.monotonic() - started
        _clean(proxy)
        return head, answer, took, up
    finally:
        up.close()


@pytest.mark.parametrize("transport", list(TRANSPORTS), indirect=True)
def test_bare_lf_interim_and_final_heads_open_the_tunnel_holds(lab, start_proxy, transport) -> None:
    """h11 (the front) ends a head at a bare LF pair: a ``100`` and the ``200`` so ended open the tunnel on both."""
    wire = b"HTTP/1.1 100 Continue\n\nHTTP/1.1 200 Connection established\n\n"
    head, answer, _, _ = _run(lab, start_proxy, [(0, wire)])
    assert head.startswith(b"HTTP/1.1 200") and b"hello from public" in answer, (head, answer[:300])


@pytest.mark.parametrize("transport", list(TRANSPORTS), indirect=True)
def test_a_101_before_the_200_does_not_open_the_tunnel_holds(lab, start_proxy, transport) -> None:
    """101 Switching Protocols to a CONNECT (no Upgrade asked): not an interim answer to skip; h11 on the front
    refuses it, mitmproxy's reader takes it as the (refusing) answer. Neither relays the origin's bytes."""
    head, answer, _, _ = _run(lab, start_proxy, [(0, b"HTTP/1.1 101 Switching Protocols\r\n\r\n"),
                                                 (0.05, ESTABLISHED)])
    assert b"hello from public" not in answer, (head, answer[:300])
    assert answer.startswith(b"HTTP/1.1 502") and b"101 Switching Protocols" in answer, (head, answer[:400])


@pytest.mark.parametrize("transport", list(TRANSPORTS), indirect=True)
def test_an_endless_flood_of_small_interim_answers_ends_within_connect_timeout_holds(lab, start_proxy,
                                                                                    transport) -> None:
    """A 100 Continue every 5 ms (25 bytes each: 64 KiB only after ~13 s): connect_timeout (2 s) ends it."""
    pieces = [(0.005, b"HTTP/1.1 100 Continue\r\n\r\n")] * 1400
    head, answer, took, _ = _run(lab, start_proxy, pieces, "limits:\n  connect_timeout: 2\n  idle_timeout: 20\n")
    assert b"hello from public" not in answer and took < 6, (took, head, answer[:300])
    assert answer.startswith(b"HTTP/1.1 502") or head.startswith(b"HTTP/1.1 502"), (head, answer[:300])


def _tls_tunnel(lab, proxy) -> bytes:
    """A passed-through TLS tunnel to the lab's TLS origin (the front's own upstream CONNECT on the fast
    transport, mitmproxy's HttpUpstreamProxy on the other): what one GET inside it got, or the error."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(str(lab.cert_file))
    authority = f"public.lab.example:{lab.public_tls.port}"
    sock, status, _ = proxy.connect(authority)
    try:
        if status != 200:
            return f"CONNECT {status}".encode()
        with context.wrap_socket(sock, server_hostname="public.lab.example") as tls:
            return _get(tls, authority, "/after-hints", close=True)
    except (OSError, ssl.SSLError) as err:
        return f"failed: {err!r}".encode()
    finally:
        sock.close()


@pytest.mark.parametrize("transport", list(TRANSPORTS), indirect=True)
def test_interim_answers_over_64_kib_in_all_fail_the_tunnel_on_both_paths(lab, start_proxy, transport) -> None:
    """62 KiB of 103 Early Hints heads (one piece), then a 200 with a 6 KiB header (the next): 68 KiB read before
    the final head ended. The fast front counts every byte read before the final answer
    (upstream_connect._response: ``seen > MAX_RESPONSE_HEAD`` raises "its answer head is over 65536 bytes") and
    fails the tunnel; mitm_upstream_wait._receive_handshake_data checks ``seen`` only while no head end is held
    (``if end is None``), so the same upstream opens the tunnel on mitmproxy's path. Its docstring promises the
    front's bound ("the answer's head is bounded by MAX_RESPONSE_HEAD" ... "the fast front's too"). Fix
    (proxy/mitm_upstream_wait.py _receive_handshake_data): check the bytes read up to the final head's end against
    MAX_RESPONSE_HEAD also when the head end was found (before handing it to mitmproxy's reader)."""
    hint = b"HTTP/1.1 103 Early Hints\r\nLink: <" + b"a" * 1000 + b">\r\n\r\n"
    interim = hint * (62 * 1024 // len(hint))
    final = b"HTTP/1.1 200 Connection established\r\nX-Pad: " + b"b" * 6000 + b"\r\n\r\n"
    assert len(interim) < 65536 < len(interim) + len(final)
    up = Scripted([(0, interim), (0.3, final)], (PUBLIC_IP, lab.public_tls.port))
    try:
        proxy = start_proxy(upstream_policy(lab, up, "limits:\n  connect_timeout: 3\n  idle_timeout: 20\n"))
        got = _tls_tunnel(lab, proxy)
        time.sleep(0.5)
        closing = [r for r in proxy.audit() if r.get("event") in ("tunnel", "response", "decision")]
        assert b"hello from public-tls" not in got, (transport, got[:300], closing[-2:])
        _clean(proxy)
    finally:
        up.close()
