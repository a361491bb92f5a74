"""``egresswall check`` as a user runs it (a subprocess), against a DNS server on loopback.

Every run that may resolve passes ``--nameserver`` pointing at the DnsLab: nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from dnslab import DnsLab, Record

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent

ZONE = {
    "mixed.example.com": [Record("A", "93.184.216.34"), Record("A", "10.0.0.5"), Record("A", "1.1.1.1"),
                          Record("AAAA", "2606:2800:220:1:248:1893:25c8:1946")],
    "public.example.com": [Record("A", "93.184.216.34"), Record("AAAA", "2606:2800:220:1:248:1893:25c8:1946")],
    "alias.example.com": [Record("CNAME", "db.internal")],
    "db.internal": [Record("A", "10.0.0.6")],
    "lab.example.com": [Record("A", "198.18.0.7"), Record("A", "198.19.1.2")],
    "denied.example.com": [Record("A", "93.184.216.34")],
    "unlisted.example.com": [Record("A", "93.184.216.34")],
    "user.example.com": [Record("A", "93.184.216.34")],
    "port.example.com": [Record("A", "93.184.216.34")],
}


@pytest.fixture
def dns():
    with DnsLab(ZONE) as server:
        yield server


def egresswall(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "proxy.cli", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=60)


def check(dns: DnsLab, *args: str) -> subprocess.CompletedProcess[str]:
    return egresswall("check", "--nameserver", dns.address, *args)


def fields(output: str) -> dict[str, str]:
    rows = {}
    for line in output.splitlines():
        if line.strip():
            key, _, value = line.partition(" ")
            rows[key] = value.strip()
    return rows


def test_one_private_address_among_public_ones_is_refused(dns: DnsLab) -> None:
    result = check(dns, "https://mixed.example.com/")
    assert result.returncode == 1, result.stdout + result.stderr
    out = fields(result.stdout)
    assert out["verdict"] == "REFUSED" and out["stage"] == "address"
    assert out["rule"] == "special-purpose 10.0.0.0/8"
    assert "10.0.0.5" in out["reason"] and "10.0.0.0/8" in out["reason"] and "Private-Use" in out["reason"]
    assert "10.0.0.5" in out["resolved"] and "93.184.216.34" in out["resolved"]
    assert "pinned" not in out
    assert dns.queried("mixed.example.com")


def test_all_public_addresses_are_allowed(dns: DnsLab) -> None:
    result = check(dns, "https://public.example.com/")
    assert result.returncode == 0, result.stdout + result.stderr
    out = fields(result.stdout)
    assert out["verdict"] == "ALLOWED" and out["pinned"] == "93.184.216.34"
    assert out["rule"].startswith("default allow (") and out["rule"].endswith("default.yaml:10)")


def test_cname_to_an_internal_name_is_refused(dns: DnsLab) -> None:
    result = check(dns, "https://alias.example.com/")
    assert result.returncode == 1, result.stdout + result.stderr
    out = fields(result.stdout)
    assert out["verdict"] == "REFUSED" and out["stage"] == "resolve"
    assert out["rule"] == "cname:local-suffix"
    assert "db.internal" in out["reason"] and "alias (CNAME)" in out["reason"]
    assert out["cnames"] == "db.internal"
    assert "pinned" not in out


@pytest.mark.parametrize("url, args, stage, rule_words", [
    ("https://denied.example.com/", ["--deny-host", "denied.example.com"], "host",
     "command line --deny-host denied.example.com"),
    ("https://unlisted.example.com/", ["--default", "deny"], "host", "default deny (--default)"),
    ("https://user:pw@user.example.com/", [], "form", "form:userinfo"),
    ("https://user.example.com\\path/", [], "form", "form:backslash"),
    ("https://port.example.com:8443/", [], "port", "ports.connect"),
    ("https://accounts.google.com/", [], "host", "default.yaml:17"),
])
def test_refused_host_is_never_queried(dns: DnsLab, url: str, args: list[str], stage: str, rule_words: str) -> None:
    result = check(dns, url, *args)
    assert result.returncode == 1, result.stdout + result.stderr
    out = fields(result.stdout)
    assert out["verdict"] == "REFUSED" and out["stage"] == stage
    assert rule_words in out["rule"]
    assert "resolved" not in out
    assert dns.queries == [], dns.queries


def test_lab_range_readmitted_by_address_rule(dns: DnsLab, tmp_path: Path) -> None:
    policy = tmp_path / "lab.yaml"
    policy.write_text("version: 1\ndefault: deny\nhosts:\n  allow:\n    - .example.com\n")
    result = check(dns, "--policy", str(policy), "--allow-range", "198.18.0.0/15", "https://lab.example.com/x")
    assert result.returncode == 0, result.stdout + result.stderr
    out = fields(result.stdout)
    assert out["verdict"] == "ALLOWED" and out["stage"] == "host"
    assert out["rule"] == f"{policy}:5"
    assert out["reason"] == "lab.example.com is allowed by rule .example.com"
    assert sorted(out["resolved"].split(", ")) == ["198.18.0.7", "198.19.1.2"]
    assert out["pinned"] in ("198.18.0.7", "198.19.1.2")


def test_lab_range_without_the_address_rule_is_refused(dns: DnsLab) -> None:
    result = check(dns, "--allow-host", "lab.example.com", "--default", "deny", "https://lab.example.com/")
    assert result.returncode == 1
    out = fields(result.stdout)
    assert out["rule"] == "special-purpose 198.18.0.0/15" and "Benchmarking" in out["reason"]


def test_host_allow_rule_does_not_readmit_a_private_address(dns: DnsLab) -> None:
    result = check(dns, "--default", "deny", "--allow-host", "mixed.example.com", "https://mixed.example.com/")
    assert result.returncode == 1
    assert fields(result.stdout)["stage"] == "address"


def test_several_urls_exit_1_when_any_is_refused(dns: DnsLab) -> None:
    result = check(dns, "https://public.example.com/", "https://mixed.example.com/")
    assert result.returncode == 1
    assert result.stdout.count("verdict") == 2
    assert check(dns, "https://public.example.com/", "https://public.example.com/a").returncode == 0


def test_ip_literal_needs_no_nameserver() -> None:
    # An IP literal is never resolved, so this run may omit --nameserver.
    result = egresswall("check", "http://169.254.169.254/latest/meta-data/")
    assert result.returncode == 1
    out = fields(result.stdout)
    assert out["rule"] == "cloud-metadata 169.254.169.254/32" and "AWS instance metadata" in out["reason"]


def test_json_output_parses(dns: DnsLab) -> None:
    result = check(dns, "--json", "https://mixed.example.com/", "https://public.example.com/",
                   "https://alias.example.com/")
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert len(lines) == 3
    mixed, public, alias = (json.loads(line) for line in lines)
    assert mixed["allowed"] is False and mixed["stage"] == "address" and "10.0.0.5" in mixed["addresses"]
    assert public == {
        "url": "https://public.example.com/", "method": "CONNECT", "verdict": "allow", "allowed": True, "stage": "host",
        "rule": public["rule"], "rule_id": "default:allow",
        "reason": "public.example.com matches no rule and the policy allows by default",
        "role": None, "cnames": [], "addresses": public["addresses"], "pinned": "93.184.216.34",
    }
    assert sorted(public["addresses"]) == ["2606:2800:220:1:248:1893:25c8:1946", "93.184.216.34"]
    assert alias["allowed"] is False and alias["cnames"] == ["db.internal"] and alias["rule"] == "cname:local-suffix"


def test_report_mode_marks_host_refusals(dns: DnsLab) -> None:
    result = check(dns, "--mode", "report", "--deny-host", "denied.example.com", "https://denied.example.com/")
    assert result.returncode == 0
    out = fields(result.stdout)
    assert out["verdict"] == "ALLOWED (report mode; enforce would refuse)"
    assert out["reason"].startswith("report mode: would refuse:")
    refused = check(dns, "--mode", "report", "https://mixed.example.com/")
    assert refused.returncode == 1


def test_client_chooses_a_role(dns: DnsLab, tmp_path: Path) -> None:
    policy = tmp_path / "roles.yaml"
    policy.write_text("version: 1\ndefault: allow\nroles:\n  - name: ci\n    clients: [10.20.0.0/16]\n"
                      "    default: deny\n")
    result = check(dns, "--policy", str(policy), "--client", "10.20.3.4", "https://public.example.com/")
    assert result.returncode == 1
    out = fields(result.stdout)
    assert out["role"] == "ci" and out["rule"] == f"default deny ({policy}:4)"
    assert dns.queries == []


# --- errors (exit 2) -----------------------------------------------------------------------------------

def test_bad_policy_exits_2_with_position(dns: DnsLab, tmp_path: Path) -> None:
    policy = tmp_path / "bad.yaml"
    policy.write_text("version: 1\ndefault: deny\nhosts:\n  allow:\n    - host: a.example.com\n      prot: [443]\n")
    result = check(dns, "--policy", str(policy), "https://a.example.com/")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == (f"egresswall: {policy}:6:7: hosts.allow[0].prot: unknown key 'prot'; expected one of: "
                             "expires, host, id, intercept, methods, owner, paths, ports, reason, schemes, websocket\n")
    assert dns.queries == []


@pytest.mark.parametrize("args, words", [
    (["--allow-range", "10.0.0.1/8"], "command line --allow-range 10.0.0.1/8: addresses.allow[0]: got '10.0.0.1/8'"),
    (["--deny-host", "a.*.example.com"], "command line --deny-host a.*.example.com: hosts.deny[2]:"),
    (["--policy", "/nonexistent/policy.yaml"], "/nonexistent/policy.yaml: no such file"),
])
def test_bad_flags_exit_2(dns: DnsLab, args: list[str], words: str) -> None:
    result = check(dns, *args, "https://a.example.com/")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith(f"egresswall: {words}"), result.stderr


def test_bad_nameserver_flag_exits_2() -> None:
    result = egresswall("check", "--nameserver", "127.0.0.1:99999", "https://a.example.com/")
    assert result.returncode == 2
    assert "port must be 1-65535" in result.stderr


# --- stable rule ids, --client, address-rule edge cases (through the real CLI) -------------------------

def test_json_names_the_stable_rule_id(dns: DnsLab, tmp_path: Path) -> None:
    policy = tmp_path / "ids.yaml"
    policy.write_text("version: 1\ndefault: deny\nhosts:\n  allow:\n    - public.example.com\n"
                      "    - host: lab.example.com\n      id: lab-pages\naddresses:\n  deny: [93.184.216.0/24]\n")
    result = check(dns, "--json", "--policy", str(policy), "--allow-range", "198.18.0.0/15",
                   "https://lab.example.com/", "https://public.example.com/", "https://unlisted.example.com/")
    lab, public, unlisted = (json.loads(line) for line in result.stdout.splitlines())
    assert (lab["rule"], lab["rule_id"]) == (f"{policy}:6", "lab-pages")
    assert (public["stage"], public["rule"], public["rule_id"]) == (
        "address", f"address-deny 93.184.216.0/24 ({policy}:9)", "addresses.deny:93.184.216.0/24")
    assert unlisted["rule_id"] == "default:deny" and unlisted["rule"] == f"default deny ({policy}:2)"
    text = fields(check(dns, "--policy", str(policy), "--allow-range", "198.18.0.0/15",
                        "https://lab.example.com/").stdout)
    assert text["rule_id"] == "lab-pages"


@pytest.mark.parametrize("client", ["nope", "10.0.0", "10.0.0.1/8", "[::1]", "fe80::1%eth0", "0x7f.1"])
def test_client_must_be_an_address(client: str) -> None:
    result = egresswall("check", "--client", client, "http://169.254.169.254/")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"egresswall: the client {client!r} is not an IP address"), lines


def test_client_in_mapped_form_chooses_the_ipv4_role(tmp_path: Path) -> None:
    policy = tmp_path / "roles.yaml"
    policy.write_text("version: 1\ndefault: allow\nroles:\n  - name: ci\n    clients: [10.20.0.0/16]\n"
                      "    default: deny\n")
    result = egresswall("check", "--policy", str(policy), "--client", "::ffff:10.20.1.1", "http://8.8.8.8/")
    assert result.returncode == 1 and fields(result.stdout)["role"] == "ci", result.stdout + result.stderr


@pytest.mark.parametrize("args, url, allowed, rule", [
    (["--deny-range", "::ffff:8.8.8.8/128"], "http://8.8.8.8/", False, "address-deny 8.8.8.8/32 ("),
    (["--deny-range", "::ffff:8.8.8.8/128"], "http://[::ffff:8.8.8.8]/", False, "address-deny 8.8.8.8/32 ("),
    (["--allow-range", "64:ff9b:1::/48"], "http://[64:ff9b:1:a00:0:100::]/", False, "special-purpose 10.0.0.0/8"),
    (["--allow-range", "64:ff9b:1::/48", "--allow-range", "10.0.0.0/8"], "http://[64:ff9b:1:a00:0:100::]/", True,
     "default allow ("),
    (["--allow-range", "64:ff9b:1::/48"], "http://[64:ff9b:1:808:8:800::]/", True, "default allow ("),
    (["--allow-range", "169.254.0.0/16"], "http://169.254.0.23/", False, "cloud-metadata 169.254.0.23/32"),
    (["--allow-range", "169.254.0.0/16"], "http://169.254.42.42/", False, "cloud-metadata 169.254.42.42/32"),
    (["--allow-range", "169.254.0.0/16"], "http://169.254.1.1/", True, "default allow ("),
])
def test_address_rule_edge_cases(args: list[str], url: str, allowed: bool, rule: str) -> None:
    result = egresswall("check", *args, url)  # IP literals: nothing is resolved
    out = fields(result.stdout)
    assert result.returncode == (0 if allowed else 1), result.stdout + result.stderr
    assert out["rule"].startswith(rule), out


@pytest.mark.parametrize("url, rule, hint", [
    # Only strings given to check: an IP literal is never resolved, and check connects nowhere.
    ("http://10.0.0.1/", "special-purpose 10.0.0.0/8",
     "this address is not global unicast (special-purpose 10.0.0.0/8); only an addresses.allow range re-admits it, "
     "a host allow rule cannot"),
    ("http://[fd00::1]/", "special-purpose fc00::/7",
     "this address is not global unicast (special-purpose fc00::/7); only an addresses.allow range re-admits it, "
     "a host allow rule cannot"),
    ("http://169.254.169.254/", "cloud-metadata 169.254.169.254/32",
     "this is a cloud metadata address, refused whatever addresses.allow says while "
     "addresses.refuse_cloud_metadata is true (with it false, a non-global one still needs an addresses.allow range)"),
])
def test_an_address_refusal_carries_the_proxy_s_hint(url: str, rule: str, hint: str) -> None:
    result = egresswall("check", url)
    assert result.returncode == 1, result.stderr
    out = fields(result.stdout)
    assert (out["stage"], out["rule"], out["hint"]) == ("address", rule, hint)
    (answer,) = [json.loads(line) for line in egresswall("check", "--json", url).stdout.splitlines()]
    assert answer["hint"] == hint
    readme = " ".join((REPO / "README.md").read_text().split())
    if rule.startswith("special-purpose"):  # the README's list of hints says the same
        assert "`this address is not global unicast (RULE); only an addresses.allow range re-admits it, a host " \
               "allow rule cannot`" in readme


def test_an_allowed_url_has_no_hint() -> None:
    result = egresswall("check", "--allow-range", "10.0.0.0/8", "http://10.0.0.1/")
    assert result.returncode == 0 and "hint" not in fields(result.stdout)
    (answer,) = [json.loads(line) for line in
                 egresswall("check", "--json", "--allow-range", "10.0.0.0/8", "http://10.0.0.1/").stdout.splitlines()]
    assert "hint" not in answer


def test_urls_may_follow_the_options(dns: DnsLab) -> None:
    """argparse takes a positional list only where it starts: a URL after an option was an unrecognized
    argument (exit 2). Every URL is checked now, wherever it stands; a mistyped option still exits 2."""
    result = check(dns, "--json", "http://93.184.216.34/", "--deny-range", "1.1.1.0/24", "http://1.1.1.1/",
                   "--method", "POST", "http://[2606:2800:220:1:248:1893:25c8:1946]/")
    assert result.returncode == 1, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(line["url"], line["verdict"]) for line in lines] == [
        ("http://93.184.216.34/", "allow"), ("http://1.1.1.1/", "refuse"),
        ("http://[2606:2800:220:1:248:1893:25c8:1946]/", "allow")], lines
    assert "--deny-range 1.1.1.0/24" in lines[1]["rule"], lines[1]
    wrong = check(dns, "http://93.184.216.34/", "--jsn", "http://1.1.1.1/")
    assert wrong.returncode == 2 and "unrecognized arguments: --jsn" in wrong.stderr, wrong.stderr


def test_the_method_is_checked_and_shown() -> None:
    """``--method 'G T'`` was taken and the method shown nowhere, so a verdict could not be tied to it (review
    round 16). IP literals: nothing is looked up."""
    bad = egresswall("check", "--method", "G T", "http://198.51.100.7/")
    assert bad.returncode == 2 and "'G T' is not an HTTP method" in bad.stderr, bad.stderr
    shown = egresswall("check", "--method", "post", "--json", "http://169.254.169.254/")
    assert json.loads(shown.stdout)["method"] == "POST"
    assert fields(egresswall("check", "--method", "DELETE", "http://169.254.169.254/").stdout)["method"] == "DELETE"


@pytest.mark.parametrize("url, sent", [("http://169.254.169.254/x#top", "http://169.254.169.254/x"),
                                       ("http://169.254.169.254/a b?q=c d", "http://169.254.169.254/a%20b?q=c%20d")])
def test_a_url_is_decided_as_a_browser_sends_it(url: str, sent: str) -> None:
    """No fragment, a space percent-encoded: what a browser puts on the wire and the proxy decides (review
    round 22)."""
    out = fields(egresswall("check", url).stdout)
    assert out["sent"] == sent and out["rule"] == "cloud-metadata 169.254.169.254/32", out
