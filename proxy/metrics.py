"""The proxy's metrics, exposed at ``/metrics`` in the Prometheus text format by ``prometheus_client``.

Each ``Metrics`` has its own ``CollectorRegistry`` (tests build several proxies in one process, and
nothing else in the process may add series to egresswall's page). Call sites use the methods below,
never the prometheus_client objects, so a label is always one of a bounded set:

* decisions are labelled by ``verdict`` (allow / refuse / report) and ``rule_id``, the rule's stable id
  (policy/rule_ids.py): a name from the policy or a fixed refusal name, never ``file:line`` (which moves
  when lines are added above it) and never the host a client asked for (unbounded);
* refusals by ``reason`` (a fixed rule name: ``limits.*``, ``audit``, ``shutdown``), DNS errors by ``kind``.

The hot-path cost against the hand-written counters this replaced is measured by
``tests/benchmarks/bench_metrics.py`` (README, "Metrics"). With ``--workers N`` the supervisor adds the
workers' pages up (``proxy/metrics_sum.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import Metric

from .build import versions

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # what generate_latest writes for these (ASCII) names
# A resolver answers from its cache in well under a millisecond and from upstream in tens of
# milliseconds; the policy's timeout is seconds. 0.5 ms … 5 s covers all three with room either side.
DNS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
VERDICTS = ("allow", "refuse", "report")
RELOAD_RESULTS = ("success", "failure")

# _created series double the page and say nothing a counter's reset does not; egresswall is the
# process's only user of prometheus_client, so the process-wide switch is ours to set.
prometheus_client.disable_created_metrics()


class Metrics:
    def __init__(self, build: Mapping[str, str] | None = None, clock: Callable[[], float] = time.time) -> None:
        self.registry = CollectorRegistry()
        self._clock = clock
        r = self.registry
        self._decisions = Counter("egresswall_decisions", "Decisions by verdict and the deciding rule's stable id.",
                                  ["verdict", "rule_id"], registry=r)
        self._decision_series: dict[tuple[str, str], Counter] = {}
        self._refusals = Counter("egresswall_refusals", "Refusals that are not policy decisions (caps, timeouts).",
                                 ["reason"], registry=r)
        self._open_tunnels = Gauge("egresswall_open_tunnels", "CONNECT tunnels open now.", registry=r)
        self._fast_tunnels = Counter("egresswall_fast_tunnels", "Tunnels relayed by the fast path, not mitmproxy.",
                                     registry=r)
        self._fast_http = Counter("egresswall_fast_http_requests", "Plain-HTTP requests relayed by the fast path, "
                                  "not mitmproxy.", registry=r)
        self._open_connections = Gauge("egresswall_open_connections", "Client connections open now.", registry=r)
        self._buffered_bodies = Gauge("egresswall_buffered_request_body_bytes",
                                      "Bytes of chunked request bodies buffered now "
                                      "(limits.max_buffered_request_bodies).",
                                      registry=r)
        relayed = Counter("egresswall_bytes", "Bytes relayed, by direction.", ["direction"], registry=r)
        self._bytes_up, self._bytes_down = relayed.labels("up"), relayed.labels("down")
        self._dns = Histogram("egresswall_dns_lookup_seconds", "DNS lookup latency (a refused lookup included).",
                              buckets=DNS_BUCKETS, registry=r)
        self._dns_errors = Counter("egresswall_dns_errors", "DNS lookups that failed, by kind.", ["kind"], registry=r)
        reloads = Counter("egresswall_policy_reloads", "Policy reloads by result.", ["result"], registry=r)
        self._reloads = {result: reloads.labels(result) for result in RELOAD_RESULTS}  # both shown from the start
        self._policy_loaded = Gauge("egresswall_policy_loaded", "1 when a policy is in force.", registry=r)
        self._last_reload = Gauge("egresswall_policy_last_reload_success_timestamp_seconds",
                                  "When the policy in force was loaded (start-up or reload), in Unix seconds.",
                                  registry=r)
        Info("egresswall_build", "The running egresswall's version and what it runs on.",
             registry=r).info(dict(build if build is not None else versions()))
        self._audit_failures: Callable[[], int] = lambda: 0
        r.register(_AuditFailures(lambda: self._audit_failures()))
        # Sessions (proxy/sessions/): counts and refusals by reason, never a per-session label.
        self._session_refusals = Counter("egresswall_session_refusals", "Requests refused by a session, by reason.",
                                         ["reason"], registry=r)
        self._session_requests = Counter("egresswall_session_requests",
                                         "Requests and CONNECTs admitted under a session.", registry=r)
        self._sessions_active = Gauge("egresswall_sessions_active", "Sessions in force in the session store.",
                                      registry=r)
        # The session API's own counts are also a page of their own: with --workers the API is the
        # supervisor's, which adds this page to the workers' (proxy/workers.py).
        self.api_registry = CollectorRegistry()
        self._sessions_created = Counter("egresswall_sessions_created", "Sessions created through the admin API.",
                                         registry=self.api_registry)
        self._sessions_ended = Counter("egresswall_sessions_ended", "Sessions ended through the admin API.",
                                       registry=self.api_registry)
        r.register(_Collected(self.api_registry))

    # ---- the hot path: once or twice a request ---------------------------------------------------

    def decision(self, verdict: str, rule_id: str) -> None:
        """``verdict``: allow / refuse / report; ``rule_id``: the deciding rule's stable id."""
        child = self._decision_series.get((verdict, rule_id))
        if child is None:  # labels() validates and locks each time: look a series up once
            child = self._decision_series[(verdict, rule_id)] = self._decisions.labels(verdict, rule_id)
        child.inc()

    def refusal(self, reason: str) -> None:
        self._refusals.labels(reason).inc()

    def session_refusal(self, rule: str) -> None:
        """``rule``: the refusal's rule (``session:not-granted``, ``session:budget-requests``, ...)."""
        self._session_refusals.labels(rule).inc()

    def session_request(self) -> None:
        self._session_requests.inc()

    def session_created(self) -> None:
        self._sessions_created.inc()

    def session_ended(self) -> None:
        self._sessions_ended.inc()

    def sessions_in_store(self, count: int) -> None:
        self._sessions_active.set(count)

    def observe_dns(self, seconds: float) -> None:
        self._dns.observe(seconds)

    def dns_error(self, kind: str) -> None:
        self._dns_errors.labels(kind).inc()

    def relayed(self, up: int, down: int) -> None:
        self._bytes_up.inc(up)
        self._bytes_down.inc(down)

    def tunnel_opened(self) -> None:
        self._open_tunnels.inc()

    def tunnel_closed(self) -> None:
        self._open_tunnels.dec()

    def fast_tunnel(self) -> None:
        self._fast_tunnels.inc()

    def fast_http(self) -> None:
        self._fast_http.inc()

    def connections_open(self, count: int) -> None:
        self._open_connections.set(count)

    def buffered_request_bodies(self, size: int) -> None:
        self._buffered_bodies.set(size)

    # ---- the policy and the audit log --------------------------------------------------------------

    def policy_in_force(self) -> None:
        """A policy was loaded (at start-up): in force, and loaded now."""
        self._policy_loaded.set(1)
        self._last_reload.set(self._clock())

    def reloaded(self, ok: bool) -> None:
        """A reload was tried; a failed one keeps the last good policy and its timestamp."""
        self._reloads["success" if ok else "failure"].inc()
        if ok:
            self._last_reload.set(self._clock())

    def count_audit_failures(self, failures: Callable[[], int]) -> None:
        """The audit log counts its own failed writes (``AuditLog.failures``); read them at each scrape."""
        self._audit_failures = failures

    # ---- reading -------------------------------------------------------------------------------------

    def render(self) -> str:
        return prometheus_client.generate_latest(self.registry).decode()

    def session_api_page(self) -> str:
        """The session API's counts alone (the supervisor adds them to its workers' pages)."""
        return prometheus_client.generate_latest(self.api_registry).decode()

    def value(self, name: str, **labels: str) -> float:
        """One sample's value by its exposed name (``egresswall_open_tunnels``); 0 when it has none yet."""
        found = self.registry.get_sample_value(name, labels)
        return 0.0 if found is None else found


class _AuditFailures:
    """A counter whose value lives in the audit log, not here (a collector read at scrape time)."""

    def __init__(self, failures: Callable[[], int]) -> None:
        self.failures = failures

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily("egresswall_audit_write_failures", "Audit lines that could not be written.",
                                  value=self.failures())


class _Collected:
    """Another registry's families, shown on this page too."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        yield from self.registry.collect()
