"""Raw-socket helpers for tests that speak to the proxy byte by byte (malformed, split or hostile input)."""

from __future__ import annotations

import socket

from proxyproc import ProxyProcess


def tunnel(proxy: ProxyProcess, authority: str, timeout: float = 10) -> socket.socket:
    """A CONNECT through ``proxy`` that was answered 200, its head read byte by byte (nothing after it)."""
    sock = socket.create_connection((proxy.host, proxy.port), timeout=timeout)
    sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    head = read_head(sock)
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock


def read_head(sock: socket.socket) -> bytes:
    """A response head read byte by byte, so that nothing after it is taken from the socket."""
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(1)
        assert chunk, head
        head += chunk
    return head


def read_all(sock: socket.socket, timeout: float = 10) -> bytes:
    """Everything until the peer closes (or resets, or is silent for ``timeout`` seconds)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return data


def exchange(proxy: ProxyProcess, data: bytes, timeout: float = 5) -> bytes:
    """``data`` sent in one write on a new connection to ``proxy``; everything that came back (read_all)."""
    with socket.create_connection((proxy.host, proxy.port), timeout=timeout) as sock:
        sock.sendall(data)
        return read_all(sock, timeout)
