"""Review round 21, newcomer: README and compose/README claims that were tried and HELD (kept as tests).
Nothing here sends traffic: files are parsed, rendered and validated offline."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kustomize import kubectl_or_skip, render

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_the_readme_policy_example_loads_holds() -> None:
    """README.md:726-772, the annotated policy file, is a policy that loads (roles, sessions, nat64, limits)."""
    from policy.loader import parse_policy

    block = re.search(r"## The policy file.*?```yaml\n(.*?)```", README, re.S)
    assert block
    policy = parse_policy(block.group(1), "policy.yaml")
    assert policy.default == "deny" and len(policy.roles) == 2


def test_compose_readme_ca_command_makes_the_files_the_secret_needs_holds(tmp_path: Path) -> None:
    """compose/README.md:198-200: the one-line CertStore command makes ca/mitmproxy-ca.pem,
    mitmproxy-ca-cert.pem and mitmproxy-dhparam.pem, the three files the Secret is created from."""
    subprocess.run([sys.executable, "-c", "from mitmproxy.certs import CertStore; "
                    "CertStore.from_store('ca', 'mitmproxy', 2048)"], cwd=tmp_path, check=True, timeout=60)
    for name in ("mitmproxy-ca.pem", "mitmproxy-ca-cert.pem", "mitmproxy-dhparam.pem"):
        assert (tmp_path / "ca" / name).is_file()


@pytest.mark.parametrize("shape", ["sidecar", "shared"])
def test_each_kustomize_shape_renders_and_validates_holds(tmp_path: Path, shape: str) -> None:
    """compose/README.md:127-133 and 243-244: `kubectl apply -k compose/k8s` with either component renders
    (the generated egress-lock ConfigMap's hashed name reaches the init container's volume), and what it
    renders passes kubernetes-validate --strict against 1.30."""
    kubectl_or_skip()
    validate = Path(sys.executable).parent / "kubernetes-validate"
    if not validate.exists():
        pytest.skip("kubernetes-validate is not installed in the venv")
    copy = tmp_path / "k8s"
    shutil.copytree(ROOT / "compose" / "k8s", copy)
    kustomization = copy / "kustomization.yaml"
    text = kustomization.read_text()
    if shape == "shared":
        text = text.replace("  - sidecar\n", "  # - sidecar\n").replace("  # - shared\n", "  - shared\n")
    kustomization.write_text(text)
    rendered = render(copy)
    out = tmp_path / "rendered.yaml"
    out.write_text(rendered)
    if shape == "sidecar":
        hashed = re.search(r"name: (egresswall-egress-lock-[a-z0-9]+)", rendered)
        assert hashed and rendered.count(hashed.group(1)) >= 2
        assert "pod-security.kubernetes.io/enforce: privileged" in rendered
    else:
        assert "pod-security.kubernetes.io/enforce: restricted" in rendered
    result = subprocess.run([str(validate), "--strict", "-k", "1.30.0", str(out)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("argv", [["replay", "a.jsonl", "--policy", "p.yaml", "--default", "deny"],
                                  ["lint", "p.yaml", "--default", "deny"],
                                  ["suggest", "a.jsonl", "--mode", "report"],
                                  ["squid", "export", "p.yaml", "--nameserver", "127.0.0.1"]])
def test_policy_options_are_usage_errors_on_the_file_readers_holds(argv: list[str]) -> None:
    """README.md:101-104: lint, squid export, replay and suggest take none of the policy options
    (`egresswall replay --default deny` is a usage error): exit 2 with the command's own usage."""
    result = subprocess.run([sys.executable, "-m", "proxy.cli", *argv], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert "unrecognized arguments" in result.stderr and "see egresswall" in result.stderr
