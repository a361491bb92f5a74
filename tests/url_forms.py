"""Hypothesis strategies for hostile URLs: every trick that makes two parsers read two hosts.

Built from pieces (scheme, separator, userinfo, host, port, path). Each piece is usually clean and
sometimes hostile, so a good share of URLs get through both parsers and the host itself is what gets
compared; a share of free text in a hostile alphabet covers what the pieces do not think of.
"""

from __future__ import annotations

from hypothesis import strategies as st

# Single code points that mean something to some URL or IDNA parser: delimiters, controls, spaces,
# ignorables, dot look-alikes, full-width delimiters, digits from other scripts, deviation characters,
# case and compatibility mappings, bidi and joiners, confusables, emoji, tags.
TRICKS = [
    ".", "-", "_", "@", "\\", ":", "[", "]", "#", "?", "/", "%", " ", "\t", "\n", "\r", "\x00",
    "\x7f", "\x1f", "\x85", "\u3000", "\u00a0", "\u2028", "\ufeff", "\u00ad", "\u200b", "\u200c", "\u200d",
    "\u034f", "\u180e", "\u2060", "\u3002", "\uff0e", "\uff61", "\u2024", "\ufe52", "\uff20", "\uff05", "\uff3c",
    "\uff0f", "\uff1f", "\uff03", "\uff1a", "\uff3b", "\uff3d", "\u2488", "\u2474", "\u2460", "\u2080", "\u00b9",
    "\u0660", "\u06f1", "\u0966", "\uff10", "\uff11", "\uff17", "\uff58", "\u00df", "\u03c2", "\u0130", "\u0131",
    "\u212a", "\u017f", "\ufb00", "\u2122", "\u338f", "\u2100", "\u0301", "\u05d0", "\u0627", "\u0628", "\u0661",
    "\u200e", "\u200f", "\u202e", "\U0001f4a9", "\u2764", "\u0430", "\u0435", "\u03bf", "\u1e9e", "\ua7af",
    "\u2e2e", "\u02e1", "\u1d2c", "\u24b6", "\u24d0", "\u33a1", "\u3164", "\u115f", "\ufe0f", "\U000e0041",
]
# Printable non-ASCII only: the IDNA/UTS-46 edge cases (mapped, deviation, ignored, disallowed, bidi,
# CONTEXTJ/CONTEXTO, combining marks, Hangul fillers).
IDNA_CASES = [c for c in TRICKS if not c.isascii() and c.isprintable()] + [
    "\u00e9", "e\u0301", "\u00fc", "\u0391", "\u0410", "\u4e2d", "\u6587", "\u00c5", "\u212b", "\u1e9b\u0323",
    "\u0644\u0627", "\u05d0\u05d1", "1\u05d0", "\u0f0b", "\u30fb", "\u00b7", "l\u00b7l", "\u0375", "\u05f3",
    "\u200c\u094d", "\u094d\u200d", "\ufe00", "\uff21", "\uff41", "\u2160", "\u24ea", "\u3251", "\u2f00",
    "\u1100", "\uac00", "\u0041\u030a", "\u01c4", "\u0345", "\u03d0", "\u1f80", "\ufb01", "\u00ad", "\u200c",
    "\u200d", "\u034f", "\u180b", "\u3002", "\uff0e", "\uff61",
]
SCHEMES = ["HTTP", "hTtPs", "WS", "Wss", "ftp", "file", "javascript", "h\ttp", "ht\ntp", "blob:http", "http+x",
           "https "]
SEPARATORS = ["/", "", "\\\\", "/\\", "\\/", "///", "////", "//\t", "/\n/", "\\", "\u3000//"]
USERINFO = ["u@", "u:p@", "@", ":@", "a@b@", "u%40@", "u\\@", "u@@", "\uff20", "u:@", "%40@"]
NUMBERS = ["0", "00", "1", "8", "08", "09", "010", "0177", "127", "255", "256", "0x", "0X", "0x7f", "0xff",
           "0x100", "0xg", "2130706433", "4294967295", "4294967296", "99999999999999999999", "1e1", "0.", "1_0"]
PUNY = ["xn--", "xn--zca", "xn--a", "xn--nxasmq6b", "xn--ls8h", "xn--fiqs8s", "xn--80ak6aa92e", "xn--1ca",
        "xn--ss-", "XN--ZCA", "xn--mnchen-3ya", "xn--xn--zca", "xn--d1acufc", "xn--9dbq2a", "xn--zca-", "xn---",
        "xn--55qx5d", "xn--bcher-kva", "xn--w-6fa", "xn--ab-qfa"]
ESCAPES = ["%41", "%61", "%2e", "%2E", "%00", "%25", "%zz", "%", "%c3%9f", "%ef%bc%8e", "%30", "%5b", "%40",
           "%3a", "%2f", "%5c", "%e3%80%82", "%C3%A9", "%ff", "%0a", "%20", "%7f", "%c0%ae"]
DOTS = ["\u3002", "\uff0e", "\uff61", "..", "\u2024", "\ufe52"]
SUFFIXES = [".", "..", "\u3002", "\uff0e", ". ", ".\t", ":", "::", "\u00ad", "\u200b", "."]
BAD_PORTS = ["", "0", "080", "0080", "65536", "99999", "4294967376", "+80", "-1", " 80", "8\t0", "8\n0",
             "\u0663", "\uff18\uff10", "0x50", "80 ", "80.", "1e2", "00000000000080", "80:80", "\u00b9"]
BAD_PATHS = ["#f", "/p?q#f", "\\p", "/%2e%2e/", ";x", " /", "/\u3002", "@x", "/@x", "?@x", "\t/"]
LEAD = [" ", "\t", "\x00", "\ufeff", "\n", "\x1f"]
TRAIL = [" ", "\t", "\x00", "\r\n", "\x7f"]


_ONE_IN_FOUR = st.integers(0, 3)


def _mostly(clean: st.SearchStrategy, hostile: st.SearchStrategy) -> st.SearchStrategy:
    """Three in four draws clean, one hostile. (``one_of(clean, clean, clean, hostile)`` would not do:
    hypothesis merges the repeated branch. Strategies are built once, at import: building them inside
    a draw makes hypothesis validate them on every call.)"""

    @st.composite
    def pick(draw):
        return draw(hostile) if draw(_ONE_IN_FOUR) == 0 else draw(clean)

    return pick()


_ASCII_LABEL = st.text("abcdefghijklmnopqrstuvwxyzABCXYZ0123456789-", min_size=1, max_size=8)
_IDNA_LABEL = st.lists(st.one_of(_ASCII_LABEL, st.sampled_from(IDNA_CASES)), min_size=1, max_size=4).map("".join)
_TRICK_LABEL = st.lists(st.one_of(_ASCII_LABEL, st.sampled_from(TRICKS), st.sampled_from(ESCAPES)),
                        min_size=1, max_size=4).map("".join)
_LABEL = _mostly(st.one_of(_ASCII_LABEL, _IDNA_LABEL),
                 st.one_of(st.sampled_from(PUNY), st.sampled_from(NUMBERS), st.sampled_from(ESCAPES), _TRICK_LABEL))
_DOT = _mostly(st.just("."), st.sampled_from(DOTS))
_SUFFIX = _mostly(st.just(""), st.sampled_from(SUFFIXES))


@st.composite
def names(draw) -> str:
    parts = draw(st.lists(_LABEL, min_size=draw(_mostly(st.just(2), st.just(1))), max_size=4))
    return parts[0] + "".join(draw(_DOT) + part for part in parts[1:]) + draw(_SUFFIX)


def _number(value: int, style: str) -> str:
    return {"dec": str(value), "oct": "0" + oct(value)[2:], "hex": hex(value), "HEX": "0X" + format(value, "X"),
            "pad": "00" + str(value)}[style]


_V4_STYLE = st.sampled_from(["dec", "dec", "dec", "dec", "oct", "hex", "HEX", "pad"])
_V4_PART = st.one_of(st.integers(0, 255), st.sampled_from([0, 1, 127, 255, 256, 65535, 16777216]))
_U32 = st.integers(0, 2**32 + 5)
_V4_SUFFIX = _mostly(st.just(""), st.sampled_from([".", "..", "\u3002", "\uff0e"]))


@st.composite
def ipv4_forms(draw) -> str:
    count = draw(_mostly(st.just(4), st.sampled_from([1, 2, 3, 5])))
    style = draw(_mostly(st.just("dec"), _V4_STYLE))  # one style for the address, or one per part
    mixed = draw(_ONE_IN_FOUR) == 0
    if count == 1:
        parts = [_number(draw(_U32), draw(_V4_STYLE) if mixed else style)]
    else:
        parts = [_number(draw(_V4_PART), draw(_V4_STYLE) if mixed else style) for _ in range(count)]
    return ".".join(parts) + draw(_V4_SUFFIX)


_V6_GROUP = st.one_of(st.integers(0, 0xFFFF).map(lambda n: format(n, "x")),
                      st.sampled_from(["0", "FFFF", "0000", "00001", "fe80", "64", "ff9b", "12345", "g", ""]))
_V6_TAIL = st.sampled_from(["127.0.0.1", "1.2.3.4", "0177.0.0.1", "127.1", "255.255.255.255", "256.0.0.0",
                            "1.2.3", "::", "0x7f.0.0.1"])
_ZONE = st.sampled_from(["%25eth0", "%eth0", "%251", "%", "%2525", "%25lo"])
_V6_PREFIX = st.sampled_from(["", "", "", "", "::ffff:", "::", "64:ff9b::", "2002:", "::ffff:0:", "0:0:0:0:0:ffff:"])


@st.composite
def ipv6_forms(draw) -> str:
    groups = draw(st.lists(_V6_GROUP, min_size=0, max_size=9))
    text = ":".join(groups)
    if draw(st.booleans()):
        at = draw(st.integers(0, len(groups)))
        text = ":".join(groups[:at]) + "::" + ":".join(groups[at:])
    prefix = draw(_V6_PREFIX)
    if prefix or draw(st.integers(0, 3)) == 0:
        text = prefix + draw(_V6_TAIL) if prefix else (
            text + (":" if text and not text.endswith(":") else "") + draw(_V6_TAIL))
    if draw(st.integers(0, 7)) == 0:
        text += draw(_ZONE)
    if draw(st.integers(0, 5)) == 0:
        text = text.upper()
    shape = draw(st.integers(0, 9))
    if shape == 0:
        return text  # without brackets
    if shape == 1:
        return "[" + text  # unbalanced
    if shape == 2:
        return "[" + text + "]]"
    if shape == 3:
        return "[" + text + "].x"
    return "[" + text + "]"


_FREE = st.text(st.one_of(st.sampled_from(TRICKS), st.sampled_from("abcxyz019:/.-[]"),
                          st.characters(exclude_categories=("Cs",))), max_size=24)
HOSTS = _mostly(st.one_of(names(), ipv4_forms()), st.one_of(ipv6_forms(), _FREE))
_PORT = _mostly(st.one_of(st.none(), st.integers(1, 65535).map(str)), st.sampled_from(BAD_PORTS))
_PATH = _mostly(st.sampled_from(["", "/", "/p", "/p?q", "?q"]), st.sampled_from(BAD_PATHS))
_CLEAN_SCHEME = st.sampled_from(["http", "http", "https", "https", "ws", "wss"])


@st.composite
def urls(draw) -> str:
    """Three URLs in four keep a clean frame (scheme://host[:port]/path), so the host is what gets tested;
    the fourth also bends the frame (scheme, separator, userinfo, whitespace or controls around it)."""
    host = draw(HOSTS)
    port = draw(_PORT)
    authority = host if port is None else f"{host}:{port}"
    path = draw(_PATH)
    if draw(_ONE_IN_FOUR):
        return f"{draw(_CLEAN_SCHEME)}://{authority}{path}"
    scheme = draw(st.one_of(_CLEAN_SCHEME, st.sampled_from(SCHEMES)))
    separator = draw(st.one_of(st.just("//"), st.sampled_from(SEPARATORS)))
    userinfo = draw(_mostly(st.just(""), st.sampled_from(USERINFO)))
    lead = draw(_mostly(st.just(""), st.sampled_from(LEAD)))
    trail = draw(_mostly(st.just(""), st.sampled_from(TRAIL)))
    return f"{lead}{scheme}:{separator}{userinfo}{authority}{path}{trail}"
