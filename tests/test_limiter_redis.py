"""Limits shared through Redis: two gateway processes enforce one limit together, and a
Redis outage falls back to memory at once (degraded, still ready) and heals by itself.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from gateway.limits.storage import RedisWindowStorage
from tests.conftest import FakeUpstream, auth, chat_body, config_for, redis_via

HOUR = 3600


@pytest.fixture
async def redis_prefix(redis_url: str) -> AsyncIterator[str]:
    """A key prefix of this test alone (the Redis server is shared); its keys go at the end."""
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    yield prefix
    storage = RedisWindowStorage(redis_url, key_prefix=prefix)
    await storage.reset()
    await storage.close()


async def test_two_processes_sharing_redis_enforce_one_limit(
    process_factory: Any, fake: FakeUpstream, key_factory: Any, redis_url: str, redis_prefix: str
) -> None:
    yaml = config_for(fake.url, rate_limits={"key_prefix": redis_prefix})
    first = await process_factory(env={"REDIS_URL": redis_url}, config_yaml=yaml)
    second = await process_factory(env={"REDIS_URL": redis_url}, config_yaml=yaml)
    raw, _ = await key_factory(rate_limit_requests=10, rate_limit_window_seconds=HOUR, max_concurrent=50)
    statuses: dict[str, list[int]] = {first.url: [], second.url: []}
    async with aiohttp.ClientSession() as session:

        async def call(url: str) -> None:
            async with session.post(f"{url}/v1/chat/completions", json=chat_body(), headers=auth(raw)) as r:
                await r.read()
                statuses[url].append(r.status)

        # Alternating, then a concurrent burst at both: 10 allowed in total, not 20.
        for i in range(10):
            await call((first.url, second.url)[i % 2])
        await asyncio.gather(*(call((first.url, second.url)[i % 2]) for i in range(20)))
    every = statuses[first.url] + statuses[second.url]
    assert every.count(200) == 10, statuses
    assert every.count(429) == 20
    assert 200 in statuses[first.url] and 200 in statuses[second.url]


async def test_a_redis_outage_falls_back_to_memory_and_heals(
    gateway_factory: Any, fake: FakeUpstream, key_factory: Any, redis_url: str, redis_proxy: Any, redis_prefix: str
) -> None:
    gw = await gateway_factory(
        env={"REDIS_URL": redis_via(redis_url, redis_proxy.port)},
        config_yaml=config_for(fake.url, rate_limits={"key_prefix": redis_prefix}),
    )
    raw, record = await key_factory(rate_limit_requests=10, rate_limit_window_seconds=HOUR, max_concurrent=5)

    async def call() -> aiohttp.ClientResponse:
        r = await gw.data.post("/v1/chat/completions", json=chat_body(), headers=auth(raw))
        await r.read()
        return r

    async def readiness() -> dict[str, Any]:
        r = await gw.data.get("/readyz")
        assert r.status == 200  # degraded is still ready: limits keep working
        return dict(await r.json())

    assert (await readiness())["status"] == "ok"
    for expected in (9, 8, 7, 6):
        r = await call()
        assert r.status == 200 and int(r.headers["x-ratelimit-remaining-requests"]) == expected

    await redis_proxy.cut()
    # At once: no request fails, each is decided from this process's memory.
    remaining = []
    for _ in range(3):
        r = await call()
        assert r.status == 200
        remaining.append(int(r.headers["x-ratelimit-remaining-requests"]))
    assert remaining == [9, 8, 7]
    ready = await readiness()
    assert ready["status"] == "degraded"
    assert "rate_limits:redis" in ready["degraded"]
    assert ready["checks"]["rate_limits"].startswith("degraded: redis")
    assert gw.state.limiter.degraded.keys() == {"redis"}

    await redis_proxy.restore()
    # The limiter probes Redis every 0.5 s; a loaded machine may take a few probes.
    for _ in range(300):
        if not gw.state.limiter.degraded:
            break
        await asyncio.sleep(0.05)
    recovered = await readiness()
    assert recovered["status"] == "ok" and "degraded" not in recovered
    assert set(recovered["checks"].values()) == {"ok"} and recovered["checks"]["rate_limits"] == "ok"
    # Redis is used again, with what it held: 4 taken before the cut, 6 left.
    statuses = [(await call()).status for _ in range(8)]
    assert statuses == [200] * 6 + [429] * 2
    # Every lease taken in Redis was given back (those taken in memory during the cut too).
    redis = gw.state.limiter._actor.redis
    await asyncio.sleep(0.05)
    assert await redis.slots_held(f"conc/{record.api_key_id}") == 0
    assert not gw.state.limiter._actor.inflight


async def test_a_redis_that_stops_answering_fails_each_pipeline_within_the_timeout_and_recovers(
    redis_url: str, redis_proxy: Any, redis_prefix: str
) -> None:
    # A silent Redis (replies held, the connection open) must fail a decision within the
    # storage's timeout, so the limiter falls back to memory, and the connection it
    # abandoned must not hand a later pipeline the replies meant for this one.
    from limits import RateLimitItemPerSecond

    from gateway.limits.storage import STORAGE_ERRORS, Windows

    storage = RedisWindowStorage(redis_via(redis_url, redis_proxy.port), key_prefix=redis_prefix, timeout=0.3)
    windows = Windows("redis", storage, "sliding-window")
    item = RateLimitItemPerSecond(100, 60)
    try:
        assert await windows.hit(item, "k")
        redis_proxy.pause()
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(STORAGE_ERRORS):
            await windows.hit(item, "k")
        assert 0.25 <= loop.time() - started < 2.0
        assert not await storage.check()  # the health probe is bounded too
        redis_proxy.resume()
        assert await storage.check()
        # The pipeline that timed out took nothing from a later one: counts are exact.
        stats = await windows.stats(item, "k")
        assert stats.remaining in (98, 99)  # the held hit may or may not have reached Redis
        assert await windows.hit(item, "k")
        assert (await windows.stats(item, "k")).remaining == stats.remaining - 1
    finally:
        redis_proxy.resume()
        await storage.close()
