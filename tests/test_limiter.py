"""The LimiterActor through its handle: exact counts at the boundary for each strategy and
storage (memory, Redis, PostgreSQL), refunds, tokens, concurrency and the seed's table.

Windows are an hour long so a test never straddles a window edge (the memory sliding
window is aligned to the clock); Redis keys carry a prefix unique to the test.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import asyncpg
import pytest
from limits import RateLimitItemPerSecond
from limits.aio.strategies import SlidingWindowCounterRateLimiter

from actors.auth import VerifiedKey
from actors.limiter import LimiterActor, LimiterHandle, Permit, reset_header
from actors.runtime import Supervisor
from gateway.auth.keys import KeyPolicy
from gateway.core.config import RateLimitSettings
from gateway.core.errors import RateLimited
from gateway.http.errors import error_response
from gateway.limits.storage import LocalStorage, PostgresWindowStorage, RedisWindowStorage, Windows

HOUR = 3600

STORAGE_STRATEGIES = [
    ("memory", "sliding-window"),
    ("memory", "fixed-window"),
    ("redis", "sliding-window"),
    ("redis", "fixed-window"),
    ("postgres", "fixed-window"),
]


class Limiter:
    """A started LimiterActor, its handle, and what tests peek at."""

    def __init__(self, actor: LimiterActor, handle: LimiterHandle) -> None:
        self.actor = actor
        self.handle = handle

    def windows(self, scope: str = "requests") -> Windows:
        store = self.actor._requests if scope == "requests" else self.actor._shared
        assert store is not None
        return store.current()


@pytest.fixture
async def limiter_factory(
    redis_url: str, db_pool: asyncpg.Pool
) -> AsyncIterator[Callable[..., Any]]:
    supervisors: list[Supervisor] = []
    redis_prefixes: list[str] = []

    async def start(
        storage: str = "memory", strategy: str = "sliding-window", lease_seconds: float = 30.0, **settings: Any
    ) -> Limiter:
        prefix = f"test-{uuid.uuid4().hex[:12]}"
        redis_prefixes.append(prefix)
        url = {"memory": "memory://", "redis": redis_url, "postgres": "postgres"}.get(storage, storage)
        options = {"per_ip": "off", **settings}
        actor = LimiterActor(
            RateLimitSettings(storage=url, strategy=strategy, key_prefix=prefix, **options), pool=db_pool,
            lease_seconds=lease_seconds,
        )
        supervisor = Supervisor()
        supervisors.append(supervisor)
        ref = await supervisor.start(actor)
        return Limiter(actor, LimiterHandle(actor, ref))

    yield start
    for supervisor in supervisors:
        await supervisor.stop()
    cleaner = RedisWindowStorage(redis_url, key_prefix="unused")
    for prefix in redis_prefixes:
        async for key in cleaner._client.scan_iter(match=f"{prefix}:*"):
            await cleaner._client.delete(key)
    await cleaner.close()


@pytest.fixture
async def verified_key(key_factory: Callable[..., Any]) -> Callable[..., Any]:
    """``await verified_key(**policy)`` → a VerifiedKey of a real row (PostgreSQL needs the row)."""

    async def make(**policy: Any) -> VerifiedKey:
        _raw, record = await key_factory(**policy)
        return VerifiedKey(
            api_key_id=record.api_key_id, subject_id=record.subject_id, name=record.name,
            key_prefix=record.key_prefix, key_hash=b"\0" * 32, policy=KeyPolicy(**policy), expires_at=None,
        )

    return make


async def outcome(handle: LimiterHandle, key: VerifiedKey) -> Permit | RateLimited:
    try:
        return await handle.acquire(key)
    except RateLimited as exc:
        return exc


def test_reset_header_is_written_like_openai() -> None:
    assert reset_header(0) == "0ms"
    assert reset_header(0.0201) == "21ms"
    assert reset_header(1) == "1s"
    assert reset_header(1.5) == "1.5s"
    assert reset_header(60) == "1m0s"
    assert reset_header(360) == "6m0s"
    assert reset_header(3723.5) == "1h2m3.5s"
    assert reset_header(-3) == "0ms"


@pytest.mark.parametrize(("storage", "strategy"), STORAGE_STRATEGIES)
async def test_requests_are_exact_at_the_boundary(
    limiter_factory: Any, verified_key: Any, storage: str, strategy: str
) -> None:
    limiter = await limiter_factory(storage, strategy)
    key = await verified_key(rate_limit_requests=5, rate_limit_window_seconds=HOUR)
    remaining = []
    for _ in range(5):
        permit = await limiter.handle.acquire(key)
        assert permit.headers["x-ratelimit-limit-requests"] == "5"
        remaining.append(permit.headers["x-ratelimit-remaining-requests"])
        permit.release()
    assert remaining == ["4", "3", "2", "1", "0"]
    for _ in range(3):
        with pytest.raises(RateLimited) as caught:
            await limiter.handle.acquire(key)
        error = caught.value
        assert error.status == 429 and error.error_code == "rate_limit_exceeded"
        assert error.headers["x-ratelimit-remaining-requests"] == "0"
        assert error.retry_after is not None and 0 < error.retry_after <= HOUR
        response = error_response(error)
        assert 1 <= int(response.headers["Retry-After"]) <= HOUR
    # A rejected request consumes nothing: the window still holds exactly five.
    assert await stored_count(limiter, key, 5, HOUR) == 5
    assert limiter.actor.rejections["requests"] == 3


async def stored_count(limiter: Limiter, key: VerifiedKey, limit: int, seconds: int) -> int:
    """What the storage itself holds for the key's request window (no clamping)."""
    windows = limiter.windows()
    item = RateLimitItemPerSecond(limit, seconds)
    storage_key = item.key_for("req", str(key.api_key_id))
    storage: Any = windows.storage
    if isinstance(windows.strategy, SlidingWindowCounterRateLimiter):
        previous, _, current, _ = await storage.get_sliding_window(storage_key, seconds)
        return int(previous + current)
    return int(await storage.get(storage_key))


@pytest.mark.parametrize(("storage", "strategy"), STORAGE_STRATEGIES)
async def test_concurrent_requests_get_exactly_the_limit(
    limiter_factory: Any, verified_key: Any, storage: str, strategy: str
) -> None:
    limiter = await limiter_factory(storage, strategy)
    key = await verified_key(rate_limit_requests=10, rate_limit_window_seconds=HOUR)
    pipelines_before = limiter.actor.redis.pipelines if limiter.actor.redis else 0
    results = await asyncio.gather(*(outcome(limiter.handle, key) for _ in range(30)))
    allowed = [r for r in results if isinstance(r, Permit)]
    assert len(allowed) == 10
    assert all(isinstance(r, RateLimited) for r in results if not isinstance(r, Permit))
    assert await stored_count(limiter, key, 10, HOUR) == 10
    if limiter.actor.redis is not None:
        # 30 requests, each 2-3 commands, plus refunds of the rejected: a few pipelines, not ~90 trips.
        assert limiter.actor.redis.pipelines - pipelines_before <= 6


@pytest.mark.parametrize(("storage", "strategy"), STORAGE_STRATEGIES)
async def test_a_negative_add_refunds(limiter_factory: Any, verified_key: Any, storage: str, strategy: str) -> None:
    limiter = await limiter_factory(storage, strategy)
    key = await verified_key(rate_limit_requests=3, rate_limit_window_seconds=HOUR)
    for _ in range(3):
        (await limiter.handle.acquire(key)).release()
    windows = limiter.windows()
    item = RateLimitItemPerSecond(3, HOUR)
    await windows.add(item, "req", str(key.api_key_id), amount=-1)
    assert await stored_count(limiter, key, 3, HOUR) == 2
    permit = await limiter.handle.acquire(key)
    assert permit.headers["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(RateLimited):
        await limiter.handle.acquire(key)


@pytest.mark.parametrize("storage", ["memory", "redis"])
@pytest.mark.parametrize("strategy", ["sliding-window", "fixed-window"])
async def test_tokens_are_checked_before_and_charged_after(
    limiter_factory: Any, verified_key: Any, storage: str, strategy: str
) -> None:
    if strategy == "sliding-window" and storage == "memory":
        await away_from_minute_edge()
    limiter = await limiter_factory(storage, strategy)
    key = await verified_key(rate_limit_requests=100, rate_limit_window_seconds=HOUR, tokens_per_minute=100)
    permit = await limiter.handle.acquire(key)
    assert permit.headers["x-ratelimit-limit-tokens"] == "100"
    assert permit.headers["x-ratelimit-remaining-tokens"] == "100"
    assert permit.headers["x-ratelimit-reset-tokens"] == "0ms"
    permit.charge(70)
    permit.release()
    permit.release()  # a second release changes nothing
    permit = await eventually_acquire(limiter.handle, key, lambda p: p.headers["x-ratelimit-remaining-tokens"] == "30")
    # Past the limit: real usage always counts, even when it overshoots what was left.
    permit.charge(45)
    permit.release()
    await asyncio.sleep(0.05)
    requests_before = await stored_count(limiter, key, 100, HOUR)
    with pytest.raises(RateLimited) as caught:
        await limiter.handle.acquire(key)
    assert caught.value.headers["x-ratelimit-remaining-tokens"] == "0"
    assert "tokens" in caught.value.message
    assert 1 <= int(error_response(caught.value).headers["Retry-After"]) <= 60
    # The request hit counted alongside was given back.
    assert await stored_count(limiter, key, 100, HOUR) == requests_before
    assert limiter.actor.rejections["tokens"] == 1


async def test_a_memory_permit_released_after_the_windows_changed_charges_the_ones_in_use(
    limiter_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # release_permit_now: with the grant's windows still in use, the permit's own counters
    # take its tokens; once they changed (a storage outage or recovery, here simulated),
    # the windows in use then do. Either way the slot is freed.
    clock = [1_000_000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    limiter = await limiter_factory()
    key = VerifiedKey(
        api_key_id=uuid.uuid4(), subject_id=uuid.uuid4(), name="k", key_prefix="llmg_k", key_hash=b"\0" * 32,
        policy=KeyPolicy(rate_limit_requests=100, rate_limit_window_seconds=60, tokens_per_minute=1000, max_concurrent=2),
        expires_at=None,
    )
    key_id = str(key.api_key_id)
    kept = await limiter.handle.acquire(key)
    moved = await limiter.handle.acquire(key)
    assert limiter.actor.inflight[key_id] == 2
    kept.charge(100)
    kept.release()
    assert limiter.actor.inflight[key_id] == 1
    limiter.actor._stores_changed()  # new windows generation: the permit's counters are stale
    moved.charge(250)
    moved.release()
    assert key_id not in limiter.actor.inflight
    assert limiter.actor._shared is not None
    windows = limiter.actor._shared.current()
    stats = windows.stats_now(limiter.actor._item(1000, 60), "tok", key_id, now=clock[0])
    assert stats.remaining == 1000 - 350


async def away_from_minute_edge() -> None:
    """The memory sliding window is aligned to the clock: keep a token test off its edge."""
    into = time.time() % 60
    if into > 55:
        await asyncio.sleep(60 - into + 0.1)


async def eventually_acquire(handle: LimiterHandle, key: VerifiedKey, ok: Callable[[Permit], bool]) -> Permit:
    """Releases are tells: acquire until the effect of the last one shows (bounded)."""
    last: Permit | RateLimited | None = None
    for _ in range(50):
        last = await outcome(handle, key)
        if isinstance(last, Permit):
            if ok(last):
                return last
            last.release()
        await asyncio.sleep(0.02)
    raise AssertionError(f"condition never held; last answer {last!r}")


@pytest.mark.parametrize("storage", ["memory", "redis"])
async def test_concurrency_is_held_until_released_exactly_once(
    limiter_factory: Any, verified_key: Any, storage: str
) -> None:
    limiter = await limiter_factory(storage)
    key = await verified_key(rate_limit_requests=100, rate_limit_window_seconds=HOUR, max_concurrent=2)
    first, second = await limiter.handle.acquire(key), await limiter.handle.acquire(key)
    assert first.holds_slot and second.holds_slot
    with pytest.raises(RateLimited) as caught:
        await limiter.handle.acquire(key)
    assert "concurrent" in caught.value.message
    # The refused request consumed no request from the window.
    assert caught.value.headers["x-ratelimit-remaining-requests"] == "98"
    first.release()
    first.release()
    first.release()
    third = await eventually_acquire(limiter.handle, key, lambda p: True)
    with pytest.raises(RateLimited):
        await limiter.handle.acquire(key)  # the triple release freed one slot, not three
    second.release()
    third.release()
    await asyncio.sleep(0.05)
    assert await slots_held(limiter, key) == 0
    assert limiter.actor.rejections["concurrency"] == 2


async def slots_held(limiter: Limiter, key: VerifiedKey) -> int:
    if limiter.actor.redis is not None:
        return await limiter.actor.redis.slots_held(f"conc/{key.api_key_id}")
    return limiter.actor.inflight.get(str(key.api_key_id), 0)


@pytest.mark.parametrize("storage", ["memory", "redis"])
async def test_a_grant_whose_asker_gave_up_is_undone(limiter_factory: Any, verified_key: Any, storage: str) -> None:
    limiter = await limiter_factory(storage)
    key = await verified_key(rate_limit_requests=100, rate_limit_window_seconds=HOUR, max_concurrent=1)
    for _ in range(5):
        task = asyncio.ensure_future(limiter.handle.acquire(key))
        await asyncio.sleep(0)
        if storage == "memory":
            # Memory decides in the caller's task without waiting: nothing to give up on.
            assert task.done()
            (await task).release()
            continue
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    permit = await eventually_acquire(limiter.handle, key, lambda p: True)
    permit.release()
    await asyncio.sleep(0.05)
    assert await slots_held(limiter, key) == 0


async def test_redis_leases_outlive_no_request(limiter_factory: Any, verified_key: Any) -> None:
    """A held slot is renewed while its request runs; a lost one expires with its lease."""
    limiter = await limiter_factory("redis", lease_seconds=0.3)
    key = await verified_key(rate_limit_requests=100, rate_limit_window_seconds=HOUR, max_concurrent=1)
    permit = await limiter.handle.acquire(key)
    await asyncio.sleep(0.8)  # longer than a lease: renewals keep it
    with pytest.raises(RateLimited):
        await limiter.handle.acquire(key)
    # A lease whose holder vanished (no renewal, no release) frees itself.
    assert limiter.actor.redis is not None
    limiter.actor._held.clear()
    await asyncio.sleep(0.5)
    (await limiter.handle.acquire(key)).release()
    permit.release()


async def test_postgres_storage_writes_the_seed_table(
    limiter_factory: Any, verified_key: Any, db_pool: asyncpg.Pool
) -> None:
    limiter = await limiter_factory("postgres")
    assert "per-key requests in postgres" in limiter.actor.description
    key = await verified_key(rate_limit_requests=3, rate_limit_window_seconds=HOUR)
    for _ in range(3):
        (await limiter.handle.acquire(key)).release()
    for _ in range(4):
        with pytest.raises(RateLimited):
            await limiter.handle.acquire(key)
    rows = await db_pool.fetch(
        "SELECT window_start_at, window_seconds, request_count FROM api_key_rate_limit_windows WHERE api_key_id = $1",
        key.api_key_id,
    )
    assert len(rows) == 1
    row = rows[0]
    assert row["window_seconds"] == HOUR and row["request_count"] == 3  # the rejections wrote nothing
    assert row["window_start_at"].timestamp() % HOUR == 0
    assert row["window_start_at"].timestamp() <= time.time() < row["window_start_at"].timestamp() + HOUR


async def test_postgres_guarded_upsert_under_concurrency(db_pool: asyncpg.Pool, verified_key: Any) -> None:
    key = await verified_key(rate_limit_requests=7, rate_limit_window_seconds=HOUR)
    windows = Windows("postgres", PostgresWindowStorage(db_pool), "fixed-window")
    item = RateLimitItemPerSecond(7, HOUR)
    oks = await asyncio.gather(*(windows.hit(item, "req", str(key.api_key_id)) for _ in range(20)))
    assert sum(oks) == 7
    count = await db_pool.fetchval(
        "SELECT request_count FROM api_key_rate_limit_windows WHERE api_key_id = $1", key.api_key_id
    )
    assert count == 7
    stats = await windows.stats(item, "req", str(key.api_key_id))
    assert stats.remaining == 0 and 0 < stats.reset_time - time.time() <= HOUR


async def test_per_ip_guard_with_and_without_burst(limiter_factory: Any) -> None:
    # per_ip is the allowance of failed attempts: each attempt peeks, then fails.
    plain = await limiter_factory(per_ip="5/minute", per_ip_burst=0)
    results = [await failed_attempt(plain.handle, "10.0.0.1") for _ in range(8)]
    assert results.count(None) == 5
    for refused in results[5:]:
        assert isinstance(refused, RateLimited)
        assert 1 <= int(error_response(refused).headers["Retry-After"]) <= 60
    assert await failed_attempt(plain.handle, "10.0.0.2") is None  # another address has its own window
    bursty = await limiter_factory(per_ip="5/minute", per_ip_burst=3)
    results = [await failed_attempt(bursty.handle, "10.0.0.1") for _ in range(10)]
    assert results.count(None) == 8
    assert bursty.actor.rejections["ip"] == 2
    off = await limiter_factory(per_ip="off", per_ip_all="off")
    assert not off.actor.guards_ip


async def failed_attempt(handle: LimiterHandle, ip: str) -> RateLimited | None:
    """One request that would cost a key lookup and then fails authentication."""
    refused = await guard(handle, ip, "peek")
    if refused is None:
        await handle.check_ip(ip, "failed")
    return refused


async def test_per_ip_all_caps_every_request_and_failures_do_not_spend_it(limiter_factory: Any) -> None:
    limiter = await limiter_factory(per_ip="2/minute", per_ip_burst=0, per_ip_all="20/minute")
    # Authenticated traffic never peeks at or spends the failure allowance.
    results = [await guard(limiter.handle, "10.0.0.9") for _ in range(45)]
    assert results.count(None) == 40  # 20 per minute plus a burst of 20
    assert await guard(limiter.handle, "10.0.0.9", "peek") is None  # no failures yet
    assert await failed_attempt(limiter.handle, "10.0.0.8") is None
    assert await failed_attempt(limiter.handle, "10.0.0.8") is None
    assert isinstance(await failed_attempt(limiter.handle, "10.0.0.8"), RateLimited)
    assert await guard(limiter.handle, "10.0.0.8") is None  # cached keys from there still pass
    assert limiter.actor.rejections["ip"] == 6


@pytest.mark.parametrize("strategy", ["sliding-window", "fixed-window"])
async def test_an_address_without_counted_failures_is_never_refused_a_peek(
    limiter_factory: Any, strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The edge skips the auth cache's check (and the peek) for an address whose failures
    # the limiter says were never counted (failures_counted): for every address it says
    # so of, the peek it skips must allow, at any time and after any failures elsewhere.
    import random

    from actors import limiter as limiter_module

    clock = [1_000_000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    memory = await limiter_factory(strategy=strategy, per_ip="2/minute", per_ip_burst=1)
    rnd = random.Random(5)
    ips = [f"10.0.1.{i}" for i in range(6)]
    skipped = 0
    for _ in range(400):
        clock[0] += rnd.choice([0.0, 0.5, 7.0, 61.0])
        ip = rnd.choice(ips)
        if rnd.random() < 0.2:
            await memory.handle.check_ip(ip, "failed")
        counted = memory.handle.failures_counted(ip)
        refused = await guard(memory.handle, ip, "peek")
        if not counted:
            skipped += 1
            assert refused is None, ip
    assert 0 < skipped < 400
    assert not memory.handle.failures_counted("10.0.2.1") and memory.handle.failures_counted(ips[0])
    # Too many addresses to keep: every one is peeked at from then on.
    monkeypatch.setattr(limiter_module, "_MAX_KEPT", 3)
    for i in range(4):
        await memory.handle.check_ip(f"10.0.3.{i}", "failed")
    assert memory.handle.failures_counted("10.0.2.1")
    # In Redis other replicas count failures too: always peek.
    shared = await limiter_factory(storage="redis", strategy=strategy, per_ip="2/minute", per_ip_burst=1)
    assert shared.handle.failures_counted("10.0.2.1")


async def guard(handle: LimiterHandle, ip: str, kind: str = "any") -> RateLimited | None:
    try:
        await handle.check_ip(ip, kind)
    except RateLimited as exc:
        return exc
    return None


@pytest.mark.parametrize("storage", ["memory", "redis"])
async def test_the_guards_answer_at_once_is_check_ips(limiter_factory: Any, storage: str) -> None:
    # passed_ip_now (the guard's every request) against check_ip on twin limiters: the same
    # passes and refusals (memory: answered at once; Redis: not, and check_ip then asks).
    ours = await limiter_factory(storage, per_ip_all="3/minute")
    theirs = await limiter_factory(storage, per_ip_all="3/minute")
    off = await limiter_factory(storage, per_ip="off", per_ip_all="off")
    assert off.handle.passed_ip_now("10.0.0.1")
    for ip in ["10.0.0.1"] * 8 + ["10.0.0.2"] * 2:
        answered, got = True, None
        try:
            if not ours.handle.passed_ip_now(ip):
                answered = False
                await ours.handle.check_ip(ip)
        except RateLimited as exc:
            got = exc
        assert answered == (storage == "memory")
        expected = await guard(theirs.handle, ip)
        assert (got is None) == (expected is None), ip
        if got is not None and expected is not None:
            assert got.message == expected.message
    assert ours.actor.rejections == theirs.actor.rejections


async def test_memory_storage_sweeps_at_most_once_a_second() -> None:
    storage = LocalStorage()
    windows = Windows("memory", storage, "fixed-window")
    item = RateLimitItemPerSecond(1000, 1)
    for i in range(200):
        await windows.hit(item, "ip", str(i))
    assert storage._next_sweep > time.monotonic()
    assert len(storage.storage) == 200


async def test_sliding_counters_schedule_the_sweep_from_the_reading_that_starts_a_period(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A sliding window's writes in its steady span skip the sweep's check: the reading
    # that began the span (a new counter, a new period) scheduled it. Counters of past
    # periods are still swept once they expire, and a steady write starts no sweep.
    clock = [1_000_000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    storage = LocalStorage()
    windows = Windows("memory", storage, "sliding-window")
    item = RateLimitItemPerSecond(1000, 1)
    for period in range(6):
        clock[0] = 1_000_000.0 + period
        storage._next_sweep = 0.0  # as if the last sweep were over a second ago
        assert windows.hit_now(item, "ip", "a", now=clock[0])  # the period's first reading
        assert storage.timer is not None and not storage.timer.done()
        await storage.timer
        storage._next_sweep = 0.0  # a sweep allowed again, but steady writes do not ask
        timer = storage.timer
        for _ in range(5):
            assert windows.hit_now(item, "ip", "a", now=clock[0] + 0.5)
            windows.add_now(item, "ip", "a", amount=1, now=clock[0] + 0.5)
            windows.stats_and_hit_now(item, "ip", "a", now=clock[0] + 0.5)
        assert storage.timer is timer
    # Counters live two periods: the sweep of the last period left only its and the previous.
    key = item.key_for("ip", "a")
    assert sorted(storage.storage) == [f"{key}/{1_000_000 + p}" for p in (4, 5)]


@pytest.mark.parametrize("strategy", ["sliding-window", "fixed-window"])
async def test_memory_windows_decide_exactly_as_the_library_does(strategy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # LocalStorage decides memory windows with synchronous twins of the library's
    # operations; the library's own strategy over its own MemoryStorage is the reference.
    # Same operations at the same (frozen) times, across window edges, must give the same
    # answers and leave the same counters.
    from limits.aio.storage import MemoryStorage

    clock = [1_000_000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    ours = Windows("memory", LocalStorage(), strategy)
    reference = Windows("memory", MemoryStorage(), strategy)
    assert ours._local is not None and reference._local is None
    item = RateLimitItemPerSecond(5, 10)
    steps: list[tuple[float, str, int]] = [
        (0.0, "hit", 1), (0.5, "hit", 2), (1.0, "stats", 0), (2.0, "hit", 3), (2.5, "add", 4),
        (3.0, "stats", 0), (3.0, "hit", 1), (9.9, "add", -2), (10.2, "stats", 0), (10.2, "hit", 1),
        (13.0, "hit", 2), (14.0, "stats", 0), (19.5, "hit", 5), (21.0, "stats", 0), (27.0, "hit", 1),
        (27.0, "add", 30), (29.0, "stats", 0), (35.0, "hit", 6), (48.0, "stats", 0), (48.0, "hit", 1),
    ]
    for offset, op, amount in steps:
        clock[0] = 1_000_000.0 + offset
        answers = []
        for windows in (ours, reference):
            if op == "hit":
                answers.append(await windows.hit(item, "k", cost=amount))
            elif op == "add":
                answers.append(await windows.add(item, "k", amount=amount))
            else:
                stats = await windows.stats(item, "k")
                answers.append((round(stats.reset_time, 6), stats.remaining))
        assert answers[0] == answers[1], (offset, op, amount)
    ours_counts = {k: v for k, v in ours.storage.storage.items() if v}  # type: ignore[attr-defined]
    reference_counts = {k: v for k, v in reference.storage.storage.items() if v}  # type: ignore[attr-defined]
    assert ours_counts == reference_counts


@pytest.mark.parametrize("strategy", ["sliding-window", "fixed-window"])
async def test_memory_counters_match_the_library_on_random_walks(strategy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The memory counters write the library's arithmetic out inline (and keep their keys
    # between calls): random operations, costs, periods and steps across window edges,
    # against the library's strategy over its own MemoryStorage, must give the same
    # answers and leave the same counters and expirations.
    import random

    from limits.aio.storage import MemoryStorage

    clock = [0.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    for seed in range(40):
        rnd = random.Random(seed)
        clock[0] = 1_000_000.0 + rnd.random() * 1000
        ours = Windows("memory", LocalStorage(), strategy)
        reference = Windows("memory", MemoryStorage(), strategy)
        items = [RateLimitItemPerSecond(rnd.randint(1, 8), rnd.choice([1, 3, 10, 60])) for _ in range(3)]
        for step in range(200):
            clock[0] += rnd.choice([0, 0.01, 0.3, 0.999, 1.7, 5, 11])
            item, ids = rnd.choice(items), rnd.choice([("k",), ("j", "x")])
            op, amount = rnd.choice(["hit", "hit", "stats", "add", "stats_and_hit"]), rnd.choice([1, 1, 2, 5, 9, -1, 0])
            answers: list[Any] = []
            for windows in (ours, reference):
                if op == "hit":
                    answers.append(await windows.hit(item, *ids, cost=max(amount, 1)))
                elif op == "add":
                    answers.append(await windows.add(item, *ids, amount=amount))
                elif op == "stats":
                    stats = await windows.stats(item, *ids)
                    answers.append((round(stats.reset_time, 6), stats.remaining))
                elif windows is ours:
                    stats, hit = ours.stats_and_hit_now(item, *ids, cost=max(amount, 1), now=clock[0])
                    answers.append((round(stats.reset_time, 6), stats.remaining, hit))
                else:
                    stats = await windows.stats(item, *ids)
                    hit = await windows.hit(item, *ids, cost=max(amount, 1))
                    answers.append((round(stats.reset_time, 6), stats.remaining, hit))
            assert answers[0] == answers[1], (seed, step, op, amount)
        _assert_same_counters(ours.storage, reference.storage, seed)


def _assert_same_counters(ours: Any, reference: Any, seed: int) -> None:
    """Two memory storages hold the same live counters, each with the same expiry."""
    ours_counts = {k: v for k, v in ours.storage.items() if v}
    assert ours_counts == {k: v for k, v in reference.storage.items() if v}, seed
    assert {k: ours.expirations[k] for k in ours_counts} == {
        k: reference.expirations[k] for k in ours_counts
    }, seed


async def test_sliding_hits_answered_from_the_last_reading_match_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    # A sliding window's counter reads without expiry checks within its steady span, and
    # its hit is mostly answered from its last reading's weight (SlidingCounter). Hits
    # through two counters of the same key (as when a kept counter outlives Windows'
    # cache) and through Windows, stats, refunds, token-like charges, clears, a clock
    # that sometimes steps back, and times at a period's last millisecond, against the
    # library's strategy over its own MemoryStorage: the same answers, counters and
    # expirations.
    import random

    from limits.aio.storage import MemoryStorage

    from gateway.limits.storage import SlidingCounter

    clock = [0.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    fast_answers = 0
    for seed in range(30):
        rnd = random.Random(seed)
        clock[0] = 1_000_000.0 + rnd.random() * 1000
        ours = Windows("memory", LocalStorage(), "sliding-window")
        reference = Windows("memory", MemoryStorage(), "sliding-window")
        local: Any = ours.storage
        item = RateLimitItemPerSecond(rnd.randint(1, 12), rnd.choice([1, 3, 10, 60]))
        expiry = item.get_expiry()
        key = item.key_for("ip", "a")
        twins = [SlidingCounter(local, key, item.amount, expiry) for _ in range(2)]
        for step in range(300):
            roll = rnd.random()
            if roll < 0.05:
                clock[0] -= rnd.choice([0.001, 0.4, expiry])  # a clock stepped back
            elif roll < 0.1:
                clock[0] = (int(clock[0] / expiry) + 1) * expiry - rnd.choice([0.0005, 0.001, 0.002])
            else:
                clock[0] += rnd.choice([0, 0.001, 0.05, 0.3, 1.7, expiry / 3])
            now = clock[0]
            op = rnd.choice(["hit", "hit", "hit", "twin", "twin", "refund", "charge", "stats", "stats_and_hit", "clear"])
            cost = rnd.choice([1, 1, 1, 2, 5, 20])
            if op == "clear":
                await local.clear(f"{key}/{int(now / expiry)}")
                await reference.storage.clear(f"{key}/{int(now / expiry)}")
                continue
            answers: list[Any] = []
            for windows in (ours, reference):
                if op in ("hit", "twin") and windows is ours:
                    counter: Any = rnd.choice(twins) if op == "twin" else ours.counter(item, "ip", "a")
                    remembered = counter._weight_at <= now <= counter._steady_until
                    answers.append(counter.hit(now, cost))
                    fast_answers += remembered and answers[-1]
                elif op in ("hit", "twin"):
                    answers.append(await windows.hit(item, "ip", "a", cost=cost))
                elif op == "refund":
                    answers.append(await windows.add(item, "ip", "a", amount=-1))
                elif op == "charge":
                    answers.append(await windows.add(item, "ip", "a", amount=cost))
                elif op == "stats_and_hit" and windows is ours:
                    stats, hit = ours.stats_and_hit_now(item, "ip", "a", cost=cost, now=now)
                    answers.append((round(stats.reset_time, 6), stats.remaining, hit))
                elif op == "stats_and_hit":
                    stats = await windows.stats(item, "ip", "a")
                    hit = await windows.hit(item, "ip", "a", cost=cost)
                    answers.append((round(stats.reset_time, 6), stats.remaining, hit))
                else:
                    stats = await windows.stats(item, "ip", "a")
                    answers.append((round(stats.reset_time, 6), stats.remaining))
            assert answers[0] == answers[1], (seed, step, op, cost)
        _assert_same_counters(local, reference.storage, seed)
    assert fast_answers > 500  # hits answered from a remembered reading were among them


@pytest.mark.parametrize("strategy", ["sliding-window", "fixed-window"])
async def test_the_per_ip_hits_stop_early_only_where_every_window_passed(strategy: str) -> None:
    # _ip_hits returns at the first window that refuses, and _ip_hits_refused hits the
    # windows after it all the same before refunding: the reference hits every window,
    # then reads the refusing ones and refunds the others (the coroutines' order).
    # Random windows (the same one twice too), times and addresses: same answers,
    # counters and expirations.
    import random

    from limits.util import WindowStats

    from actors.limiter import _ALLOWED, _ip_hits, _ip_refusal

    def reference(counters: tuple[Any, ...], now: float) -> Any:
        oks = [counter.hit(now) for counter in counters]
        if all(oks):
            return _ALLOWED
        rejected = [WindowStats(*counter.stats(now)) for counter, ok in zip(counters, oks, strict=True) if not ok]
        for counter, ok in zip(counters, oks, strict=True):
            if ok:
                counter.add(now, -1)
        return _ip_refusal(rejected, now)

    for seed in range(40):
        rnd = random.Random(seed)
        ours, theirs = Windows("memory", LocalStorage(), strategy), Windows("memory", LocalStorage(), strategy)
        items = [RateLimitItemPerSecond(rnd.randint(1, 6), rnd.choice([1, 5, 60])) for _ in range(rnd.randint(1, 3))]
        now = 1_000_000.0 + rnd.random()
        for step in range(300):
            now += rnd.choice([0, 0.01, 0.2, 1, 3])
            ip = rnd.choice(["a", "b"])
            answer = _ip_hits(tuple(ours.counter(item, "ip", ip) for item in items), now)
            expected = reference(tuple(theirs.counter(item, "ip", ip) for item in items), now)
            assert answer == expected, (seed, step)
        ours_storage: Any = ours.storage
        theirs_storage: Any = theirs.storage
        assert dict(ours_storage.storage) == dict(theirs_storage.storage), seed
        assert dict(ours_storage.expirations) == dict(theirs_storage.expirations), seed


@pytest.mark.parametrize("strategy", ["sliding-window", "fixed-window"])
async def test_a_memory_stats_and_hit_in_one_read_equal_stats_then_hit(
    strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A key's request window is read once for its stats and its hit; the library's
    # strategy, asked for the stats and then the hit, is the reference.
    from limits.aio.storage import MemoryStorage

    clock = [1_000_000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    ours = Windows("memory", LocalStorage(), strategy)
    reference = Windows("memory", MemoryStorage(), strategy)
    item = RateLimitItemPerSecond(5, 10)
    steps = [(0.0, 1), (0.5, 2), (2.0, 3), (3.0, 1), (9.9, 1), (10.2, 1), (13.0, 2), (19.5, 5), (27.0, 1),
             (35.0, 6), (48.0, 1), (48.5, 4), (49.0, 1)]
    for offset, cost in steps:
        clock[0] = 1_000_000.0 + offset
        stats, hit = ours.stats_and_hit_now(item, "k", cost=cost, now=clock[0])
        expected_stats = await reference.stats(item, "k")
        expected_hit = await reference.hit(item, "k", cost=cost)
        assert (round(stats.reset_time, 6), stats.remaining, hit) == (
            round(expected_stats.reset_time, 6), expected_stats.remaining, expected_hit,
        ), (offset, cost)
    ours_counts = {k: v for k, v in ours.storage.storage.items() if v}  # type: ignore[attr-defined]
    reference_counts = {k: v for k, v in reference.storage.storage.items() if v}  # type: ignore[attr-defined]
    assert ours_counts == reference_counts


@pytest.mark.parametrize("strategy", ["sliding-window", "fixed-window"])
async def test_memory_decisions_in_the_task_match_the_actors_coroutines(
    strategy: Literal["sliding-window", "fixed-window"], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Memory windows are decided by synchronous twins (_decide_ip_now, _decide_key_now)
    # of the coroutines remote storages go through (_decide_ip, _decide_key). Driven over
    # memory through the same messages at the same (frozen) times, both must give the
    # same answers (headers, Retry-After, messages) and leave the same counters.
    from actors.limiter import Acquire, CheckIp, Release

    clock = [1_000_000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    settings = RateLimitSettings(
        storage="memory://", strategy=strategy, per_ip="2/minute", per_ip_burst=1, per_ip_all="3/minute"
    )
    twin, coroutines = LimiterActor(settings), LimiterActor(settings)
    for actor in (twin, coroutines):
        await actor.on_start()
    key_id = str(uuid.uuid4())
    held: dict[LimiterActor, list[str]] = {twin: [], coroutines: []}
    try:
        for step in range(40):
            clock[0] = 1_000_000.0 + step * 4.5
            for kind in ("any", "any", "peek", "failed"):
                check = CheckIp(f"10.0.0.{step % 3 // 2}", kind)
                answers = []
                for actor in (twin, coroutines):
                    assert actor._shared is not None
                    windows = actor._shared.current()
                    if actor is twin:
                        answers.append(actor._settle_ip(actor._decide_ip_now(windows, check)))
                    else:
                        answers.append(actor._settle_ip(await actor._decide_ip(windows, check)))
                assert answers[0] == answers[1], (step, kind)
            acquire = Acquire(f"p{step}", key_id, requests=4, window_seconds=60, tokens_per_minute=300,
                              max_concurrent=1)
            decisions = []
            for actor in (twin, coroutines):
                assert actor._requests is not None and actor._shared is not None
                requests, shared = actor._requests.current(), actor._shared.current()
                local_slot = actor._reserve_local_slot(acquire)
                if actor is twin:
                    decision = actor._decide_key_now(requests, shared, acquire, local_slot)
                else:
                    decision = (await actor._decide_key(requests, shared, acquire, local_slot)).decision
                decisions.append(actor._settle_key(acquire, decision, local_slot))
                if decision.allowed:
                    held[actor].append(acquire.permit_id)
                if step % 5 in (1, 3):  # between, a request stays in flight: concurrency refuses
                    for permit_id in held[actor]:
                        actor._free_slot(permit_id)
                        actor._charge(Release(permit_id, key_id, 300, 400 if 20 <= step < 25 else 40))
                    held[actor].clear()
            assert decisions[0] == decisions[1], step
        assert twin.rejections == coroutines.rejections
        assert set(twin.rejections) == {"ip", "requests", "tokens", "concurrency"}
        for scope in ("_shared", "_requests"):
            ours, theirs = getattr(twin, scope).current().storage, getattr(coroutines, scope).current().storage
            assert ours.storage == theirs.storage and ours.expirations == theirs.expirations
    finally:
        for actor in (twin, coroutines):
            await actor.on_stop()


@pytest.mark.parametrize("strategy", ["sliding-window", "fixed-window"])
async def test_the_handles_memory_path_answers_as_the_message_path_does(
    strategy: Literal["sliding-window", "fixed-window"], monkeypatch: pytest.MonkeyPatch
) -> None:
    # On memory windows the handle decides without a message (acquire_now, check_ip_now,
    # a Permit that writes its headers when read and releases itself). A handle whose
    # actor has that path turned off goes through the messages (decide_now, Release) as
    # before: at the same (frozen) times both must give the same answers, headers,
    # Retry-After, slots and rejections, and leave the same counters.
    clock = [1_000_000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    settings = RateLimitSettings(
        storage="memory://", strategy=strategy, per_ip="2/minute", per_ip_burst=1, per_ip_all="3/minute"
    )
    supervisors = [Supervisor(), Supervisor()]
    fast, messages = LimiterActor(settings), LimiterActor(settings)
    handles = [LimiterHandle(fast, await supervisors[0].start(fast)),
               LimiterHandle(messages, await supervisors[1].start(messages))]
    monkeypatch.setattr(messages, "acquire_now", lambda handle, key: None)
    monkeypatch.setattr(messages, "check_ip_now", lambda ip: None)
    policy = KeyPolicy(rate_limit_requests=4, rate_limit_window_seconds=60, tokens_per_minute=300, max_concurrent=1)
    key = VerifiedKey(api_key_id=uuid.uuid4(), subject_id=uuid.uuid4(), name="k", key_prefix="llmg_k",
                      key_hash=b"\0" * 32, policy=policy, expires_at=None)
    held: list[list[Permit]] = [[], []]
    try:
        for step in range(40):
            clock[0] = 1_000_000.0 + step * 4.5
            for kind in ("any", "any", "peek", "failed"):
                ip = f"10.0.0.{step % 3 // 2}"
                ip_answers = []
                for handle in handles:
                    try:
                        await handle.check_ip(ip, kind)
                        ip_answers.append(None)
                    except RateLimited as exc:
                        ip_answers.append((exc.message, exc.retry_after, exc.headers))
                assert ip_answers[0] == ip_answers[1], (step, kind)
            answers = []
            for side, handle in enumerate(handles):
                try:
                    permit = await handle.acquire(key)
                except RateLimited as exc:
                    answers.append((exc.message, exc.retry_after, exc.headers))
                else:
                    held[side].append(permit)
                    answers.append((dict(permit.headers), permit.holds_slot))
                if step % 5 in (1, 3):  # between, a request stays in flight: concurrency refuses
                    for permit in held[side]:
                        permit.charge(400 if 20 <= step < 25 else 40)
                        permit.release()
                        permit.release()  # a second release changes nothing
                    held[side].clear()
            assert answers[0] == answers[1], step
            assert dict(fast.inflight) == dict(messages.inflight), step
        assert fast.rejections == messages.rejections
        assert set(fast.rejections) == {"ip", "requests", "tokens", "concurrency"}
        for scope in ("_shared", "_requests"):
            ours, theirs = getattr(fast, scope).current().storage, getattr(messages, scope).current().storage
            assert ours.storage == theirs.storage and ours.expirations == theirs.expirations
    finally:
        for supervisor in supervisors:
            await supervisor.stop()


def test_the_limits_internals_the_memory_storage_overrides_still_exist() -> None:
    # LocalStorage overrides these private names; if an upgrade renamed them, the
    # overrides would do nothing and nothing else would fail.
    from limits.aio.storage import MemoryStorage

    from gateway.limits import storage as storage_module

    for mangled in ("_MemoryStorage__schedule_expiry", "_MemoryStorage__expire_events"):
        assert callable(getattr(MemoryStorage, mangled, None)), mangled
        assert mangled in vars(LocalStorage), mangled
    for name in storage_module._WRAPPED:
        assert hasattr(MemoryStorage, name) or hasattr(RedisWindowStorage, name), name


def test_limits_is_pinned_to_the_tested_major() -> None:
    import configparser
    from importlib.metadata import version
    from pathlib import Path

    cfg = configparser.ConfigParser()
    cfg.read(Path(__file__).resolve().parents[1] / "setup.cfg")
    requires = [line.strip() for line in cfg["options"]["install_requires"].splitlines()]
    assert "limits>=5.0,<6" in requires
    assert version("limits").split(".")[0] == "5"


async def test_a_lost_redis_lease_is_counted_logged_and_reported(
    limiter_factory: Any, verified_key: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A long stream's concurrency lease that Redis no longer holds is not swallowed."""
    limiter = await limiter_factory("redis", lease_seconds=0.3)
    key = await verified_key(rate_limit_requests=100, rate_limit_window_seconds=HOUR, max_concurrent=2)
    permit = await limiter.handle.acquire(key)
    redis = limiter.actor.redis
    assert redis is not None
    async for name in redis._client.scan_iter(match=f"*conc/{key.api_key_id}*"):
        await redis._client.delete(name)  # the lease is gone (e.g. Redis restarted, or it expired)
    with caplog.at_level(logging.WARNING, logger="gateway.limiter"):
        for _ in range(100):  # up to 5 s
            if limiter.handle.lease_counts[0]:
                break
            await asyncio.sleep(0.05)
    assert limiter.handle.lease_counts[0] >= 1
    assert limiter.handle.lease_trouble is not None and "lost" in limiter.handle.lease_trouble
    assert any("lease" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    permit.release()
