"""The front: egresswall's public listener, and the fast relay for passed-through TLS tunnels and plain HTTP.

Every connection of ``egresswall run`` is accepted here. The front admits it (connection caps, at
accept), bounds its first request head (``limits.first_byte_timeout`` for a connection that sends
nothing, ``limits.header_timeout`` from the first byte, ``limits.max_header_bytes``), and then either

* relays it itself: a ``CONNECT`` to a host that is not intercepted, on a port that is not a
  plain-HTTP port — the shape nearly all of a browser's traffic has — decided by the gate, connected
  to the pinned address (or, when the policy names an upstream proxy, through a CONNECT to it:
  ``proxy/upstream_connect.py``), its ClientHello judged whole by the gate (and a second one, should
  the server answer with a HelloRetryRequest: ``proxy/tls_retry.py``), then copied socket to
  socket with counted bytes, without mitmproxy's per-chunk event machinery (``relay_tunnels``, the
  default); or a plain-HTTP request the fast path takes (``proxy/fast_http.py``: strict framing, no
  upgrade, not intercepted, no upstream proxy), and the kept-alive requests after it (``relay_http``,
  the default); or
* hands it to mitmproxy with the bytes it has read put back in front (a plain-HTTP head the fast path
  does not take, WebSocket over CONNECT to port 80, intercepted hosts, anything the front does not
  take), exactly as if mitmproxy had accepted it; the connection keeps its admission. The fast path
  hands a kept-alive connection over the same way, at the first request it does not take.

Every decision, refusal and record is the gate's: the two paths differ only in who copies the bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import uuid
from collections.abc import Callable

import h11

from policy.hosts import HostFormError, Target, parse_authority, parse_url

from .admission import CapRefusal
from .dial import connect_pinned
from .fast_http import FastHttp
from .first_bytes import FirstBytes
from .gate import Gate, Tunnel, refusal_for
from .head_reader import HeadProblem, answer_then_drain, read_head
from .open_files import connections_held, soft_limit
from .peers import client_key
from .refusals import failed_connect, refusal_bytes
from .tls_hello import MAX_HELLO_BYTES
from .tls_retry import RetryWatch
from .tunnel_relay import DOWN, UP, relay
from .upstream_connect import connect_via_upstream

HALF_CLOSED_IDLE = 5.0  # once one side has finished, the other gets this long of silence before the tunnel ends
log = logging.getLogger("egresswall.front")
OVER_CAP_WAIT = 2.0  # how long a connection refused by a cap may take to say where it wanted to go
MAX_OVER_CAP_PENDING = 256  # beyond this many at once, refused connections are closed unheard (fds are finite)
# (the socket, the bytes already read, ``done``): mitmproxy takes the connection; ``done`` gives its admission
# back and must be called once, when mitmproxy has finished with it (or could not take it).
Handoff = Callable[[socket.socket, bytes, Callable[[], None]], None]


class Front:
    def __init__(self, gate: Gate, handoff: Handoff, relay_tunnels: bool = True,
                 upstream_authorization: str | None = None, relay_http: bool = False) -> None:
        self.gate = gate
        self.handoff = handoff
        self.relay_tunnels = relay_tunnels
        self.fast_http = FastHttp(gate) if relay_http else None  # plain HTTP (proxy/fast_http.py)
        self.upstream_authorization = upstream_authorization  # Proxy-Authorization for the policy's upstream
        self.listener: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._over_cap_pending = 0
        self._open: set[socket.socket] = set()  # client connections served here, not handed to mitmproxy
        self._serving: set[asyncio.Task] = set()  # their tasks

    async def start(self, host: str, port: int, reuse_port: bool = False) -> tuple[str, int]:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            listener.bind((host, port))
            listener.listen(1024)
        except OSError:
            listener.close()
            raise
        listener.setblocking(False)
        self.listener = listener
        self._accepting = asyncio.get_running_loop().create_task(self._accept_loop())
        return listener.getsockname()[:2]

    def cut_open(self) -> None:
        """A stop's end of the grace period: shut every client connection still served here, so that each
        tunnel's and exchange's loop ends and writes its closing record before the process goes."""
        for conn in list(self._open):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    async def end_open(self, timeout: float) -> None:
        """A stop, after ``cut_open``: what has still not ended (a connect that hangs, an exchange waiting on its
        origin) is cancelled, and each writes its record as it goes (error: egresswall stopped)."""
        tasks = list(self._serving)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    def stop_accepting(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while self.listener is not None:
            try:
                conn, _ = await loop.sock_accept(self.listener)
            except OSError:
                await asyncio.sleep(0.05)  # EMFILE and friends: back off instead of spinning
                continue
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = loop.create_task(self._serve(conn))
            self._serving.add(task)
            task.add_done_callback(self._serving.discard)

    # ---- one connection -----------------------------------------------------------------------

    async def _serve(self, conn: socket.socket) -> None:
        try:
            peer = conn.getpeername()
        except OSError:  # reset before we looked
            conn.close()
            return
        client = client_key(peer[0])
        cap = self.gate.admit(client, conn.fileno())
        if cap is not None:
            await self._refuse_over_cap(conn, client, cap)
            return
        handed_off = False
        self._open.add(conn)
        try:
            try:
                head, rest = await self._read_head(conn)
            except HeadProblem as problem:
                if problem.status:
                    await answer_then_drain(conn, refusal_bytes(self.gate.refuse(client, None, None, problem.status,
                                                                                 _stage(problem.rule), problem.rule,
                                                                                 problem.reason)))
                else:
                    self.gate.connection_refused(client, 0, problem.rule, problem.reason)
                return
            def hand_over(sock: socket.socket, data: bytes) -> None:
                # The admission goes with the connection and comes back when mitmproxy has finished with
                # it: passed along, not matched up again by peer address (read after a reset, there is none).
                nonlocal handed_off
                handed_off = True
                self._open.discard(conn)
                self.handoff(sock, data, _once(lambda: self.gate.release(client)))

            if self.fast_http is not None and not head.startswith(b"CONNECT "):
                await self.fast_http.serve(conn, client, head, rest, hand_over)
                return
            method, raw_target, event = _parse_head(head)  # parsed once: a tunnel's setup is mostly overhead
            authority = raw_target if method == "CONNECT" else None
            target = _target(authority) if authority else None
            policy = self.gate.policy
            if (not self.relay_tunnels or target is None or target.port in policy.http_ports
                    or policy.intercepts(target.host)
                    or _header_values(event, b"transfer-encoding") or _header_values(event, b"content-length")):
                # Not ours to relay (or a malformed authority, which mitmproxy's path refuses with its reason; or
                # a CONNECT with framing headers, which it judges with its own parser: h11 merged
                # "Content-Length: 0" twice into one, which mitmproxy's parser refuses).
                hand_over(conn, head + rest)
                return
            await self._tunnel(conn, client, authority, rest, _header_values(event, b"accept"),
                               _header_values(event, b"proxy-authorization"))
        except (OSError, TimeoutError, asyncio.IncompleteReadError):
            pass
        except Exception as err:  # noqa: BLE001 - a bug of ours: the connection is closed, never relayed undecided
            log.exception("a connection from %s failed inside egresswall; closed", client)
            with contextlib.suppress(Exception):
                self.gate.internal_error(client, err, status=0)
        finally:
            self._open.discard(conn)
            if not handed_off:
                self.gate.release(client)
                conn.close()

    async def _read_head(self, conn: socket.socket, first_byte: float | None = None,
                         header: float | None = None) -> tuple[bytes, bytes]:
        """The first request head and whatever came after it; HeadProblem when a bound is passed."""
        return await read_head(conn, self.gate.policy.limits, first_byte, header)

    async def _refuse_over_cap(self, conn: socket.socket, client: str, cap: CapRefusal) -> None:
        """Refused at accept. Given a moment (bounded, and only for a bounded number of such
        connections) to say where it wanted to go, so the record names the host and port."""
        method = target = url = None
        accept: tuple[str, ...] = ()
        try:
            if self._over_cap_pending < min(MAX_OVER_CAP_PENDING, connections_held(soft_limit()) // 4):  # fds too
                self._over_cap_pending += 1
                try:
                    head, _ = await self._read_head(conn, OVER_CAP_WAIT, OVER_CAP_WAIT)
                    method, target, url = _request_of(head)
                    accept = _accept_of(head)
                except (HeadProblem, OSError):
                    pass
                finally:
                    self._over_cap_pending -= 1
            refusal = self.gate.refuse_admission(client, cap, method, target, url, accept)
            with contextlib.suppress(OSError):
                await _send(conn, refusal_bytes(refusal))
        finally:
            conn.close()

    # ---- the fast tunnel ----------------------------------------------------------------------

    async def _tunnel(self, conn: socket.socket, client: str, authority: str, rest: bytes,
                      accept: tuple[str, ...] = (), credentials: tuple[str, ...] = ()) -> None:
        gate, loop = self.gate, asyncio.get_running_loop()
        outcome = await gate.decide_connect(client, authority, uuid.uuid4().hex, accept, credentials)
        if outcome.refusal is not None:
            await _send(conn, refusal_bytes(outcome.refusal))
            return
        tunnel = outcome.tunnel
        assert tunnel is not None and tunnel.verdict.pinned is not None
        tunnel.cut = lambda: _shut(conn)  # until the relay's own: a session's end reaches a tunnel not yet relaying
        upstream: socket.socket | None = None
        try:
            port = tunnel.target.port
            via = gate.policy.upstream
            refused = gate.guard(tunnel.verdict.pinned, port) if via is None else gate.guard_upstream(via.host,
                                                                                                      via.port)
            if refused:
                await self._connect_failed(conn, tunnel, refused, accept, via_upstream=via is not None)
                return
            if via is None:
                upstream, error = await connect_pinned(tunnel.verdict.pinned, port, gate.policy.limits.connect_timeout)
                recorded = error
            else:  # decided on egresswall's resolution; the upstream connects, resolving the name itself
                upstream, error, recorded = await connect_via_upstream(
                    via, tunnel.target, self.upstream_authorization, gate.policy.limits.connect_timeout, gate.is_self)
            if upstream is None:
                await self._connect_failed(conn, tunnel, error, accept, recorded, via is not None)
                return
            gate.metrics.fast_tunnel()
            await _send(conn, b"HTTP/1.1 200 Connection established\r\n\r\n")
            # Empty lines that came with the CONNECT head are dropped, as mitmproxy's path drops them (its
            # Http1Server.make_pipe): what follows must still be a whole ClientHello.
            first = await self._first_message(conn, tunnel, rest.lstrip(b"\r\n"))
            if first is None:
                return
            data, judged = first
            if tunnel.allowance is not None and not tunnel.allowance.take(UP, len(data)):
                return  # past its session's byte budget: none of it goes upstream (the gate's refusal ends it)
            # The ClientHello goes on; what the client sent after it waits until the server's first answer
            # shows whether it asks for a second ClientHello (proxy/tls_retry.py).
            await loop.sock_sendall(upstream, data[:judged.hello_size])
            await self._relay(conn, upstream, tunnel, len(data), gate.retry_watch(judged, data[judged.hello_size:]))
        except (OSError, TimeoutError) as err:
            gate.tunnel_closed(tunnel, 0, 0, f"the tunnel failed: {getattr(err, 'strerror', None) or err}")
        finally:
            gate.tunnel_closed(tunnel, 0, 0, "the tunnel ended")  # no-op when it already has its line
            if upstream is not None:
                upstream.close()

    async def _connect_failed(self, conn: socket.socket, tunnel: Tunnel, reason: str,
                              accept: tuple[str, ...] = (), recorded: str | None = None,
                              via_upstream: bool = False) -> None:
        """Answer 502 with ``reason``; the tunnel's record gets ``recorded`` (which may quote an upstream proxy's
        answer). Through an upstream proxy the rule is ``connect:upstream``: its hint names the upstream."""
        verdict = failed_connect(reason, tunnel.verdict.role, via_upstream)
        self.gate.tunnel_closed(tunnel, 0, 0, f"connect failed: {recorded or reason}", 502)  # 502, not 200
        await _send(conn, refusal_bytes(refusal_for(502, verdict, tunnel.target, accept)))

    async def _first_message(self, conn: socket.socket, tunnel: Tunnel, data: bytes) -> tuple[bytes, FirstBytes] | None:
        """The whole ClientHello (and what came after it), judged by the gate, within limits.header_timeout of
        the 200. ``data``: what came after the CONNECT head; each read after it is fed to the gate once."""
        loop = asyncio.get_running_loop()
        timeout = self.gate.policy.limits.header_timeout
        deadline = loop.time() + timeout
        first = self.gate.first_message(tunnel)  # this tunnel's bytes so far, and where judging them stopped
        chunk = data
        while True:
            judged = self.gate.tunnel_start(tunnel, first, chunk)
            if judged.refused:
                if judged.answer:  # a TLS alert, or the answer to a refused request head
                    with contextlib.suppress(OSError):
                        await _send(conn, judged.answer)
                return None
            if not judged.need_more:
                return bytes(first.data), judged
            try:
                chunk = await asyncio.wait_for(loop.sock_recv(conn, MAX_HELLO_BYTES),
                                               max(0.0, deadline - loop.time()))
            except TimeoutError:
                self.gate.tunnel_start_timed_out(tunnel, len(first.data))
                return None
            if not chunk:
                self.gate.tunnel_cut_short(tunnel, len(first.data))
                return None

    async def _relay(self, conn: socket.socket, upstream: socket.socket, tunnel: Tunnel, sent: int,
                     retry: RetryWatch) -> None:
        limits = self.gate.policy.limits

        def refused(rule: str, reason: str, up: int, down: int) -> None:
            self.gate.refuse_tunnel(tunnel, rule, reason, up, down)

        def cut() -> None:  # the session ended: both sides see the end at once, and the relay returns
            for sock in (conn, upstream):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

        counts = {UP: 0, DOWN: 0}
        tunnel.cut, tunnel.moved = cut, lambda: (counts[UP], counts[DOWN])
        result = await relay(conn, upstream, limits.idle_timeout, HALF_CLOSED_IDLE, sent, retry, limits.header_timeout,
                             refused, counts, tunnel.allowance)
        self.gate.tunnel_closed(tunnel, result.up, result.down, result.error)


def _parse_head(head: bytes) -> tuple[str | None, str | None, h11.Request | None]:
    parser = h11.Connection(h11.SERVER)
    try:
        parser.receive_data(head)
        event = parser.next_event()
    except h11.RemoteProtocolError:
        return None, None, None  # mitmproxy's parser judges it, with its own reason
    if not isinstance(event, h11.Request):
        return None, None, None
    try:
        return event.method.decode("ascii"), event.target.decode("ascii"), event
    except UnicodeDecodeError:
        return None, None, None


def _accept_of(head: bytes) -> tuple[str, ...]:
    """The Accept header values of a head as h11 parsed them (latin-1, as sent); () when it did not parse."""
    return _header_values(_parse_head(head)[2], b"accept")


def _header_values(event: h11.Request | None, name: bytes) -> tuple[str, ...]:
    """One header's values (lower-case ``name``) as h11 parsed them, latin-1; () when the head did not parse."""
    if event is None:
        return ()
    return tuple(value.decode("latin-1") for key, value in event.headers if key == name)


def _request_of(head: bytes) -> tuple[str | None, Target | None, str | None]:
    """(method, target, url) of a head, for the record of a connection refused by a cap."""
    method, raw, _ = _parse_head(head)
    if method is None or raw is None:
        return None, None, None
    try:
        target = parse_authority(raw, "https") if method == "CONNECT" else parse_url(raw)
    except HostFormError:
        return method, None, raw
    return method, target, None


def _target(authority: str) -> Target | None:
    try:
        return parse_authority(authority, "https")
    except HostFormError:
        return None


def _shut(sock: socket.socket) -> None:
    """End a connection both ways now (its reader sees the end; closing is its owner's)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _once(action: Callable[[], None]) -> Callable[[], None]:
    """``action``, run the first time the result is called and never again."""
    pending = [action]

    def run() -> None:
        if pending:
            pending.pop()()
    return run


def _stage(rule: str) -> str:
    return "limits" if rule.startswith("limits.") else "form"


async def _send(sock: socket.socket, data: bytes) -> None:
    await asyncio.get_running_loop().sock_sendall(sock, data)
