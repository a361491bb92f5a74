"""Name resolution: the interface the decision needs, and its dnspython implementation.

This is the one module of ``policy`` that does I/O, and only here: the decision functions take the
``Resolution`` it returns as plain data. Names are asked of the policy's nameservers with
dnspython — never ``getaddrinfo``, so ``/etc/hosts`` and search domains play no part.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import dns.asyncbackend
import dns.asyncquery
import dns.asyncresolver
import dns.exception
import dns.inet
import dns.message
import dns.name
import dns.nameserver
import dns.rdatatype
import dns.resolver

from .decision import Request, Resolution, Verdict, decide_addresses, precheck, refuse_resolution
from .model import Policy

TIMEOUT, SERVFAIL, NXDOMAIN, EMPTY, ERROR = "timeout", "servfail", "nxdomain", "empty", "error"
# The most addresses one name may have. Every address is checked at every decision and written in its record:
# a nameserver that answers thousands (a zone anyone can own) made each request cost 100 ms of CPU and a
# 150 KB audit line, and each cached name 300 kB. Real names have a handful; a big round robin a few dozen.
MAX_ADDRESSES = 64
# The most records a DNS message may hold before it is parsed (checked in its 12-byte header): parsing costs
# dnspython about 40 µs a record, so a 48 KB answer of 3,000 records was 120 ms of CPU on every lookup of
# a fresh name, refused or not. Room for the addresses, a CNAME chain as long as dnspython follows
# (dns.message.MAX_CHAIN), and a generous authority and additional section.
MAX_ANSWER_RECORDS = MAX_ADDRESSES + dns.message.MAX_CHAIN
MAX_RECORDS = 256


class ResolveError(Exception):
    """The name could not be resolved to a set of addresses that can all be checked."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind, self.reason = kind, reason


class Resolver(Protocol):
    async def resolve(self, name: str) -> Resolution: ...


class DnsResolver:
    """A and AAAA over dnspython's async resolver, with a TTL cache clamped to [floor, ceiling].

    Both record types must answer (or say "no such records"): if one times out, the answer is
    incomplete and the name is refused, because every address must be checked.
    """

    def __init__(
        self,
        nameservers: Sequence[tuple[str, int]] = (),
        timeout: float = 2.0,
        ttl_floor: int = 0,
        ttl_ceiling: int = 300,
        clock: Callable[[], float] = time.monotonic,
        max_cache_entries: int = 10_000,
    ) -> None:
        self._resolver = dns.asyncresolver.Resolver(configure=not nameservers)
        if nameservers:
            self._resolver.nameservers = [_BoundedNameserver(ip, port) for ip, port in nameservers]
        else:  # the system's (egresswall check without --nameserver): the same bound
            self._resolver.nameservers = [_bounded(ns, self._resolver) for ns in self._resolver.nameservers]
        self._resolver.search = []
        self._resolver.use_search_by_default = False
        self._resolver.lifetime = timeout
        self._resolver.timeout = timeout
        self.timeout = timeout
        self.ttl_floor, self.ttl_ceiling = ttl_floor, ttl_ceiling
        self._clock = clock
        self._cache: dict[str, tuple[float, Resolution]] = {}
        self._inflight: dict[str, asyncio.Future[Resolution]] = {}
        self.max_cache_entries = max_cache_entries
        self.queries = 0  # lookups sent (cache misses), for metrics and tests

    @classmethod
    def for_policy(cls, policy: Policy) -> DnsResolver:
        settings = policy.resolver
        return cls(settings.nameservers, settings.timeout, settings.ttl_floor, settings.ttl_ceiling)

    @property
    def nameservers(self) -> list[tuple[str, int]]:
        """(address, port) of each server asked (dnspython's objects print as ``Do53:10.0.0.53@53``)."""
        found = []
        for ns in self._resolver.nameservers:
            if isinstance(ns, str):
                found.append((ns, self._resolver.port))
            else:
                found.append((ns.address, getattr(ns, "port", self._resolver.port)))
        return found

    async def resolve(self, name: str) -> Resolution:
        cached = self._cache.get(name)
        if cached and cached[0] > self._clock():
            return cached[1]
        # Concurrent requests for a name share one lookup. It runs as its own task, so a caller that
        # gives up (client gone, cancelled) does not cancel the lookup the others are waiting for.
        task = self._inflight.get(name)
        if task is None:
            task = asyncio.ensure_future(self._lookup_and_cache(name))
            self._inflight[name] = task
            task.add_done_callback(lambda done: self._finished(name, done))
        return await asyncio.shield(task)

    def _finished(self, name: str, task: asyncio.Future[Resolution]) -> None:
        if self._inflight.get(name) is task:
            del self._inflight[name]
        if not task.cancelled():
            task.exception()  # mark retrieved: no "never retrieved" warning when every caller gave up

    async def _lookup_and_cache(self, name: str) -> Resolution:
        result = await self._lookup(name)
        ttl = min(max(result.ttl, self.ttl_floor), self.ttl_ceiling)
        if ttl > 0:
            now = self._clock()
            if len(self._cache) >= self.max_cache_entries:
                self._evict(now)
            self._cache[name] = (now + ttl, result)
        return result

    def _evict(self, now: float) -> None:
        """Keep the cache bounded: a page can ask for endless random names. Expired entries go first,
        then the oldest inserted."""
        for key in [key for key, (expires, _) in self._cache.items() if expires <= now]:
            del self._cache[key]
        while len(self._cache) >= self.max_cache_entries:
            del self._cache[next(iter(self._cache))]

    async def _lookup(self, name: str) -> Resolution:
        self.queries += 1
        qname = dns.name.from_text(name)
        try:
            a, aaaa = await asyncio.wait_for(
                asyncio.gather(self._query(qname, "A"), self._query(qname, "AAAA")),
                timeout=self.timeout + 0.5,  # dnspython's lifetime should end first; this bounds it anyway
            )
        except TimeoutError:
            raise ResolveError(TIMEOUT, f"DNS lookup of {name} timed out after {self.timeout:g}s") from None
        answers = [answer for answer in (a, aaaa) if answer is not None]
        for answer in answers:
            _check_cname_stands_alone(answer.response, qname)
        if not answers:
            raise ResolveError(EMPTY, f"{name} has no A or AAAA records")
        count = sum(len(answer.rrset) for answer in answers)
        if count > MAX_ADDRESSES:
            raise ResolveError(ERROR, f"{name} has {count} addresses, more than the {MAX_ADDRESSES} egresswall "
                                      "checks for one name: a broken or hostile nameserver")
        addresses = tuple(str(rr) for answer in answers for rr in answer.rrset)
        ttl = min(answer.rrset.ttl for answer in answers)
        cnames: list[str] = []
        for answer in answers:
            for rrset in answer.chaining_result.cnames:
                ttl = min(ttl, rrset.ttl)
                for rr in rrset:
                    target = rr.target.to_text(omit_final_dot=True)
                    if target not in cnames:
                        cnames.append(target)
        return Resolution(name=name, addresses=addresses, cnames=tuple(cnames), ttl=ttl)

    async def _query(self, qname: dns.name.Name, rdtype: str) -> dns.resolver.Answer | None:
        try:
            return await self._resolver.resolve(qname, rdtype, search=False, raise_on_no_answer=True)
        except dns.resolver.NoAnswer:
            return None
        except dns.resolver.NXDOMAIN:
            raise ResolveError(NXDOMAIN, f"{qname.to_text(True)} does not exist (NXDOMAIN)") from None
        except dns.resolver.LifetimeTimeout:
            raise ResolveError(TIMEOUT, f"DNS lookup of {qname.to_text(True)} timed out after "
                                        f"{self.timeout:g}s") from None
        except dns.resolver.NoNameservers as err:
            too_large = [e[3] for e in err.kwargs.get("errors") or [] if isinstance(e[3], AnswerTooLarge)]
            if too_large:
                raise ResolveError(ERROR, f"the answer for {qname.to_text(True)} {too_large[0]}: a broken or "
                                          "hostile nameserver") from None
            answered = _answered(err)
            kind = SERVFAIL if "SERVFAIL" in answered else ERROR
            raise ResolveError(kind, f"no nameserver gave a usable answer for {qname.to_text(True)} "
                                     f"(answered {', '.join(answered) or 'nothing'})") from None
        except dns.exception.DNSException as err:
            raise ResolveError(ERROR, f"DNS lookup of {qname.to_text(True)} failed: {_short(err)}") from None


class AnswerTooLarge(dns.exception.FormError):
    """A DNS message holds more records than egresswall reads (its header says so): not parsed at all. A
    FormError, so that dnspython asks that nameserver no more for this name (it would ask again until its
    lifetime ran out)."""


def _check_header(wire: bytes) -> None:
    """Refuse a message whose header counts more records than MAX_ANSWER_RECORDS in its answer section or
    MAX_RECORDS in all, before dnspython parses it."""
    if len(wire) < 12:
        return  # dnspython refuses it as it is
    answers, authority, additional = (int.from_bytes(wire[i:i + 2]) for i in (6, 8, 10))
    if answers > MAX_ANSWER_RECORDS or answers + authority + additional > MAX_RECORDS:
        raise AnswerTooLarge(f"holds {answers + authority + additional} records ({answers} answers), more than "
                             f"the {MAX_ANSWER_RECORDS} answers and {MAX_RECORDS} records egresswall reads")


class _HeaderCheckedSocket:
    """dnspython's socket for one query, with each answer's header checked before dnspython reads the rest: a
    datagram from the nameserver carrying this query's id, or the first message on TCP. A datagram from anyone
    else is dnspython's to ignore, unchecked: checked, a forged one (from any address, with the id and a count
    over the bound) made the lookup fail."""

    def __init__(self, sock, query_id: bytes, nameserver: tuple[str, int]) -> None:
        self._sock, self._query_id = sock, query_id
        self._nameserver = (ipaddress.ip_address(nameserver[0]), nameserver[1])
        self._stream_head = b""  # TCP: the two-byte length, then the header

    def __getattr__(self, name: str):
        return getattr(self._sock, name)

    async def recvfrom(self, size: int, timeout: float | None):
        wire, sender = await self._sock.recvfrom(size, timeout)
        if wire[:2] == self._query_id and _address_of(sender) == self._nameserver:
            _check_header(wire)
        return wire, sender

    async def recv(self, size: int, timeout: float | None) -> bytes:
        data = await self._sock.recv(size, timeout)
        if len(self._stream_head) < 14:
            self._stream_head += data[:14 - len(self._stream_head)]
            if len(self._stream_head) == 14:
                _check_header(self._stream_head[2:])
        return data


def _bounded(nameserver: str | dns.nameserver.Nameserver,
             resolver: dns.asyncresolver.Resolver) -> dns.nameserver.Nameserver:
    """A nameserver of /etc/resolv.conf (an address, or dnspython's object for it) as a _BoundedNameserver."""
    if isinstance(nameserver, str) and dns.inet.is_address(nameserver):
        return _BoundedNameserver(nameserver, resolver.nameserver_ports.get(nameserver, resolver.port))
    if isinstance(nameserver, dns.nameserver.Do53Nameserver):
        return _BoundedNameserver(nameserver.address, nameserver.port)
    raise ValueError(f"nameserver {nameserver} is not an address: egresswall asks nameservers over UDP and TCP")


def _address_of(sender: tuple) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int] | None:
    """A datagram's sender as an address and a port (an IPv6 scope left out)."""
    try:
        return ipaddress.ip_address(str(sender[0]).split("%", 1)[0]), sender[1]
    except (ValueError, IndexError, TypeError):
        return None


class _BoundedNameserver(dns.nameserver.Do53Nameserver):
    """A nameserver over UDP and TCP as dnspython's own, whose answers' headers are checked (_check_header)
    before they are parsed."""

    async def async_query(self, request: dns.message.QueryMessage, timeout: float, source: str | None,
                          source_port: int, max_size: bool, backend: dns.asyncbackend.Backend,
                          one_rr_per_rrset: bool = False, ignore_trailing: bool = False) -> dns.message.Message:
        family = dns.inet.af_for_address(self.address)
        bound = (source or ("::" if family == socket.AF_INET6 else "0.0.0.0"), source_port) \
            if source or source_port else None
        query_id = request.id.to_bytes(2)
        if max_size:
            async with await backend.make_socket(family, socket.SOCK_STREAM, 0, bound, (self.address, self.port),
                                                 timeout) as sock:
                return await dns.asyncquery.tcp(request, self.address, timeout=timeout, port=self.port,
                                                sock=_HeaderCheckedSocket(sock, query_id, (self.address, self.port)),
                                                backend=backend,
                                                one_rr_per_rrset=one_rr_per_rrset, ignore_trailing=ignore_trailing)
        destination = (self.address, self.port) if backend.datagram_connection_required() else None
        async with await backend.make_socket(family, socket.SOCK_DGRAM, 0, bound, destination) as sock:
            return await dns.asyncquery.udp(request, self.address, timeout=timeout, port=self.port,
                                            sock=_HeaderCheckedSocket(sock, query_id, (self.address, self.port)),
                                            raise_on_truncation=True,
                                            backend=backend, one_rr_per_rrset=one_rr_per_rrset,
                                            ignore_trailing=ignore_trailing, ignore_errors=True,
                                            ignore_unexpected=True)


def _check_cname_stands_alone(response: dns.message.Message, qname: dns.name.Name) -> None:
    """A name that has a CNAME has no other records (RFC 1034 3.6.2). An answer that holds both for one name is
    refused: dnspython takes the name's addresses and drops its CNAME, so the name the CNAME points at would go
    unchecked. (Of two CNAMEs for one name dnspython keeps one, and follows and checks that one.)"""
    aliased = {rrset.name for rrset in response.answer if rrset.rdtype == dns.rdatatype.CNAME}
    for rrset in response.answer:
        if rrset.name in aliased and rrset.rdtype != dns.rdatatype.CNAME:
            raise ResolveError(ERROR, f"the answer for {qname.to_text(True)} holds both a CNAME and "
                                      f"{dns.rdatatype.to_text(rrset.rdtype)} records for {rrset.name.to_text(True)} "
                                      "(a CNAME stands alone): a broken or hostile nameserver")


def _answered(err: dns.resolver.NoNameservers) -> list[str]:
    """What the nameservers answered (an rcode such as SERVFAIL, or the kind of failure: ``Truncated``,
    ``EOFError``), each once, without the nameservers' addresses: the reason reaches the client, which has no
    business learning where the proxy's resolver is."""
    answered: list[str] = []
    for error in err.kwargs.get("errors") or []:
        what = error[3] if isinstance(error[3], str) else type(error[3]).__name__
        if what not in answered:
            answered.append(what)
    return answered


def _short(err: Exception) -> str:
    text = str(err)
    return text if len(text) <= 200 else text[:197] + "..."


async def resolve_and_decide(
    policy: Policy, request: Request, resolver: Resolver
) -> tuple[Verdict, Resolution | None]:
    """The whole order of checks with a real resolver: precheck, resolve only if allowed, decide.

    The one path both ``egresswall check`` and the proxy take, so they cannot disagree.
    """
    verdict = precheck(policy, request)
    if not verdict.needs_resolution:
        return verdict, None
    try:
        resolution = await resolver.resolve(request.target.host)
    except ResolveError as err:
        return refuse_resolution(err.kind, err.reason, verdict), None
    return decide_addresses(policy, verdict, resolution.addresses, resolution.cnames, request), resolution
