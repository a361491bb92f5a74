"""Opening the sockets egresswall listens on: which listener failed, where, and why.

A listener that cannot be opened (the port is taken, the address is not this machine's, a port below
1024 without the right) is an error in the operator's environment, not a bug: it is raised as a
``ListenError`` that names the listener, so the command line can say which option to change.
"""

from __future__ import annotations

import errno
import os
import socket

PROXY, ADMIN, BROWSER_SERVER = "proxy", "admin", "browser server"  # ListenError.listener


class ListenError(OSError):
    """``listener`` (PROXY, ADMIN, BROWSER_SERVER) cannot listen on ``address``; ``errno`` says why."""

    def __init__(self, listener: str, address: tuple[str, int], cause: BaseException) -> None:
        root = _root_cause(cause)
        super().__init__(getattr(root, "errno", None), _why(root))
        self.listener, self.address = listener, address

    @property
    def name_not_found(self) -> bool:
        """The host is a name that does not resolve (getaddrinfo's errors are negative numbers)."""
        return isinstance(self.errno, int) and self.errno < 0

    def __str__(self) -> str:
        return f"the {self.listener} listener cannot listen on {authority(*self.address)}: {self.strerror}"


def _root_cause(err: BaseException) -> BaseException:
    """The system's own error under the restatements asyncio and mitmproxy wrap around it."""
    while err.__cause__ is not None:
        err = err.__cause__
    return err


def _why(cause: BaseException) -> str:
    """The system's words for the error ("address already in use")."""
    code = getattr(cause, "errno", None)
    if isinstance(code, int) and code in errno.errorcode:
        return os.strerror(code).lower()
    return str(getattr(cause, "strerror", None) or cause).lower()


def authority(host: str, port: int) -> str:
    """``host:port`` as it is written in a URL or on a command line: an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_free(listener: str, host: str, port: int) -> None:
    """Raise ``ListenError`` now if ``host:port`` cannot be listened on: for a listener that would
    otherwise be opened only after slow start-up work (a browser launched, workers started)."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as every real listener does
            probe.bind(address)
    except OSError as err:
        raise ListenError(listener, (host, port), err) from err
