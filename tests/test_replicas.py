"""Two gateway processes sharing PostgreSQL (and Redis) behind nginx on loopback: the
same client experience as one process."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.balancer import Nginx, nginx_available
from tests.conftest import FakeUpstream, GatewayProcess, auth, chat_body, config_for, free_port

#: USD per million tokens: a call here costs about 0.03 USD.
PRICE = {"input_per_mtok": 1000.0, "output_per_mtok": 2000.0}


@dataclass
class Cluster:
    replicas: list[GatewayProcess]
    url: str
    fake: FakeUpstream


@pytest.fixture
async def cluster(process_factory: Any, fake_factory: Any, redis_url: str, tmp_path: Path) -> AsyncIterator[Cluster]:
    if nginx_available() is None:
        pytest.skip("nginx is not installed")
    fake: FakeUpstream = await fake_factory()
    # Own Redis key prefix: parallel test runs share the Redis server. Priced, so budgets spend.
    config = config_for(
        fake.url, rate_limits={"key_prefix": f"replicas-{uuid.uuid4().hex[:8]}"},
        models=[{"name": "*", "deployments": [{"provider": "fake", "model": "*", "price": PRICE}]}],
    )
    replicas = [await process_factory(env={"REDIS_URL": redis_url}, config_yaml=config) for _ in range(2)]
    nginx = Nginx(tmp_path / "nginx", free_port(), [r.port for r in replicas])
    nginx.start()
    try:
        yield Cluster(replicas, f"http://127.0.0.1:{nginx.port}", fake)
    finally:
        nginx.stop()


async def test_a_key_works_through_the_balancer_on_both_replicas(cluster: Cluster, api_key: str) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(6):
            async with session.post(f"{cluster.url}/v1/chat/completions", json=chat_body(), headers=auth(api_key)) as r:
                assert r.status == 200
        # Each replica answers the key on its own too.
        for replica in cluster.replicas:
            async with session.post(f"{replica.url}/v1/chat/completions", json=chat_body(stream=True), headers=auth(api_key)) as r:
                assert r.status == 200
                assert (await r.read()).endswith(b"data: [DONE]\n\n")


async def test_a_key_limit_is_counted_once_across_replicas(cluster: Cluster, key_factory: Any) -> None:
    # An hour's window, so the 20 calls never straddle a window's edge (they would fit 10 more).
    raw, _ = await key_factory(rate_limit_requests=10, rate_limit_window_seconds=3600)
    statuses = []
    # Fresh connections, so nginx spreads the requests over both replicas.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        for _ in range(20):
            async with session.post(f"{cluster.url}/v1/chat/completions", json=chat_body(), headers=auth(raw)) as r:
                statuses.append(r.status)
    assert statuses.count(200) == 10 and statuses.count(429) == 10, statuses
    assert (await cluster.fake.stats())["requests"] == 10
    # Both replicas took part (each one's own metrics count its share of the requests).
    async with aiohttp.ClientSession() as session:
        for replica in cluster.replicas:
            async with session.get(f"{replica.management_url}/metrics") as r:
                assert 'route="/v1/chat/completions"' in await r.text()


async def test_a_budget_is_shared_through_the_balancer(cluster: Cluster, key_factory: Any, db_pool: Any) -> None:
    # A call reserves its worst case before it is sent: the prompt's JSON bytes (about 0.05
    # USD here) plus max_tokens (0.02 USD for ten), or 8 USD for the default 4,096 output
    # tokens. A budget of 0.15 USD holds a few such calls, so real calls spend it.
    raw, record = await key_factory(budget_usd=Decimal("0.15"), budget_period="day", rate_limit_requests=1000)
    small = chat_body(max_tokens=10)
    statuses: list[int] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        # Calls go to either replica; spend reaches the other within about a second.
        for _ in range(60):
            async with session.post(f"{cluster.url}/v1/chat/completions", json=small, headers=auth(raw)) as r:
                statuses.append(r.status)
            if statuses[-2:] == [402, 402]:
                break
            await asyncio.sleep(0.05)
        assert statuses[0] == 200 and statuses[-2:] == [402, 402], statuses
        # Spent for good, on both replicas.
        for replica in cluster.replicas:
            for _ in range(60):
                async with session.post(f"{replica.url}/v1/chat/completions", json=small, headers=auth(raw)) as r:
                    status = r.status
                if status == 402:
                    break
                await asyncio.sleep(0.05)
            assert status == 402
    # Reservations are shared (Redis), so neither replica lets the key spend past its budget:
    # the ledger's rows of every served call add up to at most 0.15 USD.
    served = statuses.count(200)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # both replicas ship their rows
        if await db_pool.fetchval("SELECT count(*) FROM usage_ledger WHERE api_key_id = $1", record.api_key_id) >= served:
            break
        await asyncio.sleep(0.1)
    spent = await db_pool.fetchval("SELECT sum(cost_usd) FROM usage_ledger WHERE api_key_id = $1", record.api_key_id)
    assert served >= 1 and spent <= Decimal("0.15"), (statuses, spent)


async def test_revocation_holds_on_every_replica_within_a_second(cluster: Cluster, key_factory: Any, db_pool: Any) -> None:
    raw, record = await key_factory()
    async with aiohttp.ClientSession() as session:
        for replica in cluster.replicas:  # cache the key on both
            async with session.post(f"{replica.url}/v1/chat/completions", json=chat_body(), headers=auth(raw)) as r:
                assert r.status == 200
        await db_pool.execute("UPDATE api_keys SET is_active = false, revoked_at = now() WHERE api_key_id = $1", record.api_key_id)
        revoked_at = time.monotonic()
        pending = set(range(len(cluster.replicas)))
        while pending and time.monotonic() - revoked_at < 1.0:
            for i in list(pending):
                async with session.post(f"{cluster.replicas[i].url}/v1/chat/completions", json=chat_body(), headers=auth(raw)) as r:
                    if r.status == 401:
                        pending.discard(i)
            await asyncio.sleep(0.02)
        assert not pending, f"replicas {pending} still accept a key revoked a second ago"


async def test_a_replica_killed_mid_traffic_costs_only_its_in_flight_requests(cluster: Cluster, api_key: str) -> None:
    statuses: list[int] = []

    async def client(session: aiohttp.ClientSession, n: int) -> None:
        for _ in range(n):
            # Clients retry through the balancer, as the README advises.
            for _attempt in range(3):
                try:
                    async with session.post(f"{cluster.url}/v1/chat/completions", json=chat_body(), headers=auth(api_key)) as r:
                        await r.read()
                        if r.status < 500:
                            statuses.append(r.status)
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)
            else:
                statuses.append(599)

    async with aiohttp.ClientSession() as session:
        traffic = asyncio.gather(*(client(session, 30) for _ in range(4)))
        await asyncio.sleep(0.3)
        cluster.replicas[0].signal(signal.SIGKILL)
        await traffic
    assert len(statuses) == 120
    assert statuses.count(200) == 120, f"lost requests: {[s for s in statuses if s != 200]}"
