"""The HelloRetryRequest question (proxy/tls_retry.py), on real flights from Python's TLS stack and on
hand-made and random bytes."""

from __future__ import annotations

import functools
import ssl

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tls_build import ECH, client_hello, counted_record_headers, extension, padded_hello
from tls_flights import first_hello, is_hello_retry, retry_handshake, server_first_flight

from proxy.tls_hello import HelloError, read_client_hello
from proxy.tls_retry import (
    AWAIT_RETRY,
    AWAIT_SERVER,
    COMPAT_CHANGE_CIPHER_SPEC,
    HELLO_RETRY,
    HELLO_RETRY_RANDOM,
    MAX_SERVER_FIRST_BYTES,
    NEED_MORE,
    NOT_RETRY,
    RetryWatch,
    classify_server_first,
    judge_retry_hello,
    read_retry_hello,
)

ANSWERS = {NEED_MORE, HELLO_RETRY, NOT_RETRY}


@functools.cache
def handshake():
    flights = retry_handshake()
    assert is_hello_retry(flights.retry), "the secp384r1-only server did not send a HelloRetryRequest"
    return flights


@functools.cache
def plain_server_hello(maximum: ssl.TLSVersion | None = None) -> bytes:
    return server_first_flight(maximum)


def records(handshake_message: bytes, size: int) -> bytes:
    """A handshake message cut into handshake records of ``size`` bytes."""
    return b"".join(b"\x16\x03\x03" + len(handshake_message[i:i + size]).to_bytes(2, "big")
                    + handshake_message[i:i + size] for i in range(0, len(handshake_message), size))


# ---- the server's first answer -------------------------------------------------------------------------


def test_a_real_hello_retry_request_is_told_only_once_its_random_is_in():
    retry = handshake().retry
    for cut in range(43):
        assert classify_server_first(retry[:cut]) == NEED_MORE, cut
    assert classify_server_first(retry[:43]) == HELLO_RETRY
    assert classify_server_first(retry) == HELLO_RETRY


@pytest.mark.parametrize("maximum", [None, ssl.TLSVersion.TLSv1_2], ids=["tls1.3", "tls1.2"])
def test_a_real_server_hello_is_not_a_retry(maximum):
    flight = plain_server_hello(maximum)
    assert not is_hello_retry(flight)
    assert classify_server_first(flight[:42]) == NEED_MORE
    assert classify_server_first(flight[:43]) == NOT_RETRY


@pytest.mark.parametrize("size", [1, 5, 37, 38])
def test_a_server_hello_split_over_records_is_put_together(size):
    retry = handshake().retry
    message = retry[5:5 + int.from_bytes(retry[3:5], "big")]
    split = records(message, size)
    assert classify_server_first(split) == HELLO_RETRY
    assert classify_server_first(split[:len(split) - 1]) in (NEED_MORE, HELLO_RETRY)


def test_an_alert_asks_nothing_again():
    assert classify_server_first(b"\x15\x03\x03\x00\x02\x02\x70") == NOT_RETRY
    assert classify_server_first(b"\x15") == NEED_MORE  # a first read of one byte: the next says if it is TLS


@pytest.mark.parametrize("answer", [b"HTTP/1.1 400 Bad Request\r\n", b"220 mail.example ESMTP\r\n", b"\x17\x03\x03",
                                    b"\x14\x03\x03\x00\x01\x01", b"\x15\x00", b"\x80\x2e\x02"],
                         ids=["http", "smtp-greeting", "application-data", "change-cipher-spec", "alert-not-tls",
                              "sslv2"])
def test_an_answer_that_is_no_tls_handshake_or_alert_record_is_refused(answer):
    """A TLS server answers a ClientHello with a handshake record or an alert; a service that answers anything
    else (and reads on) would be driven in its own protocol through a tunnel passed as TLS (review round 19)."""
    with pytest.raises(HelloError) as caught:
        classify_server_first(answer)
    assert caught.value.rule == "tls:server-hello" and "not TLS" in caught.value.reason


def test_a_first_handshake_message_other_than_server_hello_asks_nothing_again():
    assert classify_server_first(client_hello(b"public.lab.example")) == NOT_RETRY  # (an echo of the hello)


@pytest.mark.parametrize("data, words", [
    (b"\x16\x03\x03\x00\x00", "length 0"),
    (b"\x16\x03\x03\x40\x01" + b"\x02", "length 16385"),
    (b"\x16\x04\x03\x00\x30", "not a TLS handshake record"),
    (b"\x16\x03\x03\x00\x05\x02\x00\x00\x01\x03", "too short"),
    (b"\x16\x03\x03\x00\x30\x02\x00\x00\x40\x7f\x03", "legacy_version 7f03"),
    (b"\x16\x03\x03\x00\x01\x02\x15\x03\x03\x00\x02", "not a TLS handshake record"),
], ids=["empty-record", "oversized-record", "bad-version", "short-hello", "bad-legacy-version", "then-alert"])
def test_a_handshake_record_that_cannot_be_read_is_refused_with_a_reason(data, words):
    with pytest.raises(HelloError) as raised:
        classify_server_first(data)
    assert raised.value.rule == "tls:server-hello" and words in raised.value.reason


def test_a_retry_with_a_legacy_version_other_than_tls12_is_refused():
    retry = bytearray(handshake().retry)
    retry[10] = 0x01
    with pytest.raises(HelloError, match="legacy_version"):
        classify_server_first(bytes(retry))


@settings(max_examples=500)
@given(st.binary(max_size=400))
def test_random_server_bytes_never_crash_the_classifier(data):
    try:
        answer = classify_server_first(data)
    except HelloError as err:
        assert err.rule == "tls:server-hello" and err.reason
        return
    assert answer in ANSWERS
    if len(data) >= MAX_SERVER_FIRST_BYTES:
        assert answer != NEED_MORE


@settings(max_examples=300)
@given(st.integers(min_value=1, max_value=60), st.binary(max_size=200))
def test_a_retry_in_records_of_any_size_with_anything_after_it_is_a_retry(size, after):
    retry = handshake().retry
    message = retry[5:5 + int.from_bytes(retry[3:5], "big")]
    assert classify_server_first(records(message, size) + after) == HELLO_RETRY


@settings(max_examples=300)
@given(st.binary(min_size=38, max_size=38), st.binary(max_size=40))
def test_a_record_header_then_any_bytes_is_answered_without_waiting_past_the_bound(body, after):
    data = b"\x16\x03\x03\x00\x26" + body + after
    try:
        assert classify_server_first(data) in (HELLO_RETRY, NOT_RETRY)
    except HelloError as err:
        assert err.reason


def _outcome(data: bytes) -> str:
    try:
        return classify_server_first(data)
    except HelloError as err:
        return err.rule


@settings(max_examples=300)
@given(st.sampled_from([b"\x02", b"\x01", b"\x0b"]), st.integers(min_value=0, max_value=80),
       st.sampled_from([b"\x03\x03", b"\x03\x01", b"\x7f\x17"]), st.booleans(), st.binary(max_size=60),
       st.integers(min_value=1, max_value=50))
def test_a_message_read_in_one_record_or_in_many_gets_the_same_answer(kind, length, version, retry_random, tail, size):
    random = HELLO_RETRY_RANDOM if retry_random else bytes(32)
    message = kind + length.to_bytes(3, "big") + version + random + tail
    assert _outcome(records(message, len(message))) == _outcome(records(message, size))


# ---- the client's second ClientHello -------------------------------------------------------------------


def test_the_real_second_hello_after_its_change_cipher_spec_is_read_whole():
    second = handshake().second
    assert second.startswith(COMPAT_CHANGE_CIPHER_SPEC)
    for cut in range(len(second)):
        assert read_retry_hello(second[:cut]) is None, cut
    hello = read_retry_hello(second)
    assert hello is not None and hello.sni == "public.lab.example" and hello.size == len(second)


def test_a_second_hello_without_change_cipher_spec_is_read_too():
    second = handshake().second[len(COMPAT_CHANGE_CIPHER_SPEC):]
    hello = read_retry_hello(second + b"\x17\x03\x03\x00\x01x")
    assert hello is not None and hello.size == len(second)


@pytest.mark.parametrize("data, rule, words", [
    (COMPAT_CHANGE_CIPHER_SPEC * 2, "tls:retry-hello-invalid", "type 20"),
    (b"\x14\x03\x03\x00\x02\x01\x01", "tls:retry-hello-invalid", "one-byte record"),
    (b"\x14\x03\x01", "tls:retry-hello-invalid", "one-byte record"),
    (b"\x17\x03\x03\x00\x05hello", "tls:retry-hello-invalid", "type 23"),
    (COMPAT_CHANGE_CIPHER_SPEC + client_hello(b"public.lab.example ", ), "tls:sni", "second ClientHello"),
    (b"\x16\x03\x03\x00\x04\x02\x00\x00\x00", "tls:invalid-hello", "not a ClientHello"),
], ids=["two-ccs", "long-ccs", "ccs-old-version", "application-data", "bad-sni", "not-client-hello"])
def test_a_second_hello_that_cannot_be_read_is_refused_with_a_reason(data, rule, words):
    with pytest.raises(HelloError) as raised:
        read_retry_hello(data)
    assert raised.value.rule == rule and words in raised.value.reason


def test_a_second_hello_must_name_the_server_the_first_named():
    other = read_client_hello(first_hello("other.lab.example"))
    none = read_client_hello(first_hello(None))
    same = read_client_hello(first_hello("public.lab.example"))
    assert judge_retry_hello("public.lab.example", same, ech_allowed=False) is None
    assert judge_retry_hello(None, none, ech_allowed=False) is None
    changed = judge_retry_hello("public.lab.example", other, ech_allowed=True)
    assert changed.rule == "tls:retry-hello-changed" and "other.lab.example" in changed.reason
    assert judge_retry_hello("public.lab.example", none, ech_allowed=True).rule == "tls:retry-hello-changed"
    assert judge_retry_hello(None, same, ech_allowed=True).rule == "tls:retry-hello-changed"


def test_a_second_hello_obeys_the_first_hellos_ech_rule():
    with_ech = read_client_hello(client_hello(b"public.lab.example", extra=(extension(ECH, bytes(48)),)))
    assert judge_retry_hello("public.lab.example", with_ech, ech_allowed=True) is None
    refused = judge_retry_hello("public.lab.example", with_ech, ech_allowed=False)
    assert refused.rule == "tls:ech" and "second ClientHello" in refused.reason


# ---- the watch, fed as a relay feeds it ----------------------------------------------------------------


def test_after_a_plain_server_hello_everything_held_goes_on():
    watch = RetryWatch("public.lab.example", False, held_client=b"early")
    assert watch.from_client(b" bytes").to_server == b""
    flight = plain_server_hello()
    assert watch.from_server(flight[:20]).to_client == b""
    released = watch.from_server(flight[20:])
    assert (released.to_client, released.to_server, released.refused) == (flight, b"early bytes", None)
    assert watch.done and watch.from_client(b"x").to_server == b"x" and watch.from_server(b"y").to_client == b"y"


@pytest.mark.parametrize("cut", [0, 1, 6, 7, 100, -1])
def test_after_a_retry_the_same_second_hello_goes_on_wherever_it_is_cut(cut):
    flights = handshake()
    watch = RetryWatch("public.lab.example", False)
    released = watch.from_server(flights.retry)
    assert released.to_client == flights.retry and watch.phase == AWAIT_RETRY
    assert watch.from_server(b"more").to_client == b"more"  # the server's bytes flow once it has asked
    cut = cut % len(flights.second)
    first_part = watch.from_client(flights.second[:cut])
    assert first_part.to_server == b"" and first_part.refused is None
    last = watch.from_client(flights.second[cut:])
    assert last.to_server == flights.second and last.refused is None and watch.done


def test_held_client_bytes_are_judged_as_the_second_hello_when_the_retry_comes():
    flights = handshake()
    watch = RetryWatch("public.lab.example", False, held_client=flights.second)
    released = watch.from_server(flights.retry)
    assert released.to_client == flights.retry and released.to_server == flights.second and watch.done


def test_a_changed_second_hello_is_refused_and_nothing_of_it_released():
    flights = handshake()
    watch = RetryWatch("public.lab.example", False)
    watch.from_server(flights.retry)
    released = watch.from_client(COMPAT_CHANGE_CIPHER_SPEC + first_hello("other.lab.example", "secp384r1"))
    assert released.refused is not None and released.refused.rule == "tls:retry-hello-changed"
    assert released.to_server == b"" and watch.done


def test_a_client_that_pours_bytes_before_the_server_answers_is_refused():
    watch = RetryWatch("public.lab.example", False)
    assert watch.from_client(bytes(32 * 1024)).refused is None
    assert watch.from_client(b"x").refused.rule == "tls:hello-too-large"


def test_timeouts_and_ends_say_which_wait_it_was():
    waiting = RetryWatch("public.lab.example", False)
    assert waiting.phase == AWAIT_SERVER
    assert "ServerHello" in waiting.timed_out(30).reason and waiting.done
    asked = RetryWatch("public.lab.example", False)
    asked.from_server(handshake().retry)
    err = asked.timed_out(30)
    assert err.rule == "limits.header_timeout" and "second ClientHello" in err.reason
    ended = RetryWatch("public.lab.example", False)
    ended.from_server(handshake().retry)
    assert "second ClientHello" in ended.ended() and ended.done
    assert "server's first answer" in RetryWatch("public.lab.example", False).ended()


@settings(max_examples=200)
@given(st.binary(max_size=300), st.binary(max_size=300), st.lists(st.booleans(), max_size=8))
def test_random_bytes_either_way_never_crash_the_watch(server, client, order):
    watch = RetryWatch("public.lab.example", False)
    for from_server in order:
        released = watch.from_server(server) if from_server else watch.from_client(client)
        if released.refused is not None:
            assert released.refused.rule and released.refused.reason and watch.done
            return


@pytest.mark.parametrize("change_cipher_spec", [True, False], ids=["after-change-cipher-spec", "alone"])
def test_a_second_hello_in_many_records_dripped_a_byte_at_a_time_has_each_record_read_once(monkeypatch,
                                                                                          change_cipher_spec):
    """As for the first hello (test_first_bytes.py): the held bytes were read from the start, and copied
    whole, on every read: a 30 KB second hello in 250 records, dripped a byte per write, had its record
    headers read millions of times. Each record is read once now, and the hello goes on whole."""
    flights = handshake()
    second = padded_hello(b"public.lab.example", 121)
    if change_cipher_spec:
        second = COMPAT_CHANGE_CIPHER_SPEC + second
    headers = counted_record_headers(monkeypatch)
    watch = RetryWatch("public.lab.example", False)
    assert watch.from_server(flights.retry).to_client == flights.retry and watch.phase == AWAIT_RETRY
    released = [watch.from_client(second[i:i + 1]) for i in range(len(second))]
    assert all(r == (b"", b"", None) for r in released[:-1]) and released[-1].to_server == second
    assert watch.done
    assert headers[0] <= 2 * len(second) + 260, headers[0]


@given(st.integers(20, 300), st.lists(st.integers(0, 10_000), max_size=30), st.booleans())
@settings(max_examples=60, deadline=None)
def test_any_split_of_a_second_hello_goes_on_whole_at_its_last_byte(record_size, cuts, change_cipher_spec):
    flights = handshake()
    second = padded_hello(b"public.lab.example", record_size, padding=3_000)
    if change_cipher_spec:
        second = COMPAT_CHANGE_CIPHER_SPEC + second
    points = [0, *sorted(cut % (len(second) + 1) for cut in cuts), len(second)]
    watch = RetryWatch("public.lab.example", False)
    watch.from_server(flights.retry)
    sent = b"".join(watch.from_client(second[a:b]).to_server for a, b in zip(points, points[1:], strict=False))
    assert sent == second and watch.done
