"""Render compose/k8s with `kubectl kustomize`, where a kubectl that can is at hand.

compose/k8s picks its shape with a kustomize *component*, which kubectl reads from 1.21 on. CI installs
no kubectl (Debian's `kubernetes-client` is 1.20 and stops at "unknown field components"; no registry
CI reaches carries a newer one), so the tests that render skip there and run where a modern kubectl is
installed. What CI does check without rendering is in tests/test_deploy_files.py (each file's schema,
and the promises read off the files themselves).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest

MIN_MINOR = 21  # kustomize components, read by `kubectl kustomize` since Kubernetes 1.21


@cache
def _kubectl_that_renders_components() -> str | None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return None
    out = subprocess.run([kubectl, "version", "--client", "-o", "json"], capture_output=True, text=True,
                         timeout=60)
    try:
        version = json.loads(out.stdout)["clientVersion"]
        major, minor = int(version["major"]), int(version["minor"].rstrip("+"))
    except (ValueError, KeyError, TypeError):
        return None
    return kubectl if (major, minor) >= (1, MIN_MINOR) else None


def kubectl_or_skip() -> str:
    """The path of a kubectl that renders kustomize components; skips the calling test where there is none."""
    kubectl = _kubectl_that_renders_components()
    if kubectl is None:
        pytest.skip(f"no kubectl >= 1.{MIN_MINOR} (kustomize components) installed: the rendered output is "
                    "not checked here (tests/kustomize.py says why CI has none)")
    return kubectl


def render(target: Path) -> str:
    """`kubectl kustomize TARGET`'s output; fails the test with kubectl's own words if it does not render."""
    out = subprocess.run([kubectl_or_skip(), "kustomize", str(target)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout
