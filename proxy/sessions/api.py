"""The session API on the admin listener: create, read, extend and end sessions (JSON).

    POST   /v1/sessions              {"grants": {"urls": [...], "hosts": [...]}, "ttl": 600, "budgets": {...}}
                                     → 201 {"id", "secret", "proxy_authorization", "expires", ...}
    GET    /v1/sessions              → 200 {"sessions": [ids in force]}
    GET    /v1/sessions/ID           → 200 the session (never its secret) with its usage
    POST   /v1/sessions/ID/extend    {"ttl": 600} → 200 the session, expiring ttl seconds from now
    PATCH  /v1/sessions/ID           the same as extend
    DELETE /v1/sessions/ID           → 204; the session is refused from now on

Every route needs ``Authorization: Bearer <token>``, the token being the content of ``--admin-token-file``
(compared in constant time); without a token file the API is not served at all. Errors are JSON
``{"error", "reason", "field"?, "problems"?}``: 401 (no or wrong token), 400 (malformed JSON, invalid
grants — the same rules and words as the policy file), 404 (no such session), 503 (the store is down).
"""

from __future__ import annotations

import hmac
import json
import os
import stat
from datetime import UTC, datetime
from typing import Any

from policy.credentials import basic_value
from policy.sessions import SESSION_ID, Session, SessionSpecError, parse_extension, parse_session_spec

from ..admin import MAX_BODY
from ..aiohttp_web import web
from .service import SessionService
from .store import StoreUnavailable

MIN_TOKEN = 16


def read_token_file(path: str) -> str:
    """The admin token: the file's content without surrounding whitespace; ValueError says what is wrong."""
    try:
        info = os.stat(path)
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot be read: {getattr(err, 'strerror', None) or err}") from None
    if len(token) < MIN_TOKEN or any(ch.isspace() or not ch.isprintable() for ch in token):
        raise ValueError(f"expected one token of at least {MIN_TOKEN} printable characters without spaces "
                         "(e.g. from: head -c 32 /dev/urandom | base64)")
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError("is readable by other users; chmod 600 it (it is a credential)")
    return token


def _error(status: int, error: str, reason: str, **more: Any) -> web.Response:
    body = {"error": error, "reason": reason, **more}
    headers = {"Cache-Control": "no-store"}
    if status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="egresswall-admin"'
    return web.json_response(body, status=status, headers=headers)


def _time(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


class SessionApi:
    def __init__(self, service: SessionService, token: str) -> None:
        self.service = service
        self.token = token.encode()

    def register(self, app: web.Application) -> None:
        app.middlewares.append(self._authorized)
        app.router.add_post("/v1/sessions", self.create)
        app.router.add_get("/v1/sessions", self.list_ids, allow_head=False)
        app.router.add_get("/v1/sessions/{id}", self.read, allow_head=False)
        app.router.add_post("/v1/sessions/{id}/extend", self.extend)
        app.router.add_patch("/v1/sessions/{id}", self.extend)
        app.router.add_delete("/v1/sessions/{id}", self.end)

    @web.middleware
    async def _authorized(self, request: web.Request, handler):
        if not request.path.startswith("/v1/"):
            return await handler(request)
        given = request.headers.getall("Authorization", [])
        scheme, _, token = given[0].partition(" ") if len(given) == 1 else ("", "", "")
        # Compared in constant time, and always: a missing header costs what a wrong one does. A byte that is not
        # UTF-8 (aiohttp keeps it as a surrogate) is compared as the byte it was: a wrong token, not a 500.
        ok = hmac.compare_digest(token.strip().encode("utf-8", "surrogateescape"), self.token) \
            and scheme.lower() == "bearer"
        if not ok:
            reason = ("no Authorization header; send Authorization: Bearer <the token in --admin-token-file>"
                      if not given else "the bearer token is wrong (or the header is not 'Bearer <token>')")
            return _error(401, "unauthorized", reason)
        try:
            return await handler(request)
        except StoreUnavailable as err:
            return _error(503, "unavailable", str(err))

    # ---- routes -------------------------------------------------------------------------------

    async def create(self, request: web.Request) -> web.Response:
        data = await _json_body(request)
        if isinstance(data, web.Response):
            return data
        try:
            spec = parse_session_spec(data)
        except SessionSpecError as err:
            return _invalid(err)
        session, secret = self.service.new_session(spec)
        await self.service.store.put(session)
        self.service.metrics.session_created()
        body = self._view(session, None)
        body.update(secret=secret, proxy_authorization=basic_value(session.id, secret),
                    proxy={"username": session.id, "password": secret})
        return web.json_response(body, status=201, headers={"Cache-Control": "no-store",
                                                            "Location": f"/v1/sessions/{session.id}"})

    async def list_ids(self, request: web.Request) -> web.Response:
        return web.json_response({"sessions": await self.service.store.ids(self.service.clock())})

    async def read(self, request: web.Request) -> web.Response:
        session = await self._session(request)
        if isinstance(session, web.Response):
            return session
        return web.json_response(self._view(session, await self.service.store.usage(session.id)))

    async def extend(self, request: web.Request) -> web.Response:
        session = await self._session(request)
        if isinstance(session, web.Response):
            return session
        data = await _json_body(request)
        if isinstance(data, web.Response):
            return data
        try:
            ttl = parse_extension(data)
        except SessionSpecError as err:
            return _invalid(err)
        now = self.service.clock()
        if now >= session.expires:
            # Expired is ended: its requests were told session:expired, and a platform that let it lapse must not
            # bring it back, counters and all, by the way (it is kept an hour only to say so; review round 22).
            return _error(409, "expired", f"session {session.id} expired {now - session.expires:.0f}s ago and cannot "
                                          "be extended; create a new one")
        updated = await self.service.store.set_expiry(session.id, now + ttl)
        if updated is None:
            return _not_found(session.id)
        return web.json_response(self._view(updated, await self.service.store.usage(session.id)))

    async def end(self, request: web.Request) -> web.Response:
        session_id = request.match_info["id"]
        if not SESSION_ID.match(session_id) or not await self.service.store.delete(session_id):
            return _not_found(session_id)
        self.service.metrics.session_ended()
        return web.Response(status=204)

    # ---- helpers ------------------------------------------------------------------------------

    async def _session(self, request: web.Request) -> Session | web.Response:
        session_id = request.match_info["id"]
        session = await self.service.store.get(session_id) if SESSION_ID.match(session_id) else None
        return session if session is not None else _not_found(session_id)

    def _view(self, session: Session, usage) -> dict[str, Any]:
        now = self.service.clock()
        view: dict[str, Any] = {"id": session.id, "created": _time(session.created), "expires": _time(session.expires),
                                "expired": now >= session.expires, "grants": session.grants.as_json(),
                                "budgets": session.budgets.as_json()}
        if usage is not None:
            view["usage"] = usage.as_json()
        return view


async def _json_body(request: web.Request) -> Any:
    """The request's JSON (strict: no duplicate keys, no NaN), or the 400 to answer."""
    if request.content_type != "application/json":
        return _error(400, "malformed", f"expected Content-Type: application/json, got {request.content_type!r}")
    try:
        text = (await request.read()).decode("utf-8")
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
    except web.HTTPRequestEntityTooLarge:  # in the API's words, as every other refusal of it
        return _error(413, "too-large", f"the body is over {MAX_BODY} bytes; a session's grants are smaller")
    except (UnicodeDecodeError, ValueError) as err:
        return _error(400, "malformed", f"the body is not valid JSON: {err}")
    except RecursionError:  # the decoder's own bound on nesting (a 64 KiB body can nest 32,000 levels)
        return _error(400, "malformed", "the body is JSON nested deeper than a session's grants ever are")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _invalid(err: SessionSpecError) -> web.Response:
    field, reason = err.problems[0]
    return _error(400, "invalid", reason, field=field,
                  problems=[{"field": f, "reason": r} for f, r in err.problems])


def _not_found(session_id: str) -> web.Response:
    shown = session_id if SESSION_ID.match(session_id) else "(not a session id)"
    return _error(404, "not-found", f"no session {shown} (it ended, expired over an hour ago, or never existed)")
