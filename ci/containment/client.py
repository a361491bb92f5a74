"""A simple client for the lab: what the probe page does, without a browser. ``--client simple``.

It makes one attempt per target through the proxy the way Chromium does (absolute-form GET for
``http://``, CONNECT for ``https://`` and ``wss://``, and CONNECT host:80 for ``ws://``), follows one
redirect, and answers WebRTC targets with nothing (a contained browser sends no UDP). The weakenings
copy Chromium's behaviour without its flags: ``loopback-bypass`` sends loopback and link-local targets
direct; ``webrtc`` sends a STUN binding request by UDP. It exists to test the lab itself (and the smoke
test's negative machinery) without Chromium; the real smoke test runs the probe page in Chromium.

Run in the browser namespace: ``python -m containment.client --targets T --proxy H:P --out R [--weaken W]``.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import socket
import ssl
import struct
import sys
from urllib.parse import urljoin, urlsplit

DIRECT_WHEN_BYPASSED = ("127.", "169.254.", "localhost", "::1", "fe80:")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--targets", required=True)
    parser.add_argument("--proxy", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cafile")
    parser.add_argument("--weaken", action="append", default=[])
    parser.add_argument("--timeout", type=float, default=5)
    args = parser.parse_args(argv)
    with open(args.targets) as f:
        targets = json.load(f)
    host, _, port = args.proxy.rpartition(":")
    client = Client((host.strip("[]"), int(port)), args.cafile, set(args.weaken), args.timeout)
    report = []
    for key, url in targets.items():
        route = "stun" if url.startswith("stun:") else urlsplit(url).scheme
        try:
            outcome, error = client.attempt(url)
        except TimeoutError as err:
            outcome, error = "timeout", str(err) or "timed out"
        except OSError as err:
            outcome, error = "blocked", f"{type(err).__name__}: {err}"
        except Exception as err:  # noqa: BLE001 - a report line, never a crash
            outcome, error = "error", f"{type(err).__name__}: {err}"
        report.append({"route": f"simple-{route}", "target": key, "url": url, "outcome": outcome, "error": error})
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


class Client:
    def __init__(self, proxy: tuple[str, int], cafile: str | None, weaken: set[str], timeout: float) -> None:
        self.proxy, self.weaken, self.timeout = proxy, weaken, timeout
        self.tls = ssl.create_default_context(cafile=cafile) if cafile else ssl.create_default_context()

    def attempt(self, url: str, redirects: int = 1) -> tuple[str, str]:
        if url.startswith("stun:"):
            return self.stun(url)
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port or (443 if parts.scheme in ("https", "wss") else 80)
        if "loopback-bypass" in self.weaken and host.startswith(DIRECT_WHEN_BYPASSED):
            return self.direct(host, port, parts)
        if parts.scheme == "http":
            status, headers, _ = self.request_via_proxy(url)
        else:
            status, headers = self.tunnel(parts, host, port)
        if status == 403 and "x-egresswall-reason" in headers:
            return "blocked", f"403 from the proxy: {headers['x-egresswall-reason']}"
        if status in (301, 302, 303, 307, 308) and redirects and "location" in headers:
            return self.attempt(urljoin(url, headers["location"]), redirects - 1)
        if 200 <= status < 400 or status == 101:
            return "reached", f"{status}"
        return "error", f"HTTP {status}"

    def _connect_proxy(self) -> socket.socket:
        return socket.create_connection(self.proxy, timeout=self.timeout)

    def request_via_proxy(self, url: str) -> tuple[int, dict[str, str], bytes]:
        host = urlsplit(url).netloc
        with self._connect_proxy() as sock:
            sock.sendall(f"GET {url} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            return parse(read_all(sock))

    def tunnel(self, parts, host: str, port: int) -> tuple[int, dict[str, str]]:
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        sock = self._connect_proxy()
        try:
            sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
            head = read_head(sock)
            status, headers, _ = parse(head)
            if status != 200:
                return status, headers
            if parts.scheme in ("https", "wss"):
                sock = self.tls.wrap_socket(sock, server_hostname=host)
            path = parts.path or "/"
            upgrade = ""
            if parts.scheme in ("ws", "wss"):
                key = base64.b64encode(os.urandom(16)).decode()
                upgrade = f"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n" \
                          "Sec-WebSocket-Version: 13\r\n"
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n{upgrade}Connection: close\r\n\r\n".encode())
            status, headers, _ = parse(read_head(sock))
            return status, headers
        finally:
            sock.close()

    def direct(self, host: str, port: int, parts) -> tuple[str, str]:
        address = "127.0.0.1" if host == "localhost" else host
        with socket.create_connection((address, port), timeout=self.timeout) as sock:
            sock.sendall(f"GET {parts.path or '/'} HTTP/1.1\r\nHost: {parts.netloc}\r\n\r\n".encode())
            try:
                data = sock.recv(100)
            except OSError:
                data = b""
        return "reached", f"direct connection to {address}:{port} (loopback bypass)" + (" answered" if data else "")

    def stun(self, url: str) -> tuple[str, str]:
        if "webrtc" not in self.weaken:
            return "blocked", "no UDP: the WebRTC policy allows only proxied UDP, and an HTTP proxy carries none"
        host, _, port = url[len("stun:"):].rpartition(":")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.settimeout(min(self.timeout, 2))
            request = struct.pack("!HHI", 1, 0, 0x2112A442) + os.urandom(12)
            sock.sendto(request, (host, int(port)))
            try:
                sock.recvfrom(2048)
            except TimeoutError:
                return "timeout", "STUN request sent, no answer"
        return "reached", "STUN answered"


def read_head(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def read_all(sock: socket.socket) -> bytes:
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        if not chunk:
            break
        data += chunk
    return data


def parse(data: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    if not lines or not lines[0].startswith("HTTP/"):
        raise ConnectionError(f"no HTTP response ({len(data)} bytes)")
    headers = {}
    for line in lines[1:]:
        key, _, value = line.partition(":")
        headers[key.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers, body


if __name__ == "__main__":
    sys.exit(main())
