"""A request whose host or port the core refuses gets the core's refusal on both transports, and the one
``egresswall check`` gives for the same URL.

The fast path reads an absolute-form target with the core (policy.hosts); mitmproxy's layers parse it first
with mitmproxy's own parser, which refused many of those forms itself (``GET http://a..b/``,
``CONNECT a..b:443``, a port of 0 or 65536, userinfo, ``%``: a 400 ``http:malformed``) or read them its own
way (port 0 as the scheme's default; ``[1.2.3.4]`` as the IPv4 inside), and an origin-form request whose
Host header it could not read was a 400 "destination unknown". The core's words are the authority: both
transports answer the same status, X-Egresswall-Rule and X-Egresswall-Reason, write the same record (ids and
times apart), and ``egresswall check`` names the same rule and reason.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from proxyproc import ROOT, TRANSPORTS, ProxyProcess, parse_response

from policy.hosts import HostFormError, normalise_host

pytestmark = pytest.mark.integration
VOLATILE = {"id", "time", "duration_ms"}

# (request line and Host header, the URL ``egresswall check`` is asked about)
ABSOLUTE = [
    "a..b", "xn--abc", "xn--abc.example", "[1.2.3.4]", "a" * 64 + ".example", ".a.example", "a.example..",
    "-a.example", "a_b.example", "localhost", "nodot", "0x7f.1", "127.1", "2130706433", "a.local",
    "user@public.lab.example", "user:pw@public.lab.example", "public.lab.example:0", "public.lab.example:65536",
    "public.lab.example:", "public.lab.example:99999999", "public%2elab.example", "[fe80::1%25eth0]",
    "[fe80::1%eth0]", "[::1", "[::1]x", "a:b:c", "[1.2.3.4]:80",
]
CONNECT = [
    "a..b:443", "[1.2.3.4]:443", "xn--abc:443", "public.lab.example:0", "public.lab.example:65536",
    "public.lab.example:", "user@public.lab.example:443", "[fe80::1%eth0]:443", "public%2elab.example:443",
    ".a.example:443", "a_b.example:443", "nodot:443",
]
ORIGIN = ["a..b", "xn--abc", "[1.2.3.4]", "public.lab.example:0", "public.lab.example:", "user@public.lab.example",
          "public%2elab.example", ".a.example", "a" * 64 + ".example", "[fe80::1%eth0]"]


def cases() -> list[tuple[str, bytes, str]]:
    out = [(f"http://{a}/", f"GET http://{a}/ HTTP/1.1\r\nHost: {a}\r\n\r\n".encode(), f"http://{a}/")
           for a in ABSOLUTE]
    out += [(f"CONNECT {a}", f"CONNECT {a} HTTP/1.1\r\nHost: {a}\r\n\r\n".encode(), f"https://{a}/")
            for a in CONNECT]
    out += [(f"Host: {h}", f"GET /p HTTP/1.1\r\nHost: {h}\r\nAccept: application/json\r\n\r\n".encode(),
             f"http://{h}/p") for h in ORIGIN]
    return out


CASES = cases()


def policy_text(lab) -> str:
    return (f"version: 1\nmode: enforce\ndefault: allow\nports:\n  http: [80]\n  connect: [443]\n"
            f"resolver:\n  nameservers: ['{lab.dns.address}']\n  timeout: 1\n")


@pytest.fixture(scope="module")
def proxies(lab, tmp_path_factory):
    """One proxy per transport, on one policy file (the records name it)."""
    folder = tmp_path_factory.mktemp("host-form")
    policy = folder / "policy.yaml"
    policy.write_text(policy_text(lab))
    started = {name: ProxyProcess(["--policy", str(policy), *args], folder / f"{name}.jsonl")
               for name, args in TRANSPORTS.items()}
    yield policy, started
    for proxy in started.values():
        proxy.stop()
    for proxy in started.values():
        assert not proxy.outbound(), proxy.outbound()  # nothing of this was forwarded anywhere


def exchange(proxy: ProxyProcess, raw: bytes) -> tuple[int, dict[str, str], bytes, list[dict]]:
    """The answer to ``raw`` and the records it added."""
    before = len(proxy.audit())
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(raw)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    deadline = time.monotonic() + 5
    while len(records := proxy.audit()) <= before and time.monotonic() < deadline:
        time.sleep(0.02)
    status, headers, body = parse_response(data)
    return status, headers, body, [{k: v for k, v in r.items() if k not in VOLATILE} for r in records[before:]]


def answers(proxies, raw: bytes) -> dict[str, tuple]:
    return {name: exchange(proxy, raw) for name, proxy in proxies[1].items()}


def checked(policy, urls: list[str]) -> dict[str, dict]:
    """``egresswall check --json`` on each URL: {url: its verdict}."""
    done = subprocess.run([sys.executable, "-m", "proxy.cli", "check", "--json", "--policy", str(policy), *urls],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    verdicts = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(verdicts) == len(urls), done.stderr
    return {v["url"]: v for v in verdicts}


@pytest.fixture(scope="module")
def check_verdicts(proxies):
    return checked(proxies[0], [url for _, _, url in CASES])


def assert_core_refusal_on_both(seen: dict[str, tuple], verdict: dict | None = None) -> None:
    fast, mitm = seen["fast"], seen["mitmproxy"]
    assert (fast[0], mitm[0]) == (403, 403), seen
    rule, reason = fast[1].get("x-egresswall-rule"), fast[1].get("x-egresswall-reason")
    assert rule and rule.startswith("form:"), seen
    assert (mitm[1].get("x-egresswall-rule"), mitm[1].get("x-egresswall-reason")) == (rule, reason), seen
    assert fast[2] == mitm[2], seen  # the same body (text or JSON, as the Accept header asks)
    assert fast[3] == mitm[3] and len(fast[3]) == 1, seen  # one decision record, the same on both
    record = fast[3][0]
    assert (record["rule"], record["reason"], record["status"]) == (rule, reason, 403), record
    if verdict is not None:
        # An origin-form request's reason names where the host came from: its Host header, not a URL's authority.
        assert (verdict["rule"], verdict["reason"]) == (rule, reason.replace("the Host header", "the authority")), (
            verdict, record)


@pytest.mark.parametrize("name, raw, url", CASES, ids=[c[0] for c in CASES])
def test_a_host_the_core_refuses_gets_the_cores_refusal_on_both_transports_and_from_check(
        proxies, check_verdicts, name, raw, url):
    assert_core_refusal_on_both(answers(proxies, raw), check_verdicts[url])


@pytest.mark.parametrize("authority, connect, host", [
    ("public.lab.example.", "public.lab.example.:443", "public.lab.example"),
    ("PUBLIC.Lab.Example", "PUBLIC.Lab.Example:443", "public.lab.example"),
    ("public.lab.example:080", "public.lab.example:0443", "public.lab.example"),
    ("public.lab.example:00080", "public.lab.example:00443", "public.lab.example"),
    ("[::ffff:7f00:2]", "[::ffff:7f00:2]:443", "127.0.0.2"),
    ("[0:0:0:0:0:ffff:127.0.0.2]:80", "[0:0:0:0:0:ffff:127.0.0.2]:443", "127.0.0.2"),
    ("[::1]", "[::1]:443", "::1"),
])
def test_well_formed_spellings_are_read_alike_on_both_transports(proxies, authority, connect, host):
    """Trailing dot, upper case, a port with leading zeros, IPv6 spellings of one address: read as the core
    reads them, and refused alike by the address rules (the lab's policy admits no address, so nothing is
    connected), in absolute form, as a CONNECT and in a Host header."""
    for raw in (f"GET http://{authority}/ HTTP/1.1\r\nHost: {authority}\r\n\r\n",
                f"CONNECT {connect} HTTP/1.1\r\nHost: {connect}\r\n\r\n",
                f"GET / HTTP/1.1\r\nHost: {authority}\r\n\r\n"):
        seen = answers(proxies, raw.encode())
        assert seen["fast"][0] == seen["mitmproxy"][0] == 403, seen
        assert seen["fast"][1].get("x-egresswall-rule") == seen["mitmproxy"][1].get("x-egresswall-rule"), seen
        assert seen["fast"][3] == seen["mitmproxy"][3], seen
        assert seen["fast"][3][0]["host"] == host and seen["fast"][3][0]["stage"] == "address", seen


HOST_TEXT = st.text(alphabet="ab0-.:[]_%@xn", min_size=1, max_size=12).filter(lambda h: refused_by_core(h))


def refused_by_core(host: str) -> bool:
    try:
        normalise_host(host)
    except HostFormError:
        return True
    return False


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.filter_too_much])
@given(host=HOST_TEXT, form=st.sampled_from(["absolute", "connect", "origin"]))
def test_any_host_the_core_refuses_is_refused_alike_on_both_transports(proxies, host, form):
    """Property: for any host text the core refuses, both transports refuse it with the same status, rule,
    reason and record. (Its rule is the core's for the whole target, which may name the port or brackets.)"""
    if form == "absolute":
        raw = f"GET http://{host}/ HTTP/1.1\r\nHost: {host}\r\n\r\n"
    elif form == "connect":
        raw = f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n\r\n"
    else:
        raw = f"GET / HTTP/1.1\r\nHost: {host}\r\n\r\n"
    seen = answers(proxies, raw.encode())
    fast, mitm = seen["fast"], seen["mitmproxy"]
    assert fast[0] == mitm[0] and fast[0] in (400, 403), seen
    assert fast[1].get("x-egresswall-rule") == mitm[1].get("x-egresswall-rule"), seen
    assert fast[1].get("x-egresswall-reason") == mitm[1].get("x-egresswall-reason"), seen
    assert fast[3] == mitm[3], seen
    if fast[0] == 400:  # only a request line that is not three words (none here) is mitmproxy's own 400
        pytest.fail(f"a generic 400 for a host the core refuses: {seen}")
