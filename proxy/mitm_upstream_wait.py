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
"""

from __future__ import annotations

import time
from collections.abc import Callable

from mitmproxy import connection
from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.layers.http._upstream_proxy import HttpUpstreamProxy
from mitmproxy.proxy.tunnel import TunnelState
from mitmproxy.utils import human

_TIMER = "_egresswall_upstream_timer"  # on an HttpUpstreamProxy: its wake-up request
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


def install(timeout: Callable[[], float]) -> None:
    """``timeout``: the connect timeout in force, read each time a CONNECT is sent (a reload applies)."""
    global _timeout
    _timeout = timeout
    if _originals:
        return
    assert "_handle_event" not in HttpUpstreamProxy.__dict__, "mitmproxy's HttpUpstreamProxy changed: see this module"
    _originals.update(start_handshake=HttpUpstreamProxy.start_handshake, handle_event=HttpUpstreamProxy._handle_event)
    HttpUpstreamProxy.start_handshake = _start_handshake
    HttpUpstreamProxy._handle_event = _handle_event


def uninstall() -> None:
    if _originals:
        HttpUpstreamProxy.start_handshake = _originals["start_handshake"]
        del HttpUpstreamProxy._handle_event  # TunnelLayer's again
        _originals.clear()
