"""Reports read aligned time blocks (sql/0015_usage_blocks.sql) and still equal the ledger.

Each test's calls are in 2011, with models, providers and keys of their own, so a plain
sum over the raw ledger for the same range is the exact expected answer whatever else
the run's ledger holds.
"""

from __future__ import annotations

import itertools
import random
import shutil
import uuid
import zlib
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from gateway.billing.ledger import UsageEvent, ship_lines
from gateway.billing.reports import BLOCK_SPANS, GROUPS, UsageQuery, block_plan, usage_report
from gateway.core.db import migrate, migrations_dir
from tests.conftest import _with_db

EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
START = datetime(2011, 1, 1, tzinfo=timezone.utc)
DAYS = 80  # longer than the biggest block (64 days), so every span is used
HOUR = timedelta(hours=1)
TICK = timedelta(microseconds=1)


def boundaries() -> list[datetime]:
    """Block boundaries of each span inside the period (of hour spans, in its first 12
    days only): where off-by-ones live."""
    out = set()
    for span in BLOCK_SPANS:
        step = span * HOUR
        at = EPOCH + -(-(START - EPOCH) // step) * step  # the first aligned one from START
        end = START + timedelta(days=DAYS if span >= 24 else 12)
        while at < end:
            out.add(at)
            at += step
    return sorted(out)


def make_event(key: uuid.UUID, subject: uuid.UUID, at: datetime, rng: random.Random, model: str, provider: str) -> UsageEvent:
    failed = rng.random() < 0.1
    prompt, completion = (0, 0) if failed else (rng.randint(1, 3000), rng.randint(0, 2000))
    cost = 0.0 if failed else rng.randint(0, 10**9) / 10**10  # ten decimal places, like the ledger
    return UsageEvent(
        call_id=uuid.uuid4(), request_id=uuid.uuid4().hex, response_id=None, api_key_id=key,
        subject_id=subject, requested_model=model, served_model=model, provider=provider,
        deployment=f"{provider}/{model}", prompt_tokens=prompt, completion_tokens=completion,
        usage_estimated=False, cost_usd=cost, cost_diem=cost * 2 if provider.endswith("venice") else None,
        cost_source="price", latency_seconds=0.1, ttft_seconds=None, status=502 if failed else 200,
        outcome="provider_error" if failed else "ok", streamed=False, retries=0, failovers=0,
        error_type=None, finish_reason=None, created_at=at.timestamp(),
    )


def make_events(keys: list[uuid.UUID], subject: uuid.UUID, models: list[str], providers: list[str],
                seed: int, n: int = 1500) -> list[UsageEvent]:
    rng = random.Random(seed)

    def one(at: datetime) -> UsageEvent:
        return make_event(rng.choice(keys), subject, at, rng, rng.choice(models), rng.choice(providers))

    span = DAYS * 86400 * 10**6
    events = [one(START + timedelta(microseconds=rng.randrange(span))) for _ in range(n)]
    for edge in boundaries():  # on each block boundary, and a microsecond before it
        events += [one(edge), one(edge - TICK)]
    return events


@pytest.fixture
async def long_ledger(db_pool: asyncpg.Pool, key_factory: Any) -> AsyncIterator[dict[str, Any]]:
    """~2,000 calls over 80 days of 2011 for three keys of one subject, with models and
    providers nobody else uses, shipped in batches of varied size (as replicas ship)."""
    tag = uuid.uuid4().hex[:8]
    subject = uuid.uuid4()
    keys = [(await key_factory(name=f"blocks-{tag}-{i}", subject_id=subject))[1].api_key_id for i in range(3)]
    models = [f"blocks-{tag}-{m}" for m in ("small", "large", "embed")]
    providers = [f"blocks-{tag}-a", f"blocks-{tag}-venice"]
    events = make_events(keys, subject, models, providers, seed=11)
    random.Random(3).shuffle(events)  # batches mix days and blocks, as late shipping does
    at = 0
    for size in [1, 7, 300, 50, 999, 2] * 10:
        if at >= len(events):
            break
        await ship_lines(db_pool, [e.to_line() for e in events[at:at + size]])
        at += size
    await ship_lines(db_pool, [e.to_line() for e in events[at:]])
    yield {"subject": subject, "keys": keys, "models": models, "providers": providers}


def mine(ledger: dict[str, Any], group: str) -> set[str] | None:
    """The groups that are this test's own (None for days: the period is its own)."""
    return {
        "key": {str(k) for k in ledger["keys"]}, "subject": {str(ledger["subject"])},
        "model": set(ledger["models"]), "provider": set(ledger["providers"]), "day": None,
    }[group]


async def raw_sums(pool: asyncpg.Pool, group: str, since: datetime | None, until: datetime | None,
                   column: str | None, ident: uuid.UUID | None) -> dict[str, tuple[int, int, int, int, Decimal, Decimal]]:
    """The plain answer: a sum over the raw ledger, nothing else."""
    expr = {"key": "api_key_id::text", "subject": "subject_id::text", "model": "requested_model",
            "provider": "coalesce(provider, '')", "day": "((created_at AT TIME ZONE 'UTC')::date)::text"}[group]
    rows = await pool.fetch(
        f"""SELECT {expr} AS g, count(*) AS n, count(*) FILTER (WHERE status >= 400) AS e,
                   sum(prompt_tokens) AS p, sum(completion_tokens) AS c, sum(cost_usd) AS u,
                   coalesce(sum(cost_diem), 0) AS d
            FROM usage_ledger
            WHERE ($1::timestamptz IS NULL OR created_at >= $1) AND ($2::timestamptz IS NULL OR created_at < $2)
              {f'AND {column} = $3' if column else 'AND $3::uuid IS NULL'}
            GROUP BY 1""",
        since, until, ident,
    )
    return {r["g"]: (r["n"], r["e"], r["p"], r["c"], r["u"], r["d"]) for r in rows}


def ranges(seed: int) -> list[tuple[datetime | None, datetime | None]]:
    day = timedelta(days=1)
    d0 = datetime(2011, 1, 10, tzinfo=timezone.utc)
    fixed: list[tuple[datetime | None, datetime | None]] = [
        (None, None),
        (START, START + timedelta(days=DAYS)),  # the whole period, whole days
        (d0, d0 + 30 * day),  # 30 whole days
        (d0 + timedelta(hours=7, minutes=13), d0 + 30 * day + timedelta(hours=7, minutes=13)),  # 30 days, partial edge days
        (d0 + timedelta(hours=5), d0 + 30 * day + timedelta(hours=19)),  # partial edge days, on the hour
        (d0 + timedelta(hours=8), d0 + timedelta(days=1, hours=16)),  # 8-hour block edges
        (d0 + timedelta(hours=1), d0 + timedelta(hours=23)),  # inside one day: hour blocks
        (d0 + timedelta(hours=22, minutes=30), d0 + timedelta(days=1, hours=1, minutes=30)),  # across midnight
        (d0 + timedelta(hours=3, minutes=10), d0 + timedelta(hours=3, minutes=50)),  # inside one hour
        (d0 + timedelta(hours=3) - TICK, d0 + timedelta(hours=4) + TICK),  # a microsecond past each edge
        (d0 + timedelta(hours=3), d0 + timedelta(hours=4)),  # exactly one hour
        (datetime(2011, 1, 2, tzinfo=timezone.utc), datetime(2011, 3, 7, tzinfo=timezone.utc)),  # one 64-day block
        (datetime(2011, 1, 2, tzinfo=timezone.utc) - TICK, datetime(2011, 3, 7, tzinfo=timezone.utc) + TICK),
        (None, d0 + timedelta(days=40, hours=3, minutes=1)),  # open start
        (d0 + timedelta(days=2, minutes=1), None),  # open end
        (None, START),  # before any of this test's calls
        (d0 + timedelta(hours=6, minutes=59), d0 + timedelta(days=12, hours=21, seconds=1)),
        (d0.astimezone(timezone(timedelta(hours=5, minutes=30))), d0 + timedelta(days=9)),  # an offset, not UTC
    ]
    rng = random.Random(seed)
    span = DAYS * 86400
    for _ in range(8):
        a = rng.randrange(span)
        fixed.append((START + timedelta(seconds=a), START + timedelta(seconds=a + rng.randint(1, span - a + 86400))))
    return fixed


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("scope", ["all", "subject", "key"])
async def test_report_equals_a_plain_sum_over_the_ledger(
    db_pool: asyncpg.Pool, long_ledger: dict[str, Any], group: str, scope: str
) -> None:
    """Every grouping, unfiltered (the block rollups), for one subject and for one key
    (blocks by key, days and hours by model): requests, errors, tokens, cost and diem
    exactly, over whole days, partial edge days, sub-day and sub-hour ranges, open ends."""
    column, ident = {"all": (None, None), "subject": ("subject_id", long_ledger["subject"]),
                     "key": ("api_key_id", long_ledger["keys"][1])}[scope]
    own = mine(long_ledger, group)
    answered = 0
    # A seed of its own per case, the same in every run: ``hash()`` of strings changes with
    # each process (PYTHONHASHSEED), and some seeds drew ranges too few of which hold calls.
    for since, until in ranges(zlib.crc32(f"{group}/{scope}".encode()) % 1000):
        query = UsageQuery(group_by=group, since=since, until=until,
                           api_key_id=ident if scope == "key" else None, subject_id=ident if scope == "subject" else None)
        report = await usage_report(db_pool, query)
        got = {r.group: (r.requests, r.errors, r.prompt_tokens, r.completion_tokens, r.cost_usd, r.cost_diem)
               for r in report.rows}
        expected = await raw_sums(db_pool, group, since, until, column, ident)
        if own is not None:
            got = {g: v for g, v in got.items() if g in own}
            expected = {g: v for g, v in expected.items() if g in own}
        else:
            got = {g: v for g, v in got.items() if g.startswith("2011-")}
            expected = {g: v for g, v in expected.items() if g.startswith("2011-")}
        assert got == expected, (group, scope, since, until)
        answered += bool(expected)
    assert answered > 20  # most ranges hold some of this test's calls


def covered(since: datetime | None, until: datetime | None, max_span: int) -> list[tuple[datetime | None, datetime | None]]:
    """The instants a plan reads, as sorted intervals, after checking every block is aligned."""
    plan = block_plan(since, until, max_span=max_span)
    parts: list[tuple[datetime | None, datetime | None]] = []
    for span, start in plan.blocks:
        assert span in BLOCK_SPANS and span <= max_span
        assert (start - EPOCH) % (span * HOUR) == timedelta(0), (span, start)  # as date_bin aligns it
        parts.append((start, start + span * HOUR))
    if plan.open_range is not None:
        assert plan.top == max(s for s in BLOCK_SPANS if s <= max_span)
        parts.append(plan.open_range)
    parts += list(plan.ledger)
    for start, end in plan.ledger:
        assert end - start < HOUR or (start == since and end == until)  # the ledger only for bits of hours
    return sorted(parts, key=lambda p: (p[0] is not None, p[0] or EPOCH))


@pytest.mark.parametrize("max_span", [24, BLOCK_SPANS[-1]])
def test_a_block_plan_covers_the_range_exactly_once(max_span: int) -> None:
    """No gap and no overlap, whatever the range: the blocks, the open top-span range and
    the ledger edges tile [since, until) end to end; and a 30-day range is a few blocks."""
    rng = random.Random(max_span)
    base = datetime(2026, 11, 1, tzinfo=timezone.utc)
    cases: list[tuple[datetime | None, datetime | None]] = [(None, None), (None, base), (base, None)]
    for _ in range(3000):
        a = base + timedelta(microseconds=rng.randrange(200 * 86400 * 10**6)) if rng.random() < 0.9 else None
        if rng.random() < 0.3 and a is not None:  # aligned starts, where off-by-ones live
            a = a.replace(minute=0, second=0, microsecond=0) - timedelta(hours=a.hour % rng.choice([1, 2, 8, 24]))
        length = timedelta(microseconds=rng.choice([1, 10**6, 3600 * 10**6, 86400 * 10**6, 30 * 86400 * 10**6]) * rng.random() * 3)
        b = (a or base) + length + TICK if rng.random() < 0.9 else None
        cases.append((a, b))
    for since, until in cases:
        parts = covered(since, until, max_span)
        assert parts[0][0] == since, (since, until, parts)
        assert parts[-1][1] == until, (since, until, parts)
        for (_, end), (start, _) in itertools.pairwise(parts):
            assert end == start, (since, until, parts)
        if max_span == 24:
            for start, end in parts:  # every block of a report by day lies inside one day
                if start is not None and end is not None and (start, end) not in block_plan(since, until, max_span=24).ledger:
                    assert (end - TICK).date() == start.date()
    thirty = block_plan(base + timedelta(hours=7, minutes=13), base + timedelta(days=30, hours=7, minutes=13))
    assert len(thirty.blocks) <= 20 and len(thirty.ledger) == 2


async def test_block_spans_are_the_databases(db_pool: asyncpg.Pool) -> None:
    assert tuple(await db_pool.fetchval("SELECT usage_block_spans()")) == BLOCK_SPANS


async def rollups(conn: asyncpg.Connection) -> dict[str, list[tuple[Any, ...]]]:
    tables = {
        "usage_daily": "day, api_key_id, subject_id, model, provider",
        "usage_hourly": "hour, api_key_id, subject_id, model, provider",
        "budget_spend": "scope, id, period, period_start",
        "usage_key_blocks": "span_hours, block_start, api_key_id, subject_id",
        "usage_model_blocks": "span_hours, block_start, model, provider",
    }
    return {t: [tuple(r) for r in await conn.fetch(f"SELECT * FROM {t} ORDER BY {order}")] for t, order in tables.items()}


async def test_the_migration_backfills_the_blocks_and_the_trigger_keeps_them(pg_admin_dsn: str, tmp_path: Path) -> None:
    """A ledger filled before 0015 gets its blocks from the migration; calls shipped after
    it are added by the trigger; and usage_rollups_rebuild() (what bench/ledger_report.py
    runs after a set-based fill) builds every rollup exactly as the triggers did."""
    before = tmp_path / "sql"
    before.mkdir()
    for path in sorted(migrations_dir().glob("*.sql")):
        if path.name < "0015":
            shutil.copy(path, before / path.name)
    name = f"llmg_test_blocks_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(pg_admin_dsn)
    await admin.execute(f'CREATE DATABASE "{name}"')
    try:
        conn = await asyncpg.connect(_with_db(pg_admin_dsn, name))
        try:
            await migrate(conn, before)
            subject, keys = uuid.uuid4(), [uuid.uuid4(), uuid.uuid4()]
            events = make_events(keys, subject, ["m1", "m2"], ["p", "p-venice"], seed=5, n=600)
            await ship_lines(conn, [e.to_line() for e in events[:500]])
            assert (await migrate(conn))[0] == "0015_usage_blocks.sql"  # and any later ones
            await ship_lines(conn, [e.to_line() for e in events[500:]])
            for block_table, dims, expr in [
                ("usage_key_blocks", "api_key_id, subject_id", "api_key_id, subject_id"),
                ("usage_model_blocks", "model, provider", "requested_model, coalesce(provider, '')"),
            ]:
                expected = await conn.fetch(
                    f"""SELECT s.span, date_bin(make_interval(hours => s.span), created_at, TIMESTAMPTZ '1970-01-01+00') AS start,
                               {expr}, count(*), count(*) FILTER (WHERE status >= 400), sum(prompt_tokens),
                               sum(completion_tokens), sum(cost_usd), coalesce(sum(cost_diem), 0)
                        FROM usage_ledger CROSS JOIN unnest(usage_block_spans()) AS s (span)
                        GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 3, 4""")
                got = await conn.fetch(
                    f"""SELECT span_hours, block_start, {dims}, requests, errors, prompt_tokens, completion_tokens,
                               cost_usd, cost_diem FROM {block_table} ORDER BY 1, 2, 3, 4""")
                assert [tuple(r) for r in got] == [tuple(r) for r in expected], block_table
                assert len(got) > 11 * len(keys)
            kept = await rollups(conn)
            await conn.execute("SELECT usage_rollups_rebuild()")
            assert await rollups(conn) == kept
        finally:
            await conn.close()
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


@pytest.mark.parametrize(("group", "scope", "rollup"), [
    ("key", "all", "usage_key_blocks"),  # blocks by key
    ("model", "all", "usage_model_blocks"),  # blocks by model
    ("model", "key", "usage_hourly"),  # one key's models: days and hours
])
async def test_a_partial_hour_with_no_call_of_its_hour_outside_the_range_is_read_from_the_hours_rollup(
    db_pool: asyncpg.Pool, key_factory: Any, group: str, scope: str, rollup: str
) -> None:
    """A range ending after its last hour's calls (a range ending now) reads that hour's
    rollup row, not the ledger's calls; once a call of that hour lies outside the range, the
    ledger is read again. Shown by the rollup's own figure, raised by hand: the report
    follows it only where it reads the rollup. Both ends: the range's last partial hour
    and its first."""
    tag = uuid.uuid4().hex[:8]
    subject = uuid.uuid4()
    key = (await key_factory(name=f"edge-{tag}", subject_id=subject))[1].api_key_id
    model, provider = f"edge-{tag}-model", f"edge-{tag}-p"
    # Not the other tests' 2011, and an hour of its own per case: with no key filter, a call
    # of anybody's in the hour sends the report to the ledger.
    month = {"usage_key_blocks": 5, "usage_model_blocks": 6, "usage_hourly": 7}[rollup]
    hour = datetime(2012, month, 1, 10, tzinfo=timezone.utc)
    rng = random.Random(7)
    calls = [make_event(key, subject, hour + timedelta(minutes=m), rng, model, provider) for m in (5, 20)]
    await ship_lines(db_pool, [e.to_line() for e in calls])
    where, ident = {"usage_key_blocks": ("span_hours = 1 AND block_start = $1 AND api_key_id = $2", key),
                    "usage_model_blocks": ("span_hours = 1 AND block_start = $1 AND model = $2", model),
                    "usage_hourly": ("hour = $1 AND api_key_id = $2", key)}[rollup]
    assert await db_pool.execute(f"UPDATE {rollup} SET requests = requests + 1000 WHERE {where}", hour, ident) \
        == "UPDATE 1"
    own = str(key) if group == "key" else model

    async def requests(since: datetime, until: datetime) -> int:
        report = await usage_report(db_pool, UsageQuery(group_by=group, since=since, until=until,
                                                        api_key_id=key if scope == "key" else None))
        return sum(r.requests for r in report.rows if r.group == own)

    assert await requests(hour, hour + timedelta(minutes=30)) == 1002  # the hour's rollup row, raised
    assert await requests(hour - 3 * HOUR, hour + timedelta(minutes=30)) == 1002  # the range's last partial hour
    assert await requests(hour + timedelta(minutes=1), hour + 4 * HOUR) == 1002  # its first
    assert await requests(hour + timedelta(minutes=10), hour + timedelta(minutes=30)) == 1  # a call before: the ledger
    late = make_event(key, subject, hour + timedelta(minutes=45), rng, model, provider)
    await ship_lines(db_pool, [late.to_line()])
    assert await requests(hour, hour + timedelta(minutes=30)) == 2  # a call after: the ledger
    assert await requests(hour - 3 * HOUR, hour + timedelta(minutes=30)) == 2
    assert await requests(hour + timedelta(minutes=1), hour + 4 * HOUR) == 1003  # still none before 10:01
