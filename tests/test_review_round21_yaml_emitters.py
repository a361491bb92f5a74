"""Review round 21, second pass (a helper's): the policy's YAML 1.2 numbers against what egresswall's own
tools write.

policy/yamldoc.py now reads ``1e5``, ``1E3`` and ``1.5e2`` as numbers (YAML 1.2's core schema; PyYAML's 1.1
resolver, used before, needs a signed exponent and read them as text). squid-compat's emitter
(squid_compat/emit.py ``_scalar``) writes a role name, a host pattern, an address or a method plainly when it
matches ``^[A-Za-z0-9.][A-Za-z0-9._/-]*$``; a squid ACL named ``1e5`` (or ``10``) or a dstdomain ``1e3`` /
``.1e5`` is then written unquoted, read back as a number, and ``egresswall squid import`` ends in an internal
error ("the imported policy does not load").
"""
from __future__ import annotations

import pytest
from squid_compat.importer import import_text

from policy.loader import parse_policy

CONF = """acl {name} src 10.1.0.0/16
acl sites dstdomain {domain}
http_access allow {name} sites
http_access deny all
http_port 3128
"""


@pytest.mark.parametrize(("name", "domain"), [
    ("1e5", ".example.com"),  # text before this round's reader (YAML 1.1 needs 1e+5): a regression
    ("1E3", ".example.com"),
    ("1.5e2", ".example.com"),
    ("10", ".example.com"),  # an int under either reader
    ("office", "1e3"),
    ("office", ".1e5"),
])
def test_squid_import_of_numeric_looking_names_loads(name, domain) -> None:
    """README (Commands): `egresswall squid import` "translates squid's acl/http_access rules into a policy".
    What it writes must load: a name that YAML 1.2 reads as a number must be quoted by the emitter
    (squid_compat/emit.py _scalar; better: quote whatever policy/yamldoc's resolver would not read as text)."""
    result = import_text(CONF.format(name=name, domain=domain), "squid.conf")  # loads its own output
    policy = parse_policy(result.yaml, "imported")
    if name != "office":
        assert [role.name for role in policy.roles] == [name]


@pytest.mark.parametrize("text", ["1e5", "1E3", "2e10", ".5e1", "10", "1."])
def test_every_plain_scalar_the_emitter_writes_unquoted_is_read_as_text(text) -> None:
    """The emitter's _scalar writes ``text`` plainly only when the policy reader reads it back as that text."""
    from squid_compat.emit import _scalar
    written = _scalar(text)
    policy = parse_policy(f"version: 1\nroles:\n  - name: {written}\n    clients: [10.0.0.0/8]\n", "p")
    assert policy.roles[0].name == text
