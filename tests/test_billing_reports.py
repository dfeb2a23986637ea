"""Usage reports equal the ledger: rollup for whole days, ledger for the edges; CLI and params."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import uuid
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import asyncpg
import pytest

from gateway.billing.ledger import UsageEvent, ship_lines
from gateway.billing.reports import UsageQuery, query_from_params, usage_report
from tests.conftest import REPO

DAY0 = datetime(2026, 3, 1, tzinfo=timezone.utc)


def event(key: uuid.UUID, subject: uuid.UUID, at: datetime, rng: random.Random, *, model: str, provider: str) -> UsageEvent:
    prompt, completion = rng.randint(1, 500), rng.randint(0, 900)
    return UsageEvent(
        call_id=uuid.uuid4(), request_id=uuid.uuid4().hex, response_id=None, api_key_id=key,
        subject_id=subject, requested_model=model, served_model=model, provider=provider,
        deployment=f"{provider}/{model}", prompt_tokens=prompt, completion_tokens=completion,
        usage_estimated=False, cost_usd=round(rng.uniform(0, 0.05), 8), cost_diem=None,
        cost_source="price", latency_seconds=0.1, ttft_seconds=None,
        status=rng.choice([200, 200, 200, 502]), outcome="ok", streamed=False, retries=0,
        failovers=0, error_type=None, finish_reason="stop", created_at=at.timestamp(),
    )


@pytest.fixture
async def ledger(db_pool: asyncpg.Pool, key_factory: Any) -> dict[str, Any]:
    """~600 calls over four days for two keys of one fresh subject."""
    subject = uuid.uuid4()
    keys = [(await key_factory(name=f"report-{i}", subject_id=subject))[1].api_key_id for i in range(2)]
    rng = random.Random(7)
    events = [
        event(rng.choice(keys), subject, DAY0 + timedelta(seconds=rng.randint(0, 4 * 86400 - 1)), rng,
              model=rng.choice(["small", "large", "venice/llama"]), provider=rng.choice(["a", "b"]))
        for _ in range(600)
    ]
    # Include the exact edges of days, where off-by-one mistakes live.
    events += [event(keys[0], subject, DAY0 + timedelta(days=d), rng, model="small", provider="a") for d in range(5)]
    # And of hours, where the hourly rollup's edges are.
    events += [event(keys[1], subject, DAY0 + timedelta(hours=h), rng, model="large", provider="b") for h in range(0, 96, 7)]
    for start in range(0, len(events), 100):  # several batches, like several ships
        await ship_lines(db_pool, [e.to_line() for e in events[start:start + 100]])
    return {"subject": subject, "keys": keys, "events": events}


async def ledger_sums(pool: asyncpg.Pool, subject: uuid.UUID, since: datetime | None, until: datetime | None,
                      group: str) -> dict[str, tuple[int, int, int, Decimal]]:
    expr = {"key": "api_key_id::text", "model": "requested_model", "provider": "provider",
            "day": "((created_at AT TIME ZONE 'UTC')::date)::text", "subject": "subject_id::text"}[group]
    rows = await pool.fetch(
        f"""SELECT {expr} AS g, count(*) AS n, sum(prompt_tokens) AS p, sum(completion_tokens) AS c,
                   sum(cost_usd) AS u
            FROM usage_ledger WHERE subject_id = $1
              AND ($2::timestamptz IS NULL OR created_at >= $2) AND ($3::timestamptz IS NULL OR created_at < $3)
            GROUP BY 1""",
        subject, since, until,
    )
    return {r["g"]: (r["n"], r["p"], r["c"], r["u"]) for r in rows}


RANGES: list[tuple[datetime | None, datetime | None]] = [
    (None, None),
    (DAY0, DAY0 + timedelta(days=2)),  # whole days: the rollup only
    (DAY0 + timedelta(hours=5, minutes=3), None),  # a partial first day
    (None, DAY0 + timedelta(days=2, hours=7)),  # a partial last day
    (DAY0 + timedelta(hours=1), DAY0 + timedelta(hours=20)),  # inside one day
    (DAY0 + timedelta(hours=22), DAY0 + timedelta(days=1, hours=2)),  # across one midnight
    (DAY0 + timedelta(days=1, seconds=1), DAY0 + timedelta(days=3, seconds=-1)),
    (DAY0 + timedelta(days=3), DAY0 + timedelta(days=4)),  # the last day, and its end exactly
    (DAY0 + timedelta(hours=7), DAY0 + timedelta(days=1, hours=14)),  # whole hours at both edges
    (DAY0 + timedelta(hours=6, minutes=59), DAY0 + timedelta(days=2, hours=21, seconds=1)),  # hours and bits
]


@pytest.mark.parametrize("group", ["key", "model", "day", "provider", "subject"])
async def test_report_equals_the_ledger_for_every_range(db_pool: asyncpg.Pool, ledger: dict[str, Any], group: str) -> None:
    rng = random.Random(group)
    ranges = RANGES + [
        (DAY0 + timedelta(seconds=a), DAY0 + timedelta(seconds=a + b))
        for a, b in ((rng.randint(0, 300_000), rng.randint(1, 200_000)) for _ in range(6))
    ]
    for since, until in ranges:
        report = await usage_report(db_pool, UsageQuery(group_by=group, since=since, until=until, subject_id=ledger["subject"]))
        expected = await ledger_sums(db_pool, ledger["subject"], since, until, group)
        got = {r.group: (r.requests, r.prompt_tokens, r.completion_tokens, r.cost_usd) for r in report.rows}
        assert got == expected, (since, until)
        total = report.total
        assert (total.requests, total.cost_usd) == (
            sum(v[0] for v in expected.values()), sum((v[3] for v in expected.values()), Decimal(0))
        )


async def test_report_by_key_names_the_keys_and_filters_by_key(db_pool: asyncpg.Pool, ledger: dict[str, Any]) -> None:
    key = ledger["keys"][0]
    report = await usage_report(db_pool, UsageQuery(group_by="key", api_key_id=key))
    [row] = report.rows
    assert row.group == str(key) and row.key_name == "report-0" and row.key_prefix
    assert row.requests == sum(1 for e in ledger["events"] if e.api_key_id == key)
    assert row.errors == sum(1 for e in ledger["events"] if e.api_key_id == key and e.status >= 400)
    day_rows = (await usage_report(db_pool, UsageQuery(group_by="day", api_key_id=key))).rows
    assert [r.group for r in day_rows] == sorted(r.group for r in day_rows)  # days in order


def test_admin_params_are_checked_with_the_parameter_named() -> None:
    q = query_from_params({"group_by": "day", "since": "2026-03-01", "until": "2026-03-02T12:00:00+02:00"})
    assert q.since == DAY0 and q.until == datetime(2026, 3, 2, 10, tzinfo=timezone.utc)
    for params, name in [
        ({"group_by": "colour"}, "group_by"), ({"since": "yesterday"}, "since"),
        ({"api_key_id": "nope"}, "api_key_id"), ({"since": "2026-03-02", "until": "2026-03-01"}, "since"),
        ({"limit": "5"}, "limit"),
    ]:
        with pytest.raises(ValueError, match=f"^{name}:"):
            query_from_params(params)


def cli(database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DATABASE_URL": database_url, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "gateway", *args], env=env, capture_output=True, text=True, timeout=60)


async def test_usage_command_prints_the_same_totals(database_url: str, db_pool: asyncpg.Pool, ledger: dict[str, Any]) -> None:
    key = ledger["keys"][1]
    prefix = await db_pool.fetchval("SELECT key_prefix FROM api_keys WHERE api_key_id = $1", key)
    since, until = "2026-03-01T06:00:00Z", "2026-03-03"
    done = cli(database_url, "usage", "--key", prefix, "--since", since, "--until", until, "--group-by", "model", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    expected = await db_pool.fetchrow(
        "SELECT count(*) AS n, sum(cost_usd) AS u FROM usage_ledger WHERE api_key_id = $1 AND created_at >= $2 AND created_at < $3",
        key, datetime(2026, 3, 1, 6, tzinfo=timezone.utc), datetime(2026, 3, 3, tzinfo=timezone.utc),
    )
    assert out["total"]["requests"] == expected["n"]
    assert Decimal(str(out["total"]["cost_usd"])) == pytest.approx(expected["u"], abs=Decimal("1e-9"))
    assert {r["group"] for r in out["rows"]} <= {"small", "large", "venice/llama"}
    table = cli(database_url, "usage", "--key", prefix, "--group-by", "day")
    assert table.returncode == 0 and table.stdout.splitlines()[0].startswith("DAY (UTC)")
    assert table.stdout.splitlines()[-1].startswith("TOTAL")


def test_usage_command_refuses_bad_input_in_one_line(database_url: str) -> None:
    for args, code in [
        (("usage", "--since", "last tuesday"), 2),
        (("usage", "--since", "2026-03-02", "--until", "2026-03-01"), 1),
        (("usage", "--key", "llmg_nothere"), 1),
    ]:
        done = cli(database_url, *args)
        assert done.returncode == code, done
        assert "Traceback" not in done.stderr and done.stderr.strip()


async def test_budgets_command_sets_lists_and_clears(database_url: str, db_pool: asyncpg.Pool) -> None:
    subject = str(uuid.uuid4())
    done = cli(database_url, "budgets", "set", "--subject", subject, "--usd", "12.5", "--period", "day", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["budget_usd"] == 12.5
    listed = json.loads(cli(database_url, "budgets", "list", "--json").stdout)
    assert {"subject_id": subject, "budget_usd": 12.5, "budget_period": "day"}.items() <= next(
        b for b in listed if b["subject_id"] == subject
    ).items()
    assert cli(database_url, "budgets", "clear", "--subject", subject).returncode == 0
    assert await db_pool.fetchval("SELECT count(*) FROM subject_budgets WHERE subject_id = $1", uuid.UUID(subject)) == 0
    assert cli(database_url, "budgets", "clear", "--subject", subject).returncode == 1
    assert cli(database_url, "budgets", "set", "--subject", subject, "--usd", "-1").returncode == 2


async def test_budget_spend_matches_the_ledger(db_pool: asyncpg.Pool, ledger: dict[str, Any]) -> None:
    """The per-period spend the budget refresh reads is the ledger's, for keys and subjects."""
    for scope, column, ident in [("subject", "subject_id", ledger["subject"]), ("key", "api_key_id", ledger["keys"][0])]:
        for period, bucket in [("day", "(created_at AT TIME ZONE 'UTC')::date"),
                               ("month", "date_trunc('month', created_at AT TIME ZONE 'UTC')::date"),
                               ("total", "DATE '-infinity'")]:
            expected = {r["start"]: r["usd"] for r in await db_pool.fetch(
                f"SELECT {bucket} AS start, sum(cost_usd) AS usd FROM usage_ledger WHERE {column} = $1 GROUP BY 1", ident)}
            got = {r["period_start"]: r["cost_usd"] for r in await db_pool.fetch(
                "SELECT period_start, cost_usd FROM budget_spend WHERE scope = $1 AND id = $2 AND period = $3",
                scope, ident, period)}
            assert got == expected, (scope, period)


async def test_admin_usage_route_answers_the_same_report(
    gateway_factory: Any, fake: Any, db_pool: asyncpg.Pool, ledger: dict[str, Any]
) -> None:
    from tests.conftest import config_for

    gw = await gateway_factory(env={"ADMIN_TOKEN": "t" * 32}, config_yaml=config_for(fake.url))
    key = ledger["keys"][0]
    params = {"group_by": "day", "since": "2026-03-01T12:00:00", "until": "2026-03-04", "api_key_id": str(key)}
    resp = await gw.management.get("/admin/usage", params=params, headers={"Authorization": "Bearer " + "t" * 32})
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    expected = await db_pool.fetch(
        """SELECT ((created_at AT TIME ZONE 'UTC')::date)::text AS day, count(*) AS n,
                  sum(prompt_tokens) AS p, sum(completion_tokens) AS c, sum(cost_usd) AS u
           FROM usage_ledger WHERE api_key_id = $1 AND created_at >= $2 AND created_at < $3 GROUP BY 1 ORDER BY 1""",
        key, datetime(2026, 3, 1, 12, tzinfo=timezone.utc), datetime(2026, 3, 4, tzinfo=timezone.utc),
    )
    assert [(r["group"], r["requests"], r["input_tokens"], r["output_tokens"]) for r in body["data"]] == [
        (r["day"], r["n"], r["p"], r["c"]) for r in expected
    ]
    assert body["totals"]["requests"] == sum(r["n"] for r in expected)
    assert body["totals"]["cost_usd"] == pytest.approx(float(sum(r["u"] for r in expected)), abs=1e-6)
