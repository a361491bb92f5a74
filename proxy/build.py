"""What this egresswall is built of: its own version and the versions it runs on.

One place for ``egresswall --version`` and the ``egresswall_build_info`` metric, so the two never
disagree. Versions are read from the installed distributions' metadata (no import of mitmproxy here:
the gate and the metrics stay importable without it).
"""

from __future__ import annotations

import sys
from importlib import metadata


def _distribution_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "unknown"


def versions() -> dict[str, str]:
    """``{"version": egresswall's, "python": "3.12.8", "mitmproxy": "12.1.1"}``."""
    return {"version": _distribution_version("egresswall"),
            "python": ".".join(str(n) for n in sys.version_info[:3]),
            "mitmproxy": _distribution_version("mitmproxy")}
