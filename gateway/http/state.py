"""The one state both planes share, typed behind an AppKey (no module-level globals)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import aiohttp
import asyncpg
from aiohttp import web

from actors.runtime import Supervisor
from gateway.auth.keys import KeyStore
from gateway.core.config import GatewayConfig, Settings
from gateway.core.config_source import ConfigSource, ReloadOutcome
from gateway.core.usage import CallRecord
from gateway.guardrails.registry import Guardrails
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.tracing import Tracing
from gateway.providers import Provider
from gateway.relay.headroom import DeploymentLimits
from gateway.relay.retry import RetryPolicy
from gateway.relay.routing import Router

if TYPE_CHECKING:
    from actors.auth import AuthHandle
    from actors.billing import BillingHandle
    from actors.breaker import BreakerHandle, DeploymentStatus
    from actors.cache import CacheHandle
    from actors.limiter import LimiterHandle
    from actors.prober import ProberHandle
    from actors.request_logs import RequestLogHandle
    from gateway.edge.reload import ProviderPools

__all__ = ["STATE", "GatewayState"]


@dataclass
class GatewayState:
    """Long-lived objects built at start-up; handlers read them, actors own the rest."""

    settings: Settings
    config: GatewayConfig
    pool: asyncpg.Pool
    dsn: str
    supervisor: Supervisor
    auth: AuthHandle
    billing: BillingHandle
    keys: KeyStore
    router: Router
    providers: dict[str, Provider]
    session: aiohttp.ClientSession
    retry_policy: RetryPolicy
    #: Circuit breakers and recent health per deployment (actors/breaker.py).
    breaker: BreakerHandle
    limiter: LimiterHandle
    #: Called once per finished generation call, after its ledger row is journaled
    #: (``billing.record``, never a listener) and its answer sent: metrics and the
    #: deployments' token counts subscribe here.
    call_listeners: list[Callable[[CallRecord], None]] = field(default_factory=list)
    draining: bool = False
    #: This gateway's metrics (its own registry) and tracer; see gateway/edge/telemetry.py.
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    tracing: Tracing = field(default_factory=Tracing)
    #: The response cache (see actors/cache.py); None only in states built without it.
    cache: CacheHandle | None = None
    #: Guardrail policies per model group and key (gateway/guardrails); None: none configured.
    guardrails: Guardrails | None = None
    #: Stores the bodies of the calls ``request_logs:`` opts in (actors/request_logs.py).
    request_logs: RequestLogHandle | None = None
    #: The active config's source, hash and load time (``GET /admin/config``).
    config_source: ConfigSource | None = None
    #: How the last reload went (None: none since start-up).
    last_reload: ReloadOutcome | None = None
    #: Re-reads GATEWAY_CONFIG and swaps it in (gateway/edge/reload.py); the argument
    #: says what asked (``admin``, ``sighup``). None in states built without a reloader.
    reload_config: Callable[[str], Awaitable[ReloadOutcome]] | None = None
    #: Per-deployment rpm/tpm and the providers' own rate-limit reports (gateway/relay/headroom.py).
    deployment_limits: DeploymentLimits | None = None
    #: Active health checks of the providers that opt in (actors/prober.py).
    probes: ProberHandle | None = None
    #: The providers' connection pools per config generation (gateway/edge/reload.py).
    provider_pools: ProviderPools | None = None

    def deployment_health(self) -> list[DeploymentStatus]:
        """Every configured deployment with circuit state, recent latency and error rate,
        for ``/admin/providers`` and ``gateway_circuit_state`` (read-only, no hop)."""
        return self.breaker.statuses(self.config)


STATE = web.AppKey("gateway_state", GatewayState)
