"""Review round 22 (tunnels): a CONNECT tunnel must never become a blind relay, nor outlive what let it open.

Findings (these tests failed on the tree they were written against; each docstring says what should hold). What
held is in test_review_round22_tunnels_held.py, which reuses this module's origins and helpers. Fixed: a client
that leaves while an intercepted origin's TLS handshake is awaited ends its connection (proxy/mitm_patches.py
HeldReader), and a ClientHello after a reload is judged by the policy in force (Gate.tunnel_start); a tunnel's
bytes_up is what was read from the client (README says so).
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time

import pytest
from labnet import PUBLIC_IP
from listening import ConnectionServer
from proxyproc import both_transports
from rawclient import read_all, tunnel
from tls_build import real_client_hello

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("internal_saw_nothing")]
NAME = "public.lab.example"


class MuteOrigin(ConnectionServer):
    """A TCP origin that reads everything it is sent and never answers; it notes when each connection ended."""

    def __init__(self) -> None:
        self.received: list[bytearray] = []
        self.ended: list[threading.Event] = []
        super().__init__(PUBLIC_IP)

    def accepted_one(self, conn: socket.socket) -> tuple:
        got, ended = bytearray(), threading.Event()
        self.received.append(got)
        self.ended.append(ended)
        return got, ended

    def serve(self, conn: socket.socket, got: bytearray, ended: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while chunk := conn.recv(65536):
                got += chunk
        ended.set()


@pytest.fixture
def mute():
    server = MuteOrigin()
    yield server
    server.close()


def _proxy(lab, start_proxy, port: int, idle: int = 60):
    text = lab.policy_text(limits=f"limits:\n  header_timeout: 30\n  idle_timeout: {idle}\n")
    return start_proxy(text.replace("  connect: [", f"  connect: [{port}, "))


def _tunnel_lines(proxy, wait: float) -> list[dict]:
    deadline = time.monotonic() + wait
    while True:
        found = [r for r in proxy.audit() if r.get("event") == "tunnel"]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def _wait(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def _connect_status(proxy, authority: str) -> int:
    sock, status, _ = proxy.connect(authority)
    sock.close()
    return status


class HangUpOrigin(MuteOrigin):
    """Reads the ClientHello's first record, then closes without a word."""

    def serve(self, conn: socket.socket, got: bytearray, ended: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while len(got) < 5 or len(got) < 5 + int.from_bytes(got[3:5], "big"):
                chunk = conn.recv(65536)
                if not chunk:
                    break
                got += chunk
            time.sleep(0.3)
            got += conn.recv(65536, socket.MSG_DONTWAIT) if _readable(conn) else b""
        conn.close()
        ended.set()


def _readable(conn: socket.socket) -> bool:
    import select
    return bool(select.select([conn], [], [], 0)[0])


@pytest.fixture
def hang_up():
    server = HangUpOrigin()
    yield server
    server.close()


def _ends(kind: str, proxy, port: int) -> None:
    """One tunnel that ends each way a tunnel can end before or at its first message."""
    sock = tunnel(proxy, f"{NAME}:{port}")
    with sock:
        if kind == "sni-mismatch":
            sock.sendall(real_client_hello("other.lab.example"))
        elif kind == "not-tls":
            sock.sendall(b"GET / HTTP/1.1\r\nHost: public.lab.example\r\n\r\n")
        elif kind == "ech":
            from tls_build import client_hello, extension
            sock.sendall(client_hello(NAME.encode(), extra=(extension(0xFE0D, bytes(48)),)))
        elif kind == "half-hello":
            sock.sendall(real_client_hello(NAME)[:100])
            return  # closed with half a hello
        elif kind == "reset":
            sock.sendall(real_client_hello(NAME)[:100])
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            return
        elif kind == "whole":
            sock.sendall(real_client_hello(NAME))
            time.sleep(0.2)
            return
        read_all(sock, 3)


def _intercepting_proxy(lab, start_proxy, tmp_path, port: int, idle: int = 60):
    text = lab.policy_text(f"hosts:\n  allow:\n    - host: {NAME}\n      intercept: true\n",
                           limits=f"limits:\n  header_timeout: 30\n  idle_timeout: {idle}\n  connect_timeout: 30\n")
    return start_proxy(text.replace("  connect: [", f"  connect: [{port}, "), "--confdir", str(tmp_path / "ca"),
                       "--upstream-ca", str(lab.cert_file))


@both_transports
def test_a_hello_sent_after_a_reload_that_refuses_the_host_is_refused(lab, start_proxy, mute):
    """A tunnel answered 200 whose first message has not come yet has passed nothing: its ClientHello is the
    first thing egresswall sees of it, and is judged then (README: "nothing reaches the upstream before its first
    message is whole and judged"; "A reload applies to every new connection and to every request egresswall
    sees, inside an open tunnel too"; and a CONNECT to a plain-HTTP port is re-decided by the policy in force for
    its first request). What is "not cut" is "a TLS tunnel passed through unread that is already open" — this one
    has not passed a byte. So after a reload that denies the host, the ClientHello must be refused (a TLS alert,
    a refusal record) and never reach the origin; a client that opened its CONNECT in time otherwise keeps a
    pass to a now-denied host for up to ``limits.header_timeout`` after the reload (30 s by default), and by
    dribbling its hello far longer if each read resets nothing."""
    proxy = _proxy(lab, start_proxy, mute.port)
    authority = f"{NAME}:{mute.port}"
    sock = tunnel(proxy, authority)
    with sock:
        text = proxy.policy_path.read_text().replace("hosts:", "hosts_unused:")  # (the lab policy has none)
        proxy.policy_path.write_text(text + f"hosts:\n  deny:\n    - {NAME}\n")
        proxy.signal(signal.SIGHUP)
        assert _wait(lambda: _connect_status(proxy, authority) == 403, 5), "the reload did not apply"
        sock.sendall(real_client_hello(NAME))
        answer = read_all(sock, 3)
    time.sleep(0.5)
    reached = [bytes(b) for b in mute.received if b]
    assert not reached, f"the hello reached the origin of a host the policy in force denies: {reached[0][:16]!r}"
    assert answer[:1] in (b"\x15", b""), answer[:20]
    refused = [r for r in proxy.audit() if r.get("verdict") == "refuse" and r.get("event") == "decision"
               and r.get("reason", "").startswith("since the CONNECT was answered, a policy reload refuses it")]
    assert [(r["host"], r["stage"], r["rule_id"]) for r in refused] == [(NAME, "host", f"hosts.deny:{NAME}")], \
        proxy.audit()
    (closing,) = [r for r in proxy.audit() if r["event"] == "tunnel"]
    assert closing["error"] == refused[0]["reason"], closing


@both_transports
def test_bytes_held_behind_the_hello_are_counted_as_read_on_both_paths(lab, start_proxy, hang_up):
    """A client sends its hello and, in the same write, 4000 bytes more; the origin reads the hello and closes
    without an answer, so those bytes are held and never relayed (README: "the client's bytes after its
    ClientHello wait" for the server's first answer). The origin gets the hello only; the closing line's
    ``bytes_up`` is what egresswall read from the client — hello and held bytes — the same on both transports, as
    README's audit-log paragraph says (a session is charged them: more than left, never less). A helper first
    read the README as promising the bytes sent (review round 22); README now says which."""
    proxy = _proxy(lab, start_proxy, hang_up.port)
    hello = real_client_hello(NAME)
    extra = b"\x17\x03\x03\x0f\x9b" + bytes(3995)  # an application_data record, held behind the hello
    with tunnel(proxy, f"{NAME}:{hang_up.port}") as sock:
        sock.sendall(hello + extra)
        read_all(sock, 3)
    assert hang_up.ended[-1].wait(5)
    got = bytes(hang_up.received[-1])
    assert got == hello, (len(got), len(hello))
    lines = _tunnel_lines(proxy, 5)
    assert len(lines) == 1, lines
    assert lines[0]["bytes_up"] == len(hello) + len(extra), (lines[0]["bytes_up"], len(hello), lines[0]["error"])


@both_transports
def test_a_client_that_vanishes_while_an_intercepted_origin_has_not_answered_ends_the_tunnel_in_seconds(
        lab, start_proxy, tmp_path, mute):
    """The intercepted counterpart of the first test. README: "Nor is a client read while egresswall waits on the
    origin's side of an intercepted tunnel (its TLS handshake)" and "a client that vanished mid-handshake does not
    hold it open for the idle timeout". A client sends its ClientHello for an intercepted host whose origin
    accepts and never answers, then leaves: the tunnel and its upstream connection must end within seconds, with
    one closing line, not at ``limits.idle_timeout``."""
    proxy = _intercepting_proxy(lab, start_proxy, tmp_path, mute.port)
    sock = tunnel(proxy, f"{NAME}:{mute.port}")
    sock.sendall(real_client_hello(NAME))
    assert _wait(lambda: bool(mute.received and mute.received[-1]), 5), "egresswall never began the origin's handshake"
    sock.close()
    left = time.monotonic()
    lines = _tunnel_lines(proxy, 12)
    assert lines, "no closing line 12 s after the client left: the tunnel is held open while the origin is mute"
    assert len(lines) == 1, lines
    assert mute.ended[-1].wait(2), "the origin's connection is still open"
    assert time.monotonic() - left < 13


@both_transports
def test_a_vanished_client_of_an_intercepted_tunnel_does_not_keep_its_connection_slot(lab, start_proxy, tmp_path,
                                                                                     mute):
    """The consequence of the test above for the caps. README: "A connection the front hands to mitmproxy keeps
    its slot until mitmproxy has finished with it". A client with `max_connections_per_client: 1` that sent a
    hello to an intercepted host with a mute origin and closed its socket has no connection left: 8 s later its
    next CONNECT must be admitted, not refused 429 until `limits.idle_timeout` (120 s by default) has passed."""
    text = lab.policy_text(f"hosts:\n  allow:\n    - host: {NAME}\n      intercept: true\n",
                           limits="limits:\n  header_timeout: 30\n  idle_timeout: 60\n  connect_timeout: 30\n"
                                  "  max_connections_per_client: 1\n")
    proxy = start_proxy(text.replace("  connect: [", f"  connect: [{mute.port}, "), "--confdir",
                        str(tmp_path / "ca"), "--upstream-ca", str(lab.cert_file))
    sock = tunnel(proxy, f"{NAME}:{mute.port}")
    sock.sendall(real_client_hello(NAME))
    assert _wait(lambda: bool(mute.received and mute.received[-1]), 5)
    sock.close()
    time.sleep(8)
    status = _connect_status(proxy, f"{NAME}:{lab.public_tls.port}")
    assert status == 200, f"a client with no connection open was refused {status}: its vanished tunnel holds the slot"



@both_transports
def test_a_hello_after_a_reload_that_still_allows_the_host_passes(lab, start_proxy):
    """The other side of the re-judgement: a reload that changes something else (a deny rule on another host)
    leaves a tunnel answered before it working — its ClientHello is judged again, allowed, and the TLS exchange
    with the lab's origin completes."""
    import ssl
    proxy = _proxy(lab, start_proxy, lab.public_tls.port)
    authority = f"{NAME}:{lab.public_tls.port}"
    sock = tunnel(proxy, authority)
    text = proxy.policy_path.read_text()
    proxy.policy_path.write_text(text + "hosts:\n  deny:\n    - other.lab.example\n")
    proxy.signal(signal.SIGHUP)
    assert _wait(lambda: _connect_status(proxy, f"other.lab.example:{lab.public_tls.port}") == 403, 5)
    context = ssl.create_default_context(cafile=str(lab.cert_file))
    with context.wrap_socket(sock, server_hostname=NAME) as tls:
        tls.sendall(f"GET / HTTP/1.1\r\nHost: {NAME}\r\nConnection: close\r\n\r\n".encode())
        answer = read_all(tls, 5)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
