"""What the addons share about mitmproxy's connections, keyed by mitmproxy's connection ids."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..gate import Tunnel


@dataclass
class ConnectionTable:
    # (client connection id, host, port) -> the checked address its next upstream connect must use
    pins: dict[tuple[str, str, int], str] = field(default_factory=dict)
    restore: dict[str, tuple[str, int]] = field(default_factory=dict)  # server id -> (host, port) to put back
    tunnels: dict[str, Tunnel] = field(default_factory=dict)  # server connection id of a CONNECT -> its tunnel
    admitted: dict[str, str] = field(default_factory=dict)  # client connection id -> the client key it counts on

    def forget_client(self, client_id: str) -> list[Tunnel]:
        """A client connection closed: drop its pins and return its tunnels (each still to be closed)."""
        for key in [k for k in self.pins if k[0] == client_id]:
            del self.pins[key]
        ended = [sid for sid, t in self.tunnels.items() if t.client_conn_id == client_id]
        return [self.tunnels.pop(sid) for sid in ended]
