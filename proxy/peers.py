"""Who is on the other end of a socket: the client key caps and roles use, and our own addresses."""

from __future__ import annotations

import ipaddress
import socket

from policy.addresses import unwrap_mapped


def client_key(ip: str) -> str:
    """One key per client whatever the listener's family: a dual-stack socket reports an IPv4
    client as ``::ffff:a.b.c.d``, and roles and caps are written for ``a.b.c.d``."""
    return unwrap_mapped(ip)


def peer_of(peername: tuple | None) -> str:
    return client_key(str(peername[0])) if peername else ""


def is_local_address(address: str) -> bool:
    """True when this host owns the address (binding to it succeeds): the proxy's wildcard listener
    answers on every such address."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))
        return True
    except (OSError, ValueError):
        return False
