"""``/admin/cache`` on the management plane: the cache's size and counters, and purges.

* ``GET /admin/cache`` — entries and bytes held (and the bound), vectors, whether the
  Redis tier is live, hit/miss/bypass/store/eviction counters, per-group policies.
* ``DELETE /admin/cache?key=K`` | ``?subject=UUID`` | ``?group=NAME`` (subject and group
  together: their intersection) | ``?all=true`` — forget entries here and in Redis
  (every replica drops them from memory through the announcement channel). Answers
  ``{"purged": {"memory": n, "shared": m}}`` (``shared`` is -1 when Redis failed).

Both need ``Authorization: Bearer $ADMIN_TOKEN``, compared in constant time; with no
token configured they answer 403 "admin API disabled".
"""

from __future__ import annotations

import hashlib
import hmac
import uuid

import orjson
from aiohttp import web

from gateway.errors import GatewayError, InvalidRequest
from gateway.state import STATE

__all__ = ["add_routes"]

_SELECTORS = ("key", "subject", "group", "all")


class _AdminDisabled(GatewayError):
    status = 403
    type = "permission_error"
    code = "admin_disabled"
    default_message = "admin API disabled"


class _AdminUnauthorized(GatewayError):
    status = 401
    type = "authentication_error"
    code = "invalid_admin_token"
    default_message = "invalid admin token"


class _CacheUnavailable(GatewayError):
    status = 503
    type = "service_unavailable"
    code = "cache_unavailable"
    default_message = "the response cache is not running"


def _require_admin(request: web.Request) -> None:
    """The contract's admin check (the admin module's guard does the same for every route)."""
    token = request.app[STATE].settings.admin_token
    if not token:
        raise _AdminDisabled()
    scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not presented.strip():
        raise _AdminUnauthorized()
    # Compare digests: constant time whatever the presented token's length.
    if not hmac.compare_digest(
        hashlib.sha256(presented.strip().encode("utf-8", "surrogatepass")).digest(),
        hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest(),
    ):
        raise _AdminUnauthorized()


def _json(obj: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")


async def cache_stats(request: web.Request) -> web.Response:
    _require_admin(request)
    cache = request.app[STATE].cache
    if cache is None:
        raise _CacheUnavailable()
    return _json(cache.stats())


async def cache_purge(request: web.Request) -> web.Response:
    _require_admin(request)
    cache = request.app[STATE].cache
    if cache is None:
        raise _CacheUnavailable()
    query = request.query
    unknown = sorted(set(query) - set(_SELECTORS))
    if unknown:
        raise InvalidRequest(f"unknown parameter {unknown[0]!r} (allowed: {', '.join(_SELECTORS)})")
    everything = query.get("all", "").lower() == "true"
    key, subject, group = query.get("key"), query.get("subject"), query.get("group")
    if not (everything or key or subject or group):
        raise InvalidRequest("say what to purge: key=, subject=, group= or all=true")
    if everything and (key or subject or group):
        raise InvalidRequest("all=true cannot be combined with another selector")
    if key is not None and (subject or group):
        raise InvalidRequest("key= names one entry: do not combine it with subject= or group=")
    if subject is not None:
        try:
            subject = str(uuid.UUID(subject))
        except ValueError:
            raise InvalidRequest("subject must be a UUID") from None
    purged = await cache.purge(key=key, subject=subject, group=group, everything=everything)
    return _json({"purged": purged})


def add_routes(app: web.Application) -> None:
    """Register ``/admin/cache`` on the management plane."""
    app.router.add_get("/admin/cache", cache_stats)
    app.router.add_delete("/admin/cache", cache_purge)
