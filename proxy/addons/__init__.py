"""egresswall as mitmproxy addons: one concern each, in the order their hooks must run.

Each is an adapter from mitmproxy hooks to the gate (``proxy/gate.py``), in the shape of mitmproxy's
own ``addons/block.py``. ``egresswall_addons`` builds the list both the embedded runner and the
mitmdump shim load; the order matters where two addons share a hook (``requestheaders``: decide,
then strip hop-by-hop headers, then set the body limit).
"""

from __future__ import annotations

from ..gate import Gate
from .admission import AdmissionAddon
from .audit_trail import AuditTrail
from .body_limit import BodyLimit
from .connections import ConnectionTable
from .decision import DecisionAddon
from .hop_by_hop import HopByHop
from .options import LimitsOptions
from .pinning import Pinning
from .tunnel_watch import TunnelWatch


def egresswall_addons(gate: Gate, fronted: bool = False) -> list:
    """``fronted``: the front (proxy/front.py) admitted every connection before handing it over."""
    table = ConnectionTable()
    return [LimitsOptions(gate), AdmissionAddon(gate, table, fronted), DecisionAddon(gate, table), HopByHop(),
            BodyLimit(gate), Pinning(gate, table), TunnelWatch(gate, table), AuditTrail(gate)]


__all__ = ["egresswall_addons", "ConnectionTable"]
