"""The supervisor's ``/metrics`` for ``--workers N``: the workers' pages added up into one.

Each worker serves its own page (``proxy/metrics.py``); the supervisor fetches them, parses them with
prometheus_client's parser and writes the sum with prometheus_client's exposition. How a family is
combined depends on what it measures:

* counters and histograms (every ``_bucket``, ``_sum`` and ``_count``) are added; the counts of a
  worker that was restarted are carried over (``carried``), so nothing goes down when one dies;
* an info metric (a gauge named ``*_info``, e.g. ``egresswall_build_info``) is not a quantity: each
  distinct series appears once, with value 1 — the same build in every worker gives one series;
* ``egresswall_policy_loaded`` takes the minimum: the pool enforces a policy only when every worker does;
* ``egresswall_policy_last_reload_success_timestamp_seconds`` takes the maximum: the last time any
  worker loaded the policy successfully (a failed reload is counted in ``egresswall_policy_reloads_total``);
* ``egresswall_sessions_active`` takes the maximum: every worker counts the one shared store;
* every other gauge (open tunnels, open connections) is added.

(prometheus_client's own multiprocess mode is not used: it shares values through files in a directory
every process must be given, and egresswall's workers already serve their own pages.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

CUMULATIVE = frozenset({"counter", "histogram", "gaugehistogram", "summary"})
GAUGE_RULES: dict[str, Callable[[Iterable[float]], float]] = {
    "egresswall_policy_loaded": min,
    "egresswall_policy_last_reload_success_timestamp_seconds": max,
    "egresswall_sessions_active": max,  # every worker reads the one shared store: the same count, not a share
}
SampleKey = tuple[str, tuple[tuple[str, str], ...]]  # (sample name, sorted labels)


def parse(text: str) -> list[Metric]:
    """The families of one page; ``ValueError`` when it is not the Prometheus text format."""
    return list(text_string_to_metric_families(text)) if text else []


def is_page(text: str) -> bool:
    try:
        return bool(parse(text))
    except ValueError:
        return False


def sum_metrics(texts: list[str], carried: str = "") -> str:
    """One page from the workers' ``texts``; ``carried``: the cumulative families of workers restarted
    since (``carry``), added to the counters and histograms."""
    families: dict[str, Metric] = {}  # by name, in first-seen order: help and type from the first worker
    values: dict[str, dict[SampleKey, list[float]]] = {}
    sources = [(text, False) for text in texts] + [(carried, True)]
    for text, only_cumulative in sources:
        for family in parse(text):
            if only_cumulative and family.type not in CUMULATIVE:
                continue
            families.setdefault(family.name, family)
            series = values.setdefault(family.name, {})
            for sample in family.samples:
                series.setdefault((sample.name, tuple(sorted(sample.labels.items()))), []).append(sample.value)
    registry = CollectorRegistry()
    registry.register(_Page([_combined(families[name], series) for name, series in values.items()]))
    return generate_latest(registry).decode()


def carry(carried: str, last_page: str) -> str:
    """What a worker about to be restarted had counted, added to what was carried before (cumulative
    families only: a gauge of a process that is gone is not carried)."""
    summed = parse(sum_metrics([last_page], carried)) if is_page(last_page) else parse(carried)
    registry = CollectorRegistry()
    registry.register(_Page([f for f in summed if f.type in CUMULATIVE]))
    return generate_latest(registry).decode()


def _combined(first: Metric, series: dict[SampleKey, list[float]]) -> Metric:
    out = Metric(first.name, first.documentation, first.type, first.unit)
    combine: Callable[[Iterable[float]], float] = sum
    if first.type == "gauge" and first.name.endswith("_info"):
        combine = max  # each distinct build once: 1
    elif first.type == "gauge":
        combine = GAUGE_RULES.get(first.name, sum)
    for (name, labels), samples in series.items():
        out.add_sample(name, dict(labels), combine(samples))
    return out


class _Page:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families
