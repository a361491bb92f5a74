"""The ClientHello reader: a present but unreadable server_name refuses, never passes as "no SNI"."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tls_build import ECH, client_hello, extension, real_client_hello, server_name_body

from proxy.tls_hello import MAX_HELLO_BYTES, HelloError, read_client_hello


def test_a_real_client_hello_gives_its_name():
    info = read_client_hello(real_client_hello("public.lab.example"))
    assert info is not None and info.sni == "public.lab.example" and not info.ech


def test_a_real_client_hello_without_sni_is_no_sni():
    info = read_client_hello(real_client_hello(None))
    assert info is not None and info.sni is None


def test_names_are_normalised():
    assert read_client_hello(client_hello(b"WWW.Example.COM")).sni == "www.example.com"


@pytest.mark.parametrize("body, why", [
    (server_name_body(b"example.com "), "surrounding spaces"),
    (server_name_body(b" example.com"), "surrounding spaces"),
    (server_name_body(b"example.com."), "trailing dot"),
    (server_name_body(b"a" * 64 + b".example.com"), "not a valid host name"),
    (server_name_body(b"one.example", b"two.example"), "more than one name"),
    (server_name_body(b"example.com", name_type=1), "type 1"),
    (server_name_body(b""), "empty"),
    (server_name_body(b"exa\xc3\x9fmple.com"), "not ASCII"),
    (server_name_body(b"ex\x00ample.com"), "not a valid host name"),
    (server_name_body(b"example.com")[:-2], "does not match"),
    (b"\x00", "too short"),
])
def test_an_unreadable_server_name_refuses(body, why):
    with pytest.raises(HelloError) as err:
        read_client_hello(client_hello(sni_body=body))
    # mitmproxy's structural parser refuses some of these itself (its own reason); either way: refused
    assert err.value.rule in ("tls:sni", "tls:invalid-hello")
    assert why in err.value.reason or err.value.rule == "tls:invalid-hello"


def test_two_server_name_extensions_refuse():
    with pytest.raises(HelloError, match="twice"):
        read_client_hello(client_hello(b"a.example", extra=(extension(0, server_name_body(b"b.example")),)))


def test_encrypted_client_hello_is_seen():
    assert read_client_hello(client_hello(b"a.example", extra=(extension(ECH, b"\x00" * 40),))).ech


@pytest.mark.parametrize("kind", [0xFE08, 0xFE0A, 0xFE0C, 0xFFCE])
@pytest.mark.parametrize("sni", [b"a.example", None])
def test_a_drafts_ech_and_esni_count_as_encrypted_client_hello(kind, sni):
    """Only 0xfe0d was read as ECH: a ClientHello carrying ESNI (0xffce; Firefox sent it without an SNI) or a
    draft's ECH code point went through where tls.ech refuses ECH (review round 17), to a server that honours it."""
    assert read_client_hello(client_hello(sni, extra=(extension(kind, b"\x00" * 40),))).ech


@pytest.mark.parametrize("kind", [0xFE07, 0xFE0E, 0xFFCD, 0x0010])
def test_other_extensions_are_not_encrypted_client_hello(kind):
    assert not read_client_hello(client_hello(b"a.example", extra=(extension(kind, b"\x00" * 4),))).ech


@pytest.mark.parametrize("size", [1, 7, 50])
def test_a_hello_split_over_records_and_writes_is_read_whole_only(size):
    data = client_hello(b"split.example", record_size=size)
    for cut in range(len(data)):
        if cut < 3 and cut:
            assert read_client_hello(data[:cut]) is None  # a first byte alone is only a start
        elif cut:
            assert read_client_hello(data[:cut]) is None, cut
    assert read_client_hello(data).sni == "split.example"


def test_not_tls_refuses_at_the_first_byte():
    with pytest.raises(HelloError) as err:
        read_client_hello(b"G")
    assert err.value.rule == "tls:not-tls"


def test_another_handshake_message_refuses():
    data = bytearray(client_hello(b"a.example"))
    data[5] = 2  # ServerHello
    with pytest.raises(HelloError, match="not a ClientHello"):
        read_client_hello(bytes(data))


def test_an_endless_hello_is_bounded():
    header = b"\x16\x03\x01\x40\x00"  # a 16 KiB record, and the handshake says 16 MiB
    data = header + b"\x01\xff\xff\xff" + bytes(16 * 1024 - 4)
    data += (header + bytes(16 * 1024)) * 2
    with pytest.raises(HelloError) as err:
        read_client_hello(data)
    assert err.value.rule == "tls:hello-too-large" and len(data) > MAX_HELLO_BYTES


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=600))
def test_arbitrary_bytes_never_crash_and_never_pass_without_a_hello(data):
    try:
        info = read_client_hello(b"\x16\x03\x01" + data)
    except HelloError:
        return
    if info is not None:  # only when the bytes really hold a ClientHello
        assert data[2:3] == b"\x01" or len(data) > 2


@settings(max_examples=200, deadline=None)
@given(st.from_regex(r"[a-z][a-z0-9-]{0,20}(\.[a-z][a-z0-9-]{0,20}){1,3}", fullmatch=True),
       st.integers(min_value=1, max_value=300))
def test_any_valid_name_survives_any_split(name, size):
    if name.split(".")[-1].endswith("-") or any(label.endswith("-") for label in name.split(".")):
        return
    data = client_hello(name.encode(), record_size=size)
    assert read_client_hello(data).sni == name


@pytest.mark.parametrize("extra", [b"\x01", client_hello(b"b.example")[5:]])
def test_bytes_after_the_hello_in_its_own_record_are_refused(extra):
    """One record held the ClientHello for a.example and a second for b.example: the transports relayed the whole
    record, so the origin got a hello nobody judged (review round 17). A client sends nothing after its hello
    before the server answers."""
    hello = client_hello(b"a.example")
    handshake = hello[5:] + extra
    record = b"\x16\x03\x01" + len(handshake).to_bytes(2, "big") + handshake
    with pytest.raises(HelloError) as refused:
        read_client_hello(record)
    assert refused.value.rule == "tls:invalid-hello" and f"holds {len(extra)} more bytes" in refused.value.reason
    assert read_client_hello(hello + b"\x17\x03\x03\x00\x01x").size == len(hello)  # a next record stays apart
