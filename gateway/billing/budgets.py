"""Budgets: per key (on ``api_keys``) and per subject (``subject_budgets``), in USD.

A budget holds for a period: ``day`` (the current UTC day), ``month`` (the current UTC
calendar month) or ``total`` (all time). Admission is a reservation in a shared store
(:mod:`gateway.billing.reservations`, :mod:`gateway.billing.gate`); :func:`fetch_spend`
refreshes, about once a second from ``budget_spend`` (one row per budget and period,
kept by the ledger's trigger; never the ledger itself), the subject budgets the gate
reads and the spend figures :class:`actors.billing.Spend` reports.
:class:`SubjectBudgetStore` is the one place the CLI and the admin API change subject
budgets.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

import asyncpg

from gateway.auth.keys import BUDGET_PERIODS, MAX_BUDGET_USD, Database
from gateway.billing.reservations import micro_usd

__all__ = [
    "BUDGET_PERIODS",
    "SpendSnapshot",
    "SubjectBudget",
    "SubjectBudgetStore",
    "fetch_spend",
]

# Period starts are computed by the database, in UTC, so every replica agrees on them.
_SPEND_QUERY = """
WITH bounds AS (
  SELECT (now() AT TIME ZONE 'UTC')::date AS today,
         date_trunc('month', now() AT TIME ZONE 'UTC')::date AS month_start
), budgets AS (
  SELECT 'key' AS scope, k.api_key_id AS id, k.budget_usd AS budget, k.budget_period AS period
  FROM api_keys k
  WHERE k.budget_usd IS NOT NULL AND k.is_active
  UNION ALL
  SELECT 'subject', s.subject_id, s.budget_usd, s.budget_period
  FROM subject_budgets s
)
SELECT b.scope, b.id, b.budget, b.period, coalesce(s.cost_usd, 0) AS spent
FROM budgets b CROSS JOIN bounds
LEFT JOIN budget_spend s
  ON s.scope = b.scope AND s.id = b.id AND s.period = b.period
 AND s.period_start = CASE b.period WHEN 'day' THEN bounds.today
                                    WHEN 'month' THEN bounds.month_start
                                    ELSE '-infinity'::date END
"""


@dataclass(frozen=True, slots=True)
class SpendSnapshot:
    """What the ledger says has been spent in each budget's current period (micro-USD)."""

    #: Keys with a budget → micro-USD spent in the key's period.
    key_spend: dict[uuid.UUID, int]
    #: Subjects with a budget → micro-USD spent in the subject's period.
    subject_spend: dict[uuid.UUID, int]
    #: Subjects with a budget → (USD, period).
    subject_budgets: dict[uuid.UUID, tuple[Decimal, str]]


async def fetch_spend(conn: asyncpg.Connection | asyncpg.Pool) -> SpendSnapshot:
    """Spend of every budgeted key and subject in its current period (one query)."""
    keys: dict[uuid.UUID, int] = {}
    subjects: dict[uuid.UUID, int] = {}
    budgets: dict[uuid.UUID, tuple[Decimal, str]] = {}
    for row in await conn.fetch(_SPEND_QUERY):
        if row["scope"] == "key":
            keys[row["id"]] = micro_usd(row["spent"])
        else:
            subjects[row["id"]] = micro_usd(row["spent"])
            budgets[row["id"]] = (row["budget"], row["period"])
    return SpendSnapshot(key_spend=keys, subject_spend=subjects, subject_budgets=budgets)


@dataclass(frozen=True, slots=True)
class SubjectBudget:
    """A subject's spend cap."""

    subject_id: uuid.UUID
    budget_usd: Decimal
    budget_period: str
    created_at: datetime
    updated_at: datetime

    def to_json(self) -> dict[str, Any]:
        return {
            "subject_id": str(self.subject_id),
            "budget_usd": float(self.budget_usd),
            "budget_period": self.budget_period,
            "created_at": self.created_at.isoformat(),
            "updated_at": self.updated_at.isoformat(),
        }

    @classmethod
    def from_row(cls, row: asyncpg.Record) -> SubjectBudget:
        return cls(
            subject_id=row["subject_id"],
            budget_usd=row["budget_usd"],
            budget_period=row["budget_period"],
            created_at=row["created_at"],
            updated_at=row["updated_at"],
        )


class SubjectBudgetStore:
    """Set, read, list and clear subject budgets (the CLI and the admin API share it).

    Bound to a pool, or to one connection whose transaction also holds the change's
    audit row (the admin API). Changes reach every replica's budget check with its next
    spend refresh (about a second).
    """

    def __init__(self, db: Database) -> None:
        self._db = db

    async def set(self, subject_id: uuid.UUID, budget_usd: Decimal, period: str) -> SubjectBudget:
        """Create or replace a subject's budget; ValueError on a bad amount or period."""
        if not budget_usd.is_finite() or not 0 <= budget_usd <= MAX_BUDGET_USD:
            raise ValueError(f"budget_usd must be an amount from 0 to {MAX_BUDGET_USD}")
        if period not in BUDGET_PERIODS:
            raise ValueError("budget_period must be day, month or total")
        row = await self._db.fetchrow(
            """INSERT INTO subject_budgets (subject_id, budget_usd, budget_period)
            VALUES ($1, $2, $3)
            ON CONFLICT (subject_id) DO UPDATE SET budget_usd = EXCLUDED.budget_usd,
                budget_period = EXCLUDED.budget_period, updated_at = now()
            RETURNING *""",
            subject_id, budget_usd, period,
        )
        return SubjectBudget.from_row(row)

    async def get(self, subject_id: uuid.UUID, *, for_update: bool = False) -> SubjectBudget | None:
        """The subject's budget, or None; ``for_update`` locks it for the caller's transaction."""
        lock = " FOR UPDATE" if for_update else ""
        row = await self._db.fetchrow(f"SELECT * FROM subject_budgets WHERE subject_id = $1{lock}", subject_id)
        return None if row is None else SubjectBudget.from_row(row)

    async def list(self, *, limit: int | None = None, after: uuid.UUID | None = None) -> list[SubjectBudget]:
        """Budgets in subject order; ``after`` is the last subject of the previous page."""
        rows = await self._db.fetch(
            """SELECT * FROM subject_budgets WHERE ($2::uuid IS NULL OR subject_id > $2)
            ORDER BY subject_id LIMIT $1""",
            limit, after,
        )
        return [SubjectBudget.from_row(r) for r in rows]

    async def clear(self, subject_id: uuid.UUID) -> bool:
        """Remove a subject's budget; True if it had one."""
        status = await self._db.execute("DELETE FROM subject_budgets WHERE subject_id = $1", subject_id)
        return str(status).endswith(" 1")
