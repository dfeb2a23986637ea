"""What the response cache costs and saves: hit latency, and what it adds to a miss.

    python bench/cache_cost.py [--requests 300] [--redis redis://127.0.0.1:6379/0]
                               [--pg postgresql://postgres@127.0.0.1:5432/postgres]

Two parts, both on loopback only, bounded in count:

1. The cache's own path, called directly on the real actor and handle (no HTTP): the
   decision when a group has no cache, an exact miss and hit in memory, the same with
   Redis (a miss decided by the known-keys view; a hit that needs a GET; a miss while
   not subscribed, which asks Redis), and for semantic groups the embedding time of a
   short and a long prompt, which is what a semantic miss waits for (at most
   ``cache.semantic.max_wait_ms``).
2. End to end through an in-process gateway in front of the in-process fake provider
   (needs PostgreSQL: a scratch database is created and dropped): client-side latency of
   a call with caching off, a miss, a hit, and a streamed hit.

Figures on a shared 2-core box are upper bounds; compare them with each other.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from actors.cache import CacheActor, CacheHandle
from actors.runtime import Supervisor
from gateway.cache.store import CacheEntry
from gateway.core.config import CachePolicy, CacheSettings, Deployment, GatewayConfig, ModelGroup

SUBJECT, KEY_ID = uuid.uuid4(), uuid.uuid4()
BODY = {"model": "cached", "temperature": 0, "max_tokens": 64,
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "name a colour"}]}


def _config(prefix: str) -> GatewayConfig:
    deployment = (Deployment(provider="fake", model="m"),)
    return GatewayConfig(
        providers={},
        models=(ModelGroup("cached", deployment, cache=CachePolicy()), ModelGroup("plain", deployment)),
        cache=CacheSettings(redis_prefix=prefix),
    )


def _summary(samples: list[float]) -> str:
    samples = sorted(samples)
    p50 = statistics.median(samples)
    p99 = samples[min(len(samples) - 1, int(len(samples) * 0.99))]
    unit, scale = ("µs", 1e6) if p99 < 1e-3 else ("ms", 1e3)
    return f"p50 {p50 * scale:8.2f} {unit}   p99 {p99 * scale:8.2f} {unit}   (n={len(samples)})"


async def _time(n: int, call: Callable[[int], Awaitable[Any]]) -> list[float]:
    samples: list[float] = []
    for i in range(n):
        start = time.perf_counter()
        await call(i)
        samples.append(time.perf_counter() - start)
    return samples


async def _handle(redis_url: str | None, prefix: str) -> tuple[Supervisor, CacheHandle, CacheActor]:
    config = _config(prefix)
    supervisor = Supervisor()
    actor = CacheActor(config.cache, redis_url)
    ref = await supervisor.start(actor)
    return supervisor, CacheHandle(actor, ref, config, None), actor


def _entry_for(handle: CacheHandle, body: dict[str, Any]) -> CacheEntry:
    ticket = handle.ticket("cached", "cached", body, KEY_ID, SUBJECT, {})
    assert ticket is not None
    now = time.time()
    return CacheEntry(key=ticket.key, scope=ticket.scope, subject=str(SUBJECT), group="cached", stream=False,
                      body=b'{"choices":[]}' * 40, content_type="application/json",
                      created_at=now, expires_at=now + 600)


async def direct_costs(n: int, redis_url: str | None) -> None:
    print("\n== the cache's own path (no HTTP) ==")
    supervisor, handle, actor = await _handle(None, "bench")
    try:
        async def off(_: int) -> None:
            handle.ticket("plain", "plain", BODY, KEY_ID, SUBJECT, {})

        async def miss(i: int) -> None:
            ticket = handle.ticket("cached", "cached", {**BODY, "seed": i}, KEY_ID, SUBJECT, {})
            assert ticket is not None and await ticket.lookup() is None

        handle.store(handle.ticket("cached", "cached", BODY, KEY_ID, SUBJECT, {}),  # type: ignore[arg-type]
                     _entry_for(handle, BODY))
        await asyncio.sleep(0.01)

        async def hit(_: int) -> None:
            ticket = handle.ticket("cached", "cached", BODY, KEY_ID, SUBJECT, {})
            assert ticket is not None and await ticket.lookup() is not None

        print(f"group without cache (decision)      {_summary(await _time(n * 10, off))}")
        print(f"exact miss, memory (key + lookup)   {_summary(await _time(n * 10, miss))}")
        print(f"exact hit, memory                   {_summary(await _time(n * 10, hit))}")
    finally:
        await supervisor.stop()

    if redis_url:
        prefix = f"llmg-bench-{uuid.uuid4().hex}"
        supervisor, handle, actor = await _handle(redis_url, prefix)
        other_sup, other, other_actor = await _handle(redis_url, prefix)
        try:
            for _ in range(500):
                if actor.remote_synced and other_actor.remote_synced:
                    break
                await asyncio.sleep(0.01)
            print(f"exact miss, Redis subscribed        {_summary(await _time(n * 10, miss))}"
                  f"   GETs: {handle.counters.remote_gets}")
            for i in range(n):  # the other replica stores; this one learns by announcement
                body = {**BODY, "seed": 10_000 + i}
                other.store(other.ticket("cached", "cached", body, KEY_ID, SUBJECT, {}),  # type: ignore[arg-type]
                            _entry_for(other, body))
            for _ in range(500):
                if len(actor.remote_view) >= n:
                    break
                await asyncio.sleep(0.01)

            async def remote_hit(i: int) -> None:
                ticket = handle.ticket("cached", "cached", {**BODY, "seed": 10_000 + i}, KEY_ID, SUBJECT, {})
                assert ticket is not None and await ticket.lookup() is not None

            print(f"exact hit, first on this replica    {_summary(await _time(n, remote_hit))}   (one GET)")
            actor.remote_synced = False  # as while the subscription is down

            async def blind_miss(i: int) -> None:
                ticket = handle.ticket("cached", "cached", {**BODY, "seed": 50_000 + i}, KEY_ID, SUBJECT, {})
                assert ticket is not None and await ticket.lookup() is None

            print(f"exact miss, Redis not subscribed    {_summary(await _time(n, blind_miss))}   (one GET)")
            await handle.purge(everything=True)
        finally:
            await other_sup.stop()
            await supervisor.stop()

    from gateway.cache.embedder import LocalEmbedder, local_model_available

    if not local_model_available():
        print("semantic: the [semantic] extra is not installed; skipped")
        return
    embedder = LocalEmbedder()
    await embedder.warm_up()
    short = "How do I reset my password?"
    long = " ".join(["Please summarise the following meeting notes for the team."] * 20)
    for label, text in (("short prompt (6 words)", short), ("long prompt (~180 words)", long)):
        samples = await _time(max(20, n // 5), lambda _i, t=text: embedder.embed(t))
        print(f"semantic: embed {label:<24}{_summary(samples)}")
    print(f"semantic: a miss waits at most cache.semantic.max_wait_ms "
          f"(default {CacheSettings().semantic.max_wait_ms:g} ms), then goes on; the vector still serves the store")
    embedder.close()


async def end_to_end(n: int, pg_admin: str) -> None:
    import asyncpg
    from aiohttp import ClientSession
    from aiohttp.test_utils import TestServer

    from gateway.auth.keys import KeyPolicy, KeyStore
    from gateway.core.config import load_config, load_settings
    from gateway.edge.app import build_data_app, gateway_state
    from gateway.testing.fake_provider import FakeConfig, make_app

    print("\n== end to end, client side (in-process gateway and fake provider) ==")
    name = f"llmg_bench_{uuid.uuid4().hex[:10]}"
    try:
        admin = await asyncpg.connect(pg_admin, timeout=3)
    except Exception as exc:
        print(f"skipped: PostgreSQL at {pg_admin} does not answer ({type(exc).__name__})")
        return
    await admin.execute(f'CREATE DATABASE "{name}"')
    dsn = pg_admin.rsplit("/", 1)[0] + f"/{name}"
    fake = TestServer(make_app(FakeConfig()), host="127.0.0.1")
    await fake.start_server()
    config_path = Path(f"/tmp/{name}.yaml")
    fake_url = f"http://127.0.0.1:{fake.port}/v1"
    await asyncio.to_thread(
        config_path.write_text,
        f"providers: {{fake: {{type: openai, base_url: '{fake_url}', api_key: k}}}}\n"
        "models:\n"
        "  - {name: cached, deployments: [{provider: fake, model: mock-small}], cache: {mode: exact}}\n"
        "  - {name: '*', deployments: [{provider: fake, model: '*'}]}\n",
    )
    try:
        environ = {"DATABASE_URL": dsn, "GATEWAY_CONFIG": str(config_path)}
        settings = load_settings(environ)
        async with gateway_state(settings, load_config(settings, environ), dsn) as state:
            raw_key, _ = await KeyStore(state.pool).create("bench", policy=KeyPolicy(rate_limit_requests=1_000_000))
            server = TestServer(build_data_app(state), host="127.0.0.1")
            await server.start_server()
            url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
            headers = {"Authorization": f"Bearer {raw_key}"}
            async with ClientSession() as session:

                async def call(body: dict[str, Any], expect: str | None) -> None:
                    async with session.post(url, json=body, headers=headers) as r:
                        await r.read()
                        assert r.status == 200 and r.headers.get("x-gateway-cache") == expect, r.headers

                prompt = {"temperature": 0, "messages": [{"role": "user", "content": "what is a cache"}]}
                await call({"model": "plain", **prompt}, None)  # warm connections
                rows = [
                    ("cache off (group without policy)", lambda i: call({"model": "plain", **prompt, "seed": i}, None)),
                    ("miss (stored afterwards)", lambda i: call({"model": "cached", **prompt, "seed": i}, "miss")),
                    ("hit, whole answer", lambda i: call({"model": "cached", **prompt, "seed": 0}, "hit")),
                    ("hit, stream replay", lambda i: call(
                        {"model": "cached", **prompt, "seed": 0, "stream": True}, "hit" if i else "miss")),
                ]
                for label, fn in rows:
                    print(f"{label:<36}{_summary(await _time(n, fn))}")
            await server.close()
    finally:
        await fake.close()
        await asyncio.to_thread(config_path.unlink, missing_ok=True)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--redis", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--no-redis", action="store_true")
    parser.add_argument("--pg", default=os.environ.get("TEST_PG_ADMIN_DSN", "postgresql://postgres@127.0.0.1:5432/postgres"))
    args = parser.parse_args()
    await direct_costs(args.requests, None if args.no_redis else args.redis)
    await end_to_end(args.requests, args.pg)


if __name__ == "__main__":
    asyncio.run(main())
