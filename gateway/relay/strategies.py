"""Routing strategies: in which order one call tries a model group's deployments.

Each strategy orders the whole list, not just the first pick, because the rest of the
order is the failover order. Ties are always broken by ``priority`` and then by the
order of the deployments in the config file, so two calls seeing the same numbers try
the same deployments in the same order.

* ``priority``: lowest ``priority`` first (ordered failover).
* ``weighted``: a random order drawn by ``weight`` (a canary at weight 1 beside 9 gets
  about 10 % of first picks); weight 0 deployments come last, as spares.
* ``least-latency``: lowest recent latency first: the EWMA of time to first token for
  a stream, of whole-call latency otherwise (each falls back to the other). A
  deployment with no recent measurement counts as fastest, so it gets measured.
* ``least-cost``: lowest price first (input plus output USD per million tokens, the
  usual blended list price); a deployment without a price comes last.
* ``least-busy``: most headroom first: the largest share left of the deployment's
  ``rpm`` / ``tpm`` this minute and of what its provider last reported in
  ``x-ratelimit-remaining-*`` (:mod:`gateway.relay.headroom`); a deployment with no
  limit and no report counts as untouched (1.0).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from gateway.core.config import Deployment

if TYPE_CHECKING:
    from actors.breaker import Health
    from gateway.relay.routing import Target

__all__ = ["STRATEGIES", "order_targets"]


def _tie(index: int, target: Target) -> tuple[int, int]:
    return target.deployment.priority, index


def _priority(
    targets: Sequence[Target], health: Mapping[str, Health], stream: bool, rng: random.Random,
    headroom: Mapping[str, float],
) -> list[Target]:
    return [t for _, t in sorted(enumerate(targets), key=lambda it: _tie(*it))]


def _weighted(
    targets: Sequence[Target], health: Mapping[str, Health], stream: bool, rng: random.Random,
    headroom: Mapping[str, float],
) -> list[Target]:
    # Weighted sampling without replacement (Efraimidis-Spirakis): each deployment draws
    # u ** (1 / weight) and the largest draws go first, so the first pick is
    # proportional to weight and the failover order follows the weights too.
    def key(item: tuple[int, Target]) -> tuple[float, int, int]:
        index, target = item
        weight = target.deployment.weight
        draw = rng.random() ** (1.0 / weight) if weight > 0 else -1.0
        return (-draw, *_tie(index, target))

    return [t for _, t in sorted(enumerate(targets), key=key)]


def _latency_of(health: Health | None, stream: bool) -> float:
    if health is None:
        return 0.0
    first, second = (health.ttft, health.latency) if stream else (health.latency, health.ttft)
    if first is not None:
        return first
    return second if second is not None else 0.0


def _least_latency(
    targets: Sequence[Target], health: Mapping[str, Health], stream: bool, rng: random.Random,
    headroom: Mapping[str, float],
) -> list[Target]:
    return [
        t for _, t in sorted(
            enumerate(targets),
            key=lambda it: (_latency_of(health.get(it[1].deployment.id), stream), *_tie(*it)),
        )
    ]


def _price_of(deployment: Deployment) -> float:
    if deployment.price is None:
        return math.inf
    return deployment.price.input_per_mtok + deployment.price.output_per_mtok


def _least_cost(
    targets: Sequence[Target], health: Mapping[str, Health], stream: bool, rng: random.Random,
    headroom: Mapping[str, float],
) -> list[Target]:
    return [
        t for _, t in sorted(enumerate(targets), key=lambda it: (_price_of(it[1].deployment), *_tie(*it)))
    ]


def _least_busy(
    targets: Sequence[Target], health: Mapping[str, Health], stream: bool, rng: random.Random,
    headroom: Mapping[str, float],
) -> list[Target]:
    return [
        t for _, t in sorted(
            enumerate(targets), key=lambda it: (-headroom.get(it[1].deployment.id, 1.0), *_tie(*it))
        )
    ]


_Strategy = Callable[
    [Sequence["Target"], Mapping[str, "Health"], bool, random.Random, Mapping[str, float]], list["Target"]
]

#: Strategy name (as in the config file) → how it orders targets.
STRATEGIES: Mapping[str, _Strategy] = {
    "priority": _priority,
    "weighted": _weighted,
    "least-latency": _least_latency,
    "least-cost": _least_cost,
    "least-busy": _least_busy,
}


def order_targets(
    strategy: str,
    targets: Sequence[Target],
    health: Mapping[str, Health],
    *,
    stream: bool,
    rng: random.Random,
    headroom: Mapping[str, float] | None = None,
) -> list[Target]:
    """``targets`` in the order ``strategy`` tries them for one call.

    ``health`` is the breaker's published snapshot (latencies); ``rng`` draws the
    weighted order; ``headroom`` (deployment id → 0..1 left) orders ``least-busy``.
    Raises KeyError for an unknown strategy (config refuses those).
    """
    if len(targets) < 2:
        return list(targets)
    return STRATEGIES[strategy](targets, health, stream, rng, headroom or {})
