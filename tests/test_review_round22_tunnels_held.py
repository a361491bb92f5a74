"""Review round 22 (tunnels): what was tried and HELD (each test passes on the tree it was written against)."""

from __future__ import annotations

import contextlib
import socket
import time

import pytest
from proxyproc import both_transports
from rawclient import read_all, tunnel
from test_review_round22_tunnels import NAME, MuteOrigin, _ends, _proxy, _tunnel_lines
from tls_build import real_client_hello

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("internal_saw_nothing")]


@pytest.fixture
def mute():
    server = MuteOrigin()
    yield server
    server.close()


@both_transports
@pytest.mark.parametrize("leaves", ["close", "half-close"])
def test_a_client_that_vanishes_while_the_origin_has_not_answered_its_hello_ends_the_tunnel_in_seconds_holds(
        lab, start_proxy, mute, leaves):
    """README (*Commands*, the tunnel paragraph): "Once one side of a passed-through tunnel has finished, the
    other gets 5 seconds of silence before the tunnel ends (a client that vanished mid-handshake does not hold
    it open for the idle timeout)." A client sends its (judged, allowed) ClientHello and goes away while the
    origin has not answered yet: the tunnel — its upstream socket, its connection slot — must end within
    about 5 s, with its one closing line, not at ``limits.idle_timeout`` (60 s here, 120 by default).

    On the fast front the relay does not read the client at all while the server's first answer is awaited
    (proxy/tunnel_relay.py ``_client_held``), and that wait is bounded only from the server's first byte
    (``_Question.apply`` arms no timer in AWAIT_SERVER while ``server_held`` is empty): the client's FIN is
    never seen, and a mute origin holds the tunnel for the whole idle timeout."""
    proxy = _proxy(lab, start_proxy, mute.port)
    sock = tunnel(proxy, f"{NAME}:{mute.port}")
    sock.sendall(real_client_hello(NAME))
    deadline = time.monotonic() + 5
    while not (mute.received and mute.received[-1]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert mute.received and mute.received[-1][:1] == b"\x16", "the judged ClientHello should reach the origin"
    if leaves == "close":
        sock.close()
    else:
        sock.shutdown(socket.SHUT_WR)
    left = time.monotonic()
    try:
        lines = _tunnel_lines(proxy, 12)
        assert lines, "no closing line 12 s after the client left: the tunnel is held open for the idle timeout"
        assert len(lines) == 1, lines
        assert mute.ended[-1].wait(2), "the origin's connection is still open"
        assert time.monotonic() - left < 12
    finally:
        sock.close()


@both_transports
@pytest.mark.parametrize("inner", ["internal.lab.example:{plain}", "denied.lab.example:{tls}",
                                   "other.lab.example:{tls}", "127.0.0.3:{plain}"])
def test_a_connect_inside_a_tunnel_to_a_plain_http_port_opens_nothing_holds(lab, start_proxy, inner):
    """A CONNECT to a port in both ports.connect and ports.http carries HTTP "decided request by request"; a
    request inside "goes where the tunnel's one upstream connection goes". A second CONNECT sent inside such a
    tunnel must therefore never become a nested tunnel to whatever it names (an internal host, a denied one,
    another port): it is refused, or at most sent as a request to the tunnel's own origin, and nothing is ever
    relayed blind. The internal stand-ins must see no connection, and no 200 may come back."""
    proxy = start_proxy(lab.policy_text("hosts:\n  deny:\n    - denied.lab.example\n", connect_plain=True))
    inner = inner.format(plain=lab.public.port, tls=lab.public_tls.port)
    before = len(lab.public.requests)
    with tunnel(proxy, f"{NAME}:{lab.public.port}") as sock:
        sock.sendall(f"CONNECT {inner} HTTP/1.1\r\nHost: {inner}\r\n\r\n".encode())
        answer = read_all(sock, 3)
        with contextlib.suppress(OSError):
            sock.sendall(real_client_hello(inner.split(":")[0]))
    assert not answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert answer.startswith(b"HTTP/1.1 4") or answer == b"", answer[:200]
    assert not [r for r in lab.public.requests[before:] if r[0] == "CONNECT"], lab.public.requests[before:]


@both_transports
def test_tunnels_that_end_every_way_give_their_connection_slot_back_holds(lab, start_proxy, mute):
    """README: "A connection over `limits.max_connections_per_client` (429) ... is refused when it is accepted";
    "A connection the front hands to mitmproxy keeps its slot until mitmproxy has finished with it". With a cap
    of 2, tunnels that end in every way (refused SNI, not TLS, ECH, half a hello then close, a reset, a whole
    hello then close) each give their slot back: afterwards two tunnels still open at once."""
    text = lab.policy_text("hosts:\n  deny:\n    - denied.lab.example\n",
                           limits="limits:\n  header_timeout: 5\n  idle_timeout: 60\n  max_connections_per_client: 2\n")
    proxy = start_proxy(text.replace("  connect: [", f"  connect: [{mute.port}, "))
    for kind in ["sni-mismatch", "not-tls", "ech", "half-hello", "reset", "whole"] * 2:
        _ends(kind, proxy, mute.port)
    time.sleep(1.0)
    first = tunnel(proxy, f"{NAME}:{mute.port}")
    second = tunnel(proxy, f"{NAME}:{mute.port}")
    first.close()
    second.close()


@both_transports
def test_a_tunnel_whose_session_ends_before_its_hello_passes_nothing_holds(lab, start_proxy, tmp_path, mute):
    """README (*Sessions*): "A passed-through TLS tunnel ... open when its session ends or expires is closed within
    a second, on both transports". A tunnel answered 200 under a session whose client has not sent its hello yet
    is such a tunnel: once the session is ended, the hello sent after must never reach the origin."""
    from session_client import api, connect, create, token_file

    from proxy.gate import SESSION_SWEEP

    text = lab.policy_text("session: required\n").replace("  connect: [", f"  connect: [{mute.port}, ")
    proxy = start_proxy(text, "--admin-token-file", str(token_file(tmp_path)))
    session = create(proxy.admin_port, {"hosts": [NAME]})
    sock, status, _, body = connect(proxy, f"{NAME}:{mute.port}", session)
    with sock:
        assert status == 200, body
        status, _, body = api(proxy.admin_port, "DELETE", f"/v1/sessions/{session['id']}")
        assert status in (200, 204), body
        time.sleep(SESSION_SWEEP * 3 + 1)
        with contextlib.suppress(OSError):
            sock.sendall(real_client_hello(NAME))
        read_all(sock, 2)
    time.sleep(0.3)
    assert not [bytes(b) for b in mute.received if b], "the hello reached the origin after the session ended"
    lines = _tunnel_lines(proxy, 5)
    assert len(lines) == 1 and "ended" in str(lines[0]["error"]), lines
