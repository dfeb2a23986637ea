"""App factories for both planes, and the start-up/shutdown of the state they share.

Two aiohttp applications, one per plane, read one :class:`GatewayState`: the data plane
(``BIND_ADDR``) serves clients, the management plane (``MANAGEMENT_BIND_ADDR``) serves
operators. :func:`gateway_state` builds the state in dependency order and tears it
down in reverse (actors stop last-started first).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from aiohttp import web

from actors.auth import AuthActor, AuthHandle
from actors.billing import BillingActor, BillingHandle
from actors.breaker import BreakerActor, BreakerHandle
from actors.cache import start_cache
from actors.limiter import LimiterActor, LimiterHandle
from actors.prober import ProberActor, ProberHandle
from actors.request_logs import RequestLogActor, RequestLogHandle
from actors.runtime import Supervisor
from gateway.admin import cache as cache_admin
from gateway.admin import config as config_admin
from gateway.admin import request_logs as request_logs_admin
from gateway.admin import routes as admin
from gateway.admin.console import add_console
from gateway.auth.keys import KeyStore
from gateway.billing.gate import unpriced_deployments
from gateway.billing.reservations import ReservationStore, connect_reservation_pool, open_reservations
from gateway.core.config import GatewayConfig, Settings
from gateway.core.db import connect_pool, migrate
from gateway.core.usage import CallRecord
from gateway.edge import (
    chat,
    completions,
    dataplane,
    messages,
    openapi,
    passthrough,
    responses,
    telemetry,
)
from gateway.edge.front import front_middleware, prepare_hook
from gateway.edge.guardrails import build_guardrails
from gateway.edge.reload import ConfigReloader, ProviderPools, default_source
from gateway.http.admission import ADMISSION, AdmissionGate, default_max_in_flight
from gateway.http.cors import DATA_PLANE_EXPOSED, MANAGEMENT_REQUEST_HEADERS, CorsPolicy
from gateway.http.middleware import SecurityHeaders
from gateway.http.state import STATE, GatewayState
from gateway.observability.tracing import Tracing
from gateway.relay.headroom import DeploymentLimits
from gateway.relay.retry import RetryPolicy
from gateway.relay.routing import Router

__all__ = ["DATA_SERVER_OPTIONS", "build_data_app", "build_management_app", "gateway_state"]

log = logging.getLogger("gateway")

#: aiohttp server options of the data plane. Headers up to 32 KiB reach our own code, so
#: an absurd Authorization header gets the contract's 401, not a bare parser error;
#: a client that hangs up cancels its handler, and so its upstream call.
DATA_SERVER_OPTIONS: dict[str, object] = {
    "max_line_size": 32 * 1024, "max_field_size": 32 * 1024, "handler_cancellation": True,
}

MANAGEMENT_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; frame-ancestors 'none'",
    "Cache-Control": "no-store",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}


def _shared_store(settings: Settings, config: GatewayConfig) -> str | None:
    """Redis for per-deployment rpm/tpm when the gateway has one (so replicas count
    together), unless ``rate_limits.storage`` pins windows to memory."""
    storage = config.rate_limits.storage
    if storage is not None and storage.startswith(("redis://", "rediss://", "async+redis")):
        return storage
    if storage is not None and storage.startswith("memory"):
        return None
    return settings.redis_url


def _tokens_to_deployment_limits(limits: DeploymentLimits) -> Callable[[CallRecord], None]:
    """A call listener: a finished call's tokens count toward its deployment's ``tpm``."""
    pending: set[asyncio.Task[None]] = set()

    def charge(record: CallRecord) -> None:
        if not limits.charges_tokens(record.deployment) or record.deployment is None:
            return
        task = asyncio.get_running_loop().create_task(
            limits.charge_tokens(record.deployment, record.usage.total_tokens)
        )
        pending.add(task)
        task.add_done_callback(pending.discard)

    return charge


@contextlib.asynccontextmanager
async def gateway_state(
    settings: Settings, config: GatewayConfig, dsn: str, *, run_migrations: bool = True
) -> AsyncIterator[GatewayState]:
    """Open the pool, migrate, start the actors and providers; undo it all on exit."""
    tracing = Tracing.from_settings(settings)  # no I/O: the exporter connects when it first sends
    pool = await connect_pool(dsn)
    session: aiohttp.ClientSession | None = None
    supervisor = Supervisor()
    embedder = None
    reservations: ReservationStore | None = None
    pools = ProviderPools(settings)
    deployment_limits: DeploymentLimits | None = None
    try:
        if run_migrations:
            async with pool.acquire() as conn:
                await migrate(conn)
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=300, keepalive_timeout=30)
        session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        # Billing first: actors stop in reverse, so it drains after everything that tells it.
        reservations = open_reservations(
            settings.redis_url, pool, key_prefix=config.rate_limits.key_prefix,
            reservation_pool=None if settings.redis_url else await connect_reservation_pool(dsn),
        )
        billing_actor = BillingActor(
            pool, settings.journal_dir, ship_interval=settings.billing_ship_interval,
            fsync_interval=settings.billing_fsync_interval,
            reservations=reservations, reservation_ttl=settings.budget_reservation_ttl,
            lease_fraction=settings.budget_lease_fraction, lease_seconds=settings.budget_lease_seconds,
            lease_standby_seconds=settings.budget_lease_standby_seconds,
        )
        billing = BillingHandle(billing_actor, await supervisor.start(billing_actor))
        # Always running (cheap when idle): a reload may opt calls in, and expired rows
        # are purged whatever the config says now.
        request_log_actor = RequestLogActor(
            pool, settings.journal_dir / "request-logs", ship_interval=settings.billing_ship_interval,
            fsync_interval=settings.billing_fsync_interval,
        )
        request_logs = RequestLogHandle(request_log_actor, await supervisor.start(request_log_actor))
        if billing_actor.has_budgets and (unpriced := unpriced_deployments(config)):
            log.error("budgets: deployments with no price (calls of budgeted keys to them are refused "
                      "with 402 until a price is set): %s", ", ".join(unpriced))
        auth_actor = AuthActor(pool, dsn)
        auth_ref = await supervisor.start(auth_actor)
        breaker_actor = BreakerActor(config.circuit_breaker)
        breaker_ref = await supervisor.start(breaker_actor)
        limiter_actor = LimiterActor(config.rate_limits, redis_url=settings.redis_url, pool=pool)
        limiter_ref = await supervisor.start(limiter_actor)
        providers = pools.build(config)
        deployment_limits = DeploymentLimits(
            redis_url=_shared_store(settings, config), key_prefix=config.rate_limits.key_prefix
        )
        prober_actor = ProberActor()
        probes = ProberHandle(prober_actor, await supervisor.start(prober_actor))
        probes.watch(providers)
        router = Router(config, providers=providers)
        cache, embedder = await start_cache(supervisor, config, settings.redis_url, providers, router, pool=pool)
        if embedder is not None and config.cache.semantic.embedder != "local":
            # The cache's embedder holds this provider for the process's life: never closed by a reload.
            pools.pinned.add(id(providers[router.resolve(config.cache.semantic.embedder).targets[0].provider]))
        guardrails = build_guardrails(config, session, router, providers)
        state = GatewayState(
            settings=settings,
            config=config,
            pool=pool,
            dsn=dsn,
            supervisor=supervisor,
            auth=AuthHandle(auth_actor, auth_ref),
            billing=billing,
            keys=KeyStore(pool),
            router=router,
            providers=providers,
            session=session,
            retry_policy=RetryPolicy(max_retries=settings.upstream_max_retries),
            breaker=BreakerHandle(breaker_actor, breaker_ref),
            tracing=tracing,
            limiter=LimiterHandle(limiter_actor, limiter_ref),
            cache=cache,
            guardrails=guardrails if guardrails.any else None,
            request_logs=request_logs,
            config_source=default_source(settings),
            provider_pools=pools,
            probes=probes,
            deployment_limits=deployment_limits,
        )
        state.reload_config = ConfigReloader(state, pools)
        state.metrics.watch(request_logs.metric_families)
        if state.config_source is not None:
            state.metrics.config_loaded_at.set(state.config_source.loaded_at)
        state.metrics.watch_health_checks(lambda: {name: s.healthy for name, s in probes.view.items()})
        state.call_listeners.append(_tokens_to_deployment_limits(deployment_limits))
        # The metrics listener; billing has journaled (and priced) a call before any listener hears of it.
        telemetry.install(state)
        yield state
    finally:
        await supervisor.stop()
        if reservations is not None:
            await reservations.close()
        if deployment_limits is not None:
            await deployment_limits.close()
        await tracing.shutdown()
        if embedder is not None:
            embedder.close()
        await pools.close_all()
        if session is not None:
            await session.close()
        await pool.close()


def build_data_app(state: GatewayState) -> web.Application:
    """The data plane: health, readiness, chat, models, embeddings."""
    # Any request header may be asked for (OpenAI SDKs send many); no credentials ride on CORS.
    cors = CorsPolicy(
        state.settings.cors_origins, allow_methods=("GET", "POST"), allow_headers=None,
        expose_headers=DATA_PLANE_EXPOSED,
    )
    # Admission right after what observes and what answers CORS: a refused request is
    # still counted and readable by a browser, and costs no other work.
    gate = AdmissionGate(state.settings.max_in_flight or default_max_in_flight())
    # The body limit is enforced by our reader; aiohttp's own cap sits just above it.
    app = web.Application(
        middlewares=[front_middleware(state, cors, gate=gate, guard_ips=True, pools=state.provider_pools)],
        client_max_size=state.settings.body_limit + 1024,
    )
    app[STATE] = state
    app[ADMISSION] = gate
    state.metrics.watch(gate.metric_families)
    app.on_response_prepare.append(prepare_hook(SecurityHeaders({}), cors, ratelimit_headers=True))
    app.router.add_get("/openapi.json", openapi.document_handler(openapi.data_plane_document()))
    app.router.add_get("/healthz", dataplane.healthz)
    app.router.add_get("/readyz", dataplane.readyz)
    app.router.add_post("/v1/chat/completions", functools.partial(chat.chat_completions, state=state))
    app.router.add_post("/v1/completions", completions.completions)
    responses.install(app, state)
    app.router.add_post("/v1/messages", messages.messages)
    app.router.add_post("/v1/messages/count_tokens", messages.count_tokens)
    app.router.add_get("/v1/models", dataplane.list_models)
    app.router.add_post("/v1/embeddings", dataplane.embeddings)
    for method in openapi.PASSTHROUGH_METHODS:
        app.router.add_route(method.upper(), passthrough.PASSTHROUGH_ROUTE, passthrough.passthrough)
    return app


def build_management_app(
    state: GatewayState, *, metrics_handler: Callable[[web.Request], Awaitable[web.StreamResponse]] | None = None
) -> web.Application:
    """The management plane: health, Prometheus metrics, the admin API, its OpenAPI
    document, and the admin console (``/ui/``, :mod:`gateway.admin.console`).

    ``metrics_handler`` replaces this process's own ``/metrics`` (``serve --workers``
    serves the aggregation of its workers' registries instead).
    """
    settings = state.settings
    # No origin unless MANAGEMENT_CORS_ORIGINS lists it ('*' is refused by load_settings).
    cors = CorsPolicy(
        settings.management_cors_origins, allow_methods=("GET", "POST", "PUT", "PATCH", "DELETE"),
        allow_headers=MANAGEMENT_REQUEST_HEADERS, expose_headers=("x-request-id",),
    )
    admin_auth = admin.AdminAuth(settings.admin_token, settings.admin_token_name)
    app = web.Application(
        middlewares=[front_middleware(state, cors), admin.admin_guard(
            admin_auth, sign_on=state.config.admin.oidc is not None,
        )],
        client_max_size=admin.admin_body_limit(settings.body_limit) + 1024,
    )
    app[STATE] = state
    app.on_response_prepare.append(prepare_hook(SecurityHeaders(MANAGEMENT_HEADERS), cors))
    app.router.add_get("/healthz", dataplane.healthz)
    app.router.add_get(
        "/metrics", telemetry.metrics_guard(settings.metrics_token, metrics_handler or telemetry.metrics_endpoint)
    )
    app.router.add_get("/openapi.json", openapi.document_handler(openapi.management_document()))
    admin.add_admin_routes(app.router)
    cache_admin.add_routes(app)
    add_console(app, admin_auth)
    config_admin.add_routes(app)
    request_logs_admin.add_routes(app)
    return app
