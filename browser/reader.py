"""The page reader: load a URL in the contained Chromium and return its main content as markdown,
or say exactly why it could not be read.

Each URL gets a fresh browser context. A URL that cannot be read is reported with its reason and
never with an invented page:

* ``refused``     egresswall refused it (its rule and reason, from the refusal the proxy sent, or for a
                  refused CONNECT from the proxy's own audit record) — also when a redirect led there;
* ``timeout``     no page within the time limit;
* ``http-status`` the server answered 4xx/5xx;
* ``non-html``    the response is not an HTML document (a PDF, an image, plain text...);
* ``empty``       an HTML page without readable text;
* ``error``       any other network error, with Chromium's own error code.

A page is read even when some of its own requests are refused (a script's ``fetch``, an image on a host
the policy or the session does not admit): those are listed with the result (``refused_requests``: the
URL without its query, the rule and the reason), found the same two ways as below.

A refused plain-HTTP request comes back as the proxy's 403, whose ``X-Egresswall-*`` headers are the
refusal itself: its rule and reason are read from them, and nobody is asked again. For a refused CONNECT
(https, wss) Chromium shows only ``ERR_TUNNEL_CONNECTION_FAILED`` and hides the proxy's 403. The reason then
comes from a ``RefusalSource``: ``AuditRefusals`` reads the decision records of an in-process proxy;
``ProxyQuery`` asks a running proxy the same CONNECT again and reads the rule and reason from its refusal.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

from policy.hosts import DEFAULT_PORTS, HostFormError, normalise_host
from policy.wire import client_reason, refusal_from_headers

HTML_TYPES = ("text/html", "application/xhtml+xml")
SESSION_CHALLENGE = "session:required"  # policy/sessions.py REQUIRED
TUNNEL_ERRORS = ("ERR_TUNNEL_CONNECTION_FAILED",)
MAX_ASKED = 20  # a page's refused tunnels whose reason is looked up


@dataclass(frozen=True)
class ReadLimits:
    max_chars: int = 20_000  # characters of content per page
    timeout: float = 30.0  # seconds per page
    max_links: int = 10  # URLs per call

    def __post_init__(self) -> None:
        if self.max_chars < 1 or self.timeout <= 0 or self.max_links < 1:
            raise ValueError("--max-chars, --timeout and --max-links must be positive")


@dataclass
class PageResult:
    url: str
    read: bool
    final_url: str | None = None
    status: int | None = None
    title: str | None = None
    content: str | None = None
    chars: int = 0  # the length of the whole content, before any cut
    truncated: bool = False
    problem: str | None = None  # refused | timeout | http-status | non-html | empty | error | limit
    reason: str | None = None
    rule: str | None = None
    content_type: str | None = None
    redirected_from: list[str] | None = None
    refused_requests: list[dict[str, str]] | None = None  # the page's own requests egresswall refused

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class Refusal:
    rule: str
    reason: str
    url: str  # the URL the refusal was for (after redirects, the one that was refused)


class RefusalSource(Protocol):
    def find(self, url: str, since: float) -> Refusal | None: ...


# ---- where refusal reasons come from -------------------------------------------------------------

def _norm_host(host: str | None) -> str:
    """The host as the proxy's records name it: the core's normaliser (IDNA 2008 / UTS-46, IP literals
    canonical, IPv4-mapped unwrapped); a host it refuses is compared as written, lower-cased."""
    host = host or ""
    try:
        return normalise_host(host)[0]
    except HostFormError:
        return host.lower()


def _host_port(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:
        port = None
    if port is None:
        port = DEFAULT_PORTS.get(scheme)
    return scheme, _norm_host(parts.hostname), port


class AuditRefusals:
    """Collects the refusals an in-process proxy decides (an ``AuditLog`` listener) and finds the one
    for a URL: same host and port, decided since the page started loading."""

    def __init__(self, keep: int = 5000) -> None:
        self._records: deque[tuple[float, dict[str, Any]]] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def record(self, record: dict[str, Any]) -> None:
        # session:required is the 407 that asks a browser for its session's credentials, which a context
        # with a session answers: it is not why anything failed, and a later record would be.
        if (record.get("event") == "decision" and record.get("verdict") == "refuse"
                and record.get("rule") != SESSION_CHALLENGE):
            with self._lock:
                self._records.append((time.time(), record))  # when it was decided, on this process's clock

    def find(self, url: str, since: float) -> Refusal | None:
        _, host, port = _host_port(url)
        path = urlsplit(url).path or "/"
        with self._lock:
            recent = [r for seen, r in self._records if seen >= since - 0.5]
        best: tuple[int, dict[str, Any]] | None = None
        for record in recent:
            score = 0
            if record.get("host") is not None:
                if _norm_host(str(record["host"])) != host or record.get("port") != port:
                    continue
                score = 2 if record.get("path") in (None, path) else 1
            elif host and host in str(record.get("url", "")).lower():
                score = 1  # refused for its form before it had a target (e.g. localhost)
            else:
                continue
            if best is None or score >= best[0]:
                best = (score, record)
        if best is None:
            return None
        record = best[1]
        # What the proxy would have told the client, not the record's whole reason: this report goes to the agent
        # that asked for the page (policy.wire.client_reason).
        reason = client_reason(str(record.get("stage")), str(record.get("rule")), str(record.get("reason")),
                               record.get("host"))
        return Refusal(str(record.get("rule")), reason, url)


class ProxyQuery:
    """For a proxy egresswall does not run in-process: ask it the refused CONNECT again and read its
    answer's rule and reason. A refused CONNECT opens nothing upstream."""

    def __init__(self, host: str, port: int, timeout: float = 5.0) -> None:
        self.host, self.port, self.timeout = host, port, timeout

    def find(self, url: str, since: float) -> Refusal | None:
        scheme, host, port = _host_port(url)
        if not host or port is None:
            return None
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            with socket.create_connection((self.host, self.port), timeout=self.timeout) as sock:
                sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
                head = b""
                while b"\r\n\r\n" not in head and len(head) < 65536:
                    chunk = sock.recv(4096)
                    if not chunk:
                        break
                    head += chunk
        except OSError:
            return None
        lines = head.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
        headers = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        refusal = refusal_from_headers(headers)
        return Refusal(refusal[0], refusal[1], url) if refusal else None


# ---- the reader ----------------------------------------------------------------------------------

class PageReader:
    """Reads pages with one (contained) Playwright ``Browser`` (sync API), a fresh context per URL."""

    def __init__(self, browser: Any, refusals: RefusalSource | None = None, limits: ReadLimits | None = None,
                 context_proxy: dict[str, str] | None = None) -> None:
        self.browser = browser
        self.refusals = refusals
        self.limits = limits or ReadLimits()
        # Each context's proxy option: the browser's proxy with a session's credentials (egresswall browse's
        # session); None: the browser's own proxy.
        self.context_proxy = context_proxy

    def read_all(self, urls: list[str], screenshot: str | None = None) -> list[PageResult]:
        results = []
        for index, url in enumerate(urls):
            if index >= self.limits.max_links:
                results.append(PageResult(url, False, problem="limit",
                                          reason=f"not read: over the limit of {self.limits.max_links} links per call"))
                continue
            results.append(self.read(url, screenshot_path(screenshot, index, len(urls)) if screenshot else None))
        return results

    def read(self, url: str, screenshot: str | None = None) -> PageResult:
        scheme = urlsplit(url).scheme.lower()
        if scheme not in ("http", "https"):
            return PageResult(url, False, problem="error", reason=f"not an http or https URL: {url!r}")
        since = time.time()
        options: dict[str, Any] = {"proxy": dict(self.context_proxy)} if self.context_proxy else {}
        context = self.browser.new_context(accept_downloads=False, service_workers="block", **options)
        try:
            result = self._read_in(context, url, since, screenshot)
        finally:
            context.close()
        return result

    def _read_in(self, context: Any, url: str, since: float, screenshot: str | None) -> PageResult:
        page = context.new_page()
        navigation = _Navigation(page)
        result = self._read_page(page, navigation, url, since, screenshot)
        result.refused_requests = self._refused_requests(navigation, since) or None
        return result

    def _refused_requests(self, navigation: _Navigation, since: float) -> list[dict[str, str]]:
        """The page's own requests egresswall refused: from the refusal itself (plain HTTP) or, for a
        refused tunnel Chromium reports as a network error, from the refusal source."""
        found: dict[tuple[str, str], dict[str, str]] = {}
        for request_url, refusal in navigation.refused:
            found.setdefault((_without_query(request_url), refusal[0]), {
                "url": _without_query(request_url), "rule": refusal[0], "reason": refusal[1]})
        asked: set[tuple[str, str, int | None]] = set()
        for request_url, failure in navigation.failed:
            # Only a refused tunnel hides its refusal (plain HTTP brings it as a 403, above); each host is
            # asked about once, and at most MAX_ASKED of them (a running proxy is asked the CONNECT again).
            where = _host_port(request_url)
            if (not self.refusals or _net_error(failure) not in TUNNEL_ERRORS or where in asked
                    or len(asked) >= MAX_ASKED):
                continue
            asked.add(where)
            refusal = self.refusals.find(request_url, since)
            if refusal is not None:
                found.setdefault((_without_query(request_url), refusal.rule), {
                    "url": _without_query(request_url), "rule": refusal.rule, "reason": refusal.reason})
        return list(found.values())

    def _read_page(self, page: Any, navigation: _Navigation, url: str, since: float,
                   screenshot: str | None) -> PageResult:
        from playwright.sync_api import Error as PlaywrightError
        from playwright.sync_api import TimeoutError as PlaywrightTimeout

        deadline = time.monotonic() + self.limits.timeout
        response = None
        failure = None
        try:
            response = page.goto(url, timeout=self.limits.timeout * 1000, wait_until="domcontentloaded")
        except PlaywrightTimeout:
            if navigation.document is None:
                return PageResult(url, False, problem="timeout", redirected_from=navigation.chain_before() or None,
                                  reason=f"no response within {self.limits.timeout:g} seconds")
        except PlaywrightError as err:
            failure = str(err).split("\n", 1)[0]
        if response is None:
            response = navigation.document
        if response is None:
            return self._failed(url, since, navigation, failure or "no response")
        result = self._judge_response(url, since, response, navigation)
        if result is not None:
            return result
        if failure is not None and "ERR_ABORTED" not in failure:
            return self._failed(url, since, navigation, failure)
        self._settle(page, deadline)
        if navigation.document is not None and navigation.document is not response:
            # the page went on to another document (a meta refresh, a script's location change): judged too
            late = self._judge_response(url, since, navigation.document, navigation)
            if late is not None:
                return late
            response = navigation.document
        final_url = page.url
        title = _safe(lambda: page.title(), "")
        html = _safe(lambda: page.content(), "")
        text = extract_markdown(html, final_url) or _safe(
            lambda: page.evaluate("document.body ? document.body.innerText : ''"), "").strip()
        if screenshot:
            _safe(lambda: page.screenshot(path=screenshot, timeout=5000), None)
        base = PageResult(url, False, final_url=final_url, status=response.status, title=title or None,
                          content_type=_content_type(response), redirected_from=navigation.chain_before() or None)
        if not text.strip():
            base.problem, base.reason = "empty", "the page has no readable text"
            return base
        base.read = True
        base.chars = len(text)
        base.content, base.truncated = cut_at_paragraph(text, self.limits.max_chars)
        return base

    def _judge_response(self, url: str, since: float, response: Any, navigation: _Navigation) -> PageResult | None:
        """A refusal, an error status or a non-HTML document ends the read here."""
        headers = _safe(lambda: response.all_headers(), {}) or {}
        status = response.status
        common = dict(final_url=response.url, status=status, content_type=_content_type(response),
                      redirected_from=navigation.chain_before() or None)
        refusal = refusal_from_headers(headers)
        if refusal is not None:
            # egresswall's own refusal (it strips these headers from every upstream response): the refusal
            # itself says which rule and why. Asking again (ProxyQuery) would ask another question.
            rule, reason = refusal
            return PageResult(url, False, problem="refused", rule=rule, reason=_refused_reason(reason, response.url,
                                                                                                url), **common)
        if status >= 400:
            return PageResult(url, False, problem="http-status", reason=f"HTTP {status} {response.status_text}".strip(),
                              **common)
        content_type = common["content_type"] or ""
        if not any(content_type.startswith(t) for t in HTML_TYPES):
            return PageResult(url, False, problem="non-html",
                              reason=f"not an HTML page: {content_type or 'no Content-Type'}", **common)
        return None

    def _failed(self, url: str, since: float, navigation: _Navigation, failure: str) -> PageResult:
        failed_url = navigation.failed_url or url
        code = _net_error(navigation.failure_text or failure)
        refusal = self.refusals.find(failed_url, since) if self.refusals and _may_be_refusal(code) else None
        chain = navigation.chain_before() or None
        if refusal is not None:
            return PageResult(url, False, final_url=failed_url, problem="refused", rule=refusal.rule,
                              reason=_refused_reason(refusal.reason, failed_url, url), redirected_from=chain)
        if navigation.download_type:
            return PageResult(url, False, final_url=failed_url, problem="non-html",
                              content_type=navigation.download_type,
                              reason=f"not an HTML page: {navigation.download_type}", redirected_from=chain)
        return PageResult(url, False, final_url=failed_url, problem="error", redirected_from=chain,
                          reason=f"Chromium could not load it: {code or failure}")

    def _settle(self, page: Any, deadline: float) -> None:
        """Give the page until its load event (and a short quiet period for script-built pages)."""
        remaining = deadline - time.monotonic()
        if remaining > 0:
            _safe(lambda: page.wait_for_load_state("load", timeout=remaining * 1000), None)
        remaining = min(2.0, deadline - time.monotonic())
        if remaining > 0:
            _safe(lambda: page.wait_for_load_state("networkidle", timeout=remaining * 1000), None)


class _Navigation:
    """The main frame's document requests: the redirect chain, the last response, the failure."""

    def __init__(self, page: Any) -> None:
        self.page = page
        self.chain: list[str] = []
        self.document: Any = None
        self.failed_url: str | None = None
        self.failure_text: str | None = None
        self.download_type: str | None = None
        self.refused: list[tuple[str, tuple[str, str]]] = []  # the page's own requests: (url, (rule, reason))
        self.failed: list[tuple[str, str]] = []  # the page's own requests that failed: (url, Chromium's error)
        page.on("request", self._on_request)
        page.on("requestfailed", self._on_failed)
        page.on("response", self._on_response)

    def _main(self, request: Any) -> bool:
        try:
            return request.is_navigation_request() and request.frame == self.page.main_frame
        except Exception:
            return False

    def _on_request(self, request: Any) -> None:
        if self._main(request):
            self.chain.append(request.url)

    def _on_failed(self, request: Any) -> None:
        if self._main(request):
            self.failed_url, self.failure_text = request.url, request.failure
        else:
            self.failed.append((request.url, request.failure or ""))

    def _on_response(self, response: Any) -> None:
        if not self._main(response.request):
            refusal = refusal_from_headers(_safe(lambda: response.headers, {}) or {})
            if refusal is not None and refusal[0] != SESSION_CHALLENGE:
                self.refused.append((response.url, refusal))
            return
        if not 300 <= response.status < 400:
            self.document = response
            content_type = _content_type(response)
            if content_type and not any(content_type.startswith(t) for t in HTML_TYPES):
                self.download_type = content_type

    def chain_before(self) -> list[str]:
        return self.chain[:-1]


# ---- helpers -------------------------------------------------------------------------------------

def extract_markdown(html: str, url: str | None) -> str:
    """The page's main content as markdown (trafilatura), or '' when it finds none."""
    if not html:
        return ""
    import trafilatura
    from trafilatura.settings import use_config

    config = use_config()
    config.set("DEFAULT", "MIN_EXTRACTED_SIZE", "1")  # short pages are pages too
    config.set("DEFAULT", "MIN_OUTPUT_SIZE", "1")
    config.set("DEFAULT", "EXTRACTION_TIMEOUT", "0")  # its timeout uses signals, which need the main thread
    text = trafilatura.extract(html, url=url, output_format="markdown", include_links=True, include_tables=True,
                               include_comments=False, favor_recall=True, config=config)
    return (text or "").strip()


def cut_at_paragraph(text: str, limit: int) -> tuple[str, bool]:
    """At most ``limit`` characters, cut at the last paragraph break before it (or line break, or
    space, when no paragraph break falls in the second half)."""
    if len(text) <= limit:
        return text, False
    window = text[:limit]
    for separator in ("\n\n", "\n", " "):
        cut = window.rfind(separator)
        if cut >= limit // 2:
            return window[:cut].rstrip(), True
    return window, True


def screenshot_path(path: str, index: int, count: int) -> str:
    if count == 1:
        return path
    stem, dot, ext = path.rpartition(".")
    return f"{stem}-{index + 1}.{ext}" if dot and "/" not in ext else f"{path}-{index + 1}"


def _content_type(response: Any) -> str | None:
    value = _safe(lambda: response.header_value("content-type"), None)
    return value.split(";", 1)[0].strip().lower() if value else None


def _net_error(text: str | None) -> str | None:
    if not text:
        return None
    for word in text.replace(":", " ").split():
        if word.startswith("net::"):
            return word[5:]
        if word.startswith("ERR_"):
            return word
    return None


def _may_be_refusal(code: str | None) -> bool:
    # A refused CONNECT is ERR_TUNNEL_CONNECTION_FAILED; a refusal may also abort a navigation.
    return code is None or code in TUNNEL_ERRORS or code in ("ERR_ABORTED", "ERR_FAILED")


def _without_query(url: str) -> str:
    """A URL as a report shows it: no query or fragment (what an exfiltrating request carries; the audit
    log keeps no query strings by default either)."""
    return url.split("#", 1)[0].split("?", 1)[0]


def _refused_reason(reason: str, refused_url: str, asked_url: str) -> str:
    if refused_url.rstrip("/") != asked_url.rstrip("/"):
        return f"{reason} (after a redirect to {refused_url})"
    return reason


def _safe(call, default):
    try:
        return call()
    except Exception:
        return default


# ---- output --------------------------------------------------------------------------------------

def format_text(result: PageResult) -> str:
    rows = [("URL", result.url)]
    if result.final_url and result.final_url != result.url:
        rows.append(("Final URL", result.final_url))
    if result.status is not None:
        rows.append(("Status", str(result.status)))
    if result.title:
        rows.append(("Title", result.title))
    if not result.read:
        rows.append(("NOT READ", _problem_words(result.problem)))
        if result.rule:
            rows.append(("Rule", result.rule))
        rows.append(("Reason", result.reason or ""))
        rows += _refused_rows(result)
        return "\n".join(f"{k + ':':<11}{v}" for k, v in rows) + "\n"
    rows += _refused_rows(result)
    body = "\n".join(f"{k + ':':<11}{v}" for k, v in rows) + "\n\n" + (result.content or "") + "\n"
    return body + (_cut_note(result) + "\n" if result.truncated else "")


def _refused_rows(result: PageResult) -> list[tuple[str, str]]:
    return [("Refused", f"{r['url']} ({r['rule']}: {r['reason']})") for r in result.refused_requests or ()]


def _refused_lines(result: PageResult) -> list[str]:
    if not result.refused_requests:
        return []
    return ["", "Requests of the page egresswall refused:", ""] + [
        f"- <{r['url']}> `{r['rule']}`: {r['reason']}" for r in result.refused_requests]


def format_markdown(result: PageResult) -> str:
    if not result.read:
        lines = [f"## Not read: {result.url}", "", f"- **{_problem_words(result.problem)}**"]
        if result.rule:
            lines.append(f"- rule: `{result.rule}`")
        lines.append(f"- reason: {result.reason}")
        return "\n".join(lines + _refused_lines(result)) + "\n"
    lines = [f"# {result.title or result.final_url}", "", f"<{result.final_url}> · HTTP {result.status}", "",
             result.content or ""]
    if result.truncated:
        lines += ["", f"*{_cut_note(result)}*"]
    return "\n".join(lines + _refused_lines(result)) + "\n"


def _cut_note(result: PageResult) -> str:
    return f"[cut at {len(result.content or '')} of {result.chars} characters; raise --max-chars to read more]"


def _problem_words(problem: str | None) -> str:
    return {"refused": "refused by egresswall", "timeout": "timed out", "http-status": "HTTP error status",
            "non-html": "not an HTML page", "empty": "empty page", "limit": "over the link limit",
            "error": "network error"}.get(problem or "", problem or "not read")
