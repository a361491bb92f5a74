"""Review round 22, topic "explain": `egresswall check` against what the running proxy decides.

1. A policy (or the client's role) with ``session: required``: `egresswall check URL --client IP` says
   ``ALLOWED`` (exit 0, ``verdict: allow`` in ``--json``) for a request that the proxy, for that same client
   and the same DNS answers, refuses ``407 session:required`` when no session is presented. ``check`` has no
   notion of sessions (``proxy/cli/check.py`` decides with ``policy.decision`` alone; the session gate is
   ``proxy/sessions/service.py`` ``SessionService._required``), so it neither refuses nor says that a session
   is required. README, *Commands*: check "explains a decision: verdict, the rule ... the reason"; an
   operator asking whether an agent's request would pass is told yes, and the proxy says no.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from proxyproc import both_transports, parse_response, read_response
from session_client import token_file

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("internal_saw_nothing")]

REPO = Path(__file__).resolve().parent.parent


def check_json(policy: Path, *args: str) -> list[dict]:
    done = subprocess.run([sys.executable, "-m", "proxy.cli", "check", "--json", "--policy", str(policy), *args],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode in (0, 1), done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def _raw(proxy, data: bytes) -> tuple[int, dict[str, str], bytes]:
    with socket.create_connection((proxy.host, proxy.port), timeout=5) as sock:
        sock.sendall(data)
        return parse_response(read_response(sock))


@both_transports
@pytest.mark.parametrize("where", ["policy", "role"])
def test_check_agrees_with_the_proxy_when_a_session_is_required(lab, start_proxy, tmp_path, where):
    """Same policy, same client address (127.0.0.1, the proxy's peer here), same DnsLab answers, no session:
    the proxy refuses ``session:required`` (407) for the plain URL and the CONNECT; `check --client 127.0.0.1`
    must not say ``allow`` for them. It does (exit 0, ``verdict: allow``, ``rule_id: default:allow``): check
    says allow where the running proxy refuses. README *Commands*: check "explains a decision: verdict, the
    rule ... the reason". Fix: in ``proxy/cli/check.py`` ``_check_one``, after the policy decision, apply
    ``policy.session_required(policy.role_for(client))`` (as ``SessionService._required`` does) and report the
    ``session:required`` refusal (or at least a ``session`` field saying the request needs a session that
    grants it), exit 1."""
    extra = ("session: required\n" if where == "policy"
             else "roles:\n  - name: agents\n    clients: [127.0.0.1/32]\n    session: required\n")
    proxy = start_proxy(lab.policy_text(extra), "--admin-token-file", str(token_file(tmp_path)))
    plain = f"http://public.lab.example:{lab.public.port}/x"
    authority = f"public.lab.example:{lab.public_tls.port}"
    status, headers, _ = proxy.get(plain)
    assert (status, headers.get("x-egresswall-rule")) == (407, "session:required"), (status, headers)
    status, headers, _ = _raw(proxy, f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    assert (status, headers.get("x-egresswall-rule")) == (407, "session:required"), (status, headers)
    said = check_json(proxy.policy_path, "--client", "127.0.0.1", plain, f"https://{authority}/")
    assert [row["verdict"] for row in said] == ["refuse", "refuse"], said


@both_transports
@pytest.mark.parametrize("tail", ["/#top", "/docs/a b", "/page?q=1#section"])
def test_check_decides_an_https_url_as_the_browser_sends_it(lab, start_proxy, tail):
    """`check https://HOST:PORT/...` with a fragment, or a space in the path (as copied from a browser's address
    bar or a document), says ``refuse`` ``form:url`` with the hint "the request is malformed ... fix the client:
    no policy change admits it"; the proxy, given what a browser sends for that URL (``CONNECT HOST:PORT``: the
    path, let alone the fragment, never reaches it), answers 200. README *Commands*: "`ws://`, `https://` and
    `wss://` URLs are checked as a browser sends them through a proxy, and as the proxy decides them: `CONNECT
    host:port` first", and "a path or query outside ASCII is decided as a browser sends it, percent-encoded".
    Check says refuse where the proxy allows. Fix: in ``proxy/cli/check.py`` ``_check_one`` drop a fragment
    (a browser never sends one) and percent-encode whitespace in the path/query as a browser does (``%20``)
    before ``parse_url``, as is already done for non-ASCII; print the URL actually decided."""
    proxy = start_proxy(lab.policy_text())
    authority = f"public.lab.example:{lab.public_tls.port}"
    sock, status, _ = proxy.connect(authority)
    sock.close()
    assert status == 200
    said = check_json(proxy.policy_path, "--client", "127.0.0.1", f"https://{authority}{tail}")
    assert said[0]["verdict"] == "allow", said
