"""The layers egresswall puts inside an allowed CONNECT tunnel on mitmproxy's path.

``TunnelStart`` holds the tunnel's first bytes until the gate can judge a whole message (a TLS
ClientHello, or an HTTP request head where the CONNECT went to a plain-HTTP port), bounded by
``limits.header_timeout`` from the moment the tunnel opened; then it hands every event it held to
the layer the judgement calls for. ``CountedRelay`` passes bytes through untouched and
counts them — once the server's first answer shows it is not a HelloRetryRequest, or the client's
second ClientHello after one is judged the same as the first (``RetryWatch``, proxy/tls_retry.py);
``Refused`` answers a refused start (a TLS alert when it was TLS) and closes both sides.
"""

from __future__ import annotations

from collections.abc import Callable

from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers.tcp import TCPLayer
from mitmproxy.proxy.utils import expect

from ..byte_allowance import BUDGET_CUT, DOWN, UP, ByteAllowance
from ..first_bytes import FirstBytes, FirstMessage
from ..tls_hello import MAX_HELLO_BYTES, TLS_ALERT_UNRECOGNIZED_NAME
from ..tls_retry import AWAIT_SERVER, Released, RetryWatch

Judge = Callable[[FirstMessage, bytes], FirstBytes]  # the tunnel's first bytes so far, and the newest read
Choose = Callable[[FirstBytes], layer.Layer]
RetryRefused = Callable[[str, str, int, int], None]  # (rule, reason, bytes up, bytes down)


MAX_SERVER_FIRST = MAX_HELLO_BYTES  # bytes a server may send before the client's first message is judged


class TunnelStart(layer.Layer):
    def __init__(self, context: Context, first: FirstMessage, judge: Judge, choose: Choose, timeout: float,
                 on_timeout: Callable[[int], None], on_cut_short: Callable[[int, bool], None],
                 on_server_first: Callable[[int], None]) -> None:
        super().__init__(context)
        self.judge, self.choose, self.timeout, self.on_timeout = judge, choose, timeout, on_timeout
        self.on_cut_short = on_cut_short  # (bytes that came, by the client)
        self.on_server_first = on_server_first  # (bytes the server sent): more than MAX_SERVER_FIRST, refused
        self.held: list[events.Event] = []
        self.server_held = 0
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
            # Closed before a whole first message: the tunnel ends here (a server that closes first is told
            # apart only in the reason).
            self.on_cut_short(len(self.first.data), event.connection == self.context.client)
            yield from self._close()
            return
        if isinstance(event, events.DataReceived) and event.connection != self.context.client:
            # mitmproxy reads the server as it sends: what it sends before the client's first message is judged
            # is held here, so it is bounded (a flooding origin grew a worker by 200 MiB in 30 s; the fast front
            # leaves it in the kernel's buffers). Neither TLS nor HTTP has the server speak first.
            self.server_held += len(event.data)
            if self.server_held > MAX_SERVER_FIRST:
                self.on_server_first(self.server_held)
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
        self.child = Refused(self.context, b"")
        yield from self.child.handle_event(events.Start())


class CountedRelay(TCPLayer):
    """TCP passthrough that counts bytes each way and reports once when the tunnel is done.

    With ``retry``, the first client message is the judged ClientHello (``hello_size`` bytes of it go to the
    server, the rest waits) and nothing else moves until ``retry`` has seen the server's first answer — and,
    after a HelloRetryRequest, judged the client's second ClientHello; each wait is bounded by
    ``retry_timeout``, and a refusal goes to ``on_refused`` (which records it) before both sides are closed."""

    def __init__(self, context: Context, on_done: Callable[[int, int, str | None], None],
                 retry: RetryWatch | None = None, hello_size: int = 0, retry_timeout: float = 30.0,
                 on_refused: RetryRefused | None = None, allowance: ByteAllowance | None = None) -> None:
        super().__init__(context, ignore=True)
        self.bytes_up = 0
        self.bytes_down = 0
        self.allowance = allowance  # its session's bytes left: each chunk is taken from it before it is relayed
        self._on_done = on_done
        self._reported = False
        self.retry = retry if retry is not None and not retry.done else None
        self.hello_size, self.hello_sent = hello_size, False
        self.retry_timeout, self.on_refused = retry_timeout, on_refused
        self.retry_timer: commands.RequestWakeup | None = None
        self.timed_phase: str | None = None

    @expect(events.DataReceived, events.ConnectionClosed, events.Wakeup)
    def relay_messages(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.Wakeup):
            if event.command is self.retry_timer and self.retry is not None:
                yield from self._apply(Released(refused=self.retry.timed_out(self.retry_timeout)))
            return  # else the TunnelStart timer, or ours after the question was answered: no longer needed
        if isinstance(event, events.DataReceived):
            from_client = event.connection == self.context.client
            if self.allowance is not None and not self.allowance.take(UP if from_client else DOWN, len(event.data)):
                # Past its session's byte budget: not relayed, and the tunnel ends (the gate says why).
                self.retry = None
                yield from self._close_both()
                self.report(BUDGET_CUT)
                return
            if from_client:
                self.bytes_up += len(event.data)
            else:
                self.bytes_down += len(event.data)
            if self.retry is not None:
                yield from self._watched(event)
                return
        elif self.retry is not None:  # a side closed mid-handshake: what was held can never be judged whole
            reason = self.retry.ended()
            self.retry = None
            yield from self._close_both()
            self.report(reason)
            return
        yield from super().relay_messages(event)
        if self._handle_event == self.done:
            self.report(None)

    def _watched(self, event: events.DataReceived) -> layer.CommandGenerator[None]:
        assert self.retry is not None
        data = event.data
        if event.connection != self.context.client:
            yield from self._apply(self.retry.from_server(data))
            return
        if not self.hello_sent:  # the judged ClientHello, with whatever the client sent after it
            self.hello_sent = True
            yield commands.SendData(self.context.server, data[:self.hello_size])
            data = data[self.hello_size:]
            if not data:
                return
        yield from self._apply(self.retry.from_client(data))

    def _apply(self, released: Released) -> layer.CommandGenerator[None]:
        retry = self.retry
        assert retry is not None
        if released.refused is not None:
            self.retry = None
            self._reported = True  # the refusal record closes the tunnel
            if self.on_refused is not None:
                self.on_refused(released.refused.rule, released.refused.reason, self.bytes_up, self.bytes_down)
            yield commands.SendData(self.context.client, TLS_ALERT_UNRECOGNIZED_NAME)
            yield from self._close_both()
            return
        if released.to_client:
            yield commands.SendData(self.context.client, released.to_client)
        if released.to_server:
            yield commands.SendData(self.context.server, released.to_server)
        if retry.done:
            self.retry = None
        elif self.timed_phase != retry.phase and (retry.phase != AWAIT_SERVER or retry.server_held):
            self.timed_phase = retry.phase
            self.retry_timer = commands.RequestWakeup(self.retry_timeout)
            yield self.retry_timer

    def _close_both(self) -> layer.CommandGenerator[None]:
        self._handle_event = self.done
        yield commands.CloseConnection(self.context.client)
        if self.context.server.connected:
            yield commands.CloseConnection(self.context.server)

    @expect(events.DataReceived, events.ConnectionClosed, events.Wakeup)
    def done(self, _: events.Event) -> layer.CommandGenerator[None]:
        yield from ()  # (a timer of ours may still go off)

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
    """Answer a refused tunnel start with the gate's answer (a fatal TLS alert when the client spoke TLS, an HTTP
    refusal for a request head), close both sides."""

    def __init__(self, context: Context, answer: bytes) -> None:
        super().__init__(context)
        self.answer = answer

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.Start):
            if self.answer:
                yield commands.SendData(self.context.client, self.answer)
            yield commands.CloseConnection(self.context.client)
            if self.context.server.connected:
                yield commands.CloseConnection(self.context.server)
