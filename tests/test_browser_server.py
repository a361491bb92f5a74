"""``egresswall browser-server``: the protocol filter on its own, then the real server (the Playwright
driver's launch-server, the real Chromium, the real proxy) with a Playwright client that tries to get
around the proxy."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from unprivileged import NO_SANDBOX_ARGS

from browser.launch import ContainmentError
from browser.protocol_filter import ProtocolFilter
from browser.server import check_bind_address

ROOT = Path(__file__).resolve().parent.parent


# ---- the filter ----------------------------------------------------------------------------------------

def created(protocol: ProtocolFilter, kind: str, guid: str) -> None:
    protocol.from_server(json.dumps({"guid": "", "method": "__create__",
                                     "params": {"type": kind, "guid": guid, "initializer": {}}}))


def call(guid: str, method: str, params: dict | None = None, message_id: str = "c@1") -> str:
    return json.dumps({"id": message_id, "guid": guid, "method": method, "params": params or {}, "metadata": {}})


@pytest.fixture
def protocol() -> ProtocolFilter:
    protocol = ProtocolFilter()
    for kind, guid in (("Playwright", "playwright"), ("BrowserType", "browser-type@1"), ("Browser", "browser@1"),
                       ("BrowserContext", "browser-context@1"), ("Page", "page@1"), ("Frame", "frame@1"),
                       ("LocalUtils", "utils@1"), ("Android", "android@1"), ("WebSocketRoute", "ws-route@1"),
                       ("Artifact", "artifact@1"), ("Tracing", "tracing@1")):
        created(protocol, kind, guid)
    return protocol


@pytest.mark.parametrize("guid,method,params,why", [
    ("browser@1", "newContext", {"proxy": {"server": "http://10.0.0.1:3128"}}, "'proxy'"),
    ("browser@1", "newContextForReuse", {"proxy": {"server": "socks5://x:1"}}, "context reuse"),
    ("browser@1", "newContext", {"clientCertificates": [{"origin": "https://x"}]}, "'clientCertificates'"),
    ("playwright", "newRequest", {"baseURL": "http://10.0.0.1/"}, "Playwright.newRequest"),
    ("browser-type@1", "launch", {"executablePath": "/bin/sh"}, "BrowserType.launch"),
    ("browser-type@1", "connectOverCDP", {"endpointURL": "http://10.0.0.1:9222"}, "BrowserType.connectOverCDP"),
    ("browser-type@1", "launchPersistentContext", {"userDataDir": "/tmp/x"}, "BrowserType"),
    ("utils@1", "connect", {"wsEndpoint": "ws://10.0.0.1/"}, "LocalUtils.connect"),
    ("android@1", "devices", {}, "adb"),
    ("browser-context@1", "newCDPSession", {"page": {"guid": "page@1"}}, "raw CDP"),
    ("browser@1", "newBrowserCDPSession", {}, "raw CDP"),
    ("browser@1", "startServer", {}, "startServer"),
    ("frame@1", "setInputFiles", {"selector": "input", "localPaths": ["/etc/shadow"]}, "server's files"),
    ("page@nobody", "goto", {"url": "http://x/"}, "never given"),
    # Review round 15: the server's files and other clients' pages.
    ("artifact@1", "saveAs", {"path": "/root/.venv/lib/python3.12/site-packages/x.pth"}, "saveAsStream"),
    ("browser@1", "startTracing", {"categories": ["disabled-by-default-netlog"]}, "every client's pages"),
    ("browser@1", "stopTracing", {}, "every client's pages"),
    ("browser-context@1", "showRecorder", {"outputFile": "/tmp/out.py"}, "browser of its own"),
    ("tracing@1", "tracingStart", {"name": "../../../../tmp/x", "snapshots": True}, "may not lead out of it"),
    ("tracing@1", "tracingStartChunk", {"name": "a/b"}, "may not lead out of it"),
    ("tracing@1", "tracingStart", {"name": ".."}, "may not lead out of it"),
    ("tracing@1", "tracingStart", {"name": "x\\..\\y"}, "may not lead out of it"),
    ("tracing@1", "tracingStart", {"name": 7}, "may not lead out of it"),
    ("frame@1", "goto", {"url": "file:///tmp/"}, "file: reads the server's files"),
    ("frame@1", "goto", {"url": " \tFi\nLE:///proc/self/environ"}, "file: reads"),
    ("frame@1", "goto", {"url": "view-source:file:///etc/passwd"}, "file: reads"),
    ("frame@1", "goto", {"url": "chrome://inducebrowsercrashforrealz"}, "browser's own pages"),
    ("frame@1", "goto", {"url": "about:version"}, "browser's own pages"),
    ("frame@1", "goto", {"url": "javascript:location='file:///etc/passwd'"}, "http"),
    ("frame@1", "goto", {"url": None}, "http"),
    ("browser@1", "newContext", {"baseURL": "file:///tmp/"}, "relative URLs resolve against http or https"),
    ("browser@1", "newContext", {"baseURL": "about:blank"}, "relative URLs resolve against http or https"),
    ("browser@1", "newContext", {"baseURL": "tmp/"}, "relative URLs resolve against http or https"),
])
def test_filter_refuses_network_options_launches_and_raw_channels(protocol, guid, method, params, why):
    refusal = protocol.from_client(call(guid, method, params))
    assert refusal is not None and why in refusal.reason
    reply = json.loads(refusal.reply())
    assert reply["id"] == "c@1" and "egresswall browser-server refused" in reply["error"]["error"]["message"]


def test_filter_passes_ordinary_calls(protocol):
    assert protocol.from_client(call("", "initialize", {"sdkLanguage": "python"})) is None
    assert protocol.from_client(call("browser@1", "newContext", {"viewport": {"width": 800, "height": 600}})) is None
    assert protocol.from_client(call("browser-context@1", "newPage")) is None
    assert protocol.from_client(call("frame@1", "goto", {"url": "http://example.org/"})) is None
    # a page value that happens to be called "proxy" is serialised as {"k": ..., "v": ...}, not a key
    arg = {"value": {"o": [{"k": "proxy", "v": {"s": "x"}}]}, "handles": []}
    assert protocol.from_client(call("frame@1", "evaluateExpression", {"expression": "x => x", "arg": arg})) is None
    assert protocol.from_client(call("ws-route@1", "connect")) is None  # the page's own WebSocket, in Chromium
    assert protocol.from_client(call("artifact@1", "saveAsStream")) is None  # a remote client's download
    for url in ("https://example.org/", "HTTP://example.org", "about:blank", "data:text/html,<p>hi</p>", "/path",
                "page.html"):
        assert protocol.from_client(call("frame@1", "goto", {"url": url})) is None, url
    assert protocol.from_client(call("browser@1", "newContext", {"baseURL": "https://example.org/a/"})) is None
    assert protocol.from_client(call("tracing@1", "tracingStart", {"name": "trace-1", "snapshots": True})) is None
    assert protocol.from_client(call("tracing@1", "tracingStart", {"snapshots": True})) is None


def test_filter_closes_on_garbage(protocol):
    for message in (b"\x00binary", "not json", "[1,2]", json.dumps({"id": 1})):
        refusal = protocol.from_client(message)
        assert refusal is not None
    assert protocol.from_client(b"\x00").reply() is None  # no id to answer: the relay closes instead


def test_non_loopback_bind_is_refused_without_the_flag():
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.5"):
        check_bind_address(host, False)
    for host in ("0.0.0.0", "::", "10.1.2.3", "example.org"):
        with pytest.raises(ContainmentError, match="no authentication"):
            check_bind_address(host, False)
        check_bind_address(host, True)
    done = subprocess.run([sys.executable, "-m", "proxy.cli", "browser-server", "--host", "0.0.0.0", "--proxy",
                           "127.0.0.1:9"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "refusing to bind 0.0.0.0" in done.stderr


# ---- the real server ----------------------------------------------------------------------------------

class ServerProcess:
    """``egresswall browser-server`` as a process of its own (``extra``: more command-line options)."""

    def __init__(self, proxy: str, log: Path, *extra: str) -> None:
        self.log = log
        self._err = open(log, "wb")  # noqa: SIM115 - open for the process's life
        self.process = subprocess.Popen([sys.executable, "-m", "proxy.cli", "browser-server", "--port", "0",
                                         "--proxy", proxy, *NO_SANDBOX_ARGS, *extra], cwd=ROOT,
                                        stdout=subprocess.DEVNULL, stderr=self._err)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            match = re.search(r"listening on (ws://\S+)", log.read_text(errors="replace"))
            if match:
                self.endpoint = match.group(1)
                return
            if self.process.poll() is not None:
                break
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"browser-server did not start:\n{log.read_text(errors='replace')}")

    @property
    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """``GET /metrics`` of the server: sample (with its labels) → value."""
        from urllib.request import urlopen

        with urlopen(self.endpoint.replace("ws://", "http://") + "metrics", timeout=10) as response:
            text = response.read().decode()
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line and not line.startswith("#")}

    def resident_bytes(self) -> int:
        """The server process's own resident set (VmRSS), not the browser's."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._err.close()
        return self.process.returncode


@pytest.fixture
def server(lab, start_proxy, tmp_path):
    proxy = start_proxy(lab.policy_text())
    server = ServerProcess(f"{proxy.host}:{proxy.port}", tmp_path / "server.stderr")
    server.proxy = proxy
    yield server
    assert server.stop() == 0, server.stderr


@pytest.mark.parametrize("options, named", [(["--driver-port", "70000"], "--driver-port"),
                                            (["--port", "3999", "--driver-port", "3999"], "--driver-port"),
                                            (["--port", "99999"], "--port 99999"), (["--port", "-5"], "--port -5")])
def test_a_port_that_cannot_be_is_a_usage_error_before_anything_starts(options, named):
    """``--port 99999`` started the proxy and Chromium and then failed in bind() with an internal error (exit 70);
    ``--port -5`` blamed the host name (review round 16)."""
    done = subprocess.run([sys.executable, "-m", "proxy.cli", "browser-server", "--proxy", "127.0.0.1:9", *options],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and named in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert "internal error" not in done.stderr and "Chromium" not in done.stderr, done.stderr


@pytest.mark.integration
def test_the_driver_listens_at_the_driver_port_a_pod_s_filter_admits(lab, start_proxy, tmp_path):
    """compose/k8s/egress-lock.nft admits the driver's loopback port for the browser's user only, so the sidecar
    passes a fixed --driver-port (a random one was refused to the relay, and the server had no browser)."""
    import socket

    from playwright.sync_api import sync_playwright

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proxy = start_proxy(lab.policy_text())
    server = ServerProcess(f"{proxy.host}:{proxy.port}", tmp_path / "server.stderr", "--driver-port", str(port))
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()  # the driver, at that port
        with sync_playwright() as playwright:
            browser = playwright.chromium.connect(server.endpoint, timeout=30_000)
            try:
                page = browser.new_context().new_page()
                lab.public.serve("/driver-port", "<title>through the relay</title>")
                page.goto(f"http://public.lab.example:{lab.public.port}/driver-port")
                assert page.title() == "through the relay"
            finally:
                browser.close()
    finally:
        assert server.stop() == 0, server.stderr


@pytest.mark.integration
def test_client_cannot_get_around_the_proxy_and_the_stand_in_sees_nothing(lab, server):
    from playwright.sync_api import Error, sync_playwright

    before = (list(lab.internal.connections), list(lab.internal_tls.connections))
    port, tls_port = lab.public.port, lab.public_tls.port
    with sync_playwright() as playwright:
        browser = playwright.chromium.connect(server.endpoint, timeout=30_000)
        try:
            # 1. a context with its own proxy pointing straight at the stand-in
            with pytest.raises(Error, match="refused this call: Browser.newContext with 'proxy'"):
                browser.new_context(proxy={"server": f"http://127.0.0.3:{port}"})
            with pytest.raises(Error, match="clientCertificates"):
                browser.new_context(client_certificates=[{"origin": "https://x.example", "pfxPath": "/dev/null"}])
            # the connection survives refusals: the allowed page still loads
            context = browser.new_context()
            page = context.new_page()
            page.goto(f"http://public.lab.example:{port}/hello")
            assert page.inner_text("body") == "hello from public /hello"
            # 2. navigation to the internal stand-in, by name, by address, over TLS
            for target in (f"http://internal.lab.example:{port}/", f"http://127.0.0.3:{port}/",
                           f"http://[::ffff:127.0.0.3]:{port}/"):
                response = page.goto(target)
                assert response.status == 403 and response.headers["x-egresswall-rule"].startswith("special-purpose")
            with pytest.raises(Error, match="ERR_TUNNEL_CONNECTION_FAILED"):
                page.goto(f"https://internal.lab.example:{tls_port}/")
            # 3. the driver-side HTTP client goes through egresswall too, and a standalone one is refused
            try:
                api = context.request.get(f"http://127.0.0.3:{port}/")
            except Error:
                pass  # the proxy refused the tunnel: no response at all
            else:
                assert api.status == 403 and "x-egresswall-rule" in api.headers, (api.status, api.headers)
            # 4. raw CDP (which can give a context its own proxy) is refused
            with pytest.raises(Error, match="raw CDP"):
                context.new_cdp_session(page)
            context.close()
        finally:
            browser.close()
    # 5. a hand-written client asks for a driver-side HTTP client: refused
    assert "Playwright.newRequest" in asyncio.run(raw_new_request(server.endpoint))
    assert (lab.internal.connections, lab.internal_tls.connections) == before
    refused = [d for d in server.proxy.decisions() if d["verdict"] == "refuse"]
    assert {d["host"] for d in refused} >= {"internal.lab.example", "127.0.0.3"}
    # the context's own HTTP client (in the driver process) asked egresswall, which refused it
    assert any(d["method"] == "CONNECT" and d["host"] == "127.0.0.3" and d["port"] == port for d in refused)
    assert "refused from" in server.stderr


async def raw_new_request(endpoint: str) -> str:
    """A hand-written client: ask the Playwright object for a driver-side HTTP client, and check that a
    handshake with an Origin header (a web page) is refused outright."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    user_agent = f"Playwright/{_playwright_version()} (x64; test) python/3"
    with pytest.raises(InvalidStatus) as refused:
        await connect(endpoint, user_agent_header=user_agent, origin="http://evil.example")
    assert refused.value.response.status_code == 403
    async with connect(endpoint, user_agent_header=user_agent, max_size=None) as ws:
        await ws.send(json.dumps({"id": 1, "guid": "", "method": "initialize",
                                  "params": {"sdkLanguage": "python"}, "metadata": {}}))
        playwright_guid = None
        while playwright_guid is None:
            message = json.loads(await asyncio.wait_for(ws.recv(), 30))
            if message.get("method") == "__create__" and message["params"]["type"] == "Playwright":
                playwright_guid = message["params"]["guid"]
        await ws.send(json.dumps({"id": 2, "guid": playwright_guid, "method": "newRequest",
                                  "params": {"baseURL": "http://127.0.0.3/"}, "metadata": {}}))
        while True:
            message = json.loads(await asyncio.wait_for(ws.recv(), 30))
            if message.get("id") == 2:
                return message["error"]["error"]["message"]


def _playwright_version() -> str:
    from importlib.metadata import version

    return version("playwright")


def test_an_in_process_proxy_refuses_the_browser_server_and_its_driver(lab, tmp_path):
    """With --policy the browser server runs its proxy in-process, and neither the server's own port nor the
    Playwright driver's was one of that proxy's endpoints: a policy admitting loopback let a page connect to the
    server that drives its own browser (review round 17). Both are refused now, rule ``self``."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        driver_port = probe.getsockname()[1]
    policy = tmp_path / "loopback.yaml"
    policy.write_text(lab.policy_text().replace(f"allow: [{lab.public.host}/32]", "allow: [127.0.0.0/8]")
                      .replace(f"  http: {sorted({80, lab.public.port})}", "  http: ['1-65535']")
                      .replace(f"  connect: {sorted({443, lab.public_tls.port})}", "  connect: ['1-65535']"))
    log = tmp_path / "server.stderr"
    with open(log, "wb") as err:
        process = subprocess.Popen([sys.executable, "-m", "proxy.cli", "browser-server", "--port", "0", "--policy",
                                    str(policy), "--driver-port", str(driver_port), *NO_SANDBOX_ARGS], cwd=ROOT,
                                   stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline, match = time.monotonic() + 90, None
        while time.monotonic() < deadline and match is None and process.poll() is None:
            match = re.search(r"listening on ws://127\.0\.0\.1:(\d+)/ \(Chromium behind the proxy http://127\.0\.0\.1:(\d+)",
                              log.read_text(errors="replace"))
            time.sleep(0.1)
        assert match, log.read_text(errors="replace")
        server_port, proxy_port = int(match.group(1)), int(match.group(2))
        for port in (server_port, driver_port):
            with socket.create_connection(("127.0.0.1", proxy_port), timeout=10) as sock:
                sock.sendall(f"GET http://127.0.0.1:{port}/ HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
                answer = sock.recv(4096)
            assert answer.startswith(b"HTTP/1.1 403") and b"X-Egresswall-Rule: self" in answer, (port, answer)
            with socket.create_connection(("127.0.0.1", proxy_port), timeout=10) as sock:
                sock.sendall(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
                answer = sock.recv(4096)
            assert answer.startswith(b"HTTP/1.1 403") and b"X-Egresswall-Rule: self" in answer, (port, answer)
    finally:
        process.terminate()
        assert process.wait(30) == 0, log.read_text(errors="replace")
