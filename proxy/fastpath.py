"""The fast path for passed-through TLS tunnels: the shape nearly all of a browser's traffic has.

egresswall's public listener is this front. It peeks at a new connection's first request head
without consuming it. A ``CONNECT`` to a host that is not intercepted, on a port that is not a
plain-HTTP port, is decided here with the same ``EgressWall.decide`` (same policy, resolver,
self-listener check, caps, audit), connected to the pinned address, checked for an SNI that names
the CONNECT host, and then relayed socket to socket with counted bytes — without mitmproxy's
per-chunk event machinery. Everything else (plain HTTP, WebSocket over CONNECT to port 80,
intercepted hosts, anything this parser does not take) is handed, unread, to mitmproxy's own
connection handler, exactly as if mitmproxy had accepted it.

What differs from the mitmproxy path, on purpose: a tunnel whose first bytes are not a TLS
ClientHello is closed (a plain-text protocol inside CONNECT to a TLS port is refused, not parsed).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import uuid
from collections.abc import Callable
from types import SimpleNamespace

from mitmproxy.net.http.http1.assemble import assemble_response
from mitmproxy.net.tls import starts_like_tls_record
from mitmproxy.proxy.layers.tls import parse_client_hello

from policy.decision import Request, Verdict
from policy.hosts import HostFormError, parse_authority

from . import refusals
from .addon import EgressWall, Tunnel
from .tunnels import TLS_ALERT_UNRECOGNIZED_NAME

MAX_HEAD = 8192  # a CONNECT head is a few hundred bytes; a longer one goes to mitmproxy's bounded parser
MAX_HELLO = 16 * 1024 + 5  # one TLS record
RELAY_CHUNK = 256 * 1024
Handoff = Callable[[socket.socket], None]


class FastFront:
    def __init__(self, addon: EgressWall, handoff: Handoff) -> None:
        self.addon = addon
        self.handoff = handoff
        self.listener: socket.socket | None = None
        self._accepting: asyncio.Task | None = None

    async def start(self, host: str, port: int, reuse_port: bool = False) -> tuple[str, int]:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        listener.bind((host, port))
        listener.listen(1024)
        listener.setblocking(False)
        self.listener = listener
        self._accepting = asyncio.get_running_loop().create_task(self._accept_loop())
        return listener.getsockname()[:2]

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
            loop.create_task(self._serve(conn))

    # ---- one connection -----------------------------------------------------------------------

    async def _serve(self, conn: socket.socket) -> None:
        # Counted from accept, so caps see connections that have not sent a byte yet; a connection
        # handed to mitmproxy is counted there instead (its client_connected hook).
        try:
            client_ip = _client_ip(conn)
        except OSError:  # reset before we looked
            conn.close()
            return
        self._count(client_ip, +1)
        handed_off = False
        try:
            head = await self._peek_head(conn)
            parsed = _parse_connect(head) if head else None
            target = _target(parsed[0]) if parsed else None
            policy = self.addon.policy
            if target is None or target.port in policy.http_ports or policy.intercepts(target.host):
                # Not ours (or a malformed authority, which mitmproxy's path refuses with its reason).
                self._count(client_ip, -1)
                handed_off = True
                self.handoff(conn)
                return
            await self._tunnel(conn, client_ip, target, parsed[1])
        except (OSError, TimeoutError, asyncio.IncompleteReadError):
            pass
        finally:
            if not handed_off:
                self._count(client_ip, -1)
                conn.close()

    def _count(self, client_ip: str, delta: int) -> None:
        addon = self.addon
        addon.open_connections += delta
        addon.per_client[client_ip] += delta
        if addon.per_client[client_ip] <= 0:
            del addon.per_client[client_ip]
        addon.metrics.open_connections = addon.open_connections

    async def _peek_head(self, conn: socket.socket) -> bytes:
        """The first request head, left in the socket for whoever handles the connection.

        Readiness is level-triggered and MSG_PEEK leaves the bytes queued, so once something has
        arrived the socket stays readable: from then on, poll on a short timer. A head that is not
        complete within a second is left to mitmproxy's bounded parser (``b""``); a connection that
        sends nothing is closed after ``limits.idle_timeout``, as mitmproxy would.
        """
        loop = asyncio.get_running_loop()
        await asyncio.wait_for(_readable(loop, conn), self.addon.policy.limits.idle_timeout)
        deadline, polls = loop.time() + 1.0, 0
        while True:
            polls += 1
            data = conn.recv(MAX_HEAD, socket.MSG_PEEK)
            if not data:
                raise OSError("closed before a request")
            if b"\r\n\r\n" in data:
                return data
            # "Too slow" needs both the clock and enough polls: a busy event loop must not make every
            # head look slow (the head is usually whole at the first peek).
            slow = loop.time() > deadline and polls > 100
            if len(data) >= MAX_HEAD or not data.startswith(b"CONNECT "[: len(data)]) or slow:
                return b""  # not a CONNECT, too long or too slow: mitmproxy's path
            await asyncio.sleep(0.002)

    async def _tunnel(self, conn: socket.socket, client_ip: str, target, head_length: int) -> None:
        addon, policy, loop = self.addon, self.addon.policy, asyncio.get_running_loop()
        flow_id = uuid.uuid4().hex
        await _recv_exactly(loop, conn, head_length)  # the CONNECT head is ours now
        upstream: socket.socket | None = None
        try:
            cap = addon._cap_refusal(policy, SimpleNamespace(peername=(client_ip, 0)))
            if cap is not None:
                verdict = Verdict(False, "limits", cap.headers[refusals.RULE_HEADER],
                                  cap.headers[refusals.REASON_HEADER])
                self._decision_line(flow_id, client_ip, target, verdict, cap.status_code)
                await _send(loop, conn, assemble_response(cap))
                return
            verdict = await addon.decide(policy, Request(target, "CONNECT", client_ip, tunnel=True))
            recorded = self._decision_line(flow_id, client_ip, target, verdict, None if verdict.allowed else 403)
            if not verdict.allowed:
                await _send(loop, conn, assemble_response(refusals.from_verdict(verdict)))
                return
            if not (recorded and addon.audit.healthy):
                await _send(loop, conn, assemble_response(addon._audit_unwritable()))
                return
            tunnel = Tunnel(flow_id, target, verdict, client_ip, intercept=False)
            # The guard at connect time, as on mitmproxy's path: the policy in force NOW must still accept
            # the pinned address (a reload may have landed during the lookup), and it is not ourselves.
            current = addon.policy
            checked = current.addresses.check(verdict.pinned)
            if not checked.allowed or addon._is_self(verdict.pinned, target.port):
                reason = f"refused connect to {verdict.pinned}: {checked.reason if not checked.allowed else 'self'}"
                await _send(loop, conn, assemble_response(refusals.refusal(403, checked.rule, reason)))
                self._tunnel_line(tunnel, 0, 0, reason)
                return
            upstream, error = await self._connect(verdict.pinned, target.port, current.limits.connect_timeout)
            if upstream is None:
                await _send(loop, conn, assemble_response(refusals.refusal(502, "connect", error)))
                self._tunnel_line(tunnel, 0, 0, error)
                return
            addon.metrics.open_tunnels += 1
            addon.metrics.fast_tunnels += 1
            try:
                await _send(loop, conn, b"HTTP/1.1 200 Connection established\r\n\r\n")
                await self._relay_checked(conn, upstream, tunnel)
            except (OSError, TimeoutError) as err:
                # Every allowed tunnel gets its closing line, however it ends.
                self._tunnel_line(tunnel, 0, 0, _describe(err, policy.limits.idle_timeout))
            finally:
                addon.metrics.open_tunnels -= 1
        finally:
            if upstream is not None:
                upstream.close()

    async def _connect(self, address: str, port: int, timeout: float) -> tuple[socket.socket | None, str]:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, (address, port)), timeout)
        except TimeoutError:
            sock.close()
            return None, f"connect to {address}:{port} timed out after {timeout:g}s (limits.connect_timeout)"
        except OSError as err:
            sock.close()
            return None, f"connect to {address}:{port} failed: {err.strerror or err}"
        return sock, ""

    async def _relay_checked(self, conn: socket.socket, upstream: socket.socket, tunnel: Tunnel) -> None:
        """Read the ClientHello, check its SNI, then copy bytes both ways until both sides are done."""
        loop = asyncio.get_running_loop()
        hello = b""
        while True:
            chunk = await asyncio.wait_for(loop.sock_recv(conn, MAX_HELLO), self.addon.policy.limits.idle_timeout)
            if not chunk:
                self._tunnel_line(tunnel, len(hello), 0, "the client closed the tunnel before a TLS ClientHello")
                return
            hello += chunk
            if len(hello) < 5:
                continue  # a record header is 5 bytes: judge nothing on fewer
            if not starts_like_tls_record(hello):
                self._refused_tunnel(tunnel, "tls:not-tls", "the tunnel does not start with a TLS ClientHello; "
                                                             "egresswall passes only TLS through CONNECT to this port")
                return
            try:
                parsed = parse_client_hello(hello)
            except ValueError:
                self._refused_tunnel(tunnel, "tls:sni", "the tunnel's first bytes look like TLS but are not a "
                                                        "valid ClientHello")
                await _send(loop, conn, TLS_ALERT_UNRECOGNIZED_NAME)
                return
            if parsed is not None:
                break
            if len(hello) > 4 * MAX_HELLO:
                self._refused_tunnel(tunnel, "tls:sni", "the ClientHello is larger than egresswall reads")
                return
        problem = self.addon._sni_problem(tunnel, parsed.sni)
        if problem:
            self._refused_tunnel(tunnel, "tls:sni", problem)
            await _send(loop, conn, TLS_ALERT_UNRECOGNIZED_NAME)
            return
        await _send(loop, upstream, hello)
        counts = {"up": len(hello), "down": 0}
        last = {"t": time.monotonic()}
        idle = self.addon.policy.limits.idle_timeout

        async def pump(src: socket.socket, dst: socket.socket, key: str) -> None:
            buffer = bytearray(RELAY_CHUNK)
            view = memoryview(buffer)
            try:
                while True:
                    n = await loop.sock_recv_into(src, buffer)
                    if n == 0:
                        break
                    counts[key] += n
                    last["t"] = time.monotonic()
                    await loop.sock_sendall(dst, view[:n])
                    last["t"] = time.monotonic()  # a slow reader is not an idle one
            except OSError:
                # One side failed (reset, refused): the tunnel is over both ways, now, not at the idle timeout.
                for sock in (src, dst):
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)
                return
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

        pumps = asyncio.gather(pump(conn, upstream, "up"), pump(upstream, conn, "down"))
        error = None
        try:
            while not pumps.done():
                await asyncio.wait([pumps], timeout=min(idle, 5.0))
                if not pumps.done() and time.monotonic() - last["t"] > idle:
                    error = f"nothing moved for limits.idle_timeout ({idle:g}s)"
                    pumps.cancel()
                    break
        finally:
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await pumps
            self._tunnel_line(tunnel, counts["up"], counts["down"], error)

    # ---- audit --------------------------------------------------------------------------------

    def _decision_line(self, flow_id: str, client: str, target, verdict: Verdict, status: int | None) -> bool:
        record = self.addon._base_record("decision", flow_id, client, "CONNECT", target, verdict)
        record["status"] = status
        word = "report" if verdict.report_only else ("allow" if verdict.allowed else "refuse")
        self.addon.metrics.decisions[(word, verdict.rule)] += 1
        return self.addon._write(record)

    def _refused_tunnel(self, tunnel: Tunnel, rule: str, reason: str) -> None:
        verdict = Verdict(False, "tls", rule, reason, addresses=tunnel.verdict.addresses)
        self._decision_line(tunnel.id + "-tls", tunnel.client, tunnel.target, verdict, None)
        self._tunnel_line(tunnel, 0, 0, reason)

    def _tunnel_line(self, tunnel: Tunnel, up: int, down: int, error: str | None) -> None:
        self.addon.tunnel_line(tunnel, up, down, error)


def _parse_connect(head: bytes) -> tuple[str, int] | None:
    """``CONNECT authority HTTP/1.x`` with a clean head → (authority, head length); else None."""
    end = head.find(b"\r\n\r\n")
    if end < 0 or not head.startswith(b"CONNECT "):
        return None
    lines = head[:end].split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or parts[2] not in (b"HTTP/1.1", b"HTTP/1.0"):
        return None
    for line in lines[1:]:
        name, sep, _ = line.partition(b":")
        if not sep or not name or name != name.strip() or b" " in name or b"\t" in name:
            return None  # folded or malformed headers: mitmproxy's parser judges those
    try:
        authority = parts[1].decode("ascii")
    except UnicodeDecodeError:
        return None
    if not authority.isprintable():
        return None
    return authority, end + 4


def _describe(err: BaseException, idle: float) -> str:
    if isinstance(err, TimeoutError):
        return f"nothing moved for limits.idle_timeout ({idle:g}s)"
    return f"the tunnel failed: {getattr(err, 'strerror', None) or err}"


def _target(authority: str):
    try:
        return parse_authority(authority, "https")
    except HostFormError:
        return None


def _client_ip(conn: socket.socket) -> str:
    ip = conn.getpeername()[0]
    return ip[7:] if ip.startswith("::ffff:") and "." in ip else ip


def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> asyncio.Future:
    future = loop.create_future()
    fd = sock.fileno()

    def ready() -> None:
        loop.remove_reader(fd)
        if not future.done():
            future.set_result(None)

    loop.add_reader(fd, ready)
    future.add_done_callback(lambda _: loop.remove_reader(fd))
    return future


async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = await loop.sock_recv(sock, n - len(data))
        if not chunk:
            raise asyncio.IncompleteReadError(data, n)
        data += chunk
    return data


async def _send(loop: asyncio.AbstractEventLoop, sock: socket.socket, data: bytes) -> None:
    await loop.sock_sendall(sock, data)


