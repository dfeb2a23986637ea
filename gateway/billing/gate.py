"""The budget check before a call: reserve its worst-case cost, or refuse it.

:class:`BudgetGate` turns a call (who makes it, what it may cost at most) into a
:class:`~gateway.billing.reservations.Reservation` against every budget that applies,
asks the shared store to admit it, and answers the contract's errors:

* 402 ``budget_exceeded`` when the reservation does not fit (nothing is sent);
* 402 ``budget_exceeded`` with an explicit message when a budgeted key calls a model
  with a deployment that has no price (it would be silently free otherwise);
* 503 ``budget_unavailable`` when the shared store cannot be reached: budgeted keys fail
  closed, since admitting them blind could overshoot (keys without a budget never wait
  on the store at all).

A call small against its budgets is held in a lease of this process instead of a
reservation of its own (:mod:`gateway.billing.leases`): no round trip for most calls.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from decimal import Decimal
from typing import cast

from gateway.billing.leases import BudgetLeases
from gateway.billing.reservations import (
    Budget,
    Reservation,
    ReservationStore,
    budgets_of,
    exact_micro_numerator,
    is_finite_price,
    worst_case_micro_usd,
)
from gateway.core.config import GatewayConfig, Price
from gateway.core.errors import BudgetExceeded, ServiceUnavailable

__all__ = ["BudgetGate", "unpriced_deployments"]

log = logging.getLogger("gateway.billing")

#: Longest a call waits for the shared store before it is refused 503 (fail closed).
RESERVE_TIMEOUT = 2.0
#: Keys whose budgets are remembered (with their subject, budgets and UTC day); cleared when this many.
MAX_CACHED_BUDGETS = 10_000
_DAY = 86_400


class BudgetGate:
    """Reservations for calls of budgeted keys and subjects; nothing for the others."""

    def __init__(
        self, store: ReservationStore, *, ttl: float, subject_budgets: Mapping[uuid.UUID, tuple[Decimal, str]],
        lease_fraction: float = 0.0, lease_seconds: float = 1.0, lease_standby_seconds: float = 0.0,
    ) -> None:
        self.store = store
        self.ttl = ttl
        self.leases = BudgetLeases(
            store, ttl=ttl, fraction=lease_fraction, seconds=lease_seconds, standby_seconds=lease_standby_seconds,
        )
        #: Subject → (USD, period): the billing actor's published view, refreshed each second.
        self._subject_budgets = subject_budgets
        #: The budgets of a key's calls, with everything they depend on (UTC day, key's
        #: budget, subject, subject's budget): the same for every call of a key within a
        #: UTC day, and ~4 µs of Decimal and calendar work to rebuild.
        self._budgets: dict[
            uuid.UUID, tuple[int, tuple[Decimal, str] | None, uuid.UUID, tuple[Decimal, str] | None, tuple[Budget, ...]]
        ] = {}

    def applies(self, subject_id: uuid.UUID, key_budget: Decimal | None) -> bool:
        return key_budget is not None or subject_id in self._subject_budgets

    async def reserve(
        self,
        *,
        call_id: uuid.UUID,
        api_key_id: uuid.UUID,
        key_budget: tuple[Decimal, str] | None,
        subject_id: uuid.UUID,
        model: str,
        prices: Sequence[Price | None],
        prompt_bound: int,
        output_cap: int,
    ) -> Reservation | None:
        """Hold the call's worst case against its budgets; None when none applies."""
        return await self.hold(call_id, api_key_id, key_budget, subject_id, model, prices, prompt_bound, output_cap)

    async def hold(
        self, call_id: uuid.UUID, api_key_id: uuid.UUID, key_budget: tuple[Decimal, str] | None,
        subject_id: uuid.UUID, model: str, prices: Sequence[Price | None], prompt_bound: int, output_cap: int,
        rates: tuple[tuple[int, int, int], ...] | None = None,
    ) -> Reservation | None:
        """:meth:`reserve` with its arguments in that order (every call's: no keywords to match).

        ``rates``: the prices' :func:`exact_rates`, from a caller that keeps them (a route's
        prices are the same call after call): they stand for the prices' check (every one
        priced) and give the worst case in integers. Where an integer figure might not be
        exact (28 digits: counts no call reaches), :func:`worst_case_micro_usd` decides, as
        without them (the prices' check and that were ~120 instructions a call)."""
        subject_budget = self._subject_budgets.get(subject_id)
        budgets = self._budgets_of(api_key_id, key_budget, subject_id, subject_budget)
        if not budgets:
            return None
        amount = -1
        if rates is not None and prompt_bound >= 0 and output_cap >= 0:
            amount = 0
            for rate in rates:  # cost_micro_usd's integer route
                numerator = exact_micro_numerator(prompt_bound, output_cap, rate)
                if numerator is None:
                    amount = -1
                    break
                cost = -(-numerator // rate[2])
                if cost > amount:
                    amount = cost
        if amount < 0:
            unpriced = not prices
            for price in prices:  # a loop, not all() over a generator; no list of the priced
                if price is None or not is_finite_price(price):
                    unpriced = True
                    break
            if unpriced:
                raise BudgetExceeded(
                    f"model '{model}' has a deployment with no price, so a call under a budget cannot be "
                    "counted; the operator must set a price for it (models[].deployments[].price)"
                )
            amount = worst_case_micro_usd(prompt_bound, output_cap, cast("Sequence[Price]", prices))
        lease_size = self.leases.size_for(budgets, amount)
        if lease_size and (held := self.leases.take(budgets, amount, call_id)) is not None:
            return held  # the common case of a busy key: no I/O, no timer
        reservation = Reservation(call_id, amount, budgets)
        try:
            async with asyncio.timeout(RESERVE_TIMEOUT):
                if lease_size and (held := await self.leases.acquire(budgets, amount, call_id, lease_size)):
                    return held
                refused = await self.store.reserve(reservation, self.ttl)
                if refused is not None and lease_size:
                    # The store's count includes this process's own leases: take from one
                    # granted meanwhile, or have retired ones give back what they never
                    # used and ask once more, so one replica never refuses a call for room
                    # it holds itself.
                    if (held := self.leases.take(budgets, amount, call_id)) is not None:
                        return held
                    if await self.leases.give_back(budgets):
                        refused = await self.store.reserve(reservation, self.ttl)
        except Exception as exc:
            log.warning("billing: budget store unreachable (%s: %s); budgeted calls refused",
                        type(exc).__name__, exc or f"no answer within {RESERVE_TIMEOUT:g} s")
            raise ServiceUnavailable(
                "budgets cannot be checked right now (budget store unreachable); try again shortly",
                code="budget_unavailable", retry_after=1,
            ) from exc
        if refused is None:
            return reservation
        budget = budgets[refused]
        whose = "this key's budget" if budget.scope == "key" else "the budget of this key's subject"
        raise BudgetExceeded(
            f"{whose} of {_usd_text(budget.limit_micro_usd)} USD {_per(budget.period)} cannot cover this "
            f"call's worst-case cost of {_usd_text(amount)} USD (prompt plus {output_cap} output tokens); "
            "send a smaller max_tokens or wait for the budget period to renew"
        )

    async def settle(self, reservation: Reservation, cost_micro_usd: int) -> None:
        await self.store.settle(reservation, cost_micro_usd)

    def settles_at_once(self, reservation: Reservation, cost_micro_usd: int) -> bool:
        """Settle without I/O where that is all it takes: a call held in a lease (its
        lease counts the cost), or a PostgreSQL reservation (its ledger row releases it).
        False: :meth:`settle` must run (Redis)."""
        if reservation.lease is not None:
            self.leases.finish(reservation, cost_micro_usd)
            return True
        return not self.store.settles_explicitly

    def _budgets_of(
        self, api_key_id: uuid.UUID, key_budget: tuple[Decimal, str] | None, subject_id: uuid.UUID,
        subject_budget: tuple[Decimal, str] | None,
    ) -> tuple[Budget, ...]:
        """:func:`budgets_of`, remembered: periods start on UTC days, so within one day
        the same inputs give the same budgets."""
        now = time.time()
        day = int(now // _DAY)
        # One entry per key, its other inputs compared (their objects are the same call
        # after call, so each compare is an identity check): one UUID hashed per call, not
        # a five-tuple with two UUIDs (UUID's ``__hash__`` is Python).
        entry = self._budgets.get(api_key_id)
        if (entry is not None and entry[0] == day and entry[1] == key_budget and entry[3] == subject_budget
                and (entry[2] is subject_id or entry[2] == subject_id)):
            return entry[4]
        if len(self._budgets) >= MAX_CACHED_BUDGETS:
            self._budgets.clear()
        budgets = budgets_of(api_key_id, key_budget, subject_id, subject_budget,
                             now=datetime.fromtimestamp(day * _DAY, timezone.utc))
        self._budgets[api_key_id] = (day, key_budget, subject_id, subject_budget, budgets)
        return budgets


def _usd_text(micro: int) -> str:
    """Micro-USD as people write dollars: 0.05, 25, 12.5."""
    text = f"{Decimal(micro) / Decimal(1_000_000):f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _per(period: str) -> str:
    return {"day": "per day", "month": "per month", "total": "in total"}.get(period, "")


def unpriced_deployments(config: GatewayConfig) -> list[str]:
    """``group → deployment`` of every configured deployment without a price: calls of a
    budgeted key or subject to them are refused (402), so start-up names them."""
    return [
        f"{group.name} -> {d.id}" for group in config.models for d in group.deployments if not is_finite_price(d.price)
    ]
