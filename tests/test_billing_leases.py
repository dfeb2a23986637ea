"""Budget leases (gateway/billing/leases.py): calls small against their budgets are held in a
lease this process holds in the shared store, so most make no round trip, and budgets
still never admit more than they can cover, on PostgreSQL and on Redis.

The stores talk to the real test PostgreSQL and Redis through the counting wrappers of
tests/budget_stores.py; the leases' clock is a fake one where a test
moves time on.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any

import asyncpg
import pytest

from gateway.billing.gate import BudgetGate
from gateway.billing.leases import BudgetLeases
from gateway.billing.reservations import Budget, Reservation
from gateway.core.config import Price
from gateway.core.errors import BudgetExceeded, ServiceUnavailable
from gateway.core.settings import ConfigError, load_settings
from tests.budget_stores import STORES, Faults, key_budget, open_reservations, seeded, subject_budget
from tests.conftest import auth, until
from tests.test_billing_reservations import TENTH_PER_TOKEN, call, ledger_spend, priced

#: One micro-USD per token: a call with a prompt bound of P and an output cap of C costs at
#: most P + C micro-USD.
MICRO_PER_TOKEN = Price(1.0, 1.0)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def leased_gate(
    store: Any, *, fraction: float = 0.1, seconds: float = 1.0, clock: Clock | None = None, standby: float = 0.0,
) -> BudgetGate:
    """A gate whose leases run on ``clock`` (their sweeper never wakes within a test: it
    sleeps ``seconds / 2`` of real time, and the tests sweep by hand). ``standby``: the
    leases' ``standby_seconds`` (0, the default here: a lease past its time retires)."""
    gate = BudgetGate(store, ttl=600, subject_budgets={})
    gate.leases = BudgetLeases(
        store, ttl=600, fraction=fraction, seconds=seconds, standby_seconds=standby, clock=clock or Clock())
    return gate


async def budget_store(kind: str, make_store: Any, limit: int, faults: Faults | None = None) -> tuple[Any, Budget]:
    """A store of ``kind`` and a key budget of ``limit`` micro-USD, seeded (Redis)."""
    store = await make_store(kind, faults or Faults())
    budget = key_budget(limit)
    await seeded(kind, store, budget)
    return store, budget


async def hold(gate: BudgetGate, budget: Budget, amount: int, *, budgets: tuple[Budget, ...] | None = None) -> Reservation:
    """Reserve a call whose worst case is exactly ``amount`` micro-USD against ``budget``."""
    gate._budgets_of = lambda *_: budgets or (budget,)  # type: ignore[method-assign]
    held = await gate.reserve(
        call_id=uuid.uuid4(), api_key_id=budget.id, key_budget=(Decimal(1), "total"), subject_id=uuid.uuid4(),
        model="m", prices=[MICRO_PER_TOKEN], prompt_bound=amount, output_cap=0,
    )
    assert held is not None
    return held


async def outcome(gate: BudgetGate, budget: Budget, amount: int) -> Reservation | str:
    try:
        return await hold(gate, budget, amount)
    except BudgetExceeded:
        return "402"


async def ledger_row(pool: asyncpg.Pool, call_id: uuid.UUID, budget: Budget, cost_micro: int) -> None:
    """The call's ledger row, as shipping writes it (its trigger adds the cost to budget_spend)."""
    await pool.execute(
        """INSERT INTO usage_ledger (call_id, request_id, api_key_id, subject_id, requested_model, prompt_tokens,
           completion_tokens, cost_usd, cost_source, latency_seconds, status, outcome, streamed, created_at)
           VALUES ($1, 'req', $2, $3, 'm', 1, 1, $4, 'price', 0.1, 200, 'ok', false, $5)""",
        call_id, budget.id, uuid.uuid4(), Decimal(cost_micro) / 1_000_000, datetime.now(timezone.utc))


@pytest.mark.parametrize("kind", STORES)
async def test_small_calls_share_one_lease_and_one_round_trip(kind: str, make_store: Any, db_pool: asyncpg.Pool) -> None:
    faults = Faults()
    store, budget = await budget_store(kind, make_store, 1_000_000, faults)
    gate = leased_gate(store)  # a lease of 10 % of the budget: 100,000 micro-USD
    held = await asyncio.gather(*(hold(gate, budget, 1_000) for _ in range(50)))
    assert all(h.lease is not None for h in held)
    assert faults.round_trips == 1  # 50 calls, one lease
    assert gate.leases.granted == 1 and gate.leases.admitted == 50
    assert await open_reservations(kind, store, db_pool, budget) == 100_000  # the lease, whole
    for h in held:
        assert gate.settles_at_once(h, 0)  # no I/O at the end either
    assert (await hold(gate, budget, 1_000)).lease is held[0].lease  # what ended is free again
    assert faults.round_trips == 1


@pytest.mark.parametrize("kind", STORES)
async def test_leases_admit_exactly_what_the_budget_covers_then_refuse(
    kind: str, make_store: Any, db_pool: asyncpg.Pool
) -> None:
    """150 calls in flight together on a budget worth 100: leases of 10 calls each and, for
    calls that waited for several, reservations of their own fill it; then the lease and
    the call on its own are refused: exactly 100 admitted."""
    faults = Faults()
    store, budget = await budget_store(kind, make_store, 100_000, faults)
    gate = leased_gate(store)  # leases of 10,000: ten calls of 1,000 each
    outcomes = await asyncio.gather(*(outcome(gate, budget, 1_000) for _ in range(150)))
    admitted = [o for o in outcomes if o != "402"]
    assert len(admitted) == 100 and outcomes.count("402") == 50
    assert await open_reservations(kind, store, db_pool, budget) == 100_000  # never more
    # Every lease granted was used to its last call; what queued behind them reserved on
    # its own (in batches), up to the same total.
    assert sum(1 for o in admitted if isinstance(o, Reservation) and o.lease is not None) == 10 * gate.leases.granted
    assert gate.leases.granted >= 1 and faults.round_trips < 150


@pytest.mark.parametrize("kind", STORES)
async def test_a_retired_lease_gives_back_what_it_never_used_and_is_released_when_its_calls_are_counted(
    kind: str, make_store: Any, db_pool: asyncpg.Pool
) -> None:
    store, budget = await budget_store(kind, make_store, 1_000_000)
    clock = Clock()
    gate = leased_gate(store, clock=clock)
    first, second, third = [await hold(gate, budget, 1_000) for _ in range(3)]
    assert await open_reservations(kind, store, db_pool, budget) == 100_000
    gate.settles_at_once(first, 400)
    clock.now += 1.0  # the lease stops admitting
    await gate.leases.sweep()
    # Shrunk to what its calls still hold (2 x 1,000) and have spent (400).
    assert await open_reservations(kind, store, db_pool, budget) == 2_400
    gate.settles_at_once(second, 300)
    gate.settles_at_once(third, 0)
    await gate.leases.sweep()
    if kind == "postgresql":
        # The costs are not in the ledger yet: the lease keeps counting them (and only them).
        assert await open_reservations(kind, store, db_pool, budget) == 700
        assert gate.leases.held == 1
        await ledger_row(db_pool, first.reservation_id, budget, 400)
        await ledger_row(db_pool, second.reservation_id, budget, 300)
        await gate.leases.sweep()
    else:
        spent = await store._redis.hget(f"{store._prefix}:{budget.redis_name}", "spent")
        assert int(spent) == 700  # settled at the sum of its calls' costs
    assert await open_reservations(kind, store, db_pool, budget) == 0
    assert gate.leases.held == 0


@pytest.mark.parametrize("kind", STORES)
async def test_a_call_refused_for_room_a_retired_lease_of_ours_never_used_is_admitted(
    kind: str, make_store: Any, db_pool: asyncpg.Pool
) -> None:
    """A lease retired on its time with room left (the calls of a burst still arriving
    after it) holds that room in the store until the next sweep; a call the store refuses
    meanwhile has the lease give it back and is asked for once more, so one replica never
    refuses a call for room it holds itself."""
    faults = Faults()
    store, budget = await budget_store(kind, make_store, 100_000, faults)
    clock = Clock()
    gate = leased_gate(store, clock=clock)  # leases of 10,000
    assert await store.reserve(Reservation(uuid.uuid4(), 90_000, (budget,)), 60) is None  # someone else's
    early = [await hold(gate, budget, 1_000) for _ in range(3)]
    assert all(h.lease is early[0].lease for h in early)
    clock.now += 1.0  # its time is over, 7,000 of it unused; no sweep has run
    late = await outcome(gate, budget, 1_000)
    assert isinstance(late, Reservation) and late.lease is None  # on its own, in the room given back
    assert gate.leases.granted == 1  # the lease asked for first was refused: the budget is nearly spent
    assert await open_reservations(kind, store, db_pool, budget) == 90_000 + 3_000 + 1_000
    await gate.leases.sweep()  # the sweep finds it shrunk already
    assert await open_reservations(kind, store, db_pool, budget) == 94_000
    # What is left (6,000) is admitted to the last call, and no further.
    rest = [await outcome(gate, budget, 1_000) for _ in range(7)]
    assert sum(isinstance(r, Reservation) for r in rest) == 6 and rest[-1] == "402"


@pytest.mark.parametrize("kind", STORES)
async def test_a_call_that_stops_waiting_for_a_lease_to_give_back_leaves_the_shrink_to_finish(
    kind: str, make_store: Any, db_pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shrink is shared by the sweep and every refused call: a call whose wait for the
    store runs out (503) must not cancel it for the others."""
    store, budget = await budget_store(kind, make_store, 100_000)
    clock = Clock()
    gate = leased_gate(store, clock=clock)
    assert await store.reserve(Reservation(uuid.uuid4(), 90_000, (budget,)), 60) is None  # someone else's
    lease = (await hold(gate, budget, 1_000)).lease
    assert lease is not None
    clock.now += 1.0
    resizing, go_on = asyncio.Event(), asyncio.Event()
    resize = store.resize

    async def held_resize(*args: Any) -> None:
        resizing.set()
        await go_on.wait()
        await resize(*args)

    store.resize = held_resize
    monkeypatch.setattr("gateway.billing.gate.RESERVE_TIMEOUT", 0.3)
    with pytest.raises(ServiceUnavailable):
        await hold(gate, budget, 1_000)  # refused, then gives up waiting for the shrink
    assert resizing.is_set() and lease.shrinking is not None and not lease.shrinking.cancelled()
    go_on.set()
    await until(lambda: lease.shrunk, timeout=2.0)
    assert await open_reservations(kind, store, db_pool, budget) == 90_000 + 1_000


@pytest.mark.parametrize("kind", STORES)
async def test_a_lease_in_its_last_quarter_has_its_successor_granted_before_any_call_waits(
    kind: str, make_store: Any, db_pool: asyncpg.Pool
) -> None:
    faults = Faults()
    store, budget = await budget_store(kind, make_store, 1_000_000, faults)
    clock = Clock()
    gate = leased_gate(store, clock=clock)
    first = await hold(gate, budget, 1_000)
    assert faults.round_trips == 1
    clock.now += 0.8  # the last quarter of the lease's second
    late = gate.leases.take((budget,), 1_000, uuid.uuid4())  # no I/O: still the first lease
    assert late is not None and late.lease is first.lease
    await until(lambda: gate.leases.granted == 2, timeout=2.0)
    assert gate.leases.granted == 2 and faults.round_trips == 2  # asked for in the background
    assert await open_reservations(kind, store, db_pool, budget) == 200_000  # both held meanwhile
    clock.now += 0.3  # the first lease's time is over: its successor admits, nobody waits
    after = gate.leases.take((budget,), 1_000, uuid.uuid4())
    assert after is not None and after.lease is not first.lease
    assert faults.round_trips == 2
    await gate.leases.sweep()  # the first gives back what it never used
    assert await open_reservations(kind, store, db_pool, budget) == 2_000 + 100_000


@pytest.mark.parametrize("kind", STORES)
async def test_a_refused_successor_leaves_the_lease_admitting_until_it_is_spent(
    kind: str, make_store: Any, db_pool: asyncpg.Pool
) -> None:
    faults = Faults()
    store, budget = await budget_store(kind, make_store, 100_000, faults)
    gate = leased_gate(store)  # leases of 10,000
    assert await store.reserve(Reservation(uuid.uuid4(), 90_000, (budget,)), 60) is None  # someone else's
    held = [await hold(gate, budget, 1_000) for _ in range(8)]  # 2,000 left: its successor is asked for
    await until(lambda: faults.round_trips == 3, timeout=2.0)
    assert faults.round_trips == 3 and gate.leases.granted == 1  # the successor did not fit
    more = [await outcome(gate, budget, 1_000) for _ in range(3)]
    assert [isinstance(m, Reservation) and m.lease is held[0].lease for m in more[:2]] == [True, True]
    assert more[2] == "402"  # the lease spent, the budget full: refused
    assert await open_reservations(kind, store, db_pool, budget) == 100_000


@pytest.mark.parametrize("kind", STORES)
async def test_another_replicas_lease_is_never_overspent_and_what_it_left_returns_when_it_retires(
    kind: str, make_store: Any, db_pool: asyncpg.Pool
) -> None:
    store, budget = await budget_store(kind, make_store, 100_000)
    clock = Clock()
    replica_a, replica_b = leased_gate(store, clock=clock), leased_gate(store, clock=clock)
    await hold(replica_a, budget, 1_000)  # a lease of 10,000 with 9,000 left in it
    outcomes = await asyncio.gather(*(outcome(replica_b, budget, 1_000) for _ in range(100)))
    assert outcomes.count("402") == 10  # 90 fit beside replica A's lease; nothing more
    assert await open_reservations(kind, store, db_pool, budget) == 100_000
    clock.now += 1.0
    await replica_a.leases.sweep()  # A's lease retires: it gives back the 9,000 it never used
    assert await open_reservations(kind, store, db_pool, budget) == 91_000
    clock.now += 1.0  # replica B's refused lease no longer steers it to one call at a time
    more = await asyncio.gather(*(outcome(replica_b, budget, 1_000) for _ in range(10)))
    assert more.count("402") == 1  # the 9 that fit now, one by one (a lease no longer fits)
    assert await open_reservations(kind, store, db_pool, budget) == 100_000


@pytest.mark.parametrize("kind", STORES)
async def test_a_call_large_against_its_budget_reserves_on_its_own(kind: str, make_store: Any, db_pool: asyncpg.Pool) -> None:
    store, budget = await budget_store(kind, make_store, 10_000)
    gate = leased_gate(store)  # a lease would be 1,000: not eight calls of 1,000
    held = await hold(gate, budget, 1_000)
    assert held.lease is None and gate.leases.granted == 0
    assert await open_reservations(kind, store, db_pool, budget) == 1_000


@pytest.mark.parametrize("kind", STORES)
async def test_a_lease_holds_against_every_budget_of_its_calls(kind: str, make_store: Any, db_pool: asyncpg.Pool) -> None:
    store = await make_store(kind, Faults())
    key, subject = key_budget(2_000_000), subject_budget(1_000_000)
    await seeded(kind, store, key, subject)
    gate = leased_gate(store)
    held = await hold(gate, key, 1_000, budgets=(key, subject))
    assert held.lease is not None
    # 10 % of the smaller budget, against both.
    assert await open_reservations(kind, store, db_pool, key) == 100_000
    assert await open_reservations(kind, store, db_pool, subject) == 100_000


@pytest.mark.parametrize("kind", STORES)
async def test_a_store_that_fails_the_lease_fails_its_calls_closed_and_the_next_lease_works(
    kind: str, make_store: Any, db_pool: asyncpg.Pool
) -> None:
    faults = Faults(fail_on={1})
    store, budget = await budget_store(kind, make_store, 1_000_000, faults)
    gate = leased_gate(store)
    failed = await asyncio.gather(*(hold(gate, budget, 1_000) for _ in range(5)), return_exceptions=True)
    assert all(isinstance(f, ServiceUnavailable) and f.error_code == "budget_unavailable" for f in failed), failed
    assert (await hold(gate, budget, 1_000)).lease is not None
    assert await open_reservations(kind, store, db_pool, budget) == 100_000


@pytest.mark.parametrize("kind", STORES)
async def test_closing_releases_leases_whose_calls_ended(kind: str, make_store: Any, db_pool: asyncpg.Pool) -> None:
    store, budget = await budget_store(kind, make_store, 1_000_000)
    gate = leased_gate(store)
    gate.settles_at_once(await hold(gate, budget, 1_000), 0)  # cost nothing: nothing to wait for
    await gate.leases.close()
    assert await open_reservations(kind, store, db_pool, budget) == 0


@pytest.mark.parametrize("kind", STORES)
async def test_a_lease_counts_as_held_until_the_store_has_released_it(
    kind: str, make_store: Any, db_pool: asyncpg.Pool
) -> None:
    # A sweep took retired leases off its list while their release was in flight: `held`
    # said 0 with the lease's row still in the store (a flaky end-to-end test showed it).
    store, budget = await budget_store(kind, make_store, 1_000_000)
    gate = leased_gate(store)
    gate.settles_at_once(await hold(gate, budget, 1_000), 0)
    lease = next(iter(gate.leases._active.values()))
    gate.leases._retire(lease)
    releasing, go_on = asyncio.Event(), asyncio.Event()
    release = store.release_lease

    async def held_release(*args: Any) -> bool:
        releasing.set()
        await go_on.wait()
        return await release(*args)

    store.release_lease = held_release
    sweep = asyncio.ensure_future(gate.leases.sweep())
    await releasing.wait()
    assert gate.leases.held == 1  # its row is still in the store
    assert await open_reservations(kind, store, db_pool, budget) > 0
    go_on.set()
    await sweep
    assert gate.leases.held == 0
    assert await open_reservations(kind, store, db_pool, budget) == 0


@pytest.mark.parametrize("kind", STORES)
async def test_a_retired_lease_is_tried_once_per_ship_that_can_have_its_calls(
    kind: str, make_store: Any, db_pool: asyncpg.Pool
) -> None:
    """PostgreSQL releases a lease once its costly calls are in the ledger, and each try
    sends all their ids to be looked up there: once the billing actor tells of its ships,
    a lease whose calls have ended is tried only after a ship that began after they ended
    (and again only after the next, if one was still missing). Redis settles the lease at
    once and is never held back; nor is the last sweep at close."""
    store, budget = await budget_store(kind, make_store, 1_000_000)
    clock = Clock()
    gate = leased_gate(store, clock=clock)
    leases = gate.leases
    tries: list[int] = []
    release = store.release_lease

    async def counted_release(*args: Any) -> bool:
        tries.append(len(args[2]))
        return bool(await release(*args))

    store.release_lease = counted_release
    leases.shipped(leases.ship_began())  # a ship before these calls: it cannot have them
    first, second = [await hold(gate, budget, 1_000) for _ in range(2)]
    gate.settles_at_once(first, 400)
    gate.settles_at_once(second, 300)
    clock.now += 1.0  # the lease stops admitting: retired, its calls all ended
    await leases.sweep()
    await leases.sweep()
    if kind == "redis":
        assert tries == [2] and leases.held == 0  # settled at once: nothing to wait for
        return
    assert tries == [] and leases.held == 1  # no ship since they ended: not tried
    await ledger_row(db_pool, first.reservation_id, budget, 400)  # one of the two shipped
    clock.now += 0.5
    leases.shipped(leases.ship_began())
    clock.now += 0.1  # the sweep comes a little after the ship
    await leases.sweep()
    await leases.sweep()
    assert tries == [2] and leases.held == 1  # tried once: one still missing, so it waits
    await ledger_row(db_pool, second.reservation_id, budget, 300)
    await leases.sweep()
    assert tries == [2]  # no ship since that try
    clock.now += 0.5
    leases.shipped(leases.ship_began())
    clock.now += 0.1
    await leases.sweep()
    assert tries == [2, 2] and leases.held == 0
    assert await open_reservations(kind, store, db_pool, budget) == 0

    # Retired with a call still open: the end of its last call is timed, so a ship that
    # began after that end, even before the sweep saw it, has them all.
    fourth = await hold(gate, budget, 1_000)
    clock.now += 1.0
    await leases.sweep()  # retired, one call open: nothing to try yet
    assert tries == [2, 2] and leases.held == 1
    gate.settles_at_once(fourth, 500)
    await ledger_row(db_pool, fourth.reservation_id, budget, 500)
    clock.now += 0.1
    leases.shipped(leases.ship_began())
    clock.now += 0.1
    await leases.sweep()
    assert tries == [2, 2, 1] and leases.held == 0

    # At close, after the last ship, a lease is tried whatever the ships told.
    third = await hold(gate, budget, 1_000)
    gate.settles_at_once(third, 0)
    await leases.close()
    assert tries == [2, 2, 1, 0] and leases.held == 0


# -- through a running gateway --------------------------------------------------------------
@pytest.mark.parametrize("store", ["postgresql", "redis"])
async def test_a_busy_budgeted_key_is_held_in_leases_and_its_spend_is_exact(
    store: str, gateway_factory: Any, fake_factory: Any, key_factory: Any, db_pool: asyncpg.Pool, redis_url: str
) -> None:
    fake = await fake_factory(latency_ms=300)  # all 120 in flight together
    # Leases of 2 s: the burst reaches the gate within one lease's time even on a loaded
    # machine (it took over 0.2 s there, and a lease retired on its time admits no more,
    # so fewer than 100 calls came from leases). Budgets hold exactly either way.
    env = {"BUDGET_LEASE_FRACTION": "0.5", "BUDGET_LEASE_SECONDS": "2"}
    if store == "redis":
        env["REDIS_URL"] = redis_url
    gw = await gateway_factory(env=env, config_yaml=priced(fake.url))
    # 10 USD: 100 calls of 0.1 USD; leases of 5 USD (50 calls) each.
    raw, record = await key_factory(budget_usd=Decimal("10"), budget_period="day", rate_limit_requests=100_000)
    statuses = await asyncio.gather(*(call(gw, raw) for _ in range(120)))
    leases = gw.state.billing._gate.leases
    # Under load a lease retired on its time with room left, and calls it could have held
    # were refused (86 admitted): a refused call now has it give that room back first.
    assert statuses.count(200) == 100 and statuses.count(402) == 20, (
        Counter(statuses), leases.granted, leases.admitted)
    assert (await fake.stats())["requests"] == 100  # a refused call sends nothing
    assert leases.granted == 2 and leases.admitted == 100
    assert await gw.state.billing.flush()
    assert leases._shipped_from is not None  # the billing actor tells the leases of its ships
    assert await ledger_spend(db_pool, record.api_key_id) == Decimal("10")
    # The leases retire when spent and are released once the ledger has their calls.
    await until(lambda: leases.held == 0)
    assert leases.held == 0
    if store == "postgresql":
        assert await db_pool.fetchval("SELECT count(*) FROM budget_reservations WHERE id = $1", record.api_key_id) == 0
    # The day's budget is spent: the next call is refused by the store's own count.
    resp = await gw.data.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                            "max_tokens": 1}, headers=auth(raw))
    assert resp.status == 402


async def test_leases_are_off_with_a_zero_fraction_and_a_share_over_half_is_refused(
    gateway_factory: Any, fake_factory: Any, key_factory: Any, db_pool: asyncpg.Pool
) -> None:
    fake = await fake_factory()
    gw = await gateway_factory(env={"BUDGET_LEASE_FRACTION": "0"}, config_yaml=priced(fake.url, TENTH_PER_TOKEN))
    raw, _ = await key_factory(budget_usd=Decimal("1000"), budget_period="day")
    assert await call(gw, raw) == 200
    assert gw.state.billing._gate.leases.granted == 0  # one reservation per call, as before leases
    with pytest.raises(ConfigError, match="BUDGET_LEASE_FRACTION"):
        load_settings({"BUDGET_LEASE_FRACTION": "0.75"})
    assert load_settings({}).budget_lease_fraction == 0.02


# ----------------------------------------------------------------------------- standby
async def one_call_on_a_standby_gate(
    kind: str, make_store: Any
) -> tuple[Faults, Any, Budget, Clock, BudgetGate, Reservation]:
    """A gate with standbys on (30 s) over a budget of 1,000,000, leases of 100,000, on a
    fake clock, and the first call's hold (1,000, from the first lease) settled at 400."""
    faults = Faults()
    store, budget = await budget_store(kind, make_store, 1_000_000, faults)
    clock = Clock()
    gate = leased_gate(store, clock=clock, standby=30.0)
    first = await hold(gate, budget, 1_000)
    gate.settles_at_once(first, 400)
    return faults, store, budget, clock, gate, first


@pytest.mark.parametrize("kind", STORES)
async def test_a_lease_past_its_time_stands_by_and_a_seldom_call_makes_no_round_trip(
    kind: str, make_store: Any, db_pool: asyncpg.Pool
) -> None:
    """A budget called less than once a lease's second: its lease, past its time with no
    successor, is cut down to what it has spent plus two calls' room and admits the next
    calls in memory; the one that leaves it less than another call's room asks for a full
    lease in the background, which takes over."""
    faults, store, budget, clock, gate, first = await one_call_on_a_standby_gate(kind, make_store)
    assert faults.round_trips == 1
    clock.now += 1.0
    await gate.leases.sweep()
    # Standing by: its spend (400) and room for two calls of its largest (2 x 1,000).
    assert await open_reservations(kind, store, db_pool, budget) == 2_400
    assert gate.leases.held == 1
    clock.now += 20.0  # long after the lease's second, within its standby
    seldom = await hold(gate, budget, 1_000)
    assert seldom.lease is first.lease and faults.round_trips == 1  # admitted in memory
    await asyncio.sleep(0.05)
    assert gate.leases.granted == 1  # room for one more: nothing asked of the store
    last = await hold(gate, budget, 1_000)  # its last room: a full lease is asked for in the background
    assert last.lease is first.lease
    await until(lambda: gate.leases.granted == 2, timeout=2.0)
    after = await hold(gate, budget, 1_000)
    assert after.lease is not None and after.lease is not first.lease and faults.round_trips == 2
    await gate.leases.sweep()  # the standby, retired, holds its two calls and its spend
    assert await open_reservations(kind, store, db_pool, budget) == 100_000 + 2_400


@pytest.mark.parametrize("kind", STORES)
async def test_a_call_that_finds_its_lease_past_its_time_before_the_sweep_stands_it_by(
    kind: str, make_store: Any, db_pool: asyncpg.Pool
) -> None:
    """The sweep runs every half lease, so a budget called about once a lease's time found
    its lease past its time and not yet standing by on about every other call: it retired
    the lease and waited for a new one, a round trip before its first byte. Such a call
    stands the lease by itself, is admitted from it at once, and the store is told the
    cut-down amount in the background."""
    faults, store, budget, clock, gate, first = await one_call_on_a_standby_gate(kind, make_store)
    assert faults.round_trips == 1
    clock.now += 1.5  # past the lease's second; no sweep has run
    seldom = await hold(gate, budget, 1_000)
    lease = seldom.lease
    assert lease is first.lease and lease.standby
    assert faults.round_trips == 1 and gate.leases.granted == 1  # admitted in memory
    assert lease.resizing is not None  # the store is told without the call waiting
    await lease.resizing
    # Its spend (400) and two calls' room (2 x 1,000), this call's hold in it.
    assert await open_reservations(kind, store, db_pool, budget) == 2_400
    gate.settles_at_once(seldom, 400)
    clock.now += 1.5
    last = await hold(gate, budget, 1_000)  # from the standby; it leaves it low: a full lease is asked for
    assert last.lease is lease and faults.round_trips == 1
    await until(lambda: gate.leases.granted == 2, timeout=2.0)
    await gate.leases.sweep()  # the standby, retired, holds its open call and its spend
    assert await open_reservations(kind, store, db_pool, budget) == 100_000 + 400 + 400 + 1_000


async def test_a_standby_cut_the_store_refuses_leaves_the_lease_holding_its_whole_amount(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The background update failing costs only over-holding: the call was admitted, the
    lease admits on from what it kept, and the store goes on counting the whole lease."""

    class RefusingResize:
        settles_explicitly = False

        async def reserve(self, reservation: Reservation, ttl: float) -> int | None:
            return None

        async def resize(self, lease: Reservation, amount: int) -> None:
            raise ConnectionError("store gone")

    budget = key_budget(1_000_000)
    clock = Clock()
    gate = leased_gate(RefusingResize(), clock=clock, standby=30.0)
    first = await hold(gate, budget, 1_000)
    gate.settles_at_once(first, 400)
    clock.now += 1.5
    seldom = await hold(gate, budget, 1_000)
    lease = seldom.lease
    assert lease is first.lease and lease.standby and lease.resizing is not None
    with caplog.at_level("WARNING", logger="gateway.billing"):
        await lease.resizing
    assert lease.resizing is None
    assert "could not cut a standing-by budget lease down" in caplog.text
    assert lease.free == 1_000 and lease.amount == 2_400  # what it admits from: never more than the store holds


@pytest.mark.parametrize("kind", STORES)
async def test_a_standby_admits_only_its_room_and_retires_unused_after_its_time(
    kind: str, make_store: Any, db_pool: asyncpg.Pool
) -> None:
    faults = Faults()
    store, budget = await budget_store(kind, make_store, 1_000_000, faults)
    clock = Clock()
    gate = leased_gate(store, clock=clock, standby=30.0)
    first = await hold(gate, budget, 1_000)
    gate.settles_at_once(first, 1_000)
    clock.now += 1.0
    await gate.leases.sweep()
    assert await open_reservations(kind, store, db_pool, budget) == 3_000  # spent 1,000 + room 2,000
    # A call larger than the room is not admitted from it: it waits for a full lease.
    large = await hold(gate, budget, 5_000)
    assert large.lease is not first.lease and faults.round_trips == 2
    gate.settles_at_once(large, 0)
    clock.now += 1.0
    await gate.leases.sweep()  # the new lease stands by in turn; the first is given back
    if kind == "postgresql":
        await ledger_row(db_pool, first.reservation_id, budget, 1_000)
        await gate.leases.sweep()
    assert await open_reservations(kind, store, db_pool, budget) == 2 * 5_000  # two of the largest call
    clock.now += 30.0  # unused for its whole standby: retired, then released (nothing held, nothing spent)
    await gate.leases.sweep()
    await gate.leases.sweep()
    assert await open_reservations(kind, store, db_pool, budget) == 0
    assert gate.leases.held == 0


async def test_the_standby_is_on_by_default_and_zero_turns_it_off(
    gateway_factory: Any, fake_factory: Any, key_factory: Any
) -> None:
    assert load_settings({}).budget_lease_standby_seconds == 30.0
    assert load_settings({"BUDGET_LEASE_STANDBY_SECONDS": "0"}).budget_lease_standby_seconds == 0.0
    with pytest.raises(ConfigError, match="BUDGET_LEASE_STANDBY_SECONDS"):
        load_settings({"BUDGET_LEASE_STANDBY_SECONDS": "-1"})
    fake = await fake_factory()
    env = {"BUDGET_LEASE_SECONDS": "0.2", "BUDGET_LEASE_STANDBY_SECONDS": "30"}
    gw = await gateway_factory(env=env, config_yaml=priced(fake.url, TENTH_PER_TOKEN))
    raw, _ = await key_factory(budget_usd=Decimal("1000"), budget_period="day")
    leases = gw.state.billing._gate.leases
    assert await call(gw, raw) == 200
    await until(lambda: any(lease.standby for lease in leases._active.values()), timeout=5.0)
    granted = leases.granted
    assert await call(gw, raw) == 200  # the key's next call, after its lease's time: from the standby
    assert leases.admitted == 2 and leases.granted >= granted
