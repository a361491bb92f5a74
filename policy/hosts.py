"""The one normaliser: what a client sent (absolute URL, CONNECT authority, Host header) -> a ``Target``.

Pure and strict. Every refusal is a ``HostFormError`` whose ``form`` is a short stable id and whose
``reason`` names the form and quotes the input. Anything a browser, curl, a resolver or this proxy
could read differently is refused rather than guessed at: the decision must be about exactly the host
the connection goes to.

Names come out as A-labels (IDNA 2008 with UTS-46 non-transitional mapping, as browsers use), lower
case, without the trailing dot; IP literals come out as canonical text, IPv4-mapped IPv6 unwrapped.
Whether an address is private is not judged here (``policy/addresses.py`` does that); name rules such
as ``localhost`` are, because they are rules about names.
"""

from __future__ import annotations

import ipaddress
import re
import unicodedata
from dataclasses import dataclass

import idna

DEFAULT_PORTS: dict[str, int] = {"http": 80, "https": 443, "ws": 80, "wss": 443}

# Names under these are never public web hosts (RFC 6762 .local, RFC 8375 .home.arpa, the ICANN-reserved
# .internal, and the /etc/hosts habit .localdomain). A name can still resolve to a public address, so
# they are refused by name, before any lookup.
LOCAL_SUFFIXES = ("local", "internal", "home.arpa", "localdomain")

MAX_NAME = 253  # octets of the A-label name, without the trailing dot (RFC 1035)
MAX_LABEL = 63
# Bounds the work on hostile input (idna has the same limit). A valid name is at most 253 octets as
# A-labels; only ignorable code points (soft hyphens...) could pad one past this, no loss to refuse.
MAX_INPUT = 1024
MAX_PORT_DIGITS = 5

_LDH_LABEL = re.compile(r"[a-z0-9-]+")
_DECIMAL = re.compile(r"[0-9]+")
_HEX_NUMBER = re.compile(r"0x[0-9a-f]*")  # WHATWG: "0x" with nothing after it is still a number
_QUAD_OCTET = re.compile(r"0|[1-9][0-9]{0,2}")  # no leading zeros: 010 is octal to inet_aton
_IPV6_TEXT = re.compile(r"[0-9a-fA-F:.]+")
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
_AUTHORITY_END = re.compile(r"[/?#]")


class HostFormError(ValueError):
    """A refused form: ``form`` is a stable id (``userinfo``, ``numeric-ipv4``...), ``reason`` a sentence."""

    def __init__(self, form: str, reason: str):
        super().__init__(form, reason)  # both in args, so the error pickles and compares by content
        self.form = form
        self.reason = reason

    def __str__(self) -> str:
        return self.reason


@dataclass(frozen=True)
class Target:
    """One normalised request target. The parse_* functions validate; a Target built by hand is trusted."""

    scheme: str
    host: str
    port: int
    path: str = ""
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None = None

    @property
    def is_ip(self) -> bool:
        return self.ip is not None

    @property
    def authority(self) -> str:
        if isinstance(self.ip, ipaddress.IPv6Address):
            return f"[{self.host}]:{self.port}"
        return f"{self.host}:{self.port}"

    @property
    def host_header(self) -> str:
        """The authority as a Host header names it: without the scheme's default port (RFC 3986 6.2.3)."""
        if DEFAULT_PORTS.get(self.scheme) != self.port:
            return self.authority
        return f"[{self.host}]" if isinstance(self.ip, ipaddress.IPv6Address) else self.host

    def url(self) -> str:
        return f"{self.scheme}://{self.authority}{self.path}"


# --- refusals -------------------------------------------------------------------------------------


def _quote(text: str) -> str:
    """repr() so control characters show escaped in logs; truncated so a huge input cannot flood them."""
    if len(text) > 80:
        return repr(text[:80]) + "..."
    return repr(text)


def _refuse(form: str, why: str, text: str) -> HostFormError:
    return HostFormError(form, f"{form}: {why} (got {_quote(for_logs(text))})")


def for_logs(text: str, keep_query: bool = False) -> str:
    """A URL, authority or Host value as a reason or record may quote it: a user name and password before an
    '@' (``http://alice:s3cret@host/``) become ``[userinfo]`` (all before the last '@': never too little), and a
    query string ``?[query]`` unless ``keep_query``. A refusal's reason goes to the audit log, a response header
    and ``check``'s output, none of which may carry a secret the client put in the URL."""
    if "@" in text:
        start = text.find("//") + 2 if "//" in text else 0
        text = text[:start] + "[userinfo]@" + text.rpartition("@")[2]
    base, question, _ = text.partition("?")
    return text if keep_query else base + ("?[query]" if question else "")


# --- characters -----------------------------------------------------------------------------------


def _is_space(ch: str) -> bool:
    # Tab is a C0 control too, but a tab in a host is a whitespace trick, so it reports as "space".
    return ch == "\t" or unicodedata.category(ch) in ("Zs", "Zl", "Zp")


def _is_control(ch: str) -> bool:
    return unicodedata.category(ch) == "Cc"  # C0, DEL and C1


# Each check takes the text to search and what to quote in the reason (the input as the client sent
# it, which differs from the text after Unicode mapping).


def _plain_ascii(text: str) -> bool:
    """Printable ASCII has no controls and no whitespace but ' ': the common case, checked at C speed."""
    return text.isascii() and text.isprintable()


def _check_controls(text: str, what: str, shown: str) -> None:
    if _plain_ascii(text):
        return
    for ch in text:
        if _is_space(ch):
            continue  # reported as "space" by the caller that cares where spaces may be
        if _is_control(ch):
            raise _refuse("control", f"the {what} contains the control character {ch!r}", shown)


def _check_spaces(text: str, what: str, shown: str) -> None:
    if _plain_ascii(text) and " " not in text:
        return
    for ch in text:
        if _is_space(ch):
            raise _refuse("space", f"the {what} contains whitespace {ch!r}", shown)


def _check_tricks(text: str, what: str, shown: str) -> None:
    """The characters that make one authority mean different hosts to different parsers."""
    _check_controls(text, what, shown)
    _check_spaces(text, what, shown)
    if "\\" in text:
        raise _refuse("backslash", f"the {what} contains a backslash, which some parsers read as '/'", shown)
    if "@" in text:
        raise _refuse("userinfo", f"the {what} contains '@' (userinfo, or a host behind one)", shown)


def _check_host_characters(text: str, what: str, shown: str) -> None:
    _check_tricks(text, what, shown)
    if "%" in text:
        # A zone id names an interface of this machine; percent-encoding is decoded by some parsers only.
        if ":" in text:
            raise _refuse("zone-id", f"the {what} is an IPv6 literal with a zone id ('%')", shown)
        raise _refuse("percent", f"the {what} contains '%'; percent-encoded hosts are refused", shown)


# --- hosts ----------------------------------------------------------------------------------------


def normalise_host(host: str) -> tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address | None]:
    """A host as sent -> (A-label name or canonical IP text, ip or None). Raises HostFormError.

    Accepts a name, a dotted-quad IPv4, or an IPv6 literal with or without brackets (without, so that
    the output of this function is accepted again: normalising is idempotent).
    """
    name = fast_name(host)
    if name is not None:
        return name, None
    return full_normalise_host(host)


def fast_name(host: str) -> str | None:
    """The name of a host already written as its own A-label form, or None: then ``full_normalise_host`` judges it.

    The overwhelming case, and every entry of a big allowlist: lower-case LDH labels, no ``xn--`` label to
    check, not ending in a number, outside the local names, with a dot. UTS-46 maps such text to itself and
    the A-label form is the text, so nothing is mapped or encoded; the answer is exactly the full path's
    (tests/test_hosts.py checks that by property). Anything else, refusals included, takes the full path, so
    every reason is given in one place. All of it is one regular expression (``_FAST_NAME``): a million calls
    pay for one match each, not for a match and then half a dozen string tests.
    """
    if _FAST_NAME(host) is None or "xn--" in host:
        return None
    return host[:-1] if host[-1] == "." else host


def full_normalise_host(host: str) -> tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address | None]:
    """``normalise_host`` without the fast path: every form, every refusal with its reason."""
    if not host:
        raise _refuse("empty-host", "the host is empty", host)
    if len(host) > MAX_INPUT:
        raise _refuse("too-long", f"the host is longer than {MAX_INPUT} characters", host)
    _check_host_characters(host, "host", host)
    if "[" in host or "]" in host:
        return _bracketed_ipv6(host)
    if ":" in host:
        return _ipv6(host, host)
    return _normalise_name(host)


def _bracketed_ipv6(host: str) -> tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address]:
    inner = host[1:-1]
    if not (host.startswith("[") and host.endswith("]")) or "[" in inner or "]" in inner:
        raise _refuse("ipv6", "brackets in a host must enclose the whole of an IPv6 literal", host)
    if ":" not in inner:
        raise _refuse("ipv6", "brackets enclose something that is not an IPv6 literal (an IPv4?)", host)
    return _ipv6(inner, host)


def _ipv6(text: str, shown: str) -> tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address]:
    # The regex first: it keeps ipaddress from ever seeing anything but hex digits, ':' and '.'.
    if not _IPV6_TEXT.fullmatch(text):
        raise _refuse("ipv6", "not a valid IPv6 literal", shown)
    try:
        address = ipaddress.IPv6Address(text)
    except ValueError:
        raise _refuse("ipv6", "not a valid IPv6 literal", shown) from None
    # ::ffff:a.b.c.d is the IPv4 host a.b.c.d; judging it as IPv4 keeps one address one host text.
    if address.ipv4_mapped is not None:
        return str(address.ipv4_mapped), address.ipv4_mapped
    return str(address), address


def _normalise_name(host: str) -> tuple[str, ipaddress.IPv4Address | None]:
    # UTS-46 mapping first, exactly as a browser does: it lower-cases, folds full-width forms (so
    # U+3002/U+FF0E/U+FF61 become '.', and '１２７' becomes '127') and drops ignorable code points. Only
    # the mapped text says which host a browser would connect to, so every later rule judges that.
    # For letters, digits, '-' and '.' UTS-46 mapping is exactly lower-casing: skip the table walk.
    mapped = host.lower() if _PLAIN_LDH.fullmatch(host) else _uts46(host)
    # Full-width '＠', '％', '＼' map to their ASCII forms: the same tricks, spelt wider. (For ASCII
    # input this finds nothing new: the raw text passed the same check.)
    _check_host_characters(mapped, "host (after Unicode mapping)", host)

    name = mapped.removesuffix(".")  # exactly one: "example.com." is the same host as "example.com"
    if not name:
        raise _refuse("empty-host", "the host has no labels", host)
    labels = name.split(".")
    if "" in labels:
        why = "the host has an empty label ('..', a leading dot, or more than one trailing dot)"
        raise _refuse("empty-label", why, host)

    if _ends_in_number(labels):
        return _dotted_quad(labels, host)

    if "xn--" in name or not _LDH_NAME.fullmatch(name):
        name = ".".join(_a_label(label, host) for label in labels)  # label by label, with reasons
    if len(name) > MAX_NAME:
        raise _refuse("too-long", f"the name is {len(name)} octets; the limit is {MAX_NAME}", host)
    _check_name_rules(name, host)
    return name, None


def _uts46(host: str) -> str:
    try:
        return idna.uts46_remap(host, std3_rules=False, transitional=False)
    except (idna.IDNAError, UnicodeError, ValueError) as err:
        raise _refuse("non-ascii", f"the host has a code point IDNA 2008 disallows ({err})", host) from None


_PLAIN_LDH = re.compile(r"[A-Za-z0-9.-]+")
# A whole name of valid LDH labels (1-63 octets, no hyphen at either end) is its own A-label form.
_LDH_NAME = re.compile(r"(?!-)[a-z0-9-]{1,63}(?<!-)(?:\.(?!-)[a-z0-9-]{1,63}(?<!-))*")


# What fast_name takes, in one match: two or more LDH labels (1-63 octets, no hyphen at either end), at most
# 253 octets without the one trailing dot allowed; the last label not a number (decimal, or WHATWG's "0x" hex),
# and the name not one _check_name_rules refuses as local (by its ending, or whole: "home.arpa" has a dot).
# Its text is public so that patterns.py can put a pattern's leading '*.' or '.' in front of it.
LOCAL_NAMES = ("localhost", *LOCAL_SUFFIXES)  # a name that is one of these, or under one, is refused
FAST_NAME_REGEX = (
    r"(?=.{1,253}\.?\Z)"
    + "".join(rf"(?!{re.escape(name)}\.?\Z)" for name in LOCAL_NAMES if "." in name)
    + r"(?:(?!-)[a-z0-9-]{1,63}(?<!-)\.)+"
    + r"(?![0-9]+\.?\Z)(?!0x[0-9a-f]*\.?\Z)(?!-)[a-z0-9-]{1,63}(?<!-)"
    + "".join(rf"(?<!\.{re.escape(name)})" for name in LOCAL_NAMES)
    + r"\.?"
)
_FAST_NAME = re.compile(FAST_NAME_REGEX).fullmatch


def _ends_in_number(labels: list[str]) -> bool:
    """WHATWG's "ends in a number": such a host is parsed as IPv4 by browsers, whatever else it holds."""
    last = labels[-1]
    return bool(_DECIMAL.fullmatch(last) or _HEX_NUMBER.fullmatch(last))


def _dotted_quad(labels: list[str], host: str) -> tuple[str, ipaddress.IPv4Address]:
    # Only the strict a.b.c.d form is an address here. inet_aton and browsers also read 2130706433,
    # 0x7f.1, 0177.0.0.1 and 127.1 as 127.0.0.1; those spellings exist to slip past filters.
    if len(labels) != 4 or not all(_QUAD_OCTET.fullmatch(label) and int(label) <= 255 for label in labels):
        raise _refuse(
            "numeric-ipv4",
            "the host ends in a number but is not a strict dotted-quad IPv4 "
            "(decimal, octal, hex, short and leading-zero forms are refused)",
            host,
        )
    address = ipaddress.IPv4Address(".".join(labels))
    return str(address), address


def _a_label(label: str, host: str) -> str:
    if label.isascii():
        return _ascii_label(label, host)
    # A U-label: IDNA 2008 validity (code points, joiners, bidi, NFC), then Punycode.
    try:
        idna.check_label(label)
    except (idna.IDNAError, UnicodeError, ValueError) as err:
        why = f"the label {_quote(label)} is not a valid IDNA 2008 label ({err})"
        raise _refuse("non-ascii", why, host) from None
    a_label = "xn--" + label.encode("punycode").decode("ascii")
    if len(a_label) > MAX_LABEL:
        raise _refuse("too-long", f"the label {_quote(label)} is {len(a_label)} octets as an A-label", host)
    return a_label


def _ascii_label(label: str, host: str) -> str:
    # ASCII labels are checked as LDH here rather than by idna, which refuses every label with "--" in
    # positions 3-4; real hosts such as r3---sn-abc.googlevideo.com have that.
    # Underscore: browsers accept it, but no web host needs it (it marks SRV/DKIM-style service names),
    # and it is one more way for one name to be read two ways, so it is refused.
    if "_" in label:
        raise _refuse("label", f"the label {_quote(label)} contains '_', which host names do not use", host)
    if not _LDH_LABEL.fullmatch(label):
        bad = next(ch for ch in label if not _LDH_LABEL.fullmatch(ch))
        raise _refuse("label", f"the label {_quote(label)} contains {bad!r}, not allowed in host names", host)
    if label.startswith("-") or label.endswith("-"):
        raise _refuse("label", f"the label {_quote(label)} starts or ends with a hyphen", host)
    if len(label) > MAX_LABEL:
        raise _refuse("too-long", f"a label is {len(label)} octets; the limit is {MAX_LABEL}", host)
    if label.startswith("xn--"):
        # An A-label must be the canonical encoding of a valid U-label, or it is a name in disguise.
        try:
            idna.ulabel(label)
        except (idna.IDNAError, UnicodeError, ValueError) as err:
            why = f"the label {_quote(label)} is not a valid A-label ({err})"
            raise _refuse("non-ascii", why, host) from None
    return label


def _check_name_rules(name: str, host: str) -> None:
    if name == "localhost" or name.endswith(".localhost"):
        raise _refuse("localhost", "localhost names are this machine (RFC 6761), never a web host", host)
    for suffix in LOCAL_SUFFIXES:
        if name == suffix or name.endswith("." + suffix):
            raise _refuse("local-suffix", f"names under '.{suffix}' are local or internal-only", host)
    if "." not in name:
        # A single label would go through resolver search lists on many systems: an intranet name.
        raise _refuse("no-dot", "the name has no dot (a single-label, intranet-style name)", host)


# --- authorities, URLs, Host headers --------------------------------------------------------------


def _check_scheme(scheme: str, shown: str) -> str:
    lowered = scheme.lower()
    if lowered not in DEFAULT_PORTS:
        raise _refuse("scheme", f"the scheme {scheme!r} is not one of http, https, ws, wss", shown)
    return lowered


def _parse_port(text: str, shown: str) -> int:
    if text == "":
        raise _refuse("port", "the port is empty after ':'", shown)
    if text[0] in "+-":
        raise _refuse("port", "the port has a sign", shown)
    # ASCII digits only (str.isdigit would take '٣'), and few enough of them that int() stays cheap.
    if not _DECIMAL.fullmatch(text):
        raise _refuse("port", "the port is not decimal digits", shown)
    if len(text) > MAX_PORT_DIGITS:  # leading zeros included: ':000443' is refused, ':00443' is 443
        raise _refuse("port", f"the port has more than {MAX_PORT_DIGITS} digits", shown)
    if not 1 <= int(text) <= 65535:
        raise _refuse("port", "the port is outside 1..65535", shown)
    return int(text)


def _split_authority(authority: str, what: str) -> tuple[str, str | None]:
    """host[:port] or [v6][:port] -> (host text, port text or None). The port text may be ''."""
    if authority.startswith("["):
        close = authority.find("]")
        if close < 0:
            raise _refuse("ipv6", f"the {what} opens '[' but never closes it", authority)
        host, rest = authority[: close + 1], authority[close + 1 :]
        if rest and not rest.startswith(":"):
            raise _refuse("ipv6", f"the {what} has text after the ']' of an IPv6 literal", authority)
        return host, (rest[1:] if rest else None)
    if authority.count(":") > 1:
        raise _refuse("ipv6", f"the {what} has more than one ':' outside brackets (IPv6 needs [])", authority)
    host, colon, port = authority.partition(":")
    return host, (port if colon else None)


def _parse_authority_text(authority: str, what: str, port_required: bool, scheme: str) -> Target:
    _check_tricks(authority, what, authority)
    if _AUTHORITY_END.search(authority):
        raise _refuse("url", f"the {what} contains '/', '?' or '#'; it must be host[:port] only", authority)
    if not authority:
        raise _refuse("empty-host", f"the {what} is empty", authority)
    host_text, port_text = _split_authority(authority, what)
    if not host_text:
        raise _refuse("empty-host", f"the {what} has no host before ':'", authority)
    host, ip = normalise_host(host_text)
    if port_text is None:
        if port_required:
            raise _refuse("port", f"the {what} has no port, and a CONNECT must name one", authority)
        port = DEFAULT_PORTS[scheme]
    else:
        port = _parse_port(port_text, authority)
    return Target(scheme, host, port, "", ip)


def split_host_port(text: str, default_port: int | None = None, min_port: int = 1) -> tuple[str, int]:
    """An operator's ``HOST:PORT``, ``[IPv6]:PORT`` or ``:PORT`` (a listen address, a nameserver, a proxy to
    use) → (host without brackets, port). The host is not judged here (the caller knows whether it must be
    an IP, or may be empty). Without a port: ``default_port``, and then a bare IPv6 (``2001:db8::53``) is a
    host too; with none, a port is required. ValueError says what is wrong.
    """
    if text.startswith("["):
        host, close, rest = text[1:].partition("]")
        if not close or ":" not in host or "[" in host or "]" in rest:
            raise ValueError(f"got {text!r}; brackets must enclose an IPv6 address: [IPv6]:PORT")
        if rest and not rest.startswith(":"):
            raise ValueError(f"got {text!r}; expected [IPv6]:PORT")
        port_text = rest[1:] if rest else None
    elif "[" in text or "]" in text:
        raise ValueError(f"got {text!r}; brackets must enclose a whole IPv6 address: [IPv6]:PORT")
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    elif ":" in text:
        if default_port is None:
            raise ValueError(f"got {text!r}; an IPv6 address with a port needs brackets: [IPv6]:PORT")
        host, port_text = text, None
    else:
        host, port_text = text, None
    if port_text is None:
        if default_port is None:
            raise ValueError(f"got {text!r}; expected HOST:PORT")
        return host, default_port
    if not (_DECIMAL.fullmatch(port_text) and len(port_text) <= MAX_PORT_DIGITS
            and min_port <= int(port_text) <= 65535):
        raise ValueError(f"got {text!r}; port must be {min_port}-65535")
    return host, int(port_text)


def parse_authority(authority: str, scheme: str = "https") -> Target:
    """A CONNECT authority, ``host:port`` or ``[v6]:port``; the port is required."""
    scheme = _check_scheme(scheme, authority)
    return _parse_authority_text(authority, "authority", True, scheme)


def parse_host_header(value: str, scheme: str) -> tuple[str, int]:
    """A Host header -> normalised (host, port); a missing port is the scheme's default."""
    scheme = _check_scheme(scheme, value)
    target = _parse_authority_text(value, "Host header", False, scheme)
    return target.host, target.port


def parse_origin_target(host_header: str, scheme: str, path: str) -> Target:
    """An origin-form request (``GET /path`` with ``Host: host[:port]``) -> Target: the host as
    ``parse_host_header`` reads it, the path as ``parse_url`` checks it."""
    scheme = _check_scheme(scheme, host_header)
    target = _parse_authority_text(host_header, "Host header", False, scheme)
    return parse_url(f"{scheme}://{target.authority}{path}")


def host_header_agrees(target: Target, host_header: str) -> bool:
    """The Host header names the same normalised host and port as the target (a malformed one never does)."""
    try:
        return parse_host_header(host_header, target.scheme) == (target.host, target.port)
    except HostFormError:
        return False


def parse_url(url: str) -> Target:
    """An absolute-form URL as a client sent it (http, https, ws, wss) -> Target with path + query.

    Parsed by hand rather than with urlsplit, which is lenient where parsers disagree (backslashes,
    '@', missing '//'): here each of those is refused, never interpreted.
    """
    _check_controls(url, "URL", url)
    # Before the query (the first '?' ends the authority or the path, for browsers too): a backslash there is read
    # as '/' by browsers. In the query it is a character like any other, which Chromium sends as it is
    # ('?q=C:\\Users'), and which no path rule reads (review round 19: refused inside tunnels, and plain).
    if "\\" in url.split("?", 1)[0]:
        raise _refuse("backslash", "the URL contains a backslash before its query, which browsers read as '/'", url)
    match = _SCHEME.match(url)
    if match is None:
        raise _refuse("scheme", "the URL has no scheme", url)
    scheme = _check_scheme(match.group(1), url)
    rest = url[match.end() :]
    if not rest.startswith("//"):
        raise _refuse("url", "the URL has no '//' after the scheme", url)
    rest = rest[2:]
    end = _AUTHORITY_END.search(rest)
    authority, path = (rest[: end.start()], rest[end.start() :]) if end else (rest, "")
    if not authority:
        raise _refuse("empty-host", "the URL has no host after '//'", url)
    if "#" in path:
        raise _refuse("url", "the URL has a fragment, which a client never sends", url)
    if any(_is_space(ch) for ch in path):
        raise _refuse("url", "the URL's path or query contains whitespace", url)
    target = _parse_authority_text(authority, "authority", False, scheme)
    if not path.startswith("/"):
        path = "/" + path  # "" -> "/", "?q" -> "/?q": what a client puts on the request line
    return Target(scheme, target.host, target.port, path, target.ip)
