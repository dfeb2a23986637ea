"""Budgets across replicas: two gateway processes share every reservation, through Redis
or through PostgreSQL alone, and a replica killed with reservations open lets go of them
after BUDGET_RESERVATION_TTL_SECONDS."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from decimal import Decimal
from typing import Any

import aiohttp
import asyncpg
import pytest

from tests.conftest import FakeUpstream, GatewayProcess, auth, chat_body, config_for

#: 0.1 USD per output token, input free: a one-token call reserves and costs 0.1 USD.
TENTH_PER_TOKEN = {"input_per_mtok": 0.0, "output_per_mtok": 100_000.0}
ONE_WORD = chat_body("hello there", max_tokens=1)
TTL_SECONDS = 2


async def replicas(process_factory: Any, fake: FakeUpstream, store: str, redis_url: str,
                   price: dict[str, float] = TENTH_PER_TOKEN, **extra_env: str) -> list[GatewayProcess]:
    config = config_for(
        fake.url, rate_limits={"key_prefix": f"budgets-{uuid.uuid4().hex[:8]}"},
        models=[{"name": "*", "deployments": [{"provider": "fake", "model": "*", "price": price}]}],
    )
    env = {"BUDGET_RESERVATION_TTL_SECONDS": str(TTL_SECONDS), **extra_env}
    if store == "redis":
        env["REDIS_URL"] = redis_url
    return [await process_factory(env=env, config_yaml=config) for _ in range(2)]


async def call(session: aiohttp.ClientSession, replica: GatewayProcess, key: str, body: dict[str, Any] = ONE_WORD) -> int:
    async with session.post(f"{replica.url}/v1/chat/completions", json=body, headers=auth(key)) as resp:
        await resp.read()
        return resp.status


async def ledger_spend_once_shipped(pool: asyncpg.Pool, key_id: uuid.UUID, rows: int) -> Decimal:
    """The key's ledger spend once both replicas have shipped its ``rows`` rows (10 s at most)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if await pool.fetchval("SELECT count(*) FROM usage_ledger WHERE api_key_id = $1", key_id) == rows:
            break
        await asyncio.sleep(0.1)
    return Decimal(await pool.fetchval("SELECT coalesce(sum(cost_usd), 0) FROM usage_ledger WHERE api_key_id = $1",
                                       key_id))


async def kill_mid_stream(session: aiohttp.ClientSession, victim: GatewayProcess, key: str, body: dict[str, Any]) -> float:
    """Start a stream on ``victim``, SIGKILL it once the stream is under way; when it died."""
    resp = await session.post(f"{victim.url}/v1/chat/completions", json=body, headers=auth(key))
    assert resp.status == 200
    await resp.content.readline()  # under way: what it holds is open
    victim.signal(signal.SIGKILL)
    victim.wait(10)
    resp.close()
    return time.monotonic()


async def admitted_again(session: aiohttp.ClientSession, survivor: GatewayProcess, key: str, body: dict[str, Any],
                         *, since: float, what: str) -> None:
    """Calls on ``survivor`` are refused (402) until the dead replica's hold expires, then admitted."""
    while time.monotonic() - since < TTL_SECONDS + 8:
        status = await call(session, survivor, key, body)
        if status == 200:
            return
        assert status == 402
        await asyncio.sleep(0.2)
    raise AssertionError(f"the killed replica's {what} never expired")


@pytest.mark.parametrize("store", ["redis", "postgresql"])
async def test_fifty_calls_split_over_two_replicas_admit_at_most_ten(
    store: str, process_factory: Any, fake_factory: Any, key_factory: Any, db_pool: asyncpg.Pool, redis_url: str
) -> None:
    fake = await fake_factory(latency_ms=300)
    pair = await replicas(process_factory, fake, store, redis_url)
    raw, record = await key_factory(budget_usd=Decimal("1"), budget_period="day", rate_limit_requests=100_000)
    async with aiohttp.ClientSession() as session:
        statuses = await asyncio.gather(*(call(session, pair[i % 2], raw) for i in range(50)))
    assert statuses.count(200) == 10 and statuses.count(402) == 40, statuses
    assert (await fake.stats())["requests"] == 10
    spent = await ledger_spend_once_shipped(db_pool, record.api_key_id, 10)
    assert spent == Decimal("1")


@pytest.mark.parametrize("store", ["postgresql", "redis"])
async def test_a_killed_replicas_reservations_expire_and_the_budget_is_usable_again(
    store: str, process_factory: Any, fake_factory: Any, key_factory: Any, redis_url: str
) -> None:
    fake = await fake_factory(chunk_delay_ms=1000)
    # 100 output tokens at 0.001 USD: 0.1 USD reserved, on a budget that holds one such call.
    pair = await replicas(process_factory, fake, store, redis_url, {"input_per_mtok": 0.0, "output_per_mtok": 1000.0})
    raw, _ = await key_factory(budget_usd=Decimal("0.15"), budget_period="day")
    big = chat_body("hello there", max_tokens=100, stream=True)
    victim, survivor = pair
    async with aiohttp.ClientSession() as session:
        killed_at = await kill_mid_stream(session, victim, raw, big)  # its reservation open
        assert await call(session, survivor, raw, big) == 402  # the dead call still holds it
        await admitted_again(session, survivor, raw, big, since=killed_at, what="reservation")


@pytest.mark.parametrize("store", ["postgresql", "redis"])
async def test_leases_on_two_replicas_never_overspend_and_leave_at_most_their_unused_share(
    store: str, process_factory: Any, fake_factory: Any, key_factory: Any, db_pool: asyncpg.Pool, redis_url: str
) -> None:
    """6 USD of 0.1 USD calls (60 calls' worth), leases of a quarter (15 calls) on each
    replica, 100 calls in flight together: at most 60 admitted, whatever the split; fewer
    only by what a lease never used, at most one lease per replica."""
    fake = await fake_factory(latency_ms=300)
    pair = await replicas(process_factory, fake, store, redis_url, BUDGET_LEASE_FRACTION="0.25")
    raw, record = await key_factory(budget_usd=Decimal("6"), budget_period="day", rate_limit_requests=100_000)
    async with aiohttp.ClientSession() as session:
        statuses = await asyncio.gather(*(call(session, pair[i % 2], raw) for i in range(100)))
    admitted = statuses.count(200)
    assert admitted + statuses.count(402) == 100, statuses
    assert 60 - 2 * 15 <= admitted <= 60, statuses
    assert (await fake.stats())["requests"] == admitted
    spent = await ledger_spend_once_shipped(db_pool, record.api_key_id, admitted)
    assert spent == Decimal("0.1") * admitted <= Decimal("6")


async def test_a_killed_replicas_lease_expires_and_the_budget_is_usable_again(
    process_factory: Any, fake_factory: Any, key_factory: Any
) -> None:
    fake = await fake_factory(chunk_delay_ms=1000)
    # A lease of half the budget: after the victim's lease and the call it holds, what is
    # left does not fit a lease of the survivor's own, nor (with the dead lease) much more.
    pair = await replicas(process_factory, fake, "postgresql", "", BUDGET_LEASE_FRACTION="0.5")
    raw, _ = await key_factory(budget_usd=Decimal("1.6"), budget_period="day")
    big = chat_body("hello there", max_tokens=1, stream=True)
    victim, survivor = pair
    async with aiohttp.ClientSession() as session:
        killed_at = await kill_mid_stream(session, victim, raw, big)  # admitted from its lease of 0.8 USD
        # The survivor's own lease (0.8 USD) fits beside the dead one: eight calls, then refused.
        assert [await call(session, survivor, raw) for _ in range(9)] == [200] * 8 + [402]
        await admitted_again(session, survivor, raw, ONE_WORD, since=killed_at, what="lease")
