"""Review round 20 (a helper's, exfiltration): names looked up for requests a session's byte budget already refused.

README *Sessions*: "A session is checked before the name is resolved, so an ungranted host is never looked up,
and neither is a name whose request its budgets already refuse". ``Gate._session_first`` asks
``SessionService.fits``, which judges the *store's* usage; but while a passed-through TLS tunnel (or a WebSocket)
of the session is open, its bytes reach the store only at the gate's sweep (every ``SESSION_SWEEP`` second). The
worker's own ``ByteAllowance`` knows at once that the budget is spent, yet it is asked only in
``Gate._session_charge`` (``_over_allowance``), after ``Gate.decide`` looked the name up. So for up to a second
after a tunnel spends the request_bytes budget, every request — sent one after another, no race — is refused
``session:budget-request-bytes`` *after* its client-chosen name went to DNS (measured: ~300 names in 0.85 s on
the fast path, ~180 on mitmproxy's).

Both transports; both failed before `Gate._session_first` asked the allowance (`SessionService.fits_moved`).
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import time
import uuid

from dnslab import Record
from labnet import PUBLIC_IP
from proxyproc import both_transports
from rawclient import read_head
from session_client import create, token_file

BUDGET = 8000


def _spend_budget_in_a_tunnel(proxy, lab, auth: str) -> ssl.SSLSocket:
    """A TLS tunnel under the session that sends ~7,700 of its 8,000 request bytes and stays open."""
    sock = socket.create_connection((proxy.host, proxy.port), timeout=5)
    sock.sendall(f"CONNECT public.lab.example:{lab.public_tls.port} HTTP/1.1\r\nHost: x\r\n"
                 f"Proxy-Authorization: {auth}\r\n\r\n".encode())
    assert read_head(sock).startswith(b"HTTP/1.1 200")
    tls = ssl.create_default_context(cafile=str(lab.cert_file)).wrap_socket(sock, server_hostname="public.lab.example")
    tls.sendall(b"GET / HTTP/1.1\r\nHost: public.lab.example\r\nX-Pad: " + b"p" * 7000)  # head left unfinished
    time.sleep(0.15)
    return tls


def _fresh(lab) -> str:
    name = f"conversation-{uuid.uuid4().hex[:10]}.lab.example"  # what an exfiltrating request carries
    lab.dns.set(name, [Record("A", PUBLIC_IP)])
    return name


@both_transports
def test_a_request_its_session_allowance_refuses_looks_no_name_up(lab, start_proxy, tmp_path):
    proxy = start_proxy(lab.policy_text("session: required\n"), "--admin-token-file", str(token_file(tmp_path)))
    session = create(proxy.admin_port, {"hosts": ["*.lab.example"]}, budgets={"request_bytes": BUDGET})
    auth = session["proxy_authorization"]
    tunnel = _spend_budget_in_a_tunnel(proxy, lab, auth)
    try:
        leaked, answers = [], []
        for _ in range(3):  # one after another: no request races another
            name = _fresh(lab)
            status, headers, _ = proxy.get(f"http://{name}:{lab.public.port}/x",
                                           {"Proxy-Authorization": auth, "X-Pad": "q" * 600})
            answers.append((status, headers.get("x-egresswall-rule")))
            if lab.dns.queried(name):
                leaked.append(name)
    finally:
        with contextlib.suppress(OSError):
            tunnel.close()
    assert answers == [(403, "session:budget-request-bytes")] * 3, answers
    assert not leaked, f"looked up for requests refused session:budget-request-bytes: {leaked}"

