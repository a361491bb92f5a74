"""The changes egresswall makes to mitmproxy's own code, installed explicitly when a proxy starts.

mitmproxy leaves some bounds open and has no hook at some points egresswall must act. Each patch
below wraps one mitmproxy method, says why, and names the test that proves it is needed. Nothing
is patched at import: ``install(state)`` is called by the embedded runner and by the mitmdump shim,
and the state the patches read (the limits in force, where refusals are reported) is an object the
gate's owner builds — installing a second, different state is an error, never a silent takeover.

* **Refusal before the body** (``HttpStream.start_request_stream``): mitmproxy answers a response set
  in ``requestheaders`` only after reading the whole body (and sends ``100 Continue`` first). A marked
  flow is answered and closed instead. Test:
  test_proxy_enforce.py::test_expect_continue_to_refused_target_is_refused_before_the_body.
* **Chunked body limit** (``HttpStream.state_consume_request_body``, ``Http1Server.read_body``): a body
  without Content-Length is buffered (never streamed) and refused with 413 once over
  ``limits.max_request_body``, before the upstream sees anything. The limit counts the body's wire bytes
  (chunk size lines, extensions, line ends, data), which only the reading side sees: ``read_body`` notes
  them on the request for the stream, so chunk extensions cannot carry bytes without end; and mitmproxy's
  chunk reader buffers a line that never ends (a size with its extensions, a trailer) without limit, so
  that is checked after each read too: against the body limit (past it nothing more is parsed or held,
  though the stream may still be held by its decision hook: test_body_while_deciding.py), and against
  ``limits.max_header_bytes``
  (400 ``http:bad-chunked``, as h11 refuses it on the fast path). A framing the chunk reader refuses (a
  negative or ``0x`` size, data not followed by its line end) was met with a closed connection and no
  word: it is answered 400 ``http:bad-chunked`` with h11's reason, as on the fast path; trailer fields,
  on which mitmproxy's reader raises ("not implemented") and the client got nothing, are answered 400
  ``http:trailers``, as on the fast path (``on_bad_body``). Each buffered piece is also reserved in the
  budget for buffered bodies (``on_body_buffered``: 503/429 ``limits.max_buffered_request_bodies`` when it
  is full). Tests:
  test_hardening_proxy_security.py::test_a_chunked_body_over_the_limit_gets_413_and_the_upstream_sees_nothing,
  test_review_fast_http.py::test_a_malformed_chunked_body_is_answered_400_with_a_reason_and_recorded,
  test_fast_http.py::test_chunked_trailers_are_refused_before_the_origin_sees_anything,
  test_body_budget_proxy.py.
* **Head size and time** (``Http1Server.read_headers``, ``Http1Client.read_headers``): mitmproxy buffers
  a head without limit ("FIXME: protect against header size DoS"). A head over
  ``limits.max_header_bytes`` gets 431 (502 upstream); a head incomplete ``limits.header_timeout`` after
  its first byte gets 408 — by a wakeup timer, so a client that sends half a head and waits is cut off
  too (502 for an upstream). Tests: test_hardening_adversarial.py (slowloris),
  test_hardening_proxy_security.py::test_half_a_second_head_on_a_kept_alive_connection_gets_408.
* **Interim responses** (``Http1Client.read_headers``): mitmproxy reads an upstream's ``100 Continue`` or
  ``103 Early Hints`` as the final response (the client got it as its answer, and the real response was
  dropped as unexpected data). Whole 1xx heads other than 101 are dropped, as on the fast path, and the
  final head is still due within ``limits.header_timeout`` of the first one's first byte (a flood of them
  gets 502). Test: test_review_round5.py::test_an_origins_interim_response_is_not_the_answer.
* **Response heads h11 would refuse** (``http1.read_response_head``): mitmproxy kept a bare CR or a NUL in
  a header value or the reason phrase and wrote it to the client as it came (a client that ends a line at a
  bare CR read what followed as a header of its own), and relayed a status code of any number of digits.
  A control byte other than HTAB, a status code that is not three digits, or a Content-Length of more than
  20 digits gets the client a 502, as on the fast path. Test:
  test_review_round9.py::test_a_control_byte_in_an_origins_response_head_never_reaches_the_client.
* **Response trailers** (``Http1Client.read_body``): mitmproxy's reader raises on an upstream's trailer
  fields ("not implemented"); the client was left with a body that never ended. They end the body and
  are dropped, as on the fast path. Test:
  test_fast_http.py::test_an_origins_response_trailers_are_dropped_and_the_response_ends.
* **Bytes after an early answer** (``Http1Client.read_body``, ``Http1Client.mark_done``): an origin that
  answered before the request body was all sent, then sent more, made mitmproxy's body reader, already at
  the response's end, report that end again for every read (a traceback, "mitmproxy has crashed!", per write
  of the origin), and a chunked answer's last chunk never reached the client. What an upstream sends after
  its response while the request is still going answers nothing: it is dropped unread, and the connection
  is closed once the request is done, never used again. Test: test_review_round18_responses.py.
* **First byte** (``Http1Server._handle_event``): a connection that has sent nothing is closed after
  ``limits.first_byte_timeout`` (the front does this for ``egresswall run``; this is for mitmdump).
* **Pipelined bytes** (``Http1Server.wait``): bytes a client sends while its request waits for a response
  are buffered without limit; more than ``limits.max_header_bytes`` closes the connection. Test:
  test_hardening_adversarial.py::test_bytes_pipelined_behind_a_waiting_request_are_bounded.
* **Unparseable heads**: mitmproxy answers 400 and no hook runs; ``on_head_refusal`` (else ``on_refusal``) gives
  it its record, and the head's Accept its body: JSON where it prefers JSON, as for every refusal made after a
  head was whole (``_core_answers``). Tests:
  test_hardening_adversarial.py::test_request_smuggling_shapes_are_refused_and_not_forwarded,
  test_review_round21_records_json.py.
* **mitmproxy's own error answers** (``Http1Server.send``, ``_http1.make_error_response``): a request
  mitmproxy refuses after reading its head but before any hook (no Host and origin form, a Host it cannot
  parse, an invalid request) got mitmproxy's 400 and no record; the patch records every such error answer
  for a request egresswall's ``requestheaders`` never saw. Each of mitmproxy's own answers — those, a head
  it cannot parse, a connect that failed — was its HTML page (``Server: mitmproxy``, no ``X-Egresswall-*``
  headers, an upstream's unparseable bytes quoted): it is egresswall's refusal, with its record's rule and
  reason (JSON where the Accept prefers it; two Host headers are the core's ``form:host-header``, where mitmproxy
  said there was none), as the fast path answers, and its response record says that status (``handle_protocol_error``
  and, for a response head mitmproxy's header validation refuses, ``check_invalid`` note it before the
  error hook writes the record). mitmproxy's connects fail with the fast front's
  wording (``_open_connection``). Tests: test_hardening_proxy_security.py::test_mitmproxys_own_400_is_recorded,
  test_own_answers.py.
* **The core reads the target** (``Http1Server.read_headers``, ``Http1Server.send``): mitmproxy's parser
  refuses many hosts and ports itself (``GET http://a..b/``, ``CONNECT a..b:443``, ``[1.2.3.4]``, a port of
  0 or 65536, userinfo, ``%``; an origin-form Host header it cannot read is "destination unknown"), with a
  generic 400, where the fast path's request reached the core and got its rule and reason. Outside a tunnel
  such a request gets the core's refusal (``PatchState.on_unread_target``: ``Gate.refuse_unread_target``),
  recorded as the fast path records it; a request line the core reads keeps mitmproxy's 400. And the
  authority is noted as sent before mitmproxy's regular mode empties it (its own split reads port 0 as 80).
  Test: test_host_form_parity.py.
* **No pipe after a refused 101** (``_http1.should_make_pipe``): an upstream's unasked ``101`` is answered
  with a 502 by the audit-trail addon, but mitmproxy would still turn the upstream connection into a pipe
  and crash on its next bytes. Test:
  test_hardening_proxy_security.py::test_an_upstream_cannot_switch_protocols_unasked.
* **Idle close** (``ConnectionHandler.on_timeout``): remembered, so a record says "idle timeout" rather
  than mitmproxy's "Client disconnected.". Test:
  test_hardening_adversarial.py::test_upstream_that_never_answers_is_closed_after_the_idle_timeout.
* **Connect time** (``asyncio.open_connection`` as mitmproxy's server module sees it): asyncio has no
  connect timeout; mitmproxy's connects get ``limits.connect_timeout``, and fail worded as the fast front's
  (``proxy/dial.py``). Test:
  test_hardening_adversarial.py::test_upstream_connect_that_hangs_times_out.
* **Every closed connection's socket is closed** (``ConnectionHandler.handle_connection``): mitmproxy
  closes a connection's socket only when the cancel that ends it finds it reading or draining. Its master
  runs tasks eagerly, so a hook that completes inside an event queues on mitmproxy's event lock, and the
  next event of another connection waits behind it; a connection cancelled there (a refused tunnel start
  closes both sides while the upstream's first bytes wait for the lock) kept its socket open and its
  transport registered for the life of the process. The patch closes what the original left open. Tests:
  test_mitm_patches_sockets.py.
* **No reading while a request is decided** (``ConnectionHandler.hook_task``, the client's reader in
  ``handle_connection``): the decision hook waits for the name's DNS answer, which the name's owner can make
  slow (up to ``resolver.timeout``), and mitmproxy read the client on meanwhile, queueing every piece of
  the body for the stream the hook holds — outside the budget for buffered bodies, up to
  ``limits.max_request_body`` a connection (2,000 connections of 10 MB each). The client's reads wait
  while a blocking hook of its connection runs, as on the fast path, which reads a body only after
  deciding: what is held is the socket buffers. Tests:
  test_body_while_deciding.py::test_bodies_sent_while_their_decisions_wait_are_not_read_meanwhile,
  test_mitm_patches_reads.py.
* **No reading while the origin's TLS is made** (``ClientTLSLayer.start_server_tls``): connects are eager, so
  for an intercepted host mitmproxy makes the origin's TLS before the client's, its client layer paused the
  while, and it read the client on, queueing every byte in that paused layer: an origin that never answered
  its ClientHello let one client grow a worker by 1.2 GB in 4 s. The client's reads are held until the origin's
  handshake is done (``HeldReader``), as while a hook runs; and so while a relayed tunnel waits for its server
  connection (``TCPLayer``'s start: in upstream mode, for the upstream proxy's answer to its CONNECT). Tests:
  test_review_round13.py::test_an_intercepted_client_sending_while_the_origin_s_handshake_waits_is_bounded,
  test_review_round13.py::test_a_client_sending_while_an_upstream_proxy_never_answers_the_connect_is_bounded.
* **A half-closed client is answered** (``Http1Server.wait``, ``Http1Server.mark_done``): a client that
  shuts its sending side after a whole request (``nc -N``, some scripts) was closed unanswered ("a peer
  which sent at least a FIN is not interested in any more data from us"), its refusal recorded as sent; it
  gets its answer, then the connection closes, as on the fast path. A body refused for its framing or size
  is answered too when the client's end comes first (``_server_read_body``). The end held back goes, once
  the answer is out, to what follows: a CONNECT's tunnel ends (it stayed open until limits.idle_timeout),
  a request pipelined behind is dropped unparsed, as on the fast path (it was decided and recorded as
  answered on a connection then closed). Tests: test_half_close_while_deciding.py,
  test_review_round8.py.
* **A WebSocket message is bounded** (``WebsocketConnection.events``): mitmproxy holds each message whole
  (every fragment of it) before relaying it, without limit, so one endless fragmented message from either
  side filled a worker's memory. Past ``limits.max_websocket_message`` the message ends there: both sides
  get close code 1009 (message too big) and the WebSocket is over; the connection is marked
  (``WEBSOCKET_TOO_BIG``) and its refusal is recorded at ``websocket_end`` (proxy/addons/websocket_watch.py).
  Test: test_session_websockets.py::test_a_websocket_message_over_the_limit_ends_the_websocket.
  Each fragment but the last counts ``WEBSOCKET_FRAGMENT_COST`` beyond its payload (mitmproxy keeps one entry a
  fragment: endless empty fragments grew that list past any limit); a permessage-deflate message inflates at
  most the limit + 1 bytes a piece (``PerMessageDeflate.frame_inbound_payload_data``: 64 KiB on the wire
  became 64 MiB before), and a frame cut short so is not inflated further at its end
  (``frame_inbound_complete``: zlib refused the rest, and the WebSocket closed 1007 with no record;
  test_review_round20_websockets.py); pings' and pongs' payloads are counted on their connection
  (``WEBSOCKET_CONTROL_BYTES``) for a session's budgets, and one that would pass a byte budget is not relayed
  (``WEBSOCKET_ALLOWANCE``). Tests: test_session_websockets.py
  (test_a_compressed_message_is_bounded_as_it_inflates, test_a_message_of_endless_empty_fragments_is_bounded,
  test_pings_and_pongs_are_charged_to_the_session).
  A frame that arrives in many reads grows in place (``WebsocketConnection.frame_buf``, a list of bytearrays):
  the layer's ``frame_buf[-1] += data`` on bytes copied the whole frame so far on every read, so one client
  trickling an 8 MiB frame held a worker's CPU. Test:
  test_websocket_relay.py::test_a_trickled_frame_costs_cpu_in_proportion.
* **Backpressure by direction** (``ConnectionHandler.drain_writers``): after each read mitmproxy waited, under one
  lock, until every writer of the connection had drained, the one to the peer it had just read from too; a
  peer that writes before it reads (an echo origin answering a large WebSocket message as it arrives) filled
  both ways' buffers and neither was read again: the WebSocket hung until the idle timeout. A read now waits
  for the writers to the other connections, and for the one to its own peer only when the proxy answered that
  peer itself (a refusal, a TLS alert: what the original's rule bounded; ``AnsweringWriter``). Tests:
  test_websocket_relay.py::test_a_large_message_to_an_origin_that_echoes_as_it_reads, test_mitm_patches_drain.py.
* **Names only IDNA 2008 reads** (``check.is_valid_host``, ``url.parse_authority``; ``proxy/mitm_hostnames.py``):
  mitmproxy reads hosts with Python's IDNA 2003 codec, which refuses an A-label such as ``xn--fa-hia`` (faß),
  so its path answered 400 to names the core and the fast front decide as any other. Its readers now also take
  an all-ASCII name the core accepts. Test: test_review_round20_idna.py.
* **An upstream proxy's answer to the CONNECT** (``HttpUpstreamProxy``; ``proxy/mitm_upstream_wait.py``): in
  upstream mode mitmproxy waited for it with no bound but ``limits.idle_timeout``, and the record blamed the
  client; it is bounded by ``limits.connect_timeout``, as on the fast front, and the record names the upstream.
  Test: test_review_round20_upstream_stall.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import re
import time
import types
import zlib
from collections import deque
from collections.abc import Callable, Coroutine, Generator, Iterable
from dataclasses import dataclass, field

import mitmproxy.proxy.server
from h11._readers import ChunkedReader  # mitmproxy's own chunked body reader (as _http1 imports it)
from h11._receivebuffer import ReceiveBuffer
from mitmproxy import connection, http
from mitmproxy.net.http import http1
from mitmproxy.proxy import commands, events
from mitmproxy.proxy.layers.http import HttpStream, _http1
from mitmproxy.proxy.layers.http._base import ReceiveHttp
from mitmproxy.proxy.layers.http._events import (
    ErrorCode,
    RequestData,
    RequestEndOfMessage,
    RequestHeaders,
    RequestProtocolError,
    ResponseEndOfMessage,
    ResponseProtocolError,
)
from mitmproxy.proxy.layers.http._hooks import HttpErrorHook
from mitmproxy.proxy.layers.http._http1 import Http1Client, Http1Server
from mitmproxy.proxy.layers.tcp import TCPLayer
from mitmproxy.proxy.layers.tls import ClientTLSLayer
from mitmproxy.proxy.layers.websocket import WebsocketConnection
from wsproto.events import CloseConnection as WebSocketClose
from wsproto.events import Message as WebSocketMessage
from wsproto.events import Ping as WebSocketPing
from wsproto.events import Pong as WebSocketPong
from wsproto.extensions import PerMessageDeflate
from wsproto.frame_protocol import CloseReason

from policy.decision import Verdict
from policy.hosts import for_logs
from policy.model import Limits

from . import mitm_hostnames, mitm_upstream_wait
from .accept import prefers_json
from .body_reasons import TRAILERS_REASON, body_line_too_long_reason, body_unparseable_reason
from .dial import connect_failed, connect_timed_out
from .head_end import HEAD_END  # what h11's ReceiveBuffer accepts as the end of a head
from .head_reader import LINGER_BYTES, LINGER_SECONDS
from .http_hygiene import CONTROL_BYTE, MAX_CONTENT_LENGTH
from .records import safe_text
from .refusals import UNRELAYABLE_RESPONSE, Refusal, failed_connect, refusal_bytes

REFUSE_BEFORE_BODY = "egresswall_refuse_before_body"
BODY_LIMIT = "egresswall_body_limit"  # flow.metadata: bytes a buffered (chunked) body may have
# On the http.Request (the one object the reading layer and the flow share), for a chunked body:
_BODY_FED = "egresswall_body_fed"  # bytes received since its head ended (all of them body, until it ends)
_BODY_WIRE = "egresswall_body_wire"  # its wire bytes read so far (what the stream checks against the limit)
_BODY_REFUSED = "egresswall_body_refused"  # refused (by the stream, or before it): what comes is read and dropped
# Over limits.max_request_body as received: nothing more of it is parsed or held, whoever reads it when.
_BODY_OVER = "egresswall_body_over"
_BODY_BAD = "egresswall_body_bad"  # (rule, reason) it cannot be read on: a line that never ended, a framing
# h11 refused, trailer fields


class RecentIds:
    """The last ``size`` connection ids added, for ``in``: mitmproxy's idle close is looked up moments after
    it happens (by the flow's error record, or the half-read head's), so older ones are of no use, and a set
    of every id ever closed would grow for as long as the proxy runs (a client can make one a second)."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._ids: set[str] = set()
        self._order: deque[str] = deque()

    def add(self, connection_id: str) -> None:
        if connection_id in self._ids:
            return
        self._ids.add(connection_id)
        self._order.append(connection_id)
        if len(self._order) > self.size:
            self._ids.discard(self._order.popleft())

    def __contains__(self, connection_id: object) -> bool:
        return connection_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)


@dataclass
class PatchState:
    limits: Callable[[], Limits]  # the limits in force, read at each use so a reload applies
    # A refusal made before any flow exists: (client connection, status, rule, reason); status 0 means
    # the connection was closed without an answer.
    on_refusal: Callable[[connection.Connection, int, str, str], None]
    # A buffered body went over the limit: the flow, and the limit. Returns the refusal to answer.
    on_body_over_limit: Callable[[http.HTTPFlow, int], Refusal]
    # A buffered body's next piece, of this many bytes, is about to be held: None, or the refusal to answer
    # (the budget for buffered bodies is full).
    on_body_buffered: Callable[[http.HTTPFlow, int], Refusal | None] = lambda flow, size: None
    # A buffered body cannot be read on (a line of it, a chunk size with its extensions or a trailer, passed
    # limits.max_header_bytes unfinished; its framing is malformed; it ends with trailer fields), by this
    # rule, for this reason: the refusal to answer.
    on_bad_body: Callable[[http.HTTPFlow, str, str], Refusal] = lambda flow, rule, reason: _unrecorded_bad_body(
        rule, reason)
    # A request mitmproxy's parser refused before any flow (its request line, an origin-form request's Host
    # header), outside a tunnel: (client connection, method, target as sent, the one Host header or None,
    # Accept values) -> the core's refusal of the host it names, recorded, or None (mitmproxy's 400 stands).
    on_unread_target: Callable[[connection.Connection, str, str, str | None, tuple[str, ...]], Refusal | None] = (
        lambda conn, method, target, host, accept: None)
    # A whole request head refused before any flow (a head mitmproxy cannot parse, an origin-form request with no
    # Host it can read, or two): (client connection, status, rule, reason, Accept values) -> the refusal, recorded
    # with the size of the body its Accept chooses (``Gate.refuse``). None: ``on_refusal`` records it, and its
    # bytes_down counts the text body even where the answer is JSON (``_refuse_whole_head``).
    on_head_refusal: Callable[[connection.Connection, int, str, str, tuple[str, ...]], Refusal] | None = None
    idle_closed: RecentIds = field(default_factory=RecentIds)  # client connections mitmproxy's watchdog closed
    first_byte_timer: bool = True  # False when the front already enforced limits.first_byte_timeout
    via_upstream: Callable[[], bool] = lambda: False  # the policy sends every connection through an upstream proxy


_state: PatchState | None = None
_INTERIM = re.compile(rb"HTTP/1\.[01] 1(?!01)[0-9]{2}[ \r\n]")  # a 1xx status line, not 101 Switching Protocols
_STARTED = "_egresswall_head_started"
_TIMER = "_egresswall_timer"
_TIMER_FOR = "_egresswall_timer_for"  # which head the timer is for
_SPOKE = "_egresswall_spoke"
_HALF_CLOSED = "_egresswall_half_closed"  # on an Http1Server: its client half-closed after a whole request
# RFC 9112 4: three digits, 100 to 999 as h11 reads it (mitmproxy took int() of anything: "099" went on as "99")
_STATUS_CODE = re.compile(rb"[^ ]+ +([1-9][0-9]{2})(?: |$)")
_LENGTH_DIGITS = 20  # h11's bound on a Content-Length's digits ("bad Content-Length" on the fast path)
_originals: dict[str, object] = {}
# On a mitmproxy Connection whose WebSocket message went over limits.max_websocket_message: the reason.
WEBSOCKET_TOO_BIG = "egresswall_websocket_too_big"
_WEBSOCKET_HELD = "_egresswall_websocket_held"  # on a WebsocketConnection: bytes of its unfinished message
WEBSOCKET_MESSAGE_TOO_BIG = 1009  # RFC 6455 7.4.1
WEBSOCKET_POLICY_VIOLATION = 1008
# On a mitmproxy Connection in a WebSocket: the bytes of the pings and pongs it sent (relayed, as messages are).
WEBSOCKET_CONTROL_BYTES = "egresswall_websocket_control_bytes"
# On the same Connection under a session with a byte budget: (its ByteAllowance, the way its bytes go, UP or DOWN).
# A ping or pong it cannot take is not relayed (proxy/byte_allowance.py).
WEBSOCKET_ALLOWANCE = "egresswall_websocket_allowance"
# What one fragment of a held message costs beyond its payload (mitmproxy keeps a bytes object and a list slot a
# fragment): counted against the limit, so a message of endless empty fragments is bounded too.
WEBSOCKET_FRAGMENT_COST = 64
_INFLATE_CUT = "_egresswall_inflate_cut"  # on a PerMessageDeflate: its last piece was cut short at the limit


def install(state: PatchState) -> None:
    global _state
    if _state is not None and _state is not state:
        raise RuntimeError("mitmproxy is already patched for another egresswall instance (one proxy per process)")
    _state = state
    if _originals:
        return
    mitm_hostnames.install()
    mitm_upstream_wait.install(lambda: state.limits().connect_timeout)
    _originals.update(start_request_stream=HttpStream.start_request_stream,
                      handle_protocol_error=HttpStream.handle_protocol_error,
                      check_invalid=HttpStream.check_invalid,
                      consume=HttpStream.state_consume_request_body, server_read_body=Http1Server.read_body,
                      client_read_body=Http1Client.read_body, client_mark_done=Http1Client.mark_done,
                      server_read_headers=Http1Server.read_headers, server_wait=Http1Server.wait,
                      server_mark_done=Http1Server.mark_done,
                      server_handle_event=Http1Server._handle_event,
                      client_read_headers=Http1Client.read_headers, server_send=Http1Server.send,
                      should_make_pipe=_http1.should_make_pipe, make_error_response=_http1.make_error_response,
                      read_response_head=http1.read_response_head,
                      on_timeout=mitmproxy.proxy.server.ConnectionHandler.on_timeout,
                      handle_connection=mitmproxy.proxy.server.ConnectionHandler.handle_connection,
                      hook_task=mitmproxy.proxy.server.ConnectionHandler.hook_task,
                      start_server_tls=ClientTLSLayer.start_server_tls, tcp_start=TCPLayer._handle_event,
                      drain_writers=mitmproxy.proxy.server.ConnectionHandler.drain_writers,
                      asyncio_module=mitmproxy.proxy.server.asyncio, websocket_events=WebsocketConnection.events,
                      deflate_inbound=PerMessageDeflate.frame_inbound_payload_data,
                      deflate_complete=PerMessageDeflate.frame_inbound_complete)
    HttpStream.start_request_stream = _start_request_stream
    HttpStream.handle_protocol_error = _handle_protocol_error
    HttpStream.check_invalid = _check_invalid
    HttpStream.state_consume_request_body = _consume_request_body
    Http1Server.read_body = _server_read_body
    Http1Client.read_body = _client_read_body
    Http1Client.mark_done = _client_mark_done
    Http1Server.read_headers = _server_read_headers
    Http1Server.wait = _server_wait
    Http1Server.mark_done = _server_mark_done
    Http1Server._handle_event = _server_handle_event
    Http1Client.read_headers = _client_read_headers
    Http1Server.send = _server_send
    _http1.should_make_pipe = _should_make_pipe
    _http1.make_error_response = _error_answer
    http1.read_response_head = _read_response_head  # what _http1 and _upstream_proxy call it by
    mitmproxy.proxy.server.ConnectionHandler.on_timeout = _on_timeout
    mitmproxy.proxy.server.ConnectionHandler.handle_connection = _handle_connection
    mitmproxy.proxy.server.ConnectionHandler.hook_task = _hook_task
    ClientTLSLayer.start_server_tls = _start_server_tls
    TCPLayer._handle_event = _tcp_start  # its first event's handler (instances set their next)
    mitmproxy.proxy.server.ConnectionHandler.drain_writers = _drain_writers
    WebsocketConnection.events = _websocket_events
    WebsocketConnection.frame_buf = property(_frame_buf, _set_frame_buf)
    PerMessageDeflate.frame_inbound_payload_data = _inflate_bounded
    PerMessageDeflate.frame_inbound_complete = _inflate_complete
    # mitmproxy's connection handler calls ``asyncio.open_connection``: give that module its own
    # asyncio namespace whose open_connection has a timeout, leaving asyncio itself untouched.
    bounded = types.ModuleType("asyncio")
    bounded.__dict__.update(asyncio.__dict__)
    bounded.open_connection = _open_connection
    mitmproxy.proxy.server.asyncio = bounded


def uninstall() -> None:
    """Put mitmproxy back (in-process tests)."""
    global _state
    mitm_hostnames.uninstall()
    mitm_upstream_wait.uninstall()
    if _originals:
        HttpStream.start_request_stream = _originals["start_request_stream"]
        HttpStream.handle_protocol_error = _originals["handle_protocol_error"]
        HttpStream.check_invalid = _originals["check_invalid"]
        HttpStream.state_consume_request_body = _originals["consume"]
        Http1Server.read_body = _originals["server_read_body"]
        Http1Client.read_body = _originals["client_read_body"]
        del Http1Client.mark_done  # Http1Connection's again
        Http1Server.read_headers = _originals["server_read_headers"]
        Http1Server.wait = _originals["server_wait"]
        Http1Server.mark_done = _originals["server_mark_done"]
        Http1Server._handle_event = _originals["server_handle_event"]
        Http1Client.read_headers = _originals["client_read_headers"]
        Http1Server.send = _originals["server_send"]
        _http1.should_make_pipe = _originals["should_make_pipe"]
        _http1.make_error_response = _originals["make_error_response"]
        http1.read_response_head = _originals["read_response_head"]
        mitmproxy.proxy.server.ConnectionHandler.on_timeout = _originals["on_timeout"]
        mitmproxy.proxy.server.ConnectionHandler.handle_connection = _originals["handle_connection"]
        mitmproxy.proxy.server.ConnectionHandler.hook_task = _originals["hook_task"]
        ClientTLSLayer.start_server_tls = _originals["start_server_tls"]
        TCPLayer._handle_event = _originals["tcp_start"]
        mitmproxy.proxy.server.ConnectionHandler.drain_writers = _originals["drain_writers"]
        mitmproxy.proxy.server.asyncio = _originals["asyncio_module"]
        WebsocketConnection.events = _originals["websocket_events"]
        del WebsocketConnection.frame_buf  # an instance attribute again
        PerMessageDeflate.frame_inbound_payload_data = _originals["deflate_inbound"]
        PerMessageDeflate.frame_inbound_complete = _originals["deflate_complete"]
        _originals.clear()
    _state = None


def state() -> PatchState:
    assert _state is not None, "proxy.mitm_patches.install() was not called"
    return _state


# ---- refusal before the body ----------------------------------------------------------------------

def refuse_before_body(flow: http.HTTPFlow, response: http.Response) -> None:
    """Set ``response`` as the answer; if the request has a body still to come, do not read it."""
    flow.response = response
    has_body = flow.request.headers.get("content-length", "0") not in ("", "0") or (
        "transfer-encoding" in flow.request.headers)
    flow.request.headers.pop("expect", None)  # never promise "100 Continue" to a refused request
    if has_body:
        flow.metadata[REFUSE_BEFORE_BODY] = True
        flow.request.stream = True
        # Its body is read and dropped, never parsed (_server_read_body). mitmproxy's master runs hooks
        # eagerly, so this can run before the bytes that came with the head are read: a framing error in
        # them made mitmproxy close the client before the refusal was sent (the record said 403 all the
        # same). Test: test_review_round7.py::test_a_bad_body_on_a_request_the_policy_refuses_...
        setattr(flow.request, _BODY_REFUSED, True)


ANSWERED = "egresswall_answered"  # flow metadata: the status mitmproxy answers a failed exchange with


def _handle_protocol_error(self: HttpStream, event: RequestProtocolError | ResponseProtocolError):
    """The error hook runs before mitmproxy answers a failed exchange itself (``_server_send``): the status it
    will answer is noted on the flow first, so the response record says what the client was answered (a 502
    for a failed connect), as on the fast path, not null."""
    if (isinstance(event, ResponseProtocolError) and self.flow.response is None
            and self.client_state != self.state_errored  # the conditions mitmproxy answers under
            and self.context.client.state & connection.ConnectionState.CAN_WRITE):
        self.flow.metadata[ANSWERED] = event.code.http_status_code()
    yield from _originals["handle_protocol_error"](self, event)


def _check_invalid(self: HttpStream, request: bool):
    """mitmproxy validates a response head (a header name that is not a token, framed two ways) and answers
    a failed one itself, after its error hook wrote the record: the 502 is noted as that hook is sent (only
    a failed validation sends one), as in ``_handle_protocol_error``, so the record says what the client
    was answered."""
    def note(command: object) -> object:
        if (not request and isinstance(command, HttpErrorHook)
                and self.context.client.state & connection.ConnectionState.CAN_WRITE):
            self.flow.metadata[ANSWERED] = ErrorCode.RESPONSE_VALIDATION_FAILED.http_status_code()
        return command
    return (yield from _tap(_originals["check_invalid"](self, request), note))


def _start_request_stream(self: HttpStream):
    if self.flow.response is not None and self.flow.metadata.get(REFUSE_BEFORE_BODY):
        self.client_state = self.state_errored  # whatever body arrives now is dropped unread
        yield from self.send_response()
        yield commands.CloseConnection(self.context.client)
        return
    yield from _originals["start_request_stream"](self)


# ---- the limit on a buffered body -----------------------------------------------------------------

def _consume_request_body(self: HttpStream, event: events.Event):
    limit = self.flow.metadata.get(BODY_LIMIT)
    bad = getattr(self.flow.request, _BODY_BAD, None)
    if limit is not None and isinstance(event, (RequestData, RequestEndOfMessage)):
        data = len(event.data) if isinstance(event, RequestData) else 0
        # The wire bytes as the reading side counted them (they include the data: the larger is taken in
        # case a body came some other way than through Http1Server.read_body).
        wire = max(getattr(self.flow.request, _BODY_WIRE, 0), len(self.request_body_buf) + data)
        refusal = state().on_body_over_limit(self.flow, limit) if wire > limit else None
        # In wire order, as the fast path reads: data read past the limit before the body turned out
        # unreadable is over the limit (413). While a hook holds the stream its pieces wait, and the
        # reader may meanwhile have found the body bad (test_review_round7.py::test_trailers_behind_...).
        if refusal is None and bad is not None and isinstance(event, RequestData):
            refusal = state().on_bad_body(self.flow, *bad)
        if refusal is None and data:
            refusal = state().on_body_buffered(self.flow, data)
        if refusal is not None:
            yield from _refuse_buffered_body(self, refusal)
            return
    elif bad is not None and isinstance(event, RequestData):
        yield from _refuse_buffered_body(self, state().on_bad_body(self.flow, *bad))
        return
    yield from _originals["consume"](self, event)


def _refuse_buffered_body(self: HttpStream, refusal: Refusal):
    setattr(self.flow.request, _BODY_REFUSED, True)
    self.request_body_buf.clear()
    self.client_state = self.state_errored
    self.server_state = self.state_errored
    self.flow.live = False
    yield commands.SendData(self.context.client, refusal_bytes(refusal))
    # Half close: the client may still be sending its body; what it sends is read and dropped
    # (_server_read_body) until it closes or the idle timeout, so its kernel does not answer our answer
    # with a reset that would destroy it before the client read it.
    yield commands.CloseTcpConnection(self.context.client, half_close=True)


def _client_read_body(self: Http1Client, event: events.Event):
    """An upstream's response body as mitmproxy reads it, except that trailer fields end it: mitmproxy's
    reader raises on them ("not implemented"), and its client was left with a body that never ended. The
    trailers are dropped, as on the fast path (h11 re-frames the response there, without them). And once the
    response has ended while the request is still being sent (the origin answered early), what the upstream
    sends answers nothing: dropped unread (``_client_mark_done`` closes the connection after the request)."""
    if self.response_done and isinstance(event, events.DataReceived):
        _drop_after_response(self)
        return
    try:
        yield from _originals["client_read_body"](self, event)
    except NotImplementedError:  # "HTTP trailers are not implemented yet.": the last chunk came, with trailers
        assert self.request is not None and self.stream_id is not None
        if self.request.data.method.upper() != b"CONNECT":
            yield ReceiveHttp(ResponseEndOfMessage(self.stream_id))
        yield from self.mark_done(response=True)
    if self.response_done and not self.request_done and self.buf:
        _drop_after_response(self)  # bytes that came in the same read as the response's end


def _drop_after_response(self: Http1Client) -> None:
    self.buf = ReceiveBuffer()
    setattr(self, _SPOKE_AFTER_RESPONSE, True)


def _client_mark_done(self: Http1Client, *, request: bool = False, response: bool = False):
    """mitmproxy's end of a request or response on an upstream connection; one that sent bytes after its
    response (``_client_read_body``) is closed once both are done, never kept for another request."""
    yield from _originals["client_mark_done"](self, request=request, response=response)
    if getattr(self, _SPOKE_AFTER_RESPONSE, False) and self.state == self.read_headers:
        yield commands.CloseConnection(self.conn)
        self.state = self.done


def _server_read_body(self: Http1Server, event: events.Event):
    """A request body as mitmproxy reads it; a chunked one's wire bytes are counted on the request for the
    stream (``_consume_request_body``), which alone knows the flow and its limit."""
    request = self.request
    if request is None or not isinstance(self.body_reader, ChunkedReader):
        yield from _originals["server_read_body"](self, event)
        return
    if getattr(request, _BODY_REFUSED, False) or getattr(request, _BODY_OVER, False) or getattr(
            request, _BODY_BAD, None) is not None:
        # Refused (or to be): what comes is read and dropped, never parsed or held. And a client that
        # half-closes now has sent what it will: the stream answers, then closes (the original reader took
        # the end as a body cut short and closed the client, unanswered, if the stream was still held by
        # its decision hook: test_half_close_while_deciding.py::test_a_bad_body_then_a_half_close_is_answered).
        self.buf = ReceiveBuffer()
        return
    if isinstance(event, events.DataReceived):
        fed = getattr(request, _BODY_FED, None)
        # The first call comes from read_headers with the head taken out of the buffer: what is left came
        # with the head. After that each event's data was added to the buffer before this call.
        setattr(request, _BODY_FED, len(self.buf) if fed is None else fed + len(event.data))
    original = _originals["server_read_body"](self, event)
    value = None
    while True:
        try:
            command = original.send(value)
        except StopIteration:
            break
        except NotImplementedError:  # "HTTP trailers are not implemented yet.": the body ended with trailers
            yield from _body_cannot_be_read(self, request, "http:trailers", TRAILERS_REASON)
            return
        if (isinstance(command, commands.CloseConnection) and isinstance(event, events.DataReceived)
                and not request.stream):
            # The chunk reader refused the body (mitmproxy closes, then reports a protocol error): the
            # stream answers 400 with the reason instead, as the fast path does.
            following = next(original, None)
            if isinstance(following, ReceiveHttp) and isinstance(following.event, RequestProtocolError):
                original.close()
                self.buf = ReceiveBuffer()
                error = following.event.message.removeprefix("HTTP/1 protocol error: ")
                yield from _body_cannot_be_read(self, request, "http:bad-chunked", body_unparseable_reason(error))
                return
            value = yield command
            if following is None:
                break
            command = following
        if isinstance(command, ReceiveHttp) and isinstance(command.event, (RequestData, RequestEndOfMessage)):
            # What h11 consumed of the buffer so far is the body's (the reader has taken this piece out).
            setattr(request, _BODY_WIRE, getattr(request, _BODY_FED, 0) - len(self.buf))
        value = yield command
        if getattr(request, _BODY_REFUSED, False):
            original.close()
            self.buf = ReceiveBuffer()
            return
    if self.state != self.read_body or request.stream:
        return
    limits = state().limits()
    if len(self.buf) > limits.max_header_bytes:
        # What the reader left is one unfinished line (it takes every whole line and all data it can):
        # a size line with its extensions, or a trailer, longer than a head may be. h11, which reads the
        # fast path's bodies, refuses such a line at the same bound (proxy/fast_http.py).
        yield from _body_cannot_be_read(self, request, "http:bad-chunked",
                                        body_line_too_long_reason(limits.max_header_bytes))
    elif getattr(request, _BODY_FED, 0) > limits.max_request_body:
        # The body has not ended, so every byte received is the body's: it is over the limit, whatever the
        # stream has made of it so far. That may be nothing: no piece of data came out of the bytes (a size
        # line or extension that does not end), or the stream is held by its decision hook (a slow DNS
        # answer), and mitmproxy queues every piece read meanwhile — one connection held 68 MB over a
        # 10 MB limit in 0.9 s. So nothing more is parsed or held (test_review_round7.py::
        # test_a_chunked_body_sent_while_its_decision_waits_holds_no_more_than_the_limit).
        setattr(request, _BODY_WIRE, getattr(request, _BODY_FED, 0))
        setattr(request, _BODY_OVER, True)
        self.buf = ReceiveBuffer()
        yield ReceiveHttp(RequestData(self.stream_id, b""))  # an empty piece: the stream looks at the count


def _body_cannot_be_read(self: Http1Server, request: http.Request, rule: str, reason: str):
    """The buffered body cannot be read on: what comes after is dropped, and an empty piece makes the stream
    refuse it by ``rule`` for ``reason`` (only a buffered body's stream gets it: ``request.stream`` is False
    for every chunked body, proxy/addons/body_limit.py)."""
    setattr(request, _BODY_BAD, (rule, reason))
    self.buf = ReceiveBuffer()
    yield ReceiveHttp(RequestData(self.stream_id, b""))


def _unrecorded_bad_body(rule: str, reason: str) -> Refusal:
    """``on_bad_body`` where no gate records refusals (in-process tests of the patches)."""
    from policy.decision import Verdict

    return Refusal(400, Verdict(False, "form", rule, reason))


# ---- heads: size, time, first byte ----------------------------------------------------------------

def _head_size(buf) -> int:
    data = bytes(buf)
    end = HEAD_END.search(data)
    return end.start() if end else len(data)


def _problem(layer, limits: Limits, what: str) -> tuple[str, str] | None:
    """Checked before mitmproxy parses: (rule, reason) when the head being received is over a bound."""
    if len(layer.buf) > limits.max_header_bytes and _head_size(layer.buf) > limits.max_header_bytes:
        return "limits.max_header_bytes", (f"the {what} head is over {limits.max_header_bytes} bytes "
                                           "(limits.max_header_bytes)")
    started = layer.__dict__.get(_STARTED)
    if started is not None and time.monotonic() - started > limits.header_timeout:
        return "limits.header_timeout", (f"the {what} head took more than {limits.header_timeout:g}s "
                                         "(limits.header_timeout)")
    return None


def _tap(generator: Generator, look: Callable[[object], object]) -> Generator:
    """Pass a layer's commands through (send() values too), each as ``look`` returns it: the command itself,
    seen, or another in its place."""
    value = None
    while True:
        try:
            command = generator.send(value)
        except StopIteration as stop:
            return stop.value
        value = yield look(command)


def _watch_logs(generator: Generator, logs: list[str]) -> Generator:
    """Pass a layer's commands through, keeping the text of its Log commands."""
    def keep(command: object) -> object:
        if isinstance(command, commands.Log):
            logs.append(command.message)
        return command
    return _tap(generator, keep)


def _refuse_head(self: Http1Server, rule: str, reason: str):
    status = 431 if rule == "limits.max_header_bytes" else 408
    yield commands.SendData(self.conn, http1.assemble_response(_plain_refusal(status, rule, reason)))
    yield commands.CloseConnection(self.conn)
    self.state = self.done
    state().on_refusal(self.conn, status, rule, reason)


def _server_handle_event(self: Http1Server, event: events.Event):
    """Timers of our own (``Wakeup``) never reach mitmproxy's states, which do not expect them."""
    if isinstance(event, events.Wakeup):
        if event.command is not self.__dict__.get(_TIMER) or self.state != self.read_headers:
            return
        limits = state().limits()
        if len(self.buf):
            yield from _refuse_head(self, "limits.header_timeout",
                                    f"the request head was not complete {limits.header_timeout:g}s after its first "
                                    f"byte ({len(self.buf)} bytes; limits.header_timeout)")
        elif not self.__dict__.get(_SPOKE):
            yield commands.CloseConnection(self.conn)
            self.state = self.done
            state().on_refusal(self.conn, 0, "limits.first_byte_timeout",
                               f"the client sent nothing for limits.first_byte_timeout "
                               f"({limits.first_byte_timeout:g}s) after connecting")
        return
    started = isinstance(event, events.Start)
    yield from _originals["server_handle_event"](self, event)
    if started and state().first_byte_timer:
        timer = commands.RequestWakeup(state().limits().first_byte_timeout)
        self.__dict__[_TIMER] = timer
        yield timer


def _server_read_headers(self: Http1Server, event: events.Event):
    """A client's request head: bounded in size and time; a parse failure is reported."""
    if isinstance(event, events.DataReceived):
        self.__dict__[_SPOKE] = True
        limits = state().limits()
        self.__dict__.setdefault(_STARTED, time.monotonic())
        problem = _problem(self, limits, "request")
        if problem is not None:
            yield from _refuse_head(self, *problem)
            return
    elif isinstance(event, events.ConnectionClosed) and len(self.buf) > 0:
        # Closed with half a head: by the client, or by mitmproxy after limits.idle_timeout of silence.
        waited = time.monotonic() - self.__dict__.get(_STARTED, time.monotonic())
        rule, by = ("limits.idle_timeout", "by egresswall after limits.idle_timeout of silence") if (
            self.conn.id in state().idle_closed) else ("http:incomplete-head", "by the client")
        state().on_refusal(self.conn, 0, rule, f"the connection was closed {by}, {waited:.1f}s into a request "
                                               f"head that never ended ({len(self.buf)} bytes)")
    logs: list[str] = []
    kept = _KeptHead(self.buf) if isinstance(event, events.DataReceived) else None
    sent = _note_sent_authority(self, _originals["server_read_headers"](self, event))
    try:
        yield from _watch_logs(_core_answers(self, sent, kept), logs)
    finally:
        if kept is not None:
            kept.close()
    if self.state == self.read_headers and len(self.buf) and isinstance(event, events.DataReceived) and (
            self.__dict__.get(_TIMER_FOR) != self.__dict__[_STARTED]):
        # Half a head is in: a timer, so a client that stops here is cut off at limits.header_timeout
        # (only then: a head that arrives whole, the usual case, costs no timer).
        timer = commands.RequestWakeup(max(0.0, self.__dict__[_STARTED] + limits.header_timeout - time.monotonic()))
        self.__dict__[_TIMER], self.__dict__[_TIMER_FOR] = timer, self.__dict__[_STARTED]
        yield timer
    if self.state != self.read_headers:
        self.__dict__.pop(_STARTED, None)  # the head is in: the next one on this connection gets a fresh clock
        self.__dict__.pop(_TIMER, None)
        if (self.state == self.done and self.request is None and isinstance(event, events.DataReceived)
                and not (kept is not None and kept.answered)):
            # mitmproxy answered 400 ("Bad HTTP request line", "Invalid header line"...) before any flow.
            detail = logs[-1].split(": ", 1)[-1] if logs else "unparseable request head"
            state().on_refusal(self.conn, 400, "http:malformed", _unparseable(detail))


SENT_AUTHORITY = "egresswall_sent_authority"  # on an http.Request: its request target's authority as sent
# On an http.Request whose framing mitmproxy's head reader refused: its words, which the client was answered with
# (mitmproxy's stream then words the same fault its own way, "Received ... from client, refusing ...").
FRAMING_REFUSED = "egresswall_framing_refused"
_SPOKE_AFTER_RESPONSE = "_egresswall_spoke_after_response"  # on an Http1Client: it sent bytes after its response


def _note_sent_authority(self: Http1Server, generator: Generator) -> Generator:
    """mitmproxy's request-head reader, noting each request's authority as the client sent it before its
    headers go to the stream: in regular mode the stream empties ``authority`` before any hook runs (it
    forwards origin form), and its own split of it (port 0 read as the scheme's default) must not stand in
    for what was sent (proxy/addons/decision.py gives it to the gate). Test: test_host_form_parity.py."""

    def note(command: object) -> object:
        if isinstance(command, ReceiveHttp) and isinstance(command.event, RequestHeaders):
            request = command.event.request
            setattr(request, SENT_AUTHORITY, request.data.authority.decode("latin-1"))
        return command
    return _tap(generator, note)


class _KeptHead:
    """The head lines mitmproxy's request reader takes out of its buffer (``maybe_extract_lines``), kept while it
    reads them: when it refuses the head, the core judges the target in it and its Accept chooses the answer's body
    (``_core_answers``)."""

    def __init__(self, buf: ReceiveBuffer) -> None:
        self.buf, self.lines, self.answered = buf, None, False
        extract = buf.maybe_extract_lines

        def keep():
            self.lines = extract()
            return self.lines
        buf.maybe_extract_lines = keep

    def close(self) -> None:
        del self.buf.maybe_extract_lines  # the method of the class again


def _outside_tunnel(layer: Http1Server) -> bool:
    """Not a request inside a CONNECT's tunnel (whose layers are given the CONNECT's address): there the target
    is the tunnel's, and a request line mitmproxy cannot read stays its 400."""
    return layer.context.server.address is None


def _core_answers(self: Http1Server, generator: Generator, kept: _KeptHead | None) -> Generator:
    """mitmproxy's request-head reader, but for its 400 to a head it cannot parse: when the core refuses the host
    or port the request line names (``GET http://a..b/``, ``CONNECT a..b:443``, a port of 0), the answer is the
    core's refusal (``PatchState.on_unread_target``), as on the fast path, where mitmproxy's parser is never asked
    (test_host_form_parity.py); else egresswall's ``http:malformed`` refusal, recorded here. Either way in JSON
    when the head's Accept prefers it: the head was whole, so the client said what it reads (README, *Refusals an
    agent can read*; test_review_round21_records_json.py)."""
    def answer(command: object) -> object:
        if not (isinstance(command, commands.SendData) and isinstance(command.data, _ErrorAnswer)):
            return command
        if self.request is not None:
            # The head parsed and its framing did not (``Content-Length: 003``, CL beside TE): the decision
            # hook records it as ``invalid_framing`` words it, and the answer says the same (it said
            # http:malformed, "cannot be parsed", while the record said http:invalid-request).
            setattr(self.request, FRAMING_REFUSED, command.data.message)  # the record's words: the same
            return commands.SendData(self.conn, refusal_bytes(Refusal(400, invalid_framing(command.data.message),
                                                                      json=prefers_json(_accept_of(self.request)))))
        if kept is None or not kept.lines:
            return command
        parts = _request_line(kept.lines) if _outside_tunnel(self) else None
        refusal = state().on_unread_target(self.conn, *parts) if parts is not None else None
        if refusal is None:
            refusal = _refuse_whole_head(self.conn, command.data.status, "http:malformed",
                                         _unparseable(command.data.message), _head_values(kept.lines, b"accept"))
        kept.answered = True  # recorded: _server_read_headers does not record it again
        return commands.SendData(self.conn, refusal_bytes(refusal))
    return _tap(generator, answer)


def _request_line(lines) -> tuple[str, str, str | None, tuple[str, ...]] | None:
    """(method, target, the one Host header or None, Accept values) of a head's lines as mitmproxy's reader
    split them; None when the request line is not three ASCII words (then nothing names a target)."""
    words = bytes(lines[0]).rstrip(b"\r\n").split(b" ")
    if len(words) != 3 or not all(words):
        return None
    try:
        method, target = words[0].decode("ascii"), words[1].decode("ascii")
    except UnicodeDecodeError:
        return None
    hosts = _head_values(lines, b"host")
    return method, target, hosts[0] if len(hosts) == 1 else None, _head_values(lines, b"accept")


def _head_values(lines, name: bytes) -> tuple[str, ...]:
    """Every value of one header (``name``, lower case) in a head's lines as mitmproxy's reader split them, read as
    the fast path and h11 read a field: ``name:value`` with the name exactly (no space before the colon, and not a
    folded line, which continues the field before it), the value without the SP/HTAB around it, latin-1 as sent.
    Several fields of the name all count (``prefers_json`` reads them as one list)."""
    values = []
    for line in lines[1:]:
        field_name, colon, value = bytes(line).partition(b":")
        if colon and field_name.lower() == name:
            values.append(value.strip(b" \t").decode("latin-1"))
    return tuple(values)


def _accept_of(request: http.Request | None) -> tuple[str, ...]:
    """The Accept values of a head mitmproxy parsed (each field's, as its reader split them)."""
    return () if request is None else tuple(request.headers.get_all("accept"))


def _refuse_whole_head(conn: connection.Connection, status: int, rule: str, reason: str,
                       accept: tuple[str, ...]) -> Refusal:
    """A whole request head refused before any flow: recorded, and the refusal to answer, in JSON when its
    ``accept`` prefers it (only a head that was never whole, 408 and 431, has no Accept to read)."""
    refuse = state().on_head_refusal
    if refuse is not None:
        return refuse(conn, status, rule, reason, accept)
    state().on_refusal(conn, status, rule, reason)
    return Refusal(status, Verdict(False, "form", rule, reason), json=prefers_json(accept))


def _server_wait(self: Http1Server, event: events.Event):
    """A request is out, its response not yet back: bytes the client sends meanwhile are only buffered. A
    client that half-closes now is answered, then closed (``_server_mark_done``), as on the fast path:
    mitmproxy took the end of its sending side for "not interested in any more data from us" and closed
    it unanswered — a refusal's record said sent, and the client never saw it
    (test_half_close_while_deciding.py)."""
    if (isinstance(event, events.ConnectionClosed) and event.connection.state & connection.ConnectionState.CAN_WRITE
            and self.request is not None and "upgrade" not in self.request.headers):
        setattr(self, _HALF_CLOSED, True)
        return
    limit = state().limits().max_header_bytes
    if isinstance(event, events.DataReceived) and len(self.buf) > limit:
        reason = (f"the client sent more than {limit} bytes (limits.max_header_bytes) after a request that is "
                  "still waiting for its response; they would only be buffered")
        self.state = self.done
        yield commands.CloseConnection(self.conn)
        yield ReceiveHttp(RequestProtocolError(self.stream_id, f"egresswall: {reason}", ErrorCode.CLIENT_DISCONNECTED))
        state().on_refusal(self.conn, 0, "limits.max_header_bytes", reason)
        return
    yield from _originals["server_wait"](self, event)


def _server_mark_done(self: Http1Server, *, request: bool = False, response: bool = False):
    """The answer to a half-closed client is out: the client's end, held back for it, now goes to the state
    that follows, as on the fast path. A tunnel's pipe (a CONNECT answered 200, a 101) takes it with what
    was sent after the head: its layer learns the client is done and ends the tunnel (kept from it, the
    tunnel stayed open until limits.idle_timeout). Anything else closes: a request pipelined behind the
    answered one is dropped unparsed, as the fast path drops it (parsed, it was decided and recorded as
    answered on a connection that was then closed). Test: test_review_round8.py."""
    half_closed = response and getattr(self, _HALF_CLOSED, False)
    if half_closed and self.request_done and self.request is not None and self.response is not None and not (
            _http1.should_make_pipe(self.request, self.response)):
        self.buf = ReceiveBuffer()  # the client's next request, if any: never parsed, never answered
    yield from _originals["server_mark_done"](self, request=request, response=response)
    if half_closed and self.state != self.done:
        setattr(self, _HALF_CLOSED, False)
        yield from self.state(events.ConnectionClosed(self.conn))
        if self.state == self.read_headers:
            self.state = self.done  # closed (mitmproxy's read_headers closes on the end, and stays)


def _client_read_headers(self: Http1Client, event: events.Event):
    """An upstream's response head: bounded in size and time (the client gets a 502)."""
    if isinstance(event, events.DataReceived) and self.stream_id is not None and self.request is not None:
        self.__dict__.setdefault(_STARTED, time.monotonic())
        problem = _problem(self, state().limits(), "upstream response")
        if problem is not None:
            self.state = self.done
            yield commands.CloseConnection(self.conn)
            yield ReceiveHttp(OwnResponseError(self.stream_id, f"egresswall: {problem[1]}",
                                               ErrorCode.GENERIC_SERVER_ERROR))
            return
    interim = isinstance(event, events.DataReceived) and _drop_interim_heads(self.buf)
    yield from _originals["client_read_headers"](self, event)
    if self.state != self.read_headers or (not len(self.buf) and not interim):
        # The head is in (a whole response may even have come and gone within this one event, leaving a
        # kept-alive connection back in read_headers): the next response gets a fresh clock. Not after
        # an interim one: its final response is still to come, within the same limits.header_timeout.
        self.__dict__.pop(_STARTED, None)


def _read_response_head(lines: list[bytes]):
    """An upstream's response head as mitmproxy parses it, refused (``ValueError``: the client gets
    egresswall's 502, the record mitmproxy's "Cannot parse HTTP response" with this reason) where h11
    refuses it on the fast path: a control byte in a line, a status code that is not three digits (or is under
    100: ``HTTP/1.1 099`` went on as ``HTTP/1.1 99``), a Content-Length of more than 20 digits. mitmproxy kept
    a bare CR or a NUL inside a value (or the reason phrase) and wrote it out to the client as it came: a
    client that ends a line at a bare CR read the rest as a header of its own (response splitting);
    ``HTTP/1.1 2000 OK`` went on as it came, recorded as status 2000."""
    for index, line in enumerate(lines):
        bad = CONTROL_BYTE.search(line)
        if bad is not None:
            what = "status line" if index == 0 else f"header line {index}"
            raise ValueError(f"egresswall: the upstream response's {what} has the control byte "
                             f"0x{line[bad.start()]:02x} (only HTAB may be in one)")
    if not _STATUS_CODE.match(lines[0]):
        raise ValueError(f"egresswall: the upstream response's status line has no three-digit status code from 100: "
                         f"{lines[0][:60]!r}")
    response = _originals["read_response_head"](lines)
    for value in (value.strip() for value in response.headers.get_all("content-length")):
        if len(value) > _LENGTH_DIGITS:
            raise ValueError(f"egresswall: the upstream response's Content-Length has more than {_LENGTH_DIGITS} "
                             "digits")
        if value.isascii() and value.isdigit() and int(value) > MAX_CONTENT_LENGTH:
            raise ValueError(f"egresswall: the upstream response's Content-Length is over {MAX_CONTENT_LENGTH} (a "
                             "client reading it into 64 bits could wrap it)")
    return response


def _drop_interim_heads(buf) -> bool:
    """Remove the whole 1xx heads (other than 101) at the start of an upstream's response buffer; True if
    any were. mitmproxy reads a ``100 Continue`` or ``103 Early Hints`` as the final response: the client
    got it as the answer to its request, and the real one was thrown away as "unexpected data". They are
    not passed on (as on the fast path), and the final response follows."""
    dropped = False
    while _INTERIM.match(_start_of(buf)) and buf.maybe_extract_lines() is not None:  # None: not whole yet
        dropped = True
    return dropped


def _start_of(buf, size: int = 16) -> bytes:
    """The first bytes of an h11 ReceiveBuffer without copying all of it on every read (an upstream that
    drips a long head would make that quadratic); ``maybe_extract_lines`` searches incrementally itself."""
    data = getattr(buf, "_data", None)
    return bytes(data[:size]) if data is not None else bytes(buf)[:size]


# ---- mitmproxy's own answers -------------------------------------------------------------------------

class OwnResponseError(ResponseProtocolError):
    """An upstream failure egresswall itself ended (a bound on the response head): its message is egresswall's
    own words, which the client's answer may carry (mitmproxy's may quote the upstream's bytes)."""


def _server_send(self: Http1Server, event):
    """mitmproxy's own error answers (its branch for ``ResponseProtocolError``, taken over): egresswall's
    refusal, as the fast path answers, not mitmproxy's HTML page (``Server: mitmproxy``, no reason headers,
    "consider setting connection_strategy"). For a request no hook of ours saw, the refusal is recorded here;
    one our hooks saw has its record already (the decision's, the error hook's): the answer says the same."""
    if not isinstance(event, ResponseProtocolError) or self.response is not None:
        yield from _originals["server_send"](self, event)
        return
    if not (self.conn.state & connection.ConnectionState.CAN_WRITE):
        return
    status = event.code.http_status_code()
    if status is not None:
        seen = self.request is not None and getattr(self.request, "egresswall_seen", False)
        if seen:
            refusal = _answer_to_seen(self.request, status, event.code, event.message,
                                      isinstance(event, OwnResponseError))
        else:
            refusal = _unread_host_refusal(self, status) if event.code is ErrorCode.DESTINATION_UNKNOWN else None
            if refusal is None:
                reason = f"mitmproxy refused the request before any decision: {event.message}"[:400]
                refusal = _refuse_whole_head(self.conn, status, "http:invalid-request", reason,
                                             _accept_of(self.request))
        yield commands.SendData(self.conn, refusal_bytes(refusal))
    yield commands.CloseConnection(self.conn)


def _unread_host_refusal(self: Http1Server, status: int) -> Refusal | None:
    """An origin-form request whose Host header mitmproxy cannot read ("destination unknown"), recorded: with two
    or more, the core's ``form:host-header`` (mitmproxy said "no host header", the opposite of what was sent);
    with one, the core's refusal of the host it names (``Host: a..b``), or None (mitmproxy's 400 stands)."""
    request = self.request
    if request is None or request.authority or not _outside_tunnel(self):
        return None
    hosts = request.headers.get_all("host")
    if len(hosts) > 1:
        return _refuse_whole_head(self.conn, status, "form:host-header", several_hosts_reason(hosts),
                                  _accept_of(request))
    return state().on_unread_target(self.conn, request.method, request.path, hosts[0] if hosts else None,
                                    _accept_of(request))


def several_hosts_reason(hosts: list[str]) -> str:
    """Why a request with several Host headers is refused (400, as RFC 9112 3.2 has it: each header may name
    another host, and which one a server reads is its own choice), in any form: here for origin form, by the
    decision addon for the rest. The values are quoted as the core quotes a Host header that disagrees."""
    sent = safe_text(for_logs(", ".join(hosts)), 100)
    return f"the request has {len(hosts)} Host headers ({sent!r}); a request names its host in exactly one"[:400]


def _answer_to_seen(request: http.Request, status: int, code: ErrorCode, message: str, own: bool) -> Refusal:
    """mitmproxy's error answer to a request egresswall decided: a failed connect (502), worded as its record
    is (``connect_error_text``); a bound of egresswall's on the upstream (``own``: its words); another
    upstream failure (502), whose text may quote the upstream's bytes, which never reach a refusal (README,
    "Refusals an agent can read": the record has them); or a framing mitmproxy refused (its decision
    record's reason)."""
    # A request refused for its form before it was decided has no answer context: its own Accept still chooses
    target, role, accept = getattr(request, "egresswall_answer_context", (None, None, _accept_of(request)))
    via_upstream = _state is not None and _state.via_upstream()
    if code is ErrorCode.CONNECT_FAILED:
        verdict = failed_connect(connect_error_text(message), role, via_upstream)
    elif own:
        verdict = failed_connect(message, role, via_upstream)
    elif status == 502:
        verdict = failed_connect(UNRELAYABLE_RESPONSE, role)
    else:
        verdict = invalid_framing(message)
    host, port = (target.host, target.port) if target is not None else (None, None)
    return Refusal(status, verdict, host, port, json=prefers_json(accept))


def connect_error_text(message: str) -> str:
    """mitmproxy's text for a failed connect, as egresswall words it: the fast front's wording already
    (``_open_connection``), but for the prefix mitmproxy puts before a connect a hook refused."""
    return message.removeprefix("Connection killed: ")


class _ErrorAnswer(bytes):
    """The bytes of mitmproxy's answer to a head it cannot parse (``_core_answers`` knows them by their type, and
    answers in their place), its ``status`` and mitmproxy's ``message``."""

    status: int = 400
    message: str = ""


_CONNECT_INSIDE = "mitmproxy received an HTTP CONNECT request even though"
_SMUGGLING = re.compile(r"Received (.*) from client, refusing to prevent request smuggling attacks\.", re.DOTALL)


def invalid_framing(message: str) -> Verdict:
    """A request whose head mitmproxy read and whose framing it refused (``message``: its words): the record's
    rule and reason (proxy/addons/decision.py) and the answer's (``_core_answers``). mitmproxy's own advice to its
    operator (its mode documentation, an option to switch the smuggling check off) is not egresswall's to give: a
    client and an operator read egresswall's words (review round 23)."""
    smuggling = _SMUGGLING.match(message)
    if message.startswith(_CONNECT_INSIDE):
        reason = ("a CONNECT inside a tunnel: a tunnel reaches only the host and port its own CONNECT named; open "
                  "another tunnel through the proxy for another one")
    elif smuggling is not None:
        reason = (f"the request's framing is ambiguous ({smuggling.group(1)}): an upstream may read it otherwise "
                  "than egresswall does (request smuggling), so it is refused")
    else:
        reason = f"mitmproxy refused the request: {message}"
    return Verdict(False, "form", "http:invalid-request", reason[:400])


def _error_answer(status: int, message: str) -> bytes:
    """``_http1.make_error_response``, which mitmproxy's request-head reader calls for a head it cannot parse:
    egresswall's text refusal, with the record's rule and reason. ``_core_answers`` records it and answers in its
    place (in JSON where the head's Accept prefers it); ``_server_read_headers`` records what it did not see."""
    verdict = Verdict(False, "form", "http:malformed", _unparseable(message))
    answer = _ErrorAnswer(refusal_bytes(Refusal(status, verdict)))
    answer.status, answer.message = status, message
    return answer


def _unparseable(detail: str) -> str:
    """mitmproxy's words for a head it cannot parse quote its request line, which may carry a password or a
    token in its URL: written as ``policy.hosts.for_logs`` writes a URL (no userinfo, no query)."""
    return f"the request head cannot be parsed: {for_logs(detail)}"[:400]


def _should_make_pipe(request, response) -> bool:
    if getattr(request, "egresswall_no_pipe", False):
        return False  # a 101 egresswall refused: the upstream connection is not a pipe to anyone
    return _originals["should_make_pipe"](request, response)


# ---- idle close and connect time ------------------------------------------------------------------

async def _on_timeout(self: mitmproxy.proxy.server.ConnectionHandler) -> None:
    state().idle_closed.add(self.client.id)
    await _originals["on_timeout"](self)


async def _handle_connection(self: mitmproxy.proxy.server.ConnectionHandler, conn: connection.Connection) -> None:
    """mitmproxy's, and then: a connection it left registered (an exception, in practice a cancel, escaped
    from an ``await`` the original does not guard) has its socket closed and is told closed, as the original
    would have done."""
    io = self.transports.get(conn)
    if conn is self.client and io is not None and io.reader is not None:
        io.reader = HeldReader(io.reader)  # the original takes its reader from here when it starts
        conn.__dict__[_CLIENT_READER] = io.reader  # for the layers that hold it (_start_server_tls)
    if io is not None and io.writer is not None and not isinstance(io.writer, AnsweringWriter):
        # The client's writer closes lingering, reading from the reader HeldReader wraps (its holds are over).
        reader = io.reader.reader if isinstance(io.reader, HeldReader) else None
        io.writer = AnsweringWriter(io.writer, conn, reader)
    _reading.set(conn)  # in this task's own context: whose read loop this is (_drain_writers)
    try:
        await _originals["handle_connection"](self, conn)
    finally:
        io = self.transports.pop(conn, None)  # the original removes it on every way out it expects
        if io is not None:
            told = conn.state is connection.ConnectionState.CLOSED  # closed by a layer's command: it knows
            conn.state = connection.ConnectionState.CLOSED
            if io.writer is not None:
                with contextlib.suppress(OSError):
                    io.writer.close()
            if not told:
                # Shielded: a second cancel while this waits for mitmproxy's event lock would leave the
                # layers untold (test_mitm_patches_sockets.py, task-cancelled-twice).
                await asyncio.shield(self.server_event(events.ConnectionClosed(conn)))


# The connection whose read loop runs in this task (each connection's loop is a task of its own, and the
# tasks it makes for hooks inherit it).
_reading: contextvars.ContextVar[connection.Connection | None] = contextvars.ContextVar("egresswall_reading",
                                                                                       default=None)


_lingering: set[asyncio.Task] = set()  # the lingering closes under way (a task needs a reference to run)


class AnsweringWriter:
    """A connection's writer that notes when it is written to on behalf of that connection's own reads: the
    proxy answering the peer itself (a refusal, a TLS alert, a close), not relaying the other side. Those are
    the only writes to it that its own read loop waits for, so a peer that sends and never reads cannot make
    the proxy queue answers without bound. Whatever else mitmproxy asks of it goes to the writer it wraps.

    A client's writer (given its ``reader``) also closes lingering: closing a socket with bytes unread makes
    the kernel send a reset, which destroys an answer the client has not read yet, so a client still sending
    (a body an origin answered early, with 413, and stopped reading) got a reset instead of the answer. Its
    sending side is shut at once, and what the client sends is read and dropped until it closes, for at most
    LINGER_SECONDS and LINGER_BYTES, before the socket closes (the fast path's answer_then_drain, the same
    bound). Test: test_early_response.py::test_an_answer_then_a_drain_reaches_a_client_still_sending."""

    def __init__(self, writer, conn: connection.Connection, reader=None) -> None:
        self._writer = writer
        self._conn = conn
        self._reader = reader
        self._lingering = False
        self.answered = False  # written to by its own read loop (or a hook it started) since it last drained

    def write(self, data: bytes) -> None:
        if _reading.get() is self._conn:
            self.answered = True
        self._writer.write(data)

    def close(self) -> None:
        if self._lingering:
            return  # the lingering close closes it
        reader, self._reader = self._reader, None
        if reader is None or reader.at_eof() or not isinstance(self._writer, asyncio.StreamWriter) \
                or self._writer.is_closing():
            self._writer.close()
            return
        self._lingering = True
        task = asyncio.get_running_loop().create_task(_linger(reader, self._writer))
        _lingering.add(task)
        task.add_done_callback(_lingering.discard)

    def __getattr__(self, name: str):
        return getattr(self._writer, name)


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Shut the sending side, read and drop what comes until the peer closes or the bound is reached, close."""
    loop = asyncio.get_running_loop()
    try:
        if writer.can_write_eof():
            writer.write_eof()  # after what is queued: the answer goes out first
        deadline, drained = loop.time() + LINGER_SECONDS, 0
        while drained < LINGER_BYTES and (left := deadline - loop.time()) > 0:
            chunk = await asyncio.wait_for(reader.read(65536), left)
            if not chunk:
                break
            drained += len(chunk)
    except (OSError, RuntimeError, TimeoutError):
        pass
    finally:
        writer.close()


async def _drain_writers(self: mitmproxy.proxy.server.ConnectionHandler) -> None:
    """mitmproxy's backpressure after a read, by direction: wait for the writers to the other connections, and
    for the one to the peer just read from only when this read answered it, each read loop on its own (no
    shared lock: StreamWriter.drain may be awaited by several tasks at once). So the peer's bytes are still read
    while it is slow to read what was relayed to it."""
    reading = _reading.get()
    for conn, io in list(self.transports.items()):
        writer = io.writer
        if writer is None:
            continue
        if conn is reading:
            if not getattr(writer, "answered", True):
                continue
            writer.answered = False
        try:
            await writer.drain()
        except OSError as err:
            if io.handler is not None:
                io.handler.cancel(f"Error sending data: {err}")


_GONE_POLL = 0.25  # seconds between looks at a held client's end (HeldReader)


class HeldReader:
    """A client connection's reader whose reads wait while one of its requests is being decided.

    Held from the making of a blocking hook's task to its end (several may run at once, an HTTP/2
    connection's streams: the reads wait until the last ends). A read already under way when the hold
    starts completes; the next one waits. Whatever else mitmproxy asks of the reader goes to the one it
    wraps.

    A hold made only to keep a paused layer from queueing a client's bytes without bound (``until_end``: an
    intercepted origin's TLS handshake, an upstream proxy's answer) ends early when the client has gone: its
    end is then read (with what it sent before, no more than the wrapped reader buffers). A decision's hold
    never does: its request's body and end are read only after it.

    mitmproxy takes a client's end as a half-close, queued for the paused layer, and keeps the connection for
    what it may still send the client; while the origin's TLS handshake is awaited (``ends_handshake``) there
    is nothing to send: a client that ended its side cannot finish its own handshake. Its end then ends the
    connection (its read loop is cancelled, as mitmproxy's own kill does), so its upstream and its slot go at
    once rather than when the idle timeout fires (review round 22)."""

    def __init__(self, reader) -> None:
        self.reader = reader  # the one it wraps
        self._holds = 0
        self._decisions = 0  # holds that the client's end must not cut short
        self._handshakes = 0  # holds during which the client's end ends the connection
        self._released: asyncio.Future[None] | None = None

    def hold(self, until_end: bool = False, ends_handshake: bool = False) -> None:
        self._holds += 1
        self._decisions += not until_end
        self._handshakes += ends_handshake

    def release(self, until_end: bool = False, ends_handshake: bool = False) -> None:
        self._holds -= 1
        self._decisions -= not until_end
        self._handshakes -= ends_handshake
        if self._released is not None and not self._released.done():
            self._released.set_result(None)  # a read waiting looks again: held no more, or held another way

    async def read(self, n: int = -1) -> bytes:
        while self._holds:
            if not self._decisions and self._client_gone():
                break
            self._released = asyncio.get_running_loop().create_future()
            if self._decisions:
                await self._released
            else:  # the wrapped reader has no event for its end but its data's: looked at a few times a second
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self._released), _GONE_POLL)
        data = await self.reader.read(n)
        if not data and self._handshakes:
            task = asyncio.current_task()
            assert task is not None
            task.cancel()
            await asyncio.sleep(0)  # raises the cancel here, in mitmproxy's read loop
        return data

    def _client_gone(self) -> bool:
        """The client's end (or a reset) has reached the wrapped reader, read or not (asyncio.StreamReader keeps
        it in ``_eof``; its ``at_eof`` waits for the bytes before it to be read)."""
        exception = getattr(self.reader, "exception", None)
        return bool(getattr(self.reader, "_eof", False) or (exception is not None and exception() is not None))

    def __getattr__(self, name: str):
        return getattr(self.reader, name)


def _hook_task(self: mitmproxy.proxy.server.ConnectionHandler, hook: commands.StartHook) -> Coroutine:
    """The hook's task, as mitmproxy's, holding its client's reads from the moment the task is made until
    the hook has ended (the task may start after the read loop's next read has begun).

    Every blocking hook holds them, not only ``requestheaders``: the events a hook holds up are queued by
    mitmproxy's layers anyway, and the hook before it (``next_layer``, which picks the HTTP layer for the
    connection's first bytes) let the next read take the body and the client's end before the request's
    head reached its decision. None of these hooks waits for more of the client's bytes."""
    io = self.transports.get(self.client) if hook.blocking else None
    reader = io.reader if io is not None else None
    if not isinstance(reader, HeldReader):
        return _originals["hook_task"](self, hook)
    reader.hold()
    return _held_hook_task(self, hook, reader)


async def _held_hook_task(self: mitmproxy.proxy.server.ConnectionHandler, hook: commands.StartHook,
                          reader: HeldReader) -> None:
    try:
        await _originals["hook_task"](self, hook)
    finally:
        reader.release()


_CLIENT_READER = "_egresswall_client_reader"  # on a client Connection: its HeldReader


def _holding_client_reads(layer, generator: Generator, ends_handshake: bool = False):
    """Run a layer's generator with its client's reads held: a layer paused on a command queues every event
    that comes meanwhile, and mitmproxy reads the client on (nothing is written, so nothing to drain).
    ``ends_handshake``: the client's end, meanwhile, ends its connection (HeldReader)."""
    reader = layer.context.client.__dict__.get(_CLIENT_READER)
    if not isinstance(reader, HeldReader):
        return (yield from generator)
    reader.hold(until_end=True, ends_handshake=ends_handshake)
    try:
        return (yield from generator)
    finally:
        reader.release(until_end=True, ends_handshake=ends_handshake)


def _start_server_tls(self: ClientTLSLayer):
    """The client's TLS layer waiting for the origin's handshake (connects are eager, so mitmproxy makes the
    origin's TLS before the client's), with the client's reads held meanwhile: the layer is paused until the
    origin answers, and an origin that never answered its ClientHello let one client fill a worker's memory
    (1.2 GB in 4 s). No client byte is needed for that handshake, and a client has nothing to send before the
    proxy's ServerHello."""
    return (yield from _holding_client_reads(self, _originals["start_server_tls"](self), ends_handshake=True))


def _tcp_start(self: TCPLayer, event: events.Event):
    """A relayed tunnel's start, which in mitmproxy's upstream mode waits for the upstream proxy's answer to its
    CONNECT (mitmproxy answered the client's itself): with the client's reads held meanwhile, as above (a mute
    upstream proxy let one client grow a worker by 1.9 GB in 4 s). In regular mode the origin is connected
    before the client's CONNECT is answered, and this ends at once."""
    return (yield from _holding_client_reads(self, _originals["tcp_start"](self, event)))


async def _open_connection(host, port, *args, **kwargs):
    timeout = state().limits().connect_timeout
    # Each failure is an OSError whose text is the fast front's (proxy/dial.py): mitmproxy reports it as the
    # connect error (the 502's reason, the error hook's, a tunnel's closing line).
    try:
        return await asyncio.wait_for(asyncio.open_connection(host, port, *args, **kwargs), timeout)
    except TimeoutError:
        raise TimeoutError(connect_timed_out(host, port, timeout)) from None
    except OSError as err:
        raise OSError(connect_failed(host, port, err)) from None


def _plain_refusal(status: int, rule: str, reason: str) -> http.Response:
    from .refusals import refusal_parts

    code, headers, body = refusal_parts(Refusal(status, Verdict(False, "limits", rule, reason)))
    return http.Response.make(code, body, [(k.encode(), v.encode("latin-1")) for k, v in headers])


# ---- a WebSocket message is bounded ----------------------------------------------------------------

def _websocket_events(self: WebsocketConnection) -> Generator:
    """wsproto's events, with the bytes of the message being received counted: past the limit the message
    goes no further and a close (1009) stands in for it, which mitmproxy's layer sends to both sides before it
    closes both connections; nothing after it is read."""
    held = self.__dict__.get(_WEBSOCKET_HELD, 0)
    for event in _originals["websocket_events"](self):
        if isinstance(event, (WebSocketPing, WebSocketPong)) and not _control_bytes_taken(self.conn,
                                                                                        len(event.payload)):
            return  # past its session's byte budget: not relayed, and the gate closes the WebSocket
        if isinstance(event, WebSocketClose) and not _control_bytes_taken(self.conn, _close_size(event)):
            # mitmproxy's layer relays a close's code and reason (up to 125 bytes) to the other side: past the
            # session's byte budget, egresswall's own code stands in for them (review round 18).
            event = WebSocketClose(code=WEBSOCKET_POLICY_VIOLATION, reason="")
        if isinstance(event, WebSocketMessage):
            data = event.data
            held += len(data.encode("utf-8")) if isinstance(data, str) else len(data)
            if event.frame_finished and not event.message_finished:
                held += WEBSOCKET_FRAGMENT_COST  # mitmproxy keeps it as one more fragment
            limit = state().limits().max_websocket_message
            if held > limit:
                reason = (f"a WebSocket message passed {limit} bytes (limits.max_websocket_message): egresswall "
                          "holds a message whole before relaying it, and closed the WebSocket")
                self.conn.__dict__[WEBSOCKET_TOO_BIG] = reason
                self.__dict__[_WEBSOCKET_HELD] = 0
                yield WebSocketClose(code=WEBSOCKET_MESSAGE_TOO_BIG, reason="message too big")
                return
            if event.message_finished:
                held = 0
        self.__dict__[_WEBSOCKET_HELD] = held
        yield event
    self.__dict__[_WEBSOCKET_HELD] = held


def _control_bytes_taken(conn: object, size: int) -> bool:
    """A control frame's payload (a ping's, a pong's, a close's code and reason), relayed to the other side:
    counted toward the WebSocket's bytes (charged to its session) and taken from its session's allowance. False
    when it would pass the session's byte budget (the gate then closes the WebSocket)."""
    taken = conn.__dict__.get(WEBSOCKET_ALLOWANCE)
    if taken is not None and not taken[0].take(taken[1], size):
        return False
    conn.__dict__[WEBSOCKET_CONTROL_BYTES] = conn.__dict__.get(WEBSOCKET_CONTROL_BYTES, 0) + size
    return True


def _close_size(event: WebSocketClose) -> int:
    """The bytes a close frame carries: its code (2) and its reason (RFC 6455 5.5.1); none without a code."""
    if event.code in (1005, 1006):  # "no status" and "abnormal": never on the wire
        return 0
    return 2 + len((event.reason or "").encode("utf-8"))


class _FrameBuffer(list):
    """mitmproxy's ``frame_buf`` (the pieces of the message being received, one a frame) with each piece a
    bytearray: the layer appends what each read brings by ``frame_buf[-1] += data``, which on bytes copies the
    whole frame so far every time, so a 10 MiB frame trickled in 1 KiB pieces copied some 50 GB (a worker's CPU
    held by one slow client); a bytearray grows in place."""

    def __init__(self, pieces: Iterable[bytes] = ()) -> None:
        super().__init__(bytearray(piece) for piece in pieces)

    def append(self, piece: bytes) -> None:
        super().append(bytearray(piece))


def _frame_buf(self: WebsocketConnection) -> _FrameBuffer:
    return self.__dict__["_egresswall_frame_buf"]


def _set_frame_buf(self: WebsocketConnection, pieces: Iterable[bytes]) -> None:
    self.__dict__["_egresswall_frame_buf"] = _FrameBuffer(pieces)


def _inflate_bounded(self: PerMessageDeflate, proto, data: bytes) -> bytes | CloseReason:
    """wsproto's inflating of a permessage-deflate frame, with at most ``limits.max_websocket_message`` + 1 bytes
    out of one piece of it: unbounded, 64 KiB read from the wire became 64 MiB before the limit was looked at (a
    decompression bomb). A piece cut short is over the limit, so ``_websocket_events`` ends the WebSocket on it."""
    if not self._inbound_compressed or not self._inbound_is_compressible:
        return data
    try:
        out = self._decompressor.decompress(bytes(data), state().limits().max_websocket_message + 1)
    except zlib.error:
        return CloseReason.INVALID_FRAME_PAYLOAD_DATA
    if self._decompressor.unconsumed_tail:
        self.__dict__[_INFLATE_CUT] = True  # the frame's end must not inflate the rest (``_inflate_complete``)
    return out


def _inflate_complete(self: PerMessageDeflate, proto, fin: bool) -> bytes | CloseReason | None:
    """wsproto's end of a compressed frame, except after ``_inflate_bounded`` cut a piece short: wsproto then
    inflated its end marker without the input left over, zlib refused it, and the WebSocket closed 1007 "error in
    extension" with no refusal record, before ``_websocket_events`` could see the message over the limit (a bomb
    whose frame came in one read; review round 20). Nothing more is inflated: the message is over the limit
    already, and ends 1009 with its record."""
    if self.__dict__.pop(_INFLATE_CUT, False):
        return b""
    return _originals["deflate_complete"](self, proto, fin)
