"""The cache's Redis tier: replicas share hits and purges; a miss asks Redis nothing.

Every test uses its own key prefix (a uuid), so parallel runs on the shared Redis never
meet, and purges what it stored at the end.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from tests.cache_helpers import ask, cached_config, settle, upstream_calls
from tests.conftest import FakeUpstream, Gateway, auth, chat_body, free_port
from tests.test_cache_semantic import needs_local_model


@pytest.fixture
async def prefix(redis_url: str) -> AsyncIterator[str]:
    name = f"llmg-test-cache-{uuid.uuid4().hex}"
    yield name
    client = aioredis.Redis.from_url(redis_url)
    async for key in client.scan_iter(match=f"{name}:*"):
        await client.unlink(key)
    await client.aclose()


async def _until(predicate: Callable[[], bool], what: str) -> None:
    for _ in range(500):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def _replica(gateway_factory: Callable[..., Any], config: str, redis_url: str) -> Gateway:
    gw: Gateway = await gateway_factory(config_yaml=config, env={"REDIS_URL": redis_url})
    actor = gw.state.cache._actor
    await _until(lambda: actor.remote_synced, "the Redis subscription")
    return gw


async def test_two_gateway_processes_share_hits_and_purges(
    process_factory: Callable[..., Any], fake: FakeUpstream, api_key: str, redis_url: str, prefix: str
) -> None:
    config = cached_config(fake.url, redis_prefix=prefix)
    env = {"REDIS_URL": redis_url, "ADMIN_TOKEN": "cache-admin"}
    first = await process_factory(env=env, config_yaml=config)
    second = await process_factory(env=env, config_yaml=config)
    admin = {"Authorization": "Bearer cache-admin"}
    body = chat_body("shared across replicas", model="cached", temperature=0)
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as session:

        async def post(gp: Any, payload: dict[str, Any]) -> tuple[str, bytes, str]:
            async with session.post(f"{gp.url}/v1/chat/completions", json=payload, headers=auth(api_key)) as r:
                assert r.status == 200
                return r.headers["x-gateway-cache"], await r.read(), r.headers["x-gateway-cache-key"]

        async def stats(gp: Any) -> dict[str, Any]:
            async with session.get(f"{gp.management_url}/admin/cache", headers=admin) as r:
                return dict(await r.json())

        async def known_by(gp: Any, n: int) -> None:
            for _ in range(500):
                if (await stats(gp))["shared_keys_known"] >= n:
                    return
                await asyncio.sleep(0.01)
            raise AssertionError(f"{gp.url} never learnt of {n} shared entries")

        status, answer, key = await post(first, body)
        assert status == "miss"
        status, raw_stream, _ = await post(first, stream_body)
        assert status == "miss"
        await known_by(second, 2)
        status, served, _ = await post(second, body)
        assert status == "hit" and served == answer
        status, replayed, _ = await post(second, stream_body)
        assert status == "hit" and replayed == raw_stream
        assert await upstream_calls(fake) == 2

        # A purge on one replica reaches the other's memory and the shared store.
        async with session.delete(f"{second.management_url}/admin/cache?key={key}", headers=admin) as r:
            assert (await r.json())["purged"]["shared"] == 1
        for _ in range(500):
            if (await stats(first))["shared_keys_known"] == 1:
                break
            await asyncio.sleep(0.01)
        status, _, _ = await post(first, body)
        assert status == "miss"
        assert await upstream_calls(fake) == 3


async def test_a_miss_costs_no_redis_trip_once_subscribed(
    gateway_factory: Callable[..., Any], fake: FakeUpstream, api_key: str, redis_url: str, prefix: str
) -> None:
    config = cached_config(fake.url, redis_prefix=prefix)
    one = await _replica(gateway_factory, config, redis_url)
    two = await _replica(gateway_factory, config, redis_url)
    resp, _ = await ask(one, api_key, "never asked before")
    assert resp.headers["x-gateway-cache"] == "miss"
    assert one.state.cache.counters.remote_gets == 0  # decided by the known-keys view
    await settle(one, 1)
    await _until(lambda: len(two.state.cache._actor.remote_view) == 1, "the announcement")
    resp, _ = await ask(two, api_key, "never asked before")
    assert resp.headers["x-gateway-cache"] == "hit"
    assert two.state.cache.counters.remote_gets == 1
    await asyncio.sleep(0.01)  # the adopted entry is a tell
    resp, _ = await ask(two, api_key, "never asked before")
    assert resp.headers["x-gateway-cache"] == "hit"
    assert two.state.cache.counters.remote_gets == 1  # now from memory


async def test_a_replica_started_later_finds_what_is_already_shared(
    gateway_factory: Callable[..., Any], fake: FakeUpstream, api_key: str, redis_url: str, prefix: str
) -> None:
    config = cached_config(fake.url, redis_prefix=prefix)
    early = await _replica(gateway_factory, config, redis_url)
    await ask(early, api_key, "asked early")
    await settle(early, 1)
    await _until(lambda: len(early.state.cache._actor.remote_view) == 1, "the store")
    for _ in range(100):  # the SET is a task of the actor: wait until Redis has it
        client = aioredis.Redis.from_url(redis_url)
        found = [k async for k in client.scan_iter(match=f"{prefix}:e:*")]
        await client.aclose()
        if found:
            break
        await asyncio.sleep(0.01)
    late = await _replica(gateway_factory, config, redis_url)
    assert len(late.state.cache._actor.remote_view) == 1  # seeded by the SCAN
    resp, _ = await ask(late, api_key, "asked early")
    assert resp.headers["x-gateway-cache"] == "hit"


@needs_local_model
async def test_semantic_hits_are_shared_between_replicas(
    gateway_factory: Callable[..., Any], fake: FakeUpstream, api_key: str, redis_url: str, prefix: str
) -> None:
    config = cached_config(fake.url, {"mode": "semantic"}, redis_prefix=prefix, semantic={"max_wait_ms": 5000})
    one = await _replica(gateway_factory, config, redis_url)
    two = await _replica(gateway_factory, config, redis_url)
    await ask(one, api_key, "How do I delete a git branch?")
    await _until(lambda: two.state.cache.stats()["vectors"] == 1, "the vector's announcement")
    resp, _ = await ask(two, api_key, "How can I delete a branch in git?")
    assert resp.headers["x-gateway-cache"] == "hit"
    assert float(resp.headers["x-gateway-cache-similarity"]) >= 0.95


async def test_an_unreachable_redis_costs_hits_not_answers(
    gateway_factory: Callable[..., Any], fake: FakeUpstream, api_key: str
) -> None:
    gw = await gateway_factory(
        config_yaml=cached_config(fake.url), env={"REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    )
    resp, _ = await ask(gw, api_key, "redis is away")
    assert resp.status == 200 and resp.headers["x-gateway-cache"] == "miss"
    await settle(gw, 1)
    resp, _ = await ask(gw, api_key, "redis is away")
    assert resp.status == 200 and resp.headers["x-gateway-cache"] == "hit"  # from this replica's memory
    await _until(lambda: gw.state.cache.counters.remote_errors >= 1, "the failed share to be counted")
