"""Review round 19 (h3): ClientHello shapes a domain-fronting client might try, through the real proxy on
both transports, against a real TLS origin that records every ClientHello name it processed and every byte
it got. Whatever the shape: either the tunnel is refused (a TLS alert, one tls:* refusal record, and the
origin never sees the other name), or the origin never processes a hello naming another host."""

from __future__ import annotations

import struct
import time

import pytest
from labnet import self_signed
from proxyproc import TRANSPORTS
from rawclient import read_all, tunnel
from retry_origin import RetryOrigin
from tls_build import client_hello, extension, server_name_body
from tls_flights import NAMES, first_hello

from proxy.tls_retry import COMPAT_CHANGE_CIPHER_SPEC

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("internal_saw_nothing")]
NAME, OTHER = NAMES  # public.lab.example, other.lab.example: the same address


class PlainOrigin(RetryOrigin):
    """RetryOrigin's recording, with a server that accepts X25519 (no HelloRetryRequest)."""

    def __init__(self, directory) -> None:
        super().__init__(directory)
        self.context, self.cert_file = self_signed(NAMES, str(directory))
        self.context.sni_callback = self._named


@pytest.fixture(scope="module")
def origins(tmp_path_factory):
    plain = PlainOrigin(tmp_path_factory.mktemp("plain"))
    retry = RetryOrigin(tmp_path_factory.mktemp("retry"))
    yield plain, retry
    plain.close()
    retry.close()


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def proxy(lab, origins, tmp_path_factory, request):
    from proxyproc import ProxyProcess

    plain, retry = origins
    text = lab.policy_text("hosts:\n  deny:\n    - denied.lab.example\n",  # a deny rule: ECH is refused
                           limits="limits:\n  header_timeout: 2\n")
    text = text.replace("  connect: [", f"  connect: [{plain.port}, {retry.port}, ")
    directory = tmp_path_factory.mktemp(f"proxy-{request.param}")
    policy = directory / "policy.yaml"
    policy.write_text(text)
    process = ProxyProcess(["--policy", str(policy), *TRANSPORTS[request.param]], directory / "audit.jsonl")
    yield process
    process.stop()


def record(kind: int, payload: bytes, version: bytes = b"\x03\x01") -> bytes:
    return bytes([kind]) + version + struct.pack("!H", len(payload)) + payload


def handshake_of(hello_records: bytes) -> bytes:
    """The handshake bytes inside a one-record ClientHello made by tls_build."""
    return hello_records[5:]


def _records(proxy, since: int, rule_prefix: str = "tls:", wait: float = 6) -> list[dict]:
    deadline = time.monotonic() + wait
    while True:
        found = [r for r in proxy.audit()[since:] if r.get("verdict") == "refuse"
                 and str(r.get("rule", "")).startswith(rule_prefix)]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def _send(proxy, origin, pieces: list[bytes], pause: float = 0.2) -> bytes:
    with tunnel(proxy, f"{NAME}:{origin.port}") as sock:
        for piece in pieces:
            try:
                sock.sendall(piece)
            except (BrokenPipeError, ConnectionResetError):
                break  # the proxy closed the tunnel already
            time.sleep(pause)
        return read_all(sock, 6)


def _origin_never_saw_other(origin, before: int) -> None:
    for connection in origin.connections[before:]:
        connection.ended.wait(5)
        assert OTHER not in connection.names, connection.names
        assert OTHER.encode() not in bytes(connection.received), bytes(connection.received)[:200]


OTHER_HELLO = client_hello(OTHER.encode())
NAME_HELLO = client_hello(NAME.encode())
OTHER_HS = handshake_of(OTHER_HELLO)

REFUSED = {
    # record-layer fragmentation: a 1-byte first record, then the rest
    "one-byte-first-record": [record(22, OTHER_HS[:1]) + record(22, OTHER_HS[1:])],
    "one-byte-records-dripped": [record(22, OTHER_HS[i:i + 1]) for i in range(0, 12)]
                                + [record(22, OTHER_HS[12:])],
    "zero-length-record-first": [record(22, b"") + OTHER_HELLO],
    "alert-first": [record(21, b"\x01\x00") + OTHER_HELLO],
    "ccs-first": [record(20, b"\x01") + OTHER_HELLO],
    "appdata-first": [record(23, b"x") + OTHER_HELLO],
    "sslv2-compat": [bytes([0x80, 0x2e, 0x01, 0x03, 0x01]) + bytes(41)],
    "ssl3-record-version": [record(22, OTHER_HS, b"\x03\x00")],
    "tls13-record-version": [record(22, OTHER_HS, b"\x03\x04")],
    "two-hellos-one-record": [record(22, handshake_of(NAME_HELLO) + OTHER_HS)],
    "hello-then-finished-one-record": [record(22, handshake_of(NAME_HELLO) + b"\x14\x00\x00\x0c" + bytes(12))],
    "trailing-dot": [client_hello(OTHER.encode() + b".")],
    "upper-other": [client_hello(OTHER.upper().encode())],
    "nul-in-name": [client_hello(NAME.encode() + b"\x00" + OTHER.encode())],
    "empty-name": [client_hello(sni_body=server_name_body(b""))],
    "u-label": [client_hello("püblic.lab.example".encode())],
    "ip-literal": [client_hello(b"127.0.0.2")],
    "too-long": [client_hello(b"a." * 130 + b"example")],
    "two-sni-extensions": [client_hello(NAME.encode(), extra=(extension(0, server_name_body(OTHER.encode())),))],
    "ech": [client_hello(NAME.encode(), extra=(extension(0xFE0D, bytes(48)),))],
    "ech-draft": [client_hello(NAME.encode(), extra=(extension(0xFE0A, bytes(48)),))],
    "esni-no-sni": [client_hello(None, extra=(extension(0xFFCE, bytes(48)),))],
    "sni-after-psk": [client_hello(None, extra=(extension(41, b"\x00\x00\x00\x00"),
                                                extension(0, server_name_body(OTHER.encode()))))],
    "retry-second-before-hrr": None,  # built per origin (a real first hello)
}


@pytest.mark.parametrize("shape", list(REFUSED))
def test_a_fronting_hello_shape_is_refused_with_a_record_and_never_reaches_the_origin(proxy, origins, shape):
    plain, retry = origins
    origin = retry if shape == "retry-second-before-hrr" else plain
    pieces = REFUSED[shape]
    if pieces is None:  # the second ClientHello, for another name, sent with the first, before the HRR
        pieces = [first_hello(NAME) + COMPAT_CHANGE_CIPHER_SPEC + first_hello(OTHER, "secp384r1")]
    since, before = len(proxy.audit()), len(origin.connections)
    answer = _send(proxy, origin, pieces, pause=0.05)
    assert answer[:1] in (b"\x15", b""), answer[:40]  # a TLS alert or the end, never the origin's answer
    assert _records(proxy, since), proxy.audit()[since:]
    _origin_never_saw_other(origin, before)


@pytest.mark.parametrize("shape", ["two-hellos-two-records", "two-hellos-two-writes", "hello-then-appdata-other"])
def test_a_second_hello_after_a_judged_one_is_never_processed_for_another_name(proxy, origins, shape):
    plain, _ = origins
    first = first_hello(NAME)
    pieces = {"two-hellos-two-records": [first + first_hello(OTHER)],
              "two-hellos-two-writes": [first, first_hello(OTHER)],
              "hello-then-appdata-other": [first, record(23, b"GET / HTTP/1.1\r\nHost: other\r\n\r\n", b"\x03\x03")],
              }[shape]
    before = len(plain.connections)
    _send(proxy, plain, pieces)
    for connection in plain.connections[before:]:
        connection.ended.wait(5)
        assert OTHER not in connection.names, connection.names
        assert not connection.completed


def test_upper_case_sni_of_the_connect_host_passes(proxy, origins):
    plain, _ = origins
    since, before = len(proxy.audit()), len(plain.connections)
    _send(proxy, plain, [client_hello(NAME.upper().encode())])
    assert not _records(proxy, since, wait=1)
    (connection,) = plain.connections[before:]
    connection.ended.wait(5)
    assert [n.lower() for n in connection.names] == [NAME]
