"""Who is calling the management plane: the admin token, or a console session.

A session is what a browser holds after signing in to the console (with the admin
token, or through OIDC): an HttpOnly, ``SameSite=Strict`` cookie (``Secure`` when the
plane is reached over TLS) carrying a random token. The row behind it
(``console_sessions``, PostgreSQL) holds only the token's SHA-256, the person's name,
their role, a CSRF token and an absolute expiry, so a session works on every replica
and signing out ends it everywhere.

Roles: ``admin`` may change anything; ``viewer`` may only read. The admin API's own
guard (:func:`gateway.admin.routes.admin_guard`) enforces the role on every request,
so a page that forgot to hide a button still cannot change anything.

CSRF: a cookie rides along on any request the browser makes, so every change made with
a session (any method but GET/HEAD/OPTIONS) must also carry the session's CSRF token,
in ``X-CSRF-Token`` (the console's script) or a form's ``csrf_token`` field. A bearer
token is never sent by a browser on its own and needs no CSRF token.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from aiohttp import web

from gateway.auth.keys import Database
from gateway.core.errors import GatewayError

__all__ = [
    "COOKIE",
    "CSRF_HEADER",
    "ROLES",
    "SAFE_METHODS",
    "CsrfRefused",
    "ReadOnlyRole",
    "Session",
    "SessionStore",
    "csrf_matches",
    "session_cookie",
]

#: The session cookie's name (``__Host-`` needs Secure, which plain-HTTP loopback lacks).
COOKIE = "llmg_console"
CSRF_HEADER = "X-CSRF-Token"
ROLES = ("admin", "viewer")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class ReadOnlyRole(GatewayError):
    """A viewer (read-only) asked for a change."""

    status = 403
    type = "permission_error"
    code = "read_only"
    default_message = "this session may only read (role viewer)"


class CsrfRefused(GatewayError):
    """A change made with the session cookie lacks the session's CSRF token."""

    status = 403
    type = "permission_error"
    code = "csrf_failed"
    default_message = "missing or wrong CSRF token (send X-CSRF-Token)"


@dataclass(frozen=True, slots=True)
class Session:
    principal: str
    role: str
    method: str
    csrf_token: str
    expires_at: datetime

    @property
    def may_change(self) -> bool:
        return self.role == "admin"


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def csrf_matches(session: Session, presented: str | None) -> bool:
    return presented is not None and hmac.compare_digest(presented.encode(), session.csrf_token.encode())


class SessionStore:
    """Create, read and end console sessions (rows of ``console_sessions``); bind it to
    the connection of a transaction to make a session and its audit row together."""

    def __init__(self, db: Database) -> None:
        self._db = db

    async def create(
        self, principal: str, role: str, method: str, ttl: float, *, token_fingerprint: str | None = None,
    ) -> tuple[str, Session]:
        """A new session; returns the cookie's token (shown nowhere else) and the session.

        ``token_fingerprint`` ties a token sign-in to the ADMIN_TOKEN it was made with."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}")
        token, csrf = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
        expires_at = datetime.now(timezone.utc) + timedelta(seconds=ttl)
        # Sessions that ended by themselves go when new ones start: no sweeper needed.
        await self._db.execute("DELETE FROM console_sessions WHERE expires_at < now()")
        await self._db.execute(
            """INSERT INTO console_sessions
                (token_sha256, csrf_token, principal, role, method, expires_at, token_fingerprint)
            VALUES ($1, $2, $3, $4, $5, $6, $7)""",
            _digest(token), csrf, principal, role, method, expires_at, token_fingerprint,
        )
        return token, Session(principal, role, method, csrf, expires_at)

    async def get(self, token: str, *, admin_fingerprint: str | None = None) -> Session | None:
        """The live session of this cookie token, or None (unknown, ended or expired, or
        signed in with an admin token other than today's ``admin_fingerprint``)."""
        row = await self._db.fetchrow(
            """SELECT principal, role, method, csrf_token, expires_at FROM console_sessions
            WHERE token_sha256 = $1 AND expires_at > now()
              AND (token_fingerprint IS NULL OR token_fingerprint = $2)""",
            _digest(token), admin_fingerprint,
        )
        if row is None:
            return None
        return Session(row["principal"], row["role"], row["method"], row["csrf_token"], row["expires_at"])

    async def end(self, token: str) -> bool:
        """Sign out: the session answers nothing from now on, on every replica."""
        status = await self._db.execute("DELETE FROM console_sessions WHERE token_sha256 = $1", _digest(token))
        return bool(status.endswith(" 1"))


def session_cookie(response: web.StreamResponse, request: web.Request, token: str, ttl: float) -> None:
    """Set the session cookie: HttpOnly, SameSite=Strict, Secure over TLS, for ``ttl``."""
    response.set_cookie(
        COOKIE, token, max_age=int(ttl), path="/", httponly=True, samesite="Strict", secure=request.secure,
    )
