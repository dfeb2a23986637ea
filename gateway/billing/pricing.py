"""What a call cost: settled once, when it ends, so every listener sees the same figure.

In order of trust:

1. the provider's own ``cost`` (Venice answers ``cost.usd`` and ``cost.diem``), already
   parsed into :class:`gateway.core.usage.Usage` by the relay;
2. the deployment's price table from the config file (USD per million input and output
   tokens);
3. nothing: the cost is 0 and ``cost_source`` says ``unpriced``, which billing counts per
   model and metrics can expose, so a missing price is visible rather than silently free.

A call with no tokens at all (a failed call) costs 0 with source ``none``: there is
nothing to price, and flagging its model as unpriced would only be noise.
"""

from __future__ import annotations

import math

from gateway.billing.reservations import cost_micro_usd, micro_usd
from gateway.core.config import Price
from gateway.core.usage import CallRecord, Usage

__all__ = ["COST_SOURCES", "cost_from_price", "settle_cost"]

#: Every value ``CallRecord.cost_source`` takes (the ledger's check constraint agrees).
COST_SOURCES = ("provider", "price", "unpriced", "none", "cache")

_PER_MILLION = 1_000_000


def cost_from_price(usage: Usage, price: Price) -> float:
    """USD for ``usage`` at ``price`` (per million input and output tokens), rounded up to
    the micro-dollar: exactly what the ledger and the budgets count."""
    return cost_micro_usd(usage.prompt_tokens, usage.completion_tokens, price) / _PER_MILLION


def _provider_cost(usage: Usage) -> int | None:
    """The provider's own cost in micro-USD when it is a usable number, else None."""
    cost = usage.cost_usd
    if cost is None or not math.isfinite(cost) or cost < 0:
        return None
    return micro_usd(cost)


def settle_cost(record: CallRecord) -> None:
    """Set ``record.cost_micro_usd``, ``cost_usd`` and ``cost_source`` from its usage and price.

    The exact figure is the integer micro-USD; ``cost_usd`` is the same amount as a float
    for metrics and logs (micro-USD / 10^6 prints as the exact decimal)."""
    usage = record.usage
    provider_cost = _provider_cost(usage)
    if record.cache == "hit":
        # Answered from the response cache: the provider was not called.
        micro, record.cost_source = 0, "cache"
    elif provider_cost is not None:
        micro, record.cost_source = provider_cost, "provider"
    elif usage.total_tokens == 0:
        micro, record.cost_source = 0, "none"
    elif record.price is not None:
        micro = cost_micro_usd(usage.prompt_tokens, usage.completion_tokens, record.price)
        record.cost_source = "price"
    else:
        micro, record.cost_source = 0, "unpriced"
    record.cost_micro_usd = micro
    record.cost_usd = micro / _PER_MILLION
