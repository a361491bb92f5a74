"""policy.hosts: the one normaliser from what a client sent to a Target."""

from __future__ import annotations

import ast
import ipaddress
import pickle
import re

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from policy.hosts import (
    DEFAULT_PORTS,
    HostFormError,
    Target,
    fast_name,
    full_normalise_host,
    host_header_agrees,
    normalise_host,
    parse_authority,
    parse_host_header,
    parse_url,
    split_host_port,
)

FORMS = {
    "scheme", "userinfo", "backslash", "percent", "zone-id", "control", "space", "non-ascii",
    "empty-label", "numeric-ipv4", "no-dot", "localhost", "local-suffix", "port", "ipv6",
    "empty-host", "too-long", "label", "url",
}  # fmt: skip

# (function, input, expected form). Functions by name keep the ids readable.
PARSERS = {
    "host": normalise_host,
    "url": parse_url,
    "connect": parse_authority,
    "header": lambda value: parse_host_header(value, "https"),
}

REFUSED = [
    # scheme
    ("url", "ftp://example.com/", "scheme"),
    ("url", "file:///etc/passwd", "scheme"),
    ("url", "//example.com/", "scheme"),
    ("url", "example.com/", "scheme"),
    ("url", "", "scheme"),
    # userinfo
    ("url", "http://user@example.com/", "userinfo"),
    ("url", "http://user:pass@example.com/", "userinfo"),
    ("url", "http://good.com@evil.com/", "userinfo"),
    ("connect", "user@example.com:443", "userinfo"),
    ("header", "a@example.com", "userinfo"),
    ("host", "evil.com\uff20good.com", "userinfo"),  # full-width '@' maps to '@'
    # backslash
    ("url", "http://evil.com\\@good.com/", "backslash"),
    ("url", "http://example.com/a\\b", "backslash"),
    ("connect", "example.com\\x:443", "backslash"),
    ("host", "example.com\\", "backslash"),
    # percent
    ("host", "exa%6Dple.com", "percent"),
    ("url", "http://%65xample.com/", "percent"),
    ("host", "example\uff05.com", "percent"),  # full-width '%'
    # zone-id
    ("url", "http://[fe80::1%25eth0]/", "zone-id"),
    ("connect", "[fe80::1%eth0]:443", "zone-id"),
    ("host", "fe80::1%25eth0", "zone-id"),
    # control: C0, DEL, C1, anywhere in the URL
    ("url", "http://exa\x00mple.com/", "control"),
    ("url", "http://example.com/\r\nX-Injected: 1", "control"),
    ("url", "http://example.com\x7f/", "control"),
    ("host", "example.com\x85", "control"),
    ("connect", "example.com:443\n", "control"),
    # space: any whitespace in the host or authority, tab and Unicode spaces included
    ("host", "exa mple.com", "space"),
    ("host", "example.com\t", "space"),
    ("host", "example\u3000com", "space"),
    ("host", "example\u00a0.com", "space"),
    ("host", "example\u2028.com", "space"),
    ("url", "http://example.com /", "space"),
    ("connect", " example.com:443", "space"),
    # non-ascii that does not IDNA-encode
    ("host", "\U0001f4a9.example", "non-ascii"),
    ("host", "a\u200db.example", "non-ascii"),  # ZWJ out of context
    ("host", "\u2488.example", "non-ascii"),  # disallowed by UTS-46
    ("host", "xn--ls8h.example", "non-ascii"),  # decodes to a disallowed emoji
    ("host", "xn--zz.example", "non-ascii"),  # not Punycode at all
    ("host", "xn--bcher-kva.xn--bcher-kv.example", "non-ascii"),
    ("host", "xn---bcher-kva.example", "non-ascii"),  # non-canonical spelling
    # empty-label
    ("host", "a..b.example", "empty-label"),
    ("host", ".a.example", "empty-label"),
    ("host", "example.com..", "empty-label"),
    ("host", "example\u3002\u3002com", "empty-label"),  # ideographic full stops
    # numeric-ipv4: legacy forms, and names that end in a number
    ("host", "2130706433", "numeric-ipv4"),
    ("host", "0177.0.0.1", "numeric-ipv4"),
    ("host", "0x7f.1", "numeric-ipv4"),
    ("host", "0x7f.0.0.1", "numeric-ipv4"),
    ("host", "127.1", "numeric-ipv4"),
    ("host", "0", "numeric-ipv4"),
    ("host", "010.0.0.1", "numeric-ipv4"),
    ("host", "256.0.0.1", "numeric-ipv4"),
    ("host", "1.2.3.4.5", "numeric-ipv4"),
    ("host", "example.123", "numeric-ipv4"),
    ("host", "example.0x1f", "numeric-ipv4"),
    ("host", "example.0x", "numeric-ipv4"),
    ("host", "127\u30021", "numeric-ipv4"),  # full-width dot: judged after mapping
    ("url", "http://2130706433/", "numeric-ipv4"),
    # no-dot
    ("host", "intranet", "no-dot"),
    ("host", "intranet.", "no-dot"),
    ("header", "intranet:8080", "no-dot"),
    # localhost
    ("host", "localhost", "localhost"),
    ("host", "LOCALHOST.", "localhost"),
    ("host", "app.localhost", "localhost"),
    ("host", "\uff4c\uff4f\uff43\uff41\uff4c\uff48\uff4f\uff53\uff54", "localhost"),  # full-width
    ("url", "http://localhost:8080/", "localhost"),
    # local-suffix
    ("host", "printer.local", "local-suffix"),
    ("host", "db.internal", "local-suffix"),
    ("host", "nas.home.arpa", "local-suffix"),
    ("host", "home.arpa", "local-suffix"),
    ("host", "box.localdomain", "local-suffix"),
    # port
    ("connect", "example.com", "port"),  # CONNECT must name one
    ("connect", "[::1]", "port"),
    ("url", "http://example.com:/", "port"),
    ("url", "http://example.com:+80/", "port"),
    ("url", "http://example.com:-80/", "port"),
    ("url", "http://example.com:0/", "port"),
    ("url", "http://example.com:65536/", "port"),
    ("url", "http://example.com:000443/", "port"),  # more than five digits
    ("url", "http://example.com:0x50/", "port"),
    ("url", "http://example.com:8\u0668/", "port"),  # an Arabic-Indic digit
    ("header", "example.com:http", "port"),
    # ipv6
    ("url", "http://[::1/", "ipv6"),
    ("url", "http://[::1]x/", "ipv6"),
    ("url", "http://[127.0.0.1]/", "ipv6"),  # brackets around IPv4
    ("url", "http://[example.com]/", "ipv6"),
    ("url", "http://[1:2:3:4:5:6:7:8:9]/", "ipv6"),
    ("url", "http://[::g]/", "ipv6"),
    ("url", "http://::1/", "ipv6"),  # missing brackets in an authority
    ("connect", "::1:443", "ipv6"),
    ("host", "[::1", "ipv6"),
    ("host", "a[::1]", "ipv6"),
    # empty-host
    ("host", "", "empty-host"),
    ("host", ".", "empty-host"),
    ("host", "\u200b", "empty-host"),  # an ignorable code point maps to nothing
    ("url", "http:///path", "empty-host"),
    ("url", "http://:80/", "empty-host"),
    ("connect", ":443", "empty-host"),
    ("header", "", "empty-host"),
    # too-long
    ("host", "a" * 64 + ".example", "too-long"),
    ("host", ".".join(["a" * 63] * 4) + ".example", "too-long"),
    ("host", "\u00fc" * 60 + ".example", "too-long"),  # short U-label, long A-label
    ("host", "a" * 2000 + ".example", "too-long"),
    # label
    ("host", "a_b.example", "label"),
    ("host", "_dmarc.example.com", "label"),
    ("host", "-a.example", "label"),
    ("host", "a-.example", "label"),
    ("host", "a!b.example", "label"),
    ("host", "a\uff1ab.example", "label"),  # full-width ':' maps to ':'
    ("host", "\u2100.example", "label"),  # U+2100 maps to "a/c"
    # url
    ("url", "http:example.com/", "url"),
    ("url", "http:/example.com/", "url"),
    ("url", "http://example.com/#frag", "url"),
    ("url", "http://example.com#frag", "url"),
    ("url", "http://example.com/a b", "url"),
    ("connect", "example.com:443/path", "url"),
    ("header", "example.com/", "url"),
]


def _refused_id(case: tuple[str, str, str]) -> str:
    parser, text, form = case
    return f"{form}-{parser}-{text[:30]!r}"


def test_every_form_is_tested():
    assert {form for _, _, form in REFUSED} == FORMS


@pytest.mark.parametrize("case", REFUSED, ids=[_refused_id(c) for c in REFUSED])
def test_refused_form(case):
    parser, text, form = case
    with pytest.raises(HostFormError) as caught:
        PARSERS[parser](text)
    err = caught.value
    assert err.form == form, err.reason
    assert err.reason.startswith(f"{form}: ")
    assert str(err) == err.reason
    # The reason quotes (part of) the input as the client sent it, repr'd and truncated; a user name and
    # password (before an '@') and a query as policy.hosts.for_logs writes them, never as sent.
    quoted = re.search(r"\(got ('.*'|\".*\")(\.\.\.)?\)$", err.reason, re.S)
    assert quoted, err.reason
    shown = ast.literal_eval(quoted.group(1))
    if "@" in text or "?" in text:
        assert "[userinfo]@" in shown or "?[query]" in shown, shown
        if "@" in text:  # all before the last '@' (after a '//') is gone, whatever it was
            assert shown.count("@") == 1 and "[userinfo]@" in shown, shown
    else:
        assert shown in text


def test_reason_quote_is_truncated_and_escaped():
    with pytest.raises(HostFormError) as caught:
        normalise_host("a\x00" + "b" * 500)
    assert len(caught.value.reason) < 200
    assert "\\x00" in caught.value.reason and "\x00" not in caught.value.reason


def test_error_pickles():
    err = HostFormError("userinfo", "userinfo: no")
    copy = pickle.loads(pickle.dumps(err))
    assert (copy.form, copy.reason, str(copy)) == ("userinfo", "userinfo: no", "userinfo: no")
    assert isinstance(copy, ValueError)


# --- names ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given_host", "expected"),
    [
        ("b\u00fccher.example", "xn--bcher-kva.example"),
        ("xn--bcher-kva.example", "xn--bcher-kva.example"),
        ("XN--BCHER-KVA.Example", "xn--bcher-kva.example"),
        ("B\u00dcCHER.example", "xn--bcher-kva.example"),
        ("fa\u00df.example", "xn--fa-hia.example"),  # IDNA 2008: not fass.example
        ("xn--fa-hia.example", "xn--fa-hia.example"),
        ("\u043f\u0440\u0438\u043c\u0435\u0440.\u0440\u0444", "xn--e1afmkfd.xn--p1ai"),
        ("Example.COM", "example.com"),
        ("example.com.", "example.com"),
        ("\uff25\uff38\uff21\uff2d\uff30\uff2c\uff25.com", "example.com"),  # full-width letters
        ("\u212aelvin.example", "kelvin.example"),  # Kelvin sign
        ("exa\u00admple.com", "example.com"),  # soft hyphen is ignored, as browsers do
        ("b\u00fccher\u3002example", "xn--bcher-kva.example"),  # U+3002
        ("b\u00fccher\uff0eexample", "xn--bcher-kva.example"),  # U+FF0E
        ("b\u00fccher\uff61example", "xn--bcher-kva.example"),  # U+FF61
        ("example.com\u3002", "example.com"),  # a full-width trailing dot is the one trailing dot
        ("r3---sn-4g5e6nsz.googlevideo.com", "r3---sn-4g5e6nsz.googlevideo.com"),  # "--" at 3-4
        ("1e100.net", "1e100.net"),
        ("0x.example.com", "0x.example.com"),  # only the LAST label decides "ends in a number"
        ("123.example.com", "123.example.com"),
        ("a" * 63 + ".example", "a" * 63 + ".example"),
    ],
)
def test_name_normalised(given_host, expected):
    assert normalise_host(given_host) == (expected, None)


def test_max_name_length_is_accepted():
    name = ".".join(["a" * 63] * 3 + ["b" * 61])  # 253 octets
    assert len(name) == 253
    assert normalise_host(name + ".") == (name, None)


# --- IP literals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given_host", "expected"),
    [
        ("127.0.0.1", ipaddress.ip_address("127.0.0.1")),
        ("0.0.0.0", ipaddress.ip_address("0.0.0.0")),  # classified by addresses.py, not here
        ("255.255.255.255", ipaddress.ip_address("255.255.255.255")),
        ("127.0.0.1.", ipaddress.ip_address("127.0.0.1")),
        ("127\u30020\u30020\u30021", ipaddress.ip_address("127.0.0.1")),  # judged as an IP, not a name
        ("127\uff0e0\uff0e0\uff0e1", ipaddress.ip_address("127.0.0.1")),
        ("\uff11\uff12\uff17.0.0.1", ipaddress.ip_address("127.0.0.1")),  # full-width digits
        ("[::1]", ipaddress.ip_address("::1")),
        ("::1", ipaddress.ip_address("::1")),
        ("[0:0:0:0:0:0:0:1]", ipaddress.ip_address("::1")),
        ("[2001:DB8:0:0:0:0:0:1]", ipaddress.ip_address("2001:db8::1")),
        ("[::ffff:127.0.0.1]", ipaddress.ip_address("127.0.0.1")),  # mapped: unwrapped
        ("[::FFFF:7f00:1]", ipaddress.ip_address("127.0.0.1")),
        ("[::127.0.0.1]", ipaddress.ip_address("::7f00:1")),  # IPv4-compatible: not unwrapped
    ],
)
def test_ip_literal(given_host, expected):
    host, ip = normalise_host(given_host)
    assert ip == expected
    assert type(ip) is type(expected)
    assert host == str(expected)


def test_ipv6_target():
    target = parse_url("http://[0:0:0:0:0:0:0:1]:8080/x")
    assert (target.host, target.port, target.ip) == ("::1", 8080, ipaddress.IPv6Address("::1"))
    assert target.is_ip
    assert target.authority == "[::1]:8080"
    assert target.url() == "http://[::1]:8080/x"


def test_mapped_target_is_ipv4():
    target = parse_authority("[::ffff:10.0.0.1]:443")
    assert target.ip == ipaddress.IPv4Address("10.0.0.1")
    assert target.authority == "10.0.0.1:443"


# --- URLs, authorities, Host headers ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://example.com", Target("http", "example.com", 80, "/")),
        ("http://example.com/", Target("http", "example.com", 80, "/")),
        ("https://example.com", Target("https", "example.com", 443, "/")),
        ("ws://example.com/chat", Target("ws", "example.com", 80, "/chat")),
        ("wss://example.com/chat", Target("wss", "example.com", 443, "/chat")),
        ("HTTPS://Example.COM:8443/A/b?C=d&e", Target("https", "example.com", 8443, "/A/b?C=d&e")),
        ("http://example.com?q=1", Target("http", "example.com", 80, "/?q=1")),
        ("http://example.com:0080/", Target("http", "example.com", 80, "/")),
        ("http://example.com/@user/%2e%2e?x=%40", Target("http", "example.com", 80, "/@user/%2e%2e?x=%40")),
        ("http://good.com?@evil.com/", Target("http", "good.com", 80, "/?@evil.com/")),
        ("http://b\u00fccher.example./", Target("http", "xn--bcher-kva.example", 80, "/")),
        (
            "http://1.2.3.4:65535/",
            Target("http", "1.2.3.4", 65535, "/", ipaddress.IPv4Address("1.2.3.4")),
        ),
    ],
)
def test_parse_url(url, expected):
    assert parse_url(url) == expected


def test_target_helpers():
    target = parse_url("https://example.com/a?b")
    assert not target.is_ip
    assert target.authority == "example.com:443"
    assert target.url() == "https://example.com:443/a?b"


def test_parse_authority():
    assert parse_authority("Example.com:443") == Target("https", "example.com", 443)
    assert parse_authority("example.com:80", "http") == Target("http", "example.com", 80)
    assert parse_authority("[::1]:1") == Target("https", "::1", 1, "", ipaddress.IPv6Address("::1"))
    with pytest.raises(HostFormError) as caught:
        parse_authority("example.com:443", "gopher")
    assert caught.value.form == "scheme"


@pytest.mark.parametrize(
    ("value", "scheme", "expected"),
    [
        ("example.com", "http", ("example.com", 80)),
        ("example.com", "https", ("example.com", 443)),
        ("example.com", "wss", ("example.com", 443)),
        ("Example.com.:8080", "http", ("example.com", 8080)),
        ("[::1]", "https", ("::1", 443)),
        ("b\u00fccher.example", "https", ("xn--bcher-kva.example", 443)),
    ],
)
def test_parse_host_header(value, scheme, expected):
    assert parse_host_header(value, scheme) == expected


@pytest.mark.parametrize(
    ("url", "header", "agrees"),
    [
        ("https://example.com/", "example.com", True),
        ("https://example.com/", "EXAMPLE.com.", True),
        ("https://example.com/", "example.com:443", True),
        ("http://example.com/", "example.com:80", True),
        ("http://example.com:8080/", "example.com:8080", True),
        ("https://xn--bcher-kva.example/", "b\u00fccher.example", True),
        ("http://[::1]/", "[0::1]:80", True),
        ("https://example.com/", "example.com:8443", False),
        ("http://example.com:8080/", "example.com", False),
        ("https://example.com/", "example.org", False),
        ("https://example.com/", "www.example.com", False),
        ("https://example.com/", "example.com@evil.com", False),  # malformed never agrees
        ("https://example.com/", "", False),
        ("http://[::1]/", "::1", False),  # a Host header needs the brackets
    ],
)
def test_host_header_agrees(url, header, agrees):
    assert host_header_agrees(parse_url(url), header) is agrees


def test_host_header_agrees_with_connect_target():
    target = parse_authority("example.com:443")
    assert host_header_agrees(target, "example.com:443")
    assert host_header_agrees(target, "example.com")
    assert not host_header_agrees(target, "example.com:80")


# --- properties -----------------------------------------------------------------------------------

SAFE_HOST = re.compile(r"[a-z0-9.-]+")

# Characters that matter to host parsing, so generated input hits the interesting paths often.
TRICKY = (
    "abcxyzABC019-._:[]%@\\/?#+ \t\n\x00\x7f\x85"
    "\u00df\u00fc\u0130\u212a\u00ad\u200b\u200c\u200d\u3000\u00a0"
    "\u3002\uff0e\uff61\uff20\uff05\uff1a\uff3b\uff3d\uff11\uff10\u2100\u2488\u0668\u05d0"
)
tricky_text = st.text(alphabet=st.sampled_from(TRICKY), max_size=30)
any_text = st.one_of(st.text(max_size=40), tricky_text)

label = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,8}[a-z0-9])?", fullmatch=True)
unicode_label = st.sampled_from(
    ["b\u00fccher", "fa\u00df", "m\u00fcnchen", "\u043f\u0440\u0438\u043c\u0435\u0440", "\u4f8b\u3048",
     "\u03b5\u03bb\u03bb\u03ac\u03b4\u03b1", "\uff25\uff38\uff21\uff2d\uff30\uff2c\uff25", "xn--bcher-kva"]
)  # fmt: skip
separator = st.sampled_from([".", ".", ".", "\u3002", "\uff0e", "\uff61"])


@st.composite
def likely_names(draw):
    labels = draw(st.lists(st.one_of(label, unicode_label), min_size=1, max_size=4))
    labels.append(draw(st.sampled_from(["com", "org", "example", "xn--p1ai", "COM"])))
    name = labels[0]
    for part in labels[1:]:
        name += draw(separator) + part
    return name + draw(st.sampled_from(["", "", "."]))


def _ip_text(address: ipaddress.IPv4Address | ipaddress.IPv6Address, bracket: bool) -> str:
    if address.version == 6:
        return f"[{address.exploded}]" if bracket else str(address)
    return str(address)


likely_hosts = st.one_of(
    likely_names(),
    st.builds(_ip_text, st.ip_addresses(), st.booleans()),
    st.builds(lambda a: f"::ffff:{a}", st.ip_addresses(v=4)),
)
hosts = st.one_of(likely_hosts, any_text, st.builds(str.__add__, likely_names(), tricky_text))

ports = st.one_of(st.just(""), st.integers(0, 70000).map(lambda p: f":{p}"), tricky_text.map(":".__add__))
paths = st.one_of(st.just(""), st.just("/"), st.text(max_size=20).map("/".__add__), tricky_text)


def _in_url(host: str) -> str:
    """A host as it goes into a URL authority: an unbracketed IPv6 needs brackets there."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


urls = st.one_of(
    any_text,
    st.builds(
        lambda scheme, host, port, path: f"{scheme}://{host}{port}{path}",
        st.sampled_from([*DEFAULT_PORTS, "HTTP", "ftp", "http:", ""]),
        st.one_of(likely_hosts.map(_in_url), hosts),
        ports,
        paths,
    ),
)


def _assert_well_formed(target: Target) -> None:
    assert target.scheme in DEFAULT_PORTS
    assert 1 <= target.port <= 65535
    if target.ip is None:
        assert SAFE_HOST.fullmatch(target.host), target.host
        assert not target.host.endswith(".")
    else:
        assert ipaddress.ip_address(target.host) == target.ip
        assert str(target.ip) == target.host
        assert getattr(target.ip, "ipv4_mapped", None) is None


@given(urls)
@example("http://[::ffff:127.0.0.1]:80/")
@example("http://b\u00fccher\u3002example/")
def test_property_parse_url_returns_safe_target_or_refuses(url):
    try:
        target = parse_url(url)
    except HostFormError as err:
        assert err.form in FORMS
        assert err.reason.startswith(err.form + ": ")
        return
    _assert_well_formed(target)
    assert target.path.startswith("/")
    assert "#" not in target.path


@given(any_text, st.sampled_from(list(DEFAULT_PORTS)))
def test_property_authority_and_header_never_raise_anything_else(text, scheme):
    for parse in (parse_authority, parse_host_header):
        try:
            parse(text, scheme)
        except HostFormError as err:
            assert err.form in FORMS


@given(hosts)
@example("127\u30020\u30020\u30021")
@example("::ffff:1.2.3.4")
@example("xn--fa-hia.example.")
def test_property_normalise_host_is_idempotent(host):
    try:
        first = normalise_host(host)
    except HostFormError as err:
        assert err.form in FORMS
        return
    name, ip = first
    if ip is None:
        assert SAFE_HOST.fullmatch(name)
    else:
        assert str(ip) == name
    assert normalise_host(name) == first


# Names near the fast path's edges: LDH labels up to and past 63 octets, upper case, 'xn--' and '--', a
# numeric or hex last label, the local names, one trailing dot or two, empty labels, a single label.
edge_label = st.one_of(
    st.from_regex(r"[a-z0-9-]{1,12}", fullmatch=True),
    st.from_regex(r"[a-zA-Z0-9_-]{1,6}", fullmatch=True),
    st.sampled_from(["xn--p1ai", "xn--bcher-kva", "xn--zz", "r3---sn-abc", "0x7f", "0x", "0xg1", "08", "255",
                     "localhost", "local", "internal", "localdomain", "home", "arpa", "-a", "a-", "", "a" * 63,
                     "b" * 64, "ü", "A"]),
)


@st.composite
def edge_names(draw):
    labels = draw(st.lists(edge_label, min_size=1, max_size=6))
    if draw(st.booleans()):
        labels.append(draw(st.sampled_from(["com", "local", "internal", "home.arpa", "localhost", "1", "0x1f"])))
    if draw(st.integers(0, 9)) == 0:  # past the 253-octet limit, or just below it
        labels = ["c" * 63] * draw(st.integers(3, 4)) + labels
    return ".".join(labels) + draw(st.sampled_from(["", "", ".", ".."]))


def _outcome(normalise, host):
    try:
        return normalise(host)
    except HostFormError as err:
        return ("refused", err.form, err.reason)


@given(st.one_of(edge_names(), hosts))
@example("a." * 126 + "b")  # 253 octets
@example("a." * 126 + "bc")  # 254 octets
@example("r3---sn-abc.googlevideo.com")
@example("x.home.arpa")
@example("home.arpa")
@example("a.0x")
@example("home.arpa.")  # the local names, also with the trailing dot, and names that only look like them
@example("a.b.local.")
@example("x.localhost")
@example("a.localdomainx")
@example("localhost.com")
@example("a.1.")
@example("a.0x1f.")
@example("a.0xg")
@example("a-.com")
@example("a." * 126 + "b.")  # 253 octets and the trailing dot
def test_property_fast_path_accepts_only_what_the_full_path_accepts_alike(host):
    """The fast path (already-normal LDH names) is a shortcut, never a second opinion: whatever it
    accepts, the full UTS-46 path accepts too, as the same name; it never takes what the full path refuses."""
    fast = fast_name(host)
    full = _outcome(full_normalise_host, host)
    if fast is not None:
        assert full == (fast, None), (host, fast, full)
    assert _outcome(normalise_host, host) == full  # with the fast path in front, the same answer or refusal


@given(st.one_of(edge_names(), hosts), st.sampled_from(["", "*.", "."]))
@example("a.example.", "*.")  # the fast path's edges behind each prefix
@example("home.arpa", ".")
@example("x.home.arpa.", "*.")
@example("xn--a.example", "*.")
@example(".example.com", ".")
@example("*.example.com", "*.")
@example("a." * 126 + "b", ".")
def test_property_pattern_fast_path_agrees_with_the_full_path(host, prefix):
    from policy.patterns import HostPattern, PatternKind, normalise_pattern_host

    text = prefix + host
    try:
        pattern = HostPattern.parse(text)
    except ValueError:
        pattern = None
    kind = {"": PatternKind.EXACT, "*.": PatternKind.SUBDOMAINS, ".": PatternKind.DOMAIN}[prefix]
    try:
        name, ip = normalise_pattern_host(host)  # the full path: normalise_host's fast path is checked above
        full_ok = "*" not in host and (ip is None or kind is PatternKind.EXACT)
    except HostFormError:
        full_ok = False
    if pattern is None:
        assert not full_ok, text
    else:
        assert full_ok and (pattern.kind, pattern.name, pattern.text) == (kind, name, text), (text, pattern)


@given(likely_hosts.map(_in_url), st.integers(1, 65535), st.sampled_from(list(DEFAULT_PORTS)))
def test_property_authority_round_trips(host, port, scheme):
    try:
        target = parse_url(f"{scheme}://{host}:{port}/")
    except HostFormError:
        return
    again = parse_authority(target.authority, target.scheme)
    assert (again.host, again.port, again.ip) == (target.host, target.port, target.ip)
    assert host_header_agrees(target, target.authority)


# --- HOST:PORT as operators write it (listen addresses, nameservers, --proxy) ----------------------------

@pytest.mark.parametrize("text, default, expected", [
    ("127.0.0.1:3128", None, ("127.0.0.1", 3128)),
    ("proxy.example.com:8080", None, ("proxy.example.com", 8080)),
    ("[::1]:9090", None, ("::1", 9090)),
    (":3128", None, ("", 3128)),
    ("10.0.0.53", 53, ("10.0.0.53", 53)),
    ("2001:db8::53", 53, ("2001:db8::53", 53)),  # a bare IPv6 is a host when a default port applies
    ("[2001:db8::53]", 53, ("2001:db8::53", 53)),
    ("[fd00::53]:5353", 53, ("fd00::53", 5353)),
])
def test_split_host_port(text: str, default: int | None, expected: tuple[str, int]) -> None:
    assert split_host_port(text, default) == expected


@pytest.mark.parametrize("text, default, words", [
    ("127.0.0.1", None, "expected HOST:PORT"),
    ("::1:3128", None, "needs brackets"),  # which colon is the port's? never guessed
    ("[::1]3128", None, "expected [IPv6]:PORT"),
    ("[127.0.0.1]:80", None, "brackets must enclose an IPv6"),
    ("[::1", None, "brackets must enclose"),
    ("h:0", None, "port must be 1-65535"),
    ("h:65536", None, "port must be 1-65535"),
    ("h:+80", None, "port must be"),
    ("h:٨٠", None, "port must be"),  # Arabic-Indic digits: str.isdigit() would say yes
    ("h:", None, "port must be"),
    ("h:000000080", None, "port must be"),
])
def test_split_host_port_refuses(text: str, default: int | None, words: str) -> None:
    with pytest.raises(ValueError, match=re.escape(words)):
        split_host_port(text, default)


def test_split_host_port_may_allow_port_zero_for_listeners() -> None:
    assert split_host_port("127.0.0.1:0", min_port=0) == ("127.0.0.1", 0)


@given(st.one_of(st.ip_addresses().map(str), st.from_regex(r"[a-z0-9-]{1,20}(\.[a-z0-9-]{1,20}){1,3}", fullmatch=True)),
       st.integers(1, 65535))
def test_split_host_port_round_trip(host: str, port: int) -> None:
    written = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    assert split_host_port(written) == (host, port)
    assert split_host_port(written, default_port=53) == (host, port)


@given(any_text, st.one_of(st.none(), st.integers(1, 65535)))
def test_split_host_port_returns_or_raises_value_error(text: str, default: int | None) -> None:
    try:
        host, port = split_host_port(text, default)
    except ValueError:
        return
    assert 1 <= port <= 65535 and "]" not in host


@pytest.mark.parametrize(("text", "words"), [
    ("http://example.com:000443/", "more than 5 digits"),  # 443 with zeros: not 'outside 1..65535'
    ("http://example.com:123456/", "more than 5 digits"),
    ("http://example.com:65536/", "outside 1..65535"),
    ("http://example.com:0/", "outside 1..65535"),
])
def test_a_port_refusal_says_what_is_wrong_with_it(text: str, words: str) -> None:
    with pytest.raises(HostFormError) as caught:
        parse_url(text)
    assert words in caught.value.reason, caught.value.reason
    assert parse_url("http://example.com:00443/").port == 443  # five digits, leading zeros: the port 443
