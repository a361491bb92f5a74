"""A gate in process with mitmproxy's patches installed over it, for the addon tests (``taddons``/``tflow``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from proxy import mitm_patches
from proxy.audit import AuditLog
from proxy.gate import Gate
from proxy.metrics import Metrics
from proxy.reload import PolicyHolder


@contextmanager
def patched_gate(folder: Path, policy_text: str) -> Iterator[Gate]:
    """A gate over ``policy_text`` (its audit log in ``folder``, as ``gate.log_path``), the patches installed
    for as long as the block runs and uninstalled after (and the audit log closed)."""
    policy = folder / "policy.yaml"
    policy.write_text(policy_text)
    gate = Gate(PolicyHolder(str(policy)), AuditLog(str(folder / "audit.jsonl")), Metrics())
    gate.log_path = folder / "audit.jsonl"
    mitm_patches.install(mitm_patches.PatchState(limits=lambda: gate.policy.limits, on_refusal=lambda *a: None,
                                                 on_body_over_limit=lambda *a: None))
    try:
        yield gate
    finally:
        mitm_patches.uninstall()
        gate.audit.close()
