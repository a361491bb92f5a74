"""Counters and gauges for ``/metrics``, in the Prometheus text format (written by hand: a few
dozen lines cost less than a dependency in the hot path)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


@dataclass
class Metrics:
    decisions: Counter[tuple[str, str]] = field(default_factory=Counter)  # (verdict, rule)
    dns_errors: Counter[str] = field(default_factory=Counter)
    refusals: Counter[str] = field(default_factory=Counter)  # by reason class: caps, timeouts...
    reloads: Counter[str] = field(default_factory=Counter)  # success | failure
    bytes_up: int = 0
    bytes_down: int = 0
    open_tunnels: int = 0
    fast_tunnels: int = 0  # tunnels relayed by the front (proxy/front.py)
    open_connections: int = 0
    dns_seconds_sum: float = 0.0
    dns_lookups: int = 0
    audit_failures: int = 0
    policy_loaded: int = 0
    # Sessions (proxy/sessions/): no per-session labels, only counts and refusals by reason.
    session_refusals: Counter[str] = field(default_factory=Counter)  # by rule: session:not-granted, ...
    session_requests: int = 0  # requests and CONNECTs admitted under a session
    sessions_created: int = 0
    sessions_ended: int = 0
    sessions_active: int = 0  # sessions in force in the store (refreshed every few seconds)

    def observe_dns(self, seconds: float) -> None:
        self.dns_lookups += 1
        self.dns_seconds_sum += seconds

    def render(self) -> str:
        lines: list[str] = []

        def family(name: str, kind: str, help_text: str, samples: list[tuple[dict[str, str], float]]) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
                lines.append(f"{name}{{{text}}} {value}" if text else f"{name} {value}")

        family("egresswall_decisions_total", "counter", "Decisions by verdict and deciding rule.",
               [({"verdict": v, "rule": r}, n) for (v, r), n in sorted(self.decisions.items())])
        family("egresswall_refusals_total", "counter", "Refusals that are not policy decisions (caps, timeouts).",
               [({"reason": r}, n) for r, n in sorted(self.refusals.items())])
        family("egresswall_open_tunnels", "gauge", "CONNECT tunnels open now.", [({}, self.open_tunnels)])
        family("egresswall_fast_tunnels_total", "counter", "Tunnels relayed by the fast path, not mitmproxy.",
               [({}, self.fast_tunnels)])
        family("egresswall_open_connections", "gauge", "Client connections open now.",
               [({}, self.open_connections)])
        family("egresswall_bytes_total", "counter", "Bytes relayed, by direction.",
               [({"direction": "up"}, self.bytes_up), ({"direction": "down"}, self.bytes_down)])
        family("egresswall_dns_lookup_seconds", "summary", "DNS lookup latency.",
               [])
        lines.append(f"egresswall_dns_lookup_seconds_sum {self.dns_seconds_sum}")
        lines.append(f"egresswall_dns_lookup_seconds_count {self.dns_lookups}")
        family("egresswall_dns_errors_total", "counter", "DNS lookups that failed, by kind.",
               [({"kind": k}, n) for k, n in sorted(self.dns_errors.items())])
        family("egresswall_policy_reloads_total", "counter", "Policy reloads by result.",
               [({"result": r}, self.reloads.get(r, 0)) for r in ("success", "failure")])
        family("egresswall_policy_loaded", "gauge", "1 when a policy is in force.", [({}, self.policy_loaded)])
        family("egresswall_audit_write_failures_total", "counter", "Audit lines that could not be written.",
               [({}, self.audit_failures)])
        family("egresswall_session_refusals_total", "counter", "Requests refused by a session, by reason.",
               [({"reason": r}, n) for r, n in sorted(self.session_refusals.items())])
        family("egresswall_session_requests_total", "counter", "Requests and CONNECTs admitted under a session.",
               [({}, self.session_requests)])
        family("egresswall_sessions_created_total", "counter", "Sessions created through the admin API.",
               [({}, self.sessions_created)])
        family("egresswall_sessions_ended_total", "counter", "Sessions ended through the admin API.",
               [({}, self.sessions_ended)])
        family("egresswall_sessions_active", "gauge", "Sessions in force in the session store.",
               [({}, self.sessions_active)])
        return "\n".join(lines) + "\n"
