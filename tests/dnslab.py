"""A DNS server the tests start on loopback (or on a lab address inside a namespace): answers from a
table, logs every query, and can misbehave on purpose (SERVFAIL, silence, garbage, truncation, answers
that change: rebinding).

Real sockets and real DNS messages (dnspython builds and parses them), so the resolver under test
talks to it exactly as it would to a nameserver.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset
from listening import stop_serving


@dataclass
class Record:
    rdtype: str  # "A", "AAAA", "CNAME"
    value: str
    ttl: int = 60


@dataclass
class Behaviour:
    """How to answer a name. ``sequence`` answers the n-th query with sequence[n] (the last repeats)."""

    records: list[Record] = field(default_factory=list)
    sequence: list[list[Record]] | None = None
    rcode: str | None = None  # "SERVFAIL", "NXDOMAIN", "REFUSED"
    silent: bool = False  # never answer: the resolver times out
    garbage: bool = False  # answer bytes that are not a DNS message
    truncated: bool = False  # set TC with no answer (and refuse TCP)
    tcp_only: bool = False  # set TC with no answer over UDP, and answer over TCP
    beside: list[Record] = field(default_factory=list)  # added to every answer as they are, whatever was asked
    # (a hostile or broken server's: a CNAME beside the name's own A records, which a CNAME may not have)


class DnsLab:
    def __init__(self, zone: dict[str, Behaviour | list[Record]] | None = None, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        self.zone: dict[str, Behaviour] = {}
        for name, behaviour in (zone or {}).items():
            self.set(name, behaviour)
        self.queries: list[tuple[str, str]] = []  # (name, type) in arrival order
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()
        # ``host`` is the address to serve on: loopback for the proxy tests, a lab address when the
        # server runs inside a network namespace (the containment lab, ci/containment/).
        self.host = host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # UDP and TCP must share a port; a random UDP port may be taken for TCP, so try again.
        for attempt in range(20):
            self.udp = socket.socket(family, socket.SOCK_DGRAM)
            self.udp.bind((host, port))
            self.port = self.udp.getsockname()[1]
            self.tcp = socket.socket(family, socket.SOCK_STREAM)
            self.tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                self.tcp.bind((host, self.port))
                break
            except OSError:
                self.udp.close()
                self.tcp.close()
                if port or attempt == 19:
                    raise
        self.tcp.listen(16)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._serve_udp, daemon=True),
                         threading.Thread(target=self._serve_tcp, daemon=True)]

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def set(self, name: str, behaviour: Behaviour | list[Record]) -> None:
        if isinstance(behaviour, list):
            behaviour = Behaviour(records=behaviour)
        self.zone[name.lower().rstrip(".")] = behaviour

    def queried(self, name: str) -> bool:
        name = name.lower().rstrip(".")
        return any(q == name for q, _ in self.queries)

    def __enter__(self) -> DnsLab:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        udp, tcp = self._threads
        stop_serving(self.udp, udp)
        stop_serving(self.tcp, tcp)

    # ---- serving ------------------------------------------------------------------------------

    def _serve_udp(self) -> None:
        while not self._stop.is_set():
            try:
                data, peer = self.udp.recvfrom(4096)
            except OSError:
                return
            reply = self._answer(data, tcp=False)
            if reply is not None:
                try:
                    self.udp.sendto(reply, peer)
                except OSError:
                    return

    def _serve_tcp(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.tcp.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                try:
                    length = int.from_bytes(_read_exact(conn, 2), "big")
                    reply = self._answer(_read_exact(conn, length), tcp=True)
                    if reply is not None:
                        conn.sendall(len(reply).to_bytes(2, "big") + reply)
                except (OSError, ValueError):
                    pass

    def _answer(self, data: bytes, tcp: bool) -> bytes | None:
        try:
            query = dns.message.from_wire(data)
        except Exception:
            return None
        question = query.question[0]
        name = question.name.to_text(omit_final_dot=True).lower()
        rdtype = dns.rdatatype.to_text(question.rdtype)
        with self._lock:
            self.queries.append((name, rdtype))
        behaviour = self.zone.get(name)
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        if behaviour is None:
            response.set_rcode(dns.rcode.NXDOMAIN)
            return response.to_wire()
        if behaviour.silent:
            return None
        if behaviour.garbage:
            return query.id.to_bytes(2, "big") + b"\x81\x80 this is not a DNS message"
        if behaviour.truncated or (behaviour.tcp_only and not tcp):
            if tcp:
                return None
            response.flags |= dns.flags.TC
            return response.to_wire()
        if behaviour.rcode:
            response.set_rcode(dns.rcode.from_text(behaviour.rcode))
            return response.to_wire()
        records = self._records_for(name, behaviour, rdtype)
        self._add_chain(response, name, rdtype, records, depth=0)
        for record in behaviour.beside:
            response.answer.append(dns.rrset.from_text(name + ".", record.ttl, "IN", record.rdtype,
                                                       record.value + ("." if record.rdtype == "CNAME" else "")))
        return response.to_wire()

    def _records_for(self, name: str, behaviour: Behaviour, rdtype: str) -> list[Record]:
        if behaviour.sequence is None:
            return behaviour.records
        with self._lock:
            # Count per (name, type): A and AAAA queries of one lookup see the same step.
            key = f"{name}/{rdtype}"
            n = self._counts.get(key, 0)
            self._counts[key] = n + 1
        return behaviour.sequence[min(n, len(behaviour.sequence) - 1)]

    def _add_chain(self, response: dns.message.Message, name: str, rdtype: str, records: Iterable[Record],
                   depth: int) -> None:
        records = list(records)
        cnames = [r for r in records if r.rdtype == "CNAME"]
        if cnames and depth < 8:
            cname = cnames[0]
            response.answer.append(dns.rrset.from_text(name + ".", cname.ttl, "IN", "CNAME", cname.value + "."))
            target = self.zone.get(cname.value.lower().rstrip("."))
            if target is not None and not (target.rcode or target.silent):
                self._add_chain(response, cname.value.lower().rstrip("."), rdtype,
                                self._records_for(cname.value, target, rdtype), depth + 1)
            return
        matching = [r for r in records if r.rdtype == rdtype]
        if matching:
            response.answer.append(dns.rrset.from_text_list(name + ".", min(r.ttl for r in matching), "IN", rdtype,
                                                            [r.value for r in matching]))


def _read_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ValueError("short read")
        data += chunk
    return data
