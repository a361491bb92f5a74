"""One place per rule: the default ports, the refusal header names, the ::ffff: unwrap, CIDR strictness,
HOST:PORT parsing and the host normaliser each live in policy/, and the packages that need them use it.

A source scan finds copies coming back. proxy/ is left out while the gate is being rebuilt over
policy.wire and policy.addresses.unwrap_mapped; ci/containment/client.py stays standard-library only (it
runs alone in a lab namespace).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCANNED = [p for folder in ("policy", "browser", "squid-compat", "ci") for p in (ROOT / folder).rglob("*.py")
           if p.relative_to(ROOT).as_posix() != "ci/containment/client.py"]

COPIES = {
    "default-port map": (re.compile(r"""["']https?["']\s*:\s*(?:80|443)\b"""), {"policy/hosts.py"}),
    "refusal header name": (re.compile(r"""["']x-egresswall-(?:rule|reason)["']""", re.IGNORECASE),
                            {"policy/wire.py"}),
    "::ffff: unwrap": (re.compile(r"""startswith\(["']::ffff:["']\)|\.ipv4_mapped\b|is_ipv4_mapped\(\)"""),
                       {"policy/addresses.py", "policy/hosts.py", "squid-compat/squid_compat/acls.py",
                        "squid-compat/squid_compat/importer.py", "ci/containment/checks.py"}),
    "IDNA 2003 codec": (re.compile(r"""\.encode\(["']idna["']\)"""), set()),
    "second CIDR parser": (re.compile(r"""def _strict_cidr|def _parse_cidr"""), set()),
}


@pytest.mark.parametrize("what", sorted(COPIES))
def test_no_second_copy(what: str) -> None:
    pattern, allowed = COPIES[what]
    found = []
    for path in SCANNED:
        where = path.relative_to(ROOT).as_posix()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if pattern.search(line) and where not in allowed:
                found.append(f"{where}:{number}: {line.strip()}")
    assert not found, f"a copy of the {what} outside its one place:\n" + "\n".join(found)


def test_the_shared_names_are_the_policy_ones() -> None:
    import squid_compat.access_log as access_log

    import browser.probe.runner as probe
    import browser.reader as reader
    from policy import hosts, wire

    assert reader.DEFAULT_PORTS is hosts.DEFAULT_PORTS is probe.DEFAULT_PORTS is access_log.DEFAULT_PORTS
    assert wire.refusal_from_headers({"x-egresswall-rule": "ports.connect", "X-EGRESSWALL-REASON": "why"}) == (
        "ports.connect", "why")
    assert wire.refusal_from_headers({"X-Egresswall-Rule": "r"}) == ("r", "")
    assert wire.refusal_from_headers({"x-other": "1"}) is None


def test_the_page_reader_names_hosts_as_the_core_does() -> None:
    """browser/reader.py compared hosts after IDNA 2003 (``faß`` → ``fass``); the proxy's records use the
    core's IDNA 2008 / UTS-46 normaliser (``faß`` → ``xn--fa-hia``), so a refusal was not found."""
    from browser.reader import _host_port, _norm_host
    from policy.hosts import normalise_host

    assert _norm_host("faß.example") == normalise_host("faß.example")[0] == "xn--fa-hia.example"
    assert _norm_host("[::ffff:127.0.0.3]") == "127.0.0.3"
    assert _norm_host("WWW.Example.COM.") == "www.example.com"
    assert _host_port("https://faß.example/x") == ("https", "xn--fa-hia.example", 443)
    assert _host_port("http://[::ffff:7f00:3]:8080/") == ("http", "127.0.0.3", 8080)
