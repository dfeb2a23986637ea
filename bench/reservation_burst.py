"""A burst of budget reservations on one budget: batched round trips against one by one.

    python -m bench.reservation_burst [--calls N] [--rounds R] [--no-redis]
    (or, from the repository root: PYTHONPATH=. python bench/reservation_burst.py)

S4's situation without the HTTP around it: ``N`` calls of one budgeted key reserve at
once. Measured for each store as the gateway uses it (``PostgresReservations`` on its
own pool, ``RedisReservations``): the wall time until every call has its answer, the
round trips that took and the calls per round trip, and the CPU this (the gateway's)
process spent per call (the store's own CPU is not in it); and, for comparison, the same burst
sent one call per statement through ``budget_reserve()`` (sql/0010, what every call did
before reservations were batched) on a pool of 10 connections, as the gateway had.
Every call fits (the budget is far above the burst), so every one is admitted.

PostgreSQL: a scratch database created on ``PG_ADMIN_DSN`` (default
postgresql://postgres@127.0.0.1:5432/postgres), dropped at the end. Redis: ``REDIS_URL``
(default redis://127.0.0.1:6379/0), keys under a fresh prefix, deleted at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg

from gateway.billing.reservations import (
    Budget,
    PostgresReservations,
    RedisReservations,
    Reservation,
    connect_reservation_pool,
    period_start,
)
from gateway.core.db import migrate

PG_ADMIN_DSN = os.environ.get("PG_ADMIN_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


def _budget() -> Budget:
    return Budget("key", uuid.uuid4(), "total", period_start("total"), limit_micro_usd=10**15)


async def _burst(reserve: Callable[[Reservation], Awaitable[Any]], budget: Budget, calls: int) -> tuple[float, float]:
    """Wall seconds until every call has its answer, and this process's CPU seconds meanwhile."""
    reservations = [Reservation(uuid.uuid4(), 1000, (budget,)) for _ in range(calls)]
    started, cpu = time.perf_counter(), time.process_time()
    answers = await asyncio.gather(*(reserve(r) for r in reservations))
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    if any(a not in (None, 0) for a in answers):
        raise RuntimeError(f"a call of the burst was refused: {answers}")
    return elapsed, cpu


def _line(name: str, bursts: list[tuple[float, float]], calls: int, round_trips: int | None = None) -> None:
    times = [wall for wall, _ in bursts]
    cpu_us = statistics.median(cpu for _, cpu in bursts) * 1e6 / calls
    per_trip = f", {calls * len(times) / round_trips:.0f} calls per round trip ({round_trips} round trips)" if round_trips else ""
    print(f"  {name}: {calls} calls answered in {statistics.median(times) * 1000:,.0f} ms (median of {len(times)}; "
          f"min {min(times) * 1000:,.0f} ms), client CPU {cpu_us:,.0f} µs per call{per_trip}")


async def _postgres(dsn: str, calls: int, rounds: int) -> None:
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    own = await connect_reservation_pool(dsn, max_size=10)
    store = PostgresReservations(pool, own_pool=own)
    try:
        times = [await _burst(lambda r: store.reserve(r, 600), _budget(), calls) for _ in range(rounds)]
        _line("PostgreSQL, batched (budget_reserve_batch)", times, calls, store.batcher.round_trips)

        async def one_by_one(r: Reservation) -> Any:
            (b,) = r.budgets
            return await own.fetchval(
                "SELECT budget_reserve($1, $2, $3, $4, $5, $6, $7, $8)", r.reservation_id, [b.scope], [b.id],
                [b.period], [b.start], [b.limit_micro_usd], r.amount_micro_usd, 600.0)

        times = [await _burst(one_by_one, _budget(), calls) for _ in range(rounds)]
        _line("PostgreSQL, one statement per call (budget_reserve, pool of 10)", times, calls)
    finally:
        await store.close()
        await pool.close()


async def _redis(dsn: str, url: str, calls: int, rounds: int) -> None:
    import redis.asyncio as aioredis

    prefix = f"bench-burst-{uuid.uuid4().hex[:8]}"
    client = aioredis.Redis.from_url(url)
    try:
        await client.ping()
    except Exception as exc:  # Redis is optional here
        print(f"  Redis at {url} does not answer ({exc}); skipped")
        await client.aclose()
        return
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    store = RedisReservations(client, pool, prefix=f"{prefix}:budget")
    try:
        times: list[tuple[float, float]] = []
        for _ in range(rounds):
            budget = _budget()
            await store._seed(budget)  # as a budget in use is: seeded once, long before
            times.append(await _burst(lambda r: store.reserve(r, 600), budget, calls))
        _line("Redis, batched (one script per round trip)", times, calls, store.batcher.round_trips)
    finally:
        keys = [k async for k in client.scan_iter(match=f"{prefix}:*")]
        if keys:
            await client.delete(*keys)
        await store.close()
        await pool.close()


async def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.reservation_burst", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=1000, help="calls in one burst (default 1000, at most 20000)")
    parser.add_argument("--rounds", type=int, default=3, help="bursts per store (default 3)")
    parser.add_argument("--no-redis", action="store_true")
    args = parser.parse_args()
    calls, rounds = max(1, min(args.calls, 20_000)), max(1, min(args.rounds, 20))
    admin = await asyncpg.connect(PG_ADMIN_DSN)
    name = f"llmg_burst_{uuid.uuid4().hex[:8]}"
    await admin.execute(f'CREATE DATABASE "{name}"')
    dsn = PG_ADMIN_DSN.rsplit("/", 1)[0] + f"/{name}"
    try:
        conn = await asyncpg.connect(dsn)
        try:
            await migrate(conn)
        finally:
            await conn.close()
        print(f"{calls} concurrent reservations on one budget, {rounds} bursts per store, "
              f"load average {os.getloadavg()[0]:.2f}:")
        await _postgres(dsn, calls, rounds)
        if not args.no_redis:
            await _redis(dsn, REDIS_URL, calls, rounds)
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


if __name__ == "__main__":
    asyncio.run(main())
