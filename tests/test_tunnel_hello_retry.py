"""A passed-through TLS tunnel whose origin sends a HelloRetryRequest, through the real proxy on both
transports: a genuine client still gets through; a second ClientHello that names another server, or
adds ECH where the policy refuses it, is refused — one record, both sides closed, the origin never sees it."""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time

import pytest
from labnet import PUBLIC_IP
from listening import stop_serving
from proxyproc import both_transports
from rawclient import read_all, tunnel
from retry_origin import RetryOrigin
from tls_build import ECH, client_hello, extension
from tls_flights import first_hello, is_hello_retry

from proxy.tls_retry import COMPAT_CHANGE_CIPHER_SPEC

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("internal_saw_nothing")]
NAME = "public.lab.example"


@pytest.fixture
def origin(tmp_path):
    server = RetryOrigin(tmp_path)
    yield server
    server.close()


def _policy(lab, extra: str = "") -> str:
    text = lab.policy_text(extra)
    return text.replace(f"  connect: {sorted({443, lab.public_tls.port})}", "  connect: [443, '1024-65535']")


def _records_with(proxy, rule: str, want: int = 1, wait: float = 10) -> list[dict]:
    deadline = time.monotonic() + wait
    while True:
        found = [r for r in proxy.audit() if r.get("rule") == rule]
        if len(found) >= want or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def _read_record(sock: socket.socket) -> bytes:
    data = b""
    while len(data) < 5 or len(data) < 5 + int.from_bytes(data[3:5], "big"):
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    return data


class RawClient:
    """Python's TLS client over memory BIOs: its flights are sent by hand, and can be swapped for others."""

    def __init__(self, cafile) -> None:
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = ssl.create_default_context(cafile=str(cafile)).wrap_bio(self.incoming, self.outgoing,
                                                                           server_hostname=NAME)

    def flight(self, answer: bytes = b"") -> bytes:
        self.incoming.write(answer)
        with contextlib.suppress(ssl.SSLWantReadError):
            self.tls.do_handshake()
        return self.outgoing.read()


def _ask_again(proxy, origin: RetryOrigin) -> tuple[socket.socket, bytes, RawClient]:
    """A raw client's genuine first ClientHello (X25519 first) through the proxy, and the origin's
    HelloRetryRequest back."""
    client = RawClient(origin.cert_file)
    sock = tunnel(proxy, f"{NAME}:{origin.port}")
    sock.sendall(client.flight())
    retry = _read_record(sock)
    assert is_hello_retry(retry), retry[:48]
    return sock, retry, client


@both_transports
def test_a_genuine_client_the_origin_asks_again_still_gets_through(lab, start_proxy, origin):
    proxy = start_proxy(_policy(lab))
    context = ssl.create_default_context(cafile=str(origin.cert_file))  # X25519 first: the origin asks again
    with tunnel(proxy, f"{NAME}:{origin.port}") as sock, context.wrap_socket(sock, server_hostname=NAME) as tls:
        tls.sendall(b"hi\n")
        answer = tls.recv(4096)
    assert answer == f"hello {NAME}\n".encode()
    (connection,) = origin.connections
    assert connection.sent_hello_retry, "the origin did not send a HelloRetryRequest: the test proves nothing"
    assert connection.completed and connection.names[-1] == NAME
    assert not [r for r in proxy.audit() if r["verdict"] == "refuse"], proxy.audit()


@both_transports
def test_the_genuine_second_hello_sent_by_hand_reaches_the_origin(lab, start_proxy, origin):
    """The raw harness of the next tests, with the client's own second ClientHello: the origin answers it."""
    proxy = start_proxy(_policy(lab))
    sock, retry, client = _ask_again(proxy, origin)
    with sock:
        sock.sendall(client.flight(retry))
        answer = _read_record(sock)
    assert answer[:1] == b"\x16" and not is_hello_retry(answer)  # the origin's ServerHello
    assert origin.connections[0].names == [NAME, NAME]


@both_transports
def test_a_second_hello_naming_another_server_is_refused_and_never_reaches_the_origin(lab, start_proxy, origin):
    proxy = start_proxy(_policy(lab))
    sock, _, _ = _ask_again(proxy, origin)
    # What a client would send to reach another server behind the same address: a second ClientHello for it,
    # with the group the origin asked for, so the origin would take it.
    other = first_hello("other.lab.example", "secp384r1")
    with sock:
        sock.sendall(COMPAT_CHANGE_CIPHER_SPEC + other)
        answer = read_all(sock)
    assert answer[:1] in (b"\x15", b""), answer[:20]  # a TLS alert (or the end), never the origin's answer
    refusals = _records_with(proxy, "tls:retry-hello-changed")
    assert len(refusals) == 1, proxy.audit()
    record = refusals[0]
    assert record["verdict"] == "refuse" and record["host"] == NAME
    assert "other.lab.example" in record["reason"] and NAME in record["reason"]
    (connection,) = origin.connections
    assert connection.ended.wait(5), "the origin's side of the tunnel was not closed"
    assert b"other.lab.example" not in connection.received and "other.lab.example" not in connection.names
    assert not connection.completed


@both_transports
def test_a_second_hello_that_adds_ech_where_the_policy_refuses_it_is_refused(lab, start_proxy, origin):
    proxy = start_proxy(_policy(lab, "hosts:\n  deny:\n    - denied.lab.example\n"))  # ECH unset: refused here
    sock, _, _ = _ask_again(proxy, origin)
    with sock:
        sock.sendall(COMPAT_CHANGE_CIPHER_SPEC + client_hello(NAME.encode(), extra=(extension(ECH, bytes(48)),)))
        answer = read_all(sock)
    assert answer[:1] in (b"\x15", b""), answer[:20]
    refusals = _records_with(proxy, "tls:ech")
    assert len(refusals) == 1 and "second ClientHello" in refusals[0]["reason"], proxy.audit()
    (connection,) = origin.connections
    assert connection.ended.wait(5) and not connection.completed and connection.names == [NAME]


@both_transports
def test_a_client_that_sends_no_second_hello_is_cut_at_the_header_timeout(lab, start_proxy, origin):
    proxy = start_proxy(_policy(lab, "limits:\n  header_timeout: 1\n"))
    sock, _, _ = _ask_again(proxy, origin)
    started = time.monotonic()
    with sock:
        sock.sendall(COMPAT_CHANGE_CIPHER_SPEC)  # and then nothing
        read_all(sock)
    assert time.monotonic() - started < 8
    refusals = _records_with(proxy, "limits.header_timeout")
    assert len(refusals) == 1 and "second ClientHello" in refusals[0]["reason"], proxy.audit()


@pytest.fixture
def unreadable_origin():
    """An origin that answers any ClientHello with a handshake record that cannot be read (length 0)."""
    server = socket.create_server((PUBLIC_IP, 0))

    def serve() -> None:
        with contextlib.suppress(OSError):
            conn, _ = server.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(b"\x16\x03\x03\x00\x00" + b"\x02" * 40)
                conn.recv(65536)  # until the proxy closes

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop_serving(server, thread)


@both_transports
def test_a_server_answer_that_cannot_be_read_as_tls_refuses_the_tunnel(lab, start_proxy, unreadable_origin):
    proxy = start_proxy(_policy(lab))
    with tunnel(proxy, f"{NAME}:{unreadable_origin}") as sock:
        sock.sendall(first_hello(NAME))
        answer = read_all(sock)
    assert answer[:1] in (b"\x15", b""), answer[:20]  # never the server's bytes
    refusals = _records_with(proxy, "tls:server-hello")
    assert len(refusals) == 1 and "length 0" in refusals[0]["reason"], proxy.audit()
