"""Review round 21 (third topic): `egresswall squid export` against a real squid on loopback.

squid-compat/README.md ("export"): the export is "a squid.conf access-control section ... Comments say what squid
cannot express", and "Path rules become urlpath_regex, never admitting a path a server may read as another
(/docs/../admin)"; the exporter's own docstring: "where squid cannot be exact, the export refuses more than the
policy, never less".

Each test writes a policy whose deny rule has paths, exports it, runs the Debian squid (``squid -N``) on a
loopback port with a hosts file (the one name resolves to 127.0.0.2, re-admitted by the policy so squid's
refused-address line stays out of the way) and a dead loopback nameserver, sends plain-HTTP requests from
127.0.0.1, and compares squid's verdict with egresswall's own decision (policy.decision, in process). A request
the policy refuses and the exported squid lets through, with no comment in the export saying so, fails.
Network: loopback only (squid connects, if at all, to 127.0.0.2, where nothing listens on port 80).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from squid_compat.exporter import export_policy
from squid_files import hand_to_squid_user
from test_squid_differential import (
    PLUMBING,
    SQUID,
    Squid,
    _guard,
    free_port,
    squid_refused_request,
    squid_workdir,
)

from policy.decision import Request, Resolution, decide
from policy.hosts import parse_url
from policy.loader import parse_policy

pytestmark = pytest.mark.integration

HOST = "api.lab.test"
DEAD_NAMESERVER = "127.53.21.99"  # nothing listens: squid reads HOST from its hosts file


def policy_with_deny(field: str, values: str):
    """Everything allowed but a deny rule on HOST with ``field: [values]`` (YAML flow items)."""
    return parse_policy(f"""\
version: 1
default: allow
ports: {{connect: [443, "1025-65535"], http: [80, "1025-65535"]}}
addresses:
  allow: [127.0.0.2/32]
hosts:
  deny:
    - host: {HOST}
      {field}: [{values}]
""", "p.yaml")


def policy_with_deny_paths(*paths: str):
    return policy_with_deny("paths", ", ".join(f'"{p}"' for p in paths))


def egresswall_allows(policy, path: str) -> bool:
    target = parse_url(f"http://{HOST}{path}")
    return decide(policy, Request(target, "GET", "127.0.0.1"), Resolution(HOST, ("127.0.0.2",))).allowed


@contextmanager
def squid_running(exported: str, name: str) -> Iterator[int]:
    """A squid on a loopback port (yielded) with the export, HOST in its hosts file, and a dead nameserver."""
    if SQUID is None:
        pytest.skip("squid is not installed")
    workdir = squid_workdir(name)
    try:
        (workdir / "hosts").write_text(f"127.0.0.2 {HOST}\n")
        port = free_port()
        conf = workdir / "squid.conf"
        conf.write_text(PLUMBING.format(squid_port=port, dir=workdir, dns=DEAD_NAMESERVER) + _guard() + exported)
        hand_to_squid_user(workdir)
        squid = Squid(conf, port, workdir)
        try:
            yield port
        finally:
            squid.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def squid_allows(exported: str, paths: list[str]) -> dict[str, bool]:
    with squid_running(exported, "r21c-export") as port:
        return {path: not _refused(port, path) for path in paths}


def _refused(port: int, path: str) -> bool:
    return squid_refused_request(port, f"GET http://{HOST}{path} HTTP/1.1\r\nHost: {HOST}\r\n"
                                       "Connection: close\r\n\r\n".encode())


def wider_in_squid(deny_paths: tuple[str, ...], requests: list[str], said: tuple[str, ...] = ()) -> list[str]:
    """The requests egresswall refuses and the exported squid allows, unless the export comments on it
    (``said``: words a comment would have to carry)."""
    policy = policy_with_deny_paths(*deny_paths)
    exported = export_policy(policy)
    for path in requests:
        assert not egresswall_allows(policy, path), f"the policy itself must refuse {path}"
    squid = squid_allows(exported, requests + ["/unrelated"])
    assert squid["/unrelated"], "squid must allow what no rule refuses (the harness works)"
    comments = "\n".join(line for line in exported.splitlines() if line.startswith("#"))
    if said and any(word in comments for word in said):
        return []
    return [f"GET http://{HOST}{path}: egresswall refuses, the exported squid allows" for path in requests
            if squid[path]]


def test_a_glob_path_deny_holds_in_squid_with_a_query_string() -> None:
    """egresswall matches a path rule against the path without its query (policy/model.py path_matches:
    ``path.split("?", 1)[0]``); the export writes a glob as ``^...$`` for urlpath_regex, which squid matches
    against the path AND query: `paths: ["/files/*.exe"]` refuses /files/a.exe in squid but not
    /files/a.exe?dl=1. Fix (exporter.py _path_regex): end a glob with ``(\\?.*)?$`` (or ``($|\\?)``)."""
    assert not wider_in_squid(("/files/*.exe",), ["/files/a.exe?dl=1", "/files/a.exe?"])


def test_a_glob_path_deny_keeps_fnmatch_brackets_and_question_marks_in_squid() -> None:
    """A path pattern with '*' is an fnmatch glob in egresswall (policy/model.py path_pattern_matches:
    fnmatch.fnmatchcase), where ``[pt]`` is a character class and ``?`` one character; the export escapes both
    as literals (exporter.py _posix_literal), so `/x/*.ph[pt]` refuses /x/a.php in egresswall and nothing squid
    will ever see. Fix: translate a glob with fnmatch's own rules (``?`` -> ``.``, ``[...]`` -> a POSIX bracket,
    ``[!...]`` -> ``[^...]``), or refuse the whole host's paths with a comment when one cannot be written.
    (The fix: '?' is one character of the path, and a glob with a [...] class makes the deny rule refuse every
    path of the host, saying so.)"""
    assert not wider_in_squid(("/y/*.ph?",), ["/y/a.phx", "/y/b/a.php"])
    text = f"version: 1\ndefault: allow\nhosts:\n  deny:\n    - host: {HOST}\n      paths: ['/x/*.ph[pt]']\n"
    exported = export_policy(parse_policy(text, "p.yaml"))
    assert "which the export does not translate; this deny rule refuses every path" in exported, exported
    assert "\nhttp_access deny ew_host1\n" in exported, exported


def test_a_path_deny_holds_in_squid_for_path_parameters() -> None:
    """egresswall's deny rule matches the reading without ';' parameters too (policy/model.py path_matches:
    "Tomcat, Jetty and Spring drop a segment's ';' parameters ('/admin;x/secret' is /admin/secret there) ... a
    deny rule matches either reading"). The export's ambiguous-path guard (ew_ambiguous_path) catches ';' only
    after a dot segment, so `paths: ["/admin/secret"]` is refused by egresswall for /admin;x/secret and allowed
    by the exported squid. Fix (exporter.py _path_rule): add ``;`` to ew_ambiguous_path for deny rules (a
    segment with parameters is a path a server may read as another)."""
    assert not wider_in_squid(("/admin/secret",), ["/admin;x/secret", "/admin;jsessionid=1/secret"])


def test_a_path_deny_holds_in_squid_for_empty_segments() -> None:
    """canonical_path (policy/model.py) calls '//admin/' and '/a//b' ambiguous ("nginx merges slashes by default,
    Python's http.server strips leading ones, and both then serve /admin/"), so egresswall's deny rule refuses
    //admin/secret; ew_ambiguous_path has no empty-segment regex and squid allows it. Fix (exporter.py
    _path_rule): add ``//`` (and ``/;``) to ew_ambiguous_path."""
    assert not wider_in_squid(("/admin/secret",), ["//admin/secret", "/admin//secret"])


def test_export_path_denials_that_hold_in_squid_holds() -> None:
    """Held: case (-i), percent-encoded unreserved characters (squid decodes %61 as egresswall does), dot
    segments and the glob without a query all refuse in squid as in egresswall."""
    assert not wider_in_squid(("/admin/secret", "/files/*.exe"),
                              ["/admin/secret", "/ADMIN/Secret", "/%61dmin/secret", "/admin/%73ecret",
                               "/files/a.exe", "/files/a.EXE", "/ok/../admin/secret"])


def test_a_method_deny_of_an_extension_method_holds_in_squid_in_any_case() -> None:
    """egresswall compares methods upper-cased (policy/decision.py _conditions_hold: ``request.method.upper() not in
    rule.methods``), so `methods: [PATCH]` on a deny rule refuses `patch` and `Patch` too. squid 5.7 reads the
    methods it knows in any case but compares an extension method — PATCH among them — as written
    (squid-compat/README.md, Mapping: "an extension method (PATCH among them in squid 5.7) it compares as
    written"); the export writes `acl ew_methodsN method PATCH` with no comment, and the exported squid lets
    `patch http://host/` through. Fix (exporter.py _rule): for a method squid does not know
    (squid_compat.acls.SQUID_METHODS), write every case spelling (2**len, fine for PATCH), or refuse the host's
    requests of any unknown method with a comment saying why."""
    policy = policy_with_deny("methods", "PATCH, DELETE")
    exported = export_policy(policy)
    methods = ["PATCH", "patch", "Patch", "DELETE", "delete", "GET"]
    for method in methods[:-1]:
        target = parse_url(f"http://{HOST}/x")
        assert not decide(policy, Request(target, method, "127.0.0.1"), Resolution(HOST, ("127.0.0.2",))).allowed
    with squid_running(exported, "r21c-export-methods") as port:
        refused = {method: _refused_method(port, method) for method in methods}
    assert not refused["GET"], "the harness works: GET passes"
    wrong = [m for m in methods[:-1] if not refused[m]]
    assert not wrong, f"egresswall refuses, the exported squid allows: {wrong}\n" + exported[-600:]


def _refused_method(port: int, method: str) -> bool:
    return squid_refused_request(port, f"{method} http://{HOST}/x HTTP/1.1\r\nHost: {HOST}\r\n"
                                       "Connection: close\r\n\r\n".encode())
