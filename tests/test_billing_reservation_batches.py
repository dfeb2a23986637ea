"""Budget reservations in batches: the calls a process makes while a round trip to the store
is in flight go together in the next one (gateway/billing/coalesce.py), and each is answered
exactly as if they had been sent one after another, on PostgreSQL and on Redis.

The stores here talk to the real test PostgreSQL and Redis; what reaches them is counted
(and, for the failure tests, broken) by thin wrappers around the real clients
(tests/budget_stores.py).
"""

from __future__ import annotations

import asyncio
import uuid
from decimal import Decimal
from typing import Any

import asyncpg
import pytest

from gateway.billing.coalesce import Coalescer
from gateway.billing.gate import BudgetGate
from gateway.billing.reservations import (
    Budget,
    Reservation,
)
from gateway.core.config import Price
from gateway.core.errors import ServiceUnavailable
from tests.budget_stores import (
    STORES,
    Faults,
    key_budget,
    open_reservations,
    seeded,
    subject_budget,
)


def sequential_answers(calls: list[tuple[int, tuple[Budget, ...]]]) -> list[int | None]:
    """What one-by-one reservations would answer: None admitted, else the index of the first
    of the call's budgets it does not fit."""
    used: dict[str, int] = {}
    answers: list[int | None] = []
    for amount, budgets in calls:
        refused = next((i for i, b in enumerate(budgets) if used.get(b.redis_name, 0) + amount > b.limit_micro_usd), None)
        if refused is None:
            for b in budgets:
                used[b.redis_name] = used.get(b.redis_name, 0) + amount
        answers.append(refused)
    return answers


# -- the batcher alone ---------------------------------------------------------------------
async def test_a_lone_call_goes_at_once_and_what_arrives_meanwhile_waits_for_the_next_round_trip() -> None:
    sent: list[list[int]] = []
    release = asyncio.Event()

    async def send(items: list[int]) -> list[int]:
        sent.append(items)
        if len(sent) == 1:
            await release.wait()
        return [i * 10 for i in items]

    coalescer: Coalescer[int, int] = Coalescer(send, max_batch=4)
    first = asyncio.ensure_future(coalescer.submit(0))
    await asyncio.sleep(0.01)
    assert sent == [[0]]  # no waiting for company: an idle store costs one round trip
    rest = [asyncio.ensure_future(coalescer.submit(i)) for i in range(1, 7)]
    await asyncio.sleep(0.01)
    release.set()
    assert await asyncio.gather(first, *rest) == [0, 10, 20, 30, 40, 50, 60]
    assert sent == [[0], [1, 2, 3, 4], [5, 6]]  # in arrival order, max_batch at most
    assert (coalescer.round_trips, coalescer.items) == (3, 7)


async def test_a_caller_that_stops_waiting_is_dropped_or_its_answer_handed_to_lost() -> None:
    release = asyncio.Event()
    lost: list[tuple[int, int | None]] = []

    async def send(items: list[int]) -> list[int]:
        await release.wait()
        return items

    coalescer: Coalescer[int, int] = Coalescer(send, lost=lost.extend)
    in_flight = asyncio.ensure_future(coalescer.submit(1))
    await asyncio.sleep(0.01)
    queued = asyncio.ensure_future(coalescer.submit(2))
    await asyncio.sleep(0.01)
    in_flight.cancel()
    queued.cancel()
    release.set()
    await asyncio.sleep(0.01)
    assert lost == [(1, 1)]  # sent, answered, nobody to tell: handed over to be released
    assert coalescer.round_trips == 1  # the queued one was never sent


async def test_round_trips_run_in_a_context_of_their_own_not_the_first_callers() -> None:
    """A batch serves every caller, so its log lines must not carry the request id of
    whichever call happened to start it."""
    from gateway.observability.logs import _REQUEST_ID

    seen: list[str | None] = []

    async def send(items: list[int]) -> list[int]:
        seen.append(_REQUEST_ID.get())
        return items

    coalescer: Coalescer[int, int] = Coalescer(send)
    _REQUEST_ID.set("req-first")
    assert await coalescer.submit(1) == 1
    assert seen == [None]


# -- both stores ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", STORES)
async def test_fifty_concurrent_reservations_on_ten_calls_worth_admit_exactly_the_first_ten_in_few_round_trips(
    kind: str, make_store: Any, db_pool: asyncpg.Pool
) -> None:
    faults = Faults()
    store = await make_store(kind, faults)
    budget = key_budget(100)
    await seeded(kind, store, budget)
    calls = [Reservation(uuid.uuid4(), 10, (budget,)) for _ in range(50)]
    answers = await asyncio.gather(*(store.reserve(r, 60) for r in calls))
    admitted = [i for i, a in enumerate(answers) if a is None]
    assert admitted == list(range(10)), answers  # in arrival order, as one by one would
    assert answers[10:] == [0] * 40  # refused by the first (only) budget
    assert faults.round_trips <= 2, faults.round_trips  # 50 calls, one or two round trips
    assert store.batcher.items == 50
    assert await open_reservations(kind, store, db_pool, budget) == 100


@pytest.mark.parametrize("kind", STORES)
async def test_a_batch_over_shared_and_separate_budgets_answers_each_call_as_one_by_one(
    kind: str, make_store: Any, db_pool: asyncpg.Pool
) -> None:
    """Two keys of one subject, calls interleaved: each call needs both its key's budget
    and the subject's; which call is admitted, and which budget refuses the others, is
    exactly what sending them one after another gives."""
    faults = Faults(hold=asyncio.Event())
    store = await make_store(kind, faults)
    subject = subject_budget(200)
    small, large = key_budget(45), key_budget(1_000)
    calls = [(10 + 5 * (i % 3), (small if i % 2 else large, subject)) for i in range(24)]
    blocker = Reservation(uuid.uuid4(), 1, (key_budget(10),))  # holds the first round trip
    await seeded(kind, store, subject, small, large, *blocker.budgets)
    first = asyncio.ensure_future(store.reserve(blocker, 60))
    await asyncio.sleep(0.05)
    batch = [asyncio.ensure_future(store.reserve(Reservation(uuid.uuid4(), amount, budgets), 60))
             for amount, budgets in calls]
    await asyncio.sleep(0.05)
    faults.hold.set()
    assert await first is None
    answers = await asyncio.gather(*batch)
    assert answers == sequential_answers(calls)
    assert 0 in answers and 1 in answers and None in answers  # both budgets refused some
    assert faults.round_trips == 2  # the 24 calls went in one round trip
    expected = sum(a for (a, _), ans in zip(calls, answers, strict=True) if ans is None)
    assert await open_reservations(kind, store, db_pool, subject) == expected <= 200


@pytest.mark.parametrize("kind", STORES)
async def test_a_budget_whose_limit_changed_within_a_batch_is_still_one_budget(
    kind: str, make_store: Any, db_pool: asyncpg.Pool
) -> None:
    """Two calls of one batch hold the same budget to different limits (it was raised in
    between): the budget is counted once, each call against its own limit, as one by one."""
    import dataclasses

    faults = Faults(hold=asyncio.Event())
    store = await make_store(kind, faults)
    before = key_budget(100)
    raised = dataclasses.replace(before, limit_micro_usd=150)
    blocker = Reservation(uuid.uuid4(), 1, (key_budget(10),))
    await seeded(kind, store, before, *blocker.budgets)
    first = asyncio.ensure_future(store.reserve(blocker, 60))
    await asyncio.sleep(0.05)
    batch = [asyncio.ensure_future(store.reserve(Reservation(uuid.uuid4(), 80, (b,)), 60)) for b in (before, raised)]
    await asyncio.sleep(0.05)
    faults.hold.set()
    assert await first is None
    assert await asyncio.gather(*batch) == [None, 0]  # 80 <= 100; 80 + 80 > 150
    assert faults.round_trips == 2
    assert await open_reservations(kind, store, db_pool, before) == 80


@pytest.mark.parametrize("kind", STORES)
async def test_a_failed_round_trip_fails_every_call_it_carried_closed_with_503(
    kind: str, make_store: Any, db_pool: asyncpg.Pool
) -> None:
    faults = Faults(hold=asyncio.Event(), fail_on={2})
    store = await make_store(kind, faults)
    gate = BudgetGate(store, ttl=60, subject_budgets={})
    budget = (Decimal("1"), "total")
    price = [Price(0.0, 1.0)]  # 1 micro-USD per output token

    async def reserve() -> Any:
        return await gate.reserve(call_id=uuid.uuid4(), api_key_id=key_id, key_budget=budget, subject_id=uuid.uuid4(),
                                  model="m", prices=price, prompt_bound=0, output_cap=10)

    key_id = uuid.uuid4()
    (held,) = gate._budgets_of(key_id, budget, uuid.uuid4(), None)
    await seeded(kind, store, held)
    first = asyncio.ensure_future(reserve())
    await asyncio.sleep(0.05)
    batch = [asyncio.ensure_future(reserve()) for _ in range(9)]
    await asyncio.sleep(0.05)
    faults.hold.set()
    assert (await first) is not None  # admitted by the first round trip
    results = await asyncio.gather(*batch, return_exceptions=True)
    assert faults.round_trips == 2  # all nine were in the round trip that failed
    for result in results:
        assert isinstance(result, ServiceUnavailable), result
        assert result.status == 503 and result.error_code == "budget_unavailable"
    # Nothing of the failed batch holds the budget: only the first call's 10 micro-USD.
    for _ in range(50):
        if await open_reservations(kind, store, db_pool, held) == 10:
            break
        await asyncio.sleep(0.05)
    assert await open_reservations(kind, store, db_pool, held) == 10
    # And the store works again at once.
    assert await reserve() is not None


@pytest.mark.parametrize("kind", STORES)
async def test_a_reservation_whose_caller_stopped_waiting_is_released(
    kind: str, make_store: Any, db_pool: asyncpg.Pool
) -> None:
    """A call that gave up on its reservation (the gate's timeout, a client gone) is never
    sent, so what the store admitted for it meanwhile is released at once, not after the TTL."""
    faults = Faults(delay=0.2)
    store = await make_store(kind, faults)
    budget = key_budget(100)
    await seeded(kind, store, budget)
    gave_up = Reservation(uuid.uuid4(), 100, (budget,))
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(store.reserve(gave_up, 600), timeout=0.05)
    runner = store.batcher._runner
    assert runner is not None  # its round trip is still in flight
    await runner
    assert store._releases._tasks, "the admitted reservation was not handed over to be released"
    await store._releases.wait()
    assert await open_reservations(kind, store, db_pool, budget) == 0
    faults.delay = 0
    assert await store.reserve(Reservation(uuid.uuid4(), 100, (budget,)), 600) is None  # the whole budget fits


async def test_redis_settlements_go_together_and_release_exactly(make_store: Any, db_pool: asyncpg.Pool) -> None:
    faults = Faults()
    store = await make_store("redis", faults)
    budget = key_budget(1_000)
    calls = [Reservation(uuid.uuid4(), 100, (budget,)) for _ in range(10)]
    assert await asyncio.gather(*(store.reserve(r, 60) for r in calls)) == [None] * 10
    scripts_before = store._redis.scripts
    await asyncio.gather(*(store.settle(r, 7) for r in calls))  # each cost 7 of its 100
    assert store._redis.scripts - scripts_before <= 2  # ten settlements, one or two scripts
    assert store.settle_batcher.items == 10
    assert await open_reservations("redis", store, db_pool, budget) == 0
    assert int(await store._redis.hget(f"{store._prefix}:{budget.redis_name}", "spent")) == 70
    # 70 spent: 930 left, so nine more fit and a tenth does not.
    more = [Reservation(uuid.uuid4(), 100, (budget,)) for _ in range(10)]
    answers = await asyncio.gather(*(store.reserve(r, 60) for r in more))
    assert answers == [None] * 9 + [0]


async def test_postgresql_batches_and_single_reservations_of_an_older_replica_share_the_lock_and_rows(
    make_store: Any, db_pool: asyncpg.Pool
) -> None:
    """While replicas are upgraded one by one, an older one still calls budget_reserve()
    (sql/0010): it takes the same lock and writes the same rows, so both count each other."""
    store = await make_store("postgresql", Faults())
    budget = key_budget(100)
    refused = await db_pool.fetchval(
        "SELECT budget_reserve($1, $2, $3, $4, $5, $6, $7, $8)", uuid.uuid4(), [budget.scope], [budget.id],
        [budget.period], [budget.start], [budget.limit_micro_usd], 60, 60.0)
    assert refused == 0
    answers = await asyncio.gather(*(store.reserve(Reservation(uuid.uuid4(), 30, (budget,)), 60) for _ in range(2)))
    assert answers == [None, 0]  # 60 + 30 fits, 60 + 30 + 30 does not
    assert await db_pool.fetchval(
        "SELECT budget_reserve($1, $2, $3, $4, $5, $6, $7, $8)", uuid.uuid4(), [budget.scope], [budget.id],
        [budget.period], [budget.start], [budget.limit_micro_usd], 11, 60.0) == 1  # 90 + 11 > 100


async def test_postgresql_expired_reservations_stop_counting_and_a_locked_one_is_never_waited_for(
    make_store: Any, db_pool: asyncpg.Pool
) -> None:
    """An expired reservation no longer counts and is deleted by the next batch on its
    budget, except one another transaction holds (a ledger batch deleting it as it ships):
    the batch skips it rather than wait for that transaction to end."""
    store = await make_store("postgresql", Faults())
    budget = key_budget(100)
    stale, held = Reservation(uuid.uuid4(), 60, (budget,)), Reservation(uuid.uuid4(), 40, (budget,))
    assert await asyncio.gather(store.reserve(stale, 0.05), store.reserve(held, 0.05)) == [None, None]
    await asyncio.sleep(0.1)
    async with db_pool.acquire() as conn, conn.transaction():
        await conn.execute("SELECT 1 FROM budget_reservations WHERE reservation_id = $1 FOR UPDATE", held.reservation_id)
        whole = Reservation(uuid.uuid4(), 100, (budget,))
        assert await asyncio.wait_for(store.reserve(whole, 60), timeout=1.5) is None  # neither counts any more
    left = {r["reservation_id"] for r in await db_pool.fetch(
        "SELECT reservation_id FROM budget_reservations WHERE id = $1", budget.id)}
    assert left == {held.reservation_id, whole.reservation_id}  # the stale one deleted, the locked one skipped


# -- through a running gateway -------------------------------------------------------------
async def test_concurrent_budgeted_calls_during_a_redis_outage_are_all_refused_503_and_none_is_sent(
    gateway_factory: Any, fake: Any, key_factory: Any, redis_url: str, redis_proxy: Any
) -> None:
    from tests.conftest import auth, chat_body, redis_via
    from tests.test_billing_reservations import priced

    gw = await gateway_factory(env={"REDIS_URL": redis_via(redis_url, redis_proxy.port)}, config_yaml=priced(fake.url))
    key, _ = await key_factory(budget_usd=Decimal("10"), budget_period="day", rate_limit_requests=100_000)
    body = chat_body("hello there", max_tokens=1)

    async def call() -> tuple[int, Any]:
        resp = await gw.data.post("/v1/chat/completions", json=body, headers=auth(key))
        return resp.status, (await resp.json())["error"]["code"] if resp.status != 200 else None

    assert await call() == (200, None)
    before = (await fake.stats())["requests"]
    await redis_proxy.cut()
    answers = await asyncio.gather(*(call() for _ in range(20)))
    assert answers == [(503, "budget_unavailable")] * 20, answers
    assert (await fake.stats())["requests"] == before  # fail closed: nothing sent
    batcher = gw.state.billing._gate.store.batcher
    assert batcher.round_trips < batcher.items  # the twenty shared round trips


async def test_a_round_trip_without_an_answer_in_time_fails_its_calls_with_a_timeout_that_says_so() -> None:
    lost: list[tuple[int, int | None]] = []

    async def send(items: list[int]) -> list[int]:
        await asyncio.sleep(10)
        return items

    coalescer: Coalescer[int, int] = Coalescer(send, timeout=0.05, lost=lost.extend, name="test store")
    results = await asyncio.gather(coalescer.submit(1), coalescer.submit(2), return_exceptions=True)
    assert all(isinstance(r, TimeoutError) and "no answer from the test store within 0.05 s" in str(r)
               for r in results), results
    assert lost == [(1, None), (2, None)]  # perhaps admitted: released


#: The reserve script of the version before batching (one call per script), kept verbatim:
#: replicas of that version share Redis with batching ones during a rolling upgrade.
PREVIOUS_RESERVE_LUA = """
local n = #KEYS / 2
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local id, amount, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
for i = 1, n do
  local h, z = KEYS[2 * i - 1], KEYS[2 * i]
  local spent = redis.call('HGET', h, 'spent')
  if not spent then return {-1, i} end
  local expired = redis.call('ZRANGEBYSCORE', z, '-inf', now)
  for _, r in ipairs(expired) do redis.call('HDEL', h, 'r:' .. r) end
  if #expired > 0 then redis.call('ZREMRANGEBYSCORE', z, '-inf', now) end
  local used = tonumber(spent)
  local all = redis.call('HGETALL', h)
  for j = 1, #all, 2 do
    if string.sub(all[j], 1, 2) == 'r:' then used = used + tonumber(all[j + 1]) end
  end
  if used + amount > tonumber(ARGV[3 + n + i]) then return {0, i} end
end
for i = 1, n do
  local h, z = KEYS[2 * i - 1], KEYS[2 * i]
  redis.call('HSET', h, 'r:' .. id, amount)
  redis.call('ZADD', z, now + ttl, id)
  local keep = tonumber(ARGV[3 + i])
  if keep > 0 then redis.call('EXPIRE', h, keep); redis.call('EXPIRE', z, keep) end
end
return {1}
"""


async def test_redis_batches_and_an_older_replicas_one_call_script_count_each_other(
    make_store: Any, db_pool: asyncpg.Pool
) -> None:
    store = await make_store("redis", Faults())
    budget = key_budget(100)
    await seeded("redis", store, budget)
    older = store._redis.register_script(PREVIOUS_RESERVE_LUA)
    keys = [f"{store._prefix}:{budget.redis_name}", f"{store._prefix}:{budget.redis_name}:exp"]

    async def older_reserve(amount: int) -> list[int]:
        args = [str(uuid.uuid4()), amount, 60_000, 0, budget.limit_micro_usd]
        return [int(x) for x in await older(keys=keys, args=args)]

    assert await older_reserve(60) == [1]
    answers = await asyncio.gather(*(store.reserve(Reservation(uuid.uuid4(), 30, (budget,)), 60) for _ in range(2)))
    assert answers == [None, 0]  # 60 + 30 fits, 60 + 30 + 30 does not
    assert await older_reserve(11) == [0, 1]  # 90 + 11 > 100
