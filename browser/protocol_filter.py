"""What a remote Playwright client may ask the shared browser: a filter of Playwright's protocol.

A browser server is not contained by its flags alone. Measured: a client's
``browser.new_context(proxy=...)`` overrides the server's proxy (Chromium's per-context proxy), so the
page's requests go wherever the client says. The relay in ``server.py`` therefore passes every client
message through ``ProtocolFilter.from_client`` and refuses:

* any message whose parameters carry a network option: ``proxy`` (a per-context proxy),
  ``clientCertificates`` (Playwright then puts a proxy of its own, in the driver, in front of the
  context) or ``socksProxyPort``; launch options (``executablePath``, ``args``, ...); and server-side
  file paths for the driver to read (``localPaths``, ``localDirectory``);
* every method of the interfaces that launch or connect browsers or open sockets from the driver
  process itself: ``BrowserType`` (launch, launchPersistentContext, connectOverCDP), ``LocalUtils``
  (``connect``), ``Android``/``AndroidDevice`` (adb on localhost:5037), ``Electron``, ``SocksSupport``,
  ``DebugController``, ``CDPSession``, ``JsonPipe``;
* raw CDP (``newCDPSession``, ``newBrowserCDPSession``: CDP can create a context with its own proxy),
  ``Playwright.newRequest`` (an HTTP client in the driver process that no browser flag governs),
  ``Browser.startServer``/``stopServer`` and ``killForTests``;
* what writes the server's files or watches other clients: ``Artifact.saveAs`` (the driver copies a download,
  whose bytes the page chose, to any path the client names; a remote client uses ``saveAsStream``),
  ``Browser.startTracing``/``stopTracing`` (one trace of the whole browser, every client's pages in it), the
  recorder (``BrowserContext.showRecorder``: a browser of its own, launched without the server's flags), and
  a trace ``name`` that is not a plain file name (the driver joins it to its traces folder: ``../..``);
* a navigation (``Frame.goto``) anywhere but an http, https or data: URL or ``about:blank`` (``file:`` reads the
  server's files, ``chrome:`` and ``about:`` reach the browser's own pages, one of which crashes it), and a
  context's ``baseURL`` that is not http or https (relative navigations resolve against it).

Everything else passes unchanged. Object types come from the server's own ``__create__`` messages (the
connection's ``ObjectTree``, shared with the context accounting), so a message for an object the filter
has not seen created is refused too (fail closed).

Chromium's sandbox: a client cannot turn it off. ``chromiumSandbox`` and a launch's ``args`` only exist
in launch calls (``BrowserType.launch*``, ``Android.launchBrowser``, ``Electron.launch``), which are
refused whole, and the driver runs ``launch-server`` with launching denied besides; the relay forwards
no handshake header but ``User-Agent``, so Playwright's ``x-playwright-launch-options`` header never
reaches the driver. As a second layer ``chromiumSandbox`` is refused anywhere in a call's parameters,
and so is a sandbox-disabling switch in any ``args`` list.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from .objects import ObjectTree, read_server_message

REFUSED_INTERFACES = {
    "BrowserType": "launching or connecting browsers is the server's business",
    "LocalUtils": "LocalUtils.connect would open a connection from the server process",
    "Android": "Android devices are reached over adb from the server process",
    "AndroidDevice": "Android devices are reached over adb from the server process",
    "AndroidSocket": "Android devices are reached over adb from the server process",
    "Electron": "launching Electron is not offered",
    "ElectronApplication": "launching Electron is not offered",
    "SocksSupport": "a client-side SOCKS tunnel would carry the browser's traffic past egresswall",
    "DebugController": "the debug controller is not offered",
    "CDPSession": "raw CDP can give a context its own proxy",
    "JsonPipe": "raw protocol pipes are not offered",
}
REFUSED_METHODS = {
    ("Browser", "newBrowserCDPSession"): "raw CDP can give a context its own proxy",
    ("BrowserContext", "newCDPSession"): "raw CDP can give a context its own proxy",
    ("Playwright", "newRequest"): "an API request context fetches from the server process, past the browser's proxy",
    ("Browser", "startServer"): "the browser cannot start servers for clients",
    ("Browser", "stopServer"): "the browser cannot start servers for clients",
    ("Browser", "killForTests"): "killing the shared browser is not offered",
    ("Browser", "newContextForReuse"): "the test runner's context reuse is not offered; use newContext",
    # Files on the server, and what other clients do.
    ("Artifact", "saveAs"): "the driver would write the file to a path on the server; a remote client saves "
                            "downloads, videos and traces with saveAsStream, which sends it the bytes",
    ("Browser", "startTracing"): "a browser-wide trace records every client's pages",
    ("Browser", "stopTracing"): "a browser-wide trace records every client's pages",
    ("BrowserContext", "showRecorder"): "the recorder launches a browser of its own, outside the server's flags",
    ("BrowserContext", "enableRecorder"): "the recorder launches a browser of its own, outside the server's flags",
}
# Tracing's ``name`` becomes a file name in the driver's traces folder: a plain name only, no way out of it.
NAMED_FILES = {("Tracing", "tracingStart"), ("Tracing", "tracingStartChunk")}
# Where a client may send a page: the web (through egresswall), data: and the blank page. A file: URL reads the
# server's files (its temporary folder holds the driver's launch settings and other clients' downloads), and a
# chrome: URL (or an about: one, which Chromium maps to chrome:) reaches the browser's own pages (one crashes it).
NAVIGABLE_SCHEMES = ("http", "https", "data")
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
# Anywhere in a message's parameters.
REFUSED_PARAMS = {
    "proxy": "a proxy option would override egresswall for this context",
    "clientCertificates": "client certificates make Playwright proxy the context's traffic itself",
    "socksProxyPort": "a SOCKS proxy option would carry traffic past egresswall",
    "chromiumSandbox": "Chromium's sandbox is the server's setting",
}
# Chromium switches that turn its sandbox (or a part of it) off, refused in any "args" list.
SANDBOX_SWITCHES = ("--no-sandbox", "--disable-setuid-sandbox", "--no-zygote-sandbox",
                    "--disable-seccomp-filter-sandbox", "--disable-namespace-sandbox", "--disable-gpu-sandbox")
# At the top level of a message's parameters: options of a launch.
REFUSED_LAUNCH_PARAMS = ("executablePath", "args", "ignoreDefaultArgs", "ignoreAllDefaultArgs", "chromiumSandbox",
                         "env", "channel", "cdpPort", "endpointURL", "wsEndpoint", "userDataDir")
# At the top level too: paths on the server that the driver would read (a remote client sends the
# files' contents instead; these let a client read the server's files and upload them).
REFUSED_FILE_PARAMS = ("localPaths", "localDirectory")


@dataclass(frozen=True)
class Refusal:
    message_id: int | str | None
    reason: str

    def reply(self) -> str | None:
        """The protocol error the client gets for its call (None when the message had no id)."""
        if self.message_id is None:
            return None
        return json.dumps({"id": self.message_id, "error": {"error": {
            "name": "Error", "stack": "", "message": f"egresswall browser-server refused this call: {self.reason}"}}})


@dataclass(frozen=True)
class ClientCall:
    """A client message that passed the filter."""

    call_id: int | str | None
    guid: str
    method: str
    interface: str


class ProtocolFilter:
    """Per connection: the verdict on each client message, by the types in the connection's object tree."""

    def __init__(self, tree: ObjectTree | None = None) -> None:
        self.tree = tree if tree is not None else ObjectTree()

    @property
    def types(self) -> dict[str, str]:
        return self.tree.types

    def from_server(self, text: str | bytes) -> None:
        """Track the objects a server message creates or drops (the relay does this through the tree)."""
        self.tree.observe(read_server_message(text))

    def from_client(self, text: str | bytes) -> Refusal | None:
        verdict = self.check(text)
        return verdict if isinstance(verdict, Refusal) else None

    def check(self, text: str | bytes) -> ClientCall | Refusal:
        if isinstance(text, bytes):
            return Refusal(None, "binary frames are not part of Playwright's protocol")
        try:
            message = json.loads(text)
        except ValueError:
            return Refusal(None, "a message that is not JSON")
        if not isinstance(message, dict):
            return Refusal(None, "a message that is not a JSON object")
        raw_id = message.get("id")
        message_id = raw_id if isinstance(raw_id, int | str) and not isinstance(raw_id, bool) else None
        guid, method = message.get("guid"), message.get("method")
        if not isinstance(guid, str) or not isinstance(method, str):
            return Refusal(message_id, "a message without guid and method")
        interface = self.tree.type_of(guid)
        if interface is None:
            return Refusal(message_id, f"{method} on an object this connection was never given ({guid[:80]!r})")
        refusal = self._refusal(message_id, interface, method, message.get("params"))
        return refusal if refusal is not None else ClientCall(message_id, guid, method, interface)

    @staticmethod
    def _refusal(message_id: int | str | None, interface: str, method: str, params: Any) -> Refusal | None:
        if interface in REFUSED_INTERFACES:
            return Refusal(message_id, f"{interface}.{method}: {REFUSED_INTERFACES[interface]}")
        if method.startswith("launch") or (method.startswith("connect") and interface != "WebSocketRoute"):
            return Refusal(message_id, f"{interface}.{method}: launching or connecting browsers is not offered")
        why = REFUSED_METHODS.get((interface, method))
        if why:
            return Refusal(message_id, f"{interface}.{method}: {why}")
        if params is None:
            return None
        if not isinstance(params, dict):
            return Refusal(message_id, f"{interface}.{method} with parameters that are not an object")
        if (interface, method) == ("Frame", "goto") and not _navigable(params.get("url"), relative=True):
            return Refusal(message_id, f"{interface}.{method} to {str(params.get('url'))[:80]!r}: pages go to http, "
                                       "https or data: URLs (file: reads the server's files, chrome: reaches the "
                                       "browser's own pages)")
        if "baseURL" in params and not _navigable(params["baseURL"], relative=False, blank=False):
            return Refusal(message_id, f"{interface}.{method} with the baseURL {str(params['baseURL'])[:80]!r}: "
                                       "relative URLs resolve against http or https only")
        if (interface, method) in NAMED_FILES and not _plain_file_name(params.get("name")):
            return Refusal(message_id, f"{interface}.{method} with the name {str(params.get('name'))[:80]!r}: it names "
                                       "a file in the driver's traces folder, and may not lead out of it")
        for name in REFUSED_LAUNCH_PARAMS:
            if name in params:
                return Refusal(message_id, f"{interface}.{method} with {name!r}: launch options are fixed by "
                                           "the server")
        for name in REFUSED_FILE_PARAMS:
            if name in params:
                return Refusal(message_id, f"{interface}.{method} with {name!r}: the driver would read the server's "
                                           "files; send the files' contents")
        found = _find_key(params, REFUSED_PARAMS)
        if found:
            why = REFUSED_PARAMS.get(found, "parameters nested too deeply to check")
            return Refusal(message_id, f"{interface}.{method} with {found!r}: {why}")
        switch = _sandbox_switch(params)
        if switch:
            return Refusal(message_id, f"{interface}.{method} with {switch!r}: Chromium's sandbox is the server's "
                                       "setting")
        return None


def _navigable(url: Any, *, relative: bool, blank: bool = True) -> bool:
    """Whether ``url`` (as a URL parser reads it: C0 controls and spaces around it dropped, tabs and line breaks
    inside it removed) names an http, https or data: URL, or ``about:blank`` (``blank``); one with no scheme
    only when ``relative`` (it is resolved against the context's baseURL, itself held to http or https)."""
    if not isinstance(url, str):
        return False
    text = url.translate(_TABS_AND_BREAKS).strip("".join(map(chr, range(33))))
    match = _SCHEME.match(text)
    if match is None:
        return relative
    scheme = match.group(1).lower()
    if scheme == "about":
        return blank and text.lower().split("#", 1)[0].split("?", 1)[0] == "about:blank"
    return scheme in NAVIGABLE_SCHEMES


_TABS_AND_BREAKS = {ord("\t"): None, ord("\n"): None, ord("\r"): None}


def _plain_file_name(name: Any) -> bool:
    """None (the driver picks the name), or a name with no separator and no leading dot ('..' included)."""
    return name is None or (isinstance(name, str) and name != "" and not name.startswith(".")
                            and "/" not in name and "\\" not in name and "\0" not in name)


def _sandbox_switch(value: Any, depth: int = 0) -> str | None:
    """A sandbox-disabling switch in an ``args`` list anywhere in the parameters."""
    if depth > 64:
        return None  # _find_key already refused anything this deep
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "args" and isinstance(item, list):
                for arg in item:
                    if isinstance(arg, str) and arg.split("=", 1)[0].strip().lower() in SANDBOX_SWITCHES:
                        return arg[:60]
            found = _sandbox_switch(item, depth + 1)
            if found:
                return found
    elif isinstance(value, list):
        for item in value:
            found = _sandbox_switch(item, depth + 1)
            if found:
                return found
    return None


def _find_key(value: Any, names: dict[str, str], depth: int = 0) -> str | None:
    """The first key in ``names`` anywhere in a JSON value. (Playwright serialises page values as
    ``{"k": name, "v": value}`` lists, so a page's own data never shows up as a key here.)"""
    if depth > 64:
        return "(nesting)"
    if isinstance(value, dict):
        for key, item in value.items():
            if key in names and item not in (None, [], {}):
                return key
            found = _find_key(item, names, depth + 1)
            if found:
                return found
    elif isinstance(value, list):
        for item in value:
            found = _find_key(item, names, depth + 1)
            if found:
                return found
    return None
