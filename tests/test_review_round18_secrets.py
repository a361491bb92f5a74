"""A password or token a client put in a URL never reaches the audit log, a refusal's headers or its body.

Review round 18 (a newcomer's reading of README): a request whose target the core refuses for its form
(userinfo, a space, ...) was recorded with its ``url`` as sent, ``user:password@`` and query string included,
with ``log.query_strings: false``; and the reason quoted the authority with its userinfo, into the record, the
``X-Egresswall-Reason`` header and ``check``'s output. Now ``policy.hosts.for_logs`` writes ``[userinfo]`` and
``?[query]`` in their place (the query kept where ``log.query_strings`` keeps queries).
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from proxyproc import both_transports

from policy.hosts import for_logs

SECRET, TOKEN = "s3cretPW", "tok3nXYZ"


@both_transports
@pytest.mark.parametrize("head", [
    "GET http://alice:{secret}@public.lab.example:{port}/x?token={token} HTTP/1.1\r\n"
    "Host: public.lab.example:{port}\r\n",
    "GET http://alice:{secret}@a b.example/x?token={token} HTTP/1.1\r\nHost: public.lab.example:{port}\r\n",
    "GET /x?token={token} HTTP/1.1\r\nHost: alice:{secret}@public.lab.example:{port}\r\n",
    "CONNECT alice:{secret}@public.lab.example:443 HTTP/1.1\r\nHost: public.lab.example:443\r\n",
], ids=["absolute", "absolute-and-space", "host-header", "connect"])
def test_a_secret_in_a_refused_target_is_written_nowhere(lab, start_proxy, head: str) -> None:
    proxy = start_proxy(lab.policy_text())
    request = head.format(secret=SECRET, token=TOKEN, port=lab.public.port) + "\r\n"
    answer = proxy.raw(request.encode())
    assert answer.startswith((b"HTTP/1.1 400", b"HTTP/1.1 403")), answer[:200]
    records = [r for r in proxy.audit() if r["event"] == "decision"]
    assert records and records[-1]["verdict"] == "refuse", records
    log = proxy.log_path.read_text()
    for secret in (SECRET, TOKEN):
        assert secret not in log, log
        assert secret.encode() not in answer, answer
    assert "[userinfo]" in log or "token" not in head.split("\r\n")[0] or "Host: alice" in head


@given(st.text(alphabet=st.characters(blacklist_characters="@/?#"), min_size=1, max_size=20),
       st.text(alphabet=st.characters(blacklist_characters="@/?#"), min_size=1, max_size=20),
       st.text(min_size=1, max_size=20), st.sampled_from(["http://", "https://", "//", ""]))
def test_for_logs_keeps_neither_the_userinfo_nor_the_query(user: str, password: str, query: str, prefix: str) -> None:
    text = f"{prefix}{user}:{password}@public.lab.example/p?{query}"
    shown = for_logs(text)
    assert f"{user}:{password}" not in shown and "?" + query not in shown
    kept = for_logs(text, keep_query=True)
    assert f"{user}:{password}@" not in kept
    if "@" not in query:  # else all before the query's '@' is taken for userinfo: more is hidden, never less
        assert shown.endswith("?[query]") and "[userinfo]@public.lab.example/p" in shown
        assert kept.endswith("?" + query)
