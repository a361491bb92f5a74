"""The lab's hosts, run inside a lab namespace as one process: ``python -m containment.hosts CONFIG``.

Depending on the JSON config it serves the "public" web (HTTP and HTTPS with the lab CA's
certificate, a WebSocket echo at ``/ws``, ``/redirect?to=URL``, the probe page's static files under
``/probe/``), a STUN server on UDP, the lab DNS server (``tests/dnslab.py``), and stand-ins: TCP and
UDP listeners on internal addresses (or a namespace's loopback) that log every connection and every
datagram. Every event is one JSON line in the config's log file; "ready" is written once every socket
is bound, and the process runs until SIGTERM (or the config's deadline, so it never outlives a lost run).
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import mimetypes
import os
import select
import signal
import socket
import ssl
import struct
import sys
import threading
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit

from containment import topology

_log_lock = threading.Lock()
_log_fd: int | None = None


def log(event: dict) -> None:
    event["time"] = round(time.time(), 6)
    line = (json.dumps(event, default=str) + "\n").encode()
    with _log_lock:
        assert _log_fd is not None
        os.write(_log_fd, line)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


# ---- stand-ins ---------------------------------------------------------------------------------------

def serve_standin(name: str, host: str, tcp_ports: list[int], udp_ports: list[int]) -> list[socket.socket]:
    """Bind listeners; a thread logs each connection (with the first bytes the peer sent) and datagram."""
    socks: dict[socket.socket, tuple[str, int]] = {}
    for port in tcp_ports:
        s = socket.socket(_family(host), socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        s.listen(64)
        socks[s] = ("tcp", port)
    for port in udp_ports:
        s = socket.socket(_family(host), socket.SOCK_DGRAM)
        s.bind((host, port))
        socks[s] = ("udp", port)

    def loop() -> None:
        while True:
            readable, _, _ = select.select(list(socks), [], [], 1)
            for s in readable:
                proto, port = socks[s]
                if proto == "tcp":
                    conn, peer = s.accept()
                    threading.Thread(target=_standin_conn, args=(name, host, port, conn, peer), daemon=True).start()
                else:
                    data, peer = s.recvfrom(65535)
                    log({"kind": "standin", "standin": name, "proto": "udp", "address": host, "port": port,
                         "peer": f"{peer[0]}:{peer[1]}", "data": _printable(data)})

    threading.Thread(target=loop, daemon=True).start()
    return list(socks)


def _standin_conn(name: str, host: str, port: int, conn: socket.socket, peer: tuple) -> None:
    conn.settimeout(1.0)
    try:
        data = conn.recv(300)
    except OSError:
        data = b""
    conn.close()
    log({"kind": "standin", "standin": name, "proto": "tcp", "address": host, "port": port,
         "peer": f"{peer[0]}:{peer[1]}", "data": _printable(data)})


def _printable(data: bytes) -> str:
    if data[:1] == b"\x16":
        return f"<TLS {len(data)} bytes>"
    text = data.decode("latin-1")
    first = text.split("\r\n", 1)[0]
    return "".join(c if 32 <= ord(c) < 127 else "." for c in first)[:200]


# ---- the public web ------------------------------------------------------------------------------

PUBLIC_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>egresswall lab: public page</title></head>
<body><h1>public lab page</h1><p id="marker">egresswall-lab-public {path}</p></body></html>
"""
WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


class _Web(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # the probe opens many connections at once
    scheme = "http"
    static: dict[str, Path] = {}


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Web
    # Keep idle keep-alive connections for longer than a run: a server closing one just as the proxy
    # reuses it makes a 502 that is neither a leak nor a refusal (seen once under load).
    timeout = 300

    def log_message(self, *args: object) -> None:
        pass

    def _log(self, status: int, **extra: object) -> None:
        log({"kind": "web", "scheme": self.server.scheme, "method": self.command, "host": self.headers.get("Host"),
             "path": self.path, "status": status, "peer": self.client_address[0], **extra})

    def _send(self, status: int, body: bytes, ctype: str = "text/html; charset=utf-8",
              headers: dict[str, str] | None = None) -> None:
        self._log(status)
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("Access-Control-Allow-Origin", "*")
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self) -> None:
        parts = urlsplit(self.path)
        path = parts.path
        if self.headers.get("Upgrade", "").lower() == "websocket":
            self._websocket()
            return
        if path == "/redirect":
            to = unquote(parts.query.partition("to=")[2])
            self._send(302, b"", headers={"Location": to})
            return
        for prefix, folder in self.server.static.items():
            if path.startswith(prefix):
                self._static(folder, path[len(prefix):])
                return
        if path == "/favicon.ico":
            self._send(404, b"")
            return
        self._send(200, PUBLIC_PAGE.format(path=path.replace("<", "")).encode())

    do_HEAD = do_GET

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(min(length, 1 << 20))
        self._send(200, PUBLIC_PAGE.format(path="POST " + self.path.replace("<", "")).encode())

    def do_OPTIONS(self) -> None:
        self._send(204, b"", headers={"Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                                      "Access-Control-Allow-Headers": "*"})

    def _static(self, folder: Path, rel: str) -> None:
        rel = rel or "index.html"
        file = (folder / rel).resolve()
        if not file.is_relative_to(folder.resolve()) or not file.is_file():
            self._send(404, b"not found", "text/plain")
            return
        ctype = mimetypes.guess_type(file.name)[0] or "application/octet-stream"
        if file.suffix in (".js", ".mjs"):
            ctype = "text/javascript"
        headers = {"Service-Worker-Allowed": "/"}
        self._send(200, file.read_bytes(), ctype, headers)

    def _websocket(self) -> None:
        key = self.headers.get("Sec-WebSocket-Key", "")
        accept = base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()
        self._log(101, websocket=True)
        self.send_response(101)
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", accept)
        self.end_headers()
        self.wfile.flush()
        self.close_connection = True
        try:  # echo text frames until close, bounded
            self.connection.settimeout(10)
            for _ in range(100):
                opcode, payload = _ws_read(self.rfile)
                if opcode == 8:
                    self.wfile.write(b"\x88\x00")
                    break
                if opcode in (1, 2):
                    self.wfile.write(_ws_frame(opcode, payload))
                    self.wfile.flush()
        except (OSError, ValueError):
            pass


def _ws_read(rfile) -> tuple[int, bytes]:
    head = rfile.read(2)
    if len(head) < 2:
        raise ValueError("closed")
    opcode, length = head[0] & 0x0F, head[1] & 0x7F
    if length == 126:
        length = struct.unpack("!H", rfile.read(2))[0]
    elif length == 127:
        length = struct.unpack("!Q", rfile.read(8))[0]
    mask = rfile.read(4) if head[1] & 0x80 else b"\0\0\0\0"
    data = rfile.read(min(length, 1 << 20))
    return opcode, bytes(b ^ mask[i % 4] for i, b in enumerate(data))


def _ws_frame(opcode: int, payload: bytes) -> bytes:
    n = len(payload)
    head = bytes([0x80 | opcode]) + (bytes([n]) if n < 126 else b"\x7e" + struct.pack("!H", n))
    return head + payload


def serve_web(host: str, http_port: int, https_port: int, cert: str, key: str, static: dict[str, str]) -> None:
    folders = {prefix: Path(folder) for prefix, folder in static.items()}
    plain = _Web((host, http_port), _Handler)
    plain.static = folders
    secure = _Web((host, https_port), _Handler)
    secure.scheme, secure.static = "https", folders
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    original = secure.get_request

    def wrapped():  # the TLS handshake happens in the handler thread, so one slow client blocks nothing
        conn, peer = original()
        return context.wrap_socket(conn, server_side=True, do_handshake_on_connect=False), peer

    secure.get_request = wrapped
    for server in (plain, secure):
        threading.Thread(target=server.serve_forever, daemon=True).start()


# ---- STUN ----------------------------------------------------------------------------------------

MAGIC = 0x2112A442


def serve_stun(host: str, port: int) -> socket.socket:
    """Answer STUN binding requests (RFC 5389) with XOR-MAPPED-ADDRESS, and log every datagram."""
    sock = socket.socket(_family(host), socket.SOCK_DGRAM)
    sock.bind((host, port))

    def loop() -> None:
        while True:
            data, peer = sock.recvfrom(65535)
            binding = len(data) >= 20 and struct.unpack("!HHI", data[:8])[0::2] == (0x0001, MAGIC)
            log({"kind": "stun", "address": host, "port": port, "peer": f"{peer[0]}:{peer[1]}",
                 "binding_request": binding, "bytes": len(data)})
            if binding and ":" not in peer[0]:
                xport = peer[1] ^ (MAGIC >> 16)
                xaddr = struct.unpack("!I", socket.inet_aton(peer[0]))[0] ^ MAGIC
                attr = struct.pack("!HHBBHI", 0x0020, 8, 0, 1, xport, xaddr)
                sock.sendto(struct.pack("!HHI", 0x0101, len(attr), MAGIC) + data[8:20] + attr, peer)

    threading.Thread(target=loop, daemon=True).start()
    return sock


# ---- DNS -----------------------------------------------------------------------------------------

def serve_dns(host: str, port: int):
    from dnslab import DnsLab

    class LoggedDns(DnsLab):
        def _answer(self, data: bytes, tcp: bool) -> bytes | None:
            before = len(self.queries)
            reply = super()._answer(data, tcp)
            for name, rdtype in self.queries[before:]:
                log({"kind": "dns", "name": name, "type": rdtype, "tcp": tcp})
            return reply

    server = LoggedDns(topology.ZONE, host=host, port=port)
    server.__enter__()
    return server


# ---- main ----------------------------------------------------------------------------------------

def main(config_path: str) -> int:
    global _log_fd
    config = json.loads(Path(config_path).read_text())
    _log_fd = os.open(config["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    keep = []
    for standin in config.get("standins", []):
        for address in standin["addresses"]:
            keep += serve_standin(standin["name"], address, standin["tcp"], standin["udp"])
    if web := config.get("web"):
        serve_web(web["host"], web["http_port"], web["https_port"], web["cert"], web["key"], web["static"])
    if stun := config.get("stun"):
        keep.append(serve_stun(stun["host"], stun["port"]))
    if dns := config.get("dns"):
        keep.append(serve_dns(dns["host"], dns["port"]))
    Path(config["ready"]).write_text(str(os.getpid()))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait(timeout=config.get("lifetime", 900))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
