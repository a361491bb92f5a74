"""egresswall as mitmproxy addons: one concern each, in the order their hooks must run.

Each is an adapter from mitmproxy hooks to the gate (``proxy/gate.py``), in the shape of mitmproxy's
own ``addons/block.py``. ``egresswall_addons`` builds the list both the embedded runner and the
mitmdump shim load; the order matters where two addons share a hook (``requestheaders``: decide,
then strip hop-by-hop headers, then set the body limit).
"""

from __future__ import annotations

from .. import mitm_patches
from ..gate import Gate
from ..peers import peer_of
from .admission import AdmissionAddon
from .audit_trail import AuditTrail
from .body_limit import BodyLimit, refuse_bad_body, refuse_body_over_limit, reserve_body
from .connections import ConnectionTable
from .decision import DecisionAddon
from .hop_by_hop import HopByHop
from .options import LimitsOptions
from .pinning import Pinning
from .response_hygiene import ResponseHygiene
from .tunnel_watch import TunnelWatch
from .upstream import UpstreamForwarding
from .upstream_pool import UpstreamPool
from .websocket_watch import WebSocketWatch


def egresswall_addons(gate: Gate, fronted: bool = False, upstream_credentials: str | None = None) -> list:
    """``fronted``: the front (proxy/front.py) admitted every connection before handing it over.
    With an upstream proxy in the policy (mitmproxy then runs in upstream mode) ``UpstreamForwarding``
    follows ``HopByHop``: the client's Proxy-Authorization is gone before the upstream's is added."""
    table = ConnectionTable()
    forwarding = [UpstreamForwarding(gate, table, upstream_credentials)] if gate.policy.upstream else []
    return [LimitsOptions(gate), AdmissionAddon(gate, table, fronted), DecisionAddon(gate, table), HopByHop(),
            *forwarding, BodyLimit(gate), Pinning(gate, table), UpstreamPool(), TunnelWatch(gate, table),
            AuditTrail(gate), ResponseHygiene(), WebSocketWatch(gate)]


def patch_state_for(gate: Gate, first_byte_timer: bool) -> mitm_patches.PatchState:
    """What proxy/mitm_patches.py reads, wired to ``gate``: its limits and where refusals are recorded.
    ``first_byte_timer``: False where the front already bounds a connection's first byte."""
    return mitm_patches.PatchState(
        limits=lambda: gate.policy.limits,
        on_refusal=lambda conn, status, rule, reason: gate.connection_refused(peer_of(conn.peername), status,
                                                                               rule, reason),
        on_unread_target=lambda conn, method, target, host, accept: gate.refuse_unread_target(
            peer_of(conn.peername), method, target, host, accept),
        on_head_refusal=lambda conn, status, rule, reason, accept: gate.refuse(
            peer_of(conn.peername), None, None, status, "form", rule, reason, accept=accept),
        on_body_over_limit=lambda flow, limit: refuse_body_over_limit(gate, flow, limit),
        on_body_buffered=lambda flow, size: reserve_body(gate, flow, size),
        on_bad_body=lambda flow, rule, reason: refuse_bad_body(gate, flow, rule, reason),
        first_byte_timer=first_byte_timer, via_upstream=lambda: gate.policy.upstream is not None)


__all__ = ["egresswall_addons", "patch_state_for", "ConnectionTable"]
