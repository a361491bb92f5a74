"""Round 23 (chromium): run the contained Chromium, the real proxy and a small lab inside a network
namespace and a mount namespace of their own, so that nothing the browser might send on its own can
leave: the namespace has only ``lo``. Its ``/etc/resolv.conf`` (a bind mount, in this mount namespace
only) names a "system" DNS server on 127.0.0.53:53 that logs every query: any query it logs is one the
BROWSER made itself (the proxy asks only the lab's DnsLab on 127.0.0.1:<random>).

Run as ``unshare --net --mount --fork python tests/r23_chromium_netns.py SCENARIO.json OUT.json``
(``run_in_netns`` does that). The scenario names the transport, the page's attempts (JavaScript run in
a page served by the lab's public origin) and the navigations ``page.goto`` makes; the output has what
every listener saw, the system DNS server's queries and the proxy's audit.

Listeners: TCP on 0.0.0.0:PORT and [::]:PORT (every loopback address, v4 and v6), UDP on the same
port, and UDP on 443 and 80 (QUIC / WebTransport defaults). The policy admits only 127.0.0.2 (the
public origin), and lists PORT in ports.http and ports.connect so that any refusal comes from the
address (or host) rules, not from the port.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

SYSTEM_DNS = "127.0.0.53"


class TcpWatch:
    def __init__(self, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            self.sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        self.sock.bind((host, port))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.hits: list[dict] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            conn.settimeout(0.5)
            try:
                first = conn.recv(200)
            except OSError:
                first = b""
            self.hits.append({"peer": str(peer[0]), "local": str(conn.getsockname()[0]),
                              "first": first.decode("latin-1")})
            conn.close()


class UdpWatch:
    def __init__(self, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        if family == socket.AF_INET6:
            self.sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        self.sock.bind((host, port))
        self.hits: list[dict] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                data, peer = self.sock.recvfrom(65535)
            except OSError:
                return
            self.hits.append({"peer": str(peer[0]), "bytes": len(data)})


def free_port() -> int:
    """A port free for TCP and UDP on every address of this namespace."""
    for _ in range(50):
        s = socket.socket()
        s.bind(("0.0.0.0", 0))
        port = s.getsockname()[1]
        s.close()
        try:
            u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            u.bind(("0.0.0.0", port))
            u.close()
            return port
        except OSError:
            continue
    raise RuntimeError("no free port")


PAGE = """<!doctype html><html><head><title>r23</title>HEAD</head><body><p>r23 page</p>
<script>
window.__done = false;
window.__results = {};
async function attempt(name, fn) {
  try { window.__results[name] = String(await fn()); }
  catch (e) { window.__results[name] = 'error: ' + e; }
}
async function runAll() {
  const jobs = [];
  ATTEMPTS
  await Promise.race([Promise.all(jobs), new Promise((r) => setTimeout(r, 6000))]);
  window.__done = true;
}
runAll();
</script></body></html>"""


def main(scenario_path: str, out_path: str) -> int:
    scenario = json.loads(Path(scenario_path).read_text())
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    work = Path(tempfile.mkdtemp(prefix="r23-chromium-"))
    resolv = work / "resolv.conf"
    resolv.write_text(f"nameserver {SYSTEM_DNS}\noptions timeout:1 attempts:1\n")
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)
    subprocess.run(["mount", "--bind", str(resolv), "/etc/resolv.conf"], check=True)
    # Belt and braces: the namespace must have no route anywhere but lo.
    routes = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True).stdout
    assert all(" lo " in r or r.startswith("local ") or "dev lo" in r for r in routes.splitlines() if r), routes

    from dnslab import Behaviour, DnsLab, Record
    from labnet import INTERNAL_IP, PUBLIC_IP, Upstream, self_signed
    from proxyproc import TRANSPORTS, ProxyProcess

    from browser import launch as launcher
    from browser.launch import plan_launch

    system_dns = DnsLab({}, host=SYSTEM_DNS, port=53).__enter__()
    zone = {
        "public.lab.example": [Record("A", PUBLIC_IP)],
        "internal.lab.example": [Record("A", INTERNAL_IP)],
        "loop.lab.example": [Record("A", "127.0.0.1")],
    }
    for name, records in scenario.get("zone", {}).items():
        if isinstance(records, dict):  # {"sequence": [[[TYPE, VALUE], ...], ...]}: the n-th query's answer
            zone[name] = Behaviour(sequence=[[Record(t, v, ttl=0) for t, v in answer]
                                             for answer in records["sequence"]])
        else:
            zone[name] = [Record(t, v, ttl=0) for t, v in records]
    lab_dns = DnsLab(zone).__enter__()
    tls, cert_file = self_signed(["public.lab.example"], str(work))
    public = Upstream(PUBLIC_IP, "public", tls=tls if scenario.get("tls") else None)
    port = free_port()
    tcp = [TcpWatch("0.0.0.0", port), TcpWatch("::", port)]
    udp = [UdpWatch("0.0.0.0", port), UdpWatch("::", port), UdpWatch("0.0.0.0", 443), UdpWatch("::", 443),
           UdpWatch("0.0.0.0", 80), UdpWatch("::", 80)]

    policy = work / "policy.yaml"
    ports = sorted({80, public.port, port})
    policy.write_text(f"version: 1\nmode: enforce\ndefault: allow\n"
                      f"ports:\n  http: {ports}\n  connect: {sorted({443, port, public.port})}\n"
                      f"addresses:\n  allow: [{PUBLIC_IP}/32]\n"
                      f"resolver:\n  nameservers: ['{lab_dns.address}']\n  timeout: 1\n")
    proxy = ProxyProcess(["--policy", str(policy), *TRANSPORTS[scenario["transport"]]], work / "audit.jsonl")
    subs = {"PORT": str(port), "PPORT": str(proxy.port), "APORT": str(proxy.admin_port),
            "PUBPORT": str(public.port)}

    def fill(text: str) -> str:
        for key in sorted(subs, key=len, reverse=True):
            text = text.replace("{" + key + "}", subs[key])
        return text

    attempts = "\n  ".join(f"jobs.push(attempt({json.dumps(name)}, async () => {{ {fill(code)} }}));"
                           for name, code in scenario.get("attempts", {}).items())
    page_html = PAGE.replace("HEAD", fill(scenario.get("head", ""))).replace("ATTEMPTS", attempts)
    public.serve("/r23/page", page_html)
    for path, (kind, body) in scenario.get("extra_pages", {}).items():
        public.serve(path, fill(body), kind)
    page_scheme = "https" if scenario.get("tls") else "http"
    page_host = scenario.get("page_host", "public.lab.example")
    page_url = f"{page_scheme}://{page_host}:{public.port}/r23/page"

    out: dict = {"port": port, "proxy_port": proxy.port, "admin_port": proxy.admin_port, "results": {},
                 "navigations": {}}
    time.sleep(0.3)
    out["system_dns_before"] = len(system_dns.queries)  # the lab's own look-ups (http.server's getfqdn)
    plan = plan_launch(f"{proxy.host}:{proxy.port}", sandbox=False if os.geteuid() == 0 else None,
                       ca_files=[cert_file])
    try:
        from playwright.sync_api import sync_playwright

        with sync_playwright() as playwright:
            browser = launcher.launch(playwright, plan)
            try:
                context = browser.new_context()
                page = context.new_page()
                if scenario.get("attempts") or scenario.get("head"):
                    page.goto(page_url, timeout=15_000)
                    page.wait_for_function("window.__done === true", timeout=20_000)
                    out["results"] = page.evaluate("window.__results")
                for url in scenario.get("navigations", []):
                    url = fill(url)
                    try:
                        response = page.goto(url, timeout=8_000)
                        body = page.content()
                        out["navigations"][url] = {"status": response.status if response else None,
                                                   "body": body[:600], "final": page.url}
                    except Exception as err:  # noqa: BLE001 - the error is the result
                        out["navigations"][url] = {"error": str(err).splitlines()[0][:300]}
                time.sleep(float(scenario.get("settle", 2.0)))
            finally:
                browser.close()
    finally:
        plan.cleanup()
        time.sleep(0.3)
        proxy.stop()
    out["tcp_hits"] = [h for w in tcp for h in w.hits]
    out["udp_hits"] = [h for w in udp for h in w.hits]
    out["system_dns"] = [list(q) for q in system_dns.queries[out["system_dns_before"]:]]
    out["lab_dns"] = [list(q) for q in lab_dns.queries]
    out["decisions"] = [{k: d.get(k) for k in ("method", "host", "port", "verdict", "rule_id", "stage", "reason")}
                        for d in proxy.decisions()]
    out["guard"] = proxy.guard_events()
    out["public_requests"] = [[m, p] for m, p, _ in public.requests]
    Path(out_path).write_text(json.dumps(out, indent=1))
    return 0


def run_in_netns(scenario: dict, tmp_path: Path, timeout: float = 120) -> dict:
    """Run ``scenario`` in a fresh network + mount namespace; return the output JSON."""
    scenario_file, out_file = tmp_path / "scenario.json", tmp_path / "out.json"
    scenario_file.write_text(json.dumps(scenario))
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    done = subprocess.run(["unshare", "--net", "--mount", "--fork", sys.executable, str(Path(__file__).resolve()),
                           str(scenario_file), str(out_file)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)
    if done.returncode != 0 or not out_file.exists():
        raise RuntimeError(f"the namespace run failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                           f"{done.stderr[-5000:]}")
    return json.loads(out_file.read_text())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
