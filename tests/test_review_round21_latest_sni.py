"""Review round 21 (second pass), the intercepted host's ClientHello to its origin: what of it the client chose.

The round's fix (fc8aa23, tunnel_watch.TunnelWatch.tls_clienthello) keeps mitmproxy from copying the client's
ALPN names to the origin: "client-chosen bytes to the granted origin, read by nothing and charged to no budget".
The SNI is the other name mitmproxy copies (``tlsconfig.tls_start_server``: ``server.sni = client.sni``), and
egresswall accepts it when it *normalises* to the CONNECT host (``tls_hello._server_name``: lower case), so the
client's spelling of it went on to the origin.
"""

from __future__ import annotations

import contextlib
import ssl
import time

import pytest
from intercept_client import open_intercepted
from proxyproc import both_transports
from test_intercept_alpn import HelloRecorder

pytestmark = pytest.mark.integration

HOST = "public.lab.example"


def _sni_open(proxy, sni: str, port: int):
    """CONNECT HOST:port, then TLS naming ``sni``."""
    import socket

    from intercept_client import read_head
    sock = socket.create_connection((proxy.host, proxy.port), timeout=5)
    sock.sendall(f"CONNECT {HOST}:{port} HTTP/1.1\r\nHost: {HOST}:{port}\r\n\r\n".encode())
    assert read_head(sock).startswith(b"HTTP/1.1 200")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    return context.wrap_socket(sock, server_hostname=sni)


@both_transports
def test_the_origin_sni_is_the_decided_host_not_the_clients_spelling(lab, start_proxy):
    """An SNI of ``PuBlIc.LaB.eXaMpLe`` is accepted (it normalises to the CONNECT host), and mitmproxy copies it
    as spelled into its own ClientHello to the origin: one client-chosen bit a letter per connection, to the
    granted origin, the kind of channel fc8aa23 closed for ALPN ("client-chosen bytes to the granted origin, read
    by nothing"). The proxy should name the host it decided (``tunnel.target.host``), as upstream.py does for a
    request's Host header (e8cbc6e: "the upstream is asked for exactly the name egresswall checked ... not the
    client's spelling of it"). Fix: in TunnelWatch.tls_clienthello set ``data.context.server.sni =
    tunnel.target.host`` (or client.sni) once the SNI was judged."""
    origin = HelloRecorder()
    try:
        proxy = start_proxy(lab.policy_text(f"hosts:\n  allow:\n    - host: {HOST}\n      intercept: true\n")
                            .replace("  connect: [", f"  connect: [{origin.port}, "))
        with contextlib.suppress(OSError, ssl.SSLError, AssertionError):
            _sni_open(proxy, "PuBlIc.LaB.eXaMpLe", origin.port).close()
        deadline = time.monotonic() + 5
        while not origin.hellos and time.monotonic() < deadline:
            time.sleep(0.1)
        assert origin.hellos, "the proxy never connected to the origin"
        hello = origin.hellos[0]
        assert b"PuBlIc.LaB.eXaMpLe" not in hello, "the client's spelling of the SNI reached the origin"
        assert HOST.encode() in hello, hello
    finally:
        origin.close()


@pytest.mark.parametrize("offers", [["acme-tls/1"], ["h2", "http/1.1"], ["x-other", "http/1.1"]])
def test_an_intercepted_host_answers_http_whatever_the_client_offers_holds(lab, start_proxy, tmp_path, offers):
    """The lab's TLS origin behind an intercepted host, the client offering ``offers``: mitmproxy's http2 is off
    (proxy/addons/options.py), so h2 is never chosen (the lab origin negotiates none, which mitmproxy mirrors);
    with only non-HTTP names the client gets no ALPN (the origin was offered none) and a plain HTTP/1.1 exchange
    still works, nothing crashes."""
    proxy = start_proxy(lab.policy_text("hosts:\n  allow:\n    - host: public.lab.example\n      intercept: true\n"),
                        "--confdir", str(tmp_path / "ca"), "--upstream-ca", str(lab.cert_file))
    authority = f"{HOST}:{lab.public_tls.port}"
    tls, _ = open_intercepted(proxy, HOST, lab.public_tls.port, alpn=offers, timeout=10)
    with tls:
        chosen = tls.selected_alpn_protocol()
        tls.sendall(f"GET /alpn HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n".encode())
        from intercept_client import read_until_quiet
        answer = read_until_quiet(tls, 5)
    assert chosen in (None, "http/1.1"), chosen  # the lab origin negotiates no ALPN: mitmproxy mirrors that
    assert answer.startswith(b"HTTP/1.1 200") and b"hello from public-tls" in answer, answer[:300]
    assert "Traceback" not in proxy.stderr
