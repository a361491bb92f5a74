"""What ``egresswall run`` was asked to start: one proxy process's settings.

Apart from the runner so that the supervisor of ``--workers N`` (``proxy/workers.py``), which starts
workers and never proxies, can hold it without importing mitmproxy (tens of MiB it would never use).
"""

from __future__ import annotations

from dataclasses import dataclass

from policy.loader import Overrides


@dataclass
class RunConfig:
    policy_path: str | None
    overrides: Overrides
    listen: tuple[str, int] = ("127.0.0.1", 3128)
    admin: tuple[str, int] | None = ("127.0.0.1", 3131)  # README, "Admin port"
    # A worker's admin listener (proxy/workers.py): a Unix socket in the supervisor's private directory, so no
    # client of the proxy can reach a worker's /metrics as it could a loopback port (one worker cannot know
    # another's port to refuse it); None: ``admin`` as given.
    admin_socket: str | None = None
    log_path: str | None = None
    log_format: str = "json"
    confdir: str | None = None  # where mitmproxy keeps its CA (interception only)
    upstream_ca: str | None = None  # extra CA bundle to verify intercepted upstreams with (labs, private CAs)
    watch_interval: float = 0.25
    reuse_port: bool = False  # a worker of several sharing the listen port (proxy/workers.py)
    fast_tunnels: bool = True  # passed-through TLS tunnels relayed by the front (proxy/front.py), not mitmproxy
    fast_http: bool = True  # plain-HTTP requests relayed by the front (proxy/fast_http.py), not mitmproxy
    uvloop: bool = True  # the event loop is uvloop's (proxy/event_loop.py), not the standard library's
    worker_count: int = 1  # connection caps are shared out between this many workers
    extra_self_endpoints: tuple[tuple[str, int], ...] = ()  # e.g. the supervisor's admin listener
    admin_token_file: str | None = None  # the session API's bearer token; None: the API is off
    session_store: str | None = None  # None or "memory": this process's memory; "redis://...": shared
    restarted: bool = False  # a worker started again after it died: its first load waits for a settled file
