"""mitmproxy's own options as egresswall's limits want them, on every path (the mitmdump shim too).

``tcp_timeout`` is ``limits.idle_timeout`` and follows a reload; connects are eager (the CONNECT is
answered only once the pinned upstream answered); HTTP/2 is not offered to clients, because a proxy
port that parses h2 needs bounds on h2 heads as well (intercepted hosts speak HTTP/1.1 to the
browser; passed-through tunnels are not parsed at all); HTTP/3 is off (the proxy carries TCP only).
Bodies are streamed per flow by ``BodyLimit``, never by mitmproxy's size heuristics.
"""

from __future__ import annotations

import math

from mitmproxy import ctx

from ..gate import Gate


class LimitsOptions:
    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self._applied: float | None = None

    def wanted(self) -> dict:
        # mitmproxy's tcp_timeout is whole seconds: rounded up (int() made 0.5 s a timeout of 0, which closed every
        # connection at once, and 1.9 s one second)
        idle = max(1, math.ceil(self.gate.policy.limits.idle_timeout))
        return dict(connection_strategy="eager", tcp_timeout=idle,
                    http2=False, http3=False, stream_large_bodies=None, body_size_limit=None, websocket=True,
                    rawtcp=False)  # never a raw TCP relay by mitmproxy's guess (egresswall chooses tunnel layers)

    def running(self) -> None:
        self.apply()

    def apply(self) -> None:
        """Set the options (again after a reload that changed the limits)."""
        idle = self.gate.policy.limits.idle_timeout
        if self._applied != idle:
            self._applied = idle
            ctx.options.update(**self.wanted())

    def requestheaders(self, flow) -> None:
        if self._applied != self.gate.policy.limits.idle_timeout:
            self.apply()
