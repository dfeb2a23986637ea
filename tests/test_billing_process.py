"""Billing across real ``llm-gateway serve`` processes: outages, SIGKILL, SIGTERM, replicas.

Every request carries its own x-request-id, so the ledger can be checked for "exactly
once" per request the client saw answered.
"""

from __future__ import annotations

import asyncio
import signal
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg

from gateway.billing.reservations import prompt_token_bound
from gateway.testing import fake_llm
from tests.conftest import FakeUpstream, auth, chat_body, config_for, until, via_proxy

PRICED = {"input_per_mtok": 1000.0, "output_per_mtok": 3000.0}


def priced_yaml(fake_url: str) -> str:
    return config_for(fake_url, models=[{"name": "*", "deployments": [{"provider": "fake", "model": "*", "price": PRICED}]}])


async def send(session: aiohttp.ClientSession, url: str, key: str, *, stream: bool = False) -> tuple[str, int]:
    """One chat call read to the end; returns its request id and status (0: no answer)."""
    request_id = f"p-{uuid.uuid4().hex[:16]}"
    try:
        async with session.post(
            f"{url}/v1/chat/completions", json=chat_body("bill me", stream=stream),
            headers={**auth(key), "x-request-id": request_id},
        ) as resp:
            await resp.read()
            return request_id, resp.status
    except (TimeoutError, aiohttp.ClientError):
        return request_id, 0


async def ledger_counts(pool: asyncpg.Pool, ids: list[str]) -> dict[str, int]:
    rows = await pool.fetch(
        "SELECT request_id, count(*) AS n FROM usage_ledger WHERE request_id = ANY($1) GROUP BY 1", ids
    )
    return {r["request_id"]: r["n"] for r in rows}


async def wait_for_rows(pool: asyncpg.Pool, ids: list[str], deadline: float = 20.0) -> dict[str, int]:
    """Poll the ledger until every id is there (bounded), then return the counts."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline
    counts: dict[str, int] = {}
    while loop.time() < end:
        counts = await ledger_counts(pool, ids)
        if len(counts) == len(ids):
            break
        await asyncio.sleep(0.1)
    return counts


def segments(root: Path) -> list[Path]:
    return list(root.rglob("segment-*.jsonl"))


async def test_postgres_cut_during_traffic_then_restored_every_event_once(
    process_factory: Any, fake: FakeUpstream, api_key: str, database_url: str, pg_proxy: Any,
    db_pool: asyncpg.Pool,
) -> None:
    gw = await process_factory(env={"DATABASE_URL": via_proxy(database_url, pg_proxy.port)}, config_yaml=priced_yaml(fake.url))
    async with aiohttp.ClientSession() as session:
        answered: list[str] = []
        for stream in (False, True):  # the key is cached from here on
            rid, status = await send(session, gw.url, api_key, stream=stream)
            assert status == 200
            answered.append(rid)

        warmed_up = asyncio.Event()

        async def traffic(n: int) -> None:
            for i in range(n):
                rid, status = await send(session, gw.url, api_key, stream=i % 2 == 1)
                assert status == 200, status
                answered.append(rid)
                if i == 10:
                    warmed_up.set()
                    await asyncio.sleep(0.05)

        worker = asyncio.ensure_future(traffic(60))
        await warmed_up.wait()
        await pg_proxy.cut()  # PostgreSQL "goes down" mid-traffic
        await worker
        assert len(answered) == 62
        before = await ledger_counts(db_pool, answered)
        assert len(before) < len(answered)  # some events really waited for the ledger
        # The outage lasts until a ship has run into it: traffic that ends within one ship
        # interval of the cut would otherwise restore the database before any ship failed.
        await until(lambda: "ledger unreachable" in gw.log(), timeout=15)
        await pg_proxy.restore()
        counts = await wait_for_rows(db_pool, answered)
    assert counts == {rid: 1 for rid in answered}
    assert "ledger unreachable" in gw.log()
    # The rollup went through the outage exactly as the ledger did.
    ledger, daily = await db_pool.fetchrow(
        """SELECT (SELECT sum(cost_usd) FROM usage_ledger WHERE request_id = ANY($1)),
                  (SELECT sum(cost_usd) FROM usage_daily WHERE api_key_id =
                     (SELECT api_key_id FROM usage_ledger WHERE request_id = $2))""",
        answered, answered[0],
    )
    assert ledger == daily


async def test_sigkill_mid_traffic_then_restart_ships_the_journal_exactly_once(
    process_factory: Any, fake_factory: Any, api_key: str, db_pool: asyncpg.Pool, tmp_path: Path
) -> None:
    fake = await fake_factory(latency_ms=20)
    journal = tmp_path / "journal"
    env = {"BILLING_JOURNAL_DIR": str(journal), "BILLING_SHIP_INTERVAL_SECONDS": "3600"}
    gw = await process_factory(env=env, config_yaml=priced_yaml(fake.url))
    async with aiohttp.ClientSession() as session:
        acknowledged = [rid for rid, status in await asyncio.gather(
            *(send(session, gw.url, api_key, stream=i % 3 == 0) for i in range(30))
        ) if status == 200]
        assert len(acknowledged) == 30
        # Past the group-commit window (a few ms): these are on disk now.
        await asyncio.sleep(0.3)
        in_flight = [asyncio.ensure_future(send(session, gw.url, api_key, stream=i % 2 == 0)) for i in range(20)]
        await asyncio.sleep(0.05)
        gw.signal(signal.SIGKILL)  # mid-traffic, no chance to drain
        gw.wait(timeout=10)
        ambiguous = [rid for rid, _ in await asyncio.gather(*in_flight)]
    assert segments(journal), "nothing was left in the journal to ship"
    assert await ledger_counts(db_pool, acknowledged) == {}  # nothing shipped before the kill
    restarted = await process_factory(env={"BILLING_JOURNAL_DIR": str(journal)}, config_yaml=priced_yaml(fake.url))
    counts = await wait_for_rows(db_pool, acknowledged)
    assert counts == {rid: 1 for rid in acknowledged}
    # Calls cut by the kill are recorded at most once (or not at all, if never journaled).
    assert all(n == 1 for n in (await ledger_counts(db_pool, ambiguous)).values())
    for _ in range(100):
        if not segments(journal):
            break
        await asyncio.sleep(0.05)
    assert not segments(journal)
    assert "left from a previous run" in restarted.log()


async def test_sigterm_drains_calls_in_flight_and_the_journal(
    process_factory: Any, fake_factory: Any, api_key: str, db_pool: asyncpg.Pool, tmp_path: Path
) -> None:
    fake = await fake_factory(chunk_delay_ms=40)  # streams of ~9 chunks take ~0.4 s
    journal = tmp_path / "journal"
    gw = await process_factory(
        env={"BILLING_JOURNAL_DIR": str(journal), "BILLING_SHIP_INTERVAL_SECONDS": "3600"},
        config_yaml=priced_yaml(fake.url),
    )
    async with aiohttp.ClientSession() as session:
        done = [rid for rid, status in [await send(session, gw.url, api_key) for _ in range(10)] if status == 200]
        streams = [asyncio.ensure_future(send(session, gw.url, api_key, stream=True)) for _ in range(3)]
        await asyncio.sleep(0.15)  # the streams have started
        gw.signal(signal.SIGTERM)
        finished = await asyncio.gather(*streams)
    assert all(status == 200 for _, status in finished)  # in-flight streams were let finish
    assert await asyncio.get_running_loop().run_in_executor(None, gw.wait, 30) == 0
    ids = done + [rid for rid, _ in finished]
    assert len(ids) == 13
    # Nothing was shipped before SIGTERM (hour-long interval): the drain shipped it all.
    assert await ledger_counts(db_pool, ids) == {rid: 1 for rid in ids}
    assert not segments(journal)


async def test_a_spent_budget_answers_402_on_every_replica(
    process_factory: Any, fake: FakeUpstream, key_factory: Any, db_pool: asyncpg.Pool
) -> None:
    body = chat_body("bill me", max_tokens=fake_llm.completion_tokens(chat_body("bill me")))
    cost = (fake_llm.prompt_tokens(body["messages"]) * 1000 + body["max_tokens"] * 3000) / 1e6
    reserve = (prompt_token_bound(body) * 1000 + body["max_tokens"] * 3000) / 1e6
    budget = Decimal(f"{reserve + cost * 1.5:.6f}")  # a reservation fits after one call, not two
    raw, record = await key_factory(budget_usd=budget, budget_period="day", rate_limit_requests=1000)
    a = await process_factory(config_yaml=priced_yaml(fake.url))
    b = await process_factory(config_yaml=priced_yaml(fake.url))

    async def settled(calls: int) -> None:  # the replica's ledger rows settle its reservations
        for _ in range(100):
            if await db_pool.fetchval("SELECT count(*) FROM usage_ledger WHERE api_key_id = $1", record.api_key_id) == calls:
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the ledger never had the calls")

    async with aiohttp.ClientSession() as session:
        async def status(url: str) -> int:
            async with session.post(f"{url}/v1/chat/completions", json=body, headers=auth(raw)) as resp:
                await resp.read()
                return resp.status

        assert await status(a.url) == 200
        await settled(1)
        assert await status(b.url) == 200  # B sees A's spend at once: the store is shared
        await settled(2)
        upstream_calls = (await fake.stats())["requests"]
        assert await status(a.url) == 402
        async with session.post(f"{b.url}/v1/chat/completions", json=body, headers=auth(raw)) as resp:
            assert resp.status == 402
            error = (await resp.json())["error"]
            assert error["type"] == "insufficient_quota" and error["code"] == "budget_exceeded"
            assert error["message"].startswith(f"this key's budget of {budget.normalize():f} USD per day cannot cover")
    spent = await db_pool.fetchval("SELECT sum(cost_usd) FROM usage_ledger WHERE api_key_id = $1", record.api_key_id)
    assert spent <= budget
    # A refused call never reaches the provider.
    assert (await fake.stats())["requests"] == upstream_calls
