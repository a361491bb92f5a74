"""The containment probe: its targets file, and the page run in the contained Chromium behind the real
proxy on loopback (the namespace lab in ci/ runs the same probe against its own hosts)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from unprivileged import NO_SANDBOX_ARGS, SANDBOX

from browser.probe import OUTCOMES, PAGE_DIR, ROUTES, ProbeError, load_targets, run_probe, validate_targets
from browser.probe.runner import canonical_url

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "browser" / "probe" / "targets.example.json"


def test_example_targets_file_is_valid_and_lists_every_route():
    targets = load_targets(EXAMPLE)
    assert set(targets) == set(ROUTES)


@pytest.mark.parametrize("data,problem", [({"teleport": ["x"]}, "unknown route"), ({"fetch": []}, "non-empty"),
                                          ({"fetch": [1]}, "non-empty"), ({"_comment": "only"}, "no routes"),
                                          ([], "JSON object")])
def test_bad_targets_are_refused(data, problem):
    with pytest.raises(ProbeError, match=problem):
        validate_targets(data)


def test_canonical_url_matches_chromiums_spelling():
    assert canonical_url("http://[::ffff:127.0.0.3]:80") == canonical_url("http://[::ffff:7f00:3]/")
    assert canonical_url("HTTP://Internal.Lab.Example:8080") == "http://internal.lab.example:8080/"


def lab_targets(lab) -> dict[str, list[str]]:
    port, tls = lab.public.port, lab.public_tls.port
    internal = f"http://internal.lab.example:{port}/probe-target"
    return {
        "navigation": [f"http://internal.lab.example:{port}/", f"http://127.0.0.3:{port}/",
                       f"http://[::ffff:127.0.0.3]:{port}/", f"http://[64:ff9b::7f00:3]:{port}/",
                       f"http://[::1]:{port}/", f"http://localhost:{port}/", f"http://127.0.0.1:{port}/",
                       "http://169.254.169.254/latest/meta-data/", f"http://public.lab.example:{port}/hello"],
        "redirect": [f"http://public.lab.example:{port}/redirect?to={internal}",
                     f"http://public.lab.example:{port}/redirect?to=https://internal.lab.example:{tls}/"],
        "fetch": [internal, f"http://127.0.0.3:{port}/", f"http://[::ffff:127.0.0.3]:{port}/",
                  f"http://[64:ff9b::7f00:3]:{port}/", f"http://[::1]:{port}/", f"http://localhost:{port}/",
                  f"https://internal.lab.example:{tls}/", "http://169.254.169.254/latest/meta-data/",
                  f"http://public.lab.example:{port}/hello"],
        "websocket": [f"ws://internal.lab.example:{port}/", f"wss://internal.lab.example:{tls}/",
                      f"ws://127.0.0.3:{port}/"],
        "img": [internal, f"http://127.0.0.3:{port}/x.png"],
        "script": [internal],
        "iframe": [internal],
        "css": [internal],
        "beacon": [internal],
        "form-post": [internal],
        "popup": [internal],
        "service-worker-fetch": [internal, f"http://127.0.0.3:{port}/", f"http://public.lab.example:{port}/hello"],
        "dns-prefetch": ["//internal.lab.example"],
        "preconnect": [f"http://internal.lab.example:{port}", f"https://internal.lab.example:{tls}"],
        "webrtc-stun": ["stun:127.0.0.3:3478"],
    }


@pytest.fixture
def probe_page(lab) -> str:
    for name, kind in (("index.html", "text/html"), ("probe.js", "text/javascript"), ("sw.js", "text/javascript")):
        lab.public.serve(f"/probe/{name}", (PAGE_DIR / name).read_bytes(), kind)
    return f"http://public.lab.example:{lab.public.port}/probe/index.html"


@pytest.mark.integration
def test_probe_reports_every_route_and_nothing_internal_is_reached(lab, start_proxy, probe_page):
    proxy = start_proxy(lab.policy_text())
    targets = lab_targets(lab)
    before = (list(lab.internal.connections), list(lab.internal_tls.connections))
    report = run_probe(probe_page, targets, f"{proxy.host}:{proxy.port}", timeout=5, sandbox=SANDBOX)

    # one row per target of every route, in the targets' order, with a known outcome
    assert [(r["route"], r["target"]) for r in report] == [(k, t) for k, ts in targets.items() for t in ts]
    assert {r["route"] for r in report} == set(targets) == set(ROUTES)
    assert all(r["outcome"] in OUTCOMES and set(r) == {"route", "target", "outcome", "error"} for r in report)
    allowed = [r for r in report if "public.lab.example" in r["target"] and "redirect" not in r["target"]]
    internal = [r for r in report if r not in allowed]
    assert all(r["outcome"] == "reached" for r in allowed), allowed
    assert not [r for r in internal if r["outcome"] == "reached"], internal
    by_route = {}
    for row in internal:
        by_route.setdefault(row["route"], []).append(row)
    # what the browser saw: egresswall's refusal, by rule, for the requests Playwright can observe
    for route in ("navigation", "redirect", "fetch", "img", "script", "iframe", "css", "beacon", "form-post",
                  "popup", "service-worker-fetch"):
        assert all(r["outcome"] == "blocked" for r in by_route[route]), by_route[route]
        assert any("egresswall refused" in (r["error"] or "") for r in by_route[route]), by_route[route]
    assert by_route["webrtc-stun"][0]["outcome"] == "blocked"
    assert "candidates: none" in by_route["webrtc-stun"][0]["error"]  # no UDP at all under the policy

    # the proof: the stand-ins logged nothing, the proxy refused, and it never tried to leave loopback
    assert (lab.internal.connections, lab.internal_tls.connections) == before
    refused_hosts = {d["host"] for d in proxy.decisions() if d["verdict"] == "refuse"}
    assert {"internal.lab.example", "127.0.0.3", "::1", "64:ff9b::7f00:3", "169.254.169.254"} <= refused_hosts


@pytest.mark.integration
def test_weakened_loopback_bypass_is_noticed_by_the_probe_and_the_stand_in(lab, start_proxy, probe_page):
    """The negative control for the lab: without ``<-loopback>`` Chromium sends 127.0.0.3 DIRECT,
    past the proxy (the design's measured fact); the stand-in logs it and the probe says reached.
    (All of it stays on loopback.)"""
    proxy = start_proxy(lab.policy_text())
    port = lab.public.port
    before = len(lab.internal.connections)
    report = run_probe(probe_page, {"fetch": [f"http://127.0.0.3:{port}/weak-fetch"],
                                    "navigation": [f"http://127.0.0.3:{port}/weak-nav"]},
                       f"{proxy.host}:{proxy.port}", weaken={"loopback-bypass"}, timeout=5, sandbox=SANDBOX)
    assert [r["outcome"] for r in report] == ["reached", "reached"], report
    assert len(lab.internal.connections) > before
    assert not [d for d in proxy.decisions() if d["host"] == "127.0.0.3"]  # the proxy never saw them


@pytest.mark.integration
def test_probe_command_line_contract(lab, start_proxy, probe_page, tmp_path):
    proxy = start_proxy(lab.policy_text())
    targets = tmp_path / "targets.json"
    port = lab.public.port
    targets.write_text(json.dumps({"_comment": "small", "fetch": [f"http://internal.lab.example:{port}/"],
                                   "navigation": f"http://public.lab.example:{port}/hello"}))
    out = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "browser.probe", "--page-url", probe_page, "--targets", str(targets),
                           "--proxy", f"{proxy.host}:{proxy.port}", "--out", str(out), "--timeout", "5",
                           *NO_SANDBOX_ARGS],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert [(r["route"], r["outcome"]) for r in report] == [("fetch", "blocked"), ("navigation", "reached")]
    assert "1 blocked, 1 reached" in done.stderr
    done = subprocess.run([sys.executable, "-m", "browser.probe", "--page-url", probe_page, "--targets",
                           str(EXAMPLE.parent / "missing.json"), "--proxy", "127.0.0.1:9"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "cannot read targets file" in done.stderr
