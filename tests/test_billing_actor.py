"""The BillingActor on its own, against the real ledger: bursts, drain, outages, duplicates."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from actors.billing import BillingActor, BillingHandle
from actors.runtime import Supervisor
from gateway.core.usage import CallRecord, Usage
from tests.conftest import via_proxy


def call(key: uuid.UUID, subject: uuid.UUID, cost: float = 0.25, **extra: Any) -> CallRecord:
    return CallRecord(
        request_id=f"a-{uuid.uuid4().hex[:10]}", api_key_id=key, subject_id=subject,
        requested_model="m", served_model="m", provider="p", deployment="p/m", status=200,
        usage=Usage(prompt_tokens=10, completion_tokens=20), cost_usd=cost,
        cost_source="price" if cost else "none", latency=0.01, **extra,
    )


async def count(pool: asyncpg.Pool, ids: list[str]) -> dict[str, int]:
    rows = await pool.fetch(
        "SELECT request_id, count(*) AS n FROM usage_ledger WHERE request_id = ANY($1) GROUP BY 1", ids
    )
    return {r["request_id"]: r["n"] for r in rows}


BillingFactory = Callable[..., Any]


@pytest.fixture
async def billing_factory(tmp_path: Path) -> AsyncIterator[BillingFactory]:
    """``await billing_factory(pool, **actor options)`` → (handle, supervisor), stopped at the end."""
    supervisors: list[Supervisor] = []

    async def start(pool: asyncpg.Pool, root: Path | None = None, **options: Any) -> tuple[BillingHandle, Supervisor]:
        supervisor = Supervisor()
        supervisors.append(supervisor)
        actor = BillingActor(pool, root or tmp_path / "journal", **options)
        return BillingHandle(actor, await supervisor.start(actor)), supervisor

    yield start
    for supervisor in supervisors:
        await supervisor.stop()


async def test_a_burst_of_events_is_in_the_journal_file_before_any_await(
    db_pool: asyncpg.Pool, billing_factory: BillingFactory
) -> None:
    """No mailbox between a finished call and the disk: with a mailbox of 2 and no await
    in between, all 50 events are journaled (in the file) the moment record() returns."""
    billing, _ = await billing_factory(db_pool, mailbox_size=2)
    key, subject = uuid.uuid4(), uuid.uuid4()
    calls = [call(key, subject) for _ in range(50)]
    for c in calls:  # no await in between: the actor's task cannot run meanwhile
        billing.record(c)
    assert billing.stats().recorded == 50 and billing.stats().pending == 50
    segment = billing._actor.journal._active
    assert segment is not None and segment.path.read_bytes().count(b"\n") == 50
    assert await billing.flush()
    assert await count(db_pool, [c.request_id for c in calls]) == {c.request_id: 1 for c in calls}
    assert billing.stats().recorded == 50 and billing.stats().pending == 0


async def test_stop_drains_everything_to_the_ledger(
    db_pool: asyncpg.Pool, billing_factory: BillingFactory, tmp_path: Path
) -> None:
    billing, supervisor = await billing_factory(db_pool, ship_interval=60.0, refresh_interval=60.0)
    key, subject = uuid.uuid4(), uuid.uuid4()
    calls = [call(key, subject) for _ in range(20)]
    for c in calls:
        billing.record(c)
    await asyncio.sleep(0)
    await supervisor.stop()
    assert await count(db_pool, [c.request_id for c in calls]) == {c.request_id: 1 for c in calls}
    assert not list((tmp_path / "journal").rglob("segment-*"))
    # A call that ends after billing stopped still reaches the disk, for the next start.
    late = call(key, subject)
    billing.record(late)
    assert len(list((tmp_path / "journal").rglob("segment-*"))) == 1
    again, _ = await billing_factory(db_pool)
    assert await again.flush()
    assert await count(db_pool, [late.request_id]) == {late.request_id: 1}


async def test_ledger_outage_keeps_events_on_disk_until_it_returns(
    database_url: str, pg_proxy: Any, billing_factory: BillingFactory, tmp_path: Path
) -> None:
    pool = await asyncpg.create_pool(via_proxy(database_url, pg_proxy.port), min_size=1, max_size=2)
    assert pool is not None
    try:
        billing, supervisor = await billing_factory(pool, ship_timeout=1.0, drain_timeout=1.0)
        key, subject = uuid.uuid4(), uuid.uuid4()
        before = [call(key, subject) for _ in range(5)]
        for c in before:
            billing.record(c)
        assert await billing.flush()
        await pg_proxy.cut()
        during = [call(key, subject) for _ in range(30)]
        for c in during:
            billing.record(c)
            await asyncio.sleep(0.005)
        assert not await billing.flush()
        stats = billing.stats()
        assert not stats.ledger_reachable and stats.pending == 30
        # Stopping while the ledger is away: nothing is lost, it waits on disk.
        await supervisor.stop()
        assert len([p for p in (tmp_path / "journal").rglob("segment-*")]) >= 1
        await pg_proxy.restore()
        billing, _ = await billing_factory(pool)
        assert await billing.flush()
        ids = [c.request_id for c in before + during]
        assert await count(pool, ids) == {i: 1 for i in ids}
        assert not list((tmp_path / "journal").rglob("segment-*"))
    finally:
        await pool.close()


async def test_shipping_twice_inserts_once(db_pool: asyncpg.Pool, billing_factory: BillingFactory, tmp_path: Path) -> None:
    """The crash window between the ledger's commit and the journal's truncation."""
    billing, supervisor = await billing_factory(db_pool, ship_interval=60.0)
    key, subject = uuid.uuid4(), uuid.uuid4()
    calls = [call(key, subject) for _ in range(10)]
    for c in calls:
        billing.record(c)
    await asyncio.sleep(0.05)  # committed to the journal
    journal_files = {p: p.read_bytes() for p in (tmp_path / "journal").rglob("segment-*")}
    assert journal_files
    assert await billing.flush()
    await supervisor.stop()
    for path, data in journal_files.items():  # as if the process died before deleting them
        path.write_bytes(data)
    again, _ = await billing_factory(db_pool)
    assert await again.flush()
    assert await count(db_pool, [c.request_id for c in calls]) == {c.request_id: 1 for c in calls}
    assert again.stats().duplicates == 10 and again.stats().shipped == 0
    spent = await db_pool.fetchval("SELECT sum(cost_usd) FROM usage_daily WHERE api_key_id = $1", key)
    assert float(spent) == pytest.approx(2.5)  # the rollup did not count them twice either


async def test_a_row_the_ledger_refuses_is_set_aside_and_the_rest_ship(
    db_pool: asyncpg.Pool, billing_factory: BillingFactory
) -> None:
    billing, _ = await billing_factory(db_pool)
    key, subject = uuid.uuid4(), uuid.uuid4()
    good = [call(key, subject) for _ in range(3)]
    bad = call(key, subject)
    bad.cost_source = "bogus"  # a row the ledger's constraint refuses
    billing.record(good[0])
    billing._actor.ingest(bad)
    billing.record(good[1])
    billing.record(good[2])
    assert await billing.flush()
    assert await count(db_pool, [c.request_id for c in good] + [bad.request_id]) == {c.request_id: 1 for c in good}
    rejected = Path(billing.stats().journal_dir) / "rejected.jsonl"
    assert bad.request_id in rejected.read_text()
    assert billing.stats().rejected == 1 and billing.stats().pending == 0


async def test_spend_counters_add_the_ledger_and_what_is_not_shipped(
    db_pool: asyncpg.Pool, billing_factory: BillingFactory, key_factory: Any
) -> None:
    from decimal import Decimal

    _, record = await key_factory(budget_usd=Decimal("100"), budget_period="month")
    key, subject = record.api_key_id, record.subject_id
    first, _ = await billing_factory(db_pool, refresh_interval=0.05)
    for _ in range(4):
        first.record(call(key, subject, cost=1.0))
    assert await first.flush()
    # A second replica, which never saw those calls, learns them from the ledger.
    other, _ = await billing_factory(db_pool, ship_interval=60.0, refresh_interval=0.05)
    report = await other.spend(api_key_id=key, subject_id=subject)
    assert report.key_spent_usd == pytest.approx(4.0)
    other.record(call(key, subject, cost=0.5))  # not shipped (60 s interval): counted locally
    await asyncio.sleep(0.2)  # several refreshes later it is still counted once
    assert (await other.spend(api_key_id=key)).key_spent_usd == pytest.approx(4.5)


async def test_a_call_whose_ledger_row_releases_its_reservation_is_shipped_soon(
    db_pool: asyncpg.Pool, billing_factory: BillingFactory
) -> None:
    """Shipping once a second (the default) keeps a PostgreSQL reservation no longer: the
    call whose row releases it asks for a ship within RESERVED_SHIP_SECONDS, and one
    timer serves every such call of that time. Other calls wait for the interval."""
    from actors.billing import RESERVED_SHIP_SECONDS
    from gateway.billing.reservations import Reservation

    billing, _ = await billing_factory(db_pool, ship_interval=60.0, refresh_interval=60.0)
    key, subject = uuid.uuid4(), uuid.uuid4()
    plain = call(key, subject)
    billing.record(plain)
    billing.settle(None, plain)  # no budget: nothing waits for its row
    await asyncio.sleep(3 * RESERVED_SHIP_SECONDS)
    assert await count(db_pool, [plain.request_id]) == {}
    reserved = [call(key, subject) for _ in range(3)]
    timers = []
    for c in reserved:
        billing.record(c)
        billing.settle(Reservation(c.call_id, 1_000, ()), c)  # a reservation of its own in PostgreSQL
        timers.append(billing._actor._ship_soon_timer)
    assert timers[0] is not None and timers == [timers[0]] * 3  # one timer for the three
    ids = [c.request_id for c in [plain, *reserved]]
    deadline = asyncio.get_running_loop().time() + 10 * RESERVED_SHIP_SECONDS
    while await count(db_pool, ids) != {i: 1 for i in ids}:
        assert asyncio.get_running_loop().time() < deadline, "not shipped soon"
        await asyncio.sleep(0.01)
    assert billing._actor._ship_soon_timer is None
