"""Round 23, the contained Chromium: a refusal a hostile page can read tells it what the proxy's (internal)
resolver answered.

The page is served from a name its author controls (``leak.r23.example``, TTL 0). After the page has
loaded, the author points the name (CNAME) at an internal name only the proxy's resolver knows
(``secret-db.corp.r23``, which resolves to an internal address). The page then fetches a path on its
OWN origin: the proxy resolves, refuses by the address rules, and its 403 (text, or JSON when the page
asks with ``Accept: application/json``) is a same-origin response, so the page's script reads all of it:
body and ``X-Egresswall-Reason`` alike. Both carry the internal address (``127.0.0.3 is in 127.0.0.0/8
...``; in a deployment ``10.1.2.3 is in 10.0.0.0/8``). So any page the contained browser loads can use
egresswall as an oracle for the internal DNS (split-horizon names, the addresses of internal hosts),
one CNAME at a time, although it can reach none of them.

What should hold: a refusal shown to the browser must not leak what only the proxy knows. The target's
own spelling (host, port) is the client's; the addresses the proxy's resolver returned are not. The
audit record keeps them for the operator (README, "Refusals an agent can read": the refusal's fields are
``rule``, ``reason``, ``host``, ``port``, ``hint``; "The hint is built from the verdict and the target
only" — the reason, though, is built from the resolver's answer). Fails today on both transports.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from proxyproc import TRANSPORTS
from review_round23_chromium_netns import run_in_netns

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"),
                       reason="needs root, unshare and ip for a network namespace of its own"),
]

READ_OWN_ORIGIN = ("await new Promise((r) => setTimeout(r, 300)); const r = await fetch('/after', {headers: "
                   "{'Accept': 'application/json'}}); "
                   "return JSON.stringify({status: r.status, headers: [...r.headers], body: await r.text()});")
READ_OWN_ORIGIN_TEXT = ("await new Promise((r) => setTimeout(r, 300)); const r = await fetch('/after-text'); "
                        "return JSON.stringify({status: r.status, headers: [...r.headers], body: await r.text()});")
# Two answers for the page's own load (A and AAAA), then the CNAME into the internal zone for good.
ZONE = {"leak.r23.example": {"sequence": [[["A", "127.0.0.2"]], [["A", "127.0.0.2"]],
                                          [["CNAME", "secret-db.corp.r23"]]]},
        "secret-db.corp.r23": [["A", "127.0.0.3"]]}


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_a_page_cannot_read_its_own_names_internal_address_from_a_refusal(transport, tmp_path):
    out = run_in_netns({"transport": transport, "attempts": {"json": READ_OWN_ORIGIN, "text": READ_OWN_ORIGIN_TEXT},
                        "zone": ZONE, "page_host": "leak.r23.example", "settle": 0.3}, tmp_path, timeout=120)
    assert out["tcp_hits"] == [] and out["udp_hits"] == [] and out["system_dns"] == []
    refusals = [d for d in out["decisions"] if d["host"] == "leak.r23.example" and d["verdict"] == "refuse"]
    assert refusals and all(d["stage"] == "address" for d in refusals), out["decisions"]
    for kind in ("json", "text"):
        seen = json.loads(out["results"][kind])
        assert seen["status"] == 403, seen  # the page got the proxy's refusal, same-origin, readable
        readable = seen["body"] + json.dumps(seen["headers"])
        assert "127.0.0.3" not in readable, (
            f"the page read the internal address its name's CNAME resolved to, from the refusal ({kind}): {seen}")
