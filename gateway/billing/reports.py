"""Usage reports: requests, tokens and cost grouped by key, subject, model, provider or day.

One query function serves ``llm-gateway usage`` and ``GET /admin/usage``:

    query = query_from_params(request.query)          # ValueError names the bad parameter
    report = await usage_report(pool, query)
    return web.json_response(report.to_json())

It stays fast on a large ledger by reading whole UTC days from the ``usage_daily``
rollup, the whole hours of the partial days at the edges of the range (``since``/``until``
that are not midnight) from ``usage_hourly``, and only the partial hours at its very ends
from the ledger itself, through its ``created_at`` index. The result is exactly what
summing the ledger over ``[since, until)`` gives. Days are UTC days.
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
    "GROUPS",
    "UsageQuery",
    "UsageReport",
    "UsageRow",
    "format_table",
    "parse_time",
    "query_from_params",
    "usage_report",
]

#: What a report may be grouped by (the contract names key, model and day).
GROUPS = ("key", "model", "day", "subject", "provider")

#: group → (expression over usage_daily, over usage_hourly, over usage_ledger), all text.
_GROUP_EXPRESSIONS = {
    "key": ("api_key_id::text", "api_key_id::text", "api_key_id::text"),
    "subject": ("subject_id::text", "subject_id::text", "subject_id::text"),
    "model": ("model", "model", "requested_model"),
    "provider": ("provider", "provider", "coalesce(provider, '')"),
    "day": ("day::text", "((hour AT TIME ZONE 'UTC')::date)::text", "((created_at AT TIME ZONE 'UTC')::date)::text"),
}
_HOUR = timedelta(hours=1)


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
    """Whole UTC days ``[first, last)`` for the rollup, and the ledger ranges at the edges."""
    first: date | None = None
    last: date | None = None
    edges: list[tuple[datetime | None, datetime | None]] = []
    if since is not None:
        utc = since.astimezone(timezone.utc)
        first = utc.date() if utc == _midnight(utc.date()) else utc.date() + timedelta(days=1)
    if until is not None:
        last = until.astimezone(timezone.utc).date()
    if first is not None and last is not None and first >= last:
        return None, [(since, until)]  # inside one day (or two partial ones): the ledger only
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


async def usage_report(conn: asyncpg.Connection | asyncpg.Pool, query: UsageQuery) -> UsageReport:
    """Run ``query``: one SQL statement over the rollups and the ledger's edges."""
    daily_group, hourly_group, ledger_group = _GROUP_EXPRESSIONS[query.group_by]
    args: list[Any] = []

    def arg(value: Any) -> str:
        args.append(value)
        return f"${len(args)}"

    filters: list[str] = []
    if query.api_key_id is not None:
        filters.append(f"api_key_id = {arg(query.api_key_id)}")
    if query.subject_id is not None:
        filters.append(f"subject_id = {arg(query.subject_id)}")
    days, edges = _split(query.since, query.until)
    parts: list[str] = []
    if days is not None:
        conds = list(filters)
        if days[0] is not None:
            conds.append(f"day >= {arg(days[0])}")
        if days[1] is not None:
            conds.append(f"day < {arg(days[1])}")
        parts.append(
            f"""SELECT {daily_group} AS g, sum(requests) AS requests, sum(errors) AS errors,
                   sum(prompt_tokens) AS prompt_tokens, sum(completion_tokens) AS completion_tokens,
                   sum(cost_usd) AS cost_usd, sum(cost_diem) AS cost_diem
            FROM usage_daily {'WHERE ' + ' AND '.join(conds) if conds else ''} GROUP BY 1"""
        )
    ledger_ranges: list[tuple[datetime | None, datetime | None]] = []
    for edge_start, edge_end in edges:
        hours, rest = _hours(edge_start, edge_end)
        ledger_ranges += rest
        if hours is None:
            continue
        conds = [*filters, f"hour >= {arg(hours[0])}", f"hour < {arg(hours[1])}"]
        parts.append(
            f"""SELECT {hourly_group} AS g, sum(requests) AS requests, sum(errors) AS errors,
                   sum(prompt_tokens) AS prompt_tokens, sum(completion_tokens) AS completion_tokens,
                   sum(cost_usd) AS cost_usd, sum(cost_diem) AS cost_diem
            FROM usage_hourly WHERE {' AND '.join(conds)} GROUP BY 1"""
        )
    for start, end in ledger_ranges:
        conds = list(filters)
        if start is not None:
            conds.append(f"created_at >= {arg(start)}")
        if end is not None:
            conds.append(f"created_at < {arg(end)}")
        parts.append(
            f"""SELECT {ledger_group} AS g, count(*) AS requests,
                   count(*) FILTER (WHERE status >= 400) AS errors,
                   sum(prompt_tokens) AS prompt_tokens, sum(completion_tokens) AS completion_tokens,
                   sum(cost_usd) AS cost_usd, coalesce(sum(cost_diem), 0) AS cost_diem
            FROM usage_ledger {'WHERE ' + ' AND '.join(conds) if conds else ''} GROUP BY 1"""
        )
    by_key = query.group_by == "key"
    order = "p.g" if query.group_by == "day" else "sum(p.cost_usd) DESC, sum(p.requests) DESC, p.g"
    sql = f"""
        WITH parts AS ({' UNION ALL '.join(parts)})
        SELECT p.g, sum(p.requests)::bigint AS requests, sum(p.errors)::bigint AS errors,
               sum(p.prompt_tokens)::bigint AS prompt_tokens,
               sum(p.completion_tokens)::bigint AS completion_tokens,
               sum(p.cost_usd) AS cost_usd, sum(p.cost_diem) AS cost_diem
               {', k.key_prefix, k.name AS key_name' if by_key else ''}
        FROM parts p
        {'LEFT JOIN api_keys k ON k.api_key_id = p.g::uuid' if by_key else ''}
        GROUP BY p.g{', k.key_prefix, k.name' if by_key else ''}
        ORDER BY {order}"""
    rows = await conn.fetch(sql, *args)
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
