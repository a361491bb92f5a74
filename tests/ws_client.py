"""The client side of the lab's WebSocket tests: wsproto over a socket to the proxy, and the proxy's answer read
back (the close it sent, the records it wrote)."""

from __future__ import annotations

import socket
import time

from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Request
from wsproto.extensions import PerMessageDeflate


def proxy_for_port(lab, start_proxy, port: int, limits: str = ""):
    """A proxy whose lab policy also allows plain HTTP and CONNECT to ``port`` (a test origin's)."""
    text = lab.policy_text(limits=limits).replace("  http: [", f"  http: [{port}, ")
    return start_proxy(text.replace("  connect: [", f"  connect: [{port}, "))


def send_deflate_handshake(proxy, authority: str) -> tuple[WSConnection, socket.socket]:
    """Opens a connection to the proxy and sends an absolute-form handshake for ws://authority/chat that offers
    permessage-deflate."""
    ws = WSConnection(ConnectionType.CLIENT)
    sock = socket.create_connection((proxy.host, proxy.port), timeout=10)
    sock.sendall(ws.send(Request(host=authority, target=f"http://{authority}/chat", extensions=[PerMessageDeflate()])))
    return ws, sock


def await_accept(ws: WSConnection, sock: socket.socket) -> AcceptConnection:
    accepted = None
    while accepted is None:
        ws.receive_data(sock.recv(65536))
        accepted = next((e for e in ws.events() if isinstance(e, AcceptConnection)), None)
    return accepted


def read_until_close(ws: WSConnection, sock: socket.socket, timeout: float) -> tuple[CloseConnection | None, list]:
    """Reads until the proxy's close frame, the connection's end or ``timeout`` of silence; closes the socket.
    Returns the close (None if there was none) and every event read."""
    closed, events = None, []
    sock.settimeout(timeout)
    while closed is None:
        try:
            got = sock.recv(65536)
        except OSError:
            break
        ws.receive_data(got or None)
        events += list(ws.events())
        closed = next((e for e in events if isinstance(e, CloseConnection)), None)
        if not got:
            break
    sock.close()
    return closed, events


def records_of_rule(proxy, rule: str, wait: float = 3.0) -> list[dict]:
    """The proxy's audit records with this rule, waiting up to ``wait`` seconds for the first."""
    deadline = time.monotonic() + wait
    while not (lines := [r for r in proxy.audit() if r.get("rule") == rule]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return lines
