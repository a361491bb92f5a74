"""The layers egresswall puts inside an allowed CONNECT tunnel on mitmproxy's path.

``TunnelStart`` holds the tunnel's first bytes until the gate can judge a whole message (a TLS
ClientHello, or an HTTP request head where the CONNECT went to a plain-HTTP port), bounded by
``limits.header_timeout`` from the moment the tunnel opened; then it hands every event it held to
the layer the judgement calls for. ``CountedRelay`` passes bytes through untouched and counts them;
``Refused`` answers a refused start (a TLS alert when it was TLS) and closes both sides.
"""

from __future__ import annotations

from collections.abc import Callable

from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers.tcp import TCPLayer
from mitmproxy.proxy.utils import expect

from ..first_bytes import FirstBytes, FirstMessage

# A TLS 1.2 record: alert (21), version 3.3, length 2, level fatal (2), unrecognized_name (112).
TLS_ALERT_UNRECOGNIZED_NAME = bytes([21, 3, 3, 0, 2, 2, 112])

Judge = Callable[[FirstMessage, bytes], FirstBytes]  # the tunnel's first bytes so far, and the newest read
Choose = Callable[[FirstBytes], layer.Layer]


class TunnelStart(layer.Layer):
    def __init__(self, context: Context, first: FirstMessage, judge: Judge, choose: Choose, timeout: float,
                 on_timeout: Callable[[int], None]) -> None:
        super().__init__(context)
        self.judge, self.choose, self.timeout, self.on_timeout = judge, choose, timeout, on_timeout
        self.held: list[events.Event] = []
        # The client's bytes so far, and where judging them stopped: each read is judged once, as it comes
        # (judging the whole buffer again on every read cost the square of a dripped head's size).
        self.first = first
        self.timer: commands.RequestWakeup | None = None
        self.child: layer.Layer | None = None

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.Wakeup) and event.command is self.timer:
            if self.child is None:  # still waiting for a whole first message: the bound has passed
                self.on_timeout(len(self.first.data))
                yield from self._close()
            return  # our own timer: never passed on (the layers below do not know it)
        if self.child is not None:
            yield from self.child.handle_event(event)
            return
        if isinstance(event, events.Wakeup):
            return
        self.held.append(event)
        if isinstance(event, events.Start):
            self.timer = commands.RequestWakeup(self.timeout)
            yield self.timer
            return
        if isinstance(event, events.ConnectionClosed):
            self.on_timeout(-1)  # closed before a whole first message: the tunnel ends here
            yield from self._close()
            return
        if isinstance(event, events.DataReceived) and event.connection == self.context.client:
            judged = self.judge(self.first, event.data)
            if judged.need_more:
                return
            self.child = self.choose(judged)
            # The client's bytes go on as ONE event: a NextLayer that got the first byte alone would
            # choose its layer on that byte (mitmproxy takes fewer than 3 bytes for "not HTTP, raw TCP").
            held, self.held = self.held, []
            others = [e for e in held
                      if not (isinstance(e, events.DataReceived) and e.connection == self.context.client)]
            for past in others:
                yield from self.child.handle_event(past)
            yield from self.child.handle_event(events.DataReceived(self.context.client, bytes(self.first.data)))

    def _close(self) -> layer.CommandGenerator[None]:
        self.child = Refused(self.context, tls=False)
        yield from self.child.handle_event(events.Start())


class CountedRelay(TCPLayer):
    """TCP passthrough that counts bytes each way and reports once when the tunnel is done."""

    def __init__(self, context: Context, on_done: Callable[[int, int, str | None], None]) -> None:
        super().__init__(context, ignore=True)
        self.bytes_up = 0
        self.bytes_down = 0
        self._on_done = on_done
        self._reported = False

    @expect(events.DataReceived, events.ConnectionClosed, events.Wakeup)
    def relay_messages(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.Wakeup):
            return  # the TunnelStart timer, no longer needed
        if isinstance(event, events.DataReceived):
            if event.connection == self.context.client:
                self.bytes_up += len(event.data)
            else:
                self.bytes_down += len(event.data)
        yield from super().relay_messages(event)
        if self._handle_event == self.done:
            self.report(None)

    def handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if (isinstance(event, events.OpenConnectionCompleted) and event.reply
                and event.command.connection == self.context.server):
            # The connect failed where no server_connect_error hook sees it (the CONNECT an upstream proxy
            # refused, in mitmproxy's upstream mode): the tunnel's record says why, not "the client closed".
            self.report(f"connect failed: {event.reply}")
        return super().handle_event(event)

    def report(self, error: str | None) -> None:
        if not self._reported:
            self._reported = True
            self._on_done(self.bytes_up, self.bytes_down, error)


class Refused(layer.Layer):
    """Answer a refused tunnel start (a fatal TLS alert when the client spoke TLS), close both sides."""

    def __init__(self, context: Context, tls: bool) -> None:
        super().__init__(context)
        self.tls = tls

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.Start):
            if self.tls:
                yield commands.SendData(self.context.client, TLS_ALERT_UNRECOGNIZED_NAME)
            yield commands.CloseConnection(self.context.client)
            if self.context.server.connected:
                yield commands.CloseConnection(self.context.server)
