"""Run the probe page in the contained Chromium and collect one result per attempt.

The page (``page/``) is static and served by a lab host; the runner injects the targets with an init
script, loads the page, waits for its report, runs the navigation routes itself (a navigation would
take the page away), and turns the page's view into final outcomes with what the browser's network
events showed (Playwright sees responses' headers, so it can tell egresswall's 403 from a server's
answer, and the network error of a refused tunnel):

* ``reached``  an answer came from the target: a response egresswall did not make, a WebSocket that
               opened, a STUN server's reflexive candidate, or a peer that accepted and hung up
               (ERR_EMPTY_RESPONSE and the like);
* ``blocked``  egresswall refused it (its rule and reason are in ``error``), or the browser failed
               it without an answer (ERR_TUNNEL_CONNECTION_FAILED, ERR_UNSAFE_PORT, no UDP for STUN...);
* ``error``    the route could not be tried, or its result cannot be observed from the browser
               (dns-prefetch, preconnect): judge those by the proxy's log and the stand-ins;
* ``timeout``  nothing within the time limit.

The proof of containment is the stand-ins' logs and the proxy's log; the probe says what the browser
saw and that every route was attempted.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import math
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from policy.hosts import DEFAULT_PORTS
from policy.wire import refusal_from_headers

from ..launch import ContainmentOptions, launch, plan_launch

ROUTES = ("navigation", "redirect", "fetch", "websocket", "img", "script", "iframe", "css", "beacon", "form-post",
          "popup", "service-worker-fetch", "dns-prefetch", "preconnect", "webrtc-stun")
RUNNER_ROUTES = ("navigation", "redirect")
OUTCOMES = ("reached", "blocked", "error", "timeout")
# The peer took the connection and hung up or spoke something that is not HTTP: something answered.
PEER_ANSWERED = ("ERR_EMPTY_RESPONSE", "ERR_CONNECTION_CLOSED", "ERR_CONNECTION_RESET", "ERR_SOCKET_NOT_CONNECTED",
                 "ERR_INVALID_HTTP_RESPONSE", "ERR_INVALID_RESPONSE", "ERR_RESPONSE_HEADERS_TRUNCATED",
                 "ERR_SSL_PROTOCOL_ERROR", "ERR_CERT_AUTHORITY_INVALID", "ERR_CERT_COMMON_NAME_INVALID",
                 "ERR_CERT_INVALID")
CONCURRENCY = 6
PAGE_ONLY = ("websocket", "webrtc-stun", "dns-prefetch", "preconnect")  # no request event to judge by


class ProbeError(RuntimeError):
    """The probe could not run at all (bad targets, the page did not load)."""


def load_targets(path: str | Path) -> dict[str, list[str]]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ProbeError(f"cannot read targets file {path}: {err}") from None
    return validate_targets(data)


def validate_targets(data: Mapping[str, Any]) -> dict[str, list[str]]:
    """``{route: [target, ...]}``; keys starting with ``_`` are comments. Unknown routes and empty
    lists are errors: a route the lab meant to test must not silently disappear from the report."""
    if not isinstance(data, Mapping):
        raise ProbeError("the targets file must be a JSON object {route: [targets]}")
    targets: dict[str, list[str]] = {}
    for route, value in data.items():
        if route.startswith("_"):
            continue
        if route not in ROUTES:
            raise ProbeError(f"unknown route {route!r}; routes are {', '.join(ROUTES)}")
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not items or not all(isinstance(t, str) and t for t in items):
            raise ProbeError(f"route {route!r} needs a non-empty list of target strings")
        targets[route] = list(items)
    if not targets:
        raise ProbeError("the targets file lists no routes")
    return targets


# ---- what the browser's network events showed ------------------------------------------------------

def canonical_url(url: str) -> str:
    """A URL as Chromium reports it, for matching: lower-case host, IP literals in one form, default
    ports and fragments dropped, an empty path as '/'."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return url
    host = (parts.hostname or "").rstrip(".")
    with contextlib.suppress(ValueError):
        host = ipaddress.ip_address(host).exploded
    scheme = parts.scheme.lower()
    if port == DEFAULT_PORTS.get(scheme):
        port = None
    authority = host + (f":{port}" if port is not None else "")
    query = f"?{parts.query}" if parts.query else ""
    return f"{scheme}://{authority}{parts.path or '/'}{query}"


class Evidence:
    """Every request of a context (pages, popups, frames, the service worker) by canonical URL, with
    what kind of request it was, so each route is judged by its own requests only."""

    def __init__(self, context: Any, probe_page: Any = None) -> None:
        self.probe_page = probe_page
        self.observed: dict[str, list[tuple[str, str, str]]] = defaultdict(list)  # url -> [(kind, detail, route)]
        self.redirects: dict[str, str] = {}
        context.on("request", _guarded(self._on_request))
        context.on("response", _guarded(self._on_response))
        context.on("requestfailed", _guarded(self._on_failed))

    def _route_of(self, request: Any) -> str | None:
        """Which probe route made this request (None: not one the page makes)."""
        if request.service_worker is not None:
            return "service-worker-fetch"
        kind = request.resource_type
        simple = {"fetch": "fetch", "image": "img", "script": "script", "stylesheet": "css", "ping": "beacon"}
        if kind in simple:
            return simple[kind]
        if kind == "document":
            if request.method == "POST":
                return "form-post"
            try:
                frame = request.frame
            except Exception:
                return "popup"  # a new window's first navigation starts before its frame exists
            if frame.parent_frame is not None:
                return "iframe"
            return "popup" if frame.page != self.probe_page else None
        return None

    def _on_request(self, request: Any) -> None:
        previous = request.redirected_from
        if previous is not None:
            self.redirects[canonical_url(previous.url)] = canonical_url(request.url)

    def _on_response(self, response: Any) -> None:
        url = canonical_url(response.url)
        request = response.request
        if 300 <= response.status < 400 and request.redirected_to is not None:
            return
        route = self._route_of(_first(request))
        refusal = refusal_from_headers(response.headers)  # no round trip: handlers must not block on the driver
        if refusal is not None:
            detail = f"egresswall refused ({refusal[0]}): {refusal[1]}"
            self.observed[url].append(("refused", detail, route or ""))
        else:
            self.observed[url].append(("answered", f"HTTP {response.status}", route or ""))

    def _on_failed(self, request: Any) -> None:
        code = _net_error(request.failure)
        if code == "ERR_ABORTED":
            return  # the page or the runner cancelled it (a closed popup, a finished probe)
        kind = "answered" if code in PEER_ANSWERED else "failed"
        route = self._route_of(_first(request))
        self.observed[canonical_url(request.url)].append((kind, code or str(request.failure), route or ""))

    def judge(self, route: str, url: str) -> tuple[str, str] | None:
        """('reached'|'blocked', detail) from what the browser saw for ``url`` (after its redirects),
        made by ``route``."""
        current = canonical_url(url)
        for _ in range(10):
            if current not in self.redirects:
                break
            current = self.redirects[current]
        seen = [(k, d) for k, d, r in self.observed.get(current, []) if r == route]
        for kind in ("answered", "refused", "failed"):  # the most alarming observation wins
            details = [detail for k, detail in seen if k == kind]
            if details:
                return ("reached" if kind == "answered" else "blocked"), details[-1]
        return None


def _first(request: Any) -> Any:
    """The first request of a redirect chain (the one the page made)."""
    while request.redirected_from is not None:
        request = request.redirected_from
    return request


def _guarded(handler):
    """An exception in a Playwright event handler (sync API) must not reach the dispatcher."""

    def guarded(item: Any) -> None:
        try:
            handler(item)
        except Exception as err:  # noqa: BLE001 - one unreadable event must not stop the probe
            print(f"probe: ignored a network event ({handler.__name__}): {err!r}", file=sys.stderr, flush=True)

    return guarded


def _headers(response: Any) -> dict[str, str]:
    try:
        return response.all_headers()
    except Exception:
        return {k.lower(): v for k, v in response.headers.items()}


def _net_error(text: str | None) -> str | None:
    for word in (text or "").replace(":", " ").split():
        if word.startswith("net::"):
            return word[5:]
        if word.startswith("ERR_"):
            return word
    return None


def final_outcome(route: str, target: str, page_outcome: str, page_error: str | None,
                  evidence: Evidence) -> dict[str, Any]:
    judged = None if route in PAGE_ONLY else evidence.judge(route, target)
    if judged is not None:
        outcome, error = judged
    elif page_outcome == "answered":
        outcome, error = "reached", page_error
    elif page_outcome == "failed":
        outcome, error = "blocked", page_error
    elif page_outcome == "sent":
        outcome = "error"
        error = (f"{page_error}; not observable from the browser (no request showed up): judge by the proxy's "
                 "log and the stand-ins")
    elif page_outcome in OUTCOMES:
        outcome, error = page_outcome, page_error
    else:
        outcome, error = "error", f"unexpected page outcome {page_outcome!r}: {page_error}"
    return {"route": route, "target": target, "outcome": outcome, "error": error}


# ---- the run -----------------------------------------------------------------------------------------

def run_probe(page_url: str, targets: Mapping[str, Any], proxy: str, weaken: Iterable[str] = frozenset(),
              timeout: float = 10, *, trust_cert_files: Sequence[str] = (), executable: str | None = None,
              sandbox: bool | None = None) -> list[dict[str, Any]]:
    """Load the probe page at ``page_url`` in a Chromium contained behind ``proxy`` (HOST:PORT) and
    return one ``{"route", "target", "outcome", "error"}`` per attempt, for every target of every route.

    ``timeout`` is per attempt (seconds). ``weaken`` ("loopback-bypass", "webrtc") turns a containment
    switch off, for the lab's negative tests only. ``trust_cert_files``: certificates (a lab HTTPS
    host's, the proxy's CA) whose key Chromium accepts. Uses Playwright's sync API: call it from a
    thread without a running asyncio loop (``asyncio.to_thread`` from async code)."""
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright

    targets = validate_targets(targets)
    containment = ContainmentOptions.weakened(weaken)
    extra = []
    page_origin = _origin(page_url)
    if page_origin.startswith("http://") and "service-worker-fetch" in targets:
        # Service workers need a secure context; an http:// probe page (which can also try http://
        # targets without mixed-content blocking) is declared one. This changes no network behaviour.
        extra.append(f"--unsafely-treat-insecure-origin-as-secure={page_origin}")
    plan = plan_launch(proxy, containment=containment, ca_files=trust_cert_files, executable=executable,
                       sandbox=sandbox, extra_args=extra)
    in_page = sum(len(v) for k, v in targets.items() if k not in RUNNER_ROUTES)
    page_budget = timeout * (math.ceil(in_page / CONCURRENCY) + 1) + 5
    try:
        with sync_playwright() as playwright:
            browser = launch(playwright, plan)
            try:
                context = browser.new_context(service_workers="allow")
                evidence = Evidence(context)
                context.add_init_script(
                    "window.__egresswallProbe = " + json.dumps({"targets": {k: v for k, v in targets.items()
                                                                            if k not in RUNNER_ROUTES},
                                                                "timeout": int(timeout * 1000),
                                                                "concurrency": CONCURRENCY}) + ";")
                page = context.new_page()
                evidence.probe_page = page
                try:
                    response = page.goto(page_url, timeout=timeout * 1000, wait_until="load")
                except PlaywrightError as err:
                    raise ProbeError(f"the probe page {page_url} did not load: {str(err).splitlines()[0]}") from None
                if response is None or response.status != 200:
                    raise ProbeError(f"the probe page {page_url} answered {response.status if response else 'nothing'}")
                page_results = _wait_for_page(page, page_budget)
                results = []
                for route in RUNNER_ROUTES:
                    for target in targets.get(route, []):
                        results.append(_navigate(context, route, target, timeout))
                time.sleep(0.5)  # late network events (beacons, closed popups)
                reported = {(r.get("route"), r.get("target")): r for r in page_results}
                for route, items in targets.items():
                    if route in RUNNER_ROUTES:
                        continue
                    for target in items:
                        row = reported.get((route, target))
                        if row is None:
                            results.append({"route": route, "target": target, "outcome": "error",
                                            "error": "the probe page did not report this attempt"})
                        else:
                            results.append(final_outcome(route, target, row.get("outcome", "error"), row.get("error"),
                                                         evidence))
                context.close()
                return _in_target_order(results, targets)
            finally:
                browser.close()
    finally:
        plan.cleanup()


def _wait_for_page(page: Any, budget: float) -> list[dict[str, Any]]:
    from playwright.sync_api import Error as PlaywrightError

    with contextlib.suppress(PlaywrightError):  # report what there is; missing attempts become errors
        page.wait_for_function("() => window.__egresswallProbe && window.__egresswallProbe.done === true",
                               timeout=budget * 1000, polling=200)
    state = page.evaluate("() => window.__egresswallProbe || {}")
    if state.get("error"):
        raise ProbeError(f"the probe page failed: {state['error']}")
    return list(state.get("results") or [])


def _navigate(context: Any, route: str, target: str, timeout: float) -> dict[str, Any]:
    """A top-level navigation in a fresh tab of the probe's context (redirects followed)."""
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page = context.new_page()
    try:
        try:
            response = page.goto(target, timeout=timeout * 1000, wait_until="load")
        except PlaywrightTimeout:
            return {"route": route, "target": target, "outcome": "timeout", "error": f"nothing within {timeout:g} s"}
        except PlaywrightError as err:
            code = _net_error(str(err)) or str(err).splitlines()[0]
            outcome = "reached" if code in PEER_ANSWERED else "blocked"
            return {"route": route, "target": target, "outcome": outcome, "error": code}
        if response is None:
            return {"route": route, "target": target, "outcome": "error", "error": "no response (same-document?)"}
        refusal = refusal_from_headers(_headers(response))
        if refusal is not None:
            return {"route": route, "target": target, "outcome": "blocked",
                    "error": f"egresswall refused ({refusal[0]}): {refusal[1]}"}
        where = f" from {response.url}" if canonical_url(response.url) != canonical_url(target) else ""
        return {"route": route, "target": target, "outcome": "reached", "error": f"HTTP {response.status}{where}"}
    finally:
        page.close()


def _in_target_order(results: list[dict[str, Any]], targets: Mapping[str, list[str]]) -> list[dict[str, Any]]:
    order = {(route, target): i for i, (route, target) in enumerate((r, t) for r, ts in targets.items() for t in ts)}
    return sorted(results, key=lambda r: order.get((r["route"], r["target"]), len(order)))


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"
