"""The admin API (``/admin/*``), served on the management plane only.

Every ``/admin/`` route asks for ``Authorization: Bearer $ADMIN_TOKEN``, checked in
constant time by :class:`AdminAuth` from a middleware keyed on the matched route (so
a route added later under ``/admin/`` cannot be forgotten), or for a console session
(cookie + ``X-CSRF-Token`` on changes; role ``viewer`` reads only, 403 ``read_only``;
see :mod:`gateway.admin.session`). With no token and no single sign-on configured
every admin route answers 403 ``admin_disabled``; a missing or wrong token is 401.

Key changes go through :class:`gateway.auth.keys.KeyStore` (the CLI's store) bound to one
connection, with their :mod:`gateway.admin.audit` row written in the same transaction (subject
budgets likewise through :class:`gateway.billing.budgets.SubjectBudgetStore`). Every
change fires the ``api_keys_changed`` trigger, so each replica's AuthActor evicts the
key within milliseconds: a PATCHed limit, a revocation or a rotation holds everywhere
within a second; a subject budget reaches every replica's budget check with its next
spend refresh (about a second). Handlers are thin: parse (:mod:`gateway.admin.input`),
act, answer.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Middleware

from gateway.admin import views as admin_views
from gateway.admin.audit import AuditLog
from gateway.admin.input import (
    ADMIN_BODY_LIMIT,
    QUERIES,
    parse_audit_query,
    parse_budget_list_query,
    parse_budget_set,
    parse_key_create,
    parse_key_list_query,
    parse_key_patch,
    parse_revoke,
    parse_rotation,
    parse_usage_query,
    read_admin_body,
)
from gateway.admin.session import (
    COOKIE,
    CSRF_HEADER,
    SAFE_METHODS,
    CsrfRefused,
    ReadOnlyRole,
    SessionStore,
    csrf_matches,
)
from gateway.auth.keys import KeyNotFound, KeyPolicy, KeyRecord, KeyStateError, KeyStore
from gateway.billing.budgets import SubjectBudget, SubjectBudgetStore
from gateway.core.db import CONNECTION_ERRORS
from gateway.core.errors import (
    AdminDisabled,
    AdminUnauthorized,
    Conflict,
    InvalidRequest,
    NotFound,
    ServiceUnavailable,
)
from gateway.http.middleware import request_id_of
from gateway.http.state import STATE

__all__ = [
    "ADMIN_ACTOR", "ADMIN_ROLE", "AdminAuth", "add_admin_routes", "admin_body_limit", "admin_guard", "checked_query",
    "list_page",
]

log = logging.getLogger("gateway.admin")

ADMIN_PREFIX = "/admin/"
#: Below this an admin token is logged as weak (e.g. ``openssl rand -hex 32`` gives 64).
MIN_TOKEN_LEN = 16
#: Who is acting, set by the guard on every admin request (the audit trail's "actor").
ADMIN_ACTOR = web.RequestKey("admin_actor", str)
#: The role of who is acting: ``admin`` (the admin token, or an admin session) or ``viewer``.
ADMIN_ROLE = web.RequestKey("admin_role", str)
#: A key is addressed by its id or its 12-character prefix, never by the raw key.
_KEY_REF = re.compile(r"[A-Za-z0-9_-]{12}")
#: Fields of a key whose change an audit row shows (state follows from them).
_AUDITED_FIELDS = (
    "name", "rate_limit_requests", "rate_limit_window_seconds", "tokens_per_minute", "max_concurrent",
    "budget_usd", "budget_period", "allowed_models", "expires_at", "revoked_at",
)
#: Query parameters each listing accepts (its model's fields); anything else is a typo worth a 400.
_QUERY_PARAMS: dict[str, tuple[str, ...]] = {
    **{kind: tuple(model.__pydantic_fields__) for kind, model in QUERIES.items()},
    "none": (),
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class AdminAuth:
    """The admin token check, and the name the audit trail gives its holder.

    Only the token's SHA-256 is kept; comparing digests with ``hmac.compare_digest``
    takes the same time whatever the presented token and its length.
    """

    __slots__ = ("_digest", "actor", "fingerprint")

    def __init__(self, token: str | None, name: str | None = None) -> None:
        if token:
            if len(token) < MIN_TOKEN_LEN:
                # Still accepted (the operator chose it), but a guessable token guards every key.
                log.warning("ADMIN_TOKEN is shorter than %d characters: use a long random token", MIN_TOKEN_LEN)
            digest = hashlib.sha256(token.encode("utf-8", "surrogatepass"))
            self._digest: bytes | None = digest.digest()
            self.actor = name or f"token:{digest.hexdigest()[:12]}"
            #: Ties console sessions to this token: a new ADMIN_TOKEN ends the old ones.
            self.fingerprint: str | None = hashlib.sha256(b"console-session:" + self._digest).hexdigest()[:32]
        else:
            self._digest = None
            self.actor = name or "disabled"
            self.fingerprint = None

    @property
    def enabled(self) -> bool:
        return self._digest is not None

    def check(self, authorization: str | None) -> str:
        """The actor for this ``Authorization`` header; AdminDisabled or AdminUnauthorized."""
        if self._digest is None:
            raise AdminDisabled()
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise AdminUnauthorized()
        presented = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
        if not hmac.compare_digest(presented, self._digest):
            raise AdminUnauthorized()
        return self.actor


def admin_guard(auth: AdminAuth, *, sign_on: bool = False) -> Middleware:
    """Middleware: every route whose path starts ``/admin/`` needs the admin token, or a
    console session (:mod:`gateway.admin.session`: cookie, plus the CSRF token on a change;
    a ``viewer`` session may only read).

    Keyed on the matched route, not the raw path, so no spelling of a URL reaches an
    admin handler around it; unmatched paths fall through to the usual 404/405. With
    neither a token nor single sign-on (``sign_on``) configured the API is disabled.
    """

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        resource = request.match_info.route.resource
        if resource is None or not resource.canonical.startswith(ADMIN_PREFIX):
            return await handler(request)
        try:
            request[ADMIN_ACTOR], request[ADMIN_ROLE] = await _authorize(request, auth, sign_on)
        except AdminUnauthorized:
            log.warning("admin request refused (bad token or session) from %s: %s %s",
                        request.remote, request.method, resource.canonical)
            raise
        try:
            return await handler(request)
        except CONNECTION_ERRORS as exc:
            # Every admin route reads or writes PostgreSQL: while it is away, say so and
            # when to retry, rather than a bare 500. Nothing was changed (one transaction).
            log.warning("admin request %s failed: database unavailable (%r)", request_id_of(request), exc)
            raise ServiceUnavailable("database unavailable", code="database_unavailable", retry_after=1) from None

    return guard


async def _authorize(request: web.Request, auth: AdminAuth, sign_on: bool) -> tuple[str, str]:
    """The actor of this request and its role: the bearer token's (``admin``), else the
    session's (role and CSRF checked)."""
    authorization = request.headers.get("Authorization")
    cookie = request.cookies.get(COOKIE)
    if authorization is not None or cookie is None:
        if not auth.enabled and sign_on:
            # Single sign-on only: no token to present, a session to sign in for.
            raise AdminDisabled("no ADMIN_TOKEN is set: sign in at /ui/ for a session")
        return auth.check(authorization), "admin"
    try:
        session = await SessionStore(request.app[STATE].pool).get(cookie, admin_fingerprint=auth.fingerprint)
    except CONNECTION_ERRORS:
        raise ServiceUnavailable("database unavailable", code="database_unavailable", retry_after=1) from None
    if session is None:
        raise AdminUnauthorized("no admin token, and the console session has ended: sign in again")
    if request.method not in SAFE_METHODS:
        if not csrf_matches(session, request.headers.get(CSRF_HEADER)):
            raise CsrfRefused()
        if not session.may_change:
            raise ReadOnlyRole()
    return session.principal, session.role


def admin_body_limit(body_limit: int) -> int:
    """The management plane's body limit: REQUEST_BODY_LIMIT_BYTES, at most 64 KiB."""
    return min(body_limit, ADMIN_BODY_LIMIT)


# -- helpers ------------------------------------------------------------------------
def _json(obj: Any, *, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json", headers=headers)


def checked_query(request: web.Request, kind: str) -> dict[str, str]:
    """The query string of a route of ``kind`` (``QUERIES``), unknown parameters refused (400)."""
    allowed = _QUERY_PARAMS[kind]
    for name in request.query:
        if name not in allowed:
            hint = f" (allowed: {', '.join(allowed)})" if allowed else ""
            raise InvalidRequest(f"unknown query parameter '{name}'{hint}", code="invalid_query")
    return {name: request.query[name] for name in request.query}


def _key_ref(request: web.Request) -> str:
    ref = request.match_info["id"]
    try:
        return str(uuid.UUID(ref))
    except ValueError:
        pass
    if not _KEY_REF.fullmatch(ref):
        raise NotFound(f"no key with id or prefix {ref[:64]!r}", code="key_not_found")
    return ref


def _subject_ref(request: web.Request) -> uuid.UUID:
    """The ``{subject_id}`` of a budget route: a UUID, else 400 (nothing to look up)."""
    try:
        return uuid.UUID(request.match_info["subject_id"])
    except ValueError:
        raise InvalidRequest("'subject_id' in the path must be a UUID", code="invalid_field") from None


def _no_budget(subject_id: uuid.UUID) -> NotFound:
    return NotFound(f"subject {subject_id} has no budget", code="budget_not_found")


def list_page(items: Sequence[dict[str, Any]], limit: int, id_field: str) -> dict[str, Any]:
    """OpenAI's list shape; ``items`` holds up to ``limit + 1`` entries (the extra one says "more")."""
    shown = list(items[:limit])
    return {
        "object": "list",
        "data": shown,
        "has_more": len(items) > limit,
        "first_id": shown[0][id_field] if shown else None,
        "last_id": shown[-1][id_field] if shown else None,
    }


@contextlib.contextmanager
def _store_errors() -> Iterator[None]:
    """The key store's refusals, as the contract's errors."""
    try:
        yield
    except KeyNotFound as exc:
        raise NotFound(f"no key with id or prefix {exc.args[0]!r}", code="key_not_found") from None
    except KeyStateError as exc:
        raise Conflict(str(exc), code="key_state_conflict") from None
    except ValueError as exc:
        raise InvalidRequest(str(exc), code="invalid_field") from None


@dataclass(frozen=True, slots=True)
class _Change:
    """The stores and the audit trail bound to one transaction, and who is acting."""

    keys: KeyStore
    budgets: SubjectBudgetStore
    trail: AuditLog
    actor: str
    request_id: str
    remote: str | None

    async def record(self, action: str, api_key_id: uuid.UUID | None, detail: dict[str, Any]) -> None:
        await self.trail.record(
            actor=self.actor, action=action, api_key_id=api_key_id, detail=detail,
            request_id=self.request_id, remote=self.remote,
        )


@contextlib.asynccontextmanager
async def _audited(request: web.Request) -> AsyncIterator[_Change]:
    """One admin change and its audit row: both commit, or neither does."""
    state = request.app[STATE]
    with _store_errors():
        async with state.pool.acquire() as conn, conn.transaction():
            yield _Change(
                keys=KeyStore(conn), budgets=SubjectBudgetStore(conn), trail=AuditLog(conn),
                actor=request[ADMIN_ACTOR], request_id=request_id_of(request), remote=request.remote,
            )


def _changes(before: KeyRecord, after: KeyRecord) -> dict[str, dict[str, Any]]:
    old, new = before.to_json(), after.to_json()
    return {f: {"from": old[f], "to": new[f]} for f in _AUDITED_FIELDS if old[f] != new[f]}


def _limit(request: web.Request) -> int:
    return admin_body_limit(request.app[STATE].settings.body_limit)


# -- keys ---------------------------------------------------------------------------
async def create_key(request: web.Request) -> web.Response:
    """``POST /admin/keys``: 201 with the raw key, shown this once."""
    checked_query(request, "none")
    spec = parse_key_create(await read_admin_body(request, _limit(request)))
    async with _audited(request) as change:
        raw, record = await change.keys.create(
            spec.name, subject_id=spec.subject_id, policy=KeyPolicy(**spec.policy), expires_at=spec.expires_at,
        )
        shown = record.to_json()
        await change.record("key.create", record.api_key_id, {
            f: shown[f] for f in ("name", "subject_id", "key_prefix", *_AUDITED_FIELDS) if shown.get(f) is not None
        })
    return _json({"api_key": raw, **shown}, status=201, headers={"Location": f"/admin/keys/{record.api_key_id}"})


async def list_keys(request: web.Request) -> web.Response:
    """``GET /admin/keys``: newest first, by subject and state, paged with ``after``."""
    q = parse_key_list_query(checked_query(request, "keys"))
    records = await request.app[STATE].keys.list(
        subject_id=q.subject_id, state=q.state, limit=q.limit + 1, after=q.after,
    )
    return _json(list_page([r.to_json() for r in records], q.limit, "api_key_id"))


async def get_key(request: web.Request) -> web.Response:
    """``GET /admin/keys/{id}`` (id or 12-character prefix)."""
    checked_query(request, "none")
    ref = _key_ref(request)
    with _store_errors():
        record = await request.app[STATE].keys.get(ref)
    return _json(record.to_json())


async def update_key(request: web.Request) -> web.Response:
    """``PATCH /admin/keys/{id}``: only the fields sent change; every replica within a second."""
    checked_query(request, "none")
    ref = _key_ref(request)
    patch = parse_key_patch(await read_admin_body(request, _limit(request)))
    async with _audited(request) as change:
        before = await change.keys.get(ref, for_update=True)
        after = await change.keys.update(
            str(before.api_key_id), name=patch.name, expires_at=patch.expires_at, **patch.policy
        )
        await change.record("key.update", after.api_key_id, {"changes": _changes(before, after)})
    return _json(after.to_json())


async def revoke_key(request: web.Request) -> web.Response:
    """``POST /admin/keys/{id}/revoke``: idempotent; an optional ``reason`` is audited."""
    checked_query(request, "none")
    ref = _key_ref(request)
    reason = parse_revoke(await read_admin_body(request, _limit(request), optional=True))
    async with _audited(request) as change:
        before = await change.keys.get(ref, for_update=True)
        record = await change.keys.revoke(str(before.api_key_id))
        detail: dict[str, Any] = {"already_revoked": before.state == "revoked"}
        if reason:
            detail["reason"] = reason
        await change.record("key.revoke", record.api_key_id, detail)
    return _json(record.to_json())


async def rotate_key(request: web.Request) -> web.Response:
    """``POST /admin/keys/{id}/rotate``: 201 with the new raw key; the old one is revoked,
    or keeps working for ``grace_seconds`` (its expiry is moved in)."""
    checked_query(request, "none")
    ref = _key_ref(request)
    rotation = parse_rotation(await read_admin_body(request, _limit(request), optional=True))
    async with _audited(request) as change:
        old_id = str((await change.keys.get(ref, for_update=True)).api_key_id)
        raw, new = await change.keys.rotate(old_id, grace=rotation.grace)
        old = await change.keys.get(old_id)
        detail: dict[str, Any] = {
            "new_api_key_id": str(new.api_key_id),
            "new_key_prefix": new.key_prefix,
            "grace_seconds": int(rotation.grace.total_seconds()) if rotation.grace else 0,
            "old_key_expires_at": old.expires_at.isoformat() if old.expires_at else None,
        }
        if rotation.reason:
            detail["reason"] = rotation.reason
        await change.record("key.rotate", old.api_key_id, detail)
    return _json(
        {"api_key": raw, **new.to_json(), "previous": old.to_json()},
        status=201, headers={"Location": f"/admin/keys/{new.api_key_id}"},
    )


# -- subject budgets ------------------------------------------------------------------
async def list_budgets(request: web.Request) -> web.Response:
    """``GET /admin/budgets``: subject budgets in subject order, paged with ``after``."""
    q = parse_budget_list_query(checked_query(request, "budgets"))
    budgets = await SubjectBudgetStore(request.app[STATE].pool).list(limit=q.limit + 1, after=q.after)
    return _json(list_page([b.to_json() for b in budgets], q.limit, "subject_id"))


async def get_budget(request: web.Request) -> web.Response:
    """``GET /admin/budgets/{subject_id}``: one subject's budget, or 404."""
    checked_query(request, "none")
    subject_id = _subject_ref(request)
    budget = await SubjectBudgetStore(request.app[STATE].pool).get(subject_id)
    if budget is None:
        raise _no_budget(subject_id)
    return _json(budget.to_json())


def _budget_fields(budget: SubjectBudget | None) -> dict[str, Any]:
    if budget is None:
        return {"budget_usd": None, "budget_period": None}
    return {"budget_usd": float(budget.budget_usd), "budget_period": budget.budget_period}


async def put_budget(request: web.Request) -> web.Response:
    """``PUT /admin/budgets/{subject_id}``: set or replace the budget of all the subject's
    keys together; 201 when the subject had none, else 200."""
    checked_query(request, "none")
    subject_id = _subject_ref(request)
    spec = parse_budget_set(await read_admin_body(request, _limit(request)))
    async with _audited(request) as change:
        before = await change.budgets.get(subject_id, for_update=True)
        after = await change.budgets.set(subject_id, spec.budget_usd, spec.budget_period)
        old, new = _budget_fields(before), _budget_fields(after)
        await change.record("budget.set", None, {
            "subject_id": str(subject_id),
            "changes": {f: {"from": old[f], "to": new[f]} for f in new if old[f] != new[f]},
        })
    return _json(
        after.to_json(), status=201 if before is None else 200,
        headers={"Location": f"/admin/budgets/{subject_id}"} if before is None else None,
    )


async def delete_budget(request: web.Request) -> web.Response:
    """``DELETE /admin/budgets/{subject_id}``: the subject's keys are capped by their own
    budgets only; answers the budget removed, or 404."""
    checked_query(request, "none")
    subject_id = _subject_ref(request)
    async with _audited(request) as change:
        before = await change.budgets.get(subject_id, for_update=True)
        if before is None:
            raise _no_budget(subject_id)
        await change.budgets.clear(subject_id)
        await change.record("budget.clear", None, {"subject_id": str(subject_id), **_budget_fields(before)})
    return _json(before.to_json())


# -- audit, usage, providers --------------------------------------------------------
async def list_audit(request: web.Request) -> web.Response:
    """``GET /admin/audit``: admin changes, newest first, paged with ``after``."""
    q = parse_audit_query(checked_query(request, "audit"))
    entries = await AuditLog(request.app[STATE].pool).page(
        limit=q.limit + 1, after=q.after, api_key_id=q.api_key_id, action=q.action,
    )
    return _json(list_page([e.to_json() for e in entries], q.limit, "id"))


async def usage(request: web.Request) -> web.Response:
    """``GET /admin/usage?group_by=key|model|day&since=&until=&api_key_id=``."""
    q = parse_usage_query(checked_query(request, "usage"))
    return _json(await admin_views.usage_view(request.app[STATE], q))


async def providers(request: web.Request) -> web.Response:
    """``GET /admin/providers``: providers, deployments, circuit state, latency, error rate."""
    checked_query(request, "none")
    return _json(admin_views.providers_view(request.app[STATE]))


def add_admin_routes(router: web.UrlDispatcher) -> None:
    """Register every ``/admin/`` route (the management plane only)."""
    router.add_post("/admin/keys", create_key)
    router.add_get("/admin/keys", list_keys)
    router.add_get("/admin/keys/{id}", get_key)
    router.add_patch("/admin/keys/{id}", update_key)
    router.add_post("/admin/keys/{id}/revoke", revoke_key)
    router.add_post("/admin/keys/{id}/rotate", rotate_key)
    router.add_get("/admin/budgets", list_budgets)
    router.add_get("/admin/budgets/{subject_id}", get_budget)
    router.add_put("/admin/budgets/{subject_id}", put_budget)
    router.add_delete("/admin/budgets/{subject_id}", delete_budget)
    router.add_get("/admin/audit", list_audit)
    router.add_get("/admin/usage", usage)
    router.add_get("/admin/providers", providers)
