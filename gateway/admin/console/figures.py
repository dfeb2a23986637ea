"""The numbers the console shows, from the same functions the admin API and the CLI use.

Spend, tokens, requests and errors come from :func:`gateway.billing.reports.usage_report`
(what ``GET /admin/usage`` and ``llm-gateway usage`` run: the daily rollup plus the
partial days at the edges), so a page and the API agree for the same range. The one
figure the rollup does not hold is latency: its percentiles are read from the ledger's
``latency_seconds`` over the range through the ``created_at`` index, over at most the
:data:`LATENCY_SAMPLE` latest calls, so the page costs the same on a ledger of any size.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta, timezone

import asyncpg

from gateway.billing.reports import UsageQuery, UsageReport, UsageRow, usage_report

__all__ = ["Period", "csv_export", "latency_percentiles", "period_figures", "row_label", "top"]


@dataclass(frozen=True, slots=True)
class Period:
    """One column of the overview: totals over ``[since, now)``."""

    label: str
    since: datetime
    total: UsageRow
    p50_ms: float | None
    p99_ms: float | None

    @property
    def error_rate(self) -> float | None:
        return self.total.errors / self.total.requests if self.total.requests else None


#: Latency percentiles are computed over at most this many of the range's latest calls.
LATENCY_SAMPLE = 100_000


def midnight(day: date) -> datetime:
    return datetime.combine(day, time.min, tzinfo=timezone.utc)


async def latency_percentiles(pool: asyncpg.Pool, since: datetime) -> tuple[float | None, float | None]:
    """p50 and p99 of the call latency since ``since`` (the latest calls), in milliseconds."""
    row = await pool.fetchrow(
        """WITH latest AS (
            SELECT latency_seconds FROM usage_ledger WHERE created_at >= $1
            ORDER BY created_at DESC LIMIT $2)
        SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY latency_seconds) AS p50,
               percentile_cont(0.99) WITHIN GROUP (ORDER BY latency_seconds) AS p99
        FROM latest""",
        since, LATENCY_SAMPLE,
    )
    if row is None or row["p50"] is None:
        return None, None
    return float(row["p50"]) * 1000, float(row["p99"]) * 1000


async def period_figures(pool: asyncpg.Pool, today: date) -> tuple[Period, Period, UsageReport]:
    """Today and the last 7 days (today included), and the 7 days by day."""
    week_start = midnight(today - timedelta(days=6))
    by_day = await usage_report(pool, UsageQuery(group_by="day", since=week_start))
    today_row = next((r for r in by_day.rows if r.group == today.isoformat()), None)
    empty = UsageRow(group="total", requests=0, errors=0, prompt_tokens=0, completion_tokens=0,
                     cost_usd=by_day.total.cost_usd * 0, cost_diem=by_day.total.cost_diem * 0)
    today_p = await latency_percentiles(pool, midnight(today))
    week_p = await latency_percentiles(pool, week_start)
    return (
        Period("Today (UTC)", midnight(today), today_row or empty, *today_p),
        Period("Last 7 days", week_start, by_day.total, *week_p),
        by_day,
    )


async def top(pool: asyncpg.Pool, group_by: str, since: datetime, n: int = 5) -> list[UsageRow]:
    """The ``n`` groups with the most spend since ``since`` (the report's own order)."""
    report = await usage_report(pool, UsageQuery(group_by=group_by, since=since))
    return list(report.rows[:n])


def row_label(row: UsageRow) -> str:
    """How the CLI's table names a group (a key by prefix and name)."""
    if row.key_prefix:
        return f"{row.key_prefix} {row.key_name}"
    return row.group or "(none)"


CSV_COLUMNS = ("group", "label", "requests", "errors", "prompt_tokens", "completion_tokens", "cost_usd")


def _cell(text: str) -> str:
    # A name a spreadsheet would run as a formula (=, +, -, @) is quoted as text.
    return f"'{text}" if text[:1] in ("=", "+", "-", "@") else text


def csv_export(report: UsageReport) -> str:
    """The report as CSV: the CLI table's numbers (cost to 6 decimals), then a total row."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    writer.writerow(CSV_COLUMNS)
    for r in report.rows:
        writer.writerow((r.group, _cell(row_label(r)), r.requests, r.errors, r.prompt_tokens, r.completion_tokens,
                         f"{r.cost_usd:.6f}"))
    t = report.total
    writer.writerow(("total", "TOTAL", t.requests, t.errors, t.prompt_tokens, t.completion_tokens, f"{t.cost_usd:.6f}"))
    return out.getvalue()
