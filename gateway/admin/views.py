"""What ``GET /admin/usage`` and ``GET /admin/providers`` show, and where their data comes from.

The shapes are fixed here (and in :mod:`gateway.edge.openapi`); the data sources are two
functions, each the single place to wire the real thing:

* :func:`usage_rows`: rows of the ledger report (:mod:`gateway.billing.reports`, the same
  query ``llm-gateway usage`` runs).
* :func:`deployment_health`: breaker state, recent latency and error rate per
  deployment. Until the breakers exist every deployment shows ``"unknown"`` and nulls.

Everything else (totals, provider and deployment listing from the configuration, the
JSON shape) is final.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from yarl import URL

from gateway.admin.input import UsageQuery
from gateway.billing.reports import UsageQuery as ReportQuery
from gateway.billing.reports import usage_report
from gateway.core.config import Deployment
from gateway.http.state import GatewayState

__all__ = ["DeploymentHealth", "UsageRow", "deployment_health", "providers_view", "usage_rows", "usage_view"]

#: The breaker states a deployment may report; "unknown" until breakers report.
CIRCUIT_STATES = ("closed", "half-open", "open", "unknown")


# -- usage --------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class UsageRow:
    """One group of the usage report: a key id, a model name or a day (YYYY-MM-DD)."""

    group: str
    requests: int
    input_tokens: int
    output_tokens: int
    cost_usd: float

    def to_json(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "requests": self.requests,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cost_usd": self.cost_usd,
        }


async def usage_rows(state: GatewayState, query: UsageQuery) -> list[UsageRow]:
    """The ledger's totals per group for the query's range and key.

    Grouped by ``query.group_by`` (``key``: api_key_id, ``model``: requested model,
    ``day``: UTC date), over ``[query.since, query.until)``, filtered by
    ``query.api_key_id``: the report of :mod:`gateway.billing.reports`, shared with the CLI.
    """
    report = await usage_report(state.pool, ReportQuery(
        group_by=query.group_by, since=query.since, until=query.until, api_key_id=query.api_key_id,
    ))
    return [
        UsageRow(
            group=r.group, requests=r.requests, input_tokens=r.prompt_tokens,
            output_tokens=r.completion_tokens, cost_usd=float(r.cost_usd),
        )
        for r in report.rows
    ]


async def usage_view(state: GatewayState, query: UsageQuery) -> dict[str, Any]:
    """The ``/admin/usage`` answer: the rows, and their totals."""
    rows = await usage_rows(state, query)
    totals = {
        "requests": sum(r.requests for r in rows),
        "input_tokens": sum(r.input_tokens for r in rows),
        "output_tokens": sum(r.output_tokens for r in rows),
        "cost_usd": round(sum(r.cost_usd for r in rows), 6),
    }
    return {
        "object": "usage_report",
        "group_by": query.group_by,
        "since": query.since.isoformat() if query.since else None,
        "until": query.until.isoformat() if query.until else None,
        "api_key_id": str(query.api_key_id) if query.api_key_id else None,
        "data": [r.to_json() for r in rows],
        "totals": totals,
    }


# -- providers ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class DeploymentHealth:
    """What the breakers know about one deployment, over their recent window."""

    circuit_state: str = "unknown"
    #: Median latency of recent calls, milliseconds.
    latency_ms: float | None = None
    #: Failed calls / calls, over the recent window.
    error_rate: float | None = None
    #: Calls in the recent window.
    recent_requests: int | None = None


_UNKNOWN = DeploymentHealth()


def deployment_health(state: GatewayState) -> Mapping[str, DeploymentHealth]:
    """Health per deployment id (``provider/model``), read from the breakers' snapshot."""
    health: dict[str, DeploymentHealth] = {}
    for status in state.deployment_health():
        health[status.deployment] = DeploymentHealth(
            circuit_state=status.state.name.lower().replace("_", "-"),
            latency_ms=status.latency_seconds * 1000 if status.latency_seconds is not None else None,
            error_rate=status.error_rate,
            recent_requests=status.calls,
        )
    return health


def _public_url(raw: str) -> str | None:
    # A base URL may carry credentials (https://user:secret@host): never show them.
    if not raw:
        return None
    return str(URL(raw).with_user(None).with_password(None))


def _probe(state: GatewayState, provider: str) -> dict[str, Any] | None:
    """The provider's active health check (actors/prober.py), or None if it has none."""
    status = state.probes.status(provider) if state.probes is not None else None
    return status.to_dict() if status is not None else None


def providers_view(state: GatewayState) -> dict[str, Any]:
    """The ``/admin/providers`` answer: providers, and every deployment with its health."""
    health = deployment_health(state)
    providers = [
        {"name": p.name, "type": p.type, "base_url": _public_url(p.base_url), "health_check": _probe(state, p.name)}
        for p in state.config.providers.values()
    ]
    # One entry per deployment id; priority and weight belong to each group serving it.
    deployments: dict[str, tuple[Deployment, list[dict[str, Any]]]] = {}
    for group in state.config.models:
        for d in group.deployments:
            entry = deployments.setdefault(d.id, (d, []))
            entry[1].append({"name": group.name, "priority": d.priority, "weight": d.weight})
    data = []
    for deployment_id, (d, groups) in deployments.items():
        h = health.get(deployment_id, _UNKNOWN)
        data.append({
            "id": deployment_id,
            "provider": d.provider,
            "model": d.model,
            "model_groups": groups,
            "price": (
                {"input_per_mtok": d.price.input_per_mtok, "output_per_mtok": d.price.output_per_mtok}
                if d.price is not None else None
            ),
            "circuit_state": h.circuit_state if h.circuit_state in CIRCUIT_STATES else "unknown",
            # False only while the provider's active health probes fail (then it is skipped).
            "healthy": state.probes is None or state.probes.healthy(d.provider),
            "latency_ms": h.latency_ms,
            "error_rate": h.error_rate,
            "recent_requests": h.recent_requests,
        })
    return {"providers": providers, "deployments": data}
