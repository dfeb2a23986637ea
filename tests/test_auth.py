"""AuthActor and AuthHandle (actors/auth.py) against the real test PostgreSQL.

Database round trips are counted with asyncpg's own query logger on the pool the actor
uses (the driver reports every statement it sends), and outages are real: a TCP proxy
in front of PostgreSQL is cut and restored (tests/chaos.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import aiohttp
import asyncpg
import pytest

import actors.auth
from actors.auth import AuthActor, AuthHandle, Unauthenticated
from actors.runtime import ActorStopped, Supervisor
from gateway.auth.keys import KeyPolicy, KeyStore, generate_key
from gateway.auth.negative import NegativeCache
from tests.conftest import FakeUpstream, auth, chat_body, config_for, until, via_proxy

LOOKUP = "FROM api_keys WHERE key_prefix = $1"
TOUCH = "SET last_used_at = now()"


@dataclass
class QueryLog:
    """Every statement the auth actor's pool sent, with its arguments."""

    sent: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)

    def count(self, needle: str) -> int:
        return sum(needle in query for query, _ in self.sent)

    def args_of(self, needle: str) -> list[tuple[Any, ...]]:
        return [args for query, args in self.sent if needle in query]


@dataclass
class Auth:
    handle: AuthHandle
    actor: AuthActor
    queries: QueryLog
    supervisor: Supervisor

    async def settle(self) -> None:
        """Let the driver's query-logger callbacks (scheduled with call_soon) run."""
        await asyncio.sleep(0.01)


async def accepted(handle: AuthHandle, token: str) -> bool:
    try:
        await handle.authenticate(token)
    except Unauthenticated:
        return False
    return True


@pytest.fixture
async def auth_factory(database_url: str) -> AsyncIterator[Callable[..., Any]]:
    """``await auth_factory(dsn=..., listen_dsn=...)`` → a started AuthActor and its handle."""
    started: list[tuple[Supervisor, asyncpg.Pool]] = []

    async def start(dsn: str = database_url, listen_dsn: str | None = None, *, wait_listening: bool = True) -> Auth:
        queries = QueryLog()

        async def init(conn: asyncpg.Connection) -> None:
            conn.add_query_logger(lambda record: queries.sent.append((record.query, tuple(record.args or ()))))

        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4, init=init)
        assert pool is not None
        supervisor = Supervisor()
        started.append((supervisor, pool))
        actor = AuthActor(pool, listen_dsn or dsn)
        ref = await supervisor.start(actor)
        handle = AuthHandle(actor, ref)
        if wait_listening:
            await until(lambda: handle.listening)
        return Auth(handle, actor, queries, supervisor)

    yield start
    for supervisor, pool in started:
        await supervisor.stop()
        await pool.close()


@pytest.fixture
def store(db_pool: asyncpg.Pool) -> KeyStore:
    return KeyStore(db_pool)


# ----------------------------------------------------------------------------- cache
async def test_a_cached_key_costs_no_query(auth_factory: Any, store: KeyStore) -> None:
    # Keys are created before the actor listens: a creation's own notification, arriving
    # after the first lookup, would evict the key and make the count race.
    raw, record = await store.create("cached", policy=KeyPolicy(rate_limit_requests=7))
    a = await auth_factory()
    key = await a.handle.authenticate(raw)
    assert key.api_key_id == record.api_key_id and key.policy.rate_limit_requests == 7
    for _ in range(50):
        assert (await a.handle.authenticate(raw)).api_key_id == record.api_key_id
    await a.settle()
    assert a.queries.count(LOOKUP) == 1


async def test_concurrent_misses_for_one_prefix_make_one_query(auth_factory: Any, store: KeyStore) -> None:
    raw, record = await store.create("concurrent")
    a = await auth_factory()
    forged = raw[:12] + generate_key()[12:]  # same lookup prefix, wrong secret
    results = await asyncio.gather(
        *(a.handle.authenticate(raw) for _ in range(20)),
        *(a.handle.authenticate(forged) for _ in range(5)),
        return_exceptions=True,
    )
    assert all(getattr(r, "api_key_id", None) == record.api_key_id for r in results[:20])
    assert all(isinstance(r, Unauthenticated) for r in results[20:])
    await a.settle()
    assert a.queries.count(LOOKUP) == 1


async def test_a_wrong_secret_fails_whether_or_not_the_prefix_is_cached(auth_factory: Any, store: KeyStore) -> None:
    a = await auth_factory()
    raw, _ = await store.create("secret")
    forged = raw[:12] + "A" * (len(raw) - 12)
    with pytest.raises(Unauthenticated):
        await a.handle.authenticate(forged)  # miss, then hash mismatch
    assert await accepted(a.handle, raw)
    with pytest.raises(Unauthenticated):
        await a.handle.authenticate(forged)  # hit, then hash mismatch


async def test_malformed_tokens_fail_without_a_query(auth_factory: Any) -> None:
    a = await auth_factory()
    for token in (None, "", "llmg_short", "llmg_" + "é" * 40, "llmg_" + "x" * 300):
        with pytest.raises(Unauthenticated):
            await a.handle.authenticate(token)
    await a.settle()
    assert a.queries.count(LOOKUP) == 0


async def test_unknown_prefixes_are_cached_negatively_for_a_while(
    auth_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = await auth_factory()
    unknown = generate_key()
    for _ in range(10):
        with pytest.raises(Unauthenticated):
            await a.handle.authenticate(unknown)
    await a.settle()
    assert a.queries.count(LOOKUP) == 1
    monkeypatch.setattr(actors.auth, "NEGATIVE_TTL", 0.05)
    other = generate_key()
    assert not await accepted(a.handle, other)
    await asyncio.sleep(0.1)
    assert not await accepted(a.handle, other)  # the entry expired: looked up again
    await a.settle()
    assert a.queries.count(LOOKUP) == 3


async def test_a_key_created_after_a_miss_works_at_once(auth_factory: Any, store: KeyStore) -> None:
    a = await auth_factory()
    raw = generate_key()
    assert not await accepted(a.handle, raw)  # now negatively cached
    await store.create("late", raw_key=raw)
    # The insert's notification evicts the negative entry: no waiting out its TTL.
    await until(lambda: raw[:12] not in a.actor._negative)
    assert await accepted(a.handle, raw)


# ----------------------------------------------------------------------------- key state
async def test_revoked_and_deactivated_keys_fail(auth_factory: Any, store: KeyStore, db_pool: asyncpg.Pool) -> None:
    a = await auth_factory()
    revoked, revoked_record = await store.create("to revoke")
    inactive, inactive_record = await store.create("to deactivate")
    assert await accepted(a.handle, revoked) and await accepted(a.handle, inactive)
    await store.revoke(str(revoked_record.api_key_id))
    await db_pool.execute("UPDATE api_keys SET is_active = false WHERE api_key_id = $1", inactive_record.api_key_id)
    await until(lambda: not a.handle._view.get(revoked[:12]) and not a.handle._view.get(inactive[:12]))
    assert not await accepted(a.handle, revoked)
    assert not await accepted(a.handle, inactive)


async def test_expiry_is_enforced_by_the_cache_itself(auth_factory: Any, store: KeyStore) -> None:
    expired, _ = await store.create("expired", expires_in=timedelta(seconds=-1))
    raw, record = await store.create("short-lived", expires_in=timedelta(seconds=1.5))
    a = await auth_factory()
    assert not await accepted(a.handle, expired)
    assert await accepted(a.handle, raw)
    assert record.expires_at is not None
    await asyncio.sleep(max(0.0, record.expires_at.timestamp() - time.time()) + 0.05)
    assert not await accepted(a.handle, raw)  # no notification needed: the cache checks expiry
    await a.settle()
    assert a.queries.count(LOOKUP) == 2  # one per key; the expiry check made none


# ----------------------------------------------------------------------------- last_used_at
async def test_last_used_at_is_written_in_one_batch(
    auth_factory: Any, store: KeyStore, db_pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(actors.auth, "TOUCH_FLUSH_SECONDS", 3600.0)  # only the stop flushes
    a = await auth_factory()
    first, first_record = await store.create("first")
    second, second_record = await store.create("second")
    for _ in range(100):
        await a.handle.authenticate(first)
        await a.handle.authenticate(second)
    ids = [first_record.api_key_id, second_record.api_key_id]
    await asyncio.sleep(0.05)
    query = "SELECT count(*) FROM api_keys WHERE api_key_id = ANY($1) AND last_used_at IS NOT NULL"
    assert await db_pool.fetchval(query, ids) == 0  # nothing written per request
    await a.supervisor.stop()  # stopping flushes what is pending
    await a.settle()
    assert await db_pool.fetchval(query, ids) == 2
    batches = a.queries.args_of(TOUCH)
    assert len(batches) == 1 and sorted(batches[0][0]) == sorted(ids)


async def test_last_used_at_is_flushed_periodically_and_keeps_the_cache(
    auth_factory: Any, store: KeyStore, db_pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(actors.auth, "TOUCH_FLUSH_SECONDS", 0.05)
    raw, record = await store.create("periodic")
    a = await auth_factory()
    await a.handle.authenticate(raw)
    deadline = time.monotonic() + 5
    while await db_pool.fetchval("SELECT last_used_at FROM api_keys WHERE api_key_id = $1", record.api_key_id) is None:
        assert time.monotonic() < deadline, "last_used_at never written"
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.1)  # a notification would have arrived by now
    # Writing last_used_at is no policy change: it does not evict the key everywhere.
    await a.handle.authenticate(raw)
    await a.settle()
    assert a.queries.count(LOOKUP) == 1


# ----------------------------------------------------------------------------- LISTEN / outages
async def test_lost_notifications_are_made_up_by_revalidation_on_reconnect(
    pg_proxy: Any, auth_factory: Any, store: KeyStore, database_url: str
) -> None:
    # Queries go direct; only the LISTEN connection runs through the proxy.
    revoked, revoked_record = await store.create("revoked while deaf")
    kept, _ = await store.create("kept")
    a = await auth_factory(listen_dsn=via_proxy(database_url, pg_proxy.port))
    assert await accepted(a.handle, revoked) and await accepted(a.handle, kept)
    await pg_proxy.cut()
    await until(lambda: not a.handle.listening)
    await store.revoke(str(revoked_record.api_key_id))  # its notification is lost to this replica
    await asyncio.sleep(0.2)
    assert await accepted(a.handle, revoked)  # still cached: the actor could not know
    await pg_proxy.restore()
    await until(lambda: a.handle.listening)
    await until(lambda: revoked[:12] not in a.handle._view)
    assert not await accepted(a.handle, revoked)
    assert await accepted(a.handle, kept)


async def test_through_a_database_outage_cached_keys_work_and_unknown_keys_fail_closed(
    pg_proxy: Any, gateway_factory: Any, fake: FakeUpstream, database_url: str, store: KeyStore
) -> None:
    # Created before the gateway listens, so no late creation notice evicts a cached key.
    cached, _ = await store.create("cached before the outage")
    later, _ = await store.create("first used during the outage")
    gw = await gateway_factory(
        env={"DATABASE_URL": via_proxy(database_url, pg_proxy.port)}, config_yaml=config_for(fake.url)
    )

    async def status(key: str) -> int:
        resp = await gw.data.post("/v1/chat/completions", json=chat_body(), headers=auth(key))
        await resp.read()
        return resp.status

    async def ready() -> int:
        resp = await gw.data.get("/readyz")
        await resp.read()
        return resp.status

    await until_async(lambda: ready(), 200)
    assert await status(cached) == 200
    await pg_proxy.cut()
    for _ in range(3):
        assert await status(cached) == 200
    assert await status(later) == 401  # fails closed...
    assert await status(generate_key()) == 401
    resp = await gw.data.get("/readyz")
    assert resp.status == 503 and (await resp.json())["checks"]["database"].startswith("unreachable")
    await pg_proxy.restore()
    # ... and recovers by itself: the failure was not cached as "unknown".
    await until_async(lambda: status(later), 200, timeout=15)
    await until_async(lambda: ready(), 200, timeout=15)
    assert await status(cached) == 200


async def until_async(probe: Callable[[], Any], expected: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while (got := await probe()) != expected:
        if time.monotonic() > deadline:
            raise AssertionError(f"expected {expected!r}, still {got!r}")
        await asyncio.sleep(0.05)


async def test_revocation_reaches_a_second_gateway_process_within_a_second(
    process_factory: Any, store: KeyStore
) -> None:
    first, second = await asyncio.gather(process_factory(), process_factory())
    raw, record = await store.create("replicated")
    async with aiohttp.ClientSession() as session:

        async def status(gateway: Any) -> int:
            async with session.get(f"{gateway.url}/v1/models", headers=auth(raw)) as resp:
                await resp.read()
                return resp.status

        for gateway in (first, second):
            assert await status(gateway) == 200
            assert await status(gateway) == 200  # now served from that process's cache
        await store.revoke(str(record.api_key_id))
        revoked_at = time.monotonic()
        seen: dict[int, float] = {}
        while len(seen) < 2 and time.monotonic() - revoked_at < 5:
            for gateway in (first, second):
                if gateway.port not in seen and await status(gateway) == 401:
                    seen[gateway.port] = time.monotonic() - revoked_at
            await asyncio.sleep(0.01)
    assert len(seen) == 2, f"revocation not seen everywhere within 5 s: {seen}"
    assert max(seen.values()) <= 1.0, seen


async def test_a_stopped_auth_actor_flushes_and_closes_its_listener(auth_factory: Any, store: KeyStore) -> None:
    a = await auth_factory()
    raw, _ = await store.create("stop")
    await a.handle.authenticate(raw)
    listener = a.actor._listener
    assert listener is not None
    await a.supervisor.stop()
    assert listener.is_closed()
    with pytest.raises(ActorStopped):  # an uncached key needs the actor, which takes no more work
        await a.handle.authenticate(generate_key())



async def test_a_revocation_during_a_lookup_is_not_undone_by_the_lookup(
    pg_proxy: Any, auth_factory: Any, store: KeyStore, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(actors.auth, "TOUCH_FLUSH_SECONDS", 3600.0)  # only lookups use the pool
    # Lookups go through the proxy (so their answers can be held back); LISTEN goes direct.
    warm, _ = await store.create("warms the prepared lookup statement")
    raw, record = await store.create("revoked mid-lookup")
    a = await auth_factory(via_proxy(database_url, pg_proxy.port), listen_dsn=database_url)
    assert await accepted(a.handle, warm)
    pg_proxy.pause()
    lookup = asyncio.ensure_future(accepted(a.handle, raw))
    await until(lambda: pg_proxy.held_bytes > 0)  # the server answered "active"; the answer waits
    await store.revoke(str(record.api_key_id))
    await asyncio.sleep(0.2)  # the revocation's notification reaches the actor first
    pg_proxy.resume()
    assert await lookup  # it raced the revocation and read the row before it: fair for this request
    assert not await accepted(a.handle, raw)  # but the stale answer must not stay cached


# ----------------------------------------------------------------------------- negative cache
def test_negative_cache_forgets_entries_once_they_expire() -> None:
    now = [100.0]
    cache = NegativeCache(10, clock=lambda: now[0])
    cache.add("llmg_aaaaaaa", "unknown", 5.0)
    assert cache.get("llmg_aaaaaaa") == "unknown" and "llmg_aaaaaaa" in cache
    now[0] += 5.0
    assert cache.get("llmg_aaaaaaa") is None and "llmg_aaaaaaa" not in cache
    assert len(cache) == 0


def test_negative_cache_stays_bounded_and_drops_the_oldest_first() -> None:
    now = [0.0]
    cache = NegativeCache(1000, clock=lambda: now[0])
    for i in range(5000):
        cache.add(f"p{i}", "unknown", 60.0)
    assert len(cache) == 1000
    assert "p3999" not in cache and "p4000" in cache and "p4999" in cache


def test_negative_cache_prunes_expired_entries_on_insert_without_a_scan() -> None:
    now = [0.0]
    cache = NegativeCache(1_000_000, clock=lambda: now[0])
    for i in range(1000):
        cache.add(f"old{i}", "unknown", 5.0)
    now[0] = 6.0
    cache.add("new", "revoked", 5.0)
    assert len(cache) == 1  # expired entries left on the first insert after they expired


def test_negative_cache_insert_cost_does_not_grow_with_its_size() -> None:
    def seconds_for_inserts(size: int) -> float:
        cache = NegativeCache(size)
        for i in range(size):
            cache.add(f"fill{i}", "unknown", 3600.0)
        started = time.perf_counter()
        for i in range(2000):
            cache.add(f"more{i}", "unknown", 3600.0)
        return time.perf_counter() - started

    # A scan per insert made 2,000 inserts into 200,000 entries ~100x slower than into 2,000.
    assert seconds_for_inserts(200_000) < 20 * seconds_for_inserts(2_000) + 0.05


async def test_a_flood_of_unknown_keys_keeps_the_actor_negative_cache_bounded(auth_factory: Any) -> None:
    a = await auth_factory()
    a.actor._negative.max_entries = 50
    for _ in range(120):
        assert not await accepted(a.handle, generate_key())
    assert len(a.actor._negative) == 50
