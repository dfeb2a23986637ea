"""The one state both planes share, typed behind an AppKey (no module-level globals)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import aiohttp
import asyncpg
from aiohttp import web

from actors.runtime import Supervisor
from gateway.auth.keys import KeyStore
from gateway.core.config import GatewayConfig, Settings
from gateway.core.usage import CallRecord
from gateway.guardrails.registry import Guardrails
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.tracing import Tracing
from gateway.providers import Provider
from gateway.relay.retry import RetryPolicy
from gateway.relay.routing import Router

if TYPE_CHECKING:
    from actors.auth import AuthHandle
    from actors.billing import BillingHandle
    from actors.breaker import BreakerHandle, DeploymentStatus
    from actors.cache import CacheHandle
    from actors.limiter import LimiterHandle

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
    #: Called once per finished chat call (billing, metrics, logs subscribe here).
    call_listeners: list[Callable[[CallRecord], None]] = field(default_factory=list)
    draining: bool = False
    #: This gateway's metrics (its own registry) and tracer; see gateway/edge/telemetry.py.
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    tracing: Tracing = field(default_factory=Tracing)
    #: The response cache (see actors/cache.py); None only in states built without it.
    cache: CacheHandle | None = None
    #: Guardrail policies per model group and key (gateway/guardrails); None: none configured.
    guardrails: Guardrails | None = None

    def deployment_health(self) -> list[DeploymentStatus]:
        """Every configured deployment with circuit state, recent latency and error rate,
        for ``/admin/providers`` and ``gateway_circuit_state`` (read-only, no hop)."""
        return self.breaker.statuses(self.config)


STATE = web.AppKey("gateway_state", GatewayState)
