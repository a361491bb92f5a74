"""A test's client of the session API (the admin listener) and of the proxy with session credentials."""

from __future__ import annotations

import http.client
import json
import os
import socket
from pathlib import Path

from proxyproc import ProxyProcess, parse_response

TOKEN = "test-admin-token-0123456789abcdef"


def token_file(folder: Path, token: str = TOKEN) -> Path:
    path = folder / "admin-token"
    path.write_text(token + "\n")
    os.chmod(path, 0o600)
    return path


def api(port: int, method: str, path: str, body: object = None, token: str | None = TOKEN,
        raw: bytes | None = None, content_type: str = "application/json") -> tuple[int, dict[str, str], object]:
    """One request to the admin listener; the JSON answer parsed (text when it is not JSON)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {"Content-Type": content_type}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    try:
        conn.request(method, path, body=data, headers=headers)
        response = conn.getresponse()
        text = response.read()
        found = {k.lower(): v for k, v in response.getheaders()}
    finally:
        conn.close()
    try:
        return response.status, found, json.loads(text)
    except ValueError:
        return response.status, found, text.decode(errors="replace")


def create(port: int, grants: dict, **more: object) -> dict:
    status, _, body = api(port, "POST", "/v1/sessions", {"grants": grants, **more})
    assert status == 201, body
    assert isinstance(body, dict)
    return body


def get(proxy: ProxyProcess, url: str, session: dict | None = None, headers: dict[str, str] | None = None,
        authorization: str | None = None) -> tuple[int, dict[str, str], bytes]:
    sent = {"Accept": "application/json", **(headers or {})}
    value = authorization or (session["proxy_authorization"] if session else None)
    if value:
        sent["Proxy-Authorization"] = value
    return proxy.get(url, sent)


def connect(proxy: ProxyProcess, authority: str, session: dict | None = None,
            authorization: str | None = None) -> tuple[socket.socket, int, dict[str, str], bytes]:
    """A CONNECT with the session's credentials: (socket, status, headers, body of a refusal)."""
    sock = socket.create_connection((proxy.host, proxy.port), timeout=10)
    value = authorization or (session["proxy_authorization"] if session else None)
    lines = [f"CONNECT {authority} HTTP/1.1", f"Host: {authority}", "Accept: application/json"]
    if value:
        lines.append(f"Proxy-Authorization: {value}")
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    status, headers, body = parse_response(data)
    if status != 200:
        length = int(headers.get("content-length", "0"))
        while len(body) < length:
            chunk = sock.recv(4096)
            if not chunk:
                break
            body += chunk
    return sock, status, headers, body
