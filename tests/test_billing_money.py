"""The integer routes of billing's money arithmetic give the Decimal route's figures.

``micro_usd`` of a float, ``cost_micro_usd`` (so ``worst_case_micro_usd``), ``settle_cost``
and the budget gate's worst case from a route's ``exact_rates`` take integer arithmetic
where it is exact and Decimal elsewhere. Each test here computes the Decimal figure as
the code did before the integer routes (kept below as the reference) over many prices
and token counts, odd prices with many decimals among them, and requires the same
integer and the same float, to the bit.
"""

from __future__ import annotations

import math
import random
import uuid
from decimal import ROUND_CEILING, Decimal

import pytest

from gateway.billing import reservations
from gateway.billing.gate import BudgetGate
from gateway.billing.pricing import settle_cost
from gateway.billing.reservations import (
    Reservation,
    cost_micro_usd,
    exact_micro_cost,
    exact_rates,
    micro_usd,
    price_micro,
    worst_case_micro_usd,
)
from gateway.core.config import Price
from gateway.core.errors import BudgetExceeded
from gateway.core.usage import CallRecord, Usage

_MICRO = Decimal(1_000_000)


# -- the Decimal route, as it was written before the integer routes ------------------------
def decimal_micro_usd(usd: Decimal | float) -> int:
    amount = usd if isinstance(usd, Decimal) else Decimal(repr(usd))
    if not amount.is_finite() or amount <= 0:
        return 0
    return int((amount * _MICRO).to_integral_value(rounding=ROUND_CEILING))


def decimal_cost(prompt_tokens: int, completion_tokens: int, price: Price) -> Decimal:
    """Micro-USD, as the Decimal arithmetic gives it (each price's remembered Decimal)."""
    return prompt_tokens * price_micro(price.input_per_mtok) + completion_tokens * price_micro(price.output_per_mtok)


def decimal_cost_micro_usd(prompt_tokens: int, completion_tokens: int, price: Price) -> int:
    return int(decimal_cost(prompt_tokens, completion_tokens, price).to_integral_value(rounding=ROUND_CEILING))


def decimal_settled(prompt_tokens: int, completion_tokens: int, price: Price) -> tuple[float, int]:
    cost = decimal_cost(prompt_tokens, completion_tokens, price) / _MICRO
    return float(cost), decimal_micro_usd(cost)


# -- the inputs --------------------------------------------------------------------------
def odd_prices(rng: random.Random) -> list[float]:
    """Prices people write (0.15, 2.5, 60), prices with many decimals, float sums whose text
    runs to 17 digits, tiny and huge ones, and the few that must take the Decimal route."""
    prices = [0.0, -0.0, 1.0, 2.0, 3, 0.15, 0.6, 2.5, 60.0, 0.075, 0.1 + 0.2, 17.000000000000004,
              1.23456789012345e-7, 0.3333333333333333, 2 / 3, 1e-300, 5e-324, 9.999999999999998e15, 1e16,
              1.5e22, 1.7976931348623157e308]
    for _ in range(150):
        prices.append(round(rng.uniform(0, 100), rng.randrange(0, 16)))
        prices.append(rng.uniform(0, 100))
        prices.append(10 ** rng.uniform(-12, 17))
    return prices


def token_counts(rng: random.Random) -> list[int]:
    """Counts calls have, and counts far past any call's, up to where Decimal rounds."""
    counts = [0, 1, 2, 7, 9, 14, 999, 4096, 128_000, 2**31 - 1, 10**15, 10**27, 10**28, 10**30]
    counts += [rng.randrange(0, 10 ** rng.randrange(1, 31)) for _ in range(60)]
    return counts


# -- the tests ---------------------------------------------------------------------------
def test_micro_usd_of_a_float_is_the_decimal_figure() -> None:
    rng = random.Random(23)
    floats = [0.0, -0.0, -1e-6, math.nan, math.inf, -math.inf, 5e-324, 1e-300, 1e-7, 1e-6, 3e-06, 3.2e-05,
              0.1, 0.1 + 0.2, 1.0, 99_999_999.99999999, 1e8, math.nextafter(1e8, 0), 1e300]
    for _ in range(100_000):
        micro = rng.randrange(1, 10 ** rng.randrange(1, 15))
        exact = micro / 1e6  # a whole number of micro-USD, and the floats either side of it
        floats += [exact, math.nextafter(exact, 0), math.nextafter(exact, math.inf)]
        floats.append(10 ** rng.uniform(-13, 9))
    for usd in floats:
        assert micro_usd(usd) == decimal_micro_usd(usd), repr(usd)


def test_cost_micro_usd_is_the_decimal_figure_for_every_price_and_count() -> None:
    rng = random.Random(2023)
    prices, counts = odd_prices(rng), token_counts(rng)
    integer_route = 0
    for _ in range(60_000):
        price = Price(rng.choice(prices), rng.choice(prices))
        prompt, completion = rng.choice(counts), rng.choice(counts)
        assert cost_micro_usd(prompt, completion, price) == decimal_cost_micro_usd(prompt, completion, price), (
            price, prompt, completion)
        integer_route += exact_micro_cost(prompt, completion, price) is not None
    assert integer_route > 10_000  # both routes were taken, many times each
    # Every call-sized count at the bench's price and at odd ones takes the integer route.
    for price in (Price(1.0, 2.0), Price(0.15, 0.6), Price(1.23456789012345e-7, 0.1 + 0.2)):
        for prompt in range(0, 5000, 7):
            assert exact_micro_cost(prompt, 4096, price) is not None
            assert cost_micro_usd(prompt, 4096, price) == decimal_cost_micro_usd(prompt, 4096, price)


def test_settle_cost_is_the_decimal_figure_to_the_bit() -> None:
    rng = random.Random(7)
    prices = odd_prices(rng)
    record = CallRecord(request_id="r", api_key_id=None, subject_id=None, requested_model="m")
    for _ in range(60_000):
        price = Price(rng.choice(prices), rng.choice(prices))
        prompt, completion = rng.randrange(0, 10 ** rng.randrange(1, 13)), rng.randrange(0, 10 ** rng.randrange(1, 13))
        record.usage, record.price = Usage(prompt, completion), price
        settle_cost(record)
        cost_usd, cost_micro = decimal_settled(prompt, completion, price)
        assert record.cost_source == ("price" if prompt + completion else "none")
        if prompt + completion:
            # repr: the same float, -0.0 and 0.0 told apart.
            assert (repr(record.cost_usd), record.cost_micro_usd) == (repr(cost_usd), cost_micro), (
                price, prompt, completion)
    # A price of -0.0 (``ge=0`` admits it): its Decimal is signed, and the sum's sign is what
    # the ledger's line says. (Remembered prices cannot tell -0.0 from 0.0: whichever came
    # first stands for both, on either route; so from empty memories here.)
    price_micro.cache_clear()
    reservations._per_token_micro.cache_clear()
    for price in (Price(-0.0, -0.0), Price(-0.0, 0.0), Price(0.0, -0.0)):
        record.usage, record.price = Usage(3, 4), price
        settle_cost(record)
        assert (repr(record.cost_usd), record.cost_micro_usd) == ("-0.0", 0)
    price_micro.cache_clear()
    reservations._per_token_micro.cache_clear()


@pytest.mark.parametrize(("prompt", "completion"), [(-1, 5), (5, -1), (2.5, 1), (1, Decimal(2))])
def test_counts_that_are_not_plain_non_negative_ints_take_the_decimal_route(prompt: object, completion: object) -> None:
    price = Price(0.15, 0.6)
    assert exact_micro_cost(prompt, completion, price) is None  # type: ignore[arg-type]
    try:
        expected: object = decimal_cost_micro_usd(prompt, completion, price)  # type: ignore[arg-type]
    except TypeError as exc:
        expected = type(exc)
    try:
        got: object = cost_micro_usd(prompt, completion, price)  # type: ignore[arg-type]
    except TypeError as exc:
        got = type(exc)
    assert got == expected


def test_worst_case_is_the_dearest_price() -> None:
    prices = [Price(1, 2), Price(3, 1), Price(0.15, 0.6)]
    assert worst_case_micro_usd(10, 100, prices) == max(decimal_cost_micro_usd(10, 100, p) for p in prices) == 210
    assert worst_case_micro_usd(10, 100, []) == 0
    assert worst_case_micro_usd(0, 0, [Price(0, 0)]) == 0


async def test_the_gate_holds_the_same_worst_case_from_a_routes_exact_rates() -> None:
    """``BudgetGate.hold`` given a route's remembered ``exact_rates`` (the billing handle's
    path) holds what it holds from the prices alone, and refuses the same calls."""
    class Admit:
        settles_explicitly = False

        async def reserve(self, reservation: Reservation, ttl: float) -> int | None:
            return None

    gate = BudgetGate(Admit(), ttl=60, subject_budgets={})  # type: ignore[arg-type]
    rng = random.Random(11)
    prices, counts = odd_prices(rng), token_counts(rng)
    key_id, subject_id = uuid.uuid4(), uuid.uuid4()
    budget = (Decimal(10) ** 40, "total")

    async def held(route_prices: list[Price | None], bound: int, cap: int, rates: object) -> object:
        try:
            reservation = await gate.hold(uuid.uuid4(), key_id, budget, subject_id, "m", route_prices, bound, cap,
                                          rates)  # type: ignore[arg-type]
        except BudgetExceeded as exc:
            return str(exc)
        assert reservation is not None
        return reservation.amount_micro_usd

    with_rates = 0
    for _ in range(3000):
        route_prices: list[Price | None] = [
            Price(rng.choice(prices), rng.choice(prices)) for _ in range(rng.choice([1, 1, 2, 3]))]
        if rng.random() < 0.05:
            route_prices.append(None)
        if rng.random() < 0.02:
            route_prices = []
        rates = exact_rates(route_prices)
        with_rates += rates is not None
        bound, cap = rng.choice(counts), rng.choice([*counts, 0, 16, 4096, -1])
        expected = await held(route_prices, bound, cap, None)
        assert await held(route_prices, bound, cap, rates) == expected, (route_prices, bound, cap)
        if isinstance(expected, int):
            assert expected == worst_case_micro_usd(bound, cap, route_prices)  # type: ignore[arg-type]
    assert with_rates > 2000  # the rates' route was taken, many times
    assert exact_rates([Price(1, 2), None]) is None
    assert exact_rates([]) is None
    assert exact_rates([Price(1.0, 2.0)]) == ((10, 20, 10),)  # micro-USD per token over one divisor
