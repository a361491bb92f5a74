"""How many connections this process's open-file limit (RLIMIT_NOFILE) can hold, and raising it at start.

Each admitted connection takes the client's socket and, once decided, one to its upstream; a lookup in flight
takes two more (A and AAAA at once, policy/resolver.py). A process whose descriptors run out cannot accept:
its listener's backlog fills and every client waits in silence, with no answer and no record (review round 23:
with Debian's default soft limit of 1024 and the default caps, four clients' silent sockets, each under its own
cap, shut everyone else out). So the total cap a process enforces is never more than its limit holds
(``admission.Admission``), and ``egresswall run`` raises the soft limit to the hard one before it listens.
"""

from __future__ import annotations

import resource

DESCRIPTORS_PER_CONNECTION = 3  # the client's socket, the upstream's, and a lookup's share
RESERVED_DESCRIPTORS = 64  # listeners, the audit log, the session store, the admin listener, imports


def raise_soft_limit() -> int:
    """Raise the soft open-file limit to the hard one; the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        wanted = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):
            pass  # a container may forbid it: the caps are held under the soft limit all the same
    return soft


def soft_limit() -> int:
    """The open-file limit in force now (read at each admission: a limit may be lowered while the process runs,
    ``prlimit``); no limit reads as a very large one."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 40 if soft == resource.RLIM_INFINITY else soft


def connections_held(soft: int) -> int:
    """The connections an open-file limit of ``soft`` can hold."""
    return max(1, (soft - RESERVED_DESCRIPTORS) // DESCRIPTORS_PER_CONNECTION)


def descriptors_usable(soft: int) -> int:
    """The descriptor numbers a connection may take, the reserve kept back (a connection accepted at or above this
    is refused 503, with the reserve left to answer it)."""
    return max(1, soft - RESERVED_DESCRIPTORS)
