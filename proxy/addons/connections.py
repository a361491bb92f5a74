"""What the addons share about mitmproxy's connections, keyed by mitmproxy's connection ids."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..gate import Tunnel


@dataclass
class ConnectionTable:
    # (client connection id, host, port) -> the checked address a tunnel's upstream connects must use
    pins: dict[tuple[str, str, int], str] = field(default_factory=dict)
    # client connection id -> (host, port, checked address) of its latest plain request. One per client
    # connection: its connect comes before mitmproxy reads the next request, and one per host ever asked
    # for would grow for as long as a kept-alive connection lives.
    request_pins: dict[str, tuple[str, int, str]] = field(default_factory=dict)
    restore: dict[str, tuple[str, int]] = field(default_factory=dict)  # server id -> (host, port) to put back
    tunnels: dict[str, Tunnel] = field(default_factory=dict)  # server connection id of a CONNECT -> its tunnel
    admitted: dict[str, str] = field(default_factory=dict)  # client connection id -> the client key it counts on
    # Client connections whose CONNECT was answered: every request on them from then on is inside the tunnel, even
    # after its entry in ``tunnels`` is gone (its server connection closed, and mitmproxy opens another).
    tunneled: set[str] = field(default_factory=set)
    # Client connection id -> why the latest request inside its tunnel failed (its upstream connect, say), while no
    # request came after it: the tunnel's closing line says so rather than only that the connection closed.
    failed_inside: dict[str, str] = field(default_factory=dict)

    def pin_for(self, client_id: str, host: str, port: int) -> str | None:
        """The checked address a connect of this client connection to (host, port) must use, if any."""
        latest = self.request_pins.get(client_id)
        if latest is not None and latest[:2] == (host, port):
            return latest[2]
        return self.pins.get((client_id, host, port))

    def forget_client(self, client_id: str) -> list[Tunnel]:
        """A client connection closed: drop its pins and return its tunnels (each still to be closed)."""
        self.request_pins.pop(client_id, None)
        self.tunneled.discard(client_id)
        self.failed_inside.pop(client_id, None)
        for key in [k for k in self.pins if k[0] == client_id]:
            del self.pins[key]
        ended = [sid for sid, t in self.tunnels.items() if t.client_conn_id == client_id]
        return [self.tunnels.pop(sid) for sid in ended]
