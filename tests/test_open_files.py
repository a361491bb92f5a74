"""The total connection cap is held under the open-file limit (proxy/open_files.py, proxy/admission.py): past
what the limit holds a client is refused 503 with a reason naming it, never left unanswered in the backlog."""

from __future__ import annotations

import resource

from policy.model import Limits
from proxy import open_files
from proxy.admission import Admission


def test_the_total_is_held_under_what_the_open_file_limit_holds(monkeypatch):
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (open_files.RESERVED_DESCRIPTORS + 6, 4096))  # holds 2
    gate = Admission()
    limits = Limits()
    assert gate.admit("127.0.0.1", limits) is None
    assert gate.admit("127.0.0.2", limits) is None
    refused = gate.admit("127.0.0.3", limits)
    assert refused is not None and refused.status == 503 and refused.rule == "limits.max_connections"
    assert "RLIMIT_NOFILE" in refused.reason and str(limits.max_connections) in refused.reason
    gate.release("127.0.0.1")
    assert gate.admit("127.0.0.3", limits) is None  # room again once one closes


def test_connections_held_follows_the_soft_limit(monkeypatch):
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (1024, 4096))
    assert open_files.connections_held(open_files.soft_limit()) == (1024 - open_files.RESERVED_DESCRIPTORS) // 3
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (10, 4096))
    assert open_files.connections_held(open_files.soft_limit()) == 1  # never 0: one connection always fits


def test_the_soft_limit_is_raised_to_the_hard_one(monkeypatch):
    calls = []
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (1024, 65536))
    monkeypatch.setattr(resource, "setrlimit", lambda kind, limits: calls.append(limits))
    assert open_files.raise_soft_limit() == 65536 and calls == [(65536, 65536)]
    calls.clear()
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (65536, 65536))
    assert open_files.raise_soft_limit() == 65536 and calls == []


def test_a_connection_accepted_on_a_descriptor_near_the_limit_is_refused(monkeypatch):
    """The kernel gives the lowest descriptor free: one at or above the usable ones means the process holds about
    that many (mitmproxy's path keeps a connection to each origin a client connection asked, which the count of
    client connections does not see; review round 23b)."""
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (1024, 4096))
    gate, limits = Admission(), Limits()
    assert gate.admit("127.0.0.1", limits, descriptor=10) is None
    refused = gate.admit("127.0.0.2", limits, descriptor=1024 - open_files.RESERVED_DESCRIPTORS)
    assert refused is not None and refused.status == 503 and "RLIMIT_NOFILE 1024" in refused.reason
    assert gate.total == 1  # the refused one is not counted
