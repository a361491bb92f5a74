"""Reading a ``/metrics`` page in tests: parsed with prometheus_client's parser, never matched as text."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def families(body: str) -> dict[str, tuple[str, list[Sample]]]:
    """Family name (``egresswall_decisions``: without ``_total``) → (type, samples)."""
    return {f.name: (f.type, f.samples) for f in text_string_to_metric_families(body)}


def value(body: str, name: str, **labels: str) -> float | None:
    """The value of the one sample called ``name`` (``egresswall_decisions_total``) with exactly ``labels``."""
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return None


def total(body: str, name: str) -> float:
    """The sum of every sample called ``name``, whatever its labels."""
    return sum(s.value for f in text_string_to_metric_families(body) for s in f.samples if s.name == name)
