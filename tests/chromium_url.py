"""Ask real Chromium's URL parser (``new URL()`` in an about:blank page) where a URL would connect.

Only JavaScript is evaluated: no page is loaded and nothing is fetched. As a second layer the browser is
started with every name mapped to NOTFOUND and a proxy on a closed loopback port, so even a background
request Chromium makes on its own could not leave the machine.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

CANDIDATES = ("/usr/lib/chromium/chromium", "/usr/bin/chromium")  # the binary first: no wrapper flags
DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}

_PARSE = """(urls) => urls.map((text) => {
  try {
    const u = new URL(text);
    return {protocol: u.protocol, hostname: u.hostname, port: u.port};
  } catch (e) {
    return null;
  }
})"""


def chromium_path() -> str | None:
    for candidate in CANDIDATES:
        if Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


@dataclass(frozen=True)
class Where:
    """Where Chromium would connect: scheme, host (A-label name or canonical IP text), port."""

    scheme: str
    host: str
    port: int


def normalise_chromium(result: dict | None) -> Where | None:
    """Chromium's answer in egresswall's terms, or None when Chromium would not connect with it (it threw,
    or the scheme is not one egresswall proxies).

    Two spellings count as the same host: the one trailing dot Chromium keeps ("example.com." is the
    root-anchored "example.com", which is what egresswall resolves), and an IPv4-mapped IPv6 literal,
    which egresswall unwraps to the IPv4 address a dual-stack socket reaches.
    """
    if result is None:
        return None
    scheme = result["protocol"].removesuffix(":")
    if scheme not in DEFAULT_PORTS:
        return None
    host = result["hostname"]
    if host.startswith("[") and host.endswith("]"):
        address = ipaddress.IPv6Address(host[1:-1])
        host = str(address.ipv4_mapped or address)
    else:
        host = host.removesuffix(".")
    port = int(result["port"]) if result["port"] else DEFAULT_PORTS[scheme]
    return Where(scheme, host, port)


class ChromiumUrlParser:
    """One headless Chromium, one about:blank page; ``parse(urls)`` answers a batch in one round trip."""

    def __init__(self, executable: str | None = None) -> None:
        from playwright.sync_api import sync_playwright

        executable = executable or chromium_path()
        if executable is None:
            raise RuntimeError("no Chromium found at " + " or ".join(CANDIDATES))
        args = ["--headless", "--disable-background-networking", "--disable-component-update", "--no-first-run",
                "--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=http://127.0.0.1:9",
                "--proxy-bypass-list=<-loopback>"]
        if os.geteuid() == 0:
            args.insert(0, "--no-sandbox")
        self._playwright = sync_playwright().start()
        try:
            self.browser = self._playwright.chromium.launch(executable_path=executable, headless=True, args=args)
            self.page = self.browser.new_page()
            self.version = self.browser.version
        except Exception:
            self._playwright.stop()
            raise

    def parse(self, urls: list[str]) -> list[dict | None]:
        return self.page.evaluate(_PARSE, urls)

    def where(self, urls: list[str]) -> list[Where | None]:
        return [normalise_chromium(result) for result in self.parse(urls)]

    def close(self) -> None:
        try:
            self.browser.close()
        finally:
            self._playwright.stop()
