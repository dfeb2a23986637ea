"""The front of each plane: one middleware and one response-prepare hook, in order.

Every step used to be an aiohttp middleware (or hook) of its own, and each cost every
request a layer: a coroutine, aiohttp's partial around it, and for hooks one more
coroutine per signal receiver. Here the steps are plain calls in one middleware, in the
order they had as separate layers, outermost first:

1. observe (:mod:`gateway.edge.telemetry`): timed, counted in flight, its request id
   bound for log lines; at the end counted by status and logged (the access line), so
   it sees the final status, refusals included;
2. CORS preflights answered (:meth:`~gateway.http.cors.CorsPolicy.preflight_of`), so a
   browser gets its answer even from a full or draining gateway;
3. admission (data plane, :mod:`gateway.http.admission`): a gated request is refused at
   the bound or while draining, else counted in flight until it ends; a shutdown's
   abort is answered 503 in the route's shape;
4. errors in the contract's shape (:func:`~gateway.http.middleware.error_answer`),
   whatever was raised below, the per-IP guard's 429s included;
5. the per-IP guard (data plane, :func:`~gateway.edge.ratelimit.guard_ip`), and after
   the handler, on every path, the permit's release;
6. the config-generation pin (data plane, :class:`~gateway.edge.reload.ProviderPools`):
   the providers of the config the request arrived under stay open until it returns.

The hook puts the request id and security headers, CORS's headers and (data plane) the
``x-ratelimit-*`` headers on every answer, streams included, in that order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from actors.auth import Unauthenticated
from gateway.edge import ratelimit, telemetry
from gateway.edge.reload import ProviderPools
from gateway.http.admission import GATED_PREFIX, AdmissionGate, is_shutdown, shutdown_answer
from gateway.http.cors import CorsPolicy
from gateway.http.errors import error_shape_for
from gateway.http.middleware import SecurityHeaders, error_answer
from gateway.http.state import GatewayState

__all__ = ["front_middleware", "prepare_hook"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
PrepareHook = Callable[[web.Request, web.StreamResponse], Awaitable[None]]


def front_middleware(
    state: GatewayState, cors: CorsPolicy, *, gate: AdmissionGate | None = None, guard_ips: bool = False,
    pools: ProviderPools | None = None,
) -> Middleware:
    """A plane's first middleware: the steps above; admission with ``gate``, the per-IP
    guard with ``guard_ips``, the generation pin with ``pools`` (the data plane's)."""

    async def handled(request: web.Request, handler: Handler) -> web.StreamResponse:
        """Steps 4 to 6: the handler's answer, or its error's."""
        try:
            ip = await ratelimit.guard_ip(request, state) if guard_ips else None
            try:
                if pools is None:
                    return await handler(request)
                generation = pools.enter()
                try:
                    return await handler(request)
                finally:
                    pools.leave(generation)
            except Unauthenticated:
                if ip is not None:
                    await ratelimit.count_failure(state, ip)
                raise
            finally:
                if guard_ips:
                    ratelimit.release_permit(request)
        except Exception as exc:
            answer = error_answer(request, exc)
            if answer is None:
                raise
            return answer

    @web.middleware
    async def front(request: web.Request, handler: Handler) -> web.StreamResponse:
        arrival = telemetry.arrived(request, state.metrics)
        status = 500
        try:
            preflight = cors.preflight_of(request)
            path = request.path
            if preflight is not None:
                response: web.StreamResponse = preflight
            elif gate is None or not path.startswith(GATED_PREFIX):
                response = await handled(request, handler)
            elif (refusal := gate.admit(error_shape_for(path))) is not None:
                response = refusal
            else:
                task = asyncio.current_task()
                assert task is not None
                gate.enter(task)
                try:
                    response = await handled(request, handler)
                except asyncio.CancelledError as exc:
                    # Our own abort before anything was written: answer instead of dropping
                    # the socket. (A relay that already started a stream ends it itself.)
                    if not is_shutdown(exc):
                        raise
                    task.uncancel()
                    response = shutdown_answer(path)
                finally:
                    gate.leave(task)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:
            status = telemetry.CLIENT_CLOSED
            raise
        finally:
            telemetry.answered(request, arrival, status)

    return front


def prepare_hook(security: SecurityHeaders, cors: CorsPolicy, *, ratelimit_headers: bool = False) -> PrepareHook:
    """A plane's one ``on_response_prepare`` hook (a signal, not a middleware, so streams
    prepared inside handlers get the headers too)."""

    async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
        security.put(request, response)
        cors.put_headers(request, response)
        if ratelimit_headers:
            ratelimit.put_ratelimit_headers(request, response)

    return on_prepare
