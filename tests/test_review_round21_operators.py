"""Review round 21, topic "operators": the policy file as operators write it, and the commands they run on it.

Each test here failed on the tree before the round's fixes (a confirmed finding); its docstring says what should
hold and why. Tests of what held are in tests/test_review_round21_operators_held.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from dnslab import DnsLab, Record
from proxyproc import both_transports

from policy.errors import PolicyError
from policy.loader import parse_policy

REPO = Path(__file__).resolve().parent.parent


def egresswall(tmp_path: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """The CLI as an operator runs it; TMPDIR so that an internal error's bug file lands in tmp_path."""
    import os
    return subprocess.run([sys.executable, "-m", "proxy.cli", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=timeout, env={**os.environ, "TMPDIR": str(tmp_path)})


def write(tmp_path: Path, text: str, name: str = "policy.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ---- 1. a number too long for Python's int() is an internal error, not a load error ---------------------------

@pytest.mark.parametrize("key", ["limits: {max_connections: 1%s}", "ports: {http: [1%s]}",
                                 "resolver: {ttl_ceiling: 1%s}"])
def test_a_number_with_thousands_of_digits_is_a_load_error_with_its_position(tmp_path, key):
    """README *Errors you may see*: a policy that cannot be used is reported as `FILE:LINE:COLUMN: key: message`
    ("fix that place"), exit 2; "it never shows a traceback for these". A plain integer of more than 4300 digits
    makes PyYAML's int() raise ValueError (Python's int max-str-digits guard), which is no PolicyError: `lint`
    exits 70 with "internal error, a bug in egresswall" and writes a bug file, and a reload logs an internal
    error. Fix: in policy/yamldoc.py YamlDocument.parse, catch ValueError from construct_document (or give the
    strict int resolver a digit bound, e.g. at most 20 digits) and report it at the scalar's mark."""
    text = "version: 1\n" + key % ("0" * 5000) + "\n"
    with pytest.raises(PolicyError) as caught:
        parse_policy(text, "p.yaml")
    assert "p.yaml:2:" in str(caught.value)
    result = egresswall(tmp_path, "lint", str(write(tmp_path, text)))
    assert result.returncode == 2, (result.returncode, result.stderr[-400:])
    assert "internal error" not in result.stderr and "policy.yaml:2:" in result.stderr


# ---- 2. NaN passes every bound of the schema ------------------------------------------------------------------

NAN_KEYS = ["resolver: {timeout: .nan}", "limits: {connect_timeout: .nan}", "limits: {idle_timeout: .nan}",
            "limits: {header_timeout: .nan}", "limits: {first_byte_timeout: .nan}", "limits: {tunnel_grace: .NaN}"]


@pytest.mark.parametrize("key", NAN_KEYS)
def test_a_nan_timeout_is_refused_at_load(key):
    """The schema bounds each timeout (`exclusiveMinimum: 0`, resolver.timeout `maximum: 60`), but NaN compares
    false with everything, so `.nan` passes both bounds and loads. A policy that says `resolver: {timeout: .nan}`
    refuses every name with "DNS lookup ... timed out after nans" without sending a query (see the next test),
    and a hot reload to it is taken as a good edit (it validates), so one typo-like value takes the whole proxy
    down while /readyz says ready. README: "hot reload ... keeps the last good policy when the new file is
    invalid". Fix: refuse non-finite numbers where the schema says number (policy/schema.py: a check after the
    validator, or `"not": {"const": NaN}` cannot be written in JSON; simplest in yamldoc: drop the .nan/.inf float
    resolver forms, or reject math.isnan values in _Builder.value) with file:line:column."""
    with pytest.raises(PolicyError):
        parse_policy("version: 1\n" + key + "\n", "p.yaml")


def test_a_nan_resolver_timeout_refuses_every_name_without_asking(tmp_path):
    """What the NaN timeout above does once loaded: `check` (the same resolver the proxy uses) refuses a name the
    nameserver answers, dns:timeout "after nans", and no query reaches the nameserver. Should: the policy is
    refused at load (exit 2 with file:line:column), so that it never replaces a working one."""
    with DnsLab({"public.example.com": [Record("A", "93.184.216.34")]}) as dns:
        path = write(tmp_path, "version: 1\ndefault: allow\n"
                               f"resolver: {{timeout: .nan, nameservers: ['{dns.address}']}}\n")
        result = egresswall(tmp_path, "check", "--policy", str(path), "https://public.example.com/")
        assert result.returncode == 2, (result.returncode, result.stdout)
        assert "policy.yaml:3:" in result.stderr


# ---- 3. YAML 1.1 number forms are still read -----------------------------------------------------------------

@pytest.mark.parametrize(("written", "read_as"), [
    ("limits: {idle_timeout: 1:30.0}", "90.0: YAML 1.1 sexagesimal float"),
    ("limits: {idle_timeout: 1_2_0.0}", "120.0: YAML 1.1 underscores"),
    ("ports: {http: [!!int 0120]}", "port 80: YAML 1.1 octal (YAML 1.2 reads 120)"),
    ("ports: {http: [!!int 1:20]}", "port 80: YAML 1.1 sexagesimal int"),
    ("log: {query_strings: !!bool yes}", "True: YAML 1.1 boolean word"),
])
def test_yaml_1_1_number_and_boolean_forms_are_errors(written, read_as):
    """README *The policy file*: "YAML 1.1 surprises (`default: no`) are errors with file:line:column", and
    policy/yamldoc.py promises plain scalars are read as YAML 1.2 (what an editor validating with schema.json
    uses): "`0443` is not octal 291 and `1:30` not sexagesimal 90: both are text, an error". Only the implicit int
    and bool resolvers were replaced: the float resolver is still YAML 1.1's (`1:30.0` is 90.0, `1_2_0.0` is
    120.0, both text to a YAML 1.2 editor), and an explicit `!!int`/`!!bool` tag is constructed by PyYAML's YAML 1.1
    constructors (`!!int 0120` is port 80 where YAML 1.2 reads 120; `!!int 0443` is port 291). Fix: in
    policy/yamldoc.py replace the float resolver with YAML 1.2 core's and register strict constructors for
    tag:yaml.org,2002:int/bool/float that refuse what YAML 1.2 core would not read so."""
    with pytest.raises(PolicyError):
        parse_policy("version: 1\n" + written + "\n", "p.yaml")


# ---- 4. a port list's meaning depends on what was parsed before in the process --------------------------------

def _loads(tmp_path: Path, *texts: str) -> list[str]:
    """Parse each text in turn in one fresh process: 'ok' or 'error' for each."""
    code = ("import sys\nfrom policy.loader import parse_policy\n"
            "for t in sys.argv[1:]:\n"
            "    try:\n        parse_policy(t, 'p.yaml'); print('ok')\n"
            "    except Exception as e:\n        print('error')\n")
    result = subprocess.run([sys.executable, "-c", code, *texts], capture_output=True, text=True, cwd=REPO,
                            timeout=60)
    return result.stdout.split()


def test_whether_a_port_list_loads_does_not_depend_on_the_policy_loaded_before(tmp_path):
    """policy/ports.py caches _expand with functools.cache, keyed by the tuple of values; (443.0,) == (443,) and
    they hash alike, so `ports: {connect: [!!float 443]}` (or `443.0`, which the schema's "integer" accepts) is
    refused in a fresh process ("got 443.0; expected a port number") but accepted once a policy with the port
    443 was parsed in the same process — as the running proxy has, whose default connect ports are [443]. So
    `egresswall lint` exits 2 on a file that a hot reload takes. The loader must decide a text the same way
    whatever it loaded before. Fix: in ports.parse_port_list, check the values (_bounds) before the cached
    expansion, or key the cache by (type, value)."""
    float_text = "version: 1\nports: {connect: [!!float 443]}\n"
    int_text = "version: 1\nports: {connect: [443]}\n"
    fresh = _loads(tmp_path, float_text)
    after = _loads(tmp_path, int_text, float_text)
    assert fresh[0] == after[1], f"alone: {fresh[0]}, after a policy with port 443: {after[1]}"


# ---- 5. host deny rules that lint calls clean but that refuse nothing -----------------------------------------

@pytest.mark.parametrize("condition", ["ports: []", "schemes: []"])
def test_a_deny_rule_with_an_empty_condition_list_is_not_silently_inert(tmp_path, condition):
    """`hosts.deny: [{host: blocked.example.com, ports: []}]` (a templating tool rendering an empty list, say)
    reads as a deny rule for the host; it loads, refuses nothing (no port is in the empty set), and `lint`
    says the file is clean, 0 warnings. README: lint "warns about rules that can never match". An empty list
    on an allow rule fails closed; on a deny rule it fails open. Fix: `"minItems": 1` on ports, schemes, methods
    and paths of hostEntry in policy/schema.json (a load error with file:line:column), or at least a lint
    warning in policy/lint.py _never_matches."""
    with DnsLab({"blocked.example.com": [Record("A", "93.184.216.34")]}) as dns:
        path = write(tmp_path, f"version: 1\ndefault: allow\nresolver: {{nameservers: ['{dns.address}']}}\n"
                               f"hosts:\n  deny:\n    - {{host: blocked.example.com, {condition}}}\n")
        checked = egresswall(tmp_path, "check", "--policy", str(path), "https://blocked.example.com/")
        linted = egresswall(tmp_path, "lint", str(path))
    if linted.returncode == 2:
        return  # refused at load: fine
    assert checked.returncode == 0, "the deny rule refused after all: then this test's premise is wrong"
    assert "warning:" in linted.stdout, (
        f"a deny rule that refuses nothing, and lint is silent:\n{linted.stdout}")


def test_a_deny_rule_for_wss_only_on_a_passed_through_host_is_warned_of(tmp_path):
    """`hosts.deny: [{host: chat.example.com, schemes: [wss]}]` reads as "no secure WebSockets to chat". README:
    "A `wss://` is an HTTPS tunnel" — every CONNECT is decided with scheme https, so on a host no allow rule
    intercepts the rule never matches: the CONNECT and the WebSocket inside go through (check says ALLOWED,
    `check wss://...` too, and the proxy agrees: tests/test_review_round21_operators_held.py). `lint` warns of the same
    shape for paths and methods ("its methods/paths are checked only in plain HTTP; HTTPS to this host passes
    through a TLS tunnel unchecked") but says nothing of a deny rule whose schemes are only wss (or https/wss
    paired with ports the host is not reached on). Fix: in policy/lint.py _never_matches, warn for a deny rule
    with schemes <= {"wss"} on a host no allow rule intercepts: "a wss:// through a passed-through tunnel is
    decided as https; this rule refuses only intercepted WebSockets (write schemes: [https] or intercept the
    host)"."""
    with DnsLab({"chat.example.com": [Record("A", "93.184.216.34")]}) as dns:
        path = write(tmp_path, f"version: 1\ndefault: allow\nresolver: {{nameservers: ['{dns.address}']}}\n"
                               "hosts:\n  deny:\n    - {host: chat.example.com, schemes: [wss]}\n")
        checked = egresswall(tmp_path, "check", "--policy", str(path), "wss://chat.example.com/socket")
        linted = egresswall(tmp_path, "lint", str(path))
    assert checked.returncode == 0 and '"verdict"' not in checked.stdout  # allowed: the rule never holds
    assert linted.returncode == 0
    assert "warning:" in linted.stdout and "policy.yaml:6:" in linted.stdout, linted.stdout


@pytest.mark.integration
@both_transports
def test_a_reload_to_a_nan_resolver_timeout_keeps_the_last_good_policy(lab, start_proxy):
    """A hot reload to `resolver: {timeout: .nan}` validates and is applied ("policy reloaded", counted a
    success). From then on a request to an allowed name gets NO answer at all: the connection closes with
    nothing written, and no audit record (README: "every refusal has exactly one"), on both transports;
    /readyz still says ready. README: hot reload
    "keeps the last good policy when the new file is invalid". Should: the edit is refused (logged with
    file:line:column) and the public host stays reachable. Fix as in test_a_nan_timeout_is_refused_at_load."""
    import signal
    import time
    proxy = start_proxy(lab.policy_text())
    url = f"http://public.lab.example:{lab.public.port}/"
    assert proxy.get(url)[0] == 200
    proxy.policy_path.write_text(lab.policy_text().replace("timeout: 1\n", "timeout: .nan\n"))
    proxy.signal(signal.SIGHUP)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and "reload" not in proxy.stderr:
        time.sleep(0.05)
    time.sleep(0.3)
    status, headers, _ = proxy.get(url)
    records = len(proxy.decisions())
    assert status == 200, (status, headers.get("x-egresswall-rule"), headers.get("x-egresswall-reason"),
                           f"{records} decision records (1 before the reload)")
