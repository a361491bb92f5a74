"""proxy/byte_allowance.py: what a session may still move through its open tunnels and WebSockets, taken chunk by
chunk before each is relayed (in process; the proxy-level tests are test_session_tunnel_budgets.py and
test_session_websockets.py)."""

from __future__ import annotations

import asyncio

from hypothesis import given
from hypothesis import strategies as st

from policy.decision import Verdict
from policy.hosts import parse_authority
from policy.sessions import BUDGET_REQUEST_BYTES, Session, Usage, parse_session_spec
from proxy.audit import AuditLog
from proxy.byte_allowance import DOWN, UP, ByteAllowance
from proxy.gate import Gate, Tunnel
from proxy.metrics import Metrics
from proxy.reload import PolicyHolder
from proxy.sessions.service import SessionService
from proxy.sessions.store import MemoryStore


def allowance(up: int | None, down: int | None) -> tuple[ByteAllowance, list[tuple[str, int]]]:
    crossings: list[tuple[str, int]] = []
    return ByteAllowance(up, down, lambda way, reached: crossings.append((way, reached))), crossings


@given(st.integers(0, 10_000), st.lists(st.tuples(st.sampled_from([UP, DOWN]), st.integers(0, 3_000)), max_size=40))
def test_what_is_taken_never_passes_the_budget_and_the_first_chunk_that_would_is_refused(budget, chunks):
    bounded, crossings = allowance(budget, None)
    taken_up = taken_down = refusals = 0
    for way, size in chunks:
        if bounded.take(way, size):
            assert not refusals, "a chunk was taken after one was refused"
            taken_up += size if way == UP else 0
            taken_down += size if way == DOWN else 0
            continue
        if not refusals:
            assert way == UP and taken_up + size > budget  # only the bounded way is refused, and only past it
            assert crossings == [(UP, taken_up + size)]
        refusals += 1
    assert taken_up <= budget
    assert len(crossings) == refusals  # each refusal is said: what opened since the first ends too


def test_a_session_at_its_budget_has_used_it_and_one_byte_more_is_refused():
    bounded, crossings = allowance(10, 5)
    assert bounded.take(UP, 10) and bounded.take(DOWN, 5)  # exactly the budget: allowed
    assert not bounded.take(DOWN, 1)
    assert crossings == [(DOWN, 6)]
    assert not bounded.take(UP, 0) and crossings == [(DOWN, 6), (UP, 10)]  # spent: nothing more, said each time


def test_a_request_reserves_what_fits_and_ends_nothing_when_it_does_not():
    bounded, crossings = allowance(100, None)
    assert bounded.reserve(UP, 60) and bounded.up == 40
    assert not bounded.reserve(UP, 41) and bounded.up == 40 and not bounded.spent and not crossings
    assert bounded.needed(UP, 41) == 101 and bounded.reserve(DOWN, 10**9)


def test_a_look_leaves_the_budget_less_the_stores_count_and_what_moved_since():
    bounded, _ = allowance(1_000, 500)
    bounded.refresh(Usage(request_bytes=300, response_bytes=100), (200, 50))
    assert (bounded.up, bounded.down) == (500, 350)
    bounded.refresh(Usage(request_bytes=1_200, response_bytes=0), (0, 0))  # past it already: the sweep ends it
    assert bounded.up == 0 and not bounded.take(UP, 1)


@given(st.integers(0, 10_000), st.one_of(st.none(), st.integers(0, 10_000)),
       st.lists(st.tuples(st.sampled_from([UP, DOWN]), st.integers(0, 3_000)), max_size=20))
def test_what_it_says_was_used_is_what_it_took_and_the_whole_budget_once_spent(up, down, chunks):
    """``used`` is what ``Gate._session_first`` judges a request's budgets on before the name is looked up: a
    session that crossed only its response budget is refused by that one, not by its request budget."""
    bounded, _ = allowance(up, down)
    moved = {UP: 0, DOWN: 0}
    for way, size in chunks:
        if bounded.take(way, size):
            moved[way] += size
    used = bounded.used()
    expected = {UP: moved[UP], DOWN: moved[DOWN] if down is not None else 0}
    if bounded.spent:  # the way that was spent is at its budget (its next request is refused by that budget)
        expected[bounded.spent_way] = up if bounded.spent_way == UP else down
    assert (used.request_bytes, used.response_bytes) == (expected[UP], expected[DOWN])


def test_no_budget_one_way_takes_anything_that_way():
    bounded, crossings = allowance(None, 10)
    assert bounded.take(UP, 10**12)
    bounded.refresh(Usage(request_bytes=10**12), (0, 0))
    assert bounded.up is None and not crossings


def _gate(tmp_path, budgets: dict) -> tuple[Gate, Session]:
    (tmp_path / "policy.yaml").write_text("version: 1\ndefault: allow\n")
    gate = Gate(PolicyHolder(str(tmp_path / "policy.yaml")), AuditLog(str(tmp_path / "audit.jsonl")), Metrics(),
                sessions=SessionService(MemoryStore()))
    spec = parse_session_spec({"grants": {"hosts": ["a.example"]}, "budgets": budgets})
    return gate, gate.sessions.new_session(spec)[0]


async def _tunnel(gate: Gate, session: Session, name: str, cut: list[str], moved: list[int] | None = None
                  ) -> Tunnel:
    """A tunnel under ``session`` as the gate opens one: watched, and answered once its allowance was read."""
    tunnel = Tunnel(name, parse_authority("a.example:443"), Verdict(True, "decide", "allow", "", session=session.id),
                    "127.0.0.1", False, False, session=session)
    tunnel.cut = lambda: cut.append(name)
    tunnel.moved = lambda: (moved[0], moved[1]) if moved else (0, 0)
    gate._watch_session(tunnel.id, tunnel)
    assert await gate._allowance_known(tunnel) is None
    return tunnel


def test_the_gate_shares_one_allowance_per_session_ends_all_at_a_crossing_and_drops_it_at_the_last_close(tmp_path):
    gate, session = _gate(tmp_path, {"request_bytes": 100})

    async def run() -> None:
        await gate.sessions.store.put(session)
        cut: list[str] = []
        first, second = await _tunnel(gate, session, "t1", cut), await _tunnel(gate, session, "t2", cut)
        assert first.allowance is second.allowance is gate.allowances[session.id]
        assert first.allowance.take(UP, 60)
        assert not second.allowance.take(UP, 60)  # together past 100: both end, with the refusal that says so
        assert sorted(cut) == ["t1", "t2"]
        for tunnel in (first, second):
            assert tunnel.cut_by is not None and tunnel.cut_by.rule == BUDGET_REQUEST_BYTES
            assert "would have sent 120 bytes; its budget is 100 bytes" in tunnel.cut_by.reason
        gate.tunnel_closed(first, 60, 0, None)
        assert session.id in gate.allowances
        gate.tunnel_closed(second, 0, 0, None)
        assert session.id not in gate.allowances and not gate.under_sessions
        await asyncio.sleep(0.05)  # the first look and the closes' charges

    asyncio.run(run())
    gate.audit.close()


def test_a_look_reads_what_is_left_from_the_store(tmp_path):
    """The first look (awaited before anything under it is relayed) and every sweep after it leave the budget
    less the store's count less what moved since: a second worker's bytes, in the same store, are counted
    against this one's allowance."""
    gate, session = _gate(tmp_path, {"request_bytes": 1000, "response_bytes": 500})
    moved = [0, 0]

    async def run() -> None:
        await gate.sessions.store.put(session)
        await gate.sessions.store.add_bytes(session.id, 700, 100)  # another worker's, say
        tunnel = await _tunnel(gate, session, "t1", [], moved)
        assert tunnel.allowance is not None and tunnel.allowance.read
        assert (tunnel.allowance.up, tunnel.allowance.down) == (300, 400)
        assert tunnel.allowance.take(UP, 250)
        moved[:] = [250, 0]
        await gate._look_at_session([tunnel])
        assert (await gate.sessions.store.usage(session.id)).request_bytes == 950
        assert (tunnel.allowance.up, tunnel.allowance.down) == (50, 400)
        assert not tunnel.allowance.take(UP, 51) and tunnel.cut_by is not None
        gate.tunnel_closed(tunnel, 250, 0, None)

    asyncio.run(run())
    gate.audit.close()


def test_a_session_without_byte_budgets_has_no_allowance(tmp_path):
    gate, session = _gate(tmp_path, {"requests": 5})

    async def run() -> None:
        tunnel = await _tunnel(gate, session, "t1", [])
        assert tunnel.allowance is None and not gate.allowances
        gate.tunnel_closed(tunnel, 0, 0, None)

    asyncio.run(run())
    gate.audit.close()


def test_a_tunnel_is_answered_only_once_its_allowance_was_read_from_the_store(tmp_path):
    """A new allowance started at the whole budget and read the store in a task of its own: with a remote store,
    a first message sent with the CONNECT was taken against the whole budget before the answer came (review
    round 16). decide_connect reads it before it answers. (An IP literal: nothing is looked up or connected.)"""
    from policy.credentials import basic_value

    (tmp_path / "policy.yaml").write_text("version: 1\ndefault: allow\n")
    gate = Gate(PolicyHolder(str(tmp_path / "policy.yaml")), AuditLog(str(tmp_path / "audit.jsonl")), Metrics(),
                sessions=SessionService(MemoryStore(), configured=True))
    spec = parse_session_spec({"grants": {"hosts": ["93.184.216.34"]}, "budgets": {"request_bytes": 1000}})
    session, secret = gate.sessions.new_session(spec)

    async def run() -> None:
        await gate.sessions.store.put(session)
        await gate.sessions.store.add_bytes(session.id, 900, 0)  # another worker's, say
        outcome = await gate.decide_connect("127.0.0.1", "93.184.216.34:443",
                                            credentials=[basic_value(session.id, secret)])
        assert outcome.tunnel is not None, outcome.refusal
        assert outcome.tunnel.allowance is not None and outcome.tunnel.allowance.up == 100
        gate.tunnel_closed(outcome.tunnel, 0, 0, None)

    asyncio.run(run())
    gate.audit.close()


def test_connects_during_the_first_look_wait_for_it_and_a_look_the_store_misses_refuses_them(tmp_path):
    """Review round 18: only the CONNECT that made its session's allowance waited for the store; one decided
    beside it was answered with the whole budget unread, and a first look the store did not answer left the
    allowance at the whole budget. Now every one opened while the first look is on its way waits for it, and a
    look that read nothing refuses them (503 session:store-unavailable: fail closed)."""
    from policy.credentials import basic_value
    from proxy.sessions.store import StoreUnavailable

    (tmp_path / "policy.yaml").write_text("version: 1\ndefault: allow\n")
    store = MemoryStore()
    gate = Gate(PolicyHolder(str(tmp_path / "policy.yaml")), AuditLog(str(tmp_path / "audit.jsonl")), Metrics(),
                sessions=SessionService(store, configured=True))
    spec = parse_session_spec({"grants": {"hosts": ["93.184.216.34"]}, "budgets": {"request_bytes": 1000}})
    session, secret = gate.sessions.new_session(spec)
    credentials = [basic_value(session.id, secret)]
    read_usage, answering = store.usage, [True]

    async def slow_usage(session_id: str):
        await asyncio.sleep(0.05)  # a store on another host
        if not answering[0]:
            raise StoreUnavailable("the lab's store is not answering")
        return await read_usage(session_id)
    store.usage = slow_usage

    async def run() -> None:
        await store.put(session)
        await store.add_bytes(session.id, 900, 0)
        outcomes = await asyncio.gather(*(gate.decide_connect("127.0.0.1", "93.184.216.34:443",
                                                              credentials=credentials) for _ in range(2)))
        for outcome in outcomes:
            assert outcome.tunnel is not None, outcome.refusal
            assert outcome.tunnel.allowance is not None and outcome.tunnel.allowance.up == 100
        for outcome in outcomes:
            gate.tunnel_closed(outcome.tunnel, 0, 0, None)
        assert not gate.allowances
        answering[0] = False
        outcome = await gate.decide_connect("127.0.0.1", "93.184.216.34:443", credentials=credentials)
        assert outcome.tunnel is None and outcome.refusal is not None and outcome.refusal.status == 503
        assert outcome.refusal.verdict.rule == "session:store-unavailable", outcome.refusal
        assert not gate.allowances and not gate.under_sessions

    asyncio.run(run())
    gate.audit.close()
