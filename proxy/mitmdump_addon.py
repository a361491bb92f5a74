"""Run egresswall's addon inside stock mitmdump:

    mitmdump -s proxy/mitmdump_addon.py --set egresswall_policy=policy/default.yaml

The embedded runner (``egresswall run``) is faster (fewer addons); this shim is for teams that
already operate mitmdump. Load it last so its next_layer hook has the final say in tunnels.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mitmproxy import ctx  # noqa: E402

from proxy.addon import EgressWall  # noqa: E402
from proxy.audit import AuditLog  # noqa: E402
from proxy.reload import PolicyHolder  # noqa: E402


class MitmdumpShim:
    def __init__(self) -> None:
        self.inner: EgressWall | None = None

    def load(self, loader) -> None:
        loader.add_option("egresswall_policy", str, "", "egresswall policy file (default: the bundled policy)")
        loader.add_option("egresswall_log", str, "", "egresswall audit log file (default: standard output)")

    def configure(self, updated) -> None:
        if self.inner is None or "egresswall_policy" in updated:
            holder = PolicyHolder(ctx.options.egresswall_policy or None)
            self.inner = EgressWall(holder, AuditLog(ctx.options.egresswall_log or None))
            ctx.options.update(connection_strategy="eager")

    def running(self) -> None:
        assert self.inner is not None
        self.inner.holder.start_watching()

    def __getattr__(self, name: str):
        # Every other hook goes to the addon; mitmproxy looks hooks up by name.
        if name.startswith("_") or self.__dict__.get("inner") is None:
            raise AttributeError(name)
        return getattr(self.inner, name)


addons = [MitmdumpShim()]
