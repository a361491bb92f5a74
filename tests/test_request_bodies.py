"""A request body on a method that gives it no meaning, and ``http.body_allowed_on``.

GET, HEAD and TRACE bodies are refused whatever the policy says; DELETE and OPTIONS bodies are refused
unless the policy lists the method (an origin that does not read such a body takes it for the next request,
one egresswall never decided: test_review_round4.py and test_review_round5.py hold the smuggling itself).
Here: the rule (proxy/http_hygiene.py), the setting's parser and loader errors (policy/request_bodies.py,
policy/loader.py), the gate reading the policy in force, and both transports letting a listed method's body
through to the origin, refusing an unlisted one, and following a reload.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import jsonschema
import pytest
from audit_watch import AuditWatch
from hypothesis import given
from hypothesis import strategies as st
from proxyproc import both_transports, parse_response
from rawclient import read_all, tunnel

from policy.loader import PolicyError, parse_policy
from policy.request_bodies import ALWAYS_REFUSED, REFUSED_UNLESS_ALLOWED, parse_body_method
from proxy.audit import AuditLog
from proxy.gate import Gate, HttpAsk
from proxy.http_hygiene import UNEXPECTED_BODY, unexpected_body
from proxy.metrics import Metrics
from proxy.policy_file import DEFAULT_POLICY
from proxy.reload import PolicyHolder

SCHEMA = json.loads((Path(DEFAULT_POLICY).parent / "schema.json").read_text())
SETTING = "http.body_allowed_on"
LISTABLE = sorted(REFUSED_UNLESS_ALLOWED)


def setting(methods: str | None) -> str:
    return "" if methods is None else f"http:\n  body_allowed_on: {methods}\n"


# ---- the rule --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["GET", "HEAD", "TRACE", "get"])
@pytest.mark.parametrize("allowed", [frozenset(), frozenset({"GET", "HEAD", "TRACE", "DELETE", "OPTIONS"})])
def test_a_get_head_or_trace_body_is_refused_whatever_the_setting_holds(method, allowed):
    """Even a set the loader would never build (GET listed) lets no GET body through."""
    reason = unexpected_body(method, 5, False, allowed)
    assert reason is not None and "request carries a body (Content-Length: 5)" in reason
    assert "send the body with POST" in reason and SETTING not in reason  # no way out to offer


@pytest.mark.parametrize("method, article, section", [("DELETE", "a", "9.3.5"), ("OPTIONS", "an", "9.3.7")])
@pytest.mark.parametrize("chunked, length, what", [(False, 12, "Content-Length: 12"),
                                                   (True, None, "Transfer-Encoding: chunked")])
def test_a_delete_or_options_body_is_refused_by_default_with_a_reason_that_names_the_setting(
        method, article, section, chunked, length, what):
    reason = unexpected_body(method, length, chunked, frozenset())
    assert reason == (f"{article} {method} request carries a body ({what}); HTTP defines no general meaning for it "
                      f"(RFC 9110 {section}), and an origin that does not read it would take it for another request, "
                      "one egresswall never decided; send the body with POST, or, if every origin this policy allows "
                      f"reads {method} bodies, list {method} in http.body_allowed_on")


def test_a_listed_method_s_body_goes_through_and_the_other_one_s_does_not():
    assert unexpected_body("DELETE", 12, False, frozenset({"DELETE"})) is None
    assert unexpected_body("DELETE", None, True, frozenset({"DELETE"})) is None
    assert "list OPTIONS in http.body_allowed_on" in unexpected_body("OPTIONS", 12, False, frozenset({"DELETE"}))
    assert unexpected_body("OPTIONS", 12, False, frozenset({"DELETE", "OPTIONS"})) is None


def test_a_listed_method_in_another_case_is_another_method_and_the_reason_says_so():
    reason = unexpected_body("delete", 3, False, frozenset({"DELETE"}))
    assert reason is not None
    assert "methods are case-sensitive: http.body_allowed_on lists DELETE, not 'delete'" in reason


@pytest.mark.parametrize("method", ["GET", "DELETE", "OPTIONS"])
def test_no_body_or_an_empty_one_is_never_refused(method):
    assert unexpected_body(method, None, False, frozenset()) is None
    assert unexpected_body(method, 0, False, frozenset()) is None


METHODS = st.one_of(st.sampled_from(["GET", "HEAD", "TRACE", "DELETE", "OPTIONS", "POST", "PUT", "PATCH", "delete",
                                     "Options", "get"]),
                    st.text(alphabet="ABCDEGHILNOPRSTUXYZabcdeghilnoprstu", min_size=1, max_size=8))


@given(method=METHODS, length=st.one_of(st.none(), st.integers(0, 2**40)), chunked=st.booleans(),
       allowed=st.frozensets(st.sampled_from(LISTABLE)))
def test_a_body_is_refused_exactly_when_its_method_gives_it_no_meaning_and_the_policy_does_not_list_it(
        method, length, chunked, allowed):
    has_body = chunked or bool(length)
    named = method.upper()
    refused = has_body and (named in ALWAYS_REFUSED or (named in REFUSED_UNLESS_ALLOWED and method not in allowed))
    reason = unexpected_body(method, length, chunked, allowed)
    assert (reason is not None) == refused
    if reason is not None:
        assert f" {named} request carries a body" in reason
        assert (SETTING in reason) == (named in REFUSED_UNLESS_ALLOWED)  # the way out, only where there is one


# ---- the setting: parsing and loading -----------------------------------------------------------------------

@given(st.one_of(st.sampled_from(["DELETE", "OPTIONS", "GET", "delete", "Delete", "OPTIONS ", " DELETE", "POST",
                                  "TRACE", "head", "DELETE\n", ""]), st.text(max_size=12)))
def test_only_delete_and_options_are_accepted_exactly_as_written(text):
    if text in ("DELETE", "OPTIONS"):
        assert parse_body_method(text) == text
        return
    with pytest.raises(ValueError) as info:
        parse_body_method(text)
    message = str(info.value)
    assert message.startswith(f"got {text!r}; ")
    assert "DELETE" in message  # what may be written instead


def test_the_setting_loads_and_is_empty_by_default():
    assert parse_policy("version: 1\n").http.body_allowed_on == frozenset()
    assert parse_policy("version: 1\n" + setting("[]")).http.body_allowed_on == frozenset()
    assert parse_policy("version: 1\n" + setting("[DELETE]")).http.body_allowed_on == {"DELETE"}
    assert parse_policy("version: 1\n" + setting("[OPTIONS, DELETE]")).http.body_allowed_on == {"DELETE", "OPTIONS"}


BAD_SETTINGS = [
    # id, the value, (line, column), key, message
    ("GET listed", "[DELETE, GET]", (3, 29), "http.body_allowed_on[1]",
     "got 'GET'; a GET request's body is always refused (RFC 9110 9.3.1: it has no meaning, and an origin that does "
     "not read it takes it for another request); only DELETE and OPTIONS may be listed"),
    ("TRACE listed", "[TRACE]", (3, 21), "http.body_allowed_on[0]", "a TRACE request's body is always refused"),
    ("HEAD in lower case", "[head]", (3, 21), "http.body_allowed_on[0]", "a HEAD request's body is always refused"),
    ("unknown method", "[PURGE]", (3, 21), "http.body_allowed_on[0]",
     "got 'PURGE'; expected DELETE or OPTIONS, the methods whose request body egresswall refuses unless they are "
     "listed here (a body on POST, PUT, PATCH or any other method is never refused)"),
    ("POST listed", "[POST]", (3, 21), "http.body_allowed_on[0]", "got 'POST'; expected DELETE or OPTIONS"),
    ("lower case", "[delete]", (3, 21), "http.body_allowed_on[0]",
     "got 'delete'; HTTP methods are case-sensitive: write 'DELETE'"),
    ("listed twice", "[DELETE, OPTIONS, DELETE]", (3, 38), "http.body_allowed_on[2]",
     "DELETE is listed twice (first at p.yaml:3:21)"),
    ("a string, not a list", "DELETE", (3, 20), "http.body_allowed_on", "got str 'DELETE'; expected array"),
    ("a number in the list", "[1]", (3, 21), "http.body_allowed_on[0]", "got int 1; expected string"),
    ("a mapping in the list", "[{method: DELETE}]", (3, 21), "http.body_allowed_on[0]",
     "got dict {'method': 'DELETE'}; expected string"),
    ("a boolean", "true", (3, 20), "http.body_allowed_on", "got bool True; expected array"),
]


@pytest.mark.parametrize("value, position, key, message", [case[1:] for case in BAD_SETTINGS],
                         ids=[case[0] for case in BAD_SETTINGS])
def test_a_wrong_setting_is_a_load_error_with_file_line_column_and_what_to_write(value, position, key, message):
    with pytest.raises(PolicyError) as info:
        parse_policy("version: 1\n" + setting(value), "p.yaml")
    (problem,) = info.value.problems
    assert (problem.line, problem.column) == position, str(problem)
    assert problem.key == key and message in problem.message, str(problem)
    assert str(problem).startswith(f"p.yaml:{position[0]}:{position[1]}: {key}: ")


def test_an_unknown_key_in_the_http_section_is_an_error():
    with pytest.raises(PolicyError) as info:
        parse_policy("version: 1\nhttp:\n  body_allowed: [DELETE]\n", "p.yaml")
    assert str(info.value) == "p.yaml:3:3: http.body_allowed: unknown key 'body_allowed'; expected one of: " \
                              "body_allowed_on"


def test_the_schema_declares_the_setting_for_an_editor():
    validator = jsonschema.Draft202012Validator(SCHEMA)
    assert list(validator.iter_errors({"version": 1, "http": {"body_allowed_on": ["DELETE", "OPTIONS"]}})) == []
    assert list(validator.iter_errors({"version": 1, "http": {"body_allowed_on": "DELETE"}}))
    assert list(validator.iter_errors({"version": 1, "http": {"bodies": []}}))
    described = SCHEMA["properties"]["http"]["properties"]["body_allowed_on"]["description"]
    assert "DELETE and OPTIONS" in described and "GET, HEAD and TRACE bodies are always refused" in described


# ---- the gate reads the policy in force ------------------------------------------------------------------

def test_the_gate_follows_the_policy_in_force_across_a_reload(lab, tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text(lab.policy_text())
    holder = PolicyHolder(str(policy))
    gate = Gate(holder, AuditLog(str(tmp_path / "audit.jsonl")), Metrics())
    authority = f"public.lab.example:{lab.public.port}"

    def ask(method: str) -> HttpAsk:
        return HttpAsk("10.0.0.1", method, "http", "public.lab.example", lab.public.port, "/item",
                       host_header=authority, content_length=7)

    refused = asyncio.run(gate.decide_request(ask("DELETE"), None)).refusal
    assert refused.status == 400 and refused.verdict.rule == UNEXPECTED_BODY
    assert "list DELETE in http.body_allowed_on" in refused.verdict.reason
    policy.write_text(lab.policy_text(setting("[DELETE]")))
    assert holder.reload()
    allowed = asyncio.run(gate.decide_request(ask("DELETE"), None))
    assert allowed.refusal is None and allowed.verdict.allowed
    assert asyncio.run(gate.decide_request(ask("OPTIONS"), None)).refusal.verdict.rule == UNEXPECTED_BODY
    assert asyncio.run(gate.decide_request(ask("GET"), None)).refusal.verdict.rule == UNEXPECTED_BODY


# ---- through the real proxy, both transports ---------------------------------------------------------------

def _policy(lab, methods: str | None) -> str:
    """The lab policy; CONNECT to the plain-HTTP port allowed too (such a tunnel carries HTTP, decided request
    by request)."""
    return lab.policy_text(setting(methods)).replace("  connect: [", f"  connect: [{lab.public.port}, ")


def _with_body(method: str, target: str, authority: str, framing: str, body: str) -> bytes:
    framed = (f"Content-Length: {len(body)}\r\n\r\n{body}" if framing == "length"
              else f"Transfer-Encoding: chunked\r\n\r\n{len(body):x}\r\n{body}\r\n0\r\n\r\n")
    return f"{method} {target} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n{framed}".encode()


def _seen_since(lab, before: int) -> list[tuple[str, str]]:
    time.sleep(0.3)  # the origin's handler thread records the request
    return [(method, path) for method, path, _ in lab.public.requests[before:]]


@pytest.mark.integration
@both_transports
def test_a_listed_delete_body_reaches_the_origin_and_an_unlisted_options_body_is_refused(lab, start_proxy):
    port = lab.public.port
    authority = f"public.lab.example:{port}"
    proxy = start_proxy(_policy(lab, "[DELETE]"))
    before = len(lab.public.requests)
    for framing in ("length", "chunked"):
        status, _, body = parse_response(proxy.raw(_with_body("DELETE", f"http://{authority}/item-{framing}",
                                                              authority, framing, '{"id": 7}')))
        assert (status, body) == (200, b"got 9 bytes"), framing  # the origin read the whole body
    with tunnel(proxy, authority) as sock:
        sock.sendall(_with_body("DELETE", "/in-tunnel", authority, "length", '{"id": 8}'))
        status, _, body = parse_response(read_all(sock, 5))
    assert (status, body) == (200, b"got 9 bytes")
    assert _seen_since(lab, before) == [("DELETE", "/item-length"), ("DELETE", "/item-chunked"),
                                        ("DELETE", "/in-tunnel")]
    audit = AuditWatch(proxy.log_path).mark()
    before = len(lab.public.requests)
    status, headers, _ = parse_response(proxy.raw(_with_body("OPTIONS", f"http://{authority}/item", authority,
                                                             "length", "x")))
    assert status == 400 and headers["x-egresswall-rule"] == UNEXPECTED_BODY
    assert _seen_since(lab, before) == []
    (refused,) = [r for r in audit.wait_for(lambda r: r) if r["verdict"] == "refuse"]
    assert refused["method"] == "OPTIONS" and refused["status"] == 400
    assert "list OPTIONS in http.body_allowed_on" in refused["reason"]


@pytest.mark.integration
@both_transports
def test_delete_and_options_bodies_are_refused_by_default_and_a_reload_allows_delete(lab, start_proxy):
    port = lab.public.port
    authority = f"public.lab.example:{port}"
    proxy = start_proxy(_policy(lab, None))
    audit = AuditWatch(proxy.log_path).mark()
    before = len(lab.public.requests)
    for method in ("DELETE", "OPTIONS"):
        status, headers, _ = parse_response(proxy.raw(_with_body(method, f"http://{authority}/default", authority,
                                                                 "chunked", "hello")))
        assert status == 400 and headers["x-egresswall-rule"] == UNEXPECTED_BODY, method
    with tunnel(proxy, authority) as sock:
        sock.sendall(_with_body("OPTIONS", "/in-tunnel", authority, "length", "hello"))
        status, headers, _ = parse_response(read_all(sock, 5))
    assert status == 400 and headers["x-egresswall-rule"] == UNEXPECTED_BODY
    assert _seen_since(lab, before) == []
    refused = [r for r in audit.wait_for(lambda r: len(r) >= 3) if r["verdict"] == "refuse"]
    assert [(r["method"], r["rule"]) for r in refused] == [("DELETE", UNEXPECTED_BODY), ("OPTIONS", UNEXPECTED_BODY),
                                                           ("OPTIONS", UNEXPECTED_BODY)]
    assert "list DELETE in http.body_allowed_on" in refused[0]["reason"]

    proxy.policy_path.write_text(_policy(lab, "[DELETE]"))

    def delete_status() -> int:
        return parse_response(proxy.raw(_with_body("DELETE", f"http://{authority}/after-reload", authority,
                                                   "length", "hello")))[0]

    deadline = time.monotonic() + 5
    while delete_status() != 200:
        assert time.monotonic() < deadline, "the reloaded policy was not applied"
        time.sleep(0.1)
    assert ("DELETE", "/after-reload") in _seen_since(lab, before)


# ---- the documentation says what the code does ---------------------------------------------------------------

README = (Path(DEFAULT_POLICY).parent.parent / "README.md").read_text()


def _yaml_blocks(text: str) -> list[str]:
    return [block.split("```", 1)[0] for block in text.split("```yaml\n")[1:]]


def test_the_readme_policy_example_and_the_setting_s_snippet_load():
    reference = README[README.index("## The policy file"):]
    example = _yaml_blocks(reference)[0]
    assert parse_policy(example, "README.md").http.body_allowed_on == frozenset()
    start = README.index("**A body on a method that gives it no meaning.**")
    section = README[start:README.index("## The policy file")]
    (snippet,) = _yaml_blocks(section)
    assert parse_policy("version: 1\n" + snippet, "README.md").http.body_allowed_on == {"DELETE"}
    said = " ".join(section.split())
    assert "`GET`, `HEAD`, `TRACE`, `DELETE` or `OPTIONS`" in said and "400, `http:unexpected-body`" in said


def test_the_bundled_default_lists_no_method():
    assert parse_policy(Path(DEFAULT_POLICY).read_text(), DEFAULT_POLICY).http.body_allowed_on == frozenset()
