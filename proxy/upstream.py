"""The upstream proxy's credentials, read once from the file the policy names (never from the command line).

The file holds one line, ``user:password`` (a trailing newline is fine), and must not be readable by
every user of the machine: a proxy password in a world-readable file is a password for everyone, so
egresswall refuses to start rather than send it. Group-readable is allowed (a deployment may give the
file to a service group, as a Kubernetes secret mounted with ``defaultMode: 0440`` does). A symbolic link
is followed (a mounted secret is one) and its target is judged.
"""

from __future__ import annotations

import base64
import os
import stat

from policy.model import Upstream


class UpstreamError(ValueError):
    """The upstream proxy cannot be used as configured; the message says which setting and why."""


def read_credentials(upstream: Upstream) -> str | None:
    """``user:password`` for the upstream's Basic proxy authentication, or None when it needs none."""
    path = upstream.credentials_file
    if path is None:
        return None
    where = f"upstream.credentials_file {path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as err:
        raise UpstreamError(f"{where}: cannot be read: {(err.strerror or str(err)).lower()}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UpstreamError(f"{where}: not a regular file")
        if info.st_mode & stat.S_IROTH:
            raise UpstreamError(f"{where}: readable by every user (mode {stat.S_IMODE(info.st_mode):04o}); it holds a "
                                f"proxy password: chmod o-r {path} (0600 or 0640)")
        raw = os.read(fd, 4097)
    finally:
        os.close(fd)
    return parse_credentials(raw, where)


def parse_credentials(raw: bytes, where: str = "the credentials file") -> str:
    """One line ``user:password``; the user is not empty and has no ':' (Basic authentication splits at the
    first one). Messages never repeat the password."""
    if len(raw) > 4096:
        raise UpstreamError(f"{where}: over 4096 bytes; expected one line user:password")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UpstreamError(f"{where}: not UTF-8 text; expected one line user:password") from None
    line = text[:-2] if text.endswith("\r\n") else text.removesuffix("\n")  # a lone CR is a control character
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in line):
        raise UpstreamError(f"{where}: holds more than one line, or a control character; expected one line "
                            "user:password")
    user, colon, password = line.partition(":")
    if not colon or not user or not password:
        raise UpstreamError(f"{where}: expected one line user:password (a user and a password, both not empty)")
    return line


def basic_authorization(credentials: str) -> str:
    """The Proxy-Authorization value for ``user:password`` (RFC 7617; UTF-8, as its charset parameter says)."""
    return "Basic " + base64.b64encode(credentials.encode("utf-8")).decode("ascii")
