"""Review round 21, a newcomer's check of the round's documentation changes (README.md, compose/README.md,
squid-compat/README.md, ``git diff 168a62a..HEAD``) against the code and the shipped files.

No proxy is started: the gate is driven in process against the loopback lab's DNS (as tests/test_gate.py does),
policies are parsed in process, the manifests are read as YAML. The tests whose name ends in ``_holds`` checked
a sentence that is true today; the others each fail on today's tree and say which sentence they contradict.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml
from mitmproxy.http import Headers

from policy.errors import PolicyError
from policy.hosts import Target
from policy.lint import lint
from policy.loader import parse_policy
from proxy.audit import AuditLog
from proxy.gate import Gate, HttpAsk
from proxy.metrics import Metrics
from proxy.reload import PolicyHolder

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
COMPOSE_README = (ROOT / "compose" / "README.md").read_text()
SQUID_README = (ROOT / "squid-compat" / "README.md").read_text()


@pytest.fixture
def gate(lab, tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text(lab.policy_text())
    made = Gate(PolicyHolder(str(policy)), AuditLog(str(tmp_path / "audit.jsonl")), Metrics())
    yield made
    made.audit.close()


def load(text: str):
    return parse_policy(text, "p.yaml")


def load_error(text: str) -> str:
    with pytest.raises(PolicyError) as caught:
        load(text)
    return str(caught.value)


# --- README, *What is refused*: two Host headers ------------------------------------------------------------


def test_two_identical_host_headers_beside_an_absolute_url_are_refused_holds(lab, gate):
    """Even two equal Host headers are refused (their joined value names no host) by the gate itself; the decision
    addon answers two Host headers 400 before the gate is asked (README: "400 `form:host-header`, in either
    form"; tests/test_review_round21_records_json.py ::test_two_host_headers_in_absolute_form_get_the_same_rule_holds
    on a live proxy, which was 403 until this helper's finding)."""
    port = lab.public.port
    sent = Headers([(b"Host", f"public.lab.example:{port}".encode())] * 2)
    ask = HttpAsk("10.0.0.1", "GET", "http", "public.lab.example", port, "/", host_header=sent.get("host"),
                  authority=f"public.lab.example:{port}")
    outcome = asyncio.run(gate.decide_request(ask, None))
    assert outcome.refusal is not None and outcome.refusal.verdict.rule == "form:host-header"


# --- README, *The policy file*: numbers and booleans -------------------------------------------------------


def test_the_readme_says_which_numbers_the_policy_reads():
    """README, *The policy file*, said "numbers and booleans are read as YAML 1.2 reads them", and YAML 1.2's core
    schema reads `0x10` and `0o20` as 16 (and `0443` as 443), where the policy reads them as text: an editor
    validating against policy/schema.json with a YAML 1.2 parser called such a file valid. The sentence now says
    what the loader reads: YAML 1.2's decimal form without a leading zero, no hex or octal."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "numbers and booleans are read as YAML 1.2 reads them" not in readme
    assert "a number is YAML 1.2's decimal form without a leading zero (no hex, octal, `.nan` or `.inf`)" in readme
    for text in ("0x10", "0o20", "0443"):
        with pytest.raises(PolicyError):
            load(f"version: 1\ndefault: allow\nlimits:\n  max_connections: {text}\n")


@pytest.mark.parametrize(("value", "words"), [
    ("default: no", "got 'no'; expected one of: allow, deny"),
    ("limits:\n  connect_timeout: 0443", "without a leading zero"),
    ("limits:\n  connect_timeout: 1:30", "expected number"),
    ("limits:\n  connect_timeout: 1_000", "expected number"),
    ("resolver:\n  timeout: .nan", "finite number"),
    ("resolver:\n  timeout: .inf", "finite number"),
    ("limits:\n  max_connections: 123456789012345678901", "at most 20"),
    ("limits:\n  max_connections: 443.0", "whole number"),
    ("ports:\n  connect: [443.0]", "whole number"),
    ("limits:\n  max_connections: !!int 0120", "leading zero"),
    ("addresses:\n  refuse_cloud_metadata: !!bool yes", "true or false"),
    ("resolver:\n  timeout: !!float 1_0", "decimal number"),
    ("hosts:\n  deny:\n    - host: a.example.com\n      ports: []", "leave the key out"),
    ("hosts:\n  deny:\n    - host: a.example.com\n      methods: []", "leave the key out"),
], ids=["no", "0443", "1:30", "1_000", ".nan", ".inf", "21-digits", "443.0", "port-443.0", "!!int-0120",
        "!!bool-yes", "!!float-1_0", "ports-[]", "methods-[]"])
def test_the_policy_file_paragraphs_examples_are_errors_with_a_position_holds(value, words):
    """README, *The policy file*: each example of the round's new paragraph is an error at file:line:column."""
    message = load_error(f"version: 1\ndefault: allow\n{value}\n")
    assert message.startswith("p.yaml:") and words in message, message


def test_a_20_digit_integer_loads_holds():
    assert load("version: 1\ndefault: allow\nlimits:\n  max_connections: 12345678901234567890\n")


def test_lint_warns_of_a_wss_only_deny_rule_on_a_host_no_rule_intercepts_holds():
    """README, `lint`: "a rule whose `schemes` name `wss` but not `https` on a host no rule intercepts": a warning,
    and none once an allow rule intercepts the host or the rule names https too."""
    rule = "    - host: a.example.com\n      schemes: [wss]\n"
    assert [w.message for w in lint(load(f"version: 1\ndefault: allow\nhosts:\n  deny:\n{rule}"))
            if "wss" in w.message]
    intercepted = (f"version: 1\ndefault: allow\nhosts:\n  deny:\n{rule}  allow:\n"
                   "    - host: a.example.com\n      intercept: true\n")
    assert not [w.message for w in lint(load(intercepted)) if "scheme wss" in w.message]
    both = "version: 1\ndefault: allow\nhosts:\n  deny:\n    - host: a.example.com\n      schemes: [wss, https]\n"
    assert not [w.message for w in lint(load(both)) if "scheme wss" in w.message]


# --- README, *Upstream proxy*: the Host header --------------------------------------------------------------


@pytest.mark.parametrize(("url", "header"), [
    ("http://Example.COM./a", "example.com"),
    ("http://example.com:80/a", "example.com"),
    ("http://example.com:8080/a", "example.com:8080"),
    ("http://[2001:db8::1]/a", "[2001:db8::1]"),
    ("http://[2001:db8::1]:81/a", "[2001:db8::1]:81"),
])
def test_the_upstreams_host_header_names_the_decided_host_without_the_default_port_holds(url, header):
    """README: "in a plain request's `Host` header as in its request line (the header without the scheme's
    default port, as a client writes it)" (``Target.host_header``, set by proxy/addons/upstream.py)."""
    from policy.hosts import parse_url
    target: Target = parse_url(url)
    assert target.host_header == header


# --- compose/README.md ---------------------------------------------------------------------------------------


def _k8s_pods() -> dict[str, dict]:
    pods = {}
    for path in sorted((ROOT / "compose" / "k8s").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") in ("Deployment", "StatefulSet"):
                pods[f"{path.relative_to(ROOT)}:{doc['metadata']['name']}"] = doc["spec"]["template"]["spec"]
    return pods


def test_compose_readme_says_which_pods_wait_60_s():
    """compose/README.md said "Both shapes' pods have `terminationGracePeriodSeconds: 60`" and "the Kubernetes pods
    have the same 60 s": the shared shape's browser pods (k8s/shared/browser-pool.yaml) have 30 and its Redis
    Kubernetes' default of 30; only the pods that run the proxy have 60 (below). It now names those pods."""
    readme = " ".join((ROOT / "compose" / "README.md").read_text().split())
    assert "Both shapes' pods have" not in readme and "the Kubernetes pods have the same 60 s" not in readme
    assert "The pods that run the proxy (the sidecar pod, the shared shape's `egresswall` Deployment) have " \
           "`terminationGracePeriodSeconds: 60`" in readme
    waits = {name: spec.get("terminationGracePeriodSeconds", 30) for name, spec in _k8s_pods().items()}
    shorter = {name.rsplit(":", 1)[1] for name, wait in waits.items() if wait != 60}
    assert shorter == {"browser-pool", "egresswall-redis"}, waits


def test_the_proxys_pods_and_compose_wait_60_s_holds():
    pods = _k8s_pods()
    proxies = {name: spec["terminationGracePeriodSeconds"] for name, spec in pods.items()
               if any(c["name"] == "egresswall" for c in spec["containers"])}
    assert proxies and set(proxies.values()) == {60}, proxies
    compose = yaml.safe_load((ROOT / "compose" / "docker-compose.yml").read_text())
    assert compose["services"]["proxy"]["stop_grace_period"] == "60s"


def test_the_deployed_policy_is_the_bundled_default_but_tunnel_grace_holds():
    """compose/README.md: "The file starts as the bundled default, `policy/default.yaml`, with one change:
    `limits.tunnel_grace` is 50 s instead of 10"."""
    bundled = yaml.safe_load((ROOT / "policy" / "default.yaml").read_text())
    deployed = yaml.safe_load((ROOT / "compose" / "policy" / "policy.yaml").read_text())
    assert deployed["limits"].pop("tunnel_grace") == 50
    assert deployed == bundled
    assert load((ROOT / "policy" / "default.yaml").read_text()).limits.tunnel_grace == 10


def test_the_images_section_matches_the_files_holds():
    """compose/README.md, *The images*: the manifests' image names and version, the placeholder app image and its
    PLAYWRIGHT_SERVER, a .dockerignore beside each Dockerfile, the commented images: block, the browser pool's
    Service for ws://browser-pool.egresswall.svc:3000/."""
    version = next(line.split('"')[1] for line in (ROOT / "pyproject.toml").read_text().splitlines()
                   if line.startswith("version = "))
    assert version == "0.1.0"
    images = set()
    for spec in _k8s_pods().values():
        for container in spec.get("initContainers", []) + spec["containers"]:
            images.add(container["image"])
    assert images == {"egresswall/proxy:0.1.0", "egresswall/browser:0.1.0", "egresswall/netlock:0.1.0",
                      "registry.example/your-link-reader-app:latest", "redis:7.4"}
    for name in ("proxy", "browser", "netlock"):
        assert (ROOT / "compose" / f"Dockerfile.{name}.dockerignore").is_file()
    kustomization = (ROOT / "compose" / "k8s" / "kustomization.yaml").read_text()
    assert "# images:" in kustomization.split("configMapGenerator")[1]
    sidecar = yaml.safe_load((ROOT / "compose" / "k8s" / "sidecar" / "deployment.yaml").read_text())
    (app,) = [c for c in sidecar["spec"]["template"]["spec"]["containers"] if c["name"] == "app"]
    assert {"name": "PLAYWRIGHT_SERVER", "value": "ws://127.0.0.1:3000/"} in app["env"]
    services = [doc for doc in yaml.safe_load_all((ROOT / "compose/k8s/shared/browser-pool.yaml").read_text())
                if doc["kind"] == "Service"]
    assert [s["metadata"]["name"] for s in services] == ["browser-pool"]
    assert services[0]["spec"]["ports"][0]["port"] == 3000


def test_callers_in_other_namespaces_need_both_labels_holds():
    """compose/README.md: "a labelled pod in an unlabelled namespace is refused" (one peer with the namespace's
    label AND the pod's), in both shapes' NetworkPolicies."""
    for path, label in (("compose/k8s/sidecar/networkpolicy.yaml", "egresswall.io/link-reader-client"),
                        ("compose/k8s/shared/networkpolicy.yaml", "egresswall.io/browser-client")):
        docs = list(yaml.safe_load_all((ROOT / path).read_text()))
        peers = [peer for doc in docs for rule in doc["spec"].get("ingress", []) for peer in rule.get("from", [])
                 if label in str(peer)]
        assert {"podSelector": {"matchLabels": {label: "true"}}} in peers
        assert {"namespaceSelector": {"matchLabels": {label: "true"}},
                "podSelector": {"matchLabels": {label: "true"}}} in peers
        assert not [p for p in peers if "namespaceSelector" in p and "podSelector" not in p]


# --- squid-compat/README.md ----------------------------------------------------------------------------------


def _export(text: str) -> str:
    from squid_compat.exporter import export_policy
    return export_policy(load(text))


def test_squid_export_path_and_method_paragraphs_hold():
    """squid-compat/README.md: a glob's * and ? stop at the '?', any query may follow; a [...] class makes a deny
    rule refuse every path of its host and is left out of an allow rule, as is a '?' in an allow rule's prefix;
    an extension method is listed in every spelling, past 256 the deny rule refuses every method."""
    out = _export("version: 1\ndefault: allow\nhosts:\n  deny:\n"
                  "    - host: a.example.com\n      paths: ['/api/*/re?d']\n"
                  "    - host: b.example.com\n      paths: ['/x/[ab]*']\n"
                  "    - host: c.example.com\n      methods: [PATCH]\n"
                  "    - host: d.example.com\n      methods: [ABCDEFGHI]\n"
                  "  allow:\n    - host: e.example.com\n      paths: ['/x/[ab]*', '/ok/']\n"
                  "    - host: f.example.com\n      paths: ['/search?q']\n")
    assert r"urlpath_regex -i ^/api/[^?]*/re[^?]d(\?.*)?$" in out
    assert "http_access deny ew_host3\n" in out  # b: every path
    assert out.count("method ") >= 4 and "Patch" in out and "patch" in out and "PATCH" in out
    assert "too many spellings to list, so this deny rule refuses every method" in out
    assert "left out of this allow rule" in out.split("allow e.example.com")[1]
    assert "acl ew_paths8 urlpath_regex ^/ok/" in out
    assert "http_access allow ew_host9" not in out  # f: its only path has a '?', so no allow line


def test_the_readmes_name_what_the_round_added_holds():
    """The folder table names mitm_upstream_wait.py; the Commands table the flags the CLI has."""
    assert "mitm_upstream_wait.py" in README and (ROOT / "proxy" / "mitm_upstream_wait.py").is_file()
    for flag in ("--no-admin", "--confdir", "--proxy-ca", "--upstream-ca", "--no-sandbox"):
        assert flag in README
    assert "ws://0.0.0.0:3000/" in COMPOSE_README and "`[...]` class" in SQUID_README
