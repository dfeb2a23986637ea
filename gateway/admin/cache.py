"""``/admin/cache`` on the management plane: the cache's size and counters, and purges.

* ``GET /admin/cache`` — entries and bytes held (and the bound), vectors, whether the
  Redis tier is live, hit/miss/bypass/store/eviction counters, per-group policies.
* ``DELETE /admin/cache?key=K`` | ``?subject=UUID`` | ``?group=NAME`` (subject and group
  together: their intersection) | ``?all=true`` — forget entries here and in Redis
  (every replica drops them from memory through the announcement channel). Answers
  ``{"purged": {"memory": n, "shared": m}}`` (``shared`` is -1 when Redis failed).

Both sit under ``/admin/``, so :func:`gateway.admin.routes.admin_guard` asks for
``Authorization: Bearer $ADMIN_TOKEN`` first (403 "admin API disabled" with no token
set, 401 for a wrong one); every parameter is checked (400 ``invalid_query``).
"""

from __future__ import annotations

import re
import uuid

import orjson
from aiohttp import web

from gateway.core.errors import GatewayError, InvalidRequest
from gateway.http.state import STATE

__all__ = ["PURGE_SELECTORS", "add_routes"]

#: The query parameters of a purge, for the handler and the OpenAPI document.
PURGE_SELECTORS = ("key", "subject", "group", "all")
KEY_PATTERN = "^[0-9a-f]{32}$"
MAX_GROUP_LEN = 256
_KEY = re.compile(KEY_PATTERN)


class _CacheUnavailable(GatewayError):
    status = 503
    type = "service_unavailable"
    code = "cache_unavailable"
    default_message = "the response cache is not running"


def _bad(message: str) -> InvalidRequest:
    return InvalidRequest(message, code="invalid_query")


def _json(obj: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")


async def cache_stats(request: web.Request) -> web.Response:
    """``GET /admin/cache``: sizes, counters and policies."""
    if request.query:
        raise _bad(f"unknown query parameter '{next(iter(request.query))}'")
    cache = request.app[STATE].cache
    if cache is None:
        raise _CacheUnavailable()
    return _json(cache.stats())


async def cache_purge(request: web.Request) -> web.Response:
    """``DELETE /admin/cache?key=|subject=|group=|all=true``: forget entries everywhere."""
    cache = request.app[STATE].cache
    if cache is None:
        raise _CacheUnavailable()
    query = request.query
    for name in query:
        if name not in PURGE_SELECTORS:
            raise _bad(f"unknown query parameter '{name}' (allowed: {', '.join(PURGE_SELECTORS)})")
        if len(query.getall(name)) > 1:
            raise _bad(f"query parameter '{name}' given twice")
    key, subject, group, everything = query.get("key"), query.get("subject"), query.get("group"), query.get("all")
    if key is not None and not _KEY.match(key):
        raise _bad("query parameter 'key' must be an x-gateway-cache-key (32 hex digits)")
    if subject is not None:
        try:
            subject = str(uuid.UUID(subject))
        except ValueError:
            raise _bad("query parameter 'subject' must be a UUID") from None
    if group is not None and not 0 < len(group) <= MAX_GROUP_LEN:
        raise _bad(f"query parameter 'group' must be a model group name of 1 to {MAX_GROUP_LEN} characters")
    if everything is not None and everything != "true":
        raise _bad("query parameter 'all' must be 'true'")
    if key is None and subject is None and group is None and everything is None:
        raise _bad("say what to purge: key=, subject=, group= or all=true")
    if everything is not None and (key or subject or group):
        raise _bad("all=true cannot be combined with another selector")
    if key is not None and (subject or group):
        raise _bad("key= names one entry: do not combine it with subject= or group=")
    purged = await cache.purge(key=key, subject=subject, group=group, everything=everything is not None)
    return _json({"purged": purged})


def add_routes(app: web.Application) -> None:
    """Register ``/admin/cache`` on the management plane."""
    app.router.add_get("/admin/cache", cache_stats)
    app.router.add_delete("/admin/cache", cache_purge)
