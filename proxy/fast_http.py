"""The fast path for plain HTTP: absolute-form ``http://`` requests decided by the gate and relayed by the
front, parsed with h11 on both sides, without mitmproxy's layer stack.

The front hands a connection here when its first head is one ``proxy/http_head.py`` takes (strict
framing, no upgrade, no Expect, a host that is not intercepted) and the policy names no upstream proxy.
Then, request by request on the kept-alive connection:

1. the head is classified again (``take_head``) and parsed by an h11 server-side connection; one that is
   not taken, or that h11 refuses, goes to mitmproxy with every byte read so far put back (nothing of it
   consumed): at a request boundary the connection is handed over as if mitmproxy had accepted it;
2. the gate decides it (``Gate.decide_request``: the same call the mitmproxy addons make, so the same
   checks, refusals and decision record);
3. a chunked body is read whole, bounded by ``limits.max_request_body`` (counted on its wire bytes) and by
   the budget for buffered bodies (``proxy/body_budget.py``), before anything is sent upstream; a
   Content-Length body (already checked against the limit) is streamed;
4. the connect goes to the pinned address only, re-checked by ``Gate.guard``; an upstream connection is
   reused by the next request only if that one is for the same name, pinned to the same address and port
   (as mitmproxy's path keys a kept connection by name and port, and ``Pinning`` by address), the previous
   exchange ended cleanly on both sides and the upstream sent nothing beyond its response;
5. the hop-by-hop headers are removed both ways (``proxy/http_hygiene.py``) and headers only egresswall may
   set are removed from the response; framing is h11's own, both ways, so neither side's framing is
   ever passed on as bytes: the origin's response is parsed strictly by an h11 client-side connection
   and re-framed for the client, and a 101 the request did not ask for is refused;
6. the response record (``Gate.response_closed``) gets the bytes each way, the status and how it ended.

Bytes a client sends while its request waits for the response are read (bounded by
``limits.max_header_bytes``, as mitmproxy's patched path bounds them) and become the next head.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import NoReturn

import h11

from policy.decision import Verdict
from policy.hosts import HostFormError, Target
from policy.model import Policy
from policy.sessions import STAGE as SESSION_STAGE

from .body_budget import BodyHold
from .body_reasons import TRAILERS_REASON, body_line_too_long_reason, body_over_limit_reason, body_unparseable_reason
from .dial import connect_pinned
from .early_response import UpstreamListener
from .gate import Gate, HttpAsk, plain_target, refusal_for
from .head_reader import HeadProblem, answer_then_drain, read_head
from .http_head import PlainRequest, take_head
from .http_hygiene import (
    ALWAYS_HOP_BY_HOP,
    CONTROL_BYTE,
    MAX_CONTENT_LENGTH,
    hop_by_hop_names,
    override_headers,
    tokens,
)
from .refusals import OWN_HEADER_PREFIX, UNRELAYABLE_RESPONSE, Refusal, failed_connect, refusal_bytes

Handoff = Callable[[socket.socket, bytes], None]
READ = 65536
_SWITCHING = re.compile(rb"HTTP/1\.[01] 101[ \r]")
_UNASKED_SWITCH = "_SWITCH_UPGRADE event without a pending proposal"  # h11's words for a 101 nobody asked for
_RESPONSE_DROPPED = ALWAYS_HOP_BY_HOP | {"transfer-encoding"}  # re-framed by h11 for the client
_LENGTH = re.compile(rb"0|[1-9][0-9]*")  # a Content-Length as mitmproxy's path reads one (net/http/validate.py)


class Ended(Exception):
    """The exchange ended without a response to relay: ``error`` for the record; ``answer`` (a
    refusal, already recorded or to be recorded as the response line) is sent if nothing was yet."""

    def __init__(self, error: str, answer: Refusal | None = None) -> None:
        super().__init__(error)
        self.error, self.answer = error, answer


class UnreadableBody(Ended):
    """The client's streamed (Content-Length) request body is not what h11 will read: the exchange ends with
    this reason. (A chunked body that cannot be read, read before anything goes upstream, is answered 400
    ``http:bad-chunked`` by ``_read_chunked``.)"""


@dataclass
class Upstream:
    """A connection for one name to its pinned address and port, with the h11 client-side state of its
    exchanges. ``key`` is (name, address, port): another name at the same address gets its own connection."""

    sock: socket.socket
    key: tuple[str, str, int]
    parser: h11.Connection

    def reusable_for(self, key: tuple[str, str, int]) -> bool:
        if key != self.key or self.parser.states != {h11.CLIENT: h11.DONE, h11.SERVER: h11.DONE}:
            return False
        if self.parser.trailing_data[0]:
            return False  # bytes after the response: never read as the next one's
        try:
            peeked = self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            peeked = None  # open and quiet: reusable
        except OSError:
            return False
        if peeked is not None:
            return False  # closed (b"") or it sent something unasked
        self.parser.start_next_cycle()
        return True

    def close(self) -> None:
        self.sock.close()


@dataclass
class Relayed:
    """What of the origin's response has been relayed: its status once its head is read, its body's bytes."""

    status: int | None = None
    down: int = 0
    up: int = 0  # the request body's bytes sent so far


class ClientWatch:
    """Reads what a client sends while its request waits for the response, bounded; ``over`` once the
    bound is passed (the upstream socket is then shut down, which ends the wait at once)."""

    def __init__(self, conn: socket.socket, data: bytes, limit: int, upstream: socket.socket) -> None:
        self.conn, self.data, self.limit, self.upstream = conn, bytearray(data), limit, upstream
        self.closed = self.over = False
        self._loop = asyncio.get_running_loop()
        self._watching = len(self.data) <= limit
        if self._watching:
            self._loop.add_reader(conn.fileno(), self._readable)
        else:
            self.over = True

    def _readable(self) -> None:
        try:
            chunk = self.conn.recv(READ)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self.closed = True
            self.stop()
            return
        self.data += chunk
        if len(self.data) > self.limit:
            self.over = True
            self.stop()
            with contextlib.suppress(OSError):
                self.upstream.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        if self._watching:
            self._watching = False
            self._loop.remove_reader(self.conn.fileno())


class FastHttp:
    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self._intercepts_for: Policy | None = None
        self._intercepts = False

    # ---- which requests -------------------------------------------------------------------------------

    def take(self, head: bytes) -> tuple[PlainRequest, h11.Connection] | None:
        """The request and its h11 server-side connection when the fast path relays it; None: mitmproxy's."""
        policy = self.gate.policy
        if policy.upstream is not None:
            return None
        request = take_head(head)
        if not isinstance(request, PlainRequest):
            return None
        if self._intercepting(policy):
            try:
                target = plain_target(ask_of(request, ""))
            except HostFormError:
                return None  # refused with its reason on mitmproxy's path, which reads the target itself
            if policy.intercepts(target.host):
                return None
        parser = h11.Connection(h11.SERVER, max_incomplete_event_size=policy.limits.max_header_bytes)
        try:
            parser.receive_data(head)
            event = parser.next_event()
        except h11.RemoteProtocolError:
            return None
        if not isinstance(event, h11.Request):
            return None
        return request, parser

    def _intercepting(self, policy: Policy) -> bool:
        """Whether any allow rule of ``policy`` intercepts (asked once per policy object: a reload makes
        a new one). Without such a rule no host is intercepted, and the target need not be read here."""
        if self._intercepts_for is not policy:
            tables = [policy.allow] + [role.allow for role in policy.roles]
            self._intercepts_for, self._intercepts = policy, any(r.intercept for t in tables for r in t.rules)
        return self._intercepts

    # ---- one connection -------------------------------------------------------------------------------

    async def serve(self, conn: socket.socket, client: str, head: bytes, rest: bytes, handoff: Handoff) -> bool:
        """Relay requests on ``conn`` until it ends (False) or one is not the fast path's: then the
        connection is given to ``handoff`` (mitmproxy) with the bytes read so far (True)."""
        upstream: Upstream | None = None
        try:
            while True:
                taken = self.take(head)
                if taken is None:
                    if upstream is not None:
                        upstream.close()
                        upstream = None
                    handoff(conn, head + rest)
                    return True
                self.gate.metrics.fast_http()
                going_on, rest, upstream = await self._exchange(conn, client, *taken, rest, upstream)
                if not going_on:
                    return False
                await asyncio.sleep(0)  # a client and origin that are always ready do not keep the others waiting
                following = await self._next_head(conn, client, rest)
                if following is None:
                    return False
                head, rest = following
        finally:
            if upstream is not None:
                upstream.close()

    async def _next_head(self, conn: socket.socket, client: str, data: bytes) -> tuple[bytes, bytes] | None:
        """A kept-alive connection's next head: silence up to limits.idle_timeout ends it without a word
        (as mitmproxy's idle watchdog would); a head that starts is bounded as the first one was."""
        limits = self.gate.policy.limits
        loop = asyncio.get_running_loop()
        if not data:
            try:
                data = await asyncio.wait_for(loop.sock_recv(conn, READ), limits.idle_timeout)
            except (TimeoutError, OSError):
                return None
            if not data:
                return None
        try:
            return await read_head(conn, limits, data=data, first=False)
        except HeadProblem as problem:
            if problem.status:
                refusal = self.gate.refuse(client, None, None, problem.status,
                                           "limits" if problem.rule.startswith("limits.") else "form",
                                           problem.rule, problem.reason)
                await answer_then_drain(conn, refusal_bytes(refusal))
            else:
                self.gate.connection_refused(client, 0, problem.rule, problem.reason)
            return None
        except OSError:
            return None

    # ---- one exchange ---------------------------------------------------------------------------------

    async def _exchange(self, conn: socket.socket, client: str, request: PlainRequest, server: h11.Connection,
                        rest: bytes, upstream: Upstream | None
                        ) -> tuple[bool, bytes, Upstream | None]:
        """(keep the connection, bytes already read of the next request, the upstream connection kept)."""
        gate, loop = self.gate, asyncio.get_running_loop()
        accept = request.values("accept")
        ask = ask_of(request, client)
        started = time.monotonic()
        body_pending = bool(request.chunked or request.content_length)
        outcome = await gate.decide_request(ask, None)
        if outcome.refusal is not None:
            await self._refuse(conn, outcome.refusal, body_pending)
            return False, b"", upstream
        target, verdict = outcome.target, outcome.verdict
        assert target is not None  # an allowed request has its target
        up = 0
        charged = request.content_length or 0  # the declared body: charged to a session at admission
        relayed = Relayed()
        answered = False
        watch: ClientWatch | None = None
        # A chunked body's bytes are counted against the budget while they are held (given back once the
        # upstream took them, or however the exchange ends: the finally below).
        hold = gate.body_budget.hold(client)

        async def ended_early(answer: Refusal | None, error: str) -> None:
            """Every way an exchange ends before its response was relayed whole: the upstream connection closed;
            ``answer`` sent when nothing of a response reached the client yet; the closing record, with ``error``
            ("": the refusal that ended it is the flow's closing record already); and a body still coming read
            and dropped a moment first, since closing with it unread would reset the connection and destroy
            the answer (an early answer refused, a 101, garbage, an origin's reset)."""
            nonlocal upstream
            # A send that broke off (or still went on beside an early answer) returned no count: the body's
            # bytes so far are relayed.up, and bytes_up is what a session's request_bytes budget is charged.
            sent = max(up, relayed.up)
            if upstream is not None:
                upstream.close()
                upstream = None
            told = answer is not None and not answered
            if told:
                relayed.status = answer.status  # the record says what the client was answered
                with contextlib.suppress(OSError):
                    await loop.sock_sendall(conn, refusal_bytes(answer))
            if error:
                gate.response_closed(ask.flow_id, client, request.method, target, verdict, started, sent,
                                     relayed.down, relayed.status, error, charged)
            if told and server.their_state is h11.SEND_BODY:
                await answer_then_drain(conn, b"")

        try:
            if rest:  # h11 reads b"" as the client having closed: a body still to come would be "incomplete"
                server.receive_data(rest)
            body: list[bytes] = []
            if request.chunked:  # read whole and bounded before the upstream sees anything
                up = await self._read_chunked(conn, client, server, request, target, accept, body, ask.flow_id,
                                              hold, verdict.session)
                over = await gate.chunked_body_refusal(outcome.session, up)
                if over is not None:
                    await self._refuse_body(conn, client, request, target, accept, ask.flow_id, verdict.session,
                                            over[1], SESSION_STAGE, over[0].rule, over[0].reason, pending=False)
                charged = up  # charged to its session just now (Gate.chunked_body_refusal)
            pinned = verdict.pinned
            if pinned is None:
                raise Ended("no checked address to connect to")
            key = (target.host, pinned, target.port)
            if upstream is not None and not upstream.reusable_for(key):
                upstream.close()
                upstream = None
            refused = gate.guard(pinned, target.port)
            if refused:
                raise Ended(refused, self._connect_refusal(refused, verdict, target, accept))
            if upstream is None:
                sock, error = await connect_pinned(pinned, target.port, gate.policy.limits.connect_timeout)
                if sock is None:
                    raise Ended(error, self._connect_refusal(error, verdict, target, accept))
                upstream = Upstream(sock, key, h11.Connection(
                    h11.CLIENT, max_incomplete_event_size=gate.policy.limits.max_header_bytes))
            sending = self._send_request(conn, server, request, upstream, body, up, relayed)
            if body_pending:
                early, up = await self._early_response(sending, upstream)
                if early is not None:  # the origin answered before it had the whole body
                    try:
                        tail = await self._relay_response(conn, client, server, request, target, accept, upstream,
                                                          None, relayed, verdict.session)
                        answered = True
                    finally:
                        early.cancel()
                        await asyncio.gather(early, return_exceptions=True)  # its failure is the body's, unsent
                    up = relayed.up
                    gate.response_closed(ask.flow_id, client, request.method, target, verdict, started, up,
                                         relayed.down, relayed.status, None, charged)
                    upstream.close()  # neither connection is at a message's end: both end, the client answered
                    await answer_then_drain(conn, tail)
                    return False, b"", None
            else:
                up = await sending
            hold.release()  # the body is the upstream's now (_send_request dropped each piece it sent)
            watch = ClientWatch(conn, server.trailing_data[0], gate.policy.limits.max_header_bytes, upstream.sock)
            try:
                tail = await self._relay_response(conn, client, server, request, target, accept, upstream, watch,
                                                  relayed, verdict.session)
                answered = True
            finally:
                watch.stop()
            if watch.over:
                raise Ended(f"egresswall: {_pipelined_reason(gate.policy.limits.max_header_bytes)}")
        except (Ended, h11.LocalProtocolError) as failure:
            ended = failure if isinstance(failure, Ended) else Ended(f"egresswall cannot relay the response: "
                                                                     f"{failure}"[:300])
            if watch is not None and watch.over:  # the bound's own line, as on mitmproxy's path
                gate.connection_refused(client, 0, "limits.max_header_bytes",
                                        _pipelined_reason(gate.policy.limits.max_header_bytes))
            await ended_early(ended.answer, ended.error)
            return False, b"", None
        except asyncio.CancelledError:
            # A stop past its grace (Front.end_open): the record is written before the task goes.
            gate.response_closed(ask.flow_id, client, request.method, target, verdict, started, relayed.up,
                                 relayed.down, relayed.status, "cancelled", charged)
            if upstream is not None:
                upstream.close()
            raise
        except (OSError, TimeoutError) as err:
            error = f"the exchange failed: {getattr(err, 'strerror', None) or err}"
            # Nothing of a response reached the client (the origin reset the connection): it is told with a
            # 502, as mitmproxy's path tells it, not left with a reset.
            told = None if relayed.status is not None else self._connect_refusal(f"egresswall: {error}", verdict,
                                                                                 target, accept)
            await ended_early(told, error)
            return False, b"", None
        finally:  # every way out: sent, refused, reset, timed out, cancelled
            hold.release()
        gate.response_closed(ask.flow_id, client, request.method, target, verdict, started, up, relayed.down,
                             relayed.status, None, charged)
        assert watch is not None
        try:
            await send_while_moving(conn, tail, gate.policy.limits.idle_timeout, "")
        except (OSError, Ended):  # recorded already; the connection just ends
            watch.closed = True
        keep = server.states == {h11.CLIENT: h11.DONE, h11.SERVER: h11.DONE} and not watch.closed
        if upstream is not None and upstream.parser.states != {h11.CLIENT: h11.DONE, h11.SERVER: h11.DONE}:
            upstream.close()
            upstream = None
        return keep, bytes(watch.data), upstream

    async def _early_response(self, sending: Coroutine[None, None, int], upstream: Upstream
                              ) -> tuple[asyncio.Task[int] | None, int]:
        """Send the request (``sending``) while listening to the upstream (proxy/early_response.py): (None, the
        body's bytes) when it was all sent first, as nearly always; (the send, still going, 0) when the
        origin's final response began before."""
        listener = UpstreamListener(upstream.sock, upstream.parser, READ, self.gate.policy.limits.max_header_bytes)
        task = asyncio.ensure_future(sending)
        try:
            await asyncio.wait({task, listener.answered}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled: the send goes with it
            task.cancel()
            raise
        finally:
            listener.stop()
        if task.done() and not (listener.answered.done() and task.exception() is not None):
            return None, task.result()  # its failure is raised here, as without the listener
        # The answer began (the send may have failed in the same turn, the origin gone once it had answered:
        # what it sent is in the parser and is relayed).
        return task, 0

    def _connect_refusal(self, reason: str, verdict: Verdict, target: Target, accept: tuple[str, ...]) -> Refusal:
        return refusal_for(502, failed_connect(reason, verdict.role), target, accept)

    async def _read_chunked(self, conn: socket.socket, client: str, server: h11.Connection, request: PlainRequest,
                            target: Target, accept: tuple[str, ...], body: list[bytes], flow_id: str,
                            hold: BodyHold, session: str | None) -> int:
        """Read a chunked body whole into ``body`` (its data's size is returned), within
        limits.max_request_body counted on the wire bytes and the budget for buffered bodies (``hold``).

        The limit counts the body as sent — chunk size lines, extensions, line ends, data, the last chunk
        and the end — not its data alone: with only the data counted, a client sending one-byte chunks with
        long extensions (``1;aaaa...`` CRLF ``x`` CRLF again and again) streams bytes without end inside one
        request, each read and dropped. h11 does not say how many bytes it consumed, so the wire bytes are
        the bytes given to it: while the body has not ended (h11 needs data) every one of them is the
        body's, and it is checked there, at each read; at the end, what h11 left unread (the next request,
        pipelined) is taken off once."""
        limits = self.gate.policy.limits
        limit = limits.max_request_body
        fed = len(server.trailing_data[0])  # what came with the head, or was fed already (``rest``)
        size = 0
        while True:
            try:
                event = server.next_event()
            except h11.RemoteProtocolError as err:  # nothing went upstream yet: the client is told why
                if len(server.trailing_data[0]) > limits.max_header_bytes:
                    # h11 holds one unfinished line (a size with its extensions, or a trailer) longer than
                    # a head may be: said in egresswall's words, as mitmproxy's path says it.
                    reason = body_line_too_long_reason(limits.max_header_bytes)
                else:
                    reason = body_unparseable_reason(str(err))
                await self._refuse_body(conn, client, request, target, accept, flow_id, session, 400, "form",
                                        "http:bad-chunked", reason)
            if event is h11.NEED_DATA:
                if fed > limit:
                    await self._refuse_body(conn, client, request, target, accept, flow_id, session, 413, "limits",
                                            "limits.max_request_body", body_over_limit_reason(limit))
                chunk = await _body_bytes(conn, limits.idle_timeout)
                fed += len(chunk)
                server.receive_data(chunk)
            elif isinstance(event, h11.Data):
                if size + len(event.data) > limit:  # the data alone is over (its framing is more): decided now
                    body.clear()
                    await self._refuse_body(conn, client, request, target, accept, flow_id, session, 413, "limits",
                                            "limits.max_request_body", body_over_limit_reason(limit))
                refused = hold.add(len(event.data), limits)
                if refused is not None:
                    body.clear()
                    await self._refuse_body(conn, client, request, target, accept, flow_id, session, refused.status,
                                            "limits", refused.rule, refused.reason)
                size += len(event.data)
                body.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                if fed > limit and fed - len(server.trailing_data[0]) > limit:
                    await self._refuse_body(conn, client, request, target, accept, flow_id, session, 413, "limits",
                                            "limits.max_request_body", body_over_limit_reason(limit), pending=False)
                if event.headers:
                    refusal = self.gate.refuse(client, request.method, target, 400, "form", "http:trailers",
                                               TRAILERS_REASON, flow_id=flow_id, event="response", accept=accept,
                                               session=session)
                    await self._refuse(conn, refusal, False)
                    raise Ended("")
                return size

    async def _refuse_body(self, conn: socket.socket, client: str, request: PlainRequest, target: Target,
                           accept: tuple[str, ...], flow_id: str, session: str | None, status: int, stage: str,
                           rule: str, reason: str, pending: bool = True) -> NoReturn:
        """A chunked body refused while it is read: the refusal is the flow's closing record (the session's,
        when the request was admitted under one), sent (the rest of the body read and dropped for a moment
        when ``pending``), and the exchange ends."""
        refusal = self.gate.refuse(client, request.method, target, status, stage, rule, reason, flow_id=flow_id,
                                   event="response", accept=accept, session=session)
        await self._refuse(conn, refusal, pending)
        raise Ended("")  # the refusal is sent and recorded: nothing more for this flow

    async def _client_event(self, conn: socket.socket, server: h11.Connection, flush: Upstream | None = None,
                            out: bytearray | None = None):
        """The next event of the client's request body; reading is bounded by limits.idle_timeout. Before
        waiting for more, what is in ``out`` is sent to ``flush`` (a streamed body's bytes so far)."""
        while True:
            try:
                event = server.next_event()
            except h11.RemoteProtocolError as err:
                raise UnreadableBody(f"the request body cannot be parsed: {err}"[:300]) from None
            if event is not h11.NEED_DATA:
                return event
            idle = self.gate.policy.limits.idle_timeout
            if flush is not None and out:
                await send_while_moving(flush.sock, bytes(out), idle, _upstream_stalled(idle))
                out.clear()
            server.receive_data(await _body_bytes(conn, idle))

    async def _send_request(self, conn: socket.socket, server: h11.Connection, request: PlainRequest,
                            upstream: Upstream, body: list[bytes], up: int, relayed: Relayed) -> int:
        """The head, then the body: a chunked one read already, a Content-Length one as it arrives (each
        piece sent before waiting for the next). Returns the body's bytes."""
        idle = self.gate.policy.limits.idle_timeout
        relayed.up = up  # a chunked body's, read already
        out = bytearray(upstream.parser.send(h11.Request(method=request.method, target=request.path,
                                                         headers=_forwarded_request_headers(request))))
        if request.chunked:
            # Sent a read's worth at a time, each piece dropped once framed: the body is never held twice.
            for index, piece in enumerate(body):
                out += upstream.parser.send(h11.Data(data=piece))
                body[index] = b""
                if len(out) >= READ:
                    await send_while_moving(upstream.sock, bytes(out), idle, _upstream_stalled(idle))
                    out.clear()
            body.clear()
        else:
            while True:
                event = await self._client_event(conn, server, upstream, out)
                if isinstance(event, h11.EndOfMessage):
                    break
                if isinstance(event, h11.Data):
                    up += len(event.data)
                    relayed.up = up
                    out += upstream.parser.send(h11.Data(data=event.data))
        out += upstream.parser.send(h11.EndOfMessage())
        await send_while_moving(upstream.sock, bytes(out), idle, _upstream_stalled(idle))
        return up

    async def _relay_response(self, conn: socket.socket, client: str, server: h11.Connection,
                              request: PlainRequest, target: Target, accept: tuple[str, ...], upstream: Upstream,
                              watch: ClientWatch | None, relayed: Relayed, session: str | None) -> bytes:
        """The origin's response, parsed by h11 and re-framed for the client; returns its last bytes, not yet
        sent. Its status and body bytes are kept in ``relayed`` as they come, so that a response that breaks
        off is recorded with what the client was sent of it. ``session``: the request's (its refusal here
        names it)."""
        loop = asyncio.get_running_loop()
        limits = self.gate.policy.limits
        parser = upstream.parser
        head_started: float | None = None
        seen = b""  # the response's first bytes, to name a 101 h11 refuses
        out = b""
        # Bytes given to h11 and not yet taken by a head: h11 bounds only a head it has not seen the end of
        # (max_incomplete_event_size), so a head that came whole in one read or two passed at up to twice
        # limits.max_header_bytes. Each head (an interim one too) is bounded as mitmproxy's path bounds it.
        unread = len(parser.trailing_data[0])
        # The same bytes, kept while no final head has come: h11 merges "Content-Length: 5, 5" and two equal
        # Content-Length lines into one, which mitmproxy's path refuses (502); the raw head says which it was.
        raw = bytes(parser.trailing_data[0])
        while True:
            try:
                event = parser.next_event()
            except h11.RemoteProtocolError as err:
                # An unasked 101 is h11's "_SWITCH_UPGRADE event without a pending proposal", at the start or
                # after an interim response (a 103 and then a 101 was refused as unparseable, in h11's words,
                # where mitmproxy's path names the unasked upgrade).
                if relayed.status is None and (_SWITCHING.match(seen) or _UNASKED_SWITCH in str(err)):
                    refusal = self.gate.refuse(client, request.method, target, 502, "http",
                                               "http:unrequested-upgrade", "the upstream answered 101 Switching "
                                               "Protocols to a request that was not an allowed WebSocket upgrade",
                                               accept=accept, session=session)
                    raise Ended("", refusal) from None
                if relayed.status is None:
                    if "too long" in str(err).lower() or len(seen) > limits.max_header_bytes:
                        reason = answered = (f"egresswall: the upstream response head is over "
                                             f"{limits.max_header_bytes} bytes (limits.max_header_bytes)")
                    else:
                        # h11's words quote the upstream's bytes: the record keeps them, the client's answer
                        # does not (no upstream text in a refusal; mitmproxy's path answers the same).
                        reason = f"egresswall: the upstream response cannot be parsed: {err}"[:300]
                        answered = UNRELAYABLE_RESPONSE
                    raise _not_relayed(reason, target, accept, answered) from None
                # What h11 read before the break is the client's (as on mitmproxy's path, which streams it):
                # the head and the body so far, and then the close, which tells the client it is cut short.
                with contextlib.suppress(OSError, Ended):
                    await send_while_moving(conn, out, limits.idle_timeout, "")
                raise Ended(f"the upstream response broke off: {err}"[:300]) from None
            if event is h11.NEED_DATA:
                if out:
                    await send_while_moving(conn, out, limits.idle_timeout, _client_stalled(limits.idle_timeout))
                    out = b""
                timeout = limits.idle_timeout
                if head_started is not None and relayed.status is None:
                    timeout = min(timeout, head_started + limits.header_timeout - time.monotonic())
                try:
                    chunk = await asyncio.wait_for(loop.sock_recv(upstream.sock, READ), max(0.0, timeout))
                except TimeoutError:
                    if head_started is not None and relayed.status is None:
                        reason = (f"egresswall: the upstream response head took more than {limits.header_timeout:g}s "
                                  "(limits.header_timeout)")
                        raise _not_relayed(reason, target, accept) from None
                    what = "sent no response" if relayed.status is None else "stopped sending its response"
                    raise Ended(f"nothing moved for limits.idle_timeout ({limits.idle_timeout:g}s): the upstream "
                                f"{what}, and egresswall closed the connection") from None
                if watch is not None and watch.over:
                    raise Ended(f"egresswall: {_pipelined_reason(limits.max_header_bytes)}")
                if relayed.status is None:
                    if head_started is None and chunk:
                        head_started = time.monotonic()
                    if len(seen) < 64:
                        seen += chunk[:64]
                if not chunk and relayed.status is None:
                    reason = "the upstream closed the connection without a response"
                    raise _not_relayed(reason, target, accept)
                parser.receive_data(chunk)
                unread += len(chunk)
                if relayed.status is None:
                    raw += chunk
                continue
            if isinstance(event, (h11.InformationalResponse, h11.Response)):
                left = len(parser.trailing_data[0])
                if unread - left - len(b"\r\n\r\n") > limits.max_header_bytes:
                    reason = (f"egresswall: the upstream response head is over {limits.max_header_bytes} bytes "
                              "(limits.max_header_bytes)")
                    raise _not_relayed(reason, target, accept)
                head, raw = raw[:unread - left], raw[unread - left:]
                unread = left
                problem = _length_problem(head) if isinstance(event, h11.Response) else None
                if problem is not None:
                    raise _not_relayed(f"egresswall: the upstream response's {problem}", target, accept)
            if isinstance(event, h11.InformationalResponse):
                continue  # a 1xx other than 101 (h11 refuses an unasked 101): not passed on, the final one follows
            if isinstance(event, h11.Response):
                bad = _control_byte(event)
                if bad is not None:
                    raise _not_relayed(bad, target, accept, UNRELAYABLE_RESPONSE)
                names = {k.lower() for k, _ in event.headers.raw_items()}
                if {b"transfer-encoding", b"content-length"} <= names:
                    # RFC 9112 6.3: a sender must not send both; one reading is as good as the other for a
                    # smuggler, so neither is relayed (mitmproxy's path refuses it the same way).
                    reason = ("egresswall: the upstream response has both Transfer-Encoding and Content-Length; "
                              "egresswall does not relay a response it could read two ways")
                    raise _not_relayed(reason, target, accept)
                status = relayed.status = event.status_code
                out += server.send(h11.Response(status_code=status, reason=event.reason,
                                                headers=_forwarded_response_headers(event.headers.raw_items(), status)))
            elif isinstance(event, h11.Data):
                relayed.down += len(event.data)
                out += server.send(h11.Data(data=event.data))
            elif isinstance(event, h11.EndOfMessage):
                # The last bytes are the caller's to send, after the response record is written: a client
                # that has its whole answer may look at the audit log at once.
                return out + server.send(h11.EndOfMessage())
            elif isinstance(event, h11.ConnectionClosed):
                raise Ended("the upstream closed the connection mid-response")

    async def _refuse(self, conn: socket.socket, refusal: Refusal, body_pending: bool) -> None:
        """Send a refusal (its record is written) before the connection is closed; a body still coming is
        read and dropped for a moment first (``answer_then_drain``)."""
        if body_pending:
            await answer_then_drain(conn, refusal_bytes(refusal))
            return
        with contextlib.suppress(OSError):
            await asyncio.get_running_loop().sock_sendall(conn, refusal_bytes(refusal))


async def send_while_moving(sock: socket.socket, data: bytes, idle: float, stalled: str) -> None:
    """``sock.sendall(data)``, but a peer that takes nothing for ``idle`` seconds ends the exchange
    (``Ended(stalled)``): ``loop.sock_sendall`` waits forever for a reader that never reads, which would
    hold the client's connection and the upstream one past limits.idle_timeout (mitmproxy's watchdog
    closes such a connection). A slow reader that keeps taking bytes is not cut off."""
    loop = asyncio.get_running_loop()
    view = memoryview(data)
    while view:
        try:
            sent = sock.send(view)
        except (BlockingIOError, InterruptedError):
            sent = 0
        if sent:
            view = view[sent:]
            continue
        writable = loop.create_future()
        loop.add_writer(sock.fileno(), lambda ready=writable: ready.done() or ready.set_result(None))
        try:
            await asyncio.wait_for(writable, idle)
        except TimeoutError:
            raise Ended(stalled) from None
        finally:
            loop.remove_writer(sock.fileno())


_LENGTH_LINE = re.compile(rb"\ncontent-length[ \t]*:([^\r\n]*)", re.IGNORECASE)  # after CRLF or a bare LF


def _control_byte(response: h11.Response) -> str | None:
    """Why a response head with a control byte other than HTAB in its status line or a header value is not
    relayed (None: it has none). h11 reads any byte but CR and LF in a reason phrase, and any but NUL and
    whitespace in a value (0x01-0x08, 0x0e-0x1f, 0x7f go through): refused, as on mitmproxy's path
    (``mitm_patches._read_response_head``), since a client may end a line at one. The byte is named, not
    quoted. (Names are tokens: h11 refuses any other byte there.)"""
    items = response.headers.raw_items()
    # One search over them all joined by HTAB (allowed), on the path of every response; which one, only on a hit.
    if CONTROL_BYTE.search(b"\t".join([response.reason, *(value for _, value in items)])) is None:
        return None
    lines = [("status line", response.reason)] + [(f"header {name.decode('ascii')!r}", value) for name, value in items]
    for what, text in lines:
        bad = CONTROL_BYTE.search(text)
        if bad is not None:
            return (f"egresswall: the upstream response's {what} has the control byte 0x{text[bad.start()]:02x} "
                    "(only HTAB may be in one)")
    return None


def _length_problem(head: bytes) -> str | None:
    """What mitmproxy's path refuses (502) in a response head's Content-Length as sent, which h11 reads leniently:
    two lines or a list ("5, 5": h11 merges them), a leading zero or a sign ("005" is 5 to h11, relayed as sent)."""
    values = [value.strip(b" \t") for value in _LENGTH_LINE.findall(head)]
    if len(values) > 1 or any(b"," in value for value in values):
        return ("Content-Length is given more than once (or as a list); egresswall does not relay a response it "
                "could read two ways")
    if any(_LENGTH.fullmatch(value) is None for value in values):
        return "Content-Length is not digits without a leading zero"
    if any(len(value) > 19 or int(value) > MAX_CONTENT_LENGTH for value in values):
        return f"Content-Length is over {MAX_CONTENT_LENGTH} (a client reading it into 64 bits could wrap it)"
    return None


def ask_of(request: PlainRequest, client: str) -> HttpAsk:
    """What the gate decides on: the fields the mitmproxy addon (proxy/addons/decision.py) fills from
    mitmproxy's parse, filled here from the fast path's."""
    return HttpAsk(client=client, method=request.method, scheme="http", host=request.host, port=request.port,
                   path=request.path, host_header=request.values("host")[0], content_length=request.content_length,
                   chunked=request.chunked, accept=request.values("accept"), authority=request.authority,
                   credentials=request.values("proxy-authorization"),
                   overrides=override_headers(name for name, _ in request.headers), head_size=request.size)


def _forwarded_request_headers(request: PlainRequest) -> list[tuple[str, str]]:
    """The client's headers minus the hop-by-hop ones and Proxy-Authorization (RFC 9110 7.6.1); the
    framing header stays (h11 frames the body by it). A client that asked to close says so upstream."""
    dropped = hop_by_hop_names(request.values("connection"))
    headers = [(k, v) for k, v in request.headers if k.lower() not in dropped]
    connection = tokens(request.values("connection"))
    if "close" in connection or (request.version == "1.0" and "keep-alive" not in connection):
        headers.append(("Connection", "close"))
    return headers


def _forwarded_response_headers(raw: list[tuple[bytes, bytes]], status: int) -> list[tuple[bytes, bytes]]:
    """The origin's headers minus hop-by-hop ones, framing (h11 re-frames the body) when it was chunked
    or the status is 204, and every header only egresswall may set. (A response with both framings never
    gets here.) A 204 has no body whatever its headers say (RFC 9110 8.6: it must not carry a
    Content-Length), and a client that believed one would read the next response's first bytes as its body."""
    connection = [v.decode("latin-1") for k, v in raw if k.lower() == b"connection"]
    dropped = {n.encode("latin-1") for n in _RESPONSE_DROPPED | set(tokens(connection))} - {b"content-length"}
    chunked = any(k.lower() == b"transfer-encoding" for k, _ in raw)
    own = OWN_HEADER_PREFIX.encode()
    return [(k, v) for k, v in raw if (name := k.lower()) not in dropped and not name.startswith(own)
            and not ((chunked or status == 204) and name == b"content-length")]


async def _body_bytes(conn: socket.socket, idle: float) -> bytes:
    """The client's next bytes of a request body, within limits.idle_timeout; Ended when none come."""
    try:
        chunk = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(conn, READ), idle)
    except TimeoutError:
        raise Ended(f"nothing moved for limits.idle_timeout ({idle:g}s) into the request body, and "
                    "egresswall closed the connection") from None
    if not chunk:
        raise Ended("the client closed the connection before its request body was complete")
    return chunk


def _not_relayed(error: str, target: Target, accept: tuple[str, ...], answer: str | None = None) -> Ended:
    """An upstream response egresswall does not relay: ``error`` for the record, and the client's 502 saying
    ``answer`` (``error`` itself unless it quotes the upstream's bytes)."""
    answer = error if answer is None else answer
    return Ended(error, refusal_for(502, failed_connect(answer), target, accept))

def _client_stalled(idle: float) -> str:
    return (f"nothing moved for limits.idle_timeout ({idle:g}s): the client stopped reading its response, and "
            "egresswall closed the connection")


def _upstream_stalled(idle: float) -> str:
    return (f"nothing moved for limits.idle_timeout ({idle:g}s): the upstream stopped reading the request, and "
            "egresswall closed the connection")


def _pipelined_reason(limit: int) -> str:
    return (f"the client sent more than {limit} bytes (limits.max_header_bytes) after a request that is still "
            "waiting for its response; they would only be buffered")
