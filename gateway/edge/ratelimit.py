"""Rate limits at the edge: the per-IP guard, per-key admission, and the headers.

* :func:`ratelimit_middleware` (data plane) asks the limiter about the client's address
  before any ``/v1/`` handler runs, so a flood is refused before authentication and any
  database work; after the handler ends, on every path (answer, error, cancellation,
  client gone), it releases the request's :class:`Permit` exactly once.
* :func:`admit` is what a handler calls right after authentication: the key's limits,
  a 429 when one is hit, and the ``x-ratelimit-*`` headers for whatever answer follows.
* :func:`add_ratelimit_headers` (``on_response_prepare``) puts those headers on every
  answer of an authenticated request: errors after auth and streams too, since a
  stream's headers are sent when it is prepared.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from actors.auth import VerifiedKey
from actors.limiter import Permit
from gateway.core.errors import RateLimited
from gateway.http.state import STATE

__all__ = ["PERMIT", "add_ratelimit_headers", "admit", "client_ip", "ratelimit_middleware"]

PERMIT = web.RequestKey("ratelimit_permit", Permit)
_HEADERS = web.RequestKey("ratelimit_headers", dict[str, str])

#: Routes the flood guard covers: the authenticated API (health checks stay free).
GUARDED_PREFIX = "/v1/"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def client_ip(request: web.Request) -> str:
    """The peer's address (the gateway's own TCP peer; see docs/rate-limits.md)."""
    return request.remote or "unknown"


async def admit(request: web.Request, key: VerifiedKey) -> Permit:
    """Check ``key``'s limits for this request; raises RateLimited (429) when one is hit."""
    limiter = request.app[STATE].limiter
    try:
        permit = await limiter.acquire(key)
    except RateLimited as exc:
        request[_HEADERS] = exc.headers
        raise
    request[_HEADERS] = permit.headers
    request[PERMIT] = permit
    return permit


@web.middleware
async def ratelimit_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.path.startswith(GUARDED_PREFIX):
        await request.app[STATE].limiter.check_ip(client_ip(request))
    try:
        return await handler(request)
    finally:
        permit = request.get(PERMIT)
        if permit is not None:
            permit.release()


async def add_ratelimit_headers(request: web.Request, response: web.StreamResponse) -> None:
    headers = request.get(_HEADERS)
    if headers:
        response.headers.update(headers)
