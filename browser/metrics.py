"""The browser server's counters, served as ``GET /metrics`` on its own port in the Prometheus text
format (the same format as the proxy's ``/metrics``; ``browser/`` does not import the proxy)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class BrowserMetrics:
    contexts_opened: int = 0
    contexts_refused: Counter[str] = field(default_factory=Counter)  # by cap: client | server
    contexts_reaped: Counter[str] = field(default_factory=Counter)  # by why: idle | connection_idle | ...
    connections_accepted: int = 0
    connections_refused: Counter[str] = field(default_factory=Counter)  # client | server | web_origin | session
    connections_closed: Counter[str] = field(default_factory=Counter)  # idle | oversized | browser_exited ...
    calls_refused: Counter[str] = field(default_factory=Counter)  # filter | in_flight | call_id
    browser_starts: int = 0
    browser_exits: Counter[str] = field(default_factory=Counter)  # memory_ceiling | unexpected
    oom_kills: int = 0  # processes the kernel killed in the browser's memory cgroup

    def render(self, gauges: dict[str, tuple[str, float]]) -> str:
        """The counters plus ``gauges`` (name → (help, value)) the server reads at the time of asking."""
        lines: list[str] = []

        def family(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP egresswall_browser_{name} {help_text}")
            lines.append(f"# TYPE egresswall_browser_{name} {kind}")
            lines.extend(f"egresswall_browser_{name}{labels} {_number(value)}" for labels, value in samples)

        def by(label: str, counter: Counter[str]) -> list[tuple[str, float]]:
            return [(f'{{{label}="{key}"}}', n) for key, n in sorted(counter.items())]

        for name, (help_text, value) in gauges.items():
            family(name, "gauge", help_text, [("", value)])
        family("contexts_opened_total", "counter", "Contexts opened.", [("", self.contexts_opened)])
        family("contexts_refused_total", "counter", "Context opens refused by a cap (nothing was created).",
               by("cap", self.contexts_refused))
        family("contexts_reaped_total", "counter", "Contexts the server closed, by why.",
               by("reason", self.contexts_reaped))
        family("connections_accepted_total", "counter", "Client connections accepted.",
               [("", self.connections_accepted)])
        family("connections_refused_total", "counter", "Client connections refused, by why.",
               by("reason", self.connections_refused))
        family("connections_closed_total", "counter", "Client connections the server closed, by why.",
               by("reason", self.connections_closed))
        family("calls_refused_total", "counter", "Protocol calls refused, by why.", by("reason", self.calls_refused))
        family("browser_starts_total", "counter", "Browsers started (the first, then one after each exit).",
               [("", self.browser_starts)])
        family("browser_exits_total", "counter", "Browsers that exited while serving, by why.",
               by("reason", self.browser_exits))
        family("oom_kills_total", "counter", "Browser processes the kernel killed at the memory ceiling.",
               [("", self.oom_kills)])
        return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))
