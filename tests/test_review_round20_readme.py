"""Review round 20 (a newcomer's check of the round's README sentences, against the running proxy on loopback):
what held. The two defects it found are in test_review_round20_stop.py and
test_review_round20_upstream_answer_words.py."""

from __future__ import annotations

import socket

import pytest
from fake_upstream_proxy import FakeUpstream, creds_file, upstream_policy
from proxyproc import both_transports
from rawclient import read_head
from test_review_round20_websockets import RawOrigin, _handshake, _ws_origin
from ws_client import proxy_for_port
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, Message, Request

pytestmark = pytest.mark.integration


def _open_ws(proxy, port):
    authority = f"public.lab.example:{port}"
    ws = WSConnection(ConnectionType.CLIENT)
    sock = socket.create_connection((proxy.host, proxy.port), timeout=10)
    sock.sendall(ws.send(Request(host=authority, target=f"http://{authority}/chat")))
    got, sent = 0, False
    while got < 1000:
        ws.receive_data(sock.recv(1 << 20))
        for event in ws.events():
            if isinstance(event, AcceptConnection) and not sent:
                sock.sendall(ws.send(Message(data=b"x" * 1000)))
                sent = True
            elif isinstance(event, Message):
                got += len(event.data)
    return sock


@both_transports
@pytest.mark.parametrize(("name", "extra"), [
    ("content-length-0", "Content-Length: 0\r\n"),
    ("version-twice", "Sec-WebSocket-Version: 13\r\n"),
    ("version-list", None),
])
def test_handshake_shapes(lab, start_proxy, name, extra):
    """What the README's 'a GET without a body carrying one Sec-WebSocket-Version: 13' means at the edges."""
    origin = RawOrigin(_ws_origin(hold=1))
    proxy = proxy_for_port(lab, start_proxy, origin.port)
    if extra is None:
        authority = f"public.lab.example:{origin.port}"
        sock = socket.create_connection((proxy.host, proxy.port), timeout=10)
        sock.sendall(f"GET http://{authority}/chat HTTP/1.1\r\nHost: {authority}\r\nUpgrade: websocket\r\n"
                     "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                     "Sec-WebSocket-Version: 13, 8\r\n\r\n".encode())
    else:
        sock = _handshake(proxy, origin.port, "absolute-form", extra=extra)
    head = read_head(sock)
    sock.close()
    assert head.startswith(b"HTTP/1.1 101") or b"websocket-handshake" in head, head


@both_transports
def test_head_upgrade_is_refused(lab, start_proxy):
    origin = RawOrigin(_ws_origin(hold=1))
    proxy = proxy_for_port(lab, start_proxy, origin.port)
    sock = _handshake(proxy, origin.port, "absolute-form", method="HEAD")
    head = read_head(sock)
    sock.close()
    assert head.startswith(b"HTTP/1.1 400") and b"websocket-handshake" in head, head


@both_transports
def test_a_plain_407_loses_proxy_authenticate(lab, start_proxy, tmp_path):
    answer = (b"HTTP/1.1 407 Proxy Authentication Required\r\nProxy-Authenticate: Basic realm=corp\r\n"
              b"Content-Length: 0\r\n\r\n")
    up = FakeUpstream(lambda head, inside: answer)
    try:
        proxy = start_proxy(upstream_policy(lab, up, creds=creds_file(tmp_path)))
        status, headers, _ = proxy.get(f"http://public.lab.example:{lab.public.port}/x")
        assert status == 407, (status, headers)
        assert "proxy-authenticate" not in {k.lower() for k in headers}, headers
    finally:
        up.close()


@both_transports
def test_proxy_authorization_underscore_never_reaches_an_origin(lab, start_proxy):
    """README forwarding hygiene: Proxy_Authorization is stripped as Proxy-Authorization, with no upstream too."""
    proxy = start_proxy(lab.policy_text())
    before = len(lab.public.requests)
    status, _, body = proxy.get(f"http://public.lab.example:{lab.public.port}/pa",
                                headers={"Proxy_Authorization": "Basic c2VjcmV0OnNlY3JldA=="})
    seen = lab.public.requests[before:]
    print("PA", status, seen)
    assert all("secret" not in str(h) and "c2VjcmV0" not in str(h) for h in seen), seen
