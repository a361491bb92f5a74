"""mitmproxy's host readers, taught the names the core reads by IDNA 2008 (installed by ``mitm_patches``).

The core normalises host names by IDNA 2008 / UTS-46, as Chromium does: ``faß.de`` is ``xn--fa-hia.de``.
mitmproxy reads a request line's host, a Host or ``:authority``, and a ClientHello's SNI with Python's
``idna`` codec, which is IDNA 2003: it maps ß to ss, so it refuses to decode ``xn--fa-hia`` (the label would
not encode back to itself). mitmproxy's path therefore answered 400 ``http:malformed`` to every request for
such a name: a browser's ``ws://`` to it, a request inside a CONNECT to a plain-HTTP port, an intercepted
host, everything with ``--no-fast-http`` or ``--no-fast-tunnels`` — where the fast front decides the name as
any other (tests/test_review_round20_idna.py).

The readers below take, beside what mitmproxy's own take, an all-ASCII name the core accepts, and hand it on
as it was written (mitmproxy decodes an A-label it can read to Unicode; one it cannot stays ASCII, which
everything after it encodes unchanged). Nothing is widened beyond the core's own reading, and what such a
name may reach is decided by the gate like any other name.
"""

from __future__ import annotations

from collections.abc import Callable

from mitmproxy.net import check
from mitmproxy.net.http import url

from policy.hosts import HostFormError, normalise_host

_originals: dict[str, Callable] = {}


def core_reads_name(host: str | bytes) -> bool:
    """True for an all-ASCII host name that the core's normaliser accepts (an address is mitmproxy's to read)."""
    if isinstance(host, bytes):
        if not host.isascii():
            return False
        host = host.decode("ascii")
    if not host or not host.isascii():
        return False
    try:
        return normalise_host(host)[1] is None
    except HostFormError:
        return False


def _is_valid_host(host: str | bytes) -> bool:
    return _originals["is_valid_host"](host) or core_reads_name(host)


def _parse_authority(authority: str | bytes, check: bool) -> tuple[str, int | None]:
    try:
        return _originals["parse_authority"](authority, check)
    except ValueError:
        # The original decodes a bytes authority with the IDNA 2003 codec and takes text as it is: read an
        # all-ASCII one as text, and keep the answer only when the core reads its host as a name.
        if not isinstance(authority, bytes) or not authority.isascii():
            raise
        host, port = _originals["parse_authority"](authority.decode("ascii"), check)
        if not core_reads_name(host):
            raise
        return host, port


def install() -> None:
    if _originals:
        return
    _originals.update(is_valid_host=check.is_valid_host, parse_authority=url.parse_authority)
    # ``check.is_valid_host`` is what url.parse, tls.ClientHello.sni and server_spec call; url.py also holds
    # its own imported name for parse_authority's check; readers call ``url.parse_authority`` by module.
    check.is_valid_host = _is_valid_host
    url.is_valid_host = _is_valid_host
    url.parse_authority = _parse_authority


def uninstall() -> None:
    if _originals:
        check.is_valid_host = _originals["is_valid_host"]
        url.is_valid_host = _originals["is_valid_host"]
        url.parse_authority = _originals["parse_authority"]
        _originals.clear()
