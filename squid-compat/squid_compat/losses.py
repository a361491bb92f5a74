"""Where the imported policy refuses what squid allows: each case classified and reported.

Categories (squid-compat/README.md explains each):

* ``https-form``: an absolute-form ``https://`` request, which egresswall judges by the CONNECT ports;
* ``conditional-default``: squid's answer for hosts no ACL names depends on port, method or scheme, and
  egresswall's default cannot;
* ``deny-overlap``: a deny rule egresswall needs (for the host or an enclosing domain) also refuses this,
  because deny rules come before allow rules and cannot make exceptions;
* ``host-form``: egresswall refuses the host's form before any rule (a name without a dot...);
* ``non-global-address``: an IP-literal URL squid allows, to an address egresswall refuses unless
  ``addresses.allow`` re-admits it;
* ``expressiveness``: another condition egresswall's host rules cannot carry.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from policy.decision import decide
from policy.model import DENY, Policy

from .acls import BELOW, EXACT, HTTPS, IP_ANY, REST
from .program import Outcome
from .report import NOTE, WARNING, Note, Where
from .space import Cell, Region, Space, describe_cells
from .synth import Probe as EgressProbe

# Why the imported policy refuses a request class squid allows (squid-compat/README.md explains each).
HTTPS_FORM = "https-form"  # absolute-form https:// requests are judged by the CONNECT ports
CONDITIONAL_DEFAULT = "conditional-default"  # squid's catch-all depends on port/method; egresswall's default cannot
DENY_OVERLAP = "deny-overlap"  # a deny rule egresswall needs (here or for an enclosing domain) also refuses this
HOST_FORM = "host-form"  # egresswall refuses the host's form (single label, .local, ...)
EXPRESSIVENESS = "expressiveness"  # a condition egresswall's host rules cannot carry
NON_GLOBAL = "non-global-address"  # an IP-literal URL squid allows, to an address egresswall refuses

LOSS_HINTS = {
    DENY_OVERLAP: "egresswall checks deny rules before allow rules, and a deny rule cannot make exceptions",
    EXPRESSIVENESS: "egresswall's host rules cannot carry this condition",
    HOST_FORM: "egresswall refuses this form of host before any rule",
    NON_GLOBAL: "only addresses.allow (--readmit) re-admits a non-global address",
    HTTPS_FORM: "judged by ports.connect",
    CONDITIONAL_DEFAULT: "the default cannot carry conditions",
}


@dataclass(frozen=True)
class Loss:
    """A request class squid certainly allows and the imported policy refuses."""

    where: Where | None  # the squid line that allowed it
    client: str
    region: Region
    cell: Cell
    reason: str  # egresswall's reason for refusing
    category: str

    def __str__(self) -> str:
        return f"{self.category}: {self.region.describe()}: {self.cell.describe('other')} from {self.client}: " \
               f"{self.reason}"


def classify(policy: Policy, probe: EgressProbe, outcome: Outcome, client: str, region: Region,
             cell: Cell) -> Loss:
    """Why the policy refuses a request class squid allows."""
    where = outcome.decided_by.where if outcome.decided_by else None
    if probe.request is None:
        return Loss(where, client, region, cell, "egresswall does not accept this form of host", HOST_FORM)
    verdict = decide(policy, probe.request, probe.resolution)
    reason = verdict.reason
    if region.kind != EXACT and probe.request.target.host in reason:  # name the region, not the probe
        reason = reason.replace(probe.request.target.host, {
            BELOW: f"(a name below {region.anchor})", REST: "(a host no ACL names)",
            IP_ANY: "(an IP-literal URL)"}[region.kind])
    if verdict.stage == "form":
        category = HOST_FORM
    elif verdict.stage == "address":
        category = NON_GLOBAL
    elif verdict.stage == "port" and cell.kind == HTTPS:
        category = HTTPS_FORM
    elif verdict.matched is not None and verdict.matched.action == DENY:
        category = DENY_OVERLAP
    elif region.kind in (REST, IP_ANY):
        category = CONDITIONAL_DEFAULT
    else:
        category = EXPRESSIVENESS
    return Loss(where, client, region, cell, reason, category)


def report(losses: list[Loss], space: Space) -> list[Note]:
    """One warning per cause and place, not one per request class."""
    notes: list[Note] = []
    grouped: dict[tuple, list[Loss]] = defaultdict(list)
    for loss in losses:
        if loss.category == HTTPS_FORM:
            key: tuple = (HTTPS_FORM,)
        elif loss.category == CONDITIONAL_DEFAULT:
            key = (CONDITIONAL_DEFAULT, loss.client)
        else:
            key = (loss.category, loss.client, loss.region.key)
        grouped[key].append(loss)
    for key, items in grouped.items():
        cells = describe_cells({loss.cell for loss in items}, space.other_method, len(space.methods) > 1)
        lines = sorted({str(loss.where) for loss in items if loss.where})
        by = f" ({', '.join(lines[:4])}{' ...' if len(lines) > 4 else ''})" if lines else ""
        first = items[0]
        if key[0] == HTTPS_FORM:
            message = (f"absolute-form https:// requests (a client asking the proxy to make the TLS connection; "
                       f"browsers send CONNECT instead): squid allows {cells}{by}; egresswall judges them by "
                       "ports.connect, like a CONNECT, and refuses them")
        elif key[0] == CONDITIONAL_DEFAULT:
            message = (f"hosts no ACL names, clients {first.client}: squid allows {cells}{by}; egresswall's "
                       "default cannot depend on port, method or scheme, so it refuses them")
        else:
            message = (f"{first.region.describe()}, clients {first.client}: squid allows {cells}{by}; "
                       f"egresswall refuses: {first.reason} ({LOSS_HINTS[first.category]})")
        level = NOTE if first.category == HOST_FORM else WARNING  # a deliberate difference, said in the header
        notes.append(Note(first.where, message, first.category, level))
    return notes
