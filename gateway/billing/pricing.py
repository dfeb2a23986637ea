"""What a call cost: settled once, when it ends, so every listener sees the same figure.

In order of trust:

1. the provider's own ``cost`` (Venice answers ``cost.usd`` and ``cost.diem``), already
   parsed into :class:`gateway.core.usage.Usage` by the relay;
2. the deployment's price table from the config file (USD per million input and output
   tokens);
3. nothing: the cost is 0 and ``cost_source`` says ``unpriced``, which billing counts per
   model and metrics can expose, so a missing price is visible rather than silently free.

A pass-through call whose answer carried no usage object the gateway knows costs 0 with
source ``passthrough`` (gateway/edge/passthrough.py).

A call with no tokens at all (a failed call) costs 0 with source ``none``: there is
nothing to price, and flagging its model as unpriced would only be noise.
"""

from __future__ import annotations

import math
from decimal import Decimal

from gateway.billing.reservations import exact_micro_cost, micro_usd, price_micro
from gateway.core.config import Price
from gateway.core.usage import CallRecord, Usage

__all__ = ["COST_SOURCES", "cost_from_price", "exact_cost_from_price", "settle_cost"]

#: Every value ``CallRecord.cost_source`` takes (the ledger's check constraint agrees).
COST_SOURCES = ("provider", "price", "unpriced", "none", "cache", "passthrough")

_PER_MILLION = Decimal(1_000_000)


def exact_cost_from_price(usage: Usage, price: Price) -> Decimal:
    """USD for ``usage`` at ``price`` (per million input and output tokens), exactly."""
    micro = usage.prompt_tokens * price_micro(price.input_per_mtok) + usage.completion_tokens * price_micro(
        price.output_per_mtok
    )
    return micro / _PER_MILLION


def cost_from_price(usage: Usage, price: Price) -> float:
    """The same, as the float metrics and logs show (its shortest text is the exact figure)."""
    return float(exact_cost_from_price(usage, price))


def _provider_cost(cost: float) -> Decimal | None:
    """The provider's own USD cost when it is a usable number, else None."""
    if not math.isfinite(cost) or cost < 0:
        return None
    return Decimal(repr(cost))


def settle_cost(record: CallRecord) -> None:
    """Set ``record.cost_usd``, ``cost_micro_usd`` and ``cost_source`` from usage and price.

    The figure is exact (a Decimal, then a float whose shortest text is that decimal, so
    the ledger's ``numeric`` stores it exactly); ``cost_micro_usd`` is the same amount
    rounded up to the micro-dollar, what budgets count (never less than the ledger).

    A price table's cost is taken from integers where they are exact (the float the exact
    fraction correctly rounded, as ``float()`` of the Decimal is; the micro-USD its
    ceiling: :func:`exact_micro_cost`), else from :func:`exact_cost_from_price`'s Decimal."""
    usage = record.usage
    provider_cost = usage.cost_usd
    prompt_tokens, completion_tokens = usage.prompt_tokens, usage.completion_tokens
    cost_usd, cost_micro = 0.0, 0
    if record.cache == "hit":
        # Answered from the response cache: the provider was not called.
        source = "cache"
    elif provider_cost is not None and (exact := _provider_cost(provider_cost)) is not None:
        cost_usd, cost_micro, source = float(exact), micro_usd(exact), "provider"
    elif prompt_tokens + completion_tokens == 0:
        # A pass-through answer without a usage object we know: recorded, not priced.
        source = "passthrough" if record.passthrough else "none"
    elif (price := record.price) is not None:
        source = "price"
        fraction = exact_micro_cost(prompt_tokens, completion_tokens, price)
        if fraction is not None:
            numerator, divisor = fraction
            cost_usd, cost_micro = numerator / (divisor * 1_000_000), -(-numerator // divisor)
        else:
            cost = exact_cost_from_price(usage, price)
            cost_usd, cost_micro = float(cost), micro_usd(cost)
    else:
        source = "unpriced"
    record.cost_usd, record.cost_micro_usd, record.cost_source = cost_usd, cost_micro, source
