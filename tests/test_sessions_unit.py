"""The pure session core: grants, the session check, budgets, the Basic credential parser; the memory store's
atomic charge; the 407 refusal. Property tests for the parsers and the URL grant matcher."""

from __future__ import annotations

import asyncio
import base64
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policy.credentials import CredentialsError, basic_value, parse_proxy_authorization
from policy.decision import Verdict
from policy.hosts import HostFormError, Target, parse_authority, parse_url
from policy.loader import parse_policy
from policy.sessions import (
    BUDGET_HOSTS,
    BUDGET_REQUEST_BYTES,
    BUDGET_REQUESTS,
    BUDGET_RESPONSE_BYTES,
    ENDED,
    EXPIRED,
    NOT_GRANTED,
    STORE_UNAVAILABLE,
    Session,
    SessionSpecError,
    Usage,
    bytes_over_budget,
    check_grant,
    judge_budgets,
    parse_session_spec,
    parse_url_grant,
    secret_digest,
)
from proxy.refusals import Refusal, refusal_parts
from proxy.sessions.store import MemoryStore, session_from_record, session_record

NOW = 1_800_000_000.0


def session_of(grants: dict, budgets: dict | None = None, ttl: float = 60) -> Session:
    spec = parse_session_spec({"grants": grants, "budgets": budgets or {}, "ttl": ttl})
    return Session("s1", secret_digest("secret"), NOW, NOW + ttl, spec)


# ---- grants and the check ----------------------------------------------------------------------

def test_a_host_grant_admits_its_hosts_on_any_path_and_tunnel():
    session = session_of({"hosts": ["*.docs.example"]})
    assert check_grant(session, parse_url("https://a.docs.example/x?y"), True, NOW) is None
    assert check_grant(session, parse_authority("a.docs.example:443"), False, NOW) is None
    refusal = check_grant(session, parse_url("https://docs.example/"), True, NOW)
    assert refusal is not None and refusal.rule == NOT_GRANTED and refusal.stage == "session"
    assert refusal.session == "s1" and "*.docs.example" in refusal.reason


def test_a_url_grant_is_exact_where_visible_and_host_and_port_for_a_tunnel():
    session = session_of({"urls": ["https://Public.Example/read?id=1"]})
    assert check_grant(session, parse_url("https://public.example/read?id=1"), True, NOW) is None
    assert check_grant(session, parse_url("wss://public.example/read?id=1"), True, NOW) is None
    for other in ("https://public.example/read?id=2", "https://public.example/read", "http://public.example/read?id=1",
                  "https://public.example:8443/read?id=1", "https://public.example/read/?id=1"):
        assert check_grant(session, parse_url(other), True, NOW).rule == NOT_GRANTED, other
    assert check_grant(session, parse_authority("public.example:443"), False, NOW) is None
    assert check_grant(session, parse_authority("public.example:8443"), False, NOW).rule == NOT_GRANTED


def test_the_refusal_reason_never_carries_the_query():
    session = session_of({"urls": ["https://public.example/"]})
    refusal = check_grant(session, parse_url("https://attacker.example/?q=the-conversation"), True, NOW)
    assert refusal is not None and "the-conversation" not in refusal.reason


def test_an_expired_session_is_refused_whatever_it_grants():
    session = session_of({"hosts": ["public.example"]}, ttl=10)
    assert check_grant(session, parse_url("https://public.example/"), True, NOW + 9.9) is None
    assert check_grant(session, parse_url("https://public.example/"), True, NOW + 10).rule == EXPIRED


@pytest.mark.parametrize("budgets, usage, seen, length, rule", [
    ({"requests": 3}, Usage(requests=2), True, None, None),
    ({"requests": 3}, Usage(requests=3), True, None, BUDGET_REQUESTS),
    ({"hosts": 2}, Usage(hosts=2), True, None, None),
    ({"hosts": 2}, Usage(hosts=2), False, None, BUDGET_HOSTS),
    ({"request_bytes": 100}, Usage(request_bytes=60), True, 40, None),
    ({"request_bytes": 100}, Usage(request_bytes=60), True, 41, BUDGET_REQUEST_BYTES),
    ({"request_bytes": 100}, Usage(request_bytes=100), True, None, BUDGET_REQUEST_BYTES),
    ({"response_bytes": 10}, Usage(response_bytes=9), True, None, None),
    ({"response_bytes": 10}, Usage(response_bytes=10), True, None, BUDGET_RESPONSE_BYTES),
    ({}, Usage(10**9, 10**6, 10**12, 10**12), False, 10**9, None),
])
def test_budgets(budgets, usage, seen, length, rule):
    verdict = judge_budgets(session_of({"hosts": ["a.example"]}, budgets), usage, seen, length)
    assert (verdict.rule if verdict else None) == rule


def test_the_secret_is_compared_by_digest_and_never_kept():
    session = session_of({"hosts": ["a.example"]})
    assert session.secret_matches("secret") and not session.secret_matches("secreT")
    assert "secret" not in session_record(session).replace("secret_digest", "")
    assert session_from_record(session_record(session)) == session


# ---- the request parser: the same words as the policy file -------------------------------------

def test_host_grants_are_judged_by_the_policy_files_rules_and_words():
    with pytest.raises(SessionSpecError) as raised:
        parse_session_spec({"grants": {"hosts": ["ok.example", "*bad.example"]}})
    with pytest.raises(Exception) as policy_error:
        parse_policy("version: 1\nhosts:\n  allow: ['*bad.example']\n")
    assert raised.value.problems == [("grants.hosts[1]", policy_error.value.message)]


def test_every_problem_is_listed_with_its_field():
    with pytest.raises(SessionSpecError) as raised:
        parse_session_spec({"grants": {"urls": ["http://a.example/../x", "mailto:x@y.example"],
                                       "hosts": ["localhost"]}})
    fields = [field for field, _ in raised.value.problems]
    assert fields == ["grants.hosts[0]", "grants.urls[0]", "grants.urls[1]"]


@pytest.mark.parametrize("body, field", [
    ([], ""), ({"grants": []}, "grants"), ({"grants": {"hosts": "a.example"}}, "grants.hosts"),
    ({"grants": {"hosts": ["a.example"]}, "ttl": 86401}, "ttl"),
    ({"grants": {"hosts": ["a.example"]}, "budgets": {"requests": 0}}, "budgets.requests"),
    ({"grants": {"hosts": ["a.example"]}, "budgets": {"requests": True}}, "budgets.requests"),
    ({"grants": {"hosts": ["a.example"], "paths": ["/"]}}, "grants.paths"),
])
def test_the_schema_refuses_shapes_with_their_field(body, field):
    with pytest.raises(SessionSpecError) as raised:
        parse_session_spec(body)
    assert raised.value.problems[0][0] == field


def test_a_role_can_require_a_session():
    policy = parse_policy("version: 1\nroles:\n  - name: agents\n    clients: [10.0.0.0/8]\n    session: required\n")
    assert policy.requires_sessions and policy.session_required(policy.roles[0])
    assert not policy.session_required(None)
    assert parse_policy("version: 1\nsession: required\n").session_required(None)
    with pytest.raises(Exception, match="expected one of: required, optional"):
        parse_policy("version: 1\nsession: maybe\n")


# ---- properties of the URL grant matcher --------------------------------------------------------

_segment = st.text(alphabet=string.ascii_letters + string.digits + "-_~", min_size=1, max_size=8)
_paths = st.lists(_segment, max_size=4).map(lambda parts: "/" + "/".join(parts))
_queries = st.one_of(st.just(""), _segment.map(lambda q: "?" + q))
_hosts = st.sampled_from(["a.example", "b.example", "sub.a.example"])


@given(_hosts, _paths, _queries, _hosts, _paths, _queries)
def test_a_url_grant_admits_exactly_its_own_url(host, path, query, other_host, other_path, other_query):
    grant = parse_url_grant(f"https://{host}{path}{query}")
    assert grant.admits_request(parse_url(f"https://{host}{path}{query}"))
    admitted = grant.admits_request(parse_url(f"https://{other_host}{other_path}{other_query}"))
    assert admitted == ((host, path or "/", query) == (other_host, other_path or "/", other_query))


@given(_hosts, _paths, st.sampled_from(["/..", "/.", "/%2e%2e", "/%2f", "/.%2E"]), _paths)
def test_a_path_servers_may_read_differently_is_never_admitted(host, before, trick, after):
    try:
        grant = parse_url_grant(f"https://{host}{before}{after}")
    except ValueError as refused:
        # '/' + '/x' is '//x': an empty segment, which servers read differently too, so no grant names it
        assert "//" in before + after and "empty segments" in str(refused)
        return
    try:
        target = parse_url(f"https://{host}{before}{trick}{after}")
    except HostFormError:
        return
    assert not grant.admits_request(target)


@given(st.text(max_size=80))
@settings(max_examples=300)
def test_the_url_grant_parser_accepts_only_what_parse_url_accepts(text):
    try:
        grant = parse_url_grant(text)
    except ValueError:
        return
    target = parse_url(text)
    assert target.scheme in ("http", "https") and grant.host == target.host and grant.port == target.port


# ---- properties of the Basic credential parser --------------------------------------------------

_ids = st.text(alphabet=string.ascii_letters + string.digits + "_-", min_size=1, max_size=64)
_secrets = st.text(alphabet="".join(chr(c) for c in range(0x21, 0x7f)), min_size=1, max_size=256)


@given(_ids, _secrets, st.sampled_from(["Basic", "basic", "BASIC"]), st.integers(1, 3))
def test_credentials_round_trip(session_id, secret, scheme, spaces):
    value = scheme + " " * spaces + basic_value(session_id, secret).split(" ", 1)[1]
    found = parse_proxy_authorization([value])
    assert found is not None and (found.session_id, found.secret) == (session_id, secret)
    assert repr(found).endswith("secret=<hidden>)")


@given(st.text(max_size=120))
@settings(max_examples=500)
def test_any_header_value_is_accepted_strictly_or_refused_with_a_reason(value):
    try:
        found = parse_proxy_authorization([value])
    except CredentialsError as err:
        assert err.reason
        return
    assert found is not None
    assert basic_value(found.session_id, found.secret).split(" ", 1)[1] == value.strip(" \t").split()[-1]


@given(st.binary(max_size=80))
def test_any_decoded_bytes_are_accepted_strictly_or_refused(raw):
    value = "Basic " + base64.b64encode(raw).decode()
    try:
        found = parse_proxy_authorization([value])
    except CredentialsError:
        return
    assert found is not None and f"{found.session_id}:{found.secret}".encode() == raw


@pytest.mark.parametrize("values", [
    ["Basic czE6eA==", "Basic czE6eA=="], ["Basic czE6eA"], ["Basic czE6eB=="], ["Basic  czE6eA==x"],
    ["Digest czE6eA=="], ["Basic " + base64.b64encode(b"s1").decode()], ["Basic " + base64.b64encode(b":x").decode()],
    ["Basic " + base64.b64encode(b"s/1:x").decode()], ["Basic " + base64.b64encode(b"s1:a b").decode()],
    ["Basic " + base64.b64encode(b"s1:\xff").decode()], ["Basic " + "A" * 2000],
])
def test_malformed_credentials_are_refused(values):
    with pytest.raises(CredentialsError):
        parse_proxy_authorization(values)


def test_no_header_is_no_credentials():
    assert parse_proxy_authorization([]) is None


# ---- the memory store and the 407 --------------------------------------------------------------

def test_the_memory_store_counts_a_budget_exactly_under_concurrency():
    async def run() -> list:
        store = MemoryStore(clock=lambda: NOW)
        session = session_of({"hosts": ["*.example"]}, {"requests": 5, "hosts": 2})
        await store.put(session)
        results = await asyncio.gather(*(store.charge(session, f"h{i % 3}.example", None) for i in range(20)))
        return [None if r is None else r.rule for r in results], await store.usage(session.id)

    rules, usage = asyncio.run(run())
    assert rules.count(None) == 5 and usage.requests == 5 and usage.hosts == 2
    assert set(rules) - {None} <= {BUDGET_REQUESTS, BUDGET_HOSTS}


def test_a_407_carries_proxy_authenticate():
    verdict = Verdict(False, "session", "session:required", "a session is required")
    status, headers, _ = refusal_parts(Refusal(407, verdict, "a.example", 443))
    assert status == 407 and dict(headers)["Proxy-Authenticate"].startswith("Basic realm=")
    assert "Proxy-Authenticate" not in dict(refusal_parts(Refusal(403, verdict, "a.example", 443))[1])


def test_targets_built_by_hand_are_matched_like_parsed_ones():
    grant = parse_url_grant("http://a.example/x")
    assert grant.admits_request(Target("http", "a.example", 80, "/x"))
    assert not grant.admits_request(Target("http", "a.example", 80, "/x/"))


def test_a_tunnel_under_a_session_is_over_once_the_session_ends_expires_or_changes_secret():
    """``SessionService.over``: what the gate's sweep of open tunnels asks (test_session_end_cuts_tunnels.py)."""
    from proxy.sessions.service import SessionService

    clock = [NOW]
    store = MemoryStore(clock=lambda: clock[0])
    service = SessionService(store, clock=lambda: clock[0])
    session = session_of({"hosts": ["a.example"]}, ttl=60)

    async def run() -> list:
        await store.put(session)
        seen = [(await service.over(session))[1]]
        clock[0] = NOW + 61
        seen.append((await service.over(session))[1])
        clock[0] = NOW
        await store.put(Session("s1", secret_digest("another"), NOW, NOW + 60, session.spec))
        seen.append((await service.over(session))[1])
        await store.delete("s1")
        seen.append((await service.over(session))[1])
        return seen

    held, expired, other_secret, ended = asyncio.run(run())
    assert held is None
    assert (expired.rule, expired.reason) == (EXPIRED, "session s1 expired")
    assert (other_secret.rule, other_secret.reason) == (ended.rule, ended.reason) == (ENDED, "session s1 has ended")


@pytest.mark.parametrize("budgets, usage, rule", [
    ({"request_bytes": 100}, Usage(request_bytes=100), None),  # at the budget: used up, not past it
    ({"request_bytes": 100}, Usage(request_bytes=101), BUDGET_REQUEST_BYTES),
    ({"response_bytes": 100}, Usage(response_bytes=100), None),
    ({"response_bytes": 100}, Usage(response_bytes=101), BUDGET_RESPONSE_BYTES),
    ({"requests": 1, "hosts": 1}, Usage(requests=9, hosts=9, request_bytes=10**9, response_bytes=10**9), None),
    ({}, Usage(request_bytes=10**12, response_bytes=10**12), None),
])
def test_an_open_tunnels_bytes_past_a_byte_budget(budgets, usage, rule):
    """``bytes_over_budget``: what the gate's sweep asks of a session whose passed-through tunnel is open
    (test_session_tunnel_budgets.py); only the byte budgets, and only once they are passed."""
    verdict = bytes_over_budget(session_of({"hosts": ["a.example"]}, budgets), usage)
    assert (verdict.rule if verdict else None) == rule
    if verdict is not None:
        assert verdict.session == "s1" and "budget is 100 bytes" in verdict.reason


def test_a_gate_charges_open_tunnels_as_they_move_and_only_the_rest_at_close(tmp_path):
    """``Gate._charge_open``: each look charges what moved since the last one (two tunnels of one
    session together), the tunnel's closing line charges only what is left, and a store that cannot take the
    bytes moves the charged counts back, so none is counted twice or lost."""
    from policy.hosts import parse_authority as authority
    from proxy.audit import AuditLog
    from proxy.gate import Gate, Tunnel
    from proxy.metrics import Metrics
    from proxy.reload import PolicyHolder
    from proxy.sessions.service import SessionService
    from proxy.sessions.store import StoreUnavailable

    (tmp_path / "policy.yaml").write_text("version: 1\ndefault: allow\n")
    store = MemoryStore(clock=lambda: NOW)
    gate = Gate(PolicyHolder(str(tmp_path / "policy.yaml")), AuditLog(str(tmp_path / "audit.jsonl")), Metrics(),
                sessions=SessionService(store, clock=lambda: NOW))
    session = session_of({"hosts": ["a.example"]}, {"request_bytes": 1000})
    moved = {"one": [0, 0], "two": [0, 0]}

    def tunnel(name: str) -> Tunnel:
        made = Tunnel(name, authority("a.example:443"), Verdict(True, "decide", "allow", "", session="s1"), "c",
                      False, False, session=session)
        made.moved = lambda: tuple(moved[name])
        return made

    one, two = tunnel("one"), tunnel("two")

    async def run() -> list:
        await store.put(session)
        seen = []
        moved["one"], moved["two"] = [300, 10], [200, 20]
        seen.append((await gate._charge_open(session, [one, two]), await store.usage("s1")))
        moved["one"] = [400, 10]  # 100 more on one
        seen.append((await gate._charge_open(session, [one, two]), await store.usage("s1")))
        gate.tunnel_closed(two, 250, 20, None)  # 50 more on two, counted by its closing line
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        seen.append(await store.usage("s1"))
        moved["one"] = [1200, 10]  # past the budget of 1000
        seen.append((await gate._charge_open(session, [one, two]), await store.usage("s1")))

        async def unavailable(*_: object) -> None:
            raise StoreUnavailable("down")
        store.add_bytes, kept = unavailable, store.add_bytes
        moved["one"] = [1300, 10]
        with pytest.raises(StoreUnavailable):
            await gate._charge_open(session, [one])
        seen.append(one.charged)
        store.add_bytes = kept
        return seen

    first, second, after_close, past, failed = asyncio.run(run())
    assert first == (None, Usage(0, 0, 500, 30))
    assert second == (None, Usage(0, 0, 600, 30))
    assert after_close == Usage(0, 0, 650, 30)
    assert past[0] is not None and past[0].rule == BUDGET_REQUEST_BYTES and past[1] == Usage(0, 0, 1450, 30)
    assert failed == (1200, 10)  # not charged: counted at the next look or at close
    gate.audit.close()


def test_the_sweep_cuts_what_is_open_under_a_session_once_the_store_is_silent_past_the_grace(tmp_path):
    """``Gate._look_at_session`` with a store that does not answer: nothing is cut within ``store_grace``, an
    answer in between starts the count again, and past it the session's open tunnels are cut with the
    ``session:store-unavailable`` refusal (test_session_store_outage.py does it with a real redis-server)."""
    import time

    from policy.hosts import parse_authority as authority
    from proxy.audit import AuditLog
    from proxy.gate import Gate, Tunnel
    from proxy.metrics import Metrics
    from proxy.reload import PolicyHolder
    from proxy.sessions.service import SessionService
    from proxy.sessions.store import StoreUnavailable

    (tmp_path / "policy.yaml").write_text("version: 1\ndefault: allow\n")
    store = MemoryStore(clock=lambda: NOW)
    gate = Gate(PolicyHolder(str(tmp_path / "policy.yaml")), AuditLog(str(tmp_path / "audit.jsonl")), Metrics(),
                sessions=SessionService(store, clock=lambda: NOW))
    gate.store_grace = 0.3
    session = session_of({"hosts": ["a.example"]})
    cuts: list[str] = []
    tunnel = Tunnel("t", authority("a.example:443"), Verdict(True, "decide", "allow", "", session="s1"), "c",
                    False, False, session=session, cut=lambda: cuts.append("cut"), moved=lambda: (0, 0))
    answering = store.get

    async def silent(*_: object) -> None:
        raise StoreUnavailable("the session store redis://127.0.0.1:1/0 cannot be reached: refused")

    async def run() -> list:
        await store.put(session)
        seen = []
        store.get = silent
        await gate._look_at_session([tunnel])
        time.sleep(0.2)
        await gate._look_at_session([tunnel])
        seen.append((list(cuts), tunnel.store_silent_since is not None))
        store.get = answering
        await gate._look_at_session([tunnel])  # it answers: the count starts again
        seen.append((list(cuts), tunnel.store_silent_since))
        store.get = silent
        await gate._look_at_session([tunnel])
        time.sleep(0.2)
        await gate._look_at_session([tunnel])
        seen.append(list(cuts))
        time.sleep(0.15)
        await gate._look_at_session([tunnel])
        seen.append(list(cuts))
        return seen

    first_outage, answered, second_outage, past_the_grace = asyncio.run(run())
    assert first_outage == ([], True)
    assert answered == ([], None)
    assert second_outage == []
    assert past_the_grace == ["cut"]
    assert tunnel.cut_by is not None and tunnel.cut_by.rule == STORE_UNAVAILABLE and tunnel.cut_by.session == "s1"
    assert "has not answered for" in tunnel.cut_by.reason and "cannot be reached" in tunnel.cut_by.reason
    gate.audit.close()


def test_the_sweep_goes_on_past_a_session_it_cannot_look_at(tmp_path, monkeypatch):
    """An error looking at one session's open tunnels is logged and the sweep goes on: the other sessions'
    tunnels are still cut when their session ends (a sweep that died would never cut anything again)."""
    import proxy.gate as gate_module
    from policy.hosts import parse_authority as authority
    from proxy.audit import AuditLog
    from proxy.gate import Gate, Tunnel
    from proxy.metrics import Metrics
    from proxy.reload import PolicyHolder
    from proxy.sessions.service import SessionService

    monkeypatch.setattr(gate_module, "SESSION_SWEEP", 0.01)
    (tmp_path / "policy.yaml").write_text("version: 1\ndefault: allow\n")
    store = MemoryStore(clock=lambda: NOW)
    service = SessionService(store, clock=lambda: NOW)
    gate = Gate(PolicyHolder(str(tmp_path / "policy.yaml")), AuditLog(str(tmp_path / "audit.jsonl")), Metrics(),
                sessions=service)
    broken, ending = session_of({"hosts": ["a.example"]}), Session("s2", secret_digest("x"), NOW, NOW + 60,
                                                                     session_of({"hosts": ["a.example"]}).spec)
    cut: list[str] = []
    looked = service.over

    async def over(session):
        if session.id == "s1":
            raise RuntimeError("a bug in a store")
        return await looked(session)
    service.over = over

    async def run() -> None:
        await store.put(ending)
        for session in (broken, ending):
            tunnel = Tunnel(f"t-{session.id}", authority("a.example:443"), Verdict(True, "decide", "allow", ""),
                            "c", False, False, session=session)
            tunnel.cut = lambda name=session.id: cut.append(name)
            gate._watch_session(tunnel.id, tunnel)
        await asyncio.sleep(0.05)
        await store.delete("s2")
        await asyncio.sleep(0.05)

    asyncio.run(run())
    assert cut == ["s2"]
    gate.audit.close()


@pytest.mark.parametrize(("data", "field", "words"), [
    ({"budgets": {"requests": 1.0}}, "budgets.requests", "without a fraction"),  # JSON Schema's integer takes 1.0
    ({"budgets": {"request_bytes": 1e3}}, "budgets.request_bytes", "without a fraction"),
    ({"budgets": {"hosts": 2**64}}, "budgets.hosts", "<= 9007199254740991"),
])
def test_a_session_request_is_parsed_strictly(data, field, words):
    with pytest.raises(SessionSpecError) as caught:
        parse_session_spec({"grants": {"hosts": ["a.example"]}, **data})
    assert [(f, words in why) for f, why in caught.value.problems] == [(field, True)], caught.value.problems

