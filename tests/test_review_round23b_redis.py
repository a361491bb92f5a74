"""Review round 23b (ops): a Redis session store answering what egresswall did not write (proxy/sessions/redis_store.py,
commit 91585ed). README (Sessions, The store): "If the store cannot be reached, requests that present a session are
refused with `503 session:store-unavailable` (fail closed)"; round 23 extended this to values egresswall cannot read.
Every case here must be refused (never 200), with a session: rule and a readable reason, and never reach the origin.
"""

from __future__ import annotations

import base64
import json
import shutil
import socket
import time

import pytest
from proxyproc import both_transports
from session_client import api, create, get, token_file
from test_sessions_redis import RedisServer

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs Debian's redis-server")]


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path)
    yield server
    server.stop()


def _raw(server: RedisServer, *words: bytes) -> bytes:
    with socket.create_connection((server.host, server.port), timeout=5) as sock:
        sock.sendall(b"*%d\r\n" % len(words) + b"".join(b"$%d\r\n%s\r\n" % (len(w), w) for w in words))
        data = b""
        while not data.endswith(b"\r\n") or (data.startswith(b"$") and data.count(b"\r\n") < 2
                                              and not data.startswith(b"$-1")):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        return data


def _record(server: RedisServer, session_id: str) -> dict:
    reply = _raw(server, b"GET", f"egresswall:session:{session_id}".encode())
    return json.loads(reply.split(b"\r\n", 1)[1].rsplit(b"\r\n", 1)[0])


def _set(server: RedisServer, key: str, value: bytes) -> None:
    """Replace ``key`` by a string, keeping its TTL away (the record lives long enough for the test)."""
    assert _raw(server, b"SET", key.encode(), value).startswith(b"+OK")


def _damage(server: RedisServer, sid: str, case: str, other: dict) -> None:
    key = f"egresswall:session:{sid}"
    record = _record(server, sid)
    if case == "record-is-a-list-type":
        _raw(server, b"DEL", key.encode())
        _raw(server, b"RPUSH", key.encode(), b"x")
    elif case == "usage-is-a-list-type":
        _raw(server, b"DEL", (key + ":usage").encode())
        _raw(server, b"RPUSH", (key + ":usage").encode(), b"x")
    elif case == "hosts-is-a-hash-type":
        _raw(server, b"DEL", (key + ":hosts").encode())
        _raw(server, b"HSET", (key + ":hosts").encode(), b"a", b"b")
    elif case in ("json-null", "json-list", "json-string", "json-number"):
        _set(server, key, {"json-null": b"null", "json-list": b"[1,2]", "json-string": b'"x"',
                           "json-number": b"7"}[case])
    elif case == "spec-missing":
        del record["spec"]
        _set(server, key, json.dumps(record).encode())
    elif case == "grants-a-string":
        record["spec"]["grants"] = "public.lab.example"
        _set(server, key, json.dumps(record).encode())
    elif case == "expires-nan-string":
        record["expires"] = "nan"
        _set(server, key, json.dumps(record).encode())
    elif case == "expires-NaN-literal":
        _set(server, key, json.dumps(record).replace(f"\"expires\": {json.dumps(record['expires'])}",
                                                     "\"expires\": NaN").encode())
    elif case == "expires-infinity":
        record["expires"] = "inf"
        _set(server, key, json.dumps(record).encode())
    elif case == "expires-in-the-past":
        record["expires"] = time.time() - 100
        _set(server, key, json.dumps(record).encode())
    elif case == "expires-a-bool":
        record["expires"] = True  # float(True) == 1.0: 1970
        _set(server, key, json.dumps(record).encode())
    elif case == "record-of-another-id":
        _set(server, key, json.dumps(_record(server, other["id"])).encode())
    elif case in ("counter-negative", "counter-huge", "counter-float", "counter-bytes"):
        value = {"counter-negative": b"-5", "counter-huge": b"9" * 40, "counter-float": b"1.5",
                 "counter-bytes": b"\xff\xfe"}[case]
        assert _raw(server, b"HSET", (key + ":usage").encode(), b"requests", value).startswith(b":")
    else:
        raise AssertionError(case)


CASES = ["record-is-a-list-type", "usage-is-a-list-type", "hosts-is-a-hash-type", "json-null", "json-list",
         "json-string", "json-number", "spec-missing", "grants-a-string", "expires-nan-string", "expires-NaN-literal",
         "expires-infinity", "expires-in-the-past", "expires-a-bool", "record-of-another-id", "counter-negative",
         "counter-huge", "counter-float", "counter-bytes"]


def _basic(sid: str, secret: str) -> str:
    return "Basic " + base64.b64encode(f"{sid}:{secret}".encode()).decode()


def _check(lab, proxy, redis_server, cases: list[str]) -> list[str]:
    problems = []
    for case in cases:
        session = create(proxy.admin_port, {"hosts": ["public.lab.example"]}, budgets={"requests": 100})
        other = create(proxy.admin_port, {"hosts": ["public.lab.example"]}, budgets={"requests": 100})
        url = f"http://public.lab.example:{lab.public.port}/r23b-{case}"
        assert get(proxy, url + "-before", session)[0] == 200
        _damage(redis_server, session["id"], case, other)
        seen = len(lab.public.requests)
        credential = (_basic(session["id"], other["secret"]) if case == "record-of-another-id"
                      else session["proxy_authorization"])
        status, headers, body = get(proxy, url, authorization=credential)
        reached = len(lab.public.requests) - seen
        rule, reason = headers.get("x-egresswall-rule", ""), headers.get("x-egresswall-reason", "")
        if status == 200 or reached or not rule.startswith("session:") or not reason:
            problems.append(f"{case}: {status} rule={rule!r} reason={reason[:100]!r} reached={reached}")
    return problems


def _proxy(lab, start_proxy, tmp_path, redis_server):
    return start_proxy(lab.policy_text("session: required\n"), "--admin-token-file", str(token_file(tmp_path)),
                       "--session-store", redis_server.url)


HELD = [c for c in CASES if c not in ("expires-nan-string", "expires-NaN-literal", "expires-infinity",
                                      "record-of-another-id")]


@both_transports
def test_store_garbage_is_refused_with_a_reason_holds(lab, start_proxy, tmp_path, redis_server):
    """WRONGTYPE keys, JSON of the wrong shape, missing or wrongly typed fields, an expiry in the past, negative,
    huge, fractional or non-ASCII counters: each refused with a session: rule and a reason, origin not reached."""
    problems = _check(lab, _proxy(lab, start_proxy, tmp_path, redis_server), redis_server, HELD)
    assert not problems, "\n".join(problems)


@both_transports
def test_a_nan_or_infinite_expiry_in_a_record_is_refused_with_a_session_reason(lab, start_proxy, tmp_path,
                                                                                redis_server):
    """proxy/sessions/store.py:68 session_from_record takes ``float(data["expires"])``, which accepts "nan",
    "inf" and JSON's NaN/Infinity: the record is "read" (redis_store.get does not raise StoreUnavailable), and
    then ``math.ceil`` in redis_store._expire_at (charge, redis_store.py:159) raises ValueError/OverflowError
    past the store. Fail closed, but not with the documented refusal: on mitmproxy's path 500
    egresswall:internal-error "(ValueError)"; on the fast path the client's connection is closed with NO answer
    at all. (And NaN compares false both ways: policy/sessions.py:264 ``now >= session.expires`` and
    service.py:148 never see it expire.) Expected (README, commit 91585ed): a record egresswall cannot read is
    503 session:store-unavailable with a reason. Fix: in session_from_record require finite numbers (int/float,
    not bool/str) for created/expires (math.isfinite), so get() raises _unreadable."""
    problems = _check(lab, _proxy(lab, start_proxy, tmp_path, redis_server), redis_server,
                      ["expires-nan-string", "expires-NaN-literal", "expires-infinity"])
    assert not problems, "\n".join(problems)


@both_transports
def test_a_record_stored_under_another_sessions_id_is_not_honoured(lab, start_proxy, tmp_path, redis_server):
    """The record at egresswall:session:A is session B's (its "id" is B, its digest B's secret's). Presenting
    A's id with B's secret is admitted (200, the origin reached) and charged to B: redis_store.get never checks
    that the record's id is the id it was asked for. A record not for the id asked is not one egresswall wrote
    there: it must fail closed (503 session:store-unavailable). Fix: in RedisStore.get (redis_store.py:108-115)
    raise self._unreadable(...) when session.id != session_id."""
    problems = _check(lab, _proxy(lab, start_proxy, tmp_path, redis_server), redis_server,
                      ["record-of-another-id"])
    assert not problems, "\n".join(problems)


def test_admin_views_of_damaged_records_fail_closed_with_a_reason(lab, start_proxy, tmp_path, redis_server):
    """proxy/sessions/api.py: a store problem is a 503 {"error", "reason"}. Today a record whose expiry is NaN or
    infinite makes GET /v1/sessions/ID a bare aiohttp 500 "Server got itself in trouble" (math.ceil / _time raise
    outside StoreUnavailable), and one non-UTF-8 member of egresswall:sessions makes the listing a bare 500
    (redis_store.py:244 ``m.decode()`` raises UnicodeDecodeError, not StoreUnavailable).
    The admin API over the same damage: GET /v1/sessions (the listing; a member of the ids set that is not
    UTF-8) and GET /v1/sessions/ID must answer 503 with a JSON reason (as for a store that cannot be reached),
    never 200 with made-up values and never a 500 without a reason."""
    proxy = start_proxy(lab.policy_text("session: required\n"), "--admin-token-file", str(token_file(tmp_path)),
                        "--session-store", redis_server.url)
    problems = []
    for case in ["record-is-a-list-type", "json-null", "expires-nan-string", "expires-NaN-literal",
                 "expires-infinity", "counter-negative", "counter-float"]:
        session = create(proxy.admin_port, {"hosts": ["public.lab.example"]})
        _damage(redis_server, session["id"], case, session)
        status, _, body = api(proxy.admin_port, "GET", f"/v1/sessions/{session['id']}")
        if status != 503 or not isinstance(body, dict) or not body.get("reason", body.get("message")):
            problems.append(f"GET one {case}: {status} {str(body)[:160]}")
        _raw(redis_server, b"DEL", f"egresswall:session:{session['id']}".encode(),
             f"egresswall:session:{session['id']}:usage".encode())
    assert _raw(redis_server, b"SADD", b"egresswall:sessions", b"\xff\xfebad").startswith(b":")
    status, _, body = api(proxy.admin_port, "GET", "/v1/sessions")
    if status != 503 or not isinstance(body, dict):
        problems.append(f"listing with a non-UTF-8 id: {status} {str(body)[:160]}")
    assert not problems, "\n".join(problems)
