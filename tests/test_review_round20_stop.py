"""Review round 20 (a newcomer's check): what is still open when egresswall stops is recorded.

At a stop, connections still open at the end of ``limits.tunnel_grace`` were cut by shutting mitmproxy down,
and nothing wrote their closing records: a passed-through tunnel had only its decision line (on the fast path its
record came after the audit log was closed: an AssertionError in the log), and a WebSocket, whose response record
is written when it ends (since this round), had none at all. ``Runner.stop`` now closes them itself, each is
recorded with the error ``egresswall stopped: ...`` (``gate.STOP_CUT``), and then mitmproxy is shut down.
"""

from __future__ import annotations

import socket

import pytest
from fake_upstream_proxy import client_hello
from labnet import PUBLIC_IP
from proxyproc import both_transports
from ws_echo import WsEcho
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, Message, Request

from proxy.gate import STOP_CUT

pytestmark = pytest.mark.integration

GRACE = "limits: {tunnel_grace: 1}\n"


def _stopped(proxy) -> list[dict]:
    assert proxy.stop() == 0
    assert "Traceback" not in proxy.stderr and "AssertionError" not in proxy.stderr, proxy.stderr[-3000:]
    assert "still open at the end of the grace period were closed" in proxy.stderr, proxy.stderr[-2000:]
    return [r for r in proxy.audit() if r["event"] != "decision"]


@both_transports
def test_a_websocket_open_at_a_stop_gets_its_record_with_what_it_carried(lab, start_proxy):
    echo = WsEcho(PUBLIC_IP)
    try:
        text = lab.policy_text(limits=GRACE)
        proxy = start_proxy(text.replace("  http: [", f"  http: [{echo.port}, "))
        authority = f"public.lab.example:{echo.port}"
        ws = WSConnection(ConnectionType.CLIENT)
        sock = socket.create_connection((proxy.host, proxy.port), timeout=10)
        sock.sendall(ws.send(Request(host=authority, target=f"http://{authority}/chat")))
        echoed = 0
        while echoed < 1000:
            ws.receive_data(sock.recv(1 << 20))
            for event in ws.events():
                if isinstance(event, AcceptConnection):
                    sock.sendall(ws.send(Message(data=b"x" * 1000)))
                elif isinstance(event, Message):
                    echoed += len(event.data)
        (record,) = [r for r in _stopped(proxy) if r["status"] == 101]
        sock.close()
        assert record["event"] == "response" and record["error"] == STOP_CUT, record
        assert record["bytes_up"] >= 1000 and record["bytes_down"] >= 1000, record
    finally:
        echo.close()


@both_transports
@pytest.mark.parametrize("first", ["relaying", "half-a-hello"])
def test_a_tunnel_open_at_a_stop_gets_its_record(lab, start_proxy, first):
    proxy = start_proxy(lab.policy_text(limits=GRACE))
    sock, status, _ = proxy.connect(f"public.lab.example:{lab.public_tls.port}")
    assert status == 200
    if first == "relaying":
        sock.sendall(client_hello("public.lab.example"))
        assert sock.recv(5)[:1] == b"\x16"  # the origin's ServerHello: the tunnel relays
    else:
        sock.sendall(b"\x16\x03\x01\x00\x05hel")
    (record,) = [r for r in _stopped(proxy) if r["event"] == "tunnel"]
    sock.close()
    if first == "relaying":
        assert record["error"] == STOP_CUT and record["bytes_up"] > 0 and record["bytes_down"] > 0, record
    else:  # refused or cut before it relayed: its one record, whatever it says, is written
        assert record["status"] == 200, record
