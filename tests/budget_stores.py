"""Budget stores for tests, on the real test PostgreSQL and Redis: what reaches them is
counted (and, for the failure tests, broken) by thin wrappers around the real clients.
The ``make_store`` fixture (tests/conftest.py) builds them."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import redis.asyncio as aioredis

from gateway.billing.reservations import (
    Budget,
    period_start,
)

STORES = ["postgresql", "redis"]


@dataclass
class Faults:
    """What the wrappers do to round trips: count them, hold them, break the n-th."""

    round_trips: int = 0
    hold: asyncio.Event | None = None  # the first round trip waits for it
    fail_on: set[int] = field(default_factory=set)  # 1-based round trips that fail
    delay: float = 0.0  # seconds every round trip waits before it is sent

    async def before(self) -> None:
        self.round_trips += 1
        number = self.round_trips
        if number == 1 and self.hold is not None:
            await self.hold.wait()
        if self.delay:
            await asyncio.sleep(self.delay)
        if number in self.fail_on:
            raise ConnectionResetError("connection to the budget store lost")


class CountingPool:
    """An asyncpg pool whose reservation round trips (``fetchval``) pass through ``faults``."""

    def __init__(self, pool: asyncpg.Pool, faults: Faults) -> None:
        self._pool = pool
        self._faults = faults

    async def fetchval(self, *args: Any) -> Any:
        await self._faults.before()
        return await self._pool.fetchval(*args)

    async def execute(self, *args: Any) -> Any:
        return await self._pool.execute(*args)

    async def close(self) -> None:
        await self._pool.close()


class CountingRedis(aioredis.Redis):
    """A Redis client whose reserve scripts pass through ``faults``; every script it sends
    (reserve and settle) is counted in ``scripts``."""

    faults: Faults
    reserve_sha = ""
    scripts = 0

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        if args and args[0] in ("EVALSHA", "EVAL"):
            self.scripts += 1
            if args[1] == self.reserve_sha:
                await self.faults.before()
        return await super().execute_command(*args, **options)


async def seeded(kind: str, store: Any, *budgets: Budget) -> None:
    """Redis: the budgets' spend seeded beforehand, so every reserve script is one admission
    (a budget Redis has not seen costs a script, a seed and the script again)."""
    if kind == "redis":
        for budget in budgets:
            await store._seed(budget)


def key_budget(limit: int, period: str = "total") -> Budget:
    return Budget("key", uuid.uuid4(), period, period_start(period), limit_micro_usd=limit)


def subject_budget(limit: int) -> Budget:
    return Budget("subject", uuid.uuid4(), "month", period_start("month"), limit_micro_usd=limit)


async def open_reservations(kind: str, store: Any, db_pool: asyncpg.Pool, budget: Budget) -> int:
    """Micro-USD held open against ``budget`` in the store."""
    if kind == "postgresql":
        return int(await db_pool.fetchval(
            "SELECT coalesce(sum(amount_micro_usd), 0) FROM budget_reservations WHERE scope = $1 AND id = $2",
            budget.scope, budget.id))
    fields = await store._redis.hgetall(f"{store._prefix}:{budget.redis_name}")
    return sum(int(v) for k, v in fields.items() if k.startswith(b"r:"))
