"""Review round 19 (h3): "A ClientHello may take at most 32 KiB ... beyond that it is refused
(tls:hello-too-large)" (README). ``read_client_hello`` (proxy/tls_hello.py) checks the size only while the
hello is not yet whole, so a larger hello is accepted or refused depending on how its bytes were cut into
reads: whole in one read (mitmproxy's path reads up to 64 KiB at once), or its first read exactly 32 KiB
(the front reads 32 KiB at a time), it passes; with one byte more in the first read it is refused."""

from __future__ import annotations

from tls_build import client_hello, extension

from proxy.first_bytes import FirstMessage, classify_tunnel_start
from proxy.tls_hello import MAX_HELLO_BYTES

NAME = "public.lab.example"
BIG = client_hello(NAME.encode(), extra=(extension(21, bytes(60_000)),))  # one record of about 60 KB


def _fed(pieces: list[bytes]):
    first = FirstMessage(NAME, False)
    judged = None
    for piece in pieces:
        judged = first.feed(piece, False)
        if not judged.need_more:
            break
    return judged


def test_a_hello_over_the_bound_is_refused_when_it_comes_whole():
    judged = classify_tunnel_start(BIG, NAME, False, False)
    assert judged.refused and judged.rule == "tls:hello-too-large", judged


def test_a_hello_over_the_bound_gets_the_same_answer_however_its_reads_were_cut():
    answers = {cut: _fed([BIG[:cut], BIG[cut:]]) for cut in (MAX_HELLO_BYTES, MAX_HELLO_BYTES + 1)}
    assert len({(a.refused, a.rule) for a in answers.values()}) == 1, answers
