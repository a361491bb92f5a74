"""Bounds mitmproxy leaves open, closed here (installed once at import, like ``early_refusal``).

* **Head size.** mitmproxy buffers a request or response head until its blank line arrives, without a
  limit (its own source says "FIXME: protect against header size DoS"): a client or an upstream that
  never ends its headers grows memory forever. A head over ``limits.max_header_bytes`` is refused:
  431 to a client; an upstream's gets the client a 502.
* **Head time.** A head still incomplete ``limits.header_timeout`` seconds after its first byte is cut
  off: 408 to a slowloris client that sends a byte at a time (each byte resets mitmproxy's idle
  timer, so that timer alone never fires); 502 when an upstream drips its headers. Silence is
  already bounded by ``limits.idle_timeout``.
* **Pipelined bytes.** While a request waits for its response, mitmproxy appends whatever else the
  client sends to a buffer it reads only later: one client streaming behind a slow request grows
  memory without end. More than ``limits.max_header_bytes`` waiting there closes the connection.
* **Unparseable heads.** mitmproxy answers a request line or header block it cannot parse with 400 and
  no hook runs; ``on_refusal`` gives it its audit line.
* **Silence.** mitmproxy closes a connection after ``limits.idle_timeout`` without a byte either way
  (its idle watchdog); ``idle_closed`` remembers which clients it closed, so the audit line says
  "idle timeout" (an upstream that never answered) rather than mitmproxy's "Client disconnected.".
* **Connect time.** asyncio has no connect timeout of its own (a blackholed address waits for the
  kernel's SYN retries, minutes): mitmproxy's connects get ``limits.connect_timeout``.

The addon sets ``current_limits`` and ``on_refusal``. Each check is a length comparison and a clock
read per received chunk while a head is incomplete; nothing runs once a head is in.
"""

from __future__ import annotations

import asyncio
import re
import time
import types
from collections.abc import Callable, Generator

import mitmproxy.proxy.server
from mitmproxy import connection
from mitmproxy.net.http import http1
from mitmproxy.proxy import commands, events
from mitmproxy.proxy.layers.http._base import ReceiveHttp
from mitmproxy.proxy.layers.http._events import ErrorCode, RequestProtocolError, ResponseProtocolError
from mitmproxy.proxy.layers.http._http1 import Http1Client, Http1Server

from policy.model import Limits

from . import refusals

# Set by the addon: the limits in force (read at each use, so a reload applies) and where refusals
# that happen before any flow exists are reported (client connection, status, rule, reason).
current_limits: Callable[[], Limits] = Limits


def on_refusal(conn: connection.Connection, status: int, rule: str, reason: str) -> None:
    """Replaced by the addon (which writes the audit line). Status 0: closed without a response (squid's
    000), as when the connection was already gone."""


idle_closed: set[str] = set()  # ids of client connections mitmproxy's idle watchdog closed (the addon discards)

_HEAD_END = re.compile(rb"\n\r?\n")  # what h11's ReceiveBuffer accepts as the end of a head
_STARTED = "_egresswall_head_started"
_original_server_read_headers = Http1Server.read_headers
_original_server_wait = Http1Server.wait
_original_client_read_headers = Http1Client.read_headers
_original_on_timeout = mitmproxy.proxy.server.ConnectionHandler.on_timeout


def _head_size(buf) -> int:
    data = bytes(buf)
    end = _HEAD_END.search(data)
    return end.start() if end else len(data)


def _problem(layer, limits: Limits, what: str) -> tuple[str, str] | None:
    """Checked before mitmproxy parses: (rule, reason) when the head being received is over a bound."""
    if len(layer.buf) > limits.max_header_bytes and _head_size(layer.buf) > limits.max_header_bytes:
        return "limits.max_header_bytes", (f"the {what} head is over {limits.max_header_bytes} bytes "
                                           "(limits.max_header_bytes)")
    started = layer.__dict__.setdefault(_STARTED, time.monotonic())
    if time.monotonic() - started > limits.header_timeout:
        return "limits.header_timeout", (f"the {what} head took more than {limits.header_timeout:g}s "
                                         "(limits.header_timeout)")
    return None


def _watch_logs(generator: Generator, logs: list[str]) -> Generator:
    """Pass a layer's commands through (send() values too), keeping the text of its Log commands."""
    value = None
    while True:
        try:
            command = generator.send(value)
        except StopIteration as stop:
            return stop.value
        if isinstance(command, commands.Log):
            logs.append(command.message)
        value = yield command


def _server_read_headers(self: Http1Server, event: events.Event):
    """A client's request head: bounded in size and time; a parse failure is reported."""
    if isinstance(event, events.DataReceived):
        limits = current_limits()
        problem = _problem(self, limits, "request")
        if problem is not None:
            rule, reason = problem
            status = 431 if rule == "limits.max_header_bytes" else 408
            yield commands.SendData(self.conn, http1.assemble_response(refusals.refusal(status, rule, reason)))
            yield commands.CloseConnection(self.conn)
            self.state = self.done
            on_refusal(self.conn, status, rule, reason)
            return
    elif isinstance(event, events.ConnectionClosed) and len(self.buf) > 0:
        # Closed with half a head: by the client, or by mitmproxy after limits.idle_timeout of silence.
        waited = time.monotonic() - self.__dict__.get(_STARTED, time.monotonic())
        rule, by = ("limits.idle_timeout", "by egresswall after limits.idle_timeout of silence") if (
            self.conn.id in idle_closed) else ("http:incomplete-head", "by the client")
        on_refusal(self.conn, 0, rule, f"the connection was closed {by}, {waited:.1f}s into a request head that "
                                          f"never ended ({len(self.buf)} bytes)")
    logs: list[str] = []
    yield from _watch_logs(_original_server_read_headers(self, event), logs)
    if self.state != self.read_headers:
        self.__dict__.pop(_STARTED, None)  # the head is in: the next one on this connection gets a fresh clock
        if self.state == self.done and self.request is None and isinstance(event, events.DataReceived):
            # mitmproxy answered 400 ("Bad HTTP request line", "Invalid header line"...) before any flow.
            detail = logs[-1].split(": ", 1)[-1] if logs else "unparseable request head"
            on_refusal(self.conn, 400, "http:malformed", f"the request head cannot be parsed: {detail}"[:400])


def _server_wait(self: Http1Server, event: events.Event):
    """A request is out, its response not yet back: bytes the client sends meanwhile are only buffered."""
    limit = current_limits().max_header_bytes
    if isinstance(event, events.DataReceived) and len(self.buf) > limit:
        reason = (f"the client sent more than {limit} bytes (limits.max_header_bytes) after a request that is "
                  "still waiting for its response; they would only be buffered")
        self.state = self.done
        yield commands.CloseConnection(self.conn)
        yield ReceiveHttp(RequestProtocolError(self.stream_id, f"egresswall: {reason}", ErrorCode.CLIENT_DISCONNECTED))
        on_refusal(self.conn, 0, "limits.max_header_bytes", reason)
        return
    yield from _original_server_wait(self, event)


def _client_read_headers(self: Http1Client, event: events.Event):
    """An upstream's response head: bounded in size and time (the client gets a 502)."""
    if isinstance(event, events.DataReceived) and self.stream_id is not None and self.request is not None:
        problem = _problem(self, current_limits(), "upstream response")
        if problem is not None:
            self.state = self.done
            yield commands.CloseConnection(self.conn)
            yield ReceiveHttp(ResponseProtocolError(self.stream_id, f"egresswall: {problem[1]}",
                                                    ErrorCode.GENERIC_SERVER_ERROR))
            return
    yield from _original_client_read_headers(self, event)
    if self.state != self.read_headers:
        self.__dict__.pop(_STARTED, None)


async def _on_timeout(self: mitmproxy.proxy.server.ConnectionHandler) -> None:
    idle_closed.add(self.client.id)
    await _original_on_timeout(self)


async def _open_connection(*args, **kwargs):
    timeout = current_limits().connect_timeout
    try:
        return await asyncio.wait_for(asyncio.open_connection(*args, **kwargs), timeout)
    except TimeoutError:
        # An OSError with a message: mitmproxy reports it as the connect error (502, error hook).
        raise TimeoutError(f"connect timed out after {timeout:g}s (limits.connect_timeout)") from None


def install() -> None:
    Http1Server.read_headers = _server_read_headers
    Http1Server.wait = _server_wait
    Http1Client.read_headers = _client_read_headers
    mitmproxy.proxy.server.ConnectionHandler.on_timeout = _on_timeout
    # mitmproxy's connection handler calls ``asyncio.open_connection``: give that module its own
    # asyncio namespace whose open_connection has a timeout, leaving asyncio itself untouched.
    if mitmproxy.proxy.server.asyncio.open_connection is not _open_connection:
        bounded = types.ModuleType("asyncio")
        bounded.__dict__.update(asyncio.__dict__)
        bounded.open_connection = _open_connection
        mitmproxy.proxy.server.asyncio = bounded
