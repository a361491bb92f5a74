"""Review round 18: a client holding a session moved data past what the session allows (each test failed
before its fix; the fixes are named after each finding).

1. A WebSocket opened under a session with byte budgets starts with an allowance of the *whole* budget, and
   its first look at the store was a background task (``Gate._watch_session`` with ``first_look=True``, from
   ``Gate.websocket_opened``): with the Redis store, a message sent at once after the 101 (or pipelined
   behind the handshake) is relayed against the whole budget, not what is left. One worker passes
   ``request_bytes`` by up to the whole budget (README: only N - 1 workers may pass it, by what was left).
   Fixed: ``Gate.websocket_opened`` awaits that first look, and ``WebSocketWatch.websocket_start`` awaits it,
   before mitmproxy's layer relays anything.
2. A WebSocket's close frame (code and a reason of up to 123 bytes) is relayed to the origin by mitmproxy's
   layer and never charged nor taken from the allowance (only messages, pings and pongs are): every open
   WebSocket carries 125 more bytes out after the session's request_bytes budget is used up. Fixed: a close's
   code and reason are counted and taken like a ping's (``mitm_patches._control_bytes_taken``); past the
   budget egresswall's own code (1008, no reason) stands in for them.
3. A session's budgets are judged after the name is resolved (``Gate.decide_request``/``decide_connect``:
   ``_session_first`` → ``decide`` → ``_session_charge``): a session refused ``session:budget-requests``,
   ``-hosts`` or ``-request-bytes`` still makes the proxy look up every name its host patterns match, so a
   wildcard grant sends any number of client-chosen labels (63 bytes each) to DNS past every budget. Fixed:
   ``Gate._session_first`` asks the store whether one more request fits (``SessionStore.judge``, nothing
   counted) before the policy decides; the charge after the decision still counts atomically.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import uuid

import pytest
from dnslab import Record
from labnet import PUBLIC_IP
from proxyproc import both_transports
from session_client import api, create, token_file
from session_client import connect as session_connect
from test_sessions_redis import RedisServer
from ws_echo import WsEcho
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Message, Request

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("internal_saw_nothing")]


def _usage(proxy, session) -> dict:
    return api(proxy.admin_port, "GET", f"/v1/sessions/{session['id']}")[2]["usage"]


def _masked_frame(payload: bytes, opcode: int = 0x2) -> bytes:
    key = os.urandom(4)
    n = len(payload)
    size = bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big")
    return bytes([0x80 | opcode]) + size + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))


# ---- 1. a WebSocket's first message is taken from the whole budget (Redis store) -------------------------

def _message_at_once(proxy, lab, echo, pipelined: bool, budget: int) -> tuple[int, dict]:
    """A fresh session with under 1000 of ``budget`` request bytes left opens a WebSocket and sends a 9000-byte
    message at once: (its bytes the origin echoed, the session's usage after)."""
    session = create(proxy.admin_port, {"hosts": ["public.lab.example"]}, budgets={"request_bytes": budget})
    status, _, _ = proxy.get(f"http://public.lab.example:{lab.public.port}/upload", {
        "Proxy-Authorization": session["proxy_authorization"]}, method="POST", body=b"x" * 9000)
    assert status == 200
    time.sleep(0.3)
    assert _usage(proxy, session)["request_bytes"] > 9000  # under 1000 bytes left
    authority = f"public.lab.example:{echo.port}"
    ws = WSConnection(ConnectionType.CLIENT)
    handshake = ws.send(Request(host=authority, target=f"http://{authority}/chat", extra_headers=[
        (b"Proxy-Authorization", session["proxy_authorization"].encode())]))
    payload = b"E" * 9000  # nine times what is left
    with socket.create_connection((proxy.host, proxy.port), timeout=2) as sock:
        sock.sendall(handshake + (_masked_frame(payload) if pipelined else b""))
        data = b""
        try:
            while b"\r\n\r\n" not in data:
                data += sock.recv(65536)
            assert data.startswith(b"HTTP/1.1 101"), data[:200]
            if not pipelined:
                sock.sendall(_masked_frame(payload))
            while data.count(b"E") < len(payload):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    time.sleep(1.2)
    return data.partition(b"\r\n\r\n")[2].count(b"E"), _usage(proxy, session)


@both_transports
@pytest.mark.parametrize("pipelined", [False, True], ids=["after-the-101", "behind-the-handshake"])
def test_a_websocket_message_sent_at_once_is_held_to_what_is_left(lab, start_proxy, tmp_path, pipelined):
    """A race (the first look's store round trips against mitmproxy relaying the message): tried up to 8 times;
    one message that gets through fails it (measured: about half of the tries get through)."""
    echo, redis = WsEcho(PUBLIC_IP), RedisServer(tmp_path)
    try:
        text = lab.policy_text("session: required\n").replace("  http: [", f"  http: [{echo.port}, ")
        proxy = start_proxy(text, "--admin-token-file", str(token_file(tmp_path)), "--session-store", redis.url)
        budget = 10000
        for attempt in range(8):
            echoed, usage = _message_at_once(proxy, lab, echo, pipelined, budget)
            assert echoed == 0, (f"try {attempt + 1}: a 9000-byte message reached the origin with under 1000 bytes "
                                 f"of a {budget}-byte request_bytes budget left: usage {usage}")
    finally:
        echo.close()
        redis.stop()


# ---- 2. close frames are relayed uncounted -----------------------------------------------------------------

class _CloseRecorder(WsEcho):
    """An origin that answers each message with b"ok" and records the reason of each close it gets."""

    def __init__(self, host: str) -> None:
        self.reasons: list[str] = []
        super().__init__(host)

    def serve(self, conn: socket.socket) -> None:
        ws = WSConnection(ConnectionType.SERVER)
        with conn:
            try:
                while True:
                    data = conn.recv(65536)
                    ws.receive_data(data or None)
                    for event in ws.events():
                        if isinstance(event, Request):
                            conn.sendall(ws.send(AcceptConnection()))
                        elif isinstance(event, Message):
                            conn.sendall(ws.send(Message(data=b"ok")))
                        elif isinstance(event, CloseConnection):
                            self.reasons.append(event.reason or "")
                            conn.sendall(ws.send(event.response()))
                            return
                    if not data:
                        return
            except Exception:  # noqa: BLE001 - a lab origin: a cut connection ends its thread quietly
                return


@both_transports
def test_close_frames_are_held_to_the_request_bytes_budget(lab, start_proxy, tmp_path):
    origin = _CloseRecorder(PUBLIC_IP)
    try:
        text = lab.policy_text("session: required\n").replace("  http: [", f"  http: [{origin.port}, ")
        proxy = start_proxy(text, "--admin-token-file", str(token_file(tmp_path)))
        budget = 3000
        session = create(proxy.admin_port, {"hosts": ["public.lab.example"]}, budgets={"request_bytes": budget})
        authority = f"public.lab.example:{origin.port}"
        clients = []
        for _ in range(3):
            ws = WSConnection(ConnectionType.CLIENT)
            sock = socket.create_connection((proxy.host, proxy.port), timeout=5)
            sock.sendall(ws.send(Request(host=authority, target=f"http://{authority}/chat", extra_headers=[
                (b"Proxy-Authorization", session["proxy_authorization"].encode())])))
            ws.receive_data(sock.recv(65536))
            assert any(isinstance(e, AcceptConnection) for e in ws.events())
            clients.append((ws, sock))
        time.sleep(2.5)  # the sweep has read the store: the allowance is what is left
        left = budget - _usage(proxy, session)["request_bytes"]
        ws, sock = clients[0]
        sock.sendall(ws.send(Message(data=b"F" * left)))  # the budget, used exactly
        time.sleep(0.5)
        for ws, sock in clients:
            with contextlib.suppress(OSError):
                sock.sendall(ws.send(CloseConnection(code=1000, reason="R" * 123)))
        time.sleep(2.5)
        for _, sock in clients:
            sock.close()
        past = sum(len(r) for r in origin.reasons if r.startswith("R"))
        assert past == 0, (f"{past} bytes of close reasons reached the origin after the session's {budget}-byte "
                           f"request_bytes budget was used up (usage {_usage(proxy, session)})")
    finally:
        origin.close()


# ---- 3. names looked up past the budgets -------------------------------------------------------------------

@both_transports
@pytest.mark.parametrize("budget", ["requests", "hosts", "request_bytes"])
def test_a_request_refused_for_a_budget_looks_no_name_up(lab, start_proxy, tmp_path, budget):
    text = lab.policy_text("session: required\n")
    proxy = start_proxy(text, "--admin-token-file", str(token_file(tmp_path)))
    session = create(proxy.admin_port, {"hosts": ["*.lab.example"]},
                     budgets={budget: 300 if budget == "request_bytes" else 1})
    status, _, _ = proxy.get(f"http://public.lab.example:{lab.public.port}/first", {
        "Proxy-Authorization": session["proxy_authorization"]})
    assert status == 200
    if budget == "request_bytes":  # used up whole
        status, _, _ = proxy.get(f"http://public.lab.example:{lab.public.port}/" + "a" * 200, {
            "Proxy-Authorization": session["proxy_authorization"]})
    leaked = []
    for i in range(3):
        name = f"conversation-part-{i}-{uuid.uuid4().hex[:8]}.lab.example"  # what a refused request carries
        lab.dns.set(name, [Record("A", PUBLIC_IP)])
        status, headers, _ = proxy.get(f"http://{name}:{lab.public.port}/x", {
            "Proxy-Authorization": session["proxy_authorization"]})
        assert status == 403 and headers["x-egresswall-rule"].startswith("session:budget-"), (status, headers)
        if lab.dns.queried(name):
            leaked.append(name)
    assert not leaked, (f"names looked up for requests refused {headers['x-egresswall-rule']}: {leaked}")


@both_transports
def test_a_connect_refused_for_a_budget_looks_no_name_up(lab, start_proxy, tmp_path):
    proxy = start_proxy(lab.policy_text("session: required\n"), "--admin-token-file", str(token_file(tmp_path)))
    session = create(proxy.admin_port, {"hosts": ["*.lab.example"]}, budgets={"requests": 1})
    assert proxy.get(f"http://public.lab.example:{lab.public.port}/first", {
        "Proxy-Authorization": session["proxy_authorization"]})[0] == 200
    name = f"conversation-{uuid.uuid4().hex[:8]}.lab.example"
    lab.dns.set(name, [Record("A", PUBLIC_IP)])
    sock, status, headers, _ = session_connect(proxy, f"{name}:{lab.public_tls.port}", session)
    sock.close()
    assert (status, headers.get("x-egresswall-rule")) == (403, "session:budget-requests")
    assert not lab.dns.queried(name), f"{name} was looked up for a CONNECT refused session:budget-requests"
