"""The page-load lab: an HTTPS page of 60 subresources from 12 host names, written to disk and served by
nginx (HTTP/2 on some hosts, HTTP/1.1 on the others), plus a WebSocket echo behind nginx.

Every host name has its own loopback address (127.0.0.110 and up), so Chromium cannot coalesce two
names onto one HTTP/2 connection in the direct run (it may when names share an address and a
certificate) while it never can through a proxy: each target opens what a real site would make it open.
One self-signed certificate names all twelve; the browser accepts it by its key
(``--ignore-certificate-errors-spki-list``, the launcher's ``ca_files``).

The page counts what arrived itself: ``window.__settled`` turns true once the XHR has answered and the
WebSocket has echoed and closed, and ``window.__scripts`` lists every script that ran.
"""

from __future__ import annotations

import asyncio
import json
import random
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

DOMAIN = "pageload.example"
FIRST_OCTET = 110  # 127.0.0.110 ... 127.0.0.121
FONT_CANDIDATES = ("/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
                   "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")


@dataclass(frozen=True)
class Host:
    label: str
    http2: bool
    address: str

    @property
    def name(self) -> str:
        return f"{self.label}.{DOMAIN}"


# (label, serves HTTP/2): about half and half, as on sites that mix their own servers with third parties'.
HOST_PLAN = (("www", True), ("static", True), ("js1", True), ("js2", False), ("img1", True), ("img2", False),
             ("img3", True), ("cdn", False), ("fonts", True), ("api", False), ("ws", False), ("analytics", False))
HOSTS = tuple(Host(label, http2, f"127.0.0.{FIRST_OCTET + i}") for i, (label, http2) in enumerate(HOST_PLAN))
BY_LABEL = {host.label: host for host in HOSTS}


@dataclass(frozen=True)
class Resource:
    host: str  # label
    path: str
    kind: str  # css, js, png, font, xhr
    size: int


def _resources() -> list[Resource]:
    rng = random.Random(15)  # the same page every run
    items = [Resource("static", f"/css/style{i}.css", "css", rng.randint(6, 30) * 1024) for i in range(6)]
    items += [Resource("js1", f"/js/app{i}.js", "js", rng.randint(10, 80) * 1024) for i in range(8)]
    items += [Resource("js2", f"/js/lib{i}.js", "js", rng.randint(10, 60) * 1024) for i in range(8)]
    items += [Resource("img1", f"/img/photo{i}.png", "png", rng.randint(20, 90) * 1024) for i in range(10)]
    items += [Resource("img2", f"/img/thumb{i}.png", "png", rng.randint(3, 12) * 1024) for i in range(10)]
    items += [Resource("img3", f"/img/icon{i}.png", "png", rng.randint(1, 4) * 1024) for i in range(6)]
    items += [Resource("cdn", f"/vendor/vendor{i}.js", "js", rng.randint(30, 120) * 1024) for i in range(3)]
    items += [Resource("cdn", f"/banner/banner{i}.png", "png", rng.randint(30, 60) * 1024) for i in range(3)]
    items += [Resource("analytics", f"/px/pixel{i}.png", "png", 100) for i in range(3)]
    items += [Resource("fonts", "/font/body.ttf", "font", 0)]
    items += [Resource("api", "/api/data.json", "xhr", 4 * 1024)]
    return items


RESOURCES = tuple(_resources())
WEBSOCKET_PATH = "/echo"


class PageLab:
    """The page's files under WORK/www/HOST/, the nginx servers that serve them, and the echo server."""

    def __init__(self, work: Path, port: int, echo_port: int) -> None:
        self.work, self.port, self.echo_port = work, port, echo_port
        self.www = work / "www"

    def origin(self, label: str, scheme: str = "https") -> str:
        return f"{scheme}://{BY_LABEL[label].name}:{self.port}"

    @property
    def page_url(self) -> str:
        return self.origin("www") + "/index.html"

    def subresource_urls(self) -> set[str]:
        """What a complete load fetches besides the page: 59 URLs and the WebSocket."""
        return {self.origin(r.host) + r.path for r in RESOURCES} | {self.origin("ws", "wss") + WEBSOCKET_PATH}

    def write(self) -> None:
        rng = random.Random(1515)
        for host in HOSTS:
            (self.www / host.label).mkdir(parents=True, exist_ok=True)
        font = next((Path(f) for f in FONT_CANDIDATES if Path(f).exists()), None)
        if font is None:
            raise RuntimeError(f"no font to serve: install fonts-liberation (looked for {FONT_CANDIDATES})")
        for item in RESOURCES:
            target = self.www / item.host / item.path.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            if item.kind == "css":
                body = _stylesheet(rng, item, self.origin("fonts") if item.path.endswith("style0.css") else None)
            elif item.kind == "js":
                body = _script(rng, item)
            elif item.kind == "png":
                body = _png(rng, item.size)
            elif item.kind == "font":
                body = font.read_bytes()
            else:
                body = json.dumps({"items": [rng.randbytes(24).hex() for _ in range(item.size // 54)]}).encode()
            target.write_bytes(body)
        (self.www / "www" / "index.html").write_text(self._page())

    def _page(self) -> str:
        css = [r for r in RESOURCES if r.kind == "css"]
        head_js = [r for r in RESOURCES if r.kind == "js" and r.host == "js1"][:4]
        tail_js = [r for r in RESOURCES if r.kind == "js" and r not in head_js]
        images = [r for r in RESOURCES if r.kind == "png"]
        xhr = next(r for r in RESOURCES if r.kind == "xhr")
        ws = self.origin("ws", "wss") + WEBSOCKET_PATH
        lines = ["<!doctype html>", "<html><head><meta charset='utf-8'><title>page-load lab</title>",
                 "<link rel='icon' href='data:,'>",  # no favicon request: it is not part of the page
                 "<script>",
                 "window.__scripts = []; window.__xhr = null; window.__ws = null;",
                 "let pending = 2; const done = () => { if (--pending === 0) {",
                 "  window.__settledAt = performance.now(); window.__settled = true; } };",
                 "const xhr = new XMLHttpRequest();",
                 f"xhr.open('GET', '{self.origin(xhr.host)}{xhr.path}');",
                 "xhr.onload = () => { window.__xhr = xhr.status; done(); };",
                 "xhr.onerror = () => { window.__xhr = 'error'; done(); };",
                 "xhr.send();",
                 f"const ws = new WebSocket('{ws}');",
                 "ws.onopen = () => ws.send('ping from the page-load lab');",
                 "ws.onmessage = (m) => { window.__ws = m.data; ws.close(); };",
                 "ws.onerror = () => { window.__ws = window.__ws || 'error'; };",
                 "ws.onclose = () => done();",
                 "</script>"]
        lines += [f"<link rel='stylesheet' href='{self.origin(r.host)}{r.path}'>" for r in css]
        lines += [f"<script src='{self.origin(r.host)}{r.path}'></script>" for r in head_js]
        lines += ["</head><body><h1>The page-load lab</h1>",
                  "<p class='lead'>Sixty subresources from twelve host names, the shape of a news page.</p>"]
        lines += [f"<img src='{self.origin(r.host)}{r.path}' alt='' width='64' height='64'>" for r in images]
        lines += [f"<script src='{self.origin(r.host)}{r.path}' defer></script>" for r in tail_js]
        lines += ["</body></html>", ""]
        return "\n".join(lines)

    def nginx_servers(self, cert: Path, key: Path, status_port: int) -> str:
        """The ``http { }`` body: one server per host on its own address, and nginx's counters on
        127.0.0.1:``status_port`` (``accepts`` counts every connection made to any of them)."""
        servers = [
            "  access_log off; sendfile on; keepalive_requests 10000; keepalive_timeout 120;",
            "  include /etc/nginx/mime.types;",
            f"  ssl_certificate {cert}; ssl_certificate_key {key};",
            "  map $http_upgrade $connection_upgrade { default upgrade; '' close; }",
            f"  server {{ listen 127.0.0.1:{status_port}; location = /status {{ stub_status; }} }}",
        ]
        for host in HOSTS:
            listen = f"{host.address}:{self.port} ssl" + (" http2" if host.http2 else "")
            body = [f"listen {listen};", f"server_name {host.name};", f"root {self.www / host.label};",
                    # the page is on another origin: fonts and the XHR need CORS, and timing entries the TAO header
                    "add_header Access-Control-Allow-Origin * always;", "add_header Timing-Allow-Origin *;",
                    "add_header Cache-Control no-store;"]
            if host.label == "fonts":  # Debian's mime.types has no ttf
                body += ["location /font/ { types { } default_type font/ttf; }"]
            if host.label == "ws":
                body += [f"location = {WEBSOCKET_PATH} {{ proxy_pass http://127.0.0.1:{self.echo_port};",
                         "proxy_http_version 1.1; proxy_set_header Upgrade $http_upgrade;",
                         "proxy_set_header Connection $connection_upgrade; }"]
            servers.append("  server { " + " ".join(body) + " }")
        return "\n".join(servers)

    def listens(self) -> list[tuple[str, int]]:
        return [(host.address, self.port) for host in HOSTS]


def _stylesheet(rng: random.Random, item: Resource, font_origin: str | None) -> bytes:
    parts = []
    if font_origin:
        parts.append(f"@font-face {{ font-family: LabSans; src: url({font_origin}/font/body.ttf) "
                     "format('truetype'); }\nbody { font-family: LabSans, sans-serif; }\n")
    n = 0
    while sum(map(len, parts)) < item.size:
        color, margin = rng.randrange(1 << 24), (rng.randint(0, 40), rng.randint(0, 40))
        parts.append(f".c{item.path[-6:-4]}-{n} {{ color: #{color:06x}; margin: {margin[0]}px {margin[1]}px; "
                     f"padding: {rng.randint(0, 9)}px; }}\n")
        n += 1
    return "".join(parts).encode()


def _script(rng: random.Random, item: Resource) -> bytes:
    """Valid JavaScript of about ``item.size`` bytes that records that it ran."""
    name = item.path.rsplit("/", 1)[1]
    head = f"window.__scripts.push({name!r});\n"
    blob = rng.randbytes(max(0, item.size - len(head) - 40) // 2).hex()
    return (head + f"var _blob_{name.replace('.', '_')} = '{blob}';\n").encode()


def _png(rng: random.Random, size: int) -> bytes:
    """A valid PNG of noise (incompressible) of about ``size`` bytes."""
    side = max(1, int((size / 3) ** 0.5))
    raw = b"".join(b"\x00" + rng.randbytes(side * 3) for _ in range(side))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 1)) + chunk(b"IEND", b"")


class EchoServer:
    """A WebSocket echo on 127.0.0.1 (plain ws; nginx terminates TLS in front of it), in a thread."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Future | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the WebSocket echo server did not start")

    def _run(self) -> None:
        from websockets.asyncio.server import serve

        async def echo(connection) -> None:
            async for message in connection:
                await connection.send(message)

        async def main() -> None:
            self._stop = self._loop.create_future()
            async with serve(echo, "127.0.0.1", self.port):
                self._ready.set()
                await self._stop

        self._loop.run_until_complete(main())

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set_result, None)
        self._thread.join(5)
