"""Run egresswall's addons inside stock mitmdump:

    mitmdump -s proxy/mitmdump_addon.py --set egresswall_policy=policy/default.yaml

The embedded runner (``egresswall run``) is faster (fewer addons, and its front relays passed-through
TLS tunnels itself); this shim is for teams that already operate mitmdump. It builds the same gate and
loads the same addons, so every limit holds here too (``tcp_timeout`` follows ``limits.idle_timeout``,
the head and body bounds are installed). Without the front, a connection over a cap is closed at accept
without an answer (no request has been read, so its record names no host), and a connection that never
sends a byte is closed at ``limits.idle_timeout`` (``limits.first_byte_timeout`` is the front's).
Load it last so its next_layer hook has the final say in tunnels.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mitmproxy import ctx  # noqa: E402
from mitmproxy.exceptions import OptionsError  # noqa: E402

from policy.loader import PolicyError  # noqa: E402
from proxy import mitm_patches  # noqa: E402
from proxy.addons import egresswall_addons, patch_state_for  # noqa: E402
from proxy.audit import AuditLog  # noqa: E402
from proxy.gate import Gate  # noqa: E402
from proxy.mitm_core import leave_answered_flows  # noqa: E402
from proxy.reload import PolicyHolder  # noqa: E402


class MitmdumpShim:
    def __init__(self) -> None:
        self.gate: Gate | None = None
        self.inner: list = []

    def load(self, loader) -> None:
        loader.add_option("egresswall_policy", str, "", "egresswall policy file (default: the bundled policy)")
        loader.add_option("egresswall_log", str, "", "egresswall audit log file (default: standard output)")

    def configure(self, updated) -> None:
        if self.gate is not None and "egresswall_policy" not in updated and "egresswall_log" not in updated:
            return
        try:
            holder = PolicyHolder(ctx.options.egresswall_policy or None)
        except PolicyError as err:
            raise OptionsError(f"egresswall_policy: {err}") from None
        if holder.policy.upstream is not None:
            # mitmdump's mode is the operator's own option here, and the upstream's credentials would have to
            # pass through mitmdump's: chaining is ``egresswall run``'s (README, "Chaining to an upstream proxy").
            raise OptionsError(f"egresswall_policy: the policy names an upstream proxy ({holder.policy.upstream.url}); "
                               "the mitmdump shim does not chain to one: use `egresswall run`")
        self.gate = Gate(holder, AuditLog(ctx.options.egresswall_log or None))
        gate = self.gate
        mitm_patches.uninstall()
        mitm_patches.install(patch_state_for(gate, first_byte_timer=False))  # the first byte: README
        self.inner = egresswall_addons(gate)
        # The limits become mitmproxy's options now, before the listener takes a connection (one that is
        # accepted earlier keeps mitmproxy's defaults, e.g. a 600 s tcp_timeout).
        for addon in self.inner:
            if hasattr(addon, "apply"):
                addon.apply()

    def running(self) -> None:
        assert self.gate is not None
        self.gate.holder.start_watching()
        leave_answered_flows(ctx.master.addons)  # egresswall's refusal of an HTTP/2 preface reaches the client
        for addon in self.inner:
            if hasattr(addon, "running"):
                addon.running()

    def __getattr__(self, name: str):
        # Every other hook goes to the addons that have it, in their order; mitmproxy looks hooks up by name.
        if name.startswith("_") or not self.__dict__.get("inner"):
            raise AttributeError(name)
        handlers = [getattr(addon, name) for addon in self.__dict__["inner"] if hasattr(addon, name)]
        if not handlers:
            raise AttributeError(name)
        return _chain(handlers)


def _chain(handlers):
    import inspect

    if any(inspect.iscoroutinefunction(h) for h in handlers):
        async def run_all(*args):
            for handler in handlers:
                result = handler(*args)
                if inspect.isawaitable(result):
                    await result
        return run_all

    def run_sync(*args):
        for handler in handlers:
            handler(*args)
    return run_sync


addons = [MitmdumpShim()]
