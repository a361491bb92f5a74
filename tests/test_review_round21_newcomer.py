"""Review round 21, newcomer: places where README.md (or compose/README.md) says something the code or the
shipped files do not do. Each test failed on the tree before the round's fixes and says what should hold.

No test here sends traffic anywhere: the start-up line is built from a resolv.conf this test writes (the
proxy's nameserver text is read from it, nothing is asked), and the deployment files are only parsed.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import dns.resolver
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
EGRESSWALL = [sys.executable, "-m", "proxy.cli"]


def test_the_startup_line_names_resolv_conf_nameservers_as_plain_addresses(tmp_path, monkeypatch) -> None:
    """README.md:25 shows the start-up line of a proxy whose policy names no nameservers as
    ``nameservers 10.0.0.53 (from /etc/resolv.conf)``. The code (proxy/cli/run.py ``_nameservers``, via
    policy/resolver.py ``DnsResolver.nameservers``, which is ``str()`` of dnspython's nameserver objects)
    prints dnspython's own spelling, ``nameservers Do53:10.0.0.53@53 (from /etc/resolv.conf)``: the operator
    reading what the proxy asks for names gets a form the README never shows (and that differs from the
    ``--nameserver`` form, ``127.0.0.1:5353``). Should hold: ``10.0.0.53`` for port 53, ``IP:PORT`` /
    ``[IPv6]:PORT`` otherwise, as for policy nameservers."""
    from policy.loader import parse_policy
    from proxy.cli.run import _nameservers

    resolv = tmp_path / "resolv.conf"
    resolv.write_text("nameserver 10.0.0.53\n")
    original = dns.resolver.BaseResolver.read_resolv_conf

    def read_ours(self, f):  # every resolver built in this test reads the file above, not the machine's
        return original(self, str(resolv))

    monkeypatch.setattr(dns.resolver.BaseResolver, "read_resolv_conf", read_ours)
    policy = parse_policy((ROOT / "policy" / "default.yaml").read_text(), "policy/default.yaml")
    assert not policy.resolver.nameservers, "the bundled policy names no nameservers (README: /etc/resolv.conf's)"
    shown = "nameservers 10.0.0.53 (from /etc/resolv.conf)"
    assert shown in README, "README.md's start-up line example changed; update this test"
    assert f"nameservers {_nameservers(policy)}" == shown


# -- the Commands table against each command's --help ---------------------------------------------------

POLICY_OPTIONS = {"--policy", "--default", "--mode", "--allow-host", "--deny-host", "--allow-range", "--deny-range",
                  "--nameserver", "--upstream", "--upstream-credentials-file"}  # README.md:104-109 names these
# browser-server's caps are referred to browser/README.md by the row itself ("with caps on ...").
BROWSER_SERVER_LIMITS = {"--max-contexts", "--max-contexts-per-client", "--max-connections",
                         "--max-connections-per-client", "--context-idle", "--connection-idle",
                         "--max-message-bytes", "--max-calls-in-flight", "--browser-memory-max",
                         "--browser-cgroup-parent"}
POSITIVE_TWINS = {"--fast-tunnels", "--uvloop", "--fast-http"}  # the row names the --no- form


def _help_options(command: str) -> set[str]:
    out = subprocess.run([*EGRESSWALL, *command.split(), "--help"], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return set(re.findall(r"^\s+(?:-\w, )?(--[a-z][a-z0-9-]*)", out, re.M)) - {"--help"}


def _row(command: str) -> str:
    rows = [line for line in README.splitlines() if line.startswith(f"| `egresswall {command} ")]
    assert rows, f"README.md's Commands table has no row for {command}"
    return rows[0]


@pytest.mark.parametrize("command", ["run", "browse", "browser-server"])
def test_the_commands_table_names_every_option_of_the_command(command: str) -> None:
    """README.md:111-122, the Commands table, is where a newcomer reads what a command takes; the policy
    options are listed once above it (README.md:104-109). But rows leave out options the command has and
    that the rest of the README relies on: ``run`` lacks ``--no-admin`` and ``--confdir`` (README.md:30,
    1031, 1500, 1506 tell the operator to use them), ``browse`` and ``browser-server`` lack ``--no-sandbox``
    (README.md:1464: as root they refuse to start without it, and the error says to pass it),
    ``--proxy-ca`` (needed with ``--proxy`` when the running proxy intercepts TLS) and ``--upstream-ca``.
    Should hold: each row names every option its ``--help`` lists, besides the policy options, the
    positive twins of ``--no-…`` switches, and browser-server's caps (referred to browser/README.md)."""
    row = _row(command)
    wanted = _help_options(command) - POLICY_OPTIONS - POSITIVE_TWINS - BROWSER_SERVER_LIMITS
    missing = sorted(option for option in wanted if not re.search(re.escape(option) + r"(?![a-z0-9-])", row))
    assert not missing, f"README.md's Commands row for {command} does not name {missing}"


# -- Kubernetes: the shared shape's grace period for open tunnels -------------------------------------------

def test_the_shared_shapes_replicas_give_open_tunnels_the_grace_period_compose_readme_promises() -> None:
    """compose/README.md:189-190 says the shared proxy Deployment has "a 60-second grace period for open
    tunnels", and compose/k8s/shared/proxy.yaml:29 says "Open tunnels get the proxy's grace period to finish
    when a replica is scaled away" beside ``terminationGracePeriodSeconds: 60``. But what egresswall gives
    open tunnels on SIGTERM is ``limits.tunnel_grace`` (README.md:30-34, 113), and the policy every replica
    loads (compose/k8s/policy-configmap.yaml) does not set it, so it is the default 10 s: a tunnel still
    open 10 s after a scale-down (about 13 s with the closing margin) is cut, 47 s before the pod had to
    stop. Should hold: the ConfigMap's policy sets ``limits.tunnel_grace`` so that the tunnels get most of
    the pod's grace (here: at least 30 s) while egresswall still closes and records them before the
    kubelet's SIGKILL (tunnel_grace + ~3 s, README.md:32, plus a margin, within the pod's grace)."""
    from policy.loader import parse_policy

    docs = list(yaml.safe_load_all((ROOT / "compose/k8s/shared/proxy.yaml").read_text()))
    deployment = next(d for d in docs if d and d["kind"] == "Deployment")
    pod_grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert pod_grace == 60 and "60-second grace period for open tunnels" in " ".join(
        (ROOT / "compose/README.md").read_text().split())
    configmap = yaml.safe_load((ROOT / "compose/k8s/policy-configmap.yaml").read_text())
    policy = parse_policy(configmap["data"]["policy.yaml"], "policy.yaml")
    grace = policy.limits.tunnel_grace
    assert grace + 3 + 2 <= pod_grace, f"tunnel_grace {grace} s leaves egresswall no time to close before SIGKILL"
    assert grace >= 30, (f"open tunnels get limits.tunnel_grace = {grace} s, not the 60-second grace "
                         f"compose/README.md promises (the pod waits {pod_grace} s)")
