"""Stable rule ids: a name for each rule that does not change when lines above it change.

Metrics are labelled by these and audit records carry them (``file:line`` stays the human text, in
``rule``). A host rule's id is its YAML ``id:`` when it has one (a short slug, unique in the policy), else
one derived from the list it is in and its pattern as written:

* ``hosts.allow:docs.python.org``, ``hosts.deny:*.ads.example.com``;
* ``roles.ci-runners.allow:.pypi.org`` (a role's own lists);
* a second rule with the same pattern in the same list gets ``#2`` (``hosts.allow:api.example.com#2``).

A rule of ``hosts.allow`` or ``hosts.deny`` derives its first-occurrence id itself when asked
(``HostRule.rule_id``): the loader leaves its ``id`` empty, so a million-entry allowlist keeps no id strings.

The default has ``default:deny`` / ``default:allow``, a role's own default ``roles.ci-runners.default:deny``;
an address rule ``addresses.allow:198.18.0.0/15``. Every other refusal (form, scheme, port, special-purpose
address, DNS) is already named without a position (``ports.connect``, ``special-purpose 10.0.0.0/8``) and
that name is its id. A derived id always holds ':'; a written one never does, so they cannot collide.
"""

from __future__ import annotations

import re

ID_SLUG = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
ID_WORDS = "1-64 lower-case letters, digits, '.', '_' or '-', starting with a letter or digit"


def host_list(action: str, role: str | None = None) -> str:
    """The list a host rule is in: ``hosts.allow``, ``roles.ci-runners.deny``."""
    return f"roles.{role}.{action}" if role is not None else f"hosts.{action}"


def derived(list_name: str, pattern_text: str, occurrence: int = 1) -> str:
    return f"{list_name}:{pattern_text}" + (f"#{occurrence}" if occurrence > 1 else "")


def derived_for_list(list_name: str, texts: list[str], implied: bool = False, distinct: bool = False) -> list[str]:
    """``derived`` for each pattern text of one list of bare patterns, in order: a text's second entry is ``#2``,
    its third ``#3``. A list whose texts are all different (a big allowlist) is done by one C-level map.

    ``implied``: the list is a policy's own ``hosts.allow`` or ``hosts.deny``, whose rules derive a text's first
    id themselves from their action and pattern (``HostRule.rule_id``); that id is then "" here, and a
    million-entry allowlist holds no id strings at all. ``distinct``: the caller knows no text is written twice
    (nothing is then counted)."""
    ids = [""] * len(texts) if implied else list(map(f"{list_name}:".__add__, texts))
    if not distinct and len(set(texts)) != len(texts):
        times: dict[str, int] = {}
        for i, text in enumerate(texts):
            count = times[text] = times.get(text, 0) + 1
            if count > 1:
                ids[i] = derived(list_name, text, count)
    return ids


def implied(list_name: str) -> bool:
    """A policy's own ``hosts.allow`` and ``hosts.deny`` (not a role's list): there a text's first id is "" in
    ``HostRule.id``, and ``HostRule.rule_id`` derives it from the rule's action and pattern."""
    return list_name.startswith("hosts.")


def given_id(list_name: str, text: str, occurrence: int, implied: bool) -> str:
    """One entry's id as ``derived_for_list`` gives it: "" for a text's first entry in an ``implied`` list."""
    return "" if implied and occurrence == 1 else derived(list_name, text, occurrence)


def default(action: str, role: str | None = None) -> str:
    return f"roles.{role}.default:{action}" if role is not None else f"default:{action}"


def address_rule(action: str, network: object) -> str:
    return f"addresses.{action}:{network}"
