"""How fast usage reports and budget refreshes stay on a large ledger (default 1 million rows).

    python bench/ledger_report.py [--dsn ADMIN_DSN] [--rows 1000000] [--days 90] [--keys 500]

Creates a scratch database (``llmg_bench_ledger_*``, dropped at the end unless
``--keep``), applies the migrations, fills the ledger set-based (``INSERT ... SELECT FROM
generate_series`` in batches, the rollup triggers and the ledger's indexes off meanwhile,
then the indexes built and every rollup built by ``usage_rollups_rebuild()``, one GROUP
BY each: 10 M rows in minutes), then times each report the ``usage`` command and
``GET /admin/usage`` run (every grouping over the last 30 days, 30 days ending 40 days
ago and all time, server time and client-side), the budget refresh every replica runs
once a second, the budget reservation round trip, shipping through the triggers, and,
for comparison, the same report summed from the ledger alone.

The figure in docs/billing.md: ``--rows 10000000 --keys 2000``.

Traffic shape: keys used with Zipf-like skew, each key on one to three models of a dozen,
each model on one provider, spread evenly over ``--days`` days up to now; 2 % provider
errors and 0.5 % rate limits (no tokens, no cost), 60 % streamed, Venice's calls with a
diem cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.billing.budgets import fetch_spend
from gateway.billing.ledger import LEDGER_COLUMNS, UsageEvent, ship_lines
from gateway.billing.reports import GROUPS, UsageQuery, report_statement, usage_report
from gateway.billing.reservations import Budget, PostgresReservations, Reservation, period_start
from gateway.core.db import migrate

DEFAULT_DSN = os.environ.get("TEST_PG_ADMIN_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
MODELS = [f"model-{i}" for i in range(12)]
PROVIDERS = ["venice", "anthropic", "local"]
#: The columns the fill writes, in its SELECT's order: every column an event fills.
FILL_COLUMNS = (
    "call_id", "request_id", "response_id", "api_key_id", "subject_id", "requested_model", "served_model",
    "provider", "deployment", "prompt_tokens", "completion_tokens", "usage_estimated", "cost_usd",
    "cost_diem", "cost_source", "latency_seconds", "ttft_seconds", "status", "outcome", "streamed",
    "retries", "failovers", "error_type", "finish_reason", "created_at", "protocol", "guardrails", "recorded_at",
)
assert set(FILL_COLUMNS) == {*LEDGER_COLUMNS, "recorded_at"}, "a ledger column was added: fill it here too"


def with_db(dsn: str, name: str) -> str:
    base, _, _ = dsn.rpartition("/")
    return f"{base}/{name}"


async def timed(label: str, action: Callable[[], Awaitable[Any]], runs: int = 5) -> float:
    """Run ``action`` ``runs`` times after one warm-up; print and return the median ms."""
    await action()
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        await action()
        samples.append((time.perf_counter() - start) * 1000)
    median = statistics.median(samples)
    print(f"  {label:<58} median {median:8.1f} ms   min {min(samples):8.1f} ms")
    return median


async def fill(conn: asyncpg.Connection, rows: int, days: int, n_keys: int, batch: int) -> list[tuple[uuid.UUID, uuid.UUID]]:
    """Fill the ledger set-based: one ``INSERT ... SELECT FROM generate_series`` per
    ``batch`` rows, with the ledger's triggers disabled and its indexes dropped,
    then the indexes rebuilt and every rollup built from the ledger in one statement each
    (what the migrations' backfills do). Returns the keys (id, subject), busiest first."""
    rng = random.Random(42)
    subjects = [uuid.uuid4() for _ in range(max(1, n_keys // 10))]
    keys = [(uuid.uuid4(), rng.choice(subjects)) for _ in range(n_keys)]
    await conn.copy_records_to_table(
        "api_keys",
        records=[(k, s, f"bench-{i}", f"llmg_b{i:06d}", os.urandom(32)) for i, (k, s) in enumerate(keys)],
        columns=["api_key_id", "subject_id", "name", "key_prefix", "key_hash"],
    )
    # Each key calls one to three of the dozen models; each model is served by one provider.
    await conn.execute("CREATE TEMP TABLE bench_models (idx int PRIMARY KEY, model text, provider text)")
    await conn.copy_records_to_table("bench_models", records=[
        (i, m, PROVIDERS[i % len(PROVIDERS)]) for i, m in enumerate(MODELS)])
    await conn.execute("CREATE TEMP TABLE bench_keys (idx int PRIMARY KEY, api_key_id uuid, subject_id uuid, models int[])")
    await conn.copy_records_to_table("bench_keys", records=[
        (i, k, s, rng.sample(range(len(MODELS)), rng.randint(1, 3))) for i, (k, s) in enumerate(keys)])
    await conn.execute("ANALYZE bench_models; ANALYZE bench_keys")

    start = time.perf_counter()
    # Indexes are built once at the end (far cheaper than 10 M random inserts into each).
    indexes = await conn.fetch(
        """SELECT c.relname AS name, pg_get_indexdef(c.oid) AS def, con.conname AS constraint_name,
                  pg_get_constraintdef(con.oid) AS constraint_def
           FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
           LEFT JOIN pg_constraint con ON con.conindid = i.indexrelid
           WHERE i.indrelid = 'usage_ledger'::regclass""")
    for ix in indexes:
        if ix["constraint_name"]:
            await conn.execute(f'ALTER TABLE usage_ledger DROP CONSTRAINT "{ix["constraint_name"]}"')
        else:
            await conn.execute(f'DROP INDEX "{ix["name"]}"')
    await conn.execute("ALTER TABLE usage_ledger DISABLE TRIGGER USER")
    await conn.execute("SET synchronous_commit = off")
    now = datetime.now(timezone.utc)
    for done in range(0, rows, batch):
        count = min(batch, rows - done)
        # Keys by a Zipf-like law (key i with weight ~1/(i+1): a few keys do most calls);
        # times uniform over the days and rising with insertion, as calls reach a real
        # ledger (so an hour's rows sit together on disk, as they do there); 2 % provider
        # errors and 0.5 % rate limits (no tokens, no cost), 60 % streamed; the Venice
        # model's calls carry a diem cost.
        await conn.execute(
            f"""
            INSERT INTO usage_ledger ({", ".join(FILL_COLUMNS)})
            SELECT gen_random_uuid(), md5(r.g::text || $4), CASE WHEN r.status = 200 THEN 'chatcmpl-' || r.g END,
                   k.api_key_id, k.subject_id, m.model, m.model, m.provider, m.provider || '/' || m.model,
                   t.prompt, t.completion, false, t.cost,
                   CASE WHEN m.provider = 'venice' THEN t.cost END,
                   CASE WHEN r.status <> 200 THEN 'none' WHEN m.provider = 'venice' THEN 'provider' ELSE 'price' END,
                   0.2 + r.u * 3, CASE WHEN r.streamed THEN 0.05 + r.u * 0.5 END,
                   r.status, CASE WHEN r.status = 200 THEN 'ok' ELSE 'provider_error' END, r.streamed,
                   0, 0, CASE r.status WHEN 502 THEN 'upstream_error' WHEN 429 THEN 'rate_limited' END,
                   CASE WHEN r.status = 200 THEN 'stop' END, r.created_at,
                   CASE WHEN r.u < 0.8 THEN 'chat' ELSE 'anthropic' END, NULL,
                   r.created_at + make_interval(secs => 1 + r.u * 3)
            FROM (SELECT g,
                         least($1 - 1, floor(exp(random() * ln($1 + 1)))::int - 1) AS key_idx,
                         random() AS model_pick, random() AS u,
                         CASE WHEN random() < 0.975 THEN 200 WHEN random() < 0.8 THEN 502 ELSE 429 END AS status,
                         random() < 0.6 AS streamed,
                         $3::timestamptz - make_interval(secs => $2 * (1 - (g + random()) / $7)) AS created_at,
                         5 + floor(random() * 1996)::int AS prompt, floor(random() * 1501)::int AS completion
                  FROM generate_series($5::bigint, $6::bigint) AS g) r
            JOIN bench_keys k ON k.idx = r.key_idx
            JOIN bench_models m ON m.idx = k.models[1 + floor(r.model_pick * cardinality(k.models))::int]
            CROSS JOIN LATERAL (
              SELECT CASE WHEN r.status = 200 THEN r.prompt ELSE 0 END AS prompt,
                     CASE WHEN r.status = 200 THEN r.completion ELSE 0 END AS completion,
                     CASE WHEN r.status = 200 THEN (r.prompt * 3 + r.completion * 15)::numeric / 1000000 ELSE 0 END AS cost
            ) t
            """,
            n_keys, float(days * 86400), now, uuid.uuid4().hex, done, done + count - 1, float(rows),
        )
        print(f"\r  filled {done + count:>11,} rows ({time.perf_counter() - start:.0f} s)", end="", flush=True)
    filled = time.perf_counter() - start
    for ix in indexes:
        if ix["constraint_name"]:
            await conn.execute(f'ALTER TABLE usage_ledger ADD CONSTRAINT "{ix["constraint_name"]}" {ix["constraint_def"]}')
        else:
            await conn.execute(ix["def"])
    indexed = time.perf_counter() - start
    await conn.execute("SELECT usage_rollups_rebuild()")
    await conn.execute("ALTER TABLE usage_ledger ENABLE TRIGGER USER")
    elapsed = time.perf_counter() - start
    print(f"\r  filled {rows:,} rows in {elapsed:.0f} s: insert {filled:.0f} s, indexes {indexed - filled:.0f} s, "
          f"rollups {elapsed - indexed:.0f} s")
    start = time.perf_counter()
    await conn.execute("SELECT usage_blocks_rebuild()")
    print(f"  the block rollups alone, from usage_hourly (migration 0015's backfill, shipping held meanwhile): "
          f"{time.perf_counter() - start:.0f} s")
    return keys


async def before_the_fill(conn: asyncpg.Connection) -> float:
    """When the shipping runs' calls are dated: a day before the ledger's first call, so
    they are in none of the reported ranges but all time, and a ``--reuse`` run reports
    on the same ledger (the triggers do the same work on older blocks)."""
    first = await conn.fetchval("SELECT extract(epoch FROM min(created_at)) FROM usage_ledger")
    return float(first if first is not None else time.time()) - 86400


async def ship_throughput(conn: asyncpg.Connection, keys: list[tuple[uuid.UUID, uuid.UUID]], batches: int, size: int) -> None:
    """The path the BillingActor really uses: journal lines → one INSERT per batch."""
    rng = random.Random(1)
    now = await before_the_fill(conn)
    lines_batches = []
    for _ in range(batches):
        lines = []
        for _ in range(size):
            key, subject = rng.choice(keys)
            lines.append(UsageEvent(
                call_id=uuid.uuid4(), request_id=uuid.uuid4().hex, response_id="chatcmpl-x", api_key_id=key,
                subject_id=subject, requested_model="model-1", served_model="model-1", provider="venice",
                deployment="venice/model-1", prompt_tokens=100, completion_tokens=200, usage_estimated=False,
                cost_usd=0.0012, cost_diem=None, cost_source="price", latency_seconds=0.4, ttft_seconds=0.1,
                status=200, outcome="ok", streamed=True, retries=0, failovers=0, error_type=None,
                finish_reason="stop", created_at=now,
            ).to_line())
        lines_batches.append(lines)
    start = time.perf_counter()
    for lines in lines_batches:
        await ship_lines(conn, lines)
    elapsed = time.perf_counter() - start
    total = batches * size
    print(f"  shipped {total:,} events in {batches} batches of {size}: {elapsed * 1000 / batches:.1f} ms per batch, "
          f"{total / elapsed:,.0f} events/s")
    start = time.perf_counter()
    again = sum([await ship_lines(conn, lines) for lines in lines_batches])
    print(f"  re-shipping the same batches (crash recovery): {again} inserted, "
          f"{(time.perf_counter() - start) * 1000 / batches:.1f} ms per batch")


async def blocks_cost(conn: asyncpg.Connection, keys: list[tuple[uuid.UUID, uuid.UUID]]) -> None:
    """What the block rollups' trigger adds to shipping: batches of 500 with it and
    without it, alternated (so the machine's load weighs on both alike)."""
    rng = random.Random(2)
    now = await before_the_fill(conn)
    per_batch: dict[bool, list[float]] = {True: [], False: []}
    for round_ in range(10):
        for with_blocks in (True, False):
            lines = []
            for _ in range(500):
                key, subject = rng.choice(keys)
                model = rng.choice(MODELS)
                lines.append(UsageEvent(
                    call_id=uuid.uuid4(), request_id=uuid.uuid4().hex, response_id="chatcmpl-x", api_key_id=key,
                    subject_id=subject, requested_model=model, served_model=model, provider="venice",
                    deployment=f"venice/{model}", prompt_tokens=100, completion_tokens=200, usage_estimated=False,
                    cost_usd=0.0012, cost_diem=None, cost_source="price", latency_seconds=0.4, ttft_seconds=0.1,
                    status=200, outcome="ok", streamed=True, retries=0, failovers=0, error_type=None,
                    finish_reason="stop", created_at=now - rng.random() * 60,
                ).to_line())
            if not with_blocks:
                await conn.execute("ALTER TABLE usage_ledger DISABLE TRIGGER usage_ledger_blocks")
            start = time.perf_counter()
            await ship_lines(conn, lines)
            elapsed = time.perf_counter() - start
            if not with_blocks:
                await conn.execute("ALTER TABLE usage_ledger ENABLE TRIGGER usage_ledger_blocks")
            if round_:  # the first round warms up
                per_batch[with_blocks].append(elapsed * 1000)
    print(f"  batches of 500 over all models, alternated: with the block rollups "
          f"{statistics.median(per_batch[True]):.1f} ms, without {statistics.median(per_batch[False]):.1f} ms (medians)")
    # Leave the rollups as the triggers would have (the batches without blocks added),
    # vacuumed and analysed as autovacuum would, for a later --reuse run.
    await conn.execute("SELECT usage_blocks_rebuild()")
    await conn.execute("VACUUM ANALYZE usage_key_blocks")
    await conn.execute("VACUUM ANALYZE usage_model_blocks")


async def reservations(conn: asyncpg.Connection, key: tuple[uuid.UUID, uuid.UUID]) -> None:
    """The budget check of a call: reserve against a key's and its subject's budgets (the
    busiest key, so its budget_spend rows are the hottest), with 50 reservations open."""
    key_id, subject_id = key
    budgets = (Budget("key", key_id, "month", period_start("month"), 10**15),
               Budget("subject", subject_id, "month", period_start("month"), 10**15))
    store = PostgresReservations(conn)  # type: ignore[arg-type]  # a connection answers the same calls
    for _ in range(50):
        await store.reserve(Reservation(uuid.uuid4(), 1000, budgets), 600)

    async def one() -> None:
        await store.reserve(Reservation(uuid.uuid4(), 1000, budgets), 600)

    await timed("reserve against key + subject budgets, 50 open", one, runs=200)
    await conn.execute("DELETE FROM budget_reservations")


def run_report(conn: asyncpg.Connection, query: UsageQuery) -> Callable[[], Awaitable[Any]]:
    return lambda: usage_report(conn, query)


async def server_ms(conn: asyncpg.Connection, query: UsageQuery, runs: int = 5) -> float:
    """The median time PostgreSQL spends on the report's statement (planning plus
    execution, EXPLAIN ANALYZE without per-node timing): server time, without the round
    trip and the decoding of the rows."""
    statement, args = report_statement(query)
    samples = []
    for _ in range(runs):
        [plan] = json.loads(await conn.fetchval(f"EXPLAIN (ANALYZE, TIMING OFF, FORMAT JSON) {statement}", *args))
        samples.append(plan["Planning Time"] + plan["Execution Time"])
    return statistics.median(samples)


async def reports(conn: asyncpg.Connection, keys: list[tuple[uuid.UUID, uuid.UUID]], now: datetime, odd: timedelta) -> None:
    """Every grouping over the three ranges of the target, then a few more shapes; ends
    with the Markdown table docs/billing.md carries (server and client medians, ms)."""
    print(f"reports (gateway.billing.reports.usage_report), client-side median / server median; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs:")
    ranges = {
        "last 30 days": (now - timedelta(days=30) + odd, now),
        "30 days ending 40 days ago": (now - timedelta(days=70) + odd, now - timedelta(days=40) + odd),
        "all time": (None, None),
    }
    table: dict[tuple[str, str], tuple[float, float]] = {}
    for group in GROUPS:
        for name, (since, until) in ranges.items():
            query = UsageQuery(group_by=group, since=since, until=until)
            client = await timed(f"group by {group}, {name}", run_report(conn, query))
            table[group, name] = (await server_ms(conn, query), client)
            print(f"  {'':<58} server {table[group, name][0]:8.1f} ms")
    top_key, top_subject = keys[0]
    # Edges at 00:30 and 23:30: five hour blocks and a partial hour at each end, the
    # most a 30-day range reads.
    midnight = (now - timedelta(days=32)).replace(hour=0, minute=0, second=0, microsecond=0)
    worst = (midnight + timedelta(minutes=30), midnight + timedelta(days=29, hours=23, minutes=30))
    for label, query in [
        ("group by key, 30 days, edges at 00:30 and 23:30", UsageQuery(group_by="key", since=worst[0], until=worst[1])),
        ("group by subject, 30 days, edges at 00:30 and 23:30", UsageQuery(group_by="subject", since=worst[0], until=worst[1])),
        ("group by model, last 7 days", UsageQuery(group_by="model", since=now - timedelta(days=7) + odd, until=now)),
        ("group by model, one busy key, last 30 days", UsageQuery(group_by="model", api_key_id=top_key, since=ranges["last 30 days"][0], until=now)),
        ("group by day, one busy key, all time", UsageQuery(group_by="day", api_key_id=top_key)),
        ("group by key, one subject, last 30 days", UsageQuery(group_by="key", subject_id=top_subject, since=ranges["last 30 days"][0], until=now)),
        ("group by key, inside one day", UsageQuery(group_by="key", since=now - timedelta(hours=20, minutes=7), until=now - timedelta(hours=2))),
    ]:
        await timed(label, run_report(conn, query))
        print(f"  {'':<58} server {await server_ms(conn, query):8.1f} ms")
    print("\n| group by | " + " | ".join(ranges) + " |")
    print("| --- |" + " --- |" * len(ranges))
    for group in GROUPS:
        cells = [f"{table[group, name][0]:.1f} ({table[group, name][1]:.1f})" for name in ranges]
        print(f"| {group} | " + " | ".join(cells) + " |")
    print(f"(server ms, client-side ms in brackets; medians of 5; load average now {os.getloadavg()[0]:.1f})\n")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=DEFAULT_DSN, help="a superuser DSN (a scratch database is created)")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--days", type=int, default=90)
    parser.add_argument("--keys", type=int, default=500)
    parser.add_argument("--batch", type=int, default=1_000_000, help="rows per INSERT of the fill")
    parser.add_argument("--keep", action="store_true", help="keep the scratch database")
    parser.add_argument("--reuse", metavar="NAME", help="time an existing (kept) database; no fill, no drop")
    args = parser.parse_args()

    name = args.reuse or f"llmg_bench_ledger_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(args.dsn)
    if args.reuse:
        args.keep = True
    else:
        await admin.execute(f'CREATE DATABASE "{name}"')
    print(f"{'reusing' if args.reuse else 'scratch'} database {name}")
    try:
        conn = await asyncpg.connect(with_db(args.dsn, name))
        try:
            if args.reuse:
                keys = [(r["api_key_id"], r["subject_id"]) for r in await conn.fetch(
                    "SELECT api_key_id, subject_id FROM api_keys ORDER BY name")]
            else:
                await migrate(conn)
                keys = await fill(conn, args.rows, args.days, args.keys, args.batch)
                await conn.execute("VACUUM ANALYZE")
            for table in ("usage_ledger", "usage_daily", "usage_hourly", "usage_key_blocks", "usage_model_blocks"):
                rows, size = await conn.fetchrow(
                    f"""SELECT (SELECT count(*) FROM {table}),
                               pg_size_pretty((SELECT sum(pg_total_relation_size(c))
                                               FROM (SELECT '{table}'::regclass AS c
                                                     UNION ALL SELECT inhrelid FROM pg_inherits
                                                     WHERE inhparent = '{table}'::regclass) AS t))""")
                print(f"  {table:<20} {rows:>12,} rows  {size:>8}")

            now = datetime.now(timezone.utc)
            odd = timedelta(hours=7, minutes=13)  # not midnight: the edges come from the ledger
            await reports(conn, keys, now, odd)
            print("for comparison, the same from the ledger alone:")
            await timed("group by key, all time, ledger scan", lambda: conn.fetch(
                "SELECT api_key_id, count(*), sum(prompt_tokens), sum(completion_tokens), sum(cost_usd) FROM usage_ledger GROUP BY 1"))
            await timed("group by key, last 30 days, ledger scan", lambda: conn.fetch(
                "SELECT api_key_id, count(*), sum(cost_usd) FROM usage_ledger WHERE created_at >= $1 GROUP BY 1",
                now - timedelta(days=30) + odd))

            print("budget refresh (every replica, about once a second):")
            await conn.execute("UPDATE api_keys SET budget_usd = 100, budget_period = (ARRAY['day','month','total'])[1 + (abs(hashtext(name)) % 3)]")
            await conn.execute(
                "INSERT INTO subject_budgets (subject_id, budget_usd, budget_period) SELECT DISTINCT subject_id, 500, 'month' FROM api_keys"
                " ON CONFLICT DO NOTHING")
            budgeted = await conn.fetchval("SELECT count(*) FROM api_keys WHERE budget_usd IS NOT NULL")
            subjects = await conn.fetchval("SELECT count(*) FROM subject_budgets")
            await timed(f"fetch_spend: {budgeted} budgeted keys + {subjects} subjects", lambda: fetch_spend(conn))

            print("budget reservations (gateway.billing.reservations.PostgresReservations, one round trip per call):")
            await reservations(conn, keys[0])

            print("shipping (gateway.billing.ledger.ship_lines, the BillingActor's batch insert):")
            await ship_throughput(conn, keys, batches=20, size=500)
            await ship_throughput(conn, keys, batches=4, size=5000)
            await blocks_cost(conn, keys)
        finally:
            await conn.close()
    finally:
        if not args.keep:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


if __name__ == "__main__":
    asyncio.run(main())
