"""The compose topology, run from the images' root filesystems in the containment lab
(``ci/containment/compose_run.py``; ``ci/compose-lab --negative`` does the same by hand).

The emulation follows compose/docker-compose.yml: the first test reads the file itself and checks that
each service's user, command, tmpfs mounts, read-only root, networks and health check are what the
emulation runs. Then the run (the proxy on browsernet and egress, the browser server on browsernet only,
each as its image's user with no capabilities; health checks, the article through the browser server with
its renderers sandboxed, the probe, a flag-ignoring direct client) must pass, and its negative twin (the
browser also on egress) must report the leak.

Needs the images' root filesystems (``make images``; ``make test`` builds them first).
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
import yaml
from lab_util import PREFIX, lab_skip_reason, list_namespaces

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "ci"))

from containment import compose_run  # noqa: E402
from containment.compose_run import COMPOSE_FILE, IMAGES_DIR, run_compose, service_spec  # noqa: E402

pytestmark = [pytest.mark.lab, pytest.mark.integration]
SERVICES = ("proxy", "browser")


def _skip_reason() -> str | None:
    reason = lab_skip_reason("nft", "tcpdump", "nsenter", "unshare")
    if reason:
        return reason
    missing = [n for n in SERVICES if not (IMAGES_DIR / n / "rootfs").is_dir()]
    if missing:
        return f"no root filesystem for {', '.join(missing)} in {IMAGES_DIR}: run make images (make test does)"
    return None


@pytest.fixture(scope="module", autouse=True)
def images_present():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)


def image_config(name: str) -> dict:
    data = json.loads((IMAGES_DIR / name / "image.json").read_text())
    data = data[0] if isinstance(data, list) else data
    return data["Docker"]["config"]


@pytest.mark.parametrize("name", SERVICES)
def test_the_emulation_follows_the_compose_file_and_the_image(name, tmp_path):
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    service = raw["services"][name]
    spec = service_spec(raw, name, IMAGES_DIR, tmp_path)
    config = image_config(name)
    uid, gid = (int(x) for x in service["user"].split(":"))
    assert (spec.uid, spec.gid) == (uid, gid) and uid != 0
    assert config["User"] == service["user"]  # the image's USER is the one compose names
    assert spec.argv == [*config["Entrypoint"], *[str(w) for w in service["command"]]]
    assert [m.target for m in spec.mounts if m.kind == "tmpfs"] == service["tmpfs"]
    assert spec.read_only is service["read_only"] is True
    assert spec.networks == service["networks"]
    binds = {m.target: m.read_only for m in spec.mounts if m.kind == "bind"}
    assert binds == {v["target"]: bool(v.get("read_only")) for v in service.get("volumes") or []}
    assert spec.healthcheck == service["healthcheck"]["test"][1:]
    # The image's own HEALTHCHECK runs the same command (buildah --format docker keeps it).
    assert config["Healthcheck"]["Test"] == service["healthcheck"]["test"]
    assert spec.env["PATH"].startswith("/opt/egresswall/venv/bin:")
    assert (IMAGES_DIR / name / "rootfs" / "usr/bin/setpriv").exists()
    assert shlex.join(spec.argv)  # printable


def test_the_browser_is_on_the_internal_network_only_and_the_proxy_bridges():
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    internal = {n for n, v in raw["networks"].items() if (v or {}).get("internal")}
    assert set(raw["services"]["browser"]["networks"]) <= internal
    assert set(raw["services"]["proxy"]["networks"]) - internal


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("compose")
    base.chmod(0o755)
    base.parent.chmod(0o755)
    return {
        "compose": run_compose("compose", IMAGES_DIR, base / "compose", browser_on_egress=False),
        "twin": run_compose("negative:browser-on-egress", IMAGES_DIR, base / "twin", browser_on_egress=True),
    }


def test_the_compose_topology_run_passes(runs):
    from containment.checks import format_table

    result = runs["compose"]
    assert result.error is None, result.error
    print(format_table(result.judgement))
    assert result.judgement.failed() == []
    ids = {c.id for c in result.judgement.checks}
    assert set(compose_run.EXTRA_CHECKS) | {"stand-ins", "capture", "audit", "allowed", "probe"} <= ids
    page = result.details["server_page"]
    assert page["status"] == 200 and "public" in page["text"].lower()
    assert all(a["outcome"].startswith("OSError: Network is unreachable") for a in result.details["direct"])


def test_the_negative_twin_reports_the_leak(runs):
    result = runs["twin"]
    assert result.error is None, result.error
    failed = result.judgement.failed()
    assert "network" in failed and "stand-ins" in failed, failed
    assert any(a["outcome"] == "connected" for a in result.details["direct"])
    # Only the network changed: the containers and the server are as in the passing run.
    assert "health" not in failed and "containers" not in failed and "server" not in failed


def test_nothing_left_behind(runs):
    import os

    assert [ns for ns in list_namespaces() if ns.startswith(f"{PREFIX}-{os.getpid()}-")] == []
