"""proxy/mitm_hostnames.py: mitmproxy's host readers take what they took, and beside it only an all-ASCII name
the core's normaliser accepts (an IDNA 2008 A-label such as xn--fa-hia), handed on as written."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from mitmproxy.net import check
from mitmproxy.net.http import url

from policy.hosts import HostFormError, normalise_host
from proxy import mitm_hostnames

ORIGINAL_PARSE, ORIGINAL_VALID = url.parse_authority, check.is_valid_host


@pytest.fixture(autouse=True)
def installed():
    already = bool(mitm_hostnames._originals)
    mitm_hostnames.install()
    yield
    if not already:
        mitm_hostnames.uninstall()


def _outcome(function, *args):
    try:
        return function(*args)
    except (ValueError, UnicodeError) as err:
        return type(err)


LABELS = st.sampled_from(["xn--fa-hia", "xn--strae-oqa", "xn--bcher-kva", "xn--a", "xn--zca", "xn--ls8h", "faß",
                          "bücher", "example", "EXAMPLE", "a_b", "-x", "1", "0x7f", "", "xn--", "ß", "ａ"])
AUTHORITIES = st.builds(lambda labels, port: ".".join(labels) + port,
                        st.lists(LABELS, min_size=1, max_size=4), st.sampled_from(["", ":80", ":0", ":x", ":"]))


@given(AUTHORITIES)
@example("xn--fa-hia.example:80")
@example("[::1]:443")
def test_parse_authority_keeps_every_answer_of_the_original_and_adds_only_core_names(authority):
    for value in (authority.encode("utf-8"), authority):
        before = _outcome(ORIGINAL_PARSE, value, True)
        after = _outcome(url.parse_authority, value, True)
        if not isinstance(before, type):
            assert after == before
        elif not isinstance(after, type):
            host = after[0]
            assert value.isascii() and host.isascii()
            assert host == authority.rsplit(":", 1)[0] if ":" in authority else host == authority
            try:
                assert normalise_host(host)[1] is None
            except HostFormError as err:  # pragma: no cover - the assertion's message
                raise AssertionError(f"{authority!r} read as {host!r}, which the core refuses: {err}") from None


@given(st.lists(LABELS, min_size=1, max_size=4).map(".".join))
def test_is_valid_host_adds_only_names_the_core_reads(host):
    for value in (host, host.encode("utf-8")):
        if ORIGINAL_VALID(value):
            assert check.is_valid_host(value)
        elif check.is_valid_host(value):
            assert value.isascii()
            assert normalise_host(host)[1] is None


def test_the_idna2008_names_are_read_and_garbage_is_not():
    assert url.parse_authority(b"xn--fa-hia.example:443", True) == ("xn--fa-hia.example", 443)
    assert url.parse_authority(b"xn--bcher-kva.example", True) == ("bücher.example", None)  # as mitmproxy reads it
    for bad in (b"xn--a.example:80", b"xn--xxx-.example:80", "faß.example:80".encode()):
        with pytest.raises(ValueError):
            url.parse_authority(bad, True)
    assert check.is_valid_host(b"xn--fa-hia.example") and not ORIGINAL_VALID(b"xn--fa-hia.example")


def test_uninstall_gives_mitmproxy_its_own_readers_back():
    mitm_hostnames.uninstall()
    try:
        assert url.parse_authority is ORIGINAL_PARSE and check.is_valid_host is ORIGINAL_VALID
        assert url.is_valid_host is ORIGINAL_VALID
    finally:
        mitm_hostnames.install()
