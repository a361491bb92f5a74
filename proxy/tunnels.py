"""The layers egresswall puts inside a CONNECT tunnel once it has decided.

``CountedRelay`` passes bytes through untouched (no certificate on the client) and counts them
for the audit log. ``RefuseTls`` answers a ClientHello whose SNI disagrees with the CONNECT host
with a fatal TLS alert and closes the tunnel.
"""

from __future__ import annotations

from collections.abc import Callable

from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers.tcp import TCPLayer
from mitmproxy.proxy.utils import expect

# A TLS 1.2 record: alert (21), version 3.3, length 2, level fatal (2), unrecognized_name (112).
TLS_ALERT_UNRECOGNIZED_NAME = bytes([21, 3, 3, 0, 2, 2, 112])


class CountedRelay(TCPLayer):
    """TCP passthrough that counts bytes each way and reports once when the tunnel is done."""

    def __init__(self, context: Context, on_done: Callable[[int, int, str | None], None]) -> None:
        super().__init__(context, ignore=True)
        self.bytes_up = 0
        self.bytes_down = 0
        self._on_done = on_done
        self._reported = False

    @expect(events.DataReceived, events.ConnectionClosed)
    def relay_messages(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.DataReceived):
            if event.connection == self.context.client:
                self.bytes_up += len(event.data)
            else:
                self.bytes_down += len(event.data)
        yield from super().relay_messages(event)
        if self._handle_event == self.done:
            self.report(None)

    def report(self, error: str | None) -> None:
        if not self._reported:
            self._reported = True
            self._on_done(self.bytes_up, self.bytes_down, error)


class RefuseTls(layer.Layer):
    """Send a fatal TLS alert to the client and close both sides."""

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.Start):
            yield commands.SendData(self.context.client, TLS_ALERT_UNRECOGNIZED_NAME)
            yield commands.CloseConnection(self.context.client)
            if self.context.server.connected:
                yield commands.CloseConnection(self.context.server)
