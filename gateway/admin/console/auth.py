"""Signing in to the console and out again: the admin token, or OIDC.

Every console page asks for a session (:func:`console_page`): without one the browser
is sent to ``/ui/login``. Signing in writes a ``session.sign_in`` row to the audit
trail naming the person; signing out ends the session on every replica and writes
``session.sign_out``. Forms that post here check the ``Origin`` header (a page on
another site cannot sign anyone in or out) and, once signed in, the CSRF token.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from yarl import URL

from gateway.admin.audit import AuditLog
from gateway.admin.console.layout import esc, html_response, page
from gateway.admin.console.oidc import LOGIN_COOKIE, LOGIN_TTL, OidcClient, OidcRefused, PendingLogin
from gateway.admin.routes import AdminAuth
from gateway.admin.session import COOKIE, Session, SessionStore, csrf_matches, session_cookie
from gateway.core.config import AdminSettings
from gateway.core.db import CONNECTION_ERRORS
from gateway.core.errors import AdminDisabled, AdminUnauthorized
from gateway.http.middleware import request_id_of
from gateway.http.state import STATE

__all__ = ["CONSOLE", "Console", "console_page", "current_session", "sign_in_routes"]

log = logging.getLogger("gateway.console")


@dataclass(frozen=True, slots=True)
class Console:
    """What the console's handlers share: the token check, its settings, the OIDC client."""

    auth: AdminAuth
    settings: AdminSettings
    oidc: OidcClient | None


CONSOLE = web.AppKey("console", Console)
_SESSION = web.RequestKey("console_session", Session)

PageHandler = Callable[[web.Request, Session], Awaitable[web.StreamResponse]]


async def current_session(request: web.Request) -> Session | None:
    """The request's live session, or None."""
    if _SESSION in request:
        return request[_SESSION]
    token = request.cookies.get(COOKIE)
    if not token:
        return None
    session = await SessionStore(request.app[STATE].pool).get(
        token, admin_fingerprint=request.app[CONSOLE].auth.fingerprint,
    )
    if session is not None:
        request[_SESSION] = session
    return session


def _safe_next(raw: str | None) -> str:
    """Only a console path may follow sign-in (never another site: no open redirect)."""
    if raw and raw.startswith("/ui/") and not raw.startswith("//") and "\\" not in raw:
        return raw
    return "/ui/"


def console_page(handler: PageHandler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """A page that needs a session: without one, 303 to the sign-in page (back here after)."""

    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            session = await current_session(request)
            if session is None:
                raise web.HTTPSeeOther(str(URL("/ui/login").with_query(next=request.path_qs)))
            return await handler(request, session)
        except CONNECTION_ERRORS as exc:
            # Every page reads PostgreSQL: while it is away, say so (the admin API says 503 too).
            log.warning("console page %s failed: database unavailable (%r)", request.path, exc)
            resp = html_response(
                "<!doctype html><html lang=en><head><meta charset=utf-8><title>Database unavailable</title></head>"
                "<body><main><h1>Database unavailable</h1><p>PostgreSQL does not answer; try again in a moment.</p>"
                "</main></body></html>", status=503,
            )
            resp.headers["Retry-After"] = "1"
            return resp

    wrapped.__name__ = handler.__name__
    wrapped.__doc__ = handler.__doc__
    return wrapped


def _same_origin(request: web.Request) -> bool:
    """Did this form post come from one of our own pages?

    Browsers say so in ``Sec-Fetch-Site``; under the plane's ``Referrer-Policy:
    no-referrer`` Chromium sends ``Origin: null`` even for a same-origin form, so
    ``Origin`` is the fallback for browsers without fetch metadata. A client that sends
    neither is not a browser, and CSRF cannot involve it.
    """
    site = request.headers.get("Sec-Fetch-Site")
    if site is not None:
        return site in ("same-origin", "none")
    origin = request.headers.get("Origin")
    return origin is None or origin == f"{request.scheme}://{request.host}"


async def _start_session(
    request: web.Request, principal: str, role: str, method: str, detail: dict[str, Any] | None = None,
) -> str:
    """A new session and its ``session.sign_in`` audit row, in one transaction; the cookie's token."""
    console = request.app[CONSOLE]
    fingerprint = console.auth.fingerprint if method == "token" else None
    async with request.app[STATE].pool.acquire() as conn, conn.transaction():
        token, _ = await SessionStore(conn).create(
            principal, role, method, console.settings.session_ttl, token_fingerprint=fingerprint,
        )
        await AuditLog(conn).record(
            actor=principal, action="session.sign_in", api_key_id=None,
            detail={"method": method, "role": role, **(detail or {})},
            request_id=request_id_of(request), remote=request.remote,
        )
    log.info("console sign-in: %s (%s, %s)", principal, role, method)
    return token


def _login_page(request: web.Request, *, message: str = "", status: int = 200) -> web.Response:
    console = request.app[CONSOLE]
    next_path = _safe_next(request.query.get("next"))
    parts = []
    if message:
        parts.append(f'<p class="error" role="alert">{esc(message)}</p>')
    if console.oidc is not None:
        parts.append(
            f'<p><a class="button primary" id="sso" href="{esc(URL("/ui/oidc/start").with_query(next=next_path))}">'
            "Sign in with single sign-on</a></p>"
        )
    if console.auth.enabled:
        parts.append(
            f'<form method="post" action="{esc(URL("/ui/login").with_query(next=next_path))}" class="card">'
            '<label for="token">Admin token</label>'
            '<input id="token" name="token" type="password" autocomplete="current-password" required autofocus>'
            '<button type="submit" class="primary">Sign in</button></form>'
        )
    if not parts:
        parts.append('<p class="error">The admin console is disabled: set ADMIN_TOKEN or admin.oidc.</p>')
    resp = page("Sign in", "".join(parts), None)
    resp.set_status(status)
    return resp


async def login_form(request: web.Request) -> web.StreamResponse:
    """``GET /ui/login``."""
    if await current_session(request) is not None:
        raise web.HTTPSeeOther(_safe_next(request.query.get("next")))
    return _login_page(request)


async def login_submit(request: web.Request) -> web.StreamResponse:
    """``POST /ui/login``: the admin token from the form; a session for its holder."""
    if not _same_origin(request):
        return _login_page(request, message="Sign-in refused: the form came from another site.", status=403)
    console = request.app[CONSOLE]
    form = await request.post()
    token = form.get("token")
    try:
        actor = console.auth.check(f"Bearer {token}" if isinstance(token, str) else None)
    except AdminDisabled:
        return _login_page(request, message="Signing in with a token is disabled (no ADMIN_TOKEN).", status=403)
    except AdminUnauthorized:
        log.warning("console sign-in refused (bad token) from %s", request.remote)
        return _login_page(request, message="That is not the admin token.", status=401)
    token_value = await _start_session(request, actor, "admin", "token")
    resp = web.HTTPSeeOther(_safe_next(request.query.get("next")))
    session_cookie(resp, request, token_value, console.settings.session_ttl)
    raise resp


async def logout(request: web.Request) -> web.StreamResponse:
    """``POST /ui/logout``: ends the session everywhere (CSRF token required)."""
    session = await current_session(request)
    if session is not None:
        form = await request.post()
        token = form.get("csrf_token")
        if not _same_origin(request) or not csrf_matches(session, token if isinstance(token, str) else None):
            return html_response("<!doctype html><title>Refused</title><p>Sign-out refused: bad CSRF token.</p>",
                                 status=403)
        async with request.app[STATE].pool.acquire() as conn, conn.transaction():
            await SessionStore(conn).end(request.cookies[COOKIE])
            await AuditLog(conn).record(
                actor=session.principal, action="session.sign_out", api_key_id=None,
                detail={"method": session.method}, request_id=request_id_of(request), remote=request.remote,
            )
    resp = web.HTTPSeeOther("/ui/login")
    resp.del_cookie(COOKIE, path="/")
    raise resp


def _redirect_uri(request: web.Request, client: OidcClient) -> str:
    return client.settings.redirect_url or f"{request.scheme}://{request.host}/ui/oidc/callback"


async def oidc_start(request: web.Request) -> web.StreamResponse:
    """``GET /ui/oidc/start``: off to the identity provider, with state, nonce and PKCE."""
    client = request.app[CONSOLE].oidc
    if client is None:
        raise web.HTTPNotFound()
    try:
        url, pending = await client.start(_redirect_uri(request, client), _safe_next(request.query.get("next")))
    except OidcRefused as exc:
        return _login_page(request, message=f"Single sign-on is unavailable: {exc}", status=502)
    resp = web.HTTPFound(url)
    # Lax, not Strict: the provider sends the browser back with a cross-site navigation.
    resp.set_cookie(LOGIN_COOKIE, pending.cookie_value(), max_age=LOGIN_TTL, path="/ui/oidc",
                    httponly=True, samesite="Lax", secure=request.secure)
    raise resp


async def oidc_callback(request: web.Request) -> web.StreamResponse:
    """``GET /ui/oidc/callback``: check state, redeem the code, start the session."""
    client = request.app[CONSOLE].oidc
    if client is None:
        raise web.HTTPNotFound()
    pending = PendingLogin.from_cookie(request.cookies.get(LOGIN_COOKIE))
    state, code = request.query.get("state", ""), request.query.get("code")
    if "error" in request.query:
        return _login_page(request, message=f"The identity provider said: {request.query['error'][:200]}", status=401)
    if pending is None or not code or not _same_state(pending.state, state):
        return _login_page(request, message="This sign-in expired or was not started here: try again.", status=400)
    try:
        person = await client.finish(code, pending, _redirect_uri(request, client))
    except OidcRefused as exc:
        log.warning("console single sign-on refused from %s: %s", request.remote, exc)
        return _login_page(request, message=f"Sign-in refused: {exc}", status=403)
    console = request.app[CONSOLE]
    token = await _start_session(request, person.name, person.role, "oidc", {"sub": person.subject})
    # A page, not a redirect: the browser arrived here from the provider's site, and a
    # SameSite=Strict cookie is not sent on a redirect that a cross-site navigation
    # started; a refresh from this page is a same-site navigation, and carries it.
    target = esc(_safe_next(pending.next_path))
    resp = html_response(
        f'<!doctype html><html lang=en><head><meta charset=utf-8><meta http-equiv="refresh" content="0;url={target}">'
        f'<title>Signed in</title></head><body><p>Signed in. <a href="{target}">Continue</a></p></body></html>'
    )
    session_cookie(resp, request, token, console.settings.session_ttl)
    resp.del_cookie(LOGIN_COOKIE, path="/ui/oidc")
    return resp


def _same_state(expected: str, got: str) -> bool:
    return bool(expected) and hmac.compare_digest(expected.encode(), got.encode())


def sign_in_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/ui/login", login_form)
    router.add_post("/ui/login", login_submit)
    router.add_post("/ui/logout", logout)
    router.add_get("/ui/oidc/start", oidc_start)
    router.add_get("/ui/oidc/callback", oidc_callback)
