"""The upstream proxy egresswall forwards through (``upstream:`` in the policy): its URL, parsed strictly.

Pure: the credentials file is named here and read by the proxy (``proxy/upstream.py``). The URL is
``http://HOST:PORT`` and nothing else: no credentials (they would sit in the policy file, in process
lists and in logs; they come from ``upstream.credentials_file``), no path, query or fragment (a proxy
URL has none), an explicit port (no guessing between 3128, 8080 and 80), and no TLS to the proxy
(``https://`` is not supported: the hop to the upstream is plain HTTP, as with most corporate proxies).
"""

from __future__ import annotations

import re

from .addresses import parse_address
from .hosts import split_host_port
from .model import RESOLUTION_UPSTREAM, Upstream

__all__ = ["RESOLUTION_UPSTREAM", "Upstream", "check_credentials_path", "parse_upstream_proxy"]

_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


def parse_upstream_proxy(text: str) -> tuple[str, int]:
    """``http://HOST:PORT`` → (host, port). ValueError says what is wrong, and never repeats a password."""
    if "@" in text:  # checked first, so that no other message repeats what may be a password
        scheme_text = _SCHEME.match(text)
        shown = f"{scheme_text.group(0) if scheme_text else ''}***@{text.rpartition('@')[2]}"
        raise ValueError(f"got {shown!r}: credentials in the proxy URL are never accepted (they would show in the "
                         "policy, in process lists and in logs); put user:password in a file named by "
                         "upstream.credentials_file (or --upstream-credentials-file)")
    if any(ord(ch) < 0x21 or ord(ch) == 0x7F for ch in text):
        raise ValueError("the upstream proxy URL holds a space or a control character; expected http://HOST:PORT")
    scheme = _SCHEME.match(text)
    if scheme is None:
        raise ValueError(f"got {text!r}; expected http://HOST:PORT (the scheme is required)")
    rest = text[scheme.end():]
    authority, slash, tail = rest.partition("/")
    authority, _, _ = authority.partition("?")
    authority, _, _ = authority.partition("#")
    name = scheme.group(1).lower()
    if name == "https":
        raise ValueError(f"got {text!r}; an https:// upstream (TLS to the proxy itself) is not supported: "
                         "expected http://HOST:PORT")
    if name != "http":
        raise ValueError(f"got {text!r}; only an HTTP proxy can be an upstream: expected http://HOST:PORT")
    if (slash and tail) or "?" in rest or "#" in rest:
        raise ValueError(f"got {text!r}; a proxy URL has no path, query or fragment: expected http://HOST:PORT")
    try:
        host, port = split_host_port(authority)
    except ValueError as err:
        raise ValueError(f"got {text!r}; expected http://HOST:PORT with an explicit port ({err})") from None
    return _proxy_host(host, text), port


def _proxy_host(host: str, text: str) -> str:
    if not host:
        raise ValueError(f"got {text!r}; the proxy host is empty: expected http://HOST:PORT")
    try:
        return str(parse_address(host))
    except ValueError:
        pass
    name = host.lower().removesuffix(".")
    labels = name.split(".")
    if len(name) > 253 or not all(_LABEL.fullmatch(label) for label in labels) or labels[-1].isdigit():
        raise ValueError(f"got {text!r}; the proxy host {host!r} is neither an IP address nor a host name "
                         "(letters, digits and '-' in dot-separated labels)")
    return name


def check_credentials_path(path: str) -> str | None:
    """Why ``path`` cannot name the credentials file (None when it can): an absolute path, one line of text."""
    if not path.startswith("/"):
        return (f"got {path!r}; expected an absolute path (a relative one would depend on the directory "
                "egresswall was started in)")
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in path):
        return "the path holds a control character"
    return None
