"""Budgets before the call: per key and per subject, by period, and no overshoot.

A call reserves its worst case (RESERVE) before it is sent and is charged its real cost
(COST) when it ends; each helper call below waits for the ledger, which settles it."""

from __future__ import annotations

import asyncio
import time
import uuid
from decimal import Decimal
from typing import Any

import asyncpg
import pytest

from gateway.billing.budgets import SubjectBudgetStore
from gateway.billing.ledger import UsageEvent, ship_lines
from gateway.billing.reservations import prompt_token_bound
from gateway.testing import fake_llm
from tests.conftest import FakeUpstream, Gateway, auth, chat_body, config_for

PRICE = {"input_per_mtok": 1000.0, "output_per_mtok": 3000.0}
#: Asks for at most the fake's answer length, so the worst case is known.
BODY = chat_body("hello there", max_tokens=fake_llm.completion_tokens(chat_body("hello there")))
#: What BODY costs at PRICE: its tokens are the fake's deterministic counts.
COST = (fake_llm.prompt_tokens(BODY["messages"]) * 1000 + fake_llm.completion_tokens(BODY) * 3000) / 1e6
#: What BODY reserves: its JSON's bytes bound the prompt tokens, plus max_tokens of output.
RESERVE = (prompt_token_bound(BODY) * 1000 + BODY["max_tokens"] * 3000) / 1e6


async def start(gateway_factory: Any, fake: FakeUpstream) -> Gateway:
    yaml = config_for(fake.url, models=[{"name": "*", "deployments": [{"provider": "fake", "model": "*", "price": PRICE}]}])
    return await gateway_factory(config_yaml=yaml)  # type: ignore[no-any-return]


async def post(gw: Gateway, key: str, *, settle: bool = True) -> int:
    resp = await gw.data.post("/v1/chat/completions", json=BODY, headers=auth(key))
    await resp.read()
    if settle:  # the call's ledger row settles its reservation to its real cost
        assert await gw.state.billing.flush()
    return resp.status


async def past_spend(pool: asyncpg.Pool, key_id: uuid.UUID, subject: uuid.UUID, usd: float, days_ago: float) -> None:
    """A call in the ledger as if made ``days_ago`` days ago."""
    event = UsageEvent(
        call_id=uuid.uuid4(), request_id="old", response_id=None, api_key_id=key_id, subject_id=subject,
        requested_model="m", served_model="m", provider="fake", deployment="fake/*", prompt_tokens=1,
        completion_tokens=1, usage_estimated=False, cost_usd=usd, cost_diem=None, cost_source="price",
        latency_seconds=0.1, ttft_seconds=None, status=200, outcome="ok", streamed=False, retries=0,
        failovers=0, error_type=None, finish_reason="stop", created_at=time.time() - days_ago * 86400,
    )
    await ship_lines(pool, [event.to_line()])


async def test_key_budget_spent_answers_402_before_the_provider_is_called(
    gateway_factory: Any, fake: FakeUpstream, key_factory: Any
) -> None:
    gw = await start(gateway_factory, fake)
    raw, _ = await key_factory(budget_usd=Decimal(f"{RESERVE + COST * 2.5:.6f}"), budget_period="month")
    assert [await post(gw, raw) for _ in range(3)] == [200, 200, 200]  # 0, 1c, 2c spent: a reserve fits
    calls = (await fake.stats())["requests"]
    resp = await gw.data.post("/v1/chat/completions", json=BODY, headers=auth(raw))
    assert resp.status == 402
    body = await resp.json()
    assert body["error"]["type"] == "insufficient_quota" and body["error"]["code"] == "budget_exceeded"
    assert "per month" in body["error"]["message"]
    assert (await fake.stats())["requests"] == calls


async def test_no_budget_never_blocks_and_a_zero_budget_always_does(
    gateway_factory: Any, fake: FakeUpstream, key_factory: Any, db_pool: asyncpg.Pool
) -> None:
    free, free_record = await key_factory()
    await past_spend(db_pool, free_record.api_key_id, free_record.subject_id, 1000.0, 0)
    zero, _ = await key_factory(budget_usd=Decimal("0"), budget_period="total")
    gw = await start(gateway_factory, fake)
    assert await post(gw, free) == 200
    assert await post(gw, zero) == 402


async def test_budget_periods_count_only_their_own_spend(
    gateway_factory: Any, fake: FakeUpstream, key_factory: Any, db_pool: asyncpg.Pool
) -> None:
    daily, d = await key_factory(budget_usd=Decimal("1"), budget_period="day")
    monthly, m = await key_factory(budget_usd=Decimal("1"), budget_period="month")
    total, t = await key_factory(budget_usd=Decimal("1"), budget_period="total")
    for record in (d, m, t):
        await past_spend(db_pool, record.api_key_id, record.subject_id, 5.0, days_ago=40)  # last month or older
    await past_spend(db_pool, d.api_key_id, d.subject_id, 5.0, days_ago=1.01)  # yesterday
    gw = await start(gateway_factory, fake)
    assert await post(gw, daily) == 200  # yesterday's spend is not today's
    assert await post(gw, monthly) == 200  # 40 days ago is never this month
    assert await post(gw, total) == 402  # but it is all time


async def test_subject_budget_covers_all_its_keys(
    gateway_factory: Any, fake: FakeUpstream, key_factory: Any, db_pool: asyncpg.Pool
) -> None:
    subject = uuid.uuid4()
    first, _ = await key_factory(subject_id=subject)
    second, _ = await key_factory(subject_id=subject)
    other, _ = await key_factory()
    await SubjectBudgetStore(db_pool).set(subject, Decimal(f"{RESERVE + COST * 1.5:.6f}"), "day")
    gw = await start(gateway_factory, fake)
    assert await post(gw, first) == 200
    assert await post(gw, second) == 200  # 1c spent + a reserve fits
    assert await post(gw, first) == 402
    resp = await gw.data.post("/v1/chat/completions", json=BODY, headers=auth(second))
    assert resp.status == 402 and "subject" in (await resp.json())["error"]["message"]
    assert await post(gw, other) == 200  # another subject is not affected
    report = await gw.state.billing.spend(subject_id=subject)
    assert report.subject_budget_period == "day" and report.subject_spent_usd == pytest.approx(COST * 2)


async def test_fifty_clients_until_refused_never_spend_past_the_budget(
    gateway_factory: Any, fake_factory: Any, key_factory: Any, db_pool: asyncpg.Pool
) -> None:
    """50 clients hammer one key until it is refused: what the ledger charged stays within
    the budget (it used to overshoot by what was in flight), and every client is refused."""
    fake = await fake_factory(latency_ms=30)
    gw = await start(gateway_factory, fake)
    budget = RESERVE * 10
    raw, record = await key_factory(budget_usd=Decimal(f"{budget:.6f}"), budget_period="day", rate_limit_requests=100_000)

    async def client() -> int:
        for served in range(100):  # bounded; ends at the first 402
            status = await post(gw, raw, settle=False)
            if status == 402:
                return served
            assert status == 200
        raise AssertionError("never refused")

    served = sum(await asyncio.gather(*(client() for _ in range(50))))
    assert await gw.state.billing.flush()
    spent = Decimal(await db_pool.fetchval("SELECT sum(cost_usd) FROM usage_ledger WHERE api_key_id = $1", record.api_key_id))
    print(f"\nbudget {budget:.6f} USD, spent {spent:.6f} USD over {served} calls")
    assert served >= 10  # ten reservations always fit
    assert spent <= Decimal(f"{budget:.6f}")
