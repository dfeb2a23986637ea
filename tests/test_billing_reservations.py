"""Budgets hold exactly: a call's worst case is reserved before it is sent, in a store every
replica shares (PostgreSQL, or Redis with REDIS_URL), and released at its real cost.

Prices here charge output only, so a call asking for ``max_tokens`` N reserves exactly
what it costs when the fake answers N words: 0.1 USD a call below.
"""

from __future__ import annotations

import asyncio
import uuid
from decimal import Decimal
from typing import Any

import aiohttp
import asyncpg
import pytest

from gateway.billing.budgets import SubjectBudgetStore
from gateway.billing.reservations import (
    Budget,
    PostgresReservations,
    Reservation,
    connect_reservation_pool,
    cost_micro_usd,
    micro_usd,
    period_start,
    prompt_token_bound,
    worst_case_micro_usd,
)
from gateway.core.config import Price
from tests.conftest import FakeUpstream, Gateway, auth, chat_body, config_for, redis_via, via_proxy

#: 0.1 USD per output token: one word of answer costs exactly 0.1 USD.
TENTH_PER_TOKEN = {"input_per_mtok": 0.0, "output_per_mtok": 100_000.0}
ONE_WORD = chat_body("hello there", max_tokens=1)


def priced(fake_url: str, price: dict[str, float] | None = TENTH_PER_TOKEN, **extra: Any) -> str:
    deployment: dict[str, Any] = {"provider": "fake", "model": "*"}
    if price is not None:
        deployment["price"] = price
    return config_for(fake_url, models=[{"name": "*", "deployments": [deployment]}], **extra)


async def call(gw: Gateway, key: str, body: dict[str, Any] = ONE_WORD) -> int:
    resp = await gw.data.post("/v1/chat/completions", json=body, headers=auth(key))
    await resp.read()
    return resp.status


async def ledger_spend(pool: asyncpg.Pool, key_id: uuid.UUID) -> Decimal:
    return Decimal(await pool.fetchval(
        "SELECT coalesce(sum(cost_usd), 0) FROM usage_ledger WHERE api_key_id = $1", key_id))


# -- pure arithmetic ----------------------------------------------------------------------
def test_money_is_exact_micro_usd() -> None:
    assert sum(micro_usd(0.1) for _ in range(10)) == micro_usd(1) == 1_000_000
    assert micro_usd(Decimal("0.0000185")) == 19  # rounded up: never undercounted
    assert cost_micro_usd(3, 7, Price(0.15, 0.6)) == 5  # 0.45 + 4.2 micro-USD, rounded up
    # The worst case takes the dearest deployment the call may reach.
    assert worst_case_micro_usd(10, 100, [Price(1, 2), Price(3, 1)]) == 210  # 10 + 200 vs 30 + 100
    body = chat_body("héllo")
    assert prompt_token_bound(body) == len(__import__("orjson").dumps(body))


# -- one gateway ----------------------------------------------------------------------------
@pytest.mark.parametrize("store", ["postgresql", "redis"])
async def test_ten_sequential_tenth_dollar_calls_on_one_dollar_admit_exactly_ten(
    store: str, gateway_factory: Any, fake: FakeUpstream, key_factory: Any, db_pool: asyncpg.Pool, redis_url: str
) -> None:
    env = {"REDIS_URL": redis_url} if store == "redis" else {}
    gw = await gateway_factory(env=env, config_yaml=priced(fake.url))
    raw, record = await key_factory(budget_usd=Decimal("1"), budget_period="day")
    assert [await call(gw, raw) for _ in range(11)] == [200] * 10 + [402]
    assert await gw.state.billing.flush()
    assert await ledger_spend(db_pool, record.api_key_id) == Decimal("1")


@pytest.mark.parametrize("store", ["postgresql", "redis"])
async def test_fifty_concurrent_calls_on_ten_calls_worth_admit_at_most_ten(
    store: str, gateway_factory: Any, fake_factory: Any, key_factory: Any, db_pool: asyncpg.Pool, redis_url: str
) -> None:
    fake = await fake_factory(latency_ms=200)  # all 50 are in flight together
    env = {"REDIS_URL": redis_url} if store == "redis" else {}
    gw = await gateway_factory(env=env, config_yaml=priced(fake.url))
    raw, record = await key_factory(budget_usd=Decimal("1"), budget_period="day", rate_limit_requests=100_000)
    statuses = await asyncio.gather(*(call(gw, raw) for _ in range(50)))
    assert statuses.count(200) == 10 and statuses.count(402) == 40, statuses
    assert (await fake.stats())["requests"] == 10  # a refused call sends nothing
    assert await gw.state.billing.flush()
    assert await ledger_spend(db_pool, record.api_key_id) <= Decimal("1")


async def test_the_groups_max_output_tokens_is_what_a_call_without_max_tokens_reserves(
    gateway_factory: Any, fake: FakeUpstream, key_factory: Any
) -> None:
    raw, _ = await key_factory(budget_usd=Decimal("1"), budget_period="day")
    no_cap = chat_body("hello there")  # the fake answers 6 words: 0.6 USD at this price
    capped = await gateway_factory(config_yaml=config_for(fake.url, models=[{
        "name": "*", "max_output_tokens": 8, "deployments": [{"provider": "fake", "model": "*", "price": TENTH_PER_TOKEN}]}]))
    assert await call(capped, raw, no_cap) == 200  # 8 tokens reserved: 0.8 USD fits
    assert await capped.state.billing.flush()  # 0.6 USD spent: another 0.8 does not fit
    assert await call(capped, raw, no_cap) == 402
    default = await gateway_factory(config_yaml=priced(fake.url))
    other, _ = await key_factory(budget_usd=Decimal("1"), budget_period="day")
    resp = await default.data.post("/v1/chat/completions", json=no_cap, headers=auth(other))
    assert resp.status == 402 and "4096 output tokens" in (await resp.json())["error"]["message"]


async def test_a_subject_budget_is_reserved_across_its_keys(
    gateway_factory: Any, fake_factory: Any, key_factory: Any, db_pool: asyncpg.Pool
) -> None:
    fake = await fake_factory(latency_ms=200)
    subject = uuid.uuid4()
    keys = [(await key_factory(subject_id=subject, rate_limit_requests=100_000))[0] for _ in range(2)]
    await SubjectBudgetStore(db_pool).set(subject, Decimal("0.5"), "month")
    gw = await gateway_factory(config_yaml=priced(fake.url))
    statuses = await asyncio.gather(*(call(gw, keys[i % 2]) for i in range(20)))
    assert statuses.count(200) == 5 and statuses.count(402) == 15, statuses


@pytest.mark.parametrize("store", ["postgresql", "redis"])
async def test_a_cancelled_streams_reservation_is_released_so_a_later_call_fits(
    store: str, gateway_factory: Any, fake_factory: Any, key_factory: Any, redis_url: str
) -> None:
    fake = await fake_factory(chunk_delay_ms=400)
    # Reserve 100 tokens' worth (0.1 USD) of a budget that holds one such reservation.
    env = {"REDIS_URL": redis_url} if store == "redis" else {}
    gw = await gateway_factory(env=env, config_yaml=priced(fake.url, {"input_per_mtok": 0.0, "output_per_mtok": 1000.0}))
    raw, _ = await key_factory(budget_usd=Decimal("0.15"), budget_period="day")
    big = chat_body("hello there", max_tokens=100, stream=True)
    async with aiohttp.ClientSession() as session:
        resp = await session.post(gw.url("/v1/chat/completions"), json=big, headers=auth(raw))
        assert resp.status == 200
        await resp.content.readline()  # the stream is under way, its reservation held
        assert await call(gw, raw, big) == 402  # 0.1 held + 0.1 > 0.15
        resp.close()  # the client hangs up mid-stream
    for _ in range(50):  # released once the cancelled call's ledger row lands
        if await call(gw, raw, big) == 200:
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("the cancelled stream's reservation was never released")


async def test_embeddings_leave_ledger_rows_and_are_held_to_budgets(
    gateway_factory: Any, fake: FakeUpstream, key_factory: Any, db_pool: asyncpg.Pool
) -> None:
    gw = await gateway_factory(config_yaml=priced(fake.url, {"input_per_mtok": 1000.0, "output_per_mtok": 0.0}))
    raw, record = await key_factory(budget_usd=Decimal("5"), budget_period="day")
    body = {"model": "emb", "input": ["hello world", "bye"]}
    resp = await gw.data.post("/v1/embeddings", json=body, headers=auth(raw))
    answer = await resp.json()
    assert resp.status == 200, answer
    assert await gw.state.billing.flush()
    row = await db_pool.fetchrow("SELECT * FROM usage_ledger WHERE api_key_id = $1", record.api_key_id)
    tokens = answer["usage"]["prompt_tokens"]
    assert tokens > 0 and row["prompt_tokens"] == tokens and row["completion_tokens"] == 0
    assert row["cost_source"] == "price" and row["cost_usd"] == Decimal(tokens * 1000) / 1_000_000
    assert row["requested_model"] == "emb" and row["status"] == 200
    # A budget too small for the input's worst case refuses the call before it is sent.
    tiny, _ = await key_factory(budget_usd=Decimal("0.000001"), budget_period="day")
    before = (await fake.stats())["requests"]
    resp = await gw.data.post("/v1/embeddings", json=body, headers=auth(tiny))
    assert resp.status == 402 and (await resp.json())["error"]["code"] == "budget_exceeded"
    assert (await fake.stats())["requests"] == before


async def test_an_unpriced_deployment_under_a_budget_is_refused_with_the_reason(
    gateway_factory: Any, fake: FakeUpstream, key_factory: Any
) -> None:
    gw = await gateway_factory(config_yaml=priced(fake.url, None))
    budgeted, _ = await key_factory(budget_usd=Decimal("100"), budget_period="month")
    free, _ = await key_factory()
    resp = await gw.data.post("/v1/chat/completions", json=ONE_WORD, headers=auth(budgeted))
    error = (await resp.json())["error"]
    assert resp.status == 402 and error["code"] == "budget_exceeded"
    assert "no price" in error["message"]
    assert (await fake.stats())["requests"] == 0
    assert await call(gw, free) == 200  # no budget: never asked about prices


async def test_start_up_names_unpriced_deployments_when_budgets_exist(
    gateway_factory: Any, fake: FakeUpstream, key_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    await key_factory(budget_usd=Decimal("1"), budget_period="day")
    await gateway_factory(config_yaml=priced(fake.url, None))
    lines = [r.getMessage() for r in caplog.records if r.levelname == "ERROR" and "no price" in r.getMessage()]
    assert lines and "* -> fake/*" in lines[0], lines


async def test_redis_outage_fails_budgeted_calls_closed_and_recovers(
    gateway_factory: Any, fake: FakeUpstream, key_factory: Any, redis_url: str, redis_proxy: Any
) -> None:
    gw = await gateway_factory(env={"REDIS_URL": redis_via(redis_url, redis_proxy.port)}, config_yaml=priced(fake.url))
    budgeted, _ = await key_factory(budget_usd=Decimal("10"), budget_period="day")
    free, _ = await key_factory()
    assert await call(gw, budgeted) == 200
    await redis_proxy.cut()
    resp = await gw.data.post("/v1/chat/completions", json=ONE_WORD, headers=auth(budgeted))
    error = (await resp.json())["error"]
    assert resp.status == 503 and error["code"] == "budget_unavailable", error
    assert resp.headers.get("Retry-After") == "1"
    assert await call(gw, free) == 200  # keys without a budget never wait on the store
    await redis_proxy.restore()
    for _ in range(30):
        if await call(gw, budgeted) == 200:
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("budgeted calls never recovered after Redis came back")


async def test_postgresql_outage_fails_budgeted_calls_closed_and_recovers(
    gateway_factory: Any, fake: FakeUpstream, key_factory: Any, database_url: str, pg_proxy: Any
) -> None:
    """No REDIS_URL: reservations live in PostgreSQL, so while it is away a budgeted call
    is refused 503 (never admitted blind); a key without a budget keeps working."""
    gw = await gateway_factory(env={"DATABASE_URL": via_proxy(database_url, pg_proxy.port)}, config_yaml=priced(fake.url))
    budgeted, _ = await key_factory(budget_usd=Decimal("10"), budget_period="day")
    free, _ = await key_factory()
    assert await call(gw, budgeted) == 200 and await call(gw, free) == 200  # both keys verified and cached
    await pg_proxy.cut()
    resp = await gw.data.post("/v1/chat/completions", json=ONE_WORD, headers=auth(budgeted))
    error = (await resp.json())["error"]
    assert resp.status == 503 and error["code"] == "budget_unavailable", error
    before = (await fake.stats())["requests"]
    assert await call(gw, free) == 200
    assert (await fake.stats())["requests"] == before + 1  # the refused call sent nothing
    await pg_proxy.restore()
    for _ in range(50):
        if await call(gw, budgeted) == 200:
            break
        await asyncio.sleep(0.2)
    else:
        raise AssertionError("budgeted calls never recovered after PostgreSQL came back")


async def test_the_reservation_pool_costs_one_round_trip_per_call(database_url: str, db_pool: asyncpg.Pool) -> None:
    """Reservations run on a pool that skips asyncpg's reset query on release (it would be a
    second round trip per budgeted call): session state survives a release, proving no
    reset was sent, and the store still admits and refuses exactly."""
    pool = await connect_reservation_pool(database_url, max_size=1)
    store = PostgresReservations(db_pool, own_pool=pool)
    try:
        async with pool.acquire() as conn:
            await conn.execute("SET application_name = 'kept'")
        async with pool.acquire() as conn:  # max_size 1: the same connection
            assert await conn.fetchval("SHOW application_name") == "kept"
        budget = Budget("key", uuid.uuid4(), "total", period_start("total"), limit_micro_usd=100)
        fits, too_much = Reservation(uuid.uuid4(), 60, (budget,)), Reservation(uuid.uuid4(), 60, (budget,))
        assert await store.reserve(fits, ttl=60) is None
        assert await store.reserve(too_much, ttl=60) == 0  # 120 > 100: the first budget refuses
        assert await db_pool.fetchval(
            "SELECT count(*) FROM budget_reservations WHERE reservation_id = $1", fits.reservation_id) == 1
    finally:
        await store.close()
    assert pool.is_closing()


def test_the_gate_remembers_budgets_only_while_their_inputs_and_day_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """Budgets are remembered per key, budget and UTC day: a changed budget or a new day
    gives new budgets (a day budget's period starts on the new day)."""
    from gateway.billing import gate as gate_module
    from gateway.billing.gate import BudgetGate

    gate = BudgetGate(None, ttl=60, subject_budgets={})  # type: ignore[arg-type]  # no store needed
    key, subject = uuid.uuid4(), uuid.uuid4()
    clock = [1_767_225_599.0]  # 2025-12-31T23:59:59Z
    monkeypatch.setattr(gate_module.time, "time", lambda: clock[0])
    (first,) = gate._budgets_of(key, (Decimal("5"), "day"), subject, None)
    assert first.start.isoformat() == "2025-12-31" and first.limit_micro_usd == 5_000_000
    (raised,) = gate._budgets_of(key, (Decimal("7"), "day"), subject, None)
    assert raised.limit_micro_usd == 7_000_000
    clock[0] += 2  # past midnight UTC
    (next_day,) = gate._budgets_of(key, (Decimal("5"), "day"), subject, None)
    assert next_day.start.isoformat() == "2026-01-01"
