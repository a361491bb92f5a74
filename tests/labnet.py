"""Servers the proxy tests talk to, all on loopback: an upstream that plays "the public web" and
stand-ins for internal services that log every connection (a containment test passes when they
logged nothing). Real sockets, real HTTP and TLS."""

from __future__ import annotations

import contextlib
import datetime
import http.server
import socket
import ssl
import sys
import tempfile
import threading
import time
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from listening import stop_serving

PUBLIC_IP = "127.0.0.2"  # re-admitted by the test policy's address allow rule: "the public web"
INTERNAL_IP = "127.0.0.3"  # never re-admitted: an internal service


class StandIn:
    """A TCP listener that records every connection it accepts (and closes it)."""

    def __init__(self, host: str = INTERNAL_IP, port: int = 0) -> None:
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(64)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.connections: list[tuple[str, int]] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            self.connections.append(peer[:2])
            conn.close()

    def close(self) -> None:
        stop_serving(self.sock, self._thread)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Upstream

    def log_message(self, *args: object) -> None:  # keep test output quiet
        pass

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in {"Content-Length": str(len(body)), "Content-Type": "text/plain", **(headers or {})}.items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self) -> None:
        self.server.requests.append((self.command, self.path, dict(self.headers)))
        page = self.server.pages.get(self.path.split("?", 1)[0])
        if page is not None:
            self._send(200, page[1], {"Content-Type": page[0]})
        elif self.path.startswith("/slow/"):  # answers after N seconds (timeouts)
            time.sleep(float(self.path.split("/")[2]))
            with contextlib.suppress(OSError):  # the client may have given up waiting
                self._send(200, b"<html><body><p>slow</p></body></html>", {"Content-Type": "text/html"})
        elif self.path.startswith("/pdf"):
            self._send(200, b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n1 0 obj<<>>endobj\ntrailer<<>>\n%%EOF\n",
                       {"Content-Type": "application/pdf"})
        elif self.path.startswith("/status/"):
            self._send(int(self.path.split("/")[2]), b"<html><body><p>status page</p></body></html>",
                       {"Content-Type": "text/html"})
        elif self.path.startswith("/redirect?to="):
            self._send(302, b"", {"Location": self.path.split("=", 1)[1]})
        elif self.path.startswith("/forge"):
            self._send(200, b"forged", {"X-Egresswall-Reason": "forged by upstream"})
        elif self.path.startswith("/bytes/"):
            self._send(200, b"x" * int(self.path.split("/")[2]))
        else:
            self._send(200, f"hello from {self.server.name} {self.path}".encode())

    def do_POST(self) -> None:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            body = self._read_chunked()
        else:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.server.requests.append((self.command, self.path, dict(self.headers)))
        self._send(200, f"got {len(body)} bytes".encode())

    do_DELETE = do_POST  # an API that gives a DELETE body a meaning reads it (http.body_allowed_on: [DELETE])


def _read_chunks(rfile) -> bytes:
    """A chunked request body (RFC 9112 7.1), as a real origin reads it: all of it, before answering."""
    body = b""
    while True:
        size = int(rfile.readline().split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            while rfile.readline() not in (b"\r\n", b"\n", b""):
                pass  # trailers
            return body
        body += rfile.read(size)
        rfile.readline()


_Handler._read_chunked = lambda self: _read_chunks(self.rfile)


class _Upstream(http.server.ThreadingHTTPServer):
    daemon_threads = True
    requests: list[tuple[str, str, dict[str, str]]]
    name: str
    pages: dict[str, tuple[str, bytes]]  # path -> (Content-Type, body), registered by tests

    def handle_error(self, request, client_address) -> None:
        """A peer that went away while it was answered (the proxy closed a connection a test ended early) is
        no error of the lab's; anything else is printed as socketserver does."""
        if not isinstance(sys.exception(), (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


class Upstream:
    """An HTTP (or HTTPS) server on a loopback address, counting connections and requests."""

    def __init__(self, host: str = PUBLIC_IP, name: str = "public", tls: ssl.SSLContext | None = None) -> None:
        self.server = _Upstream((host, 0), _Handler)
        self.server.requests = []
        self.server.name = name
        self.server.pages = {}
        self.connections = 0
        original = self.server.get_request

        def counted():
            conn, peer = original()
            self.connections += 1
            if tls is not None:
                conn = tls.wrap_socket(conn, server_side=True)
            return conn, peer

        self.server.get_request = counted
        self.host, self.port = host, self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def serve(self, path: str, body: str | bytes, content_type: str = "text/html; charset=utf-8") -> str:
        """Serve ``body`` at ``path`` (query strings ignored); returns the path."""
        self.server.pages[path] = (content_type, body.encode() if isinstance(body, str) else body)
        return path

    @property
    def requests(self) -> list[tuple[str, str, dict[str, str]]]:
        return self.server.requests

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def self_signed(names: list[str], directory: str | None = None) -> tuple[ssl.SSLContext, Path]:
    """A server context for a certificate naming ``names``, and the certificate file (to trust it)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=7))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False)
        .sign(key, hashes.SHA256())
    )
    folder = Path(directory or tempfile.mkdtemp(prefix="ew-cert-"))
    cert_file, key_file = folder / "cert.pem", folder / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_file, key_file)
    return context, cert_file


def seen_since(lab, before: int) -> list[str]:
    """The paths lab.public was asked for after its first ``before`` requests."""
    time.sleep(0.3)  # the origin's handler thread records the request
    return [path for _, path, _ in lab.public.requests[before:]]
