"""Usage reports: requests, tokens and cost grouped by key, subject, model, provider or day.

One query function serves ``llm-gateway usage`` and ``GET /admin/usage``:

    query = query_from_params(request.query)          # ValueError names the bad parameter
    report = await usage_report(pool, query)
    return web.json_response(report.to_json())

It stays fast on a large ledger (tens of milliseconds on 10 M rows, docs/billing.md) by
reading aligned time blocks instead of rows or days: a range ``[since, until)`` splits into
blocks of 1, 2, 4 or 8 hours and 1, 2, 4 ... 64 UTC days (:func:`block_plan`; a 30-day
range is about ten blocks), read from ``usage_key_blocks`` for reports by key or subject
and ``usage_model_blocks`` for reports by model, provider or day (day blocks at most, so
each lies in one day), plus the ledger itself for the partial hours at the very ends,
through its ``created_at`` index. Reports by model, provider or day for one key or
subject read ``usage_daily``, ``usage_hourly`` and the ledger's edges instead (the model
blocks have no key). Either way the result is exactly what summing the ledger over
``[since, until)`` gives (tested). Days are UTC days.

A partial hour at an end is read from its hour's rollup row instead of the ledger when
no call of the report's scope lies in that hour outside the range (:meth:`_Sql.edge`;
the two are then equal): a range ending now, after the hour's last call, costs an index
probe instead of a sum over the current hour's calls, however busy the hour.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import date, datetime, time, timedelta, timezone
from decimal import Decimal
from typing import Any

import asyncpg

__all__ = [
    "BLOCK_SPANS",
    "GROUPS",
    "BlockPlan",
    "UsageQuery",
    "UsageReport",
    "UsageRow",
    "block_plan",
    "format_table",
    "parse_time",
    "query_from_params",
    "report_statement",
    "usage_report",
]

#: What a report may be grouped by (the contract names key, model and day).
GROUPS = ("key", "model", "day", "subject", "provider")

#: Block spans in hours, as ``usage_block_spans()`` in sql/0015_usage_blocks.sql lists
#: them: 1-8 hours aligned within the UTC day, then 1-64 UTC days aligned on the days
#: since 1970-01-01. Each divides the next, so a range splits into aligned blocks greedily.
BLOCK_SPANS = (1, 2, 4, 8, 24, 48, 96, 192, 384, 768, 1536)

#: group → its expression over each source, in the column's own type (cast to text once,
#: on the grouped result). Sources: the block rollups, usage_daily, usage_hourly, the ledger.
_GROUP_EXPRESSIONS: dict[str, dict[str, str]] = {
    "key": dict.fromkeys(("blocks", "daily", "hourly", "ledger"), "api_key_id"),
    "subject": dict.fromkeys(("blocks", "daily", "hourly", "ledger"), "subject_id"),
    "model": {"blocks": "model", "daily": "model", "hourly": "model", "ledger": "requested_model"},
    "provider": {"blocks": "provider", "daily": "provider", "hourly": "provider", "ledger": "coalesce(provider, '')"},
    "day": {
        "blocks": "(block_start AT TIME ZONE 'UTC')::date",
        "daily": "day",
        "hourly": "(hour AT TIME ZONE 'UTC')::date",
        "ledger": "(created_at AT TIME ZONE 'UTC')::date",
    },
}
_HOUR = timedelta(hours=1)
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
#: A rollup's rows pass through as they are; the one aggregate over every part sums them.
_ROLLUP_COLUMNS = "requests, errors, prompt_tokens, completion_tokens, cost_usd, cost_diem"
_LEDGER_SUMS = """count(*) AS requests, count(*) FILTER (WHERE status >= 400) AS errors,
           sum(prompt_tokens) AS prompt_tokens, sum(completion_tokens) AS completion_tokens,
           sum(cost_usd) AS cost_usd, coalesce(sum(cost_diem), 0) AS cost_diem"""


def parse_time(text: str, name: str) -> datetime:
    """An ISO 8601 date or date-time; without an offset it is UTC. ValueError names ``name``."""
    try:
        value = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"{name}: expected an ISO 8601 date or date-time, got {text!r}") from None
    return value if value.tzinfo is not None else value.replace(tzinfo=timezone.utc)


@dataclass(frozen=True, slots=True)
class UsageQuery:
    """What to report: a grouping, a half-open time range ``[since, until)``, filters."""

    group_by: str = "key"
    since: datetime | None = None
    until: datetime | None = None
    api_key_id: uuid.UUID | None = None
    subject_id: uuid.UUID | None = None

    def __post_init__(self) -> None:
        if self.group_by not in GROUPS:
            raise ValueError(f"group_by: expected one of {', '.join(GROUPS)}, got {self.group_by!r}")
        for name in ("since", "until"):
            value = getattr(self, name)
            if value is not None and value.tzinfo is None:
                raise ValueError(f"{name}: needs a time zone")
        if self.since is not None and self.until is not None and self.since >= self.until:
            raise ValueError("since: must be before until")


def query_from_params(params: Mapping[str, str]) -> UsageQuery:
    """A query from URL parameters (``group_by``, ``since``, ``until``, ``api_key_id``,
    ``subject_id``); ValueError with a one-line message naming the bad one."""
    known = {"group_by", "since", "until", "api_key_id", "subject_id"}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown parameter (known: {', '.join(sorted(known))})")

    def ident(name: str) -> uuid.UUID | None:
        raw = params.get(name)
        if not raw:
            return None
        try:
            return uuid.UUID(raw)
        except ValueError:
            raise ValueError(f"{name}: expected a UUID, got {raw!r}") from None

    return UsageQuery(
        group_by=params.get("group_by") or "key",
        since=parse_time(params["since"], "since") if params.get("since") else None,
        until=parse_time(params["until"], "until") if params.get("until") else None,
        api_key_id=ident("api_key_id"),
        subject_id=ident("subject_id"),
    )


@dataclass(frozen=True, slots=True)
class UsageRow:
    """One group's totals."""

    group: str
    requests: int
    errors: int
    prompt_tokens: int
    completion_tokens: int
    cost_usd: Decimal
    cost_diem: Decimal
    #: For ``group_by=key``: the key's prefix and name, when the key still exists.
    key_prefix: str | None = None
    key_name: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "group": self.group,
            "requests": self.requests,
            "errors": self.errors,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "cost_usd": float(self.cost_usd),
            "cost_diem": float(self.cost_diem),
        }
        if self.key_prefix is not None or self.key_name is not None:
            out["key_prefix"], out["key_name"] = self.key_prefix, self.key_name
        return out


@dataclass(frozen=True, slots=True)
class UsageReport:
    query: UsageQuery
    rows: tuple[UsageRow, ...]
    total: UsageRow = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "total", UsageRow(
            group="total",
            requests=sum(r.requests for r in self.rows),
            errors=sum(r.errors for r in self.rows),
            prompt_tokens=sum(r.prompt_tokens for r in self.rows),
            completion_tokens=sum(r.completion_tokens for r in self.rows),
            cost_usd=sum((r.cost_usd for r in self.rows), Decimal(0)),
            cost_diem=sum((r.cost_diem for r in self.rows), Decimal(0)),
        ))

    def to_json(self) -> dict[str, Any]:
        q = self.query
        return {
            "group_by": q.group_by,
            "since": q.since.isoformat() if q.since else None,
            "until": q.until.isoformat() if q.until else None,
            "api_key_id": str(q.api_key_id) if q.api_key_id else None,
            "subject_id": str(q.subject_id) if q.subject_id else None,
            "rows": [r.to_json() for r in self.rows],
            "total": self.total.to_json(),
        }


def _midnight(day: date) -> datetime:
    return datetime.combine(day, time.min, tzinfo=timezone.utc)


def _split(since: datetime | None, until: datetime | None) -> tuple[
    tuple[date | None, date | None] | None, list[tuple[datetime | None, datetime | None]]
]:
    """Whole UTC days ``[first, last)`` for usage_daily, and the partial days at the edges."""
    first: date | None = None
    last: date | None = None
    edges: list[tuple[datetime | None, datetime | None]] = []
    if since is not None:
        utc = since.astimezone(timezone.utc)
        first = utc.date() if utc == _midnight(utc.date()) else utc.date() + timedelta(days=1)
    if until is not None:
        last = until.astimezone(timezone.utc).date()
    if first is not None and last is not None and first >= last:
        return None, [(since, until)]  # inside one day (or two partial ones): hours and the ledger
    if since is not None and first is not None and since < _midnight(first):
        edges.append((since, _midnight(first)))
    if until is not None and last is not None and _midnight(last) < until:
        edges.append((_midnight(last), until))
    return (first, last), edges


def _hours(start: datetime | None, end: datetime | None) -> tuple[
    tuple[datetime, datetime] | None, list[tuple[datetime | None, datetime | None]]
]:
    """Whole UTC hours ``[first, last)`` of an edge for the hourly rollup, and the partial
    hours at its ends for the ledger (an open end stays with the ledger)."""
    if start is None or end is None:
        return None, [(start, end)]
    a, b = start.astimezone(timezone.utc), end.astimezone(timezone.utc)
    first = a.replace(minute=0, second=0, microsecond=0)
    if first < a:
        first += _HOUR
    last = b.replace(minute=0, second=0, microsecond=0)
    if first >= last:
        return None, [(start, end)]
    ledger: list[tuple[datetime | None, datetime | None]] = []
    if a < first:
        ledger.append((start, first))
    if last < b:
        ledger.append((last, end))
    return (first, last), ledger


@dataclass(frozen=True, slots=True)
class BlockPlan:
    """How a range ``[since, until)`` is read from a block rollup.

    ``blocks``: explicit ``(span_hours, start)`` blocks; ``open_range``: when an end is
    open, every block of span ``top`` whose start lies in ``[lower, upper)`` (None: no
    bound) as well; ``ledger``: the partial hours at the ends, summed from the ledger.
    Together they cover every instant of the range exactly once (tested)."""

    blocks: tuple[tuple[int, datetime], ...]
    top: int
    open_range: tuple[datetime | None, datetime | None] | None
    ledger: tuple[tuple[datetime, datetime], ...]


def _epoch_hours(moment: datetime, *, up: bool) -> int:
    """Whole hours since 1970-01-01 UTC: ``moment`` rounded down (or up)."""
    seconds = (moment - _EPOCH) // timedelta(seconds=1)
    whole, part = divmod(seconds, 3600)
    exact = part == 0 and moment.microsecond == 0
    return whole + 1 if up and not exact else whole


def _at(hours: int) -> datetime:
    return _EPOCH + hours * _HOUR


def block_plan(since: datetime | None, until: datetime | None, *, max_span: int = BLOCK_SPANS[-1]) -> BlockPlan:
    """Split ``[since, until)`` into aligned blocks of at most ``max_span`` hours (24 for
    reports by day, whose every block must lie inside one day) and ledger edges."""
    spans = [s for s in BLOCK_SPANS if s <= max_span]
    top = spans[-1]
    first = None if since is None else _epoch_hours(since, up=True)
    last = None if until is None else _epoch_hours(until, up=False)
    if since is not None and until is not None and first is not None and last is not None and first >= last:
        return BlockPlan((), top, None, ((since, until),))  # inside an hour, or across one boundary
    ledger: list[tuple[datetime, datetime]] = []
    if since is not None and first is not None and since < _at(first):
        ledger.append((since, _at(first)))
    if until is not None and last is not None and _at(last) < until:
        ledger.append((_at(last), until))
    open_range: tuple[datetime | None, datetime | None] | None = None
    if first is None and last is None:
        open_range, first, last = (None, None), 0, 0
    elif first is None:
        assert last is not None
        aligned = last - last % top
        open_range, first = (None, _at(aligned)), aligned
    elif last is None:
        aligned = first + (-first) % top
        open_range, last = (_at(aligned), None), aligned
    blocks: list[tuple[int, datetime]] = []
    at = first
    while at < last:
        span = next(s for s in reversed(spans) if at % s == 0 and at + s <= last)
        blocks.append((span, _at(at)))
        at += span
    return BlockPlan(tuple(blocks), top, open_range, tuple(ledger))


class _Sql:
    """One report statement's parts and its numbered arguments."""

    def __init__(self) -> None:
        self.args: list[Any] = []
        self.parts: list[str] = []

    def arg(self, value: Any) -> str:
        self.args.append(value)
        return f"${len(self.args)}"

    def part(self, group: str, source: str, conds: list[str]) -> None:
        """A rollup's rows in the range (each already a total)."""
        where = f"WHERE {' AND '.join(conds)}" if conds else ""
        self.parts.append(f"SELECT {group} AS g, {_ROLLUP_COLUMNS} FROM {source} {where}")

    def ledger(self, group: str, filters: list[str], start: datetime | None, end: datetime | None) -> None:
        conds = list(filters)
        if start is not None:
            conds.append(f"created_at >= {self.arg(start)}")
        if end is not None:
            conds.append(f"created_at < {self.arg(end)}")
        where = f"WHERE {' AND '.join(conds)}" if conds else ""
        self.parts.append(f"SELECT {group} AS g, {_LEDGER_SUMS} FROM usage_ledger {where} GROUP BY 1")

    def edge(self, group: str, filters: list[str], start: datetime | None, end: datetime | None,
             rollup: tuple[str, str, str]) -> None:
        """The ledger's calls in the partial hour ``[start, end)``; or, when it lies inside one
        UTC hour, that hour's rows of ``rollup`` (group expression, table, its hour condition
        with ``{}`` for the hour) if no call of ``filters`` lies in the hour outside ``[start,
        end)`` (the rollup then holds exactly those calls: one statement sees the ledger and
        its rollups, kept by the ledger's trigger, in one snapshot), and the ledger's calls
        otherwise. Either way the answer is the ledger's sum."""
        hour = _hour_holding(start, end)
        if hour is None or start is None or end is None:
            self.ledger(group, filters, start, end)
            return
        outside = []
        for lower, upper in ((hour, start), (end, hour + _HOUR)):
            if lower < upper:
                conds = [*filters, f"created_at >= {self.arg(lower)}", f"created_at < {self.arg(upper)}"]
                outside.append(f"EXISTS (SELECT 1 FROM usage_ledger WHERE {' AND '.join(conds)})")
        others = f"({' OR '.join(outside)})"
        self.part(rollup[0], rollup[1], [*filters, rollup[2].format(self.arg(hour)), f"NOT {others}"])
        conds = [*filters, f"created_at >= {self.arg(start)}", f"created_at < {self.arg(end)}", others]
        self.parts.append(f"SELECT {group} AS g, {_LEDGER_SUMS} FROM usage_ledger WHERE {' AND '.join(conds)} GROUP BY 1")


def _hour_holding(start: datetime | None, end: datetime | None) -> datetime | None:
    """The UTC hour a part of which ``[start, end)`` is (None: open, empty, across an hour's
    end, or the whole hour, which the plans read as a whole hour)."""
    if start is None or end is None or start >= end:
        return None
    hour = start.astimezone(timezone.utc).replace(minute=0, second=0, microsecond=0)
    return hour if end <= hour + _HOUR and (hour < start or end < hour + _HOUR) else None


def _from_blocks(sql: _Sql, query: UsageQuery, table: str, filters: list[str]) -> None:
    """The parts reading a block rollup (and the ledger's partial hours at the ends)."""
    exprs = _GROUP_EXPRESSIONS[query.group_by]
    plan = block_plan(query.since, query.until, max_span=24 if query.group_by == "day" else BLOCK_SPANS[-1])
    starts: dict[int, list[datetime]] = {}
    for span, start in plan.blocks:
        starts.setdefault(span, []).append(start)
    for span, of_span in sorted(starts.items()):  # a constant span: one partition, planned
        sql.part(exprs["blocks"], table,
                 [*filters, f"span_hours = {int(span)}", f"block_start = ANY({sql.arg(of_span)}::timestamptz[])"])
    if plan.open_range is not None:
        lower, upper = plan.open_range
        conds = [*filters, f"span_hours = {int(plan.top)}"]
        if lower is not None:
            conds.append(f"block_start >= {sql.arg(lower)}")
        if upper is not None:
            conds.append(f"block_start < {sql.arg(upper)}")
        sql.part(exprs["blocks"], table, conds)
    for start, end in plan.ledger:
        sql.edge(exprs["ledger"], filters, start, end, (exprs["blocks"], table, "span_hours = 1 AND block_start = {}"))


def _from_days(sql: _Sql, query: UsageQuery, filters: list[str]) -> None:
    """The parts reading usage_daily for whole days, usage_hourly for the whole hours of
    the edge days and the ledger for the rest: for one key's or subject's models or days,
    through those tables' key and subject indexes."""
    exprs = _GROUP_EXPRESSIONS[query.group_by]
    days, edges = _split(query.since, query.until)
    if days is not None:
        conds = list(filters)
        if days[0] is not None:
            conds.append(f"day >= {sql.arg(days[0])}")
        if days[1] is not None:
            conds.append(f"day < {sql.arg(days[1])}")
        sql.part(exprs["daily"], "usage_daily", conds)
    for edge_start, edge_end in edges:
        hours, rest = _hours(edge_start, edge_end)
        for start, end in rest:
            sql.edge(exprs["ledger"], filters, start, end, (exprs["hourly"], "usage_hourly", "hour = {}"))
        if hours is not None:
            sql.part(exprs["hourly"], "usage_hourly",
                     [*filters, f"hour >= {sql.arg(hours[0])}", f"hour < {sql.arg(hours[1])}"])


def report_statement(query: UsageQuery) -> tuple[str, list[Any]]:
    """The one SQL statement (and its arguments) that answers ``query``.

    Reports by key or subject read ``usage_key_blocks``; by model, provider or day,
    ``usage_model_blocks``, unless filtered by a key or subject (that table has neither):
    then usage_daily and usage_hourly, whose rows for one key or subject are few."""
    sql = _Sql()
    filters: list[str] = []
    if query.api_key_id is not None:
        filters.append(f"api_key_id = {sql.arg(query.api_key_id)}")
    if query.subject_id is not None:
        filters.append(f"subject_id = {sql.arg(query.subject_id)}")
    if query.group_by in ("key", "subject"):
        _from_blocks(sql, query, "usage_key_blocks", filters)
    elif not filters:
        _from_blocks(sql, query, "usage_model_blocks", filters)
    else:
        _from_days(sql, query, filters)
    by_key = query.group_by == "key"
    order = "t.g" if query.group_by == "day" else "t.cost_usd DESC, t.requests DESC, t.g::text"
    # Summed once over every part, then named: the key join sees one row per key.
    statement = f"""
        WITH parts AS ({' UNION ALL '.join(sql.parts)}),
        totals AS (
          SELECT g, sum(requests)::bigint AS requests, sum(errors)::bigint AS errors,
                 sum(prompt_tokens)::bigint AS prompt_tokens, sum(completion_tokens)::bigint AS completion_tokens,
                 sum(cost_usd) AS cost_usd, sum(cost_diem) AS cost_diem
          FROM parts GROUP BY g)
        SELECT t.g::text AS g, t.requests, t.errors, t.prompt_tokens, t.completion_tokens, t.cost_usd, t.cost_diem
               {', k.key_prefix, k.name AS key_name' if by_key else ''}
        FROM totals t
        {'LEFT JOIN api_keys k ON k.api_key_id = t.g' if by_key else ''}
        ORDER BY {order}"""
    return statement, sql.args


async def usage_report(conn: asyncpg.Connection | asyncpg.Pool, query: UsageQuery) -> UsageReport:
    """Run ``query``: one SQL statement over the rollups and the ledger's edges."""
    statement, args = report_statement(query)
    rows = await conn.fetch(statement, *args)
    by_key = query.group_by == "key"
    return UsageReport(query=query, rows=tuple(
        UsageRow(
            group=r["g"],
            requests=r["requests"],
            errors=r["errors"],
            prompt_tokens=r["prompt_tokens"],
            completion_tokens=r["completion_tokens"],
            cost_usd=r["cost_usd"],
            cost_diem=r["cost_diem"],
            key_prefix=r["key_prefix"] if by_key else None,
            key_name=r["key_name"] if by_key else None,
        )
        for r in rows
    ))


def format_table(report: UsageReport) -> str:
    """The report as an aligned text table with a total line (for the CLI)."""
    title = {"key": "KEY", "model": "MODEL", "day": "DAY (UTC)", "subject": "SUBJECT", "provider": "PROVIDER"}
    labels = [
        f"{r.key_prefix} {r.key_name}" if r.key_prefix else r.group or "(none)" for r in report.rows
    ]
    width = max([len(title[report.query.group_by]), 5, *map(len, labels)])
    header = f"{title[report.query.group_by]:<{width}}  {'REQUESTS':>9}  {'ERRORS':>7}  {'TOKENS IN':>12}  {'TOKENS OUT':>12}  {'COST USD':>14}"
    lines = [header]
    for label, r in [*zip(labels, report.rows, strict=True), ("TOTAL", report.total)]:
        lines.append(
            f"{label:<{width}}  {r.requests:>9}  {r.errors:>7}  {r.prompt_tokens:>12}  "
            f"{r.completion_tokens:>12}  {r.cost_usd:>14.6f}"
        )
    return "\n".join(lines)
