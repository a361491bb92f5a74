"""The gate in process: decisions, admission, the connect-time guard, tunnel starts and the one record
writer, driven with plain values (no mitmproxy), against the loopback lab's real DNS server."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
from labnet import PUBLIC_IP
from tls_build import ECH, client_hello, extension

from proxy.audit import AuditLog
from proxy.first_bytes import FirstBytes
from proxy.gate import Gate, HttpAsk, Tunnel
from proxy.metrics import Metrics
from proxy.records import SCHEMA_PATH
from proxy.reload import PolicyHolder

SCHEMA = json.loads(SCHEMA_PATH.read_text())


@pytest.fixture
def make_gate(lab, tmp_path):
    made: list[Gate] = []

    def make(extra: str = "", default: str = "allow", limits: str = "", connect_to_http_port: bool = False) -> Gate:
        policy = tmp_path / "policy.yaml"
        text = lab.policy_text(extra, default=default, limits=limits)
        if connect_to_http_port:  # a CONNECT to the plain-HTTP port is allowed (and carries parsed HTTP)
            text = text.replace("  connect: [", f"  connect: [{lab.public.port}, ")
        policy.write_text(text)
        gate = Gate(PolicyHolder(str(policy)), AuditLog(str(tmp_path / "audit.jsonl")), Metrics())
        gate.log_path = tmp_path / "audit.jsonl"
        made.append(gate)
        return gate
    yield make
    for gate in made:
        gate.audit.close()


def judge_whole(gate: Gate, tunnel: Tunnel, data: bytes) -> FirstBytes:
    """The gate's judgement of a tunnel start that came in one read."""
    return gate.tunnel_start(tunnel, gate.first_message(tunnel), data)


def records(gate: Gate) -> list[dict]:
    lines = [json.loads(line) for line in gate.log_path.read_text().splitlines()]
    for line in lines:
        jsonschema.validate(line, SCHEMA)  # every record the gate writes is the declared one
    return lines


def test_an_allowed_connect_opens_a_tunnel_pinned_to_the_checked_address(lab, make_gate):
    gate = make_gate()
    outcome = asyncio.run(gate.decide_connect("10.9.8.7", f"public.lab.example:{lab.public_tls.port}", "f1"))
    assert outcome.refusal is None and outcome.tunnel.verdict.pinned == PUBLIC_IP
    assert gate.metrics.value("egresswall_open_tunnels") == 1
    gate.tunnel_closed(outcome.tunnel, 10, 20, None)
    gate.tunnel_closed(outcome.tunnel, 10, 20, None)  # once only
    decision, tunnel = records(gate)
    assert (decision["event"], decision["verdict"], decision["pinned"], decision["client"]) == (
        "decision", "allow", PUBLIC_IP, "10.9.8.7")
    assert (tunnel["event"], tunnel["bytes_up"], tunnel["bytes_down"], tunnel["status"]) == ("tunnel", 10, 20, 200)
    assert gate.metrics.value("egresswall_open_tunnels") == 0


@pytest.mark.parametrize("authority, stage, rule", [
    ("denied.lab.example:{port}", "host", None),
    ("internal.lab.example:{port}", "address", "special-purpose 127.0.0.0/8"),
    ("user@public.lab.example:{port}", "form", "form:userinfo"),
    ("public.lab.example:22", "port", "ports.connect"),
])
def test_refused_connects_get_one_record_and_no_tunnel(lab, make_gate, authority, stage, rule):
    gate = make_gate("hosts:\n  deny: [denied.lab.example]\n")
    outcome = asyncio.run(gate.decide_connect("10.0.0.1", authority.format(port=lab.public_tls.port)))
    assert outcome.tunnel is None and outcome.refusal.status == 403
    (record,) = records(gate)
    assert record["verdict"] == "refuse" and record["stage"] == stage and record["status"] == 403
    assert rule is None or record["rule"] == rule
    assert gate.metrics.value("egresswall_open_tunnels") == 0


def test_a_pin_that_is_egresswall_itself_is_refused_as_self(lab, make_gate):
    gate = make_gate()
    gate.self_endpoints.add((PUBLIC_IP, lab.public_tls.port))
    outcome = asyncio.run(gate.decide_connect("10.0.0.1", f"public.lab.example:{lab.public_tls.port}"))
    assert outcome.refusal.verdict.rule == "self"
    assert records(gate)[0]["rule"] == "self"


def test_the_guard_rechecks_the_pin_against_the_policy_in_force(lab, make_gate, tmp_path):
    gate = make_gate()
    assert gate.guard(PUBLIC_IP, 443) is None
    (tmp_path / "policy.yaml").write_text(lab.policy_text().replace(f"allow: [{PUBLIC_IP}/32]", "allow: []"))
    assert gate.holder.reload()
    assert "127.0.0.0/8" in gate.guard(PUBLIC_IP, 443)


def test_admission_counts_at_accept_and_refuses_past_each_cap(make_gate):
    gate = make_gate(limits="limits:\n  max_connections: 3\n  max_connections_per_client: 2\n")
    assert gate.admit("10.0.0.1") is None and gate.admit("10.0.0.1") is None
    assert gate.admit("10.0.0.1").rule == "limits.max_connections_per_client"
    assert gate.admit("10.0.0.2") is None
    assert gate.admit("10.0.0.3").rule == "limits.max_connections"
    gate.release("10.0.0.1")
    assert gate.admit("10.0.0.3") is None
    assert gate.metrics.value("egresswall_open_connections") == 3


def test_the_gate_refuses_a_third_connection_from_one_64_and_admits_another_64(make_gate):
    gate = make_gate(limits="limits:\n  max_connections_per_client: 2\n")
    assert gate.admit("2001:db8:1:2::a") is None and gate.admit("2001:db8:1:2::b") is None
    refusal = gate.admit("2001:db8:1:2:ffff::c")
    assert refusal.rule == "limits.max_connections_per_client" and refusal.status == 429
    assert "2001:db8:1:2::/64" in refusal.reason and "counted as one" in refusal.reason
    assert gate.admit("2001:db8:1:3::a") is None
    gate.release("2001:db8:1:2::b")  # released by its own address, counted back to its /64
    assert gate.admit("2001:db8:1:2::d") is None
    assert gate.admission.per_client["2001:db8:1:2::/64"] == 2


def test_a_tunnel_start_is_judged_on_whole_messages_only(lab, make_gate):
    gate = make_gate()
    tunnel = asyncio.run(gate.decide_connect("10.0.0.1", f"public.lab.example:{lab.public_tls.port}")).tunnel
    hello = client_hello(b"public.lab.example")
    first = gate.first_message(tunnel)  # the transport's reader: each read fed once
    assert gate.tunnel_start(tunnel, first, hello[:1]).need_more
    assert gate.tunnel_start(tunnel, first, hello[1:-1]).need_more
    judged = gate.tunnel_start(tunnel, first, hello[-1:])
    assert judged.kind == "tls" and judged.sni == "public.lab.example"
    assert [r["event"] for r in records(gate)] == ["decision"]  # nothing refused


@pytest.mark.parametrize("data, rule", [
    (client_hello(b"other.lab.example"), "tls:sni"),
    (client_hello(sni_body=b"\x00\x05\x01\x00\x02ab"), "tls:sni"),
    (b"GET / HTTP/1.1\r\nHost: other.lab.example\r\n\r\n", "tls:not-tls"),
    (b"G", "tls:not-tls"),
])
def test_a_bad_tunnel_start_is_refused_with_a_record_and_closes_the_tunnel(lab, make_gate, data, rule):
    gate = make_gate()
    tunnel = asyncio.run(gate.decide_connect("10.0.0.1", f"public.lab.example:{lab.public_tls.port}")).tunnel
    assert judge_whole(gate, tunnel, data).refused
    decision, refused, closed = records(gate)
    assert refused["rule"] == rule and refused["verdict"] == "refuse" and refused["id"] == tunnel.id + "-tls"
    assert closed["event"] == "tunnel" and tunnel.closed


def test_encrypted_client_hello_is_refused_on_an_allowlist_and_passes_on_the_open_web(lab, make_gate):
    hello = client_hello(b"public.lab.example", extra=(extension(ECH, bytes(40)),))
    for default, refused in (("deny", True), ("allow", False)):
        gate = make_gate("hosts:\n  allow: [public.lab.example]\n", default=default)
        tunnel = asyncio.run(gate.decide_connect("10.0.0.1", f"public.lab.example:{lab.public_tls.port}")).tunnel
        assert judge_whole(gate, tunnel, hello).refused is refused


def test_http_inside_a_connect_to_a_plain_http_port_needs_a_whole_head(lab, make_gate):
    gate = make_gate(connect_to_http_port=True)
    tunnel = asyncio.run(gate.decide_connect("10.0.0.1", f"public.lab.example:{lab.public.port}")).tunnel
    assert tunnel.http_inside
    head = b"GET /chat HTTP/1.1\r\nHost: public.lab.example\r\nUpgrade: websocket\r\n\r\n"
    for cut in (1, 5, len(head) - 1):
        assert judge_whole(gate, tunnel, head[:cut]).need_more
    first = gate.first_message(tunnel)
    assert [gate.tunnel_start(tunnel, first, head[i:i + 1]).need_more for i in range(len(head))] == (
        [True] * (len(head) - 1) + [False])  # judged at its last byte, and not before
    assert judge_whole(gate, tunnel, head).kind == "http"
    assert judge_whole(gate, tunnel, client_hello(b"public.lab.example")).kind == "tls"  # TLS may come too
    assert judge_whole(gate, tunnel, b"\x00\x01 not http\r\n\r\n").rule == "http:not-http"


def test_a_request_inside_a_tunnel_is_decided_against_the_tunnel_host(lab, make_gate):
    gate = make_gate(connect_to_http_port=True)
    tunnel = asyncio.run(gate.decide_connect("10.0.0.1", f"public.lab.example:{lab.public.port}")).tunnel
    ask = HttpAsk("10.0.0.1", "GET", "http", "whatever", 1, "/", host_header="other.lab.example")
    outcome = asyncio.run(gate.decide_request(ask, tunnel))
    assert outcome.refusal.verdict.rule == "form:host-header"


def test_a_declared_body_over_the_limit_is_refused_before_the_decision(lab, make_gate):
    gate = make_gate(limits="limits:\n  max_request_body: 100\n")
    ask = HttpAsk("10.0.0.1", "POST", "http", "public.lab.example", lab.public.port, "/up",
                  host_header=f"public.lab.example:{lab.public.port}", content_length=101)
    outcome = asyncio.run(gate.decide_request(ask, None))
    assert outcome.refusal.status == 413 and outcome.refusal.verdict.rule == "limits.max_request_body"
    (record,) = records(gate)
    assert record["status"] == 413 and record["host"] == "public.lab.example" and record["addresses"] == []


def test_an_unwritable_audit_log_refuses_what_the_policy_allows(lab, make_gate):
    gate = make_gate()
    gate.audit.close()
    gate.audit.path, gate.audit._fd = "/dev/full", None
    gate.audit.reopen()
    outcome = asyncio.run(gate.decide_connect("10.0.0.1", f"public.lab.example:{lab.public_tls.port}"))
    assert outcome.refusal.status == 503 and outcome.refusal.verdict.rule == "audit"
    # The count is the audit log's own (the decision line, and the probe's line if it ran already).
    assert gate.metrics.value("egresswall_audit_write_failures_total") == gate.audit.failures >= 1


def test_a_record_line_is_every_field_once_time_first_lists_copied() -> None:
    import dataclasses

    from proxy.records import AuditRecord

    record = AuditRecord(event="tunnel", id="x", client="127.0.0.1", verdict="allow", stage="address",
                         rule="global", rule_id="global", reason="r", mode="enforce", time="t",
                         addresses=["192.0.2.1"], cnames=["a.example"])
    line = record.as_dict()
    assert list(line) == ["time"] + [f.name for f in dataclasses.fields(AuditRecord) if f.name != "time"]
    assert line == dataclasses.asdict(record)
    line["addresses"].append("192.0.2.2")
    assert record.addresses == ["192.0.2.1"]
