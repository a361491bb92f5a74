"""The session ``egresswall browse`` reads with: exactly the URLs it was given, plus what ``--subresources``
lets a page's own requests (images, scripts, a script's fetch) reach.

* ``same-site`` (the default): hosts that share a registrable domain with one of the URLs (the Public
  Suffix List, as ``egresswall suggest`` groups names: ``docs.example.co.uk`` → ``.example.co.uk``; an IP
  address or a name that is itself a public suffix: that host only);
* ``none``: the URLs alone (a passed-through TLS tunnel is judged by host and port, so an https URL's
  host is reachable whole; on plain HTTP only the exact URL);
* ``policy``: no session: a page reaches whatever the policy allows, as before sessions existed.

A page that redirects or scripts its way anywhere else is refused by the session (``session:not-granted``)
and the refusal is reported with the page.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from policy.sessions import SessionSpec, parse_session_spec, parse_url_grant
from proxy.suggest import registrable_domain

SUBRESOURCES = ("same-site", "none", "policy")
DEFAULT_SUBRESOURCES = "same-site"
MAX_TTL = 86400.0  # the longest session policy/schema.json allows


@dataclass(frozen=True)
class BrowseGrants:
    spec: SessionSpec | None  # None: no session (--subresources policy)
    not_granted: tuple[tuple[str, str], ...] = ()  # (URL, why it cannot be granted): the session refuses it


def browse_grants(urls: Sequence[str], subresources: str, ttl: float) -> BrowseGrants:
    """The session for reading ``urls``; ValueError when none of them can be granted."""
    if subresources not in SUBRESOURCES:
        raise ValueError(f"--subresources {subresources!r}: use one of {', '.join(SUBRESOURCES)}")
    if subresources == "policy":
        return BrowseGrants(None)
    granted: list[str] = []
    hosts: list[str] = []
    not_granted: list[tuple[str, str]] = []
    for url in urls:
        try:
            grant = parse_url_grant(url)
        except ValueError as err:
            not_granted.append((url, str(err)))
            continue
        if grant.text not in granted:
            granted.append(grant.text)
        site = same_site_pattern(grant.host)
        if subresources == "same-site" and site not in hosts:
            hosts.append(site)
    if not granted:
        raise ValueError("none of the URLs can be granted to a session: " +
                         "; ".join(why for _, why in not_granted))
    spec = parse_session_spec({"grants": {"urls": granted, "hosts": hosts}, "ttl": min(ttl, MAX_TTL)})
    return BrowseGrants(spec, tuple(not_granted))


def same_site_pattern(host: str) -> str:
    """The host pattern for a host's site: ``.registrable-domain``, or the host alone when it has none."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        return f"[{host}]" if ":" in host else host
    domain = registrable_domain(host)
    return f".{domain}" if domain else host


def reading_ttl(urls: int, page_timeout: float) -> float:
    """Long enough for every page (each gets at most ``page_timeout`` plus the time to settle and extract)."""
    return 60.0 + urls * (page_timeout + 15.0)
