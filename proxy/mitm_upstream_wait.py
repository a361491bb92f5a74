"""mitmproxy's wait for an upstream proxy's answer to its CONNECT, bounded by ``limits.connect_timeout``
(installed by ``mitm_patches``).

In upstream mode mitmproxy answers a client's CONNECT with its own 200, then sends the upstream a CONNECT
(``HttpUpstreamProxy``, a tunnel layer) and waits for the upstream's answer with no bound of its own: an
upstream that accepted the connection and never answered held the tunnel until ``limits.idle_timeout``, and the
record then said the client connection had closed (review round 20). The fast front bounds the same wait by
``limits.connect_timeout`` (``proxy/upstream_connect.py``): so does mitmproxy's path now. When the CONNECT is
sent, the layer asks mitmproxy's connection handler for a wake-up after the timeout; if the tunnel is still
being established then, the layer ends its handshake with the fast front's words, which mitmproxy reports as
the connect's error (the tunnel's closing record, a plain request's 502), and closes the upstream connection.
Test: tests/test_review_round20_upstream_stall.py.

Its reading of the answer is the fast front's too: a 1xx answer before the final one is skipped (mitmproxy took
it for the answer and refused the tunnel, "100 Continue"), and the answer's head is bounded by
``MAX_RESPONSE_HEAD`` (mitmproxy buffered an endless head for as long as the wait lasted). Test:
tests/test_review_round21_upstream_wait.py.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

from mitmproxy import connection
from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.layers.http._upstream_proxy import HttpUpstreamProxy
from mitmproxy.proxy.tunnel import TunnelState
from mitmproxy.utils import human

from .head_end import HEAD_END
from .upstream_connect import MAX_RESPONSE_HEAD

_TIMER = "_egresswall_upstream_timer"  # on an HttpUpstreamProxy: its wake-up request
_HELD = "_egresswall_answer_held"  # on an HttpUpstreamProxy: (bytes of its answer held back, bytes read in all)
_INTERIM = re.compile(rb"HTTP/1\.[01] 1(?!01)[0-9]{2}[ \r\n]")  # a 1xx status line, not 101 Switching Protocols
_originals: dict[str, Callable] = {}
_timeout: Callable[[], float] = float  # replaced by install(); float() is 0.0


def _upstream(layer: HttpUpstreamProxy) -> str:
    """The upstream as the fast front's words name it (its URL)."""
    via = layer.context.server.via
    if via is None:
        return human.format_address(layer.tunnel_connection.address)
    return f"{via[0]}://{human.format_address(via[1])}"


def _start_handshake(self: HttpUpstreamProxy) -> layer.CommandGenerator[None]:
    if self.send_connect:
        timer = commands.RequestWakeup(_timeout())
        self.__dict__[_TIMER] = timer
        yield timer
    return (yield from _originals["start_handshake"](self))


def _handle_event(self: HttpUpstreamProxy, event: events.Event) -> layer.CommandGenerator[None]:
    timer = self.__dict__.get(_TIMER)
    if timer is not None and isinstance(event, events.Wakeup) and event.command is timer:
        del self.__dict__[_TIMER]  # the layer's own wake-up: no layer under it asked for it
        if self.tunnel_state is TunnelState.ESTABLISHING:
            yield from _fail(self, f"the upstream proxy {_upstream(self)} did not open the tunnel within "
                                   f"{timer.delay:g}s (limits.connect_timeout)")
    elif (self.send_connect and isinstance(event, events.ConnectionClosed)
          and event.connection == self.tunnel_connection and self.tunnel_state is TunnelState.ESTABLISHING):
        # mitmproxy's own words are "connection closed", which a record reads as the client's
        yield from _fail(self, f"the upstream proxy {_upstream(self)} closed the connection without answering "
                               "the CONNECT")
    else:
        yield from _originals["handle_event"](self, event)


def _fail(self: HttpUpstreamProxy, why: str) -> layer.CommandGenerator[None]:
    """The tunnel's handshake ends with ``why`` (as the original ends it on a close while establishing)."""
    if self.conn != self.tunnel_connection:
        self.conn.state = connection.ConnectionState.CLOSED
        self.conn.timestamp_end = time.time()
    yield from self.on_handshake_error(why)  # closes the connection to the upstream
    yield from self._handshake_finished(why)  # tells the layer that opened the tunnel why it failed


def _receive_handshake_data(self: HttpUpstreamProxy, data: bytes) -> layer.CommandGenerator[tuple[bool, str | None]]:
    """The upstream's answer to the CONNECT, handed to mitmproxy's reader a whole head at a time, without the 1xx
    heads before the final one; over MAX_RESPONSE_HEAD bytes read before it, the tunnel fails."""
    if not self.send_connect:
        return (yield from _originals["receive_handshake_data"](self, data))
    held, seen = self.__dict__.get(_HELD, (b"", 0))
    held, seen = held + data, seen + len(data)
    while (end := HEAD_END.search(held)) is not None and _INTERIM.match(held):
        held = held[end.end():]  # an interim answer: the final one is still to come
    read_to_the_end = seen if end is None else seen - (len(held) - end.end())  # the bytes before the final head's end
    if read_to_the_end > MAX_RESPONSE_HEAD:  # counted as the front counts them: 1xx heads included
        return False, f"the upstream proxy {_upstream(self)} failed: its answer head is over {MAX_RESPONSE_HEAD} bytes"
    if end is None:
        self.__dict__[_HELD] = (held, seen)
        return False, None
    self.__dict__.pop(_HELD, None)
    return (yield from _originals["receive_handshake_data"](self, held))


def install(timeout: Callable[[], float]) -> None:
    """``timeout``: the connect timeout in force, read each time a CONNECT is sent (a reload applies)."""
    global _timeout
    _timeout = timeout
    if _originals:
        return
    assert "_handle_event" not in HttpUpstreamProxy.__dict__, "mitmproxy's HttpUpstreamProxy changed: see this module"
    _originals.update(start_handshake=HttpUpstreamProxy.start_handshake, handle_event=HttpUpstreamProxy._handle_event,
                      receive_handshake_data=HttpUpstreamProxy.receive_handshake_data)
    HttpUpstreamProxy.start_handshake = _start_handshake
    HttpUpstreamProxy._handle_event = _handle_event
    HttpUpstreamProxy.receive_handshake_data = _receive_handshake_data


def uninstall() -> None:
    if _originals:
        HttpUpstreamProxy.start_handshake = _originals["start_handshake"]
        HttpUpstreamProxy.receive_handshake_data = _originals["receive_handshake_data"]
        del HttpUpstreamProxy._handle_event  # TunnelLayer's again
        _originals.clear()
