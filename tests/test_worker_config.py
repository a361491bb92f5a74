"""What a supervisor and its workers tell each other (proxy/worker_config.py): parsed strictly."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policy.loader import Overrides
from proxy.runner import RunConfig
from proxy.worker_config import FAILED, READY, WorkerConfig, WorkerReport

texts = st.text(max_size=20)
addresses = st.tuples(texts, st.integers(0, 65535))
overrides = st.builds(Overrides, default=st.none() | st.sampled_from(["allow", "deny"]),
                      allow_hosts=st.lists(texts, max_size=3), deny_hosts=st.lists(texts, max_size=3),
                      allow_ranges=st.lists(texts, max_size=3), deny_ranges=st.lists(texts, max_size=3),
                      nameservers=st.lists(texts, max_size=3), mode=st.none() | st.sampled_from(["enforce", "report"]))
run_configs = st.builds(RunConfig, policy_path=st.none() | texts, overrides=overrides, listen=addresses,
                        admin=st.none() | addresses, log_path=st.none() | texts,
                        log_format=st.sampled_from(["json", "squid"]), confdir=st.none() | texts,
                        upstream_ca=st.none() | texts, watch_interval=st.floats(0.01, 10), reuse_port=st.booleans(),
                        fast_tunnels=st.booleans(), worker_count=st.integers(1, 64),
                        extra_self_endpoints=st.lists(addresses, max_size=3).map(tuple))


@given(run_configs, st.integers(0, 1023))
def test_a_configuration_comes_back_as_it_was_sent(config: RunConfig, fd: int) -> None:
    assert WorkerConfig.from_json(WorkerConfig(config, fd).to_json()) == WorkerConfig(config, fd)


def test_every_run_config_field_has_a_decoder() -> None:
    # A RunConfig field added later must be taught to the codec, or workers would not get it.
    sent = WorkerConfig(RunConfig("p.yaml", Overrides()), 3)
    assert WorkerConfig.from_json(sent.to_json()) == sent


def _document(**run_changes) -> dict:
    document = json.loads(WorkerConfig(RunConfig("p.yaml", Overrides()), 3).to_json())
    document["run"].update(run_changes)
    return document


@pytest.mark.parametrize("document", [
    [],
    {"run": {}, "ready_fd": 3},
    {**_document(), "extra": 1},
    {**_document(), "ready_fd": True},
    {**_document(), "ready_fd": -1},
    _document(unknown_field=1),
    _document(listen=["127.0.0.1", "3128"]),
    _document(listen=["127.0.0.1", 70000]),
    _document(listen=["127.0.0.1"]),
    _document(admin="127.0.0.1:3131"),
    _document(reuse_port=1),
    _document(worker_count=True),
    _document(worker_count=2.0),
    _document(log_format=None),
    _document(overrides={"default": None}),
    _document(overrides={**dataclasses.asdict(Overrides()), "allow_hosts": "a.example"}),
    _document(overrides={**dataclasses.asdict(Overrides()), "mode": ["report"]}),
    _document(extra_self_endpoints=[["127.0.0.1", -1]]),
])
def test_a_malformed_configuration_is_refused(document) -> None:
    with pytest.raises(ValueError):
        WorkerConfig.from_json(json.dumps(document))


def test_a_missing_field_is_refused() -> None:
    document = _document()
    del document["run"]["fast_tunnels"]
    with pytest.raises(ValueError, match="missing"):
        WorkerConfig.from_json(json.dumps(document))


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | texts,
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4)))
def test_any_json_is_a_configuration_or_a_value_error(value) -> None:
    try:
        parsed = WorkerConfig.from_json(json.dumps(value))
    except ValueError:
        return
    assert isinstance(parsed, WorkerConfig)  # anything else (TypeError, KeyError...) fails the test


def test_reports_come_back_as_they_were_sent() -> None:
    ready = WorkerReport(READY, listen=("127.0.0.1", 3128), admin=("::1", 40000), pid=42)
    failed = WorkerReport(FAILED, error="the proxy listener cannot listen on 127.0.0.1:3128", exit=2)
    for report in (ready, failed, WorkerReport(READY, listen=("127.0.0.1", 1), admin=None, pid=1)):
        line = report.to_line()
        assert line.endswith(b"\n") and line.count(b"\n") == 1
        assert WorkerReport.from_line(line) == report


@pytest.mark.parametrize("line", [b"[]", b'{"event": "ready"}', b'{"event": "ready", "pid": 1, "listen": [], '
                                  b'"admin": null}', b'{"event": "done", "error": "x", "exit": 1}',
                                  b'{"event": "failed", "error": "x", "exit": 1, "more": 1}', b"not json"])
def test_a_malformed_report_is_refused(line: bytes) -> None:
    with pytest.raises(ValueError):
        WorkerReport.from_line(line)
