"""The one place that builds the contained Chromium's command line.

Every byte the browser sends must go to egresswall. ``--proxy-server`` alone does not do that in this
Chromium (156, Debian; see ``../shared/design.md``, "Chromium facts"), so the plan also:

* removes the implicit loopback bypass (``--proxy-bypass-list=<-loopback>``): without it localhost,
  127/8, 169.254/16 and fe80::/10 go direct;
* stops WebRTC's UDP (``--webrtc-ip-handling-policy=disable_non_proxied_udp`` and the same
  ``webrtc.ip_handling_policy`` preference in the profile) and its mDNS announcements (feature
  ``WebRtcHideLocalIpsWithMdns`` disabled);
* turns off QUIC, DNS-over-HTTPS (``dns_over_https.mode = off`` in Local State), background networking,
  component updates, sync, pings, domain reliability and network prediction (prefetch/preconnect);
* passes every disabled feature — Playwright's own list included — in ONE ``--disable-features``:
  Chromium keeps only the last occurrence, so a second flag would silently drop the first list.

To own the whole command line the plan launches with ``ignore_default_args=True`` and passes
Playwright's default switches itself (copied from Playwright 1.65's ``chromiumSwitches.ts``), so no
flag Playwright adds can undo one of ours. ``browser_command_line`` reads the argv the browser process
actually got from /proc, and ``launch`` checks it before handing the browser out.

The proxy is also given to Playwright as its launch ``proxy`` option (it adds no flag, since default
arguments are ignored): Playwright's Node-side fetches (``context.request``, ``route.fetch``) use it,
so they go through egresswall too instead of leaving from the driver process.

Only Chromium-based engines are accepted: Firefox and WebKit ignore these switches (behind the same
proxy they would reach loopback and send WebRTC UDP directly).
"""

from __future__ import annotations

import base64
import getpass
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger("egresswall.browser")

# Debian's /usr/bin/chromium is a shell wrapper that adds flags of its own (--load-extension,
# --enable-remote-extensions, ...) and exports Google API keys: the real binary behind it is used.
DEBIAN_CHROMIUM = "/usr/lib/chromium/chromium"
CHROMIUM_ENGINES = frozenset({"chromium", "chrome", "chrome-beta", "msedge", "chromium-headless-shell"})
NON_CHROMIUM_ENGINES = frozenset({"firefox", "webkit"})

# Playwright 1.65's chromiumSwitches(), minus --disable-features/--enable-features (merged below).
PLAYWRIGHT_SWITCHES = (
    "--disable-field-trial-config",
    "--disable-background-networking",
    "--disable-background-timer-throttling",
    "--disable-backgrounding-occluded-windows",
    "--disable-back-forward-cache",
    "--disable-breakpad",
    "--disable-component-extensions-with-background-pages",
    "--disable-component-update",
    "--no-default-browser-check",
    "--disable-default-apps",
    "--disable-dev-shm-usage",
    "--disable-edgeupdater",
    "--disable-extensions",
    "--allow-pre-commit-input",
    "--disable-hang-monitor",
    "--disable-ipc-flooding-protection",
    "--disable-popup-blocking",
    "--disable-prompt-on-repost",
    "--disable-renderer-backgrounding",
    "--disable-updater-scheduler",
    "--force-color-profile=srgb",
    "--metrics-recording-only",
    "--no-first-run",
    "--password-store=basic",
    "--use-mock-keychain",
    "--no-service-autorun",
    "--disable-search-engine-choice-screen",
    "--unsafely-disable-devtools-self-xss-warnings",
    "--enable-unsafe-swiftshader",
    "--edge-skip-compat-layer-relaunch",
    "--disable-stack-profiler",
    "--disable-infobars",
    "--disable-sync",
    "--do-not-de-elevate",
)
PLAYWRIGHT_DISABLED_FEATURES = (
    "AvoidUnnecessaryBeforeUnloadCheckSync", "DestroyProfileOnBrowserClose", "HttpsUpgrades",
    "HttpsFirstBalancedModeAutoEnable", "LensOverlay", "MediaRouter", "PaintHolding", "ThirdPartyStoragePartitioning",
    "AvoidCorsURLLoaderRestartOnRedirect", "TcpPortRandomizationWin", "OptimizationHints",
    "NetworkTimeServiceQuerying", "AimEnabled", "PreconnectToSearch", "msForceBrowserSignIn",
    "msEdgeUpdateLaunchServicesPreferredVersion",
)
PLAYWRIGHT_ENABLED_FEATURES = ("CDPScreenshotNewSurface", "SkipListAccountsWithoutGaiaCookies")
PLAYWRIGHT_HEADLESS_SWITCHES = (
    "--headless", "--hide-scrollbars", "--mute-audio",
    "--blink-settings=primaryHoverType=2,availableHoverTypes=2,primaryPointerType=4,availablePointerTypes=4",
)

# Ours: each one stops a request that would otherwise leave past the proxy or go to Google unasked.
# Chromium silently ignores unknown feature names; these exist in Chromium 156 (checked against the
# binary's feature table, see browser/README.md).
CONTAINMENT_DISABLED_FEATURES = (
    "WebRtcHideLocalIpsWithMdns",  # else mDNS announcements of host candidates leave on UDP 5353
    "AutofillServerCommunication",  # autofill field-type queries to Google
    "Prerender2",  # speculative prerendering (a page's speculation rules; prediction is off too)
)
# Port 1 is on Chromium's restricted-port list: a request to it fails with ERR_UNSAFE_PORT before any
# socket is opened, so a service pointed there sends nothing, not even to the proxy.
NOWHERE = "http://127.0.0.1:1/"
CONTAINMENT_SWITCHES = (
    "--disable-quic",  # QUIC is UDP: an HTTP proxy cannot carry it
    "--disable-domain-reliability",  # error beacons to Google
    "--no-pings",  # <a ping> hyperlink auditing
    "--disable-translate",
    # Measured: even with --disable-component-update Chromium 156 asks update.googleapis.com for a
    # component at startup (an on-demand update); with no URL source it sends nothing.
    "--component-updater=url-source=data:,",
    # Measured: the Gaia cookie manager POSTs accounts.google.com/ListAccounts at startup (Playwright's
    # SkipListAccountsWithoutGaiaCookies does not exist in 156): point Gaia nowhere.
    f"--gaia-url={NOWHERE}",
)
WEBRTC_POLICY = "disable_non_proxied_udp"


class ContainmentError(ValueError):
    """A launch that would not be contained: refused, with the reason."""


@dataclass(frozen=True)
class ContainmentOptions:
    """Switches for the containment lab's NEGATIVE tests only: each one turned off re-opens a known
    escape, so the lab can prove its probe would notice. Never turn them off in a deployment."""

    loopback_bypass_fix: bool = True
    webrtc_policy: bool = True

    @classmethod
    def weakened(cls, weaken: Iterable[str]) -> ContainmentOptions:
        names = set(weaken)
        unknown = names - {"loopback-bypass", "webrtc"}
        if unknown:
            raise ContainmentError(f"unknown --weaken value(s) {sorted(unknown)}: use loopback-bypass or webrtc")
        return cls(loopback_bypass_fix="loopback-bypass" not in names, webrtc_policy="webrtc" not in names)

    def warn_if_weakened(self) -> None:
        if not self.loopback_bypass_fix:
            log.warning("!!! CONTAINMENT WEAKENED: loopback bypass fix OFF: Chromium sends localhost, 127/8, "
                        "169.254/16 and fe80::/10 DIRECT, past the proxy (negative tests only) !!!")
        if not self.webrtc_policy:
            log.warning("!!! CONTAINMENT WEAKENED: WebRTC IP handling policy OFF: STUN/WebRTC UDP leaves "
                        "directly, past the proxy (negative tests only) !!!")


def check_engine(engine: str) -> str:
    name = engine.strip().lower()
    if name in CHROMIUM_ENGINES:
        return name
    if name in NON_CHROMIUM_ENGINES:
        raise ContainmentError(
            f"{engine} cannot be contained: the loopback-bypass and WebRTC switches are Chromium switches that "
            f"{engine.capitalize()} ignores, so behind the same proxy it would reach loopback and send WebRTC UDP "
            "directly. Use chromium.")
    raise ContainmentError(f"unknown browser engine {engine!r}; only Chromium-based engines are accepted")


def check_proxy_url(proxy: str) -> str:
    """``HOST:PORT`` or ``http://HOST:PORT`` → ``http://HOST:PORT``. Credentials are refused: they would
    sit on the browser's command line (readable by any local user) and egresswall identifies clients
    by address, not by a password."""
    text = proxy.strip()
    if not text:
        raise ContainmentError("empty proxy address")
    if "://" not in text:
        text = "http://" + text
    parts = urlsplit(text)
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise ContainmentError("the proxy URL carries credentials (user:password@); egresswall identifies clients "
                               "by address, and a password on the browser's command line is readable by every "
                               "local user. Give HOST:PORT only.")
    if parts.scheme != "http":
        raise ContainmentError(f"proxy scheme {parts.scheme!r} is not supported: egresswall is an HTTP proxy "
                               "(http://HOST:PORT)")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ContainmentError(f"the proxy address {proxy!r} has a path or query; give HOST:PORT")
    try:
        port = parts.port
    except ValueError as err:
        raise ContainmentError(f"bad proxy port in {proxy!r}: {err}") from None
    if not parts.hostname or port is None:
        raise ContainmentError(f"the proxy address {proxy!r} needs a host and a port")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"http://{host}:{port}"


def spki_hash(ca_file: str | os.PathLike[str]) -> str:
    """base64(SHA-256(SubjectPublicKeyInfo)) of the first certificate in a PEM file: the form
    ``--ignore-certificate-errors-spki-list`` takes. mitmproxy's leaf certificates reuse its CA's key,
    so this one hash makes Chromium accept exactly the certificates that CA's key signs for."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    cert = x509.load_pem_x509_certificate(Path(ca_file).read_bytes())
    spki = cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return base64.b64encode(hashlib.sha256(spki).digest()).decode("ascii")


MANAGED_POLICY_DIRS = ("/etc/chromium/policies/managed",)
_PROXY_POLICIES = ("ProxySettings", "ProxyMode", "ProxyServer", "ProxyServerMode", "ProxyPacUrl", "ProxyBypassList")


def managed_policy_problems(directories: Sequence[str] = MANAGED_POLICY_DIRS) -> list[str]:
    """Machine-wide managed policies beat command-line switches: one that sets a proxy, DNS-over-HTTPS
    (measured: secure-mode DoH connects to its server directly, past the proxy) or a weaker WebRTC
    policy would undo the containment, so such a policy refuses the launch."""
    problems = []
    for directory in directories:
        folder = Path(directory)
        if not folder.is_dir():
            continue
        for file in sorted(folder.glob("*.json")):
            try:
                policies = json.loads(file.read_text())
            except (OSError, ValueError) as err:
                problems.append(f"{file}: unreadable managed policy ({err})")
                continue
            if not isinstance(policies, dict):
                continue
            for name in _PROXY_POLICIES:
                if name in policies:
                    problems.append(f"{file}: managed policy {name} overrides the browser's --proxy-server")
            doh = policies.get("DnsOverHttpsMode")
            if doh is not None and doh != "off":
                problems.append(f"{file}: managed policy DnsOverHttpsMode={doh!r} resolves names past the proxy")
            webrtc = policies.get("WebRtcIPHandling")
            if webrtc is not None and webrtc != WEBRTC_POLICY:
                problems.append(f"{file}: managed policy WebRtcIPHandling={webrtc!r} lets WebRTC UDP past the proxy")
    return problems


def running_as_root() -> bool:
    return os.geteuid() == 0


@dataclass
class LaunchPlan:
    """Everything a contained launch needs: the executable, the complete argv and the profile."""

    executable: str
    args: list[str]
    proxy_server: str
    user_data_dir: Path
    chromium_sandbox: bool
    headless: bool = True
    containment: ContainmentOptions = field(default_factory=ContainmentOptions)
    owns_user_data_dir: bool = True

    def launch_options(self) -> dict[str, Any]:
        """Keyword arguments for Playwright's (Python) ``browser_type.launch``."""
        return {"executable_path": self.executable, "args": list(self.args), "ignore_default_args": True,
                "headless": self.headless, "chromium_sandbox": self.chromium_sandbox,
                "proxy": {"server": self.proxy_server}, "env": browser_environment()}

    def server_config(self) -> dict[str, Any]:
        """The same launch as ``launch-server --config`` JSON (Playwright's camelCase options)."""
        return {"executablePath": self.executable, "args": list(self.args), "ignoreDefaultArgs": True,
                "headless": self.headless, "chromiumSandbox": self.chromium_sandbox,
                "proxy": {"server": self.proxy_server}, "env": browser_environment()}

    def cleanup(self) -> None:
        if self.owns_user_data_dir:
            shutil.rmtree(self.user_data_dir, ignore_errors=True)


def browser_environment() -> dict[str, str]:
    """The browser's environment: the caller's, without Google API keys (Debian's wrapper exports them;
    without keys Chromium does not talk to Google's APIs) or proxy variables (the flags decide)."""
    dropped = {"GOOGLE_API_KEY", "GOOGLE_DEFAULT_CLIENT_ID", "GOOGLE_DEFAULT_CLIENT_SECRET", "http_proxy",
               "https_proxy", "all_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY",
               "auto_proxy"}
    return {k: v for k, v in os.environ.items() if k not in dropped}


def find_chromium(executable: str | None = None) -> str:
    candidates = [executable] if executable else [os.environ.get("EGRESSWALL_CHROMIUM") or "", DEBIAN_CHROMIUM,
                                                  shutil.which("chromium") or ""]
    for path in candidates:
        if path and os.access(path, os.X_OK):
            return path
    raise ContainmentError("no Chromium found: install Debian's chromium package (ci/install.sh --browser); "
                           "egresswall never downloads a browser" + (f" ({executable} is not executable)"
                                                                     if executable else ""))


def plan_launch(proxy: str, *, engine: str = "chromium", executable: str | None = None,
                ca_files: Sequence[str | os.PathLike[str]] = (), containment: ContainmentOptions | None = None,
                headless: bool = True, sandbox: bool | None = None, user_data_dir: str | None = None,
                extra_args: Sequence[str] = ()) -> LaunchPlan:
    """Build a contained launch. ``ca_files``: certificates whose key Chromium should accept for TLS
    (the proxy's CA when the policy intercepts; a lab's own certificate). ``sandbox``: None or True means
    Chromium's sandbox is on, and as root (where it cannot run) the launch is refused; False turns it
    off, logged."""
    check_engine(engine)
    proxy_server = check_proxy_url(proxy)
    problems = managed_policy_problems()
    if problems:
        raise ContainmentError("Chromium's managed policies undo the containment: " + "; ".join(problems))
    containment = containment or ContainmentOptions()
    containment.warn_if_weakened()
    for arg in extra_args:
        _check_extra_arg(arg)
    chromium_sandbox = _sandbox_choice(sandbox)

    owns = user_data_dir is None
    profile = Path(user_data_dir or tempfile.mkdtemp(prefix="egresswall-chromium-"))
    write_profile(profile, containment)

    args = list(PLAYWRIGHT_SWITCHES) + list(CONTAINMENT_SWITCHES)
    disabled = list(PLAYWRIGHT_DISABLED_FEATURES) + list(CONTAINMENT_DISABLED_FEATURES)
    if not containment.webrtc_policy:
        disabled.remove("WebRtcHideLocalIpsWithMdns")
    args.append("--disable-features=" + ",".join(disabled))
    args.append("--enable-features=" + ",".join(PLAYWRIGHT_ENABLED_FEATURES))
    if headless:
        args.extend(PLAYWRIGHT_HEADLESS_SWITCHES)
    if not chromium_sandbox:
        args.append("--no-sandbox")
    args.append(f"--proxy-server={proxy_server}")
    if containment.loopback_bypass_fix:
        args.append("--proxy-bypass-list=<-loopback>")
    if containment.webrtc_policy:
        args.append(f"--webrtc-ip-handling-policy={WEBRTC_POLICY}")
    hashes = sorted({spki_hash(path) for path in ca_files})
    if hashes:
        args.append("--ignore-certificate-errors-spki-list=" + ",".join(hashes))
    args.extend(extra_args)
    args += [f"--user-data-dir={profile}", "--remote-debugging-pipe", "--no-startup-window"]
    return LaunchPlan(find_chromium(executable), args, proxy_server, profile, chromium_sandbox, headless,
                      containment, owns)


_FORBIDDEN_EXTRA = ("--proxy", "--no-proxy", "--proxy-bypass", "--proxy-pac-url", "--webrtc", "--disable-features",
                    "--enable-features", "--user-data-dir", "--remote-debugging", "--host-resolver-rules",
                    "--ignore-certificate-errors", "--enable-quic", "--origin-to-force-quic-on", "--load-extension",
                    "--dns-over-https", "--no-sandbox", "--disable-web-security")


def _check_extra_arg(arg: str) -> None:
    if not arg.startswith("-"):
        raise ContainmentError(f"extra browser argument {arg!r} is not a switch")
    for prefix in _FORBIDDEN_EXTRA:
        if arg.startswith(prefix):
            raise ContainmentError(f"extra browser argument {arg!r} would change containment; the launcher sets it")


def _sandbox_choice(sandbox: bool | None) -> bool:
    """Chromium's sandbox is on unless the caller turned it off in so many words. As root it cannot run
    (Chromium refuses to start), and quietly turning it off would take away the browser's own boundary
    around hostile pages: so as root a launch is refused unless ``sandbox=False`` (``--no-sandbox``) says
    the caller knows."""
    if sandbox is False:
        log.warning("Chromium's sandbox is OFF by request (--no-sandbox): a compromised renderer is not confined")
        return False
    if running_as_root():
        raise ContainmentError(
            f"running as root ({getpass.getuser()}): Chromium's sandbox cannot run as root, and egresswall does "
            "not turn it off unasked; run as an unprivileged user to keep it, or pass --no-sandbox to run "
            "without it")
    return True


def write_profile(profile: Path, containment: ContainmentOptions) -> None:
    """A fresh profile: preferences that keep the browser quiet and its WebRTC on the proxy.

    ``Default/Preferences`` (per profile; Playwright's contexts are off-the-record children of it and
    read through to it) and ``Local State`` (browser-wide: DNS-over-HTTPS)."""
    default = profile / "Default"
    default.mkdir(parents=True, exist_ok=True)
    prefs: dict[str, Any] = {
        "net": {"network_prediction_options": 2},  # never predict: no prefetch, no preconnect of its own
        "alternate_error_pages": {"enabled": False},
        "safebrowsing": {"enabled": False},
        "search": {"suggest_enabled": False},
        "signin": {"allowed": False},
        "translate": {"enabled": False},
        "credentials_enable_service": False,
        "enable_do_not_track": True,
        "browser": {"has_seen_welcome_page": True, "check_default_browser": False},
    }
    if containment.webrtc_policy:
        prefs["webrtc"] = {"ip_handling_policy": WEBRTC_POLICY, "multiple_routes_enabled": False,
                           "nonproxied_udp_enabled": False}
    (default / "Preferences").write_text(json.dumps(prefs))
    local_state = {
        "dns_over_https": {"mode": "off", "templates": ""},
        "browser": {"enabled_labs_experiments": []},
        "user_experience_metrics": {"reporting_enabled": False},
        # No Encrypted Client Hello, not even GREASE: measured in Chromium 156, every ClientHello through
        # a proxy carries extension 0xfe0d unless this is off, and an allowlist egresswall refuses ECH
        # (it hides the real destination; a GREASE one cannot be told apart). --disable-features does not stop it.
        "ssl": {"ech_enabled": False},
    }
    (profile / "Local State").write_text(json.dumps(local_state))


# ---- checking the launched process ---------------------------------------------------------------

def browser_command_line(user_data_dir: Path, timeout: float = 5.0) -> list[str] | None:
    """The argv of the browser process using ``user_data_dir`` (Linux /proc), or None if not found."""
    marker = f"--user-data-dir={user_data_dir}".encode()
    deadline = time.monotonic() + timeout
    while True:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if marker in argv and not any(a.startswith(b"--type=") for a in argv):
                return [a.decode(errors="replace") for a in argv if a]
        if time.monotonic() > deadline:
            return None
        time.sleep(0.1)


def verify_command_line(argv: Sequence[str], plan: LaunchPlan) -> list[str]:
    """Problems with the argv the browser really got (empty when it is the contained one)."""
    problems = []
    for name in ("--disable-features", "--enable-features", "--proxy-server", "--proxy-bypass-list",
                 "--webrtc-ip-handling-policy"):
        count = sum(1 for a in argv if a == name or a.startswith(name + "="))
        expected = 1 if any(a.startswith(name + "=") for a in plan.args) else 0
        if count != expected:
            problems.append(f"{name} appears {count} times, expected {expected}")
    for arg in plan.args:
        if arg not in argv:
            problems.append(f"{arg} is missing")
    return problems


def launch(playwright: Any, plan: LaunchPlan, verify: bool = True) -> Any:
    """Launch the planned Chromium with Playwright's sync API; check the argv it really got."""
    browser = playwright.chromium.launch(**plan.launch_options())
    if verify:
        argv = browser_command_line(plan.user_data_dir)
        problems = ["the browser process was not found in /proc"] if argv is None else verify_command_line(argv,
                                                                                                           plan)
        if problems:
            browser.close()
            raise ContainmentError("the launched Chromium is not contained: " + "; ".join(problems))
    return browser
