"""The launcher: the command line it builds, what it refuses, and (with the real Chromium behind the
real proxy) the argv the browser really got and the requests an idle browser makes on its own."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import shutil
import subprocess
import time

import pytest
from unprivileged import SANDBOX

from browser import launch as launcher
from browser.launch import (
    PLAYWRIGHT_DISABLED_FEATURES,
    ContainmentError,
    ContainmentOptions,
    browser_command_line,
    check_engine,
    check_proxy_url,
    managed_policy_problems,
    plan_launch,
    spki_hash,
    verify_command_line,
)


@pytest.fixture
def plan():
    made = plan_launch("127.0.0.1:3128", sandbox=SANDBOX)
    yield made
    made.cleanup()


def flag_values(args: list[str], name: str) -> list[str]:
    return [a.split("=", 1)[1] for a in args if a.startswith(name + "=")]


def test_one_merged_disable_features_with_playwrights_defaults_and_ours(plan):
    values = flag_values(plan.args, "--disable-features")
    assert len(values) == 1, "Chromium keeps only the last --disable-features"
    features = values[0].split(",")
    assert set(PLAYWRIGHT_DISABLED_FEATURES) <= set(features)
    assert "WebRtcHideLocalIpsWithMdns" in features
    assert len(flag_values(plan.args, "--enable-features")) == 1


def test_proxy_loopback_webrtc_quic_and_background_switches(plan):
    args = plan.args
    assert flag_values(args, "--proxy-server") == ["http://127.0.0.1:3128"]
    assert flag_values(args, "--proxy-bypass-list") == ["<-loopback>"]
    assert flag_values(args, "--webrtc-ip-handling-policy") == ["disable_non_proxied_udp"]
    for switch in ("--disable-quic", "--disable-background-networking", "--disable-component-update",
                   "--disable-sync", "--no-pings", "--disable-domain-reliability", "--remote-debugging-pipe"):
        assert switch in args
    assert flag_values(args, "--gaia-url") == ["http://127.0.0.1:1/"]
    assert flag_values(args, "--user-data-dir") == [str(plan.user_data_dir)]
    assert plan.executable == "/usr/lib/chromium/chromium"  # the binary, not Debian's wrapper script
    options = plan.launch_options()
    assert options["ignore_default_args"] is True and options["proxy"] == {"server": "http://127.0.0.1:3128"}
    assert "GOOGLE_API_KEY" not in options["env"]


def test_profile_preferences_pin_webrtc_and_turn_doh_off(plan):
    prefs = json.loads((plan.user_data_dir / "Default" / "Preferences").read_text())
    assert prefs["webrtc"]["ip_handling_policy"] == "disable_non_proxied_udp"
    assert prefs["net"]["network_prediction_options"] == 2
    local_state = json.loads((plan.user_data_dir / "Local State").read_text())
    assert local_state["dns_over_https"]["mode"] == "off"


def test_weakening_is_explicit_and_loud(caplog):
    with caplog.at_level(logging.WARNING, logger="egresswall.browser"):
        weak = plan_launch("127.0.0.1:3128", sandbox=SANDBOX, containment=ContainmentOptions(loopback_bypass_fix=False,
                                                                            webrtc_policy=False))
    try:
        assert not flag_values(weak.args, "--proxy-bypass-list")
        assert not flag_values(weak.args, "--webrtc-ip-handling-policy")
        assert "webrtc" not in json.loads((weak.user_data_dir / "Default" / "Preferences").read_text())
        text = caplog.text
        assert "CONTAINMENT WEAKENED: loopback bypass fix OFF" in text and "WebRTC IP handling policy OFF" in text
    finally:
        weak.cleanup()
    assert ContainmentOptions.weakened({"webrtc"}) == ContainmentOptions(webrtc_policy=False)
    with pytest.raises(ContainmentError, match="unknown --weaken"):
        ContainmentOptions.weakened({"everything"})


@pytest.mark.parametrize("engine", ["firefox", "webkit", "Firefox"])
def test_launcher_refuses_firefox_and_webkit_with_the_reason(engine):
    with pytest.raises(ContainmentError, match="ignores, so behind the same proxy it would reach loopback"):
        check_engine(engine)
    with pytest.raises(ContainmentError, match="cannot be contained"):
        plan_launch("127.0.0.1:3128", engine=engine)
    assert check_engine("chromium") == "chromium"


@pytest.mark.parametrize("proxy", ["http://user:secret@127.0.0.1:3128", "user:secret@127.0.0.1:3128",
                                   "http://user@127.0.0.1:3128", "http://:pw@127.0.0.1:3128"])
def test_launcher_refuses_a_proxy_url_with_credentials(proxy):
    with pytest.raises(ContainmentError, match="carries credentials"):
        check_proxy_url(proxy)
    with pytest.raises(ContainmentError, match="carries credentials"):
        plan_launch(proxy)


@pytest.mark.parametrize("proxy,problem", [("socks5://127.0.0.1:1080", "not supported"),
                                           ("https://127.0.0.1:3128", "not supported"),
                                           ("127.0.0.1", "needs a host and a port"),
                                           ("http://127.0.0.1:3128/path", "has a path"), ("", "empty")])
def test_launcher_refuses_other_proxy_forms(proxy, problem):
    with pytest.raises(ContainmentError, match=problem):
        check_proxy_url(proxy)


def test_proxy_forms_accepted():
    assert check_proxy_url("127.0.0.1:3128") == "http://127.0.0.1:3128"
    assert check_proxy_url("http://[::1]:3128/") == "http://[::1]:3128"


@pytest.mark.parametrize("arg", ["--proxy-server=http://evil:1", "--no-proxy-server", "--disable-features=X",
                                 "--proxy-bypass-list=*", "--webrtc-ip-handling-policy=default",
                                 "--host-resolver-rules=MAP * 1.2.3.4", "--ignore-certificate-errors"])
def test_extra_arguments_cannot_change_containment(arg):
    with pytest.raises(ContainmentError, match="would change containment"):
        plan_launch("127.0.0.1:3128", extra_args=[arg])


def test_spki_hash_is_base64_sha256_of_the_subject_public_key_info(lab):
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    cert = x509.load_pem_x509_certificate(lab.cert_file.read_bytes())
    der = cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    assert spki_hash(lab.cert_file) == base64.b64encode(hashlib.sha256(der).digest()).decode()
    if shutil.which("openssl"):  # the recipe Chromium's documentation gives
        pubkey = subprocess.run(["openssl", "x509", "-pubkey", "-noout", "-in", str(lab.cert_file)],
                                capture_output=True, check=True).stdout
        der2 = subprocess.run(["openssl", "pkey", "-pubin", "-outform", "der"], input=pubkey, capture_output=True,
                              check=True).stdout
        assert spki_hash(lab.cert_file) == base64.b64encode(hashlib.sha256(der2).digest()).decode()
    plan = plan_launch("127.0.0.1:3128", ca_files=[lab.cert_file], sandbox=SANDBOX)
    assert flag_values(plan.args, "--ignore-certificate-errors-spki-list") == [spki_hash(lab.cert_file)]
    plan.cleanup()


def test_managed_policies_that_undo_containment_refuse_the_launch(tmp_path):
    (tmp_path / "ok.json").write_text(json.dumps({"DnsOverHttpsMode": "off", "BookmarkBarEnabled": False}))
    assert managed_policy_problems([str(tmp_path)]) == []
    (tmp_path / "bad.json").write_text(json.dumps({"ProxyMode": "direct", "DnsOverHttpsMode": "secure",
                                                   "WebRtcIPHandling": "default"}))
    problems = " ".join(managed_policy_problems([str(tmp_path)]))
    assert "ProxyMode overrides" in problems and "DnsOverHttpsMode='secure'" in problems
    assert "WebRtcIPHandling='default'" in problems


def test_verify_command_line_catches_a_second_disable_features(plan):
    assert verify_command_line([plan.executable, *plan.args], plan) == []
    doubled = [plan.executable, *plan.args, "--disable-features=Other"]
    assert "--disable-features appears 2 times, expected 1" in verify_command_line(doubled, plan)
    missing = [a for a in plan.args if not a.startswith("--proxy-bypass-list")]
    assert any("--proxy-bypass-list" in p for p in verify_command_line(missing, plan))


# ---- the real browser -------------------------------------------------------------------------------

@pytest.mark.integration
def test_real_chromium_gets_the_planned_argv_and_stays_quiet_when_idle(lab, start_proxy):
    """Launched behind the real proxy: the browser's argv in /proc is the planned one, and an idle
    browser that then loads one page sends the proxy that page's requests and nothing else (no
    update.googleapis.com, no accounts.google.com)."""
    from playwright.sync_api import sync_playwright

    proxy = start_proxy(lab.policy_text())
    plan = plan_launch(f"{proxy.host}:{proxy.port}", sandbox=SANDBOX)
    lab.public.serve("/page/quiet", "<html><head><title>quiet</title></head><body><p>quiet page</p></body></html>")
    try:
        with sync_playwright() as playwright:
            browser = launcher.launch(playwright, plan)
            try:
                argv = browser_command_line(plan.user_data_dir)
                assert argv is not None and argv[0] == "/usr/lib/chromium/chromium"
                assert verify_command_line(argv, plan) == []
                assert sum(a.startswith("--disable-features") for a in argv) == 1
                page = browser.new_context().new_page()
                time.sleep(4)  # Chromium's startup requests came within 2 s when they were not stopped
                page.goto(f"http://public.lab.example:{lab.public.port}/page/quiet")
                assert page.title() == "quiet"
                time.sleep(1)
            finally:
                browser.close()
    finally:
        plan.cleanup()
    hosts = {(d["host"], d["port"]) for d in proxy.decisions()}
    assert hosts == {("public.lab.example", lab.public.port)}, hosts
