"""The budget for buffered request bodies (proxy/body_budget.py) as a plain object, and the policy limit
that sizes it (``limits.max_buffered_request_bodies``): model, schema, loader and README agree."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policy.loader import PolicyError, parse_policy
from policy.model import Limits
from proxy.body_budget import RULE, BodyBudget
from proxy.gate import Gate
from proxy.hints import hint_for
from proxy.metrics import Metrics

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((ROOT / "policy" / "schema.json").read_text())
MiB = 1024 * 1024


def limits(budget: int, body: int = 10) -> Limits:
    return Limits(max_buffered_request_bodies=budget, max_request_body=body)


# ---- the object --------------------------------------------------------------------------------------

def test_a_reservation_within_the_budget_is_counted_and_given_back() -> None:
    budget = BodyBudget()
    hold = budget.hold("10.0.0.1")
    assert hold.add(30, limits(400)) is None
    assert (budget.total, budget.per_client["10.0.0.1"], hold.held) == (30, 30, 30)
    hold.release()
    assert budget.total == 0 and "10.0.0.1" not in budget.per_client and hold.held == 0


def test_the_full_budget_is_refused_503_with_what_it_holds_and_its_limit() -> None:
    budget = BodyBudget()
    assert all(budget.hold(f"10.0.0.{n}").add(100, limits(400, body=100)) is None for n in range(4))
    refused = budget.hold("10.0.0.9").add(1, limits(400, body=100))
    assert refused is not None and refused.status == 503 and refused.rule == RULE
    assert "already buffering 400 bytes of request bodies, its limit is 400" in refused.reason
    assert RULE in refused.reason and "would take 1 more" in refused.reason
    assert budget.total == 400  # the refused byte was not counted


def test_one_client_holds_at_most_a_quarter_of_the_budget_and_is_refused_429() -> None:
    budget = BodyBudget()
    first = budget.hold("10.0.0.1")
    assert first.add(100, limits(400)) is None
    refused = budget.hold("10.0.0.1").add(1, limits(400))
    assert refused is not None and refused.status == 429 and refused.rule == RULE
    assert "client 10.0.0.1 is already buffering 100 bytes" in refused.reason and "its share is 100" in refused.reason
    assert "would take 1 more" in refused.reason
    assert budget.hold("10.0.0.2").add(100, limits(400)) is None  # another client is not held up by it


def test_an_ipv6_client_s_share_is_its_64_s_as_for_the_connection_caps() -> None:
    budget = BodyBudget()
    assert budget.hold("2001:db8:1:2::a").add(100, limits(400)) is None
    refused = budget.hold("2001:db8:1:2::b").add(1, limits(400))  # another address of the same /64
    assert refused is not None and refused.status == 429
    assert "clients in 2001:db8:1:2::/64 (counted as one) are already buffering 100 bytes" in refused.reason
    assert budget.hold("2001:db8:1:3::a").add(100, limits(400)) is None  # the next /64 is another client
    budget.release("2001:db8:1:2::a", 100)
    assert "2001:db8:1:2::/64" not in budget.per_client


def test_a_client_may_always_hold_one_body_at_the_limit_when_the_budget_holds_one() -> None:
    """A quarter of the budget smaller than max_request_body would refuse every body at the limit: the
    share is never less than one such body (but never more than the budget)."""
    assert BodyBudget().limits_of(limits(400, body=300)) == (400, 300)
    assert BodyBudget().limits_of(limits(400, body=1000)) == (400, 400)
    assert BodyBudget().hold("c").add(300, limits(400, body=300)) is None


def test_each_of_n_workers_has_its_share_of_the_budget_and_says_so() -> None:
    budget = BodyBudget(share=3)
    assert budget.limits_of(limits(1000, body=10)) == (334, 83)  # rounded up, as Admission's caps
    assert all(budget.hold(f"c{n}").add(83, limits(1000)) is None for n in range(4))
    refused = budget.hold("c9").add(3, limits(1000))
    assert refused is not None and "this worker's share of 1000 over 3 workers" in refused.reason


def test_release_is_idempotent_and_a_zero_or_negative_size_counts_nothing() -> None:
    budget = BodyBudget()
    hold = budget.hold("c")
    assert hold.add(0, limits(0)) is None and hold.add(-5, limits(0)) is None
    assert budget.total == 0 and hold.held == 0
    assert hold.add(40, limits(400)) is None
    hold.release()
    hold.release()
    assert budget.total == 0 and not budget.per_client


def test_a_budget_of_zero_refuses_any_buffered_byte() -> None:
    refused = BodyBudget().hold("c").add(1, limits(0, body=0))
    assert refused is not None and refused.status == 503


def test_on_change_is_told_every_total() -> None:
    seen: list[int] = []
    budget = BodyBudget(on_change=seen.append)
    hold = budget.hold("c")
    hold.add(5, limits(100))
    hold.add(7, limits(100))
    budget.hold("c").add(1000, limits(100))  # refused: no change
    hold.release()
    assert seen == [5, 12, 0]


OPS = st.lists(st.tuples(st.sampled_from(["new", "add", "release"]), st.integers(0, 7),
                         st.integers(-3, 300)), max_size=80)


@given(ops=OPS, budget_size=st.integers(0, 1200), body=st.integers(0, 500), share=st.integers(1, 4))
def test_any_sequence_of_reservations_and_releases_stays_within_the_budget_and_returns_to_zero(
        ops, budget_size: int, body: int, share: int) -> None:
    gauge: list[int] = []
    budget = BodyBudget(share=share, on_change=gauge.append)
    policy_limits = limits(budget_size, body)
    whole, per_client = budget.limits_of(policy_limits)
    holds = []
    for op, index, size in ops:
        if op == "new" or not holds:
            holds.append(budget.hold(f"10.0.0.{index % 3}"))
        elif op == "add":
            hold = holds[index % len(holds)]
            before = hold.held
            refused = hold.add(size, policy_limits)
            assert hold.held == (before if refused is not None else before + max(0, size))
            if refused is not None:
                assert refused.status in (429, 503) and refused.rule == RULE and refused.reason
        else:
            holds[index % len(holds)].release()
        assert 0 <= budget.total <= whole
        assert all(0 < held <= per_client for held in budget.per_client.values())
        assert budget.total == sum(h.held for h in holds) == sum(budget.per_client.values())
        assert gauge[-1:] in ([], [budget.total])
    for hold in holds:
        hold.release()
    assert budget.total == 0 and not budget.per_client and gauge[-1:] in ([], [0])


def test_the_gate_holds_one_budget_sized_by_its_share_and_reports_it_as_a_metric(tmp_path: Path) -> None:
    from proxy.audit import AuditLog
    from proxy.reload import PolicyHolder

    metrics = Metrics()
    policy = tmp_path / "policy.yaml"
    policy.write_text("version: 1\n")
    gate = Gate(PolicyHolder(str(policy)), AuditLog(str(tmp_path / "audit.jsonl")), metrics, share=2)
    assert gate.body_budget.share == 2
    hold = gate.body_budget.hold("127.0.0.1")
    assert hold.add(1234, gate.policy.limits) is None
    assert metrics.value("egresswall_buffered_request_body_bytes") == 1234
    hold.release()
    assert metrics.value("egresswall_buffered_request_body_bytes") == 0


def test_the_refusal_hint_says_retry_later() -> None:
    from policy.decision import Verdict

    assert hint_for(Verdict(False, "limits", RULE, "full")) == "retry later"


# ---- the policy limit ----------------------------------------------------------------------------------

def test_the_limit_defaults_to_256_mib_in_model_schema_and_default_policy() -> None:
    assert Limits().max_buffered_request_bodies == 256 * MiB
    assert SCHEMA["properties"]["limits"]["properties"]["max_buffered_request_bodies"]["default"] == 256 * MiB
    assert parse_policy("version: 1\n", "p.yaml").limits.max_buffered_request_bodies == 256 * MiB
    default = (ROOT / "policy" / "default.yaml").read_text()
    assert parse_policy(default, "default.yaml").limits.max_buffered_request_bodies == 256 * MiB


def test_the_limit_is_read_from_the_policy() -> None:
    policy = parse_policy("version: 1\nlimits:\n  max_buffered_request_bodies: 12345\n", "p.yaml")
    assert policy.limits.max_buffered_request_bodies == 12345
    assert parse_policy("version: 1\nlimits:\n  max_buffered_request_bodies: 0\n", "p.yaml").limits == \
        dataclasses.replace(Limits(), max_buffered_request_bodies=0)


@pytest.mark.parametrize("value, expected", [("-1", "expected a value >= 0"), ("'1M'", "expected integer"),
                                             ("1.5", "expected a whole number")])
def test_a_bad_limit_is_refused_with_its_position(value: str, expected: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy(f"version: 1\nlimits:\n  max_buffered_request_bodies: {value}\n", "bad.yaml")
    err = info.value
    assert (err.line, err.key) == (3, "limits.max_buffered_request_bodies"), str(err)
    assert expected in err.message, str(err)


def test_the_readme_names_the_limit_with_its_default_and_statuses() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "max_buffered_request_bodies: 268435456" in readme  # the policy file example
    section = readme[readme.index("**Bodies**"):]
    section = section[:section.index("\n\n")]
    said = re.sub(r"\s+", " ", section)
    assert "`limits.max_buffered_request_bodies`" in said and "256 MiB" in said
    assert "503" in said and "429" in said and "a quarter" in said
    assert "chunk extensions" in said
