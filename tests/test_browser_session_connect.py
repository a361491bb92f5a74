"""The pure parts of the browser side of sessions: which session a browser-server handshake names, the
proxy option the relay sets on a session connection's contexts, and the grants ``egresswall browse``
reads with (``--subresources``), plus the override that makes the in-process proxy require sessions."""

from __future__ import annotations

import json
from types import SimpleNamespace
from urllib.parse import quote

import pytest
from hypothesis import given
from hypothesis import strategies as st

from browser.launch import LaunchPlan
from browser.protocol_filter import ProtocolFilter
from browser.server import BrowserServer
from browser.session_connect import (
    SESSION_HEADER,
    HandshakeRefusal,
    is_session_path,
    session_of_handshake,
    session_proxy,
    with_context_proxy,
)
from policy.credentials import Credentials
from policy.hosts import parse_url
from policy.loader import Overrides, parse_policy
from proxy.cli.browse_session import browse_grants, same_site_pattern

SECRET = "Zq3-_abcdefghijklmnopqrstuvwxyz0123456789AB"  # the form the admin API hands out (token_urlsafe)


# ---- the handshake ---------------------------------------------------------------------------------

def test_a_session_path_names_its_session():
    found = session_of_handshake(f"/session/s0123abc?secret={SECRET}", [])
    assert found == Credentials("s0123abc", SECRET)
    assert "Zq3" not in repr(found)  # a secret never reaches a log through a repr


def test_escapes_in_the_secret_are_decoded():
    assert session_of_handshake("/session/s1?secret=a%3Ab%2Fc%7E", []) == Credentials("s1", "a:b/c~")


def test_the_header_names_a_session_on_any_path():
    assert session_of_handshake("/", [f"s1:{SECRET}"]) == Credentials("s1", SECRET)
    assert session_of_handshake("/anything", [f" s1:{SECRET}\t"]) == Credentials("s1", SECRET)


def test_without_a_session_the_connection_runs_as_today():
    for path in ("/", "/x", "/sessions/s1?secret=x", "/?secret=x", "/sessionx"):
        assert session_of_handshake(path, []) is None


@pytest.mark.parametrize("path,headers,words", [
    ("/session", [], "nothing after the id"),
    ("/session/", [], "nothing after the id"),
    ("/session/s1/more?secret=abc", [], "nothing after the id"),
    ("/session/s1", [], "no ?secret="),
    ("/session/s1?", [], "no ?secret="),
    ("/session/s1?secret", [], "exactly secret="),
    ("/session/s1?secret=a&secret=b", [], "exactly secret="),
    ("/session/s1?secret=a&x=1", [], "exactly secret="),
    ("/session/s1?token=abc", [], "exactly secret="),
    ("/session/s1?secret=", [], "URL-encoded"),
    ("/session/s1?secret=a+b", [], "URL-encoded"),
    ("/session/s1?secret=a%2", [], "URL-encoded"),
    ("/session/s1?secret=a%20b", [], "spaces"),
    ("/session/s1?secret=a%00b", [], "control"),
    ("/session/s1?secret=caf%C3%A9", [], "spaces or control"),
    ("/session/bad%20id?secret=abc", [], "not a session id"),
    ("/session/" + "s" * 65 + "?secret=abc", [], "not a session id"),
    ("/session/s1?secret=" + "a" * 257, [], "too long"),
    ("/session/s1?secret=abc", ["s1:abc"], "given twice"),
    ("/", ["s1:a", "s1:b"], "2 X-Egresswall-Session headers"),
    ("/", ["s1"], "no ':'"),
    ("/", ["bad id:abc"], "not a session id"),
    ("/", ["s1:"], "empty"),
    ("/", ["s1:a b"], "spaces"),
])
def test_a_malformed_session_is_refused_with_its_reason(path, headers, words):
    found = session_of_handshake(path, headers)
    assert isinstance(found, HandshakeRefusal) and found.status == 400, found
    assert words in found.reason
    assert "X-Egresswall-Session" in found.reason


def test_a_refusal_never_repeats_the_secret():
    for path, headers in ((f"/session/bad!id?secret={SECRET}", []), ("/", [f"bad!id:{SECRET}"]),
                          (f"/session/s1?secret={SECRET}%20", [])):
        found = session_of_handshake(path, headers)
        assert isinstance(found, HandshakeRefusal) and SECRET not in found.reason


session_ids = st.from_regex(r"\A[A-Za-z0-9_-]{1,64}\Z")
secrets_ = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7e), min_size=1, max_size=256)


@given(session_ids, secrets_)
def test_every_id_and_secret_the_proxy_takes_round_trips_through_the_url_and_the_header(session_id, secret):
    assert session_of_handshake(f"/session/{session_id}?secret={quote(secret, safe='-._~')}", []) == \
        Credentials(session_id, secret)
    if ":" not in session_id:
        assert session_of_handshake("/", [f"{session_id}:{secret}"]) == Credentials(session_id, secret)


@given(st.text(max_size=300), st.lists(st.text(max_size=80), max_size=3))
def test_any_handshake_is_a_session_none_or_a_refusal_never_an_error(tail, headers):
    for path in ("/session/" + tail, "/" + tail):
        found = session_of_handshake(path, headers)
        assert found is None or isinstance(found, HandshakeRefusal | Credentials)
        if found is None:
            assert not is_session_path(path) and not headers
        if isinstance(found, Credentials):  # only what the proxy itself would take
            assert 1 <= len(found.secret) <= 256 and all(0x21 <= ord(c) <= 0x7e for c in found.secret)


def _plan() -> LaunchPlan:
    from pathlib import Path

    return LaunchPlan("/usr/lib/chromium/chromium", [], "http://127.0.0.1:3128", Path("/nonexistent"), False)


def test_a_server_whose_proxy_has_no_session_api_refuses_session_connections_at_the_handshake():
    request = SimpleNamespace(path=f"/session/s1?secret={SECRET}", headers={})
    request.headers = SimpleNamespace(get_all=lambda name: [])
    refused = BrowserServer(_plan(), sessions_refused="no session API here")._session_of(request)
    assert refused == HandshakeRefusal(403, "no session API here")
    assert BrowserServer(_plan())._session_of(request) == Credentials("s1", SECRET)
    plain = SimpleNamespace(path="/", headers=SimpleNamespace(get_all=lambda name: []))
    assert BrowserServer(_plan(), sessions_refused="no session API here")._session_of(plain) is None
    malformed = SimpleNamespace(path="/session/s1", headers=SimpleNamespace(get_all=lambda name: []))
    assert BrowserServer(_plan())._session_of(malformed).status == 400
    header = SimpleNamespace(path="/", headers=SimpleNamespace(
        get_all=lambda name: [f"s2:{SECRET}"] if name == SESSION_HEADER else []))
    assert BrowserServer(_plan())._session_of(header) == Credentials("s2", SECRET)


# ---- the context's proxy -------------------------------------------------------------------------------

def test_the_relay_sets_the_sessions_proxy_only_after_the_filter_refused_the_clients_own():
    protocol = ProtocolFilter()
    protocol.from_server(json.dumps({"guid": "", "method": "__create__",
                                     "params": {"type": "Browser", "guid": "browser@1", "initializer": {}}}))
    own = {"id": 1, "guid": "browser@1", "method": "newContext",
           "params": {"proxy": {"server": "http://127.0.0.1:9", "username": "s-other", "password": "x"}}}
    assert "'proxy'" in protocol.from_client(json.dumps(own)).reason
    plain = {"id": 2, "guid": "browser@1", "method": "newContext", "params": {"viewport": None, "locale": "en"}}
    assert protocol.from_client(json.dumps(plain)) is None
    proxy = session_proxy("http://127.0.0.1:3128", Credentials("s1", SECRET))
    sent = with_context_proxy(plain, proxy)
    assert sent["params"] == {"viewport": None, "locale": "en", "proxy": {
        "server": "http://127.0.0.1:3128", "username": "s1", "password": SECRET}}
    assert "bypass" not in sent["params"]["proxy"]  # Playwright then adds <-loopback> itself
    assert plain["params"] == {"viewport": None, "locale": "en"}  # the client's message is not changed in place
    assert with_context_proxy({"id": 3, "guid": "browser@1", "method": "newContext"}, proxy)["params"] == {
        "proxy": proxy}


# ---- browse's grants ------------------------------------------------------------------------------------

def test_same_site_grants_the_urls_and_the_hosts_of_their_registrable_domains():
    grants = browse_grants(["http://public.lab.example:8080/page", "https://www.example.co.uk/a?b=1"],
                           "same-site", 300)
    spec = grants.spec
    assert spec is not None and grants.not_granted == ()
    assert [u.text for u in spec.grants.urls] == ["http://public.lab.example:8080/page",
                                                  "https://www.example.co.uk/a?b=1"]
    assert [h.text for h in spec.grants.hosts] == [".lab.example", ".example.co.uk"]
    admit = spec.grants.admit
    assert admit(parse_url("http://other.lab.example:8080/pixel"), True)
    assert admit(parse_url("https://static.example.co.uk/x.js"), False)
    assert not admit(parse_url("https://other.example/?q=secret"), True)
    assert not admit(parse_url("https://other.example/"), False)
    assert not admit(parse_url("https://co.uk/"), False)  # never a public suffix


def test_none_grants_the_urls_only_and_policy_makes_no_session():
    spec = browse_grants(["http://public.lab.example:8080/page"], "none", 300).spec
    assert spec is not None and spec.grants.hosts == ()
    assert spec.grants.admit(parse_url("http://public.lab.example:8080/page"), True)
    assert not spec.grants.admit(parse_url("http://public.lab.example:8080/other"), True)
    assert not spec.grants.admit(parse_url("http://other.lab.example:8080/page"), True)
    assert browse_grants(["http://public.lab.example/"], "policy", 300).spec is None
    with pytest.raises(ValueError, match="--subresources"):
        browse_grants(["http://public.lab.example/"], "all", 300)


def test_addresses_and_public_suffixes_are_their_own_site():
    assert same_site_pattern("198.18.0.7") == "198.18.0.7"
    assert same_site_pattern("2001:db8::1") == "[2001:db8::1]"
    assert same_site_pattern("github.io") == "github.io"
    assert same_site_pattern("alice.github.io") == ".alice.github.io"  # not every github.io site


def test_urls_that_cannot_be_granted_are_named_and_all_of_them_is_an_error():
    grants = browse_grants(["http://public.lab.example/", "ftp://x.example/", "http://a.example/x/../y"],
                           "same-site", 1e9)
    assert [url for url, _ in grants.not_granted] == ["ftp://x.example/", "http://a.example/x/../y"]
    assert grants.spec is not None and grants.spec.ttl == 86400  # capped at the longest session
    with pytest.raises(ValueError, match="none of the URLs can be granted"):
        browse_grants(["ftp://x.example/"], "same-site", 60)


def test_the_session_override_requires_a_session_of_every_client_and_role():
    text = ("version: 1\ndefault: allow\nsession: optional\nroles:\n  - name: ci\n    clients: [127.0.0.0/8]\n"
            "    session: optional\n  - name: other\n    clients: [10.0.0.0/8]\n")
    assert not parse_policy(text).requires_sessions
    policy = parse_policy(text, overrides=Overrides(session="required"))
    assert policy.session == "required" and all(role.session == "required" for role in policy.roles)
    assert policy.session_required(policy.roles[0]) and policy.session_required(None)


labels = st.from_regex(r"\A[a-z][a-z0-9]{0,8}\Z")
sites = st.tuples(labels, st.sampled_from(["example", "co.uk", "com", "github.io"]))


# Paths with no empty segment but a trailing one ('/a//b' has no canonical form and is never granted).
paths = st.from_regex(r"\A(/[a-z0-9]{1,6}){0,2}/[a-z0-9]{0,6}\Z")


@given(st.lists(st.tuples(st.lists(labels, max_size=2), sites, paths), min_size=1, max_size=4), sites,
       st.sampled_from(["same-site", "none"]))
def test_a_browse_session_admits_each_url_it_was_given_and_no_other_site(pages, other, subresources):
    urls = [f"https://{'.'.join([*sub, name, suffix])}{path}" for sub, (name, suffix), path in pages]
    spec = browse_grants(urls, subresources, 300).spec
    assert spec is not None
    for url in urls:
        assert spec.grants.admit(parse_url(url), True) and spec.grants.admit(parse_url(url), False)
    other_host = f"zz-{other[0]}.{other[1]}"  # a site none of the URLs is on ("-" is not in the labels)
    assert not spec.grants.admit(parse_url(f"https://{other_host}/?q=x"), True)
    assert not spec.grants.admit(parse_url(f"https://{other_host}/"), False)
    if subresources == "none":
        assert spec.grants.hosts == ()
