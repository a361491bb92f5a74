"""Admission: connection caps, checked when a connection is accepted.

A connection counts against its client's cap and the total from accept until it closes, whether it
has sent a byte or not: a client that opens sockets and stays silent holds at most its own share
(``limits.max_connections_per_client``) and cannot shut other clients out. The total is never more than the
process's open-file limit holds (``proxy/open_files.py``): past it a client is refused 503, not left unanswered.
An IPv6 client is counted by
the /64 it is in (``policy.addresses.cap_group``): one host may hold a whole /64 and take a fresh address
for every connection. With N workers on one
port each worker enforces 1/N of each cap, rounded up (the kernel spreads connections about evenly, by a hash):
a client may hold up to N-1 more than its cap, as README says, rather than be refused while under it by a worker
whose share is 0.

The front (``proxy/front.py``) admits every connection of ``egresswall run``; a connection it hands
to mitmproxy keeps its admission, which the front gives back when mitmproxy has finished with it
(``proxy/runner.py``), so it is counted once. Under stock mitmdump, where there is no front, the
mitmproxy addon admits in ``client_connected``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from policy.addresses import cap_group
from policy.model import Limits

from .open_files import connections_held, descriptors_usable, soft_limit


@dataclass(frozen=True)
class CapRefusal:
    status: int  # 429 for the client's own cap, 503 for the total or while shutting down
    rule: str
    reason: str


class Admission:
    def __init__(self, share: int = 1) -> None:
        self.share = share
        self.total = 0
        self.per_client: Counter[str] = Counter()
        self.draining = False

    def admit(self, client: str, limits: Limits, descriptor: int | None = None) -> CapRefusal | None:
        """Count the connection, or say why it is refused (then it is not counted). ``descriptor``: its file
        descriptor, where the transport has it: the kernel gives the lowest one free, so one this high means about
        as many are open (mitmproxy's path keeps a connection to each origin a client connection asked, which no
        count of connections sees)."""
        if self.draining:
            return CapRefusal(503, "shutdown", "egresswall is shutting down; retry on another instance")
        max_total = -(-limits.max_connections // self.share)
        if self.total >= max_total:
            return CapRefusal(503, "limits.max_connections",
                              f"egresswall has {self.total} open connections, its limit is {max_total}"
                              + self._per_worker(limits.max_connections))
        soft = soft_limit()
        if self.total >= connections_held(soft) or (descriptor is not None and descriptor >= descriptors_usable(soft)):
            return CapRefusal(503, "limits.max_connections",
                              f"egresswall's open files are at its open-file limit (RLIMIT_NOFILE {soft}, with "
                              f"{self.total} client "
                              f"connections open), under limits.max_connections {limits.max_connections}; the "
                              "operator may raise the limit (ulimit -n, LimitNOFILE=)")
        max_per_client = -(-limits.max_connections_per_client // self.share)
        group = cap_group(client)
        if self.per_client[group] >= max_per_client:
            who = f"client {client} has" if group == client else f"clients in {group} (counted as one) have"
            return CapRefusal(429, "limits.max_connections_per_client",
                              f"{who} {self.per_client[group]} open connections, the limit is "
                              f"{max_per_client}" + self._per_worker(limits.max_connections_per_client))
        self.total += 1
        self.per_client[group] += 1
        return None

    def release(self, client: str) -> None:
        group = cap_group(client)
        self.total -= 1
        self.per_client[group] -= 1
        if self.per_client[group] <= 0:
            del self.per_client[group]

    def _per_worker(self, limit: int) -> str:
        return f" (this worker's share of {limit} over {self.share} workers)" if self.share > 1 else ""

