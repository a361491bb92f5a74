"""``/metrics`` as Prometheus users expect it (issue 14 item 7): the page ``proxy/metrics.py`` writes, parsed
with prometheus_client's parser, and the supervisor's sum of workers' pages (``proxy/metrics_sum.py``).
Through the real proxy: tests/test_proxy_audit.py, tests/test_proxy_reload.py, tests/test_proxy_workers.py."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from metrics_page import families, total, value

from policy.model import ALLOW, DENY, HostRule, Origin
from policy.patterns import HostPattern
from proxy.build import versions
from proxy.metrics import DNS_BUCKETS, Metrics
from proxy.metrics_sum import carry, is_page, sum_metrics

BUILD = {"version": "9.9.9", "python": "3.12.0", "mitmproxy": "12.0.0"}


def busy_metrics(clock: float = 1000.0, build: dict[str, str] | None = None) -> Metrics:
    m = Metrics(build=build or BUILD, clock=lambda: clock)
    m.policy_in_force()
    m.decision("allow", "hosts.allow:docs.python.org")
    m.decision("refuse", "default:deny")
    m.decision("refuse", "default:deny")
    for seconds in (0.0004, 0.003, 7.0):
        m.observe_dns(seconds)
    m.dns_error("timeout")
    m.refusal("limits.max_connections")
    m.relayed(10, 200)
    m.tunnel_opened()
    m.tunnel_opened()
    m.tunnel_closed()
    m.fast_tunnel()
    m.connections_open(3)
    return m


def buckets(body: str) -> list[tuple[float, float]]:
    """(le, cumulative count) of the DNS histogram, in page order."""
    _, samples = families(body)["egresswall_dns_lookup_seconds"]
    return [(float(s.labels["le"]), s.value) for s in samples if s.name.endswith("_bucket")]


def test_every_family_has_the_type_prometheus_users_expect():
    body = busy_metrics().render()
    assert {name: kind for name, (kind, _) in families(body).items()} == {
        "egresswall_decisions": "counter",
        "egresswall_refusals": "counter",
        "egresswall_open_tunnels": "gauge",
        "egresswall_fast_tunnels": "counter",
        "egresswall_fast_http_requests": "counter",
        "egresswall_open_connections": "gauge",
        "egresswall_buffered_request_body_bytes": "gauge",
        "egresswall_bytes": "counter",
        "egresswall_dns_lookup_seconds": "histogram",
        "egresswall_dns_errors": "counter",
        "egresswall_policy_reloads": "counter",
        "egresswall_policy_loaded": "gauge",
        "egresswall_policy_last_reload_success_timestamp_seconds": "gauge",
        "egresswall_build_info": "gauge",  # an info metric: the text format calls it a gauge
        "egresswall_audit_write_failures": "counter",
        "egresswall_session_refusals": "counter",
        "egresswall_session_requests": "counter",
        "egresswall_sessions_active": "gauge",
        "egresswall_sessions_created": "counter",
        "egresswall_sessions_ended": "counter",
    }
    assert not [line for line in body.splitlines() if "_created " in line or "_created{" in line]  # no second series


def test_decisions_are_labelled_by_verdict_and_rule_id():
    body = busy_metrics().render()
    _, samples = families(body)["egresswall_decisions"]
    assert {(s.labels["verdict"], s.labels["rule_id"]): s.value for s in samples} == {
        ("allow", "hosts.allow:docs.python.org"): 1, ("refuse", "default:deny"): 2}
    assert all(set(s.labels) == {"verdict", "rule_id"} for s in samples)


def test_dns_latency_is_a_histogram_with_resolver_buckets():
    body = busy_metrics().render()
    assert [le for le, _ in buckets(body)] == [*DNS_BUCKETS, math.inf]
    assert DNS_BUCKETS[0] == 0.0005 and DNS_BUCKETS[-1] == 5.0
    counts = dict(buckets(body))
    # 0.4 ms is under the first bucket, 3 ms under 5 ms, 7 s only under +Inf.
    assert (counts[0.0005], counts[0.0025], counts[0.005], counts[5.0], counts[math.inf]) == (1, 1, 2, 2, 3)
    assert value(body, "egresswall_dns_lookup_seconds_count") == 3
    assert value(body, "egresswall_dns_lookup_seconds_sum") == pytest.approx(7.0034)
    assert value(body, "egresswall_dns_errors_total", kind="timeout") == 1


def test_build_info_is_one_series_of_value_one():
    _, samples = families(busy_metrics().render())["egresswall_build_info"]
    assert [(s.labels, s.value) for s in samples] == [(BUILD, 1)]
    _, samples = families(Metrics().render())["egresswall_build_info"]  # by default: what is installed
    assert [s.labels for s in samples] == [versions()] and set(versions()) == {"version", "python", "mitmproxy"}


def test_the_last_successful_reload_time_moves_only_on_success():
    now = [100.0]
    m = Metrics(build=BUILD, clock=lambda: now[0])
    stamp = "egresswall_policy_last_reload_success_timestamp_seconds"
    assert value(m.render(), stamp) == 0 and value(m.render(), "egresswall_policy_loaded") == 0
    m.policy_in_force()  # the first load counts as loading the policy in force
    assert value(m.render(), stamp) == 100 and value(m.render(), "egresswall_policy_loaded") == 1
    now[0] = 200.0
    m.reloaded(True)
    now[0] = 300.0
    m.reloaded(False)
    body = m.render()
    assert value(body, stamp) == 200
    assert value(body, "egresswall_policy_reloads_total", result="success") == 1
    assert value(body, "egresswall_policy_reloads_total", result="failure") == 1


def test_both_reload_results_are_shown_before_any_reload():
    body = Metrics(build=BUILD).render()
    assert value(body, "egresswall_policy_reloads_total", result="success") == 0
    assert value(body, "egresswall_policy_reloads_total", result="failure") == 0


def test_audit_failures_are_the_audit_logs_own_count_read_at_scrape():
    m = Metrics(build=BUILD)
    failures = [0]
    m.count_audit_failures(lambda: failures[0])
    assert value(m.render(), "egresswall_audit_write_failures_total") == 0
    failures[0] = 4
    assert value(m.render(), "egresswall_audit_write_failures_total") == 4


def test_instances_do_not_share_series():
    one, two = Metrics(build=BUILD), Metrics(build=BUILD)
    one.decision("allow", "hosts.allow:a.example")
    assert one.value("egresswall_decisions_total", verdict="allow", rule_id="hosts.allow:a.example") == 1
    assert two.value("egresswall_decisions_total", verdict="allow", rule_id="hosts.allow:a.example") == 0
    assert "hosts.allow:a.example" not in two.render()


def test_a_rule_built_without_an_id_is_never_labelled_by_its_file_position():
    """The loader gives every rule an id; one built by hand (squid import, tests) derives one too."""
    for action in (ALLOW, DENY):
        rule = HostRule(action, HostPattern.parse("*.ads.example.com"), Origin("policy.yaml", 12))
        assert rule.rule_id == f"hosts.{action}:*.ads.example.com" and "policy.yaml" not in rule.rule_id
    named = HostRule(ALLOW, HostPattern.parse("docs.python.org"), Origin("policy.yaml", 3), id="docs")
    assert named.rule_id == "docs"


# ---- the supervisor's sum ---------------------------------------------------------------------------


def test_two_workers_pages_are_summed_by_what_each_family_measures():
    one = busy_metrics(clock=100.0)
    two = busy_metrics(clock=200.0)
    two.observe_dns(0.01)
    two.decision("report", "hosts.deny:x.example")
    body = sum_metrics([one.render(), two.render()])
    assert value(body, "egresswall_decisions_total", verdict="refuse", rule_id="default:deny") == 4
    assert value(body, "egresswall_decisions_total", verdict="report", rule_id="hosts.deny:x.example") == 1
    assert [le for le, _ in buckets(body)] == [*DNS_BUCKETS, math.inf]  # buckets summed le by le
    counts = dict(buckets(body))
    assert (counts[0.0005], counts[0.005], counts[0.01], counts[5.0], counts[math.inf]) == (2, 4, 5, 5, 7)
    assert value(body, "egresswall_dns_lookup_seconds_count") == 7
    assert value(body, "egresswall_dns_lookup_seconds_sum") == pytest.approx(2 * 7.0034 + 0.01)
    assert value(body, "egresswall_bytes_total", direction="down") == 400
    assert value(body, "egresswall_open_tunnels") == 2 and value(body, "egresswall_open_connections") == 6
    kind, samples = families(body)["egresswall_build_info"]
    assert kind == "gauge" and [(s.labels, s.value) for s in samples] == [(BUILD, 1)]  # one series, not 2
    assert value(body, "egresswall_policy_last_reload_success_timestamp_seconds") == 200  # the latest
    assert value(body, "egresswall_policy_loaded") == 1
    assert families(body)["egresswall_dns_lookup_seconds"][0] == "histogram"


def test_the_pool_enforces_a_policy_only_when_every_worker_does():
    loaded, not_yet = Metrics(build=BUILD), Metrics(build=BUILD)
    loaded.policy_in_force()
    assert value(sum_metrics([loaded.render(), not_yet.render()]), "egresswall_policy_loaded") == 0


def test_workers_of_two_builds_show_both_builds_once():
    other = {**BUILD, "version": "10.0.0"}
    body = sum_metrics([busy_metrics().render(), busy_metrics(build=other).render(), busy_metrics().render()])
    _, samples = families(body)["egresswall_build_info"]
    assert sorted((s.labels["version"], s.value) for s in samples) == [("10.0.0", 1), ("9.9.9", 1)]


def test_a_restarted_workers_counts_are_carried_and_its_gauges_are_not():
    dead = busy_metrics().render()
    carried = carry("", dead)
    assert "egresswall_open_tunnels" not in carried and "egresswall_build_info" not in carried
    fresh = Metrics(build=BUILD)
    fresh.policy_in_force()
    body = sum_metrics([fresh.render()], carried)
    assert value(body, "egresswall_decisions_total", verdict="refuse", rule_id="default:deny") == 2
    assert value(body, "egresswall_dns_lookup_seconds_count") == 3
    assert dict(buckets(body))[0.005] == 2
    assert value(body, "egresswall_open_tunnels") == 0
    assert len(families(body)["egresswall_build_info"][1]) == 1
    carried = carry(carried, dead)  # a second restart adds to what was carried
    assert value(sum_metrics([fresh.render()], carried), "egresswall_dns_lookup_seconds_count") == 6
    assert carry(carried, "unreachable: connection refused") == carried  # nothing said: nothing added


def test_only_a_metrics_page_counts_as_a_workers_answer():
    assert is_page(Metrics(build=BUILD).render())
    for text in ("", "unreachable: [Errno 111] Connection refused", "not ready\n", "# HELP x\nx{ 1\n"):
        assert not is_page(text)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.floats(0, 10), st.sampled_from(["default:deny", "r1", "r2"]),
                          st.integers(0, 10_000)), max_size=30))
def test_the_sum_of_split_work_is_the_page_of_all_the_work(requests):
    """However requests are spread over two workers, the sum is what one worker doing all would say."""
    alone, first, second = Metrics(build=BUILD), Metrics(build=BUILD), Metrics(build=BUILD)
    for to_first, seconds, rule_id, size in requests:
        for m in (alone, first if to_first else second):
            m.observe_dns(seconds)
            m.decision("refuse", rule_id)
            m.relayed(size, 2 * size)
    summed, single = sum_metrics([first.render(), second.render()]), alone.render()
    assert buckets(summed) == buckets(single)
    for name in ("egresswall_dns_lookup_seconds_count", "egresswall_bytes_total", "egresswall_decisions_total"):
        assert total(summed, name) == total(single, name)
    assert total(summed, "egresswall_dns_lookup_seconds_sum") == pytest.approx(
        total(single, "egresswall_dns_lookup_seconds_sum"))


def test_the_session_api_counts_are_a_page_of_their_own_and_on_the_full_page():
    """With --workers the API is the supervisor's: it adds this page to the workers' sum."""
    metrics = Metrics(build={"version": "t"})
    metrics.session_created(), metrics.session_created(), metrics.session_ended()
    alone = metrics.session_api_page()
    assert set(families(alone)) == {"egresswall_sessions_created", "egresswall_sessions_ended"}
    assert value(alone, "egresswall_sessions_created_total") == 2
    full = metrics.render()
    assert value(full, "egresswall_sessions_created_total") == 2 and value(full, "egresswall_sessions_ended_total") == 1


def test_the_sessions_gauge_is_the_stores_count_not_a_sum_over_workers():
    pages = []
    for _ in range(2):
        metrics = Metrics(build={"version": "t"})
        metrics.sessions_in_store(3)
        pages.append(metrics.render())
    assert value(sum_metrics(pages), "egresswall_sessions_active") == 3
