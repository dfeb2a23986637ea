"""What the limiter costs per request, for each storage: memory, Redis, PostgreSQL.

    python -m bench.limiter_cost [--requests N] [--concurrency C] [--json] [--memory-only]
    (or, from the repository root: PYTHONPATH=. python bench/limiter_cost.py)

For each storage a real LimiterActor is started and driven through its handle as the
edge drives it: the per-IP check, then a per-key acquire (requests + tokens +
concurrency limits, headers computed) and its release with a token charge, ``C``
requests at a time, ``N`` in all. Reported per request: wall time, and CPU time of
this process minus that of the same driver doing nothing (so the figure is the
limiter's own cost: actor hops, strategies, client work; it stays meaningful on a busy
machine, where wall time mostly measures the neighbours); for Redis, commands and
pipelines. Also: the memory path alone through the handle, one request at a time (the
per-IP check, the key's acquire and release, and both), and the library's own Redis
storage driven without batching (one round trip per operation).
Everything is bounded: a few thousand requests per storage.

Redis: ``REDIS_URL`` (default redis://127.0.0.1:6379/0), keys under a fresh prefix,
deleted at the end. PostgreSQL: a scratch database created on ``PG_ADMIN_DSN``
(default postgresql://postgres@127.0.0.1:5432/postgres), dropped at the end. A storage
that does not answer is skipped with a line saying so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from typing import Any

import asyncpg
from limits import RateLimitItemPerSecond
from limits.aio.storage import RedisStorage
from limits.aio.strategies import SlidingWindowCounterRateLimiter

from actors.auth import VerifiedKey
from actors.limiter import LimiterActor, LimiterHandle, Permit
from actors.runtime import Supervisor
from gateway.auth.keys import KeyPolicy, KeyStore
from gateway.core.config import RateLimitSettings
from gateway.core.db import migrate
from gateway.core.errors import RateLimited
from gateway.limits.storage import RedisWindowStorage

__all__ = ["main"]

POLICY = KeyPolicy(rate_limit_requests=10**9, rate_limit_window_seconds=3600, tokens_per_minute=10**9,
                   max_concurrent=10**6)


@dataclass
class Result:
    storage: str
    requests: int
    concurrency: int
    us_per_request: float
    rejected: int
    cpu_us_per_request: float | None = None
    redis_commands_per_request: float | None = None
    redis_pipelines_per_request: float | None = None
    note: str = ""


def _verified(api_key_id: uuid.UUID) -> VerifiedKey:
    return VerifiedKey(
        api_key_id=api_key_id, subject_id=uuid.uuid4(), name="bench", key_prefix="llmg_bench00",
        key_hash=b"\0" * 32, policy=POLICY, expires_at=None,
    )


async def _one(handle: LimiterHandle, key: VerifiedKey, ip: str) -> bool:
    try:
        await handle.check_ip(ip)
        permit: Permit = await handle.acquire(key)
    except RateLimited:
        return False
    permit.charge(100)
    permit.release()
    return True


async def _nothing(_handle: Any, _key: Any, _ip: str) -> bool:
    return True


async def _drive(
    handle: LimiterHandle | None, keys: list[VerifiedKey], total: int, concurrency: int
) -> tuple[float, float, int]:
    """``total`` requests, ``concurrency`` at a time; returns (wall s, CPU s, rejected).

    With no handle the driver does nothing per request: its CPU time is the baseline.
    """
    one: Callable[[Any, VerifiedKey, str], Awaitable[bool]] = _one if handle is not None else _nothing
    rejected = 0
    started, cpu = time.perf_counter(), time.process_time()
    for start in range(0, total, concurrency):
        batch = range(start, min(total, start + concurrency))
        results = await asyncio.gather(*(one(handle, keys[i % len(keys)], f"10.0.{i % 250}.1") for i in batch))
        rejected += results.count(False)
    return time.perf_counter() - started, time.process_time() - cpu, rejected


async def _limiter(storage: str, redis_url: str | None, pool: asyncpg.Pool | None, prefix: str) -> tuple[Supervisor, LimiterActor, LimiterHandle]:
    settings = RateLimitSettings(storage=storage, per_ip="1000000/second", key_prefix=prefix)
    actor = LimiterActor(settings, redis_url=redis_url, pool=pool)
    supervisor = Supervisor()
    ref = await supervisor.start(actor)
    return supervisor, actor, LimiterHandle(actor, ref)


async def measure(
    name: str, storage: str, keys: list[VerifiedKey], total: int, concurrency: int,
    redis_url: str | None = None, pool: asyncpg.Pool | None = None, prefix: str = "bench",
) -> Result:
    supervisor, actor, handle = await _limiter(storage, redis_url, pool, prefix)
    try:
        if actor.degraded:
            return Result(name, 0, concurrency, 0.0, 0, note=f"skipped: {dict(actor.degraded)}")
        await _drive(handle, keys, min(200, total), concurrency)  # warm-up: scripts, connections, caches
        _, baseline_cpu, _ = await _drive(None, keys, total, concurrency)
        redis = actor.redis
        commands, pipelines = (redis.commands, redis.pipelines) if redis else (0, 0)
        seconds, cpu, rejected = await _drive(handle, keys, total, concurrency)
        result = Result(name, total, concurrency, seconds / total * 1e6, rejected, (cpu - baseline_cpu) / total * 1e6)
        if redis is not None:
            result.redis_commands_per_request = (redis.commands - commands) / total
            result.redis_pipelines_per_request = (redis.pipelines - pipelines) / total
        if actor.degraded:
            result.note = f"degraded during the run: {dict(actor.degraded)}"
        return result
    finally:
        await supervisor.stop()


async def measure_library_redis(redis_url: str, total: int, concurrency: int, prefix: str) -> Result:
    """The library's own async Redis storage, unbatched: per-IP hit, key hit + stats, token stats + charge."""
    storage = RedisStorage(f"async+{redis_url}", implementation="redispy", key_prefix=prefix)
    limiter = SlidingWindowCounterRateLimiter(storage)
    ip_item, rpm, tpm = (RateLimitItemPerSecond(10**6, 1), RateLimitItemPerSecond(10**9, 3600),
                         RateLimitItemPerSecond(10**9, 60))

    async def one(i: int) -> None:
        await limiter.hit(ip_item, "ip", f"10.0.{i % 250}.1")
        await limiter.get_window_stats(rpm, "req", "k")
        await limiter.hit(rpm, "req", "k")
        await limiter.get_window_stats(tpm, "tok", "k")
        await limiter.hit(tpm, "tok", "k", cost=100)

    started, cpu = time.perf_counter(), time.process_time()
    for start in range(0, total, concurrency):
        await asyncio.gather(*(one(i) for i in range(start, min(total, start + concurrency))))
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    await storage.reset()
    return Result("redis (limits' own storage, no batching, no actor)", total, concurrency, seconds / total * 1e6, 0,
                  cpu / total * 1e6, note="5 round trips per request")


async def measure_memory_path(total: int) -> list[Result]:
    """The memory path through the handle, one request at a time: no actor hop, no gather.

    What the edge runs per request on a memory limiter (decided in the request's task),
    in three cuts: the per-IP check (rate and burst windows), the key's acquire and
    release with a token charge (requests, tokens, concurrency, headers), and both. CPU
    per request, minus the same loop calling nothing; the median of five rounds.
    """
    supervisor, _actor, handle = await _limiter("memory://", None, None, "bench")
    keys = [_verified(uuid.uuid4()) for _ in range(20)]
    ips = [f"10.0.{i}.1" for i in range(250)]

    async def check(i: int) -> None:
        await handle.check_ip(ips[i % 250])

    async def acquire_release(i: int) -> None:
        permit = await handle.acquire(keys[i % 20])
        permit.charge(100)
        permit.release()

    async def whole(i: int) -> None:
        await check(i)
        await acquire_release(i)

    async def nothing(_i: int) -> None:
        return None

    async def cpu_per_call(step: Callable[[int], Awaitable[None]]) -> float:
        rounds = []
        for _ in range(5):
            started = time.process_time()
            for i in range(total):
                await step(i)
            rounds.append((time.process_time() - started) / total * 1e6)
        return statistics.median(rounds)

    try:
        await cpu_per_call(whole)  # warm-up: every window and key exists
        baseline = await cpu_per_call(nothing)
        cuts = [
            ("memory: whole path alone (check_ip+acquire+release)", whole),
            ("memory: key acquire+release alone (requests+tokens)", acquire_release),
            ("memory: per-IP check alone (rate+burst)", check),
        ]
        results = []
        for name, step in cuts:
            cpu = await cpu_per_call(step) - baseline
            results.append(Result(name, total, 1, cpu, 0, cpu, note="no actor hop, one at a time"))
        return results
    finally:
        await supervisor.stop()


@asynccontextmanager
async def scratch_database(admin_dsn: str) -> AsyncIterator[str]:
    name = f"llmg_bench_{uuid.uuid4().hex[:10]}"
    conn = await asyncpg.connect(admin_dsn, timeout=3)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    base, _, _ = admin_dsn.rpartition("/")
    try:
        yield f"{base}/{name}"
    finally:
        conn = await asyncpg.connect(admin_dsn, timeout=3)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()


async def run(total: int, concurrency: int, memory_only: bool = False) -> list[Result]:
    results: list[Result] = []
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    keys = [_verified(uuid.uuid4()) for _ in range(20)]
    results.append(await measure("memory", "memory://", keys, total, concurrency))
    results.extend(await measure_memory_path(total))
    if memory_only:
        return results
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    probe = RedisWindowStorage(redis_url, key_prefix=prefix)
    try:
        if await probe.check():
            results.append(await measure("redis (batched pipelines)", redis_url, keys, total, concurrency, prefix=prefix))
            results.append(await measure_library_redis(redis_url, min(total, 1000), concurrency, prefix + "-lib"))
        else:
            results.append(Result("redis", 0, concurrency, 0.0, 0, note=f"skipped: no Redis at {redis_url}"))
    finally:
        await probe.reset()
        await probe.close()
    admin_dsn = os.environ.get("PG_ADMIN_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
    try:
        async with scratch_database(admin_dsn) as dsn:
            pool = await asyncpg.create_pool(dsn, min_size=1, max_size=10)
            try:
                async with pool.acquire() as conn:
                    await migrate(conn)
                store = KeyStore(pool)
                pg_keys = []
                for i in range(20):
                    _raw, record = await store.create(f"bench-{i}", policy=POLICY)
                    pg_keys.append(_verified(record.api_key_id))
                results.append(await measure(
                    "postgres (per-key requests; ip, tokens in memory)", "postgres", pg_keys,
                    min(total, 1000), concurrency, pool=pool,
                ))
            finally:
                await pool.close()
    except (OSError, asyncpg.PostgresError) as exc:
        results.append(Result("postgres", 0, concurrency, 0.0, 0, note=f"skipped: {exc!r}"))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000, help="requests per storage (bounded to 20000)")
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--memory-only", action="store_true", help="skip Redis and PostgreSQL")
    args = parser.parse_args(argv)
    results = asyncio.run(run(min(args.requests, 20_000), max(1, args.concurrency), args.memory_only))
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
        return 0
    print(f"{'storage':55} {'wall µs/req':>11} {'CPU µs/req':>11} {'cmds/req':>9} {'pipes/req':>10}  note")
    for r in results:
        cmds = f"{r.redis_commands_per_request:.2f}" if r.redis_commands_per_request is not None else "-"
        pipes = f"{r.redis_pipelines_per_request:.3f}" if r.redis_pipelines_per_request is not None else "-"
        cpu = f"{r.cpu_us_per_request:.1f}" if r.cpu_us_per_request is not None else "-"
        print(f"{r.storage:55} {r.us_per_request:11.1f} {cpu:>11} {cmds:>9} {pipes:>10}  {r.note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
