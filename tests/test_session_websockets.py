"""An allowed WebSocket opened under a session is held to the session after its 101.

The handshake is a request, checked against the session and charged; the messages after it are not. Before
this, a WebSocket opened under a session ran on after the session was ended or expired, and its message bytes
were never charged to the session's byte budgets (README, Sessions). The gate's sweep now watches it as it
watches a passed-through tunnel (``proxy/addons/websocket_watch.py``): its bytes are charged every
``SESSION_SWEEP`` seconds, and it is closed, with a refusal line naming the session rule, once the session is
over or past a byte budget. WebSockets ride mitmproxy's path on both transports (the fast path hands every
upgrade over), so both are run.
"""

from __future__ import annotations

import contextlib
import socket
import time

import pytest
from audit_watch import tree_kib
from labnet import PUBLIC_IP
from proxyproc import both_transports
from session_client import api, connect, create, token_file
from ws_echo import WsEcho
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Message, Ping, Request
from wsproto.extensions import PerMessageDeflate

from proxy.gate import SESSION_SWEEP
from proxy.head_reader import LINGER_BYTES

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("internal_saw_nothing")]


@pytest.fixture
def echo():
    server = WsEcho(PUBLIC_IP)
    yield server
    server.close()


class Client:
    """A WebSocket client through the proxy (absolute-form handshake with the session's credentials)."""

    def __init__(self, proxy, echo: WsEcho, session: dict, tunnel: bool = False, deflate: bool = False) -> None:
        self.ws = WSConnection(ConnectionType.CLIENT)
        extensions = [PerMessageDeflate()] if deflate else []
        authority = f"public.lab.example:{echo.port}"
        credentials = [(b"Proxy-Authorization", session["proxy_authorization"].encode())]
        if tunnel:  # as Chromium sends ws:// through a proxy: a CONNECT, then the handshake in origin form
            self.sock, status, _, body = connect(proxy, authority, session)
            assert status == 200, body
            request = Request(host=authority, target="/chat", extensions=extensions)
        else:
            self.sock = socket.create_connection((proxy.host, proxy.port), timeout=10)
            request = Request(host=authority, target=f"http://{authority}/chat", extra_headers=credentials,
                              extensions=extensions)
        self.sock.sendall(self.ws.send(request))
        self.accepted = self._next()
        assert isinstance(self.accepted, AcceptConnection)

    def _next(self):
        while True:
            for event in self.ws.events():
                return event
            data = self.sock.recv(65536)
            self.ws.receive_data(data or None)
            if not data:
                return None

    def echo(self, data: bytes) -> bytes:
        self.sock.sendall(self.ws.send(Message(data=data)))
        got = b""
        while len(got) < len(data):
            event = self._next()
            assert isinstance(event, Message), event
            got += event.data
        return got

    def closed_within(self, seconds: float) -> bool:
        self.sock.settimeout(seconds)
        try:
            event = self._next()
        except TimeoutError:
            return False
        except OSError:
            return True
        return event is None or isinstance(event, CloseConnection)


def _start(lab, start_proxy, tmp_path, echo: WsEcho, tunnel: bool = False, limits: str = "", deflate: bool = False,
           **spec):
    text = lab.policy_text("session: required\n", limits=limits).replace("  http: [", f"  http: [{echo.port}, ")
    text = text.replace("  connect: [", f"  connect: [{echo.port}, ")
    proxy = start_proxy(text, "--admin-token-file", str(token_file(tmp_path)))
    session = create(proxy.admin_port, {"hosts": ["public.lab.example"]}, **spec)
    client = Client(proxy, echo, session, tunnel, deflate)
    assert client.echo(b"hello") == b"hello"
    assert not client.closed_within(SESSION_SWEEP * 2)  # the session holds: open
    return proxy, session, client


def _cut_line(proxy, session) -> dict:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        lines = [r for r in proxy.audit() if r.get("session") == session["id"] and r["id"].endswith("-ws")]
        if lines:
            return lines[0]
        time.sleep(0.1)
    raise AssertionError(proxy.audit())


@both_transports
@pytest.mark.parametrize("tunnel", [False, True], ids=["absolute-form", "in-a-connect"])
def test_ending_a_session_closes_its_open_websocket(lab, start_proxy, tmp_path, echo, tunnel):
    proxy, session, client = _start(lab, start_proxy, tmp_path, echo, tunnel)
    assert api(proxy.admin_port, "DELETE", f"/v1/sessions/{session['id']}")[0] in (200, 204)
    assert client.closed_within(SESSION_SWEEP * 3 + 1), "the WebSocket outlived its session"
    line = _cut_line(proxy, session)
    assert (line["verdict"], line["rule"], line["host"]) == ("refuse", "session:ended", "public.lab.example"), line
    assert "closed the WebSocket" in line["reason"], line


def _echoed(client: Client, data: bytes) -> bool:
    """``data`` sent and echoed whole (True), or the WebSocket closed before the echo came (False)."""
    client.sock.sendall(client.ws.send(Message(data=data)))
    got = b""
    while len(got) < len(data):
        event = client._next()
        if not isinstance(event, Message):
            return False
        got += event.data
    return got == data


@both_transports
@pytest.mark.parametrize("tunnel", [False, True], ids=["absolute-form", "in-a-connect"])
def test_a_websocket_never_relays_past_its_response_bytes_budget(lab, start_proxy, tmp_path, echo, tunnel):
    """Echoes of 30,000 bytes under a response_bytes budget of 100,000: the echo that would pass it is not relayed
    and the WebSocket is closed (before, the sweep closed it a second later, past the budget)."""
    proxy, session, client = _start(lab, start_proxy, tmp_path, echo, tunnel, budgets={"response_bytes": 100_000})
    echoes = 0
    while echoes < 6 and _echoed(client, b"e" * 30_000):
        echoes += 1
    assert echoes == 3, f"{echoes} echoes of 30,000 bytes came back under a budget of 100,000"
    line = _cut_line(proxy, session)
    assert line["rule"] == "session:budget-response-bytes" and "would have received" in line["reason"], line
    deadline = time.monotonic() + 5
    while True:  # the close's charge lands just after its line
        status, _, view = api(proxy.admin_port, "GET", f"/v1/sessions/{session['id']}")
        assert status == 200, view
        if view["usage"]["request_bytes"] >= 120_000 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert 90_000 <= view["usage"]["response_bytes"] <= 100_000, view
    assert view["usage"]["request_bytes"] >= 120_000, view  # the client's four messages are charged too


def _limit_line(proxy) -> dict:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        lines = [r for r in proxy.audit() if r.get("rule") == "limits.max_websocket_message"]
        if lines:
            return lines[0]
        time.sleep(0.1)
    raise AssertionError(proxy.audit())


LIMIT = "limits:\n  max_websocket_message: 1000000\n"


@both_transports
def test_a_websocket_message_over_the_limit_ends_the_websocket(lab, start_proxy, tmp_path, echo):
    """mitmproxy holds a message whole (every fragment) before relaying it: one endless fragmented message held
    without limit filled the worker's memory. Past limits.max_websocket_message the client gets close 1009 and
    the WebSocket ends, with a refusal line; the origin never gets the message."""
    proxy, session, client = _start(lab, start_proxy, tmp_path, echo, limits=LIMIT)
    assert len(client.echo(b"x" * 900_000)) == 900_000  # under the limit: relayed
    before = tree_kib(proxy.process.pid)
    sent = 0
    with contextlib.suppress(OSError):
        while sent < 50_000_000:
            client.sock.sendall(client.ws.send(Message(data=b"f" * 65536, message_finished=False)))
            sent += 65536
    # Past the limit the proxy closes: lingering, it reads and drops up to LINGER_BYTES more before the socket goes.
    assert sent < 10_000_000 + LINGER_BYTES, "the proxy kept reading one endless message"
    client.sock.settimeout(5)
    closed = None
    with contextlib.suppress(OSError):
        closed = client._next()
    assert closed is None or (isinstance(closed, CloseConnection) and closed.code == 1009), closed
    assert (tree_kib(proxy.process.pid) - before) // 1024 < 20
    line = _limit_line(proxy)
    assert line["verdict"] == "refuse" and line["host"] == "public.lab.example" and "1000000 bytes" in line["reason"]
    assert line["session"] == session["id"]


@both_transports
def test_an_origin_s_message_over_the_limit_ends_the_websocket(lab, start_proxy, tmp_path, echo):
    proxy, _, client = _start(lab, start_proxy, tmp_path, echo, limits=LIMIT)
    client.sock.sendall(client.ws.send(Message(data=b"big:5000000")))
    got = 0
    client.sock.settimeout(10)
    while True:
        event = client._next()
        if not isinstance(event, Message):
            break
        got += len(event.data)
    assert got == 0 and (event is None or (isinstance(event, CloseConnection) and event.code == 1009)), (got, event)
    assert "limits.max_websocket_message" in _limit_line(proxy)["reason"]



def _closed_with(client: Client, seconds: float) -> CloseConnection | None:
    """Read (and drop) what comes until the WebSocket is closed: its close, None for a bare close, or fail."""
    deadline = time.monotonic() + seconds
    client.sock.settimeout(seconds)
    while time.monotonic() < deadline:
        try:
            event = client._next()
        except TimeoutError:
            break
        except OSError:
            return None
        if event is None or isinstance(event, CloseConnection):
            return event
    raise AssertionError("the WebSocket is still open")


@both_transports
def test_a_compressed_message_is_bounded_as_it_inflates(lab, start_proxy, tmp_path):
    """A WebSocket whose origin accepts permessage-deflate is compressed through mitmproxy, which inflates what it
    reads with no bound: 64 KiB on the wire became 64 MiB in the worker before the message limit was looked at (a
    decompression bomb). The inflating is bounded by limits.max_websocket_message now."""
    echo = WsEcho(PUBLIC_IP, deflate=True)
    try:
        proxy, session, client = _start(lab, start_proxy, tmp_path, echo, limits=LIMIT, deflate=True)
        assert client.accepted.extensions, "permessage-deflate was not negotiated"
        assert len(client.echo(b"z" * 900_000)) == 900_000  # under the limit, compressed: relayed
        before = tree_kib(proxy.process.pid, "VmHWM")
        with contextlib.suppress(OSError):
            client.sock.sendall(client.ws.send(Message(data=bytes(128 << 20))))  # ~128 KiB on the wire
        closed = _closed_with(client, 10)
        assert closed is None or closed.code == 1009, closed
        grown = (tree_kib(proxy.process.pid, "VmHWM") - before) // 1024
        assert grown < 30, f"the proxy's peak memory grew by {grown} MiB inflating one message"
        line = _limit_line(proxy)
        assert line["session"] == session["id"] and "1000000 bytes" in line["reason"], line
    finally:
        echo.close()


@both_transports
def test_a_message_of_endless_empty_fragments_is_bounded(lab, start_proxy, tmp_path, echo):
    """mitmproxy keeps a list entry for every fragment of a message it holds; the limit counted only payload bytes,
    so a message of empty fragments (6 bytes each on the wire) grew that list forever, never past the limit.
    Every fragment counts now."""
    proxy, session, client = _start(lab, start_proxy, tmp_path, echo, limits=LIMIT)
    mask = b"\x00\x00\x00\x00"
    with contextlib.suppress(OSError):
        client.sock.sendall(b"\x02\x80" + mask)  # a binary message, not final, empty
        for _ in range(50):
            client.sock.sendall((b"\x00\x80" + mask) * 10_000)  # empty continuations, none final
    closed = _closed_with(client, 10)
    assert closed is None or closed.code == 1009, closed
    line = _limit_line(proxy)
    assert line["session"] == session["id"] and "limits.max_websocket_message" in line["reason"], line


@both_transports
def test_pings_and_pongs_are_charged_to_the_session(lab, start_proxy, tmp_path, echo):
    """A ping's payload is relayed to the other side, and the origin's pong back, as a message is; only messages
    were charged, so pings moved any number of bytes past a session's byte budget. Now they are charged, and the
    ping that would pass the budget is not relayed."""
    proxy, session, client = _start(lab, start_proxy, tmp_path, echo, budgets={"request_bytes": 100_000})

    def usage(enough) -> dict:
        deadline = time.monotonic() + SESSION_SWEEP * 3 + 2
        while True:  # charged by the sweep, or at the close just after its line
            status, _, view = api(proxy.admin_port, "GET", f"/v1/sessions/{session['id']}")
            assert status == 200, view
            if enough(view["usage"]) or time.monotonic() > deadline:
                return view["usage"]
            time.sleep(0.1)

    for _ in range(400):  # 50,000 bytes each way, within the budget: the pongs come back and are charged
        client.sock.sendall(client.ws.send(Ping(payload=b"p" * 125)))
    seen = usage(lambda u: u["response_bytes"] >= 50_000)
    assert seen["request_bytes"] >= 50_000 and seen["response_bytes"] >= 50_000, seen
    with contextlib.suppress(OSError):  # the proxy closes the WebSocket mid-way
        for _ in range(2000):
            client.sock.sendall(client.ws.send(Ping(payload=b"p" * 125)))
    _closed_with(client, SESSION_SWEEP * 3 + 1)
    line = _cut_line(proxy, session)
    assert line["rule"] == "session:budget-request-bytes", line
    seen = usage(lambda u: u["request_bytes"] >= 90_000)
    assert 90_000 <= seen["request_bytes"] <= 100_000, seen
