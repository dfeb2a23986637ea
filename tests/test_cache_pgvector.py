"""The semantic cache's pgvector index: against the embedded PostgreSQL, which ships pgvector.

The shared test PostgreSQL has no pgvector, so this module starts its own embedded server
(``pgserver``, PostgreSQL 16 with pgvector) once per session and points ``database_url``
(and so every gateway, key and pool fixture here) at it. Without ``pgserver`` it skips.
The fallback to the in-process index is tested against the shared server in
tests/test_cache_semantic.py.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import asyncpg
import pytest
import yaml

from gateway.core.db import migrate
from tests.cache_helpers import ask, cached_config, upstream_calls
from tests.conftest import FakeUpstream, Gateway
from tests.test_cache_semantic import needs_local_model


@pytest.fixture(scope="session")
def pgvector_server_url() -> Iterator[str]:
    """A migrated database in an embedded PostgreSQL 16 with pgvector, for this session."""
    pgserver = pytest.importorskip("pgserver", reason="the embedded PostgreSQL (pgserver) ships pgvector")
    # Under /tmp: as root, pgserver chmods every parent of its directory.
    home = tempfile.mkdtemp(prefix="llmg-pgvector-", dir="/tmp")
    server = pgserver.get_server(home, cleanup_mode="stop")
    url = str(server.get_uri("postgres"))

    async def migrated() -> None:
        conn = await asyncpg.connect(url)
        try:
            await migrate(conn)
        finally:
            await conn.close()

    asyncio.run(migrated())
    try:
        yield url
    finally:
        server.cleanup()
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def database_url(pgvector_server_url: str) -> str:
    """Every gateway, key and pool of this module uses the pgvector database."""
    return pgvector_server_url


def _config(fake: FakeUpstream, *, embedder: str = "local", **policy: Any) -> tuple[str, str]:
    """A config with one semantic group on the pgvector index; returns (yaml, group name)."""
    group = f"cached-{uuid.uuid4().hex[:6]}"  # the table is shared by the module's tests
    config = cached_config(
        fake.url, {"mode": "semantic", **policy}, name=group,
        semantic={"embedder": embedder, "max_wait_ms": 5000, "index": "pgvector"},
    )
    if embedder != "local":
        doc = yaml.safe_load(config)
        doc["models"].insert(0, {"name": embedder, "deployments": [{"provider": "fake", "model": "mock-embedding"}]})
        config = yaml.safe_dump(doc)
    return config, group


async def _vectors_stored(gw: Gateway, count: int) -> None:
    """Wait (bounded) until ``count`` vectors are committed to PostgreSQL."""
    counters = gw.state.cache.counters
    for _ in range(500):
        if counters.vectors_stored >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{counters.vectors_stored} vectors stored (errors: {counters.vector_errors}), expected {count}")


async def _rows(database_url: str, group: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(database_url)
    try:
        return await conn.fetch(
            "SELECT key, scope, partition, expires_at - created_at AS ttl FROM semantic_vectors WHERE model_group = $1",
            group,
        )
    finally:
        await conn.close()




@needs_local_model
async def test_a_paraphrase_is_served_from_the_pgvector_index(
    gateway_factory: Callable[..., Any], fake: FakeUpstream, api_key: str, database_url: str
) -> None:
    config, group = _config(fake)
    gw = await gateway_factory(config_yaml=config, env={"ADMIN_TOKEN": "t" * 32})
    admin = await gw.management.get("/admin/cache", headers={"Authorization": "Bearer " + "t" * 32})
    assert admin.status == 200
    assert (await admin.json())["semantic_index"] == "pgvector"
    first, answer = await ask(gw, api_key, "How do I reset my password?", model=group)
    assert first.headers["x-gateway-cache"] == "miss"
    await _vectors_stored(gw, 1)
    rows = await _rows(database_url, group)
    assert [r["key"] for r in rows] == [first.headers["x-gateway-cache-key"]]
    assert len(gw.state.cache._actor._index) == 0  # nothing in the in-process index
    para, served = await ask(gw, api_key, "How can I reset my password?", model=group)
    assert para.headers["x-gateway-cache"] == "hit" and served == answer
    assert 0.95 <= float(para.headers["x-gateway-cache-similarity"]) <= 1.0
    near, _ = await ask(gw, api_key, "How do I reset my username?", model=group)
    assert near.headers["x-gateway-cache"] == "miss"
    assert await upstream_calls(fake) == 2
    assert gw.state.cache.counters.semantic_hits == 1


async def test_two_gateways_on_one_database_share_vectors_without_redis(
    gateway_factory: Callable[..., Any], fake: FakeUpstream, api_key: str, database_url: str
) -> None:
    # The deployment embedder (the fake's deterministic vectors): the same text is similarity 1,
    # found by the second gateway only through the shared table, since neither has Redis.
    config, group = _config(fake, embedder="embedder", threshold=0.99)
    one = await gateway_factory(config_yaml=config)
    two = await gateway_factory(config_yaml=config)
    assert two.state.cache.stats()["shared"] is False
    stored, answer = await ask(one, api_key, "what is the boiling point of water", model=group)
    assert stored.headers["x-gateway-cache"] == "miss"
    await _vectors_stored(one, 1)
    hit, served = await ask(two, api_key, "what is the boiling point of water", model=group)
    assert hit.headers["x-gateway-cache"] == "hit" and served == answer
    assert float(hit.headers["x-gateway-cache-similarity"]) == pytest.approx(1.0, abs=1e-4)
    assert await upstream_calls(fake) == 1
    # The answer came with the vector's row: the second gateway now holds it in memory too.
    for _ in range(100):
        if two.state.cache.stats()["entries"] == 1:
            break
        await asyncio.sleep(0.01)
    assert two.state.cache.stats()["entries"] == 1
    # A purge on one gateway removes the shared vector for both.
    await one.state.cache.purge(group=group)
    assert await _rows(database_url, group) == []


@needs_local_model
async def test_partitions_never_cross_in_the_table(
    gateway_factory: Callable[..., Any], fake: FakeUpstream, key_factory: Callable[..., Any], database_url: str
) -> None:
    config, group = _config(fake)
    gw = await gateway_factory(config_yaml=config)
    owner, _ = await key_factory("owner", subject_id=uuid.uuid4())
    stranger, _ = await key_factory("stranger", subject_id=uuid.uuid4())
    await ask(gw, owner, "What is the capital of France?", model=group)
    await _vectors_stored(gw, 1)
    paraphrase = "What's the capital city of France?"
    hit, _ = await ask(gw, owner, paraphrase, model=group)
    assert hit.headers["x-gateway-cache"] == "hit"
    other_tenant, _ = await ask(gw, stranger, paraphrase, model=group)
    assert other_tenant.headers["x-gateway-cache"] == "miss"
    with_system = {"messages": [{"role": "system", "content": "Answer in French."},
                                {"role": "user", "content": paraphrase}]}
    resp, _ = await ask(gw, owner, "ignored", model=group, **with_system)
    assert resp.headers["x-gateway-cache"] == "miss"
    await _vectors_stored(gw, 3)
    rows = await _rows(database_url, group)
    assert len({r["partition"] for r in rows}) == 3 and len({r["scope"] for r in rows}) == 2


async def test_expired_vectors_are_never_served_and_are_swept(
    gateway_factory: Callable[..., Any], fake: FakeUpstream, api_key: str, database_url: str
) -> None:
    config, group = _config(fake, embedder="embedder", threshold=0.99, ttl_seconds=1)
    one = await gateway_factory(config_yaml=config)
    two = await gateway_factory(config_yaml=config)  # nothing in its memory: only the table could answer
    await ask(one, api_key, "a question that expires", model=group)
    second, _ = await ask(one, api_key, "another question that expires", model=group)
    await _vectors_stored(one, 2)
    rows = await _rows(database_url, group)
    assert len(rows) == 2 and all(r["ttl"].total_seconds() <= 1.5 for r in rows)
    await asyncio.sleep(1.2)
    # Still in the table, but expired: not served.
    again, _ = await ask(two, api_key, "a question that expires", model=group)
    assert again.headers["x-gateway-cache"] == "miss"
    one.state.cache._actor.post_internal("sweep")
    gone = second.headers["x-gateway-cache-key"]
    for _ in range(300):
        if gone not in {r["key"] for r in await _rows(database_url, group)}:
            break
        await asyncio.sleep(0.01)
    assert gone not in {r["key"] for r in await _rows(database_url, group)}


async def test_the_table_is_bounded_by_max_vectors(
    gateway_factory: Callable[..., Any], fake: FakeUpstream, api_key: str, database_url: str
) -> None:
    config, group = _config(fake, embedder="embedder", threshold=0.99)
    doc = yaml.safe_load(config)
    doc["cache"]["semantic"]["max_vectors"] = 2
    gw = await gateway_factory(config_yaml=yaml.safe_dump(doc))
    await gw.state.cache.purge(everything=True)  # the table is shared by this module's tests
    keys = []
    for n in range(3):
        resp, _ = await ask(gw, api_key, f"question number {n}", model=group)
        keys.append(resp.headers["x-gateway-cache-key"])
        await _vectors_stored(gw, n + 1)
    gw.state.cache._actor.post_internal("sweep")
    for _ in range(300):
        if len(await _rows(database_url, group)) == 2 and gw.state.cache.stats()["vectors"] == 2:
            break
        await asyncio.sleep(0.01)
    assert {r["key"] for r in await _rows(database_url, group)} == set(keys[1:])  # the oldest went
    assert gw.state.cache.stats()["vectors"] == 2


async def test_a_blocked_search_does_not_hold_a_miss_past_its_budget(
    gateway_factory: Callable[..., Any], fake: FakeUpstream, api_key: str, database_url: str
) -> None:
    config, group = _config(fake, embedder="embedder", threshold=0.99)
    doc = yaml.safe_load(config)
    doc["cache"]["semantic"]["max_wait_ms"] = 500  # the fake embeds in a few ms; the search never answers
    gw = await gateway_factory(config_yaml=yaml.safe_dump(doc))
    blocker = await asyncpg.connect(database_url)
    try:
        async with blocker.transaction():
            await blocker.execute("LOCK TABLE semantic_vectors IN ACCESS EXCLUSIVE MODE")
            resp, _ = await ask(gw, api_key, "asked while the table is locked", model=group)
            assert resp.headers["x-gateway-cache"] == "miss" and resp.status == 200
            assert gw.state.cache.counters.semantic_timeouts == 1
    finally:
        await blocker.close()
    await _vectors_stored(gw, 1)  # the write waited for the lock, then went through
