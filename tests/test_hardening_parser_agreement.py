"""Parser agreement: egresswall and the browser never read one URL as two different hosts.

Real Chromium's URL parser (``new URL()`` in an about:blank page, batches of URLs in one call) says
which scheme, host and port it would connect to; ``policy.hosts.parse_url`` says what egresswall
decides about. Whenever the two differ (after the two spellings that are the same host: one trailing
dot, an IPv4-mapped IPv6 literal) egresswall must have refused the URL. It may refuse more than
Chromium (it is strict by design); it must never accept a URL and mean another host.

Hypothesis generates the URLs (tests/url_forms.py: backslashes, '@', %-escapes, dots and full-width
dots, IDNA edge cases, numeric forms, IPv6 forms, ports, trailing dots, whitespace, control
characters). Both transports are held to it: ``parse_url`` of the URL is what the gate decides on, and for a
URL the plain-HTTP fast path takes as an absolute-form request target (proxy/http_head.py), the target it
hands the gate (proxy/gate.py ``plain_target``) must read the same host too.
EGRESSWALL_PARSER_BATCHES=N runs N batches of 100 instead of the default 30 batches of 50.
"""

from __future__ import annotations

import os
import random

import pytest
from chromium_url import ChromiumUrlParser, Where, chromium_path
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from url_forms import urls

from policy.hosts import HostFormError, parse_url
from proxy.fast_http import ask_of
from proxy.gate import plain_target
from proxy.http_head import PlainRequest, take_head

pytestmark = pytest.mark.integration

BATCHES = int(os.environ.get("EGRESSWALL_PARSER_BATCHES", "0"))
BATCH_SIZE = 100 if BATCHES else 50


@pytest.fixture(scope="module")
def chromium():
    if chromium_path() is None:
        pytest.skip("Debian's chromium is not installed (ci/install.sh --all installs it)")
    parser = ChromiumUrlParser()
    yield parser
    parser.close()


def disagreement(url: str, chromium_reads: Where | None) -> str | None:
    """None when egresswall is safe on ``url``: it refused, or it reads the host Chromium connects to."""
    try:
        target = parse_url(url)
    except HostFormError:
        return None  # refusing is always safe
    if chromium_reads is None:
        # Chromium would not connect at all (it rejects the URL; e.g. its bidi rule spans the whole
        # name, idna's is per label). egresswall decides on the host it connects to: no second reading.
        return None
    ours = Where(target.scheme, target.host, target.port)
    if ours != chromium_reads:
        return f"{url!r}: egresswall accepts it as {ours}, Chromium connects to {chromium_reads}"
    return None


def fast_path_disagreement(url: str, chromium_reads: Where | None) -> str | None:
    """None when the fast path is safe on ``url`` sent as an absolute-form request target: it does not take
    it (mitmproxy's path then decides, held by ``disagreement``), the gate refuses what it hands over, or
    the host it hands over is the one Chromium connects to."""
    try:
        head = b"GET " + url.encode("ascii") + b" HTTP/1.1\r\nHost: h\r\n\r\n"
    except UnicodeEncodeError:
        return None  # not an HTTP/1.1 request target at all
    request = take_head(head)
    if not isinstance(request, PlainRequest):
        return None
    try:
        target = plain_target(ask_of(request, "client"))
    except HostFormError:
        return None
    if chromium_reads is None:
        return None
    ours = Where(target.scheme, target.host, target.port)
    if ours != chromium_reads:
        return f"{url!r}: the fast path hands the gate {ours}, Chromium connects to {chromium_reads}"
    return None


def check_batch(chromium: ChromiumUrlParser, batch: list[str]) -> list[str]:
    wheres = chromium.where(batch)
    problems = [p for url, where in zip(batch, wheres, strict=True) if (p := disagreement(url, where))]
    problems += [p for url, where in zip(batch, wheres, strict=True) if (p := fast_path_disagreement(url, where))]
    # What the proxy then receives is Chromium's canonical form (absolute-form request or CONNECT
    # authority): egresswall must read that one as the same host too, or refuse it.
    canonical = [f"{r['protocol']}//{_authority(r)}/" for r in chromium.parse(batch) if r is not None]
    canonical_wheres = chromium.where(canonical)
    problems += [p for url, where in zip(canonical, canonical_wheres, strict=True) if (p := disagreement(url, where))]
    problems += [p for url, where in zip(canonical, canonical_wheres, strict=True)
                 if (p := fast_path_disagreement(url, where))]
    return problems


def _authority(result: dict) -> str:
    return result["hostname"] + (":" + result["port"] if result["port"] else "")


# ---- regression seeds: every kind of disagreement found, and egresswall's refusal of it ------------------
# (url, what Chromium 156 reads as scheme/host/port, the form egresswall refuses it as). The first block
# came out of hypothesis runs of this file (shortest example of each kind); the rest are the classic
# filter bypasses written by hand.
DISAGREEMENTS = [
    ("http://\\p", ("http", "p", 80), "backslash"),
    ("ws:\\\\@G/p", ("ws", "g", 80), "backslash"),
    ("wss://\xb1\\p", ("wss", "xn--oba", 443), "backslash"),
    ("http://1:8\n0/", ("http", "0.0.0.1", 80), "control"),  # Chromium strips tab/LF anywhere
    ("ws://\x11:400@x", ("ws", "x", 80), "control"),
    ("ht\ntp://\xcc/p?q", ("http", "xn--dda", 80), "control"),
    ("http:///p", ("http", "p", 80), "empty-host"),  # extra slashes are skipped by Chromium
    ("ws://7..y/", ("ws", "7..y", 80), "empty-label"),
    ("ws://1.229../", ("ws", "1.229.", 80), "empty-label"),
    ("wss://\u180b.\u1d2c:233", ("wss", ".a", 233), "empty-label"),  # ignored code point leaves an empty label
    ("ws://[::0x7f.0.0.1]/p", ("ws", "::7f00:1", 80), "ipv6"),  # hex IPv4 inside IPv6, accepted by Chromium
    ("https://[::ffff:0177.0.0.1]", ("https", "127.0.0.1", 443), "ipv6"),
    ("https://`?q", ("https", "`", 443), "label"),
    ("http://LPT1;x", ("http", "lpt1;x", 80), "label"),
    ("http://ubal-/", ("http", "ubal-", 80), "label"),
    ("ws://x/p", ("ws", "x", 80), "no-dot"),
    ("wss://\xc7\xe0/", ("wss", "xn--0can", 443), "no-dot"),
    ("http://\xbb3", ("http", "xn--3-nda", 80), "non-ascii"),
    ("ws://xn--ab-qfa", ("ws", "xn--ab-qfa", 80), "non-ascii"),
    ("https://j\xe2M!:9/", ("https", "xn--jm!-ila", 9), "non-ascii"),
    ("wss://6/", ("wss", "0.0.0.6", 443), "numeric-ipv4"),
    ("ws://26341", ("ws", "0.0.102.229", 80), "numeric-ipv4"),
    ("wss://5.3\uff0e", ("wss", "5.0.0.3", 443), "numeric-ipv4"),
    ("wss://%61.0lz/", ("wss", "a.0lz", 443), "percent"),  # Chromium percent-decodes hosts
    ("http://8.%30\u3002lmC/p?q", ("http", "8.0.lmc", 80), "percent"),
    ("http://%C3%A9.2hn2Z/", ("http", "xn--9ca.2hn2z", 80), "percent"),
    ("https://py.B4lyhYq:", ("https", "py.b4lyhyq", 443), "port"),  # an empty port is the default to Chromium
    ("http://1.1.0.2:0/p?q", ("http", "1.1.0.2", 0), "port"),
    ("\thttp://0./p?q ", ("http", "0.0.0.0", 80), "scheme"),  # leading/trailing whitespace is stripped
    (" http://[::149c]/p", ("http", "::149c", 80), "scheme"),
    ("http://x.\t", ("http", "x", 80), "space"),
    ("wss://35915 /", ("wss", "35915%20", 443), "space"),
    ("http://0:#f", ("http", "0.0.0.0", 80), "url"),
    ("http:/\xb0\xbb5:585#f", ("http", "xn--5-0ca7a", 585), "url"),  # one slash is enough for Chromium
    ("http://i@x", ("http", "x", 80), "userinfo"),
    ("Wss://\xac:080@x", ("wss", "x", 443), "userinfo"),
    # classic bypasses
    ("http://evil.example\\@good.example/", ("http", "evil.example", 80), "backslash"),
    ("http://good.example@evil.example/", ("http", "evil.example", 80), "userinfo"),
    ("http://good.example\uff20evil.example/", None, "userinfo"),  # full-width '@': Chromium rejects the URL
    ("http://2130706433/", ("http", "127.0.0.1", 80), "numeric-ipv4"),
    ("http://0x7f.1/", ("http", "127.0.0.1", 80), "numeric-ipv4"),
    ("http://0177.0.0.1/", ("http", "127.0.0.1", 80), "numeric-ipv4"),
    ("http://127.1/", ("http", "127.0.0.1", 80), "numeric-ipv4"),
    ("http://\uff10\uff58\uff17\uff46.1/", ("http", "127.0.0.1", 80), "numeric-ipv4"),  # full-width hex
    ("http://127.0.0.1\u3002\u3002/", ("http", "127.0.0.1.", 80), "empty-label"),
    ("http://exa\tmple.example/", ("http", "example.example", 80), "space"),
    ("http://example.example:8\t0/", ("http", "example.example", 80), "space"),
    ("http://[fe80::1%25eth0]/", None, "zone-id"),  # Chromium rejects zone ids
    ("http://%31%32%37.0.0.1/", ("http", "127.0.0.1", 80), "percent"),
    ("http:example.example/", ("http", "example.example", 80), "url"),
    ("http://localhost./", ("http", "localhost", 80), "localhost"),
    ("http://metadata.google.internal/", ("http", "metadata.google.internal", 80), "local-suffix"),
]

# Both parsers accept these and read the same host: proof the comparison is not vacuous (the
# normalising of trailing dots and mapped IPv6, IDNA deviation characters, full-width forms).
AGREEMENTS = [
    ("http://1.2.3.4./", ("http", "1.2.3.4", 80)),
    ("http://1.2.3.4\u3002/", ("http", "1.2.3.4", 80)),
    ("http://example.com\u3002/", ("http", "example.com", 80)),
    ("http://exa\u00admple.com/", ("http", "example.com", 80)),  # soft hyphen is ignored by both
    ("http://fa\u00df.de/", ("http", "xn--fa-hia.de", 80)),  # non-transitional: ß stays ß
    ("http://\u03c2.com/", ("http", "xn--3xa.com", 80)),
    ("http://\u1e9e.com/", ("http", "xn--zca.com", 80)),
    ("http://\u0130stanbul.tr/", ("http", "xn--istanbul-o0e.tr", 80)),
    ("http://XN--ZCA.com/", ("http", "xn--zca.com", 80)),
    ("http://\uff25\uff38\uff21\uff2d\uff30\uff2c\uff25\uff0e\uff23\uff2f\uff2d/", ("http", "example.com", 80)),
    ("http://\uff11\uff12\uff17.\uff10.\uff10.\uff11/", ("http", "127.0.0.1", 80)),
    ("http://a\u3002b\uff0ec\uff61d/", ("http", "a.b.c.d", 80)),
    ("http://[::ffff:7f00:1]/", ("http", "127.0.0.1", 80)),
    ("http://[::FFFF:127.0.0.1]:0080/", ("http", "127.0.0.1", 80)),
    ("http://[::1.2.3.4]/", ("http", "::102:304", 80)),
    ("http://[64:ff9b::127.0.0.1]/", ("http", "64:ff9b::7f00:1", 80)),
    ("http://1.2.3.4:080/", ("http", "1.2.3.4", 80)),
    ("ws://example.com:443/", ("ws", "example.com", 443)),
    ("http://example.com?@evil.com", ("http", "example.com", 80)),
    ("http://r3---sn-abc.googlevideo.com/", ("http", "r3---sn-abc.googlevideo.com", 80)),
]


@pytest.mark.parametrize(("url", "chromium_reads", "form"), DISAGREEMENTS, ids=[ascii(c[0]) for c in DISAGREEMENTS])
def test_disagreement_seed_is_refused(url, chromium_reads, form):
    with pytest.raises(HostFormError) as refused:
        parse_url(url)
    assert refused.value.form == form


def test_seeds_show_real_disagreements(chromium):
    """The recorded Chromium readings still hold (most of them: a newer Chromium may read a seed
    otherwise, and egresswall must refuse it either way), so the seeds are disagreements, not guesses."""
    seeds = [(url, reads) for url, reads, _ in DISAGREEMENTS if reads is not None]
    found = chromium.where([url for url, _ in seeds])
    same = [url for (url, reads), where in zip(seeds, found, strict=True) if where == Where(*reads)]
    assert len(same) >= 0.8 * len(seeds), set(url for url, _ in seeds) - set(same)


def test_agreement_seeds_read_the_same_host(chromium):
    batch = [url for url, _ in AGREEMENTS]
    for (url, expected), where in zip(AGREEMENTS, chromium.where(batch), strict=True):
        target = parse_url(url)
        assert Where(target.scheme, target.host, target.port) == Where(*expected), url
        assert where == Where(*expected), f"{url!r}: Chromium now reads {where}"


def test_the_fast_path_takes_plain_seeds_and_reads_them_as_chromium_does(chromium):
    """The fast path's check is not vacuous: the ASCII http:// agreement seeds are taken by it (a head of
    that form goes to the fast path), and what it hands the gate is what Chromium connects to."""
    seeds = [(url, expected) for url, expected in AGREEMENTS if url.startswith("http://") and url.isascii()]
    taken = 0
    for (url, expected), where in zip(seeds, chromium.where([url for url, _ in seeds]), strict=True):
        request = take_head(b"GET " + url.encode() + b" HTTP/1.1\r\nHost: h\r\n\r\n")
        if isinstance(request, PlainRequest):
            taken += 1
            target = plain_target(ask_of(request, "client"))
            assert Where(target.scheme, target.host, target.port) == Where(*expected) == where, url
    assert taken >= len(seeds) // 2, f"the fast path took {taken} of {len(seeds)} plain seeds"


def test_seeds_are_safe_together(chromium):
    assert check_batch(chromium, [url for url, _, _ in DISAGREEMENTS] + [url for url, _ in AGREEMENTS]) == []


@settings(max_examples=BATCHES or 30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(batch=st.lists(urls(), min_size=BATCH_SIZE, max_size=BATCH_SIZE))
def test_generated_urls_never_mean_two_hosts(chromium, batch):
    assert check_batch(chromium, batch) == []


def test_random_unicode_names_never_mean_two_hosts(chromium):
    """A seeded sweep of names made of random code points from every plane: where IDNA tables of two
    Unicode versions (Python's idna, Chromium's ICU) could map one name to two A-labels."""
    rng = random.Random(9)

    def char() -> str:
        while True:
            c = chr(rng.choice([rng.randint(0x80, 0x2FFF), rng.randint(0x3000, 0xFFFF), rng.randint(0x10000, 0x1FFFF),
                                rng.randint(0xE0000, 0xE01EF)]))
            if not 0xD800 <= ord(c) <= 0xDFFF:
                return c

    def label() -> str:
        return "".join(rng.choice([char(), rng.choice("abcxyz09-"), char()]) for _ in range(rng.randint(1, 4)))

    problems, agreed = [], 0
    for _ in range(10):
        batch = [f"http://{label()}.{rng.choice(['com', 'example', label()])}/" for _ in range(500)]
        problems += check_batch(chromium, batch)
        agreed += sum(1 for url in batch if _accepted(url))
    assert problems == []
    assert agreed > 500  # a sweep that egresswall refuses whole would prove nothing


def _accepted(url: str) -> bool:
    try:
        parse_url(url)
    except HostFormError:
        return False
    return True
