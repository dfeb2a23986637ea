"""Gateway keys: generation, hashing, and the one store the CLI and admin API share.

A key is ``llmg_`` + 43 URL-safe characters (32 random bytes). Only its first 12
characters (the lookup prefix) and the SHA-256 of the whole key are stored.
"""

from __future__ import annotations

import contextlib
import hashlib
import secrets
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any, TypeAlias

import asyncpg

__all__ = [
    "DEFAULT_KEY_RPM",
    "DEFAULT_KEY_WINDOW_SECONDS",
    "DEV_KEY",
    "DEV_KEY_RPM",
    "DEV_KEY_WINDOW_SECONDS",
    "KEY_PREFIX_LEN",
    "KeyNotFound",
    "KeyPolicy",
    "KeyRecord",
    "KeyStateError",
    "KeyStore",
    "UNCHANGED",
    "Unchanged",
    "generate_key",
    "hash_key",
]

KEY_PREFIX_LEN = 12
KEY_MARK = "llmg_"
#: Seeded only by an embedded-database ``serve``, for the quick start.
DEV_KEY = "llmg_dev_0123456789abcdef"

#: A new key's request window unless set (``keys create --rpm/--window-seconds``, the
#: admin API): the columns' own defaults in ``sql/0001_api_keys.sql``.
DEFAULT_KEY_RPM = 60
DEFAULT_KEY_WINDOW_SECONDS = 60
#: The development key's window: room for trying things out, a small load test
#: included, where the default 60 per minute would answer 429 within a second.
DEV_KEY_RPM = 100_000
DEV_KEY_WINDOW_SECONDS = 60

BUDGET_PERIODS = ("day", "month", "total")
#: Largest value of an ``integer`` column, and the bound of ``numeric(14, 6)``.
MAX_INT = 2**31 - 1
MAX_BUDGET_USD = Decimal("99999999.999999")
#: A key's name is a label: short, and never NUL (which PostgreSQL text cannot hold).
MAX_NAME_LEN = 200
#: What ``KeyRecord.state`` may say, and what ``KeyStore.list(state=...)`` filters on.
KEY_STATES = ("active", "revoked", "expired")

#: SQL for each state, the same rule as ``KeyRecord.state`` (revoked wins over expired).
_STATE_CLAUSES = {
    "active": "(is_active AND revoked_at IS NULL AND (expires_at IS NULL OR expires_at > now()))",
    "revoked": "(NOT is_active OR revoked_at IS NOT NULL)",
    "expired": "(is_active AND revoked_at IS NULL AND expires_at <= now())",
}

#: Where KeyStore runs its queries: the pool, or one connection (inside a caller's
#: transaction, so the admin API can write a key change and its audit row atomically).
Database: TypeAlias = asyncpg.Pool | asyncpg.Connection | asyncpg.pool.PoolConnectionProxy


class _Unchanged:
    """Marks an argument that was not given (``None`` already means "clear it")."""


UNCHANGED = _Unchanged()
#: The type of UNCHANGED, for callers that pass an update through (the admin API).
Unchanged = _Unchanged


class KeyNotFound(LookupError):
    """No key has that id or prefix."""


class KeyStateError(ValueError):
    """The key's state forbids the change (rotating a revoked or expired key)."""


def _check_name(name: str) -> None:
    # PostgreSQL text cannot hold NUL; a name is a label, so it is also kept short.
    if not name.strip() or "\x00" in name or len(name) > MAX_NAME_LEN:
        raise ValueError(f"name must be 1 to {MAX_NAME_LEN} characters, not blank")


def generate_key() -> str:
    """A new raw key: ``llmg_`` + 32 random bytes, URL-safe base64."""
    return KEY_MARK + secrets.token_urlsafe(32)


def hash_key(raw: str) -> bytes:
    """SHA-256 of the whole key, as stored in ``api_keys.key_hash``."""
    return hashlib.sha256(raw.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True, slots=True)
class KeyPolicy:
    """Limits and permissions attached to a key; ``None`` means not set."""

    rate_limit_requests: int = DEFAULT_KEY_RPM
    rate_limit_window_seconds: int = DEFAULT_KEY_WINDOW_SECONDS
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    budget_usd: Decimal | None = None
    budget_period: str | None = None
    allowed_models: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        # The bounds are the columns' own: a value past them must be a clear error
        # here, not a database error later.
        for name in ("rate_limit_requests", "rate_limit_window_seconds"):
            if not 0 < getattr(self, name) <= MAX_INT:
                raise ValueError(f"{name} must be between 1 and {MAX_INT}")
        for name in ("tokens_per_minute", "max_concurrent"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= MAX_INT:
                raise ValueError(f"{name} must be between 1 and {MAX_INT}")
        if self.budget_usd is not None and not 0 <= self.budget_usd <= MAX_BUDGET_USD:
            raise ValueError(f"budget_usd must be between 0 and {MAX_BUDGET_USD}")
        if self.budget_period is not None and self.budget_period not in BUDGET_PERIODS:
            raise ValueError("budget_period must be day, month or total")
        if self.allowed_models is not None:
            for model in self.allowed_models:
                if not model or "\x00" in model:
                    raise ValueError("allowed_models must hold non-empty model names")


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """A key's row, without its hash."""

    api_key_id: uuid.UUID
    subject_id: uuid.UUID
    name: str
    key_prefix: str
    policy: KeyPolicy
    is_active: bool
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None
    expires_at: datetime | None

    @property
    def state(self) -> str:
        if self.revoked_at is not None or not self.is_active:
            return "revoked"
        if self.expires_at is not None and self.expires_at <= datetime.now(timezone.utc):
            return "expired"
        return "active"

    def to_json(self) -> dict[str, Any]:
        p = self.policy
        return {
            "api_key_id": str(self.api_key_id),
            "subject_id": str(self.subject_id),
            "name": self.name,
            "key_prefix": self.key_prefix,
            "state": self.state,
            "rate_limit_requests": p.rate_limit_requests,
            "rate_limit_window_seconds": p.rate_limit_window_seconds,
            "tokens_per_minute": p.tokens_per_minute,
            "max_concurrent": p.max_concurrent,
            "budget_usd": float(p.budget_usd) if p.budget_usd is not None else None,
            "budget_period": p.budget_period,
            "allowed_models": list(p.allowed_models) if p.allowed_models is not None else None,
            "created_at": self.created_at.isoformat(),
            "last_used_at": self.last_used_at.isoformat() if self.last_used_at else None,
            "revoked_at": self.revoked_at.isoformat() if self.revoked_at else None,
            "expires_at": self.expires_at.isoformat() if self.expires_at else None,
        }

    @classmethod
    def from_row(cls, row: asyncpg.Record) -> KeyRecord:
        models = row["allowed_models"]
        return cls(
            api_key_id=row["api_key_id"],
            subject_id=row["subject_id"],
            name=row["name"],
            key_prefix=row["key_prefix"],
            policy=KeyPolicy(
                rate_limit_requests=row["rate_limit_requests"],
                rate_limit_window_seconds=row["rate_limit_window_seconds"],
                tokens_per_minute=row["tokens_per_minute"],
                max_concurrent=row["max_concurrent"],
                budget_usd=row["budget_usd"],
                budget_period=row["budget_period"],
                allowed_models=tuple(models) if models is not None else None,
            ),
            is_active=row["is_active"],
            created_at=row["created_at"],
            last_used_at=row["last_used_at"],
            revoked_at=row["revoked_at"],
            expires_at=row["expires_at"],
        )


KEY_COLUMNS = (
    "api_key_id, subject_id, name, key_prefix, rate_limit_requests, rate_limit_window_seconds,"
    " is_active, created_at, last_used_at, revoked_at, expires_at, tokens_per_minute,"
    " max_concurrent, budget_usd, budget_period, allowed_models"
)

_POLICY_COLUMNS = (
    "rate_limit_requests", "rate_limit_window_seconds", "tokens_per_minute", "max_concurrent",
    "budget_usd", "budget_period", "allowed_models",
)


class KeyStore:
    """Create, list, find, change, revoke and rotate keys in PostgreSQL.

    Every change fires the ``api_keys_changed`` trigger, so caches on every replica
    evict the key within milliseconds.
    """

    def __init__(self, db: Database) -> None:
        self._db = db

    @contextlib.asynccontextmanager
    async def _transaction(self) -> AsyncIterator[asyncpg.Connection]:
        """A transaction: a fresh one on a pooled connection, or a savepoint in the caller's."""
        if isinstance(self._db, asyncpg.Pool):
            async with self._db.acquire() as conn, conn.transaction():
                yield conn
        else:
            async with self._db.transaction():
                yield self._db

    async def create(
        self,
        name: str,
        *,
        subject_id: uuid.UUID | None = None,
        policy: KeyPolicy | None = None,
        expires_in: timedelta | None = None,
        expires_at: datetime | None = None,
        raw_key: str | None = None,
    ) -> tuple[str, KeyRecord]:
        """Insert a new key; returns the raw key (shown once) and its record.

        The expiry is given either relative (``expires_in``) or absolute (``expires_at``).
        """
        _check_name(name)
        if expires_in is not None and expires_at is not None:
            raise ValueError("give expires_in or expires_at, not both")
        policy = policy or KeyPolicy()
        raw = raw_key or generate_key()
        if expires_in:
            expires_at = datetime.now(timezone.utc) + expires_in
        row = await self._db.fetchrow(
            f"""INSERT INTO api_keys (subject_id, name, key_prefix, key_hash, rate_limit_requests,
                rate_limit_window_seconds, tokens_per_minute, max_concurrent, budget_usd,
                budget_period, allowed_models, expires_at)
            VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)
            RETURNING {KEY_COLUMNS}""",
            subject_id or uuid.uuid4(), name, raw[:KEY_PREFIX_LEN], hash_key(raw),
            policy.rate_limit_requests, policy.rate_limit_window_seconds,
            policy.tokens_per_minute, policy.max_concurrent, policy.budget_usd,
            policy.budget_period,
            list(policy.allowed_models) if policy.allowed_models is not None else None,
            expires_at,
        )
        return raw, KeyRecord.from_row(row)

    async def ensure(self, raw: str, name: str, *, requests: int, window_seconds: int) -> bool:
        """Insert ``raw`` as a key allowing ``requests`` per ``window_seconds`` unless its
        prefix exists; True if inserted.

        The same key seeded earlier with the default window (60 per 60 s, before the
        development key had its own) is raised to this one; a window an operator has
        changed since is left alone.
        """
        inserted = await self._db.fetchval(
            """INSERT INTO api_keys (subject_id, name, key_prefix, key_hash,
                                     rate_limit_requests, rate_limit_window_seconds)
            VALUES ($1, $2, $3, $4, $5, $6)
            ON CONFLICT (key_prefix) DO UPDATE
               SET rate_limit_requests = EXCLUDED.rate_limit_requests,
                   rate_limit_window_seconds = EXCLUDED.rate_limit_window_seconds
             WHERE api_keys.key_hash = EXCLUDED.key_hash
               AND api_keys.rate_limit_requests = $7 AND api_keys.rate_limit_window_seconds = $8
            RETURNING xmax = 0""",
            uuid.uuid4(), name, raw[:KEY_PREFIX_LEN], hash_key(raw), requests, window_seconds,
            DEFAULT_KEY_RPM, DEFAULT_KEY_WINDOW_SECONDS,
        )
        return bool(inserted)

    async def list(
        self, *, subject_id: uuid.UUID | None = None, state: str | None = None,
        limit: int = 1000, offset: int = 0, after: uuid.UUID | None = None,
    ) -> list[KeyRecord]:
        """Keys, newest first, optionally filtered by subject and state.

        Pages either by ``offset`` or, stable under concurrent inserts, by ``after``: the
        id of the last key of the previous page (keys older than it come next; an
        unknown id gives an empty page).
        """
        if state is not None and state not in _STATE_CLAUSES:
            raise ValueError(f"state must be one of {', '.join(KEY_STATES)}")
        state_clause = _STATE_CLAUSES[state] if state is not None else "true"
        rows = await self._db.fetch(
            f"""SELECT {KEY_COLUMNS} FROM api_keys
            WHERE ($1::uuid IS NULL OR subject_id = $1) AND {state_clause}
              AND ($4::uuid IS NULL OR (created_at, api_key_id) <
                   (SELECT created_at, api_key_id FROM api_keys WHERE api_key_id = $4))
            ORDER BY created_at DESC, api_key_id DESC LIMIT $2 OFFSET $3""",
            subject_id, limit, offset, after,
        )
        return [KeyRecord.from_row(r) for r in rows]

    async def get(self, id_or_prefix: str, *, for_update: bool = False) -> KeyRecord:
        """The key whose id or 12-character prefix (or whole raw key) is given.

        ``for_update`` locks the row until the caller's transaction ends (only useful on
        a store bound to a connection inside a transaction).
        """
        lock = " FOR UPDATE" if for_update else ""
        row = await self._db.fetchrow(
            f"SELECT {KEY_COLUMNS} FROM api_keys WHERE {self._match_clause(id_or_prefix)}{lock}",
            self._match_value(id_or_prefix),
        )
        if row is None:
            raise KeyNotFound(id_or_prefix)
        return KeyRecord.from_row(row)

    async def update(
        self, id_or_prefix: str, *, name: str | None = None,
        expires_at: datetime | _Unchanged | None = UNCHANGED, **policy: Any,
    ) -> KeyRecord:
        """Change a key's name, expiry or policy fields; fields not given stay as they are.

        The row is locked while the change is merged, so two concurrent updates of
        different fields both land.
        """
        unknown = set(policy) - set(_POLICY_COLUMNS)
        if unknown:
            raise ValueError(f"unknown field {sorted(unknown)[0]}")
        if name is not None:
            _check_name(name)
        async with self._transaction() as conn:
            current_row = await conn.fetchrow(
                f"SELECT {KEY_COLUMNS} FROM api_keys WHERE {self._match_clause(id_or_prefix)} FOR UPDATE",
                self._match_value(id_or_prefix),
            )
            if current_row is None:
                raise KeyNotFound(id_or_prefix)
            return await self._apply_update(conn, KeyRecord.from_row(current_row), name, expires_at, policy)

    async def _apply_update(
        self, conn: asyncpg.Connection, current: KeyRecord, name: str | None,
        expires_at: datetime | _Unchanged | None, policy: dict[str, Any],
    ) -> KeyRecord:
        merged = {c: getattr(current.policy, c) for c in _POLICY_COLUMNS}
        merged.update(policy)
        if merged["allowed_models"] is not None:
            merged["allowed_models"] = tuple(merged["allowed_models"])
        if merged["budget_usd"] is not None:
            merged["budget_usd"] = Decimal(str(merged["budget_usd"]))
            if merged["budget_period"] is None:
                merged["budget_period"] = "month"
        checked = KeyPolicy(**merged)
        row = await conn.fetchrow(
            f"""UPDATE api_keys SET name = $2, rate_limit_requests = $3,
                rate_limit_window_seconds = $4, tokens_per_minute = $5, max_concurrent = $6,
                budget_usd = $7, budget_period = $8, allowed_models = $9, expires_at = $10
            WHERE api_key_id = $1 RETURNING {KEY_COLUMNS}""",
            current.api_key_id, name if name is not None else current.name,
            checked.rate_limit_requests, checked.rate_limit_window_seconds,
            checked.tokens_per_minute, checked.max_concurrent, checked.budget_usd,
            checked.budget_period,
            list(checked.allowed_models) if checked.allowed_models is not None else None,
            current.expires_at if isinstance(expires_at, _Unchanged) else expires_at,
        )
        return KeyRecord.from_row(row)

    async def revoke(self, id_or_prefix: str) -> KeyRecord:
        """Revoke a key (idempotent): ``revoked_at`` set, ``is_active`` false."""
        row = await self._db.fetchrow(
            f"""UPDATE api_keys SET is_active = false, revoked_at = coalesce(revoked_at, now())
            WHERE {self._match_clause(id_or_prefix)} RETURNING {KEY_COLUMNS}""",
            self._match_value(id_or_prefix),
        )
        if row is None:
            raise KeyNotFound(id_or_prefix)
        return KeyRecord.from_row(row)

    async def rotate(self, id_or_prefix: str, *, grace: timedelta | None = None) -> tuple[str, KeyRecord]:
        """Issue a new key with the old one's subject, name and policy; retire the old one.

        With ``grace``, the old key keeps working until then (its expiry is moved in),
        otherwise it is revoked at once. Both happen in one transaction.
        """
        async with self._transaction() as conn:
            old_row = await conn.fetchrow(
                f"SELECT {KEY_COLUMNS} FROM api_keys WHERE {self._match_clause(id_or_prefix)} FOR UPDATE",
                self._match_value(id_or_prefix),
            )
            if old_row is None:
                raise KeyNotFound(id_or_prefix)
            old = KeyRecord.from_row(old_row)
            if old.state != "active":
                # An expired key's successor would inherit the past expiry: useless.
                raise KeyStateError(f"a {old.state} key cannot be rotated")
            raw = generate_key()
            p = old.policy
            row = await conn.fetchrow(
                f"""INSERT INTO api_keys (subject_id, name, key_prefix, key_hash, rate_limit_requests,
                    rate_limit_window_seconds, tokens_per_minute, max_concurrent, budget_usd,
                    budget_period, allowed_models, expires_at)
                VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)
                RETURNING {KEY_COLUMNS}""",
                old.subject_id, old.name, raw[:KEY_PREFIX_LEN], hash_key(raw),
                p.rate_limit_requests, p.rate_limit_window_seconds, p.tokens_per_minute,
                p.max_concurrent, p.budget_usd, p.budget_period,
                list(p.allowed_models) if p.allowed_models is not None else None,
                old.expires_at,
            )
            if grace:
                await conn.execute(
                    "UPDATE api_keys SET expires_at = least(coalesce(expires_at, 'infinity'), now() + $2)"
                    " WHERE api_key_id = $1",
                    old.api_key_id, grace,
                )
            else:
                await conn.execute(
                    "UPDATE api_keys SET is_active = false, revoked_at = now() WHERE api_key_id = $1",
                    old.api_key_id,
                )
        return raw, KeyRecord.from_row(row)

    @staticmethod
    def _match_clause(id_or_prefix: str) -> str:
        try:
            uuid.UUID(id_or_prefix)
        except ValueError:
            return "key_prefix = $1"
        return "api_key_id = $1::uuid"

    @staticmethod
    def _match_value(id_or_prefix: str) -> str:
        try:
            return str(uuid.UUID(id_or_prefix))
        except ValueError:
            return id_or_prefix[:KEY_PREFIX_LEN]
