"""Gateway keys: generation, hashing, and the one store the CLI and admin API share.

A key is ``llmg_`` + 43 URL-safe characters (32 random bytes). Only its first 12
characters (the lookup prefix) and the SHA-256 of the whole key are stored.
"""

from __future__ import annotations

import hashlib
import secrets
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import asyncpg

__all__ = [
    "DEV_KEY",
    "KEY_PREFIX_LEN",
    "KeyNotFound",
    "KeyPolicy",
    "KeyRecord",
    "KeyStore",
    "UNCHANGED",
    "generate_key",
    "hash_key",
]

KEY_PREFIX_LEN = 12
KEY_MARK = "llmg_"
#: Seeded only by an embedded-database ``serve``, for the quick start.
DEV_KEY = "llmg_dev_0123456789abcdef"

BUDGET_PERIODS = ("day", "month", "total")


class _Unchanged:
    """Marks an argument that was not given (``None`` already means "clear it")."""


UNCHANGED = _Unchanged()


class KeyNotFound(LookupError):
    """No key has that id or prefix."""


def generate_key() -> str:
    """A new raw key: ``llmg_`` + 32 random bytes, URL-safe base64."""
    return KEY_MARK + secrets.token_urlsafe(32)


def hash_key(raw: str) -> bytes:
    """SHA-256 of the whole key, as stored in ``api_keys.key_hash``."""
    return hashlib.sha256(raw.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True, slots=True)
class KeyPolicy:
    """Limits and permissions attached to a key; ``None`` means not set."""

    rate_limit_requests: int = 60
    rate_limit_window_seconds: int = 60
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    budget_usd: Decimal | None = None
    budget_period: str | None = None
    allowed_models: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("rate_limit_requests", "rate_limit_window_seconds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        for name in ("tokens_per_minute", "max_concurrent"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive")
        if self.budget_usd is not None and self.budget_usd < 0:
            raise ValueError("budget_usd must not be negative")
        if self.budget_period is not None and self.budget_period not in BUDGET_PERIODS:
            raise ValueError("budget_period must be day, month or total")


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

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def create(
        self,
        name: str,
        *,
        subject_id: uuid.UUID | None = None,
        policy: KeyPolicy | None = None,
        expires_in: timedelta | None = None,
        raw_key: str | None = None,
    ) -> tuple[str, KeyRecord]:
        """Insert a new key; returns the raw key (shown once) and its record."""
        if not name.strip():
            raise ValueError("name must not be empty")
        policy = policy or KeyPolicy()
        raw = raw_key or generate_key()
        expires_at = datetime.now(timezone.utc) + expires_in if expires_in else None
        row = await self._pool.fetchrow(
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

    async def ensure(self, raw: str, name: str) -> bool:
        """Insert ``raw`` as a key unless its prefix exists; True if inserted."""
        result = await self._pool.execute(
            """INSERT INTO api_keys (subject_id, name, key_prefix, key_hash)
            VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING""",
            uuid.uuid4(), name, raw[:KEY_PREFIX_LEN], hash_key(raw),
        )
        return str(result).endswith(" 1")

    async def list(
        self, *, subject_id: uuid.UUID | None = None, state: str | None = None,
        limit: int = 1000, offset: int = 0,
    ) -> list[KeyRecord]:
        """Keys, newest first, optionally filtered by subject and state."""
        rows = await self._pool.fetch(
            f"""SELECT {KEY_COLUMNS} FROM api_keys
            WHERE ($1::uuid IS NULL OR subject_id = $1)
            ORDER BY created_at DESC, api_key_id LIMIT $2 OFFSET $3""",
            subject_id, limit if state is None else 1_000_000, offset if state is None else 0,
        )
        records = [KeyRecord.from_row(r) for r in rows]
        if state is not None:
            records = [r for r in records if r.state == state][offset : offset + limit]
        return records

    async def get(self, id_or_prefix: str) -> KeyRecord:
        """The key whose id or 12-character prefix (or whole raw key) is given."""
        row = await self._pool.fetchrow(
            f"SELECT {KEY_COLUMNS} FROM api_keys WHERE {self._match_clause(id_or_prefix)}",
            self._match_value(id_or_prefix),
        )
        if row is None:
            raise KeyNotFound(id_or_prefix)
        return KeyRecord.from_row(row)

    async def update(
        self, id_or_prefix: str, *, name: str | None = None,
        expires_at: datetime | _Unchanged | None = UNCHANGED, **policy: Any,
    ) -> KeyRecord:
        """Change a key's name, expiry or policy fields; fields not given stay as they are."""
        current = await self.get(id_or_prefix)
        merged = {c: getattr(current.policy, c) for c in _POLICY_COLUMNS}
        unknown = set(policy) - set(_POLICY_COLUMNS)
        if unknown:
            raise ValueError(f"unknown field {sorted(unknown)[0]}")
        merged.update(policy)
        if merged["allowed_models"] is not None:
            merged["allowed_models"] = tuple(merged["allowed_models"])
        if merged["budget_usd"] is not None:
            merged["budget_usd"] = Decimal(str(merged["budget_usd"]))
            if merged["budget_period"] is None:
                merged["budget_period"] = "month"
        checked = KeyPolicy(**merged)
        row = await self._pool.fetchrow(
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
        row = await self._pool.fetchrow(
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
        async with self._pool.acquire() as conn, conn.transaction():
            old_row = await conn.fetchrow(
                f"SELECT {KEY_COLUMNS} FROM api_keys WHERE {self._match_clause(id_or_prefix)} FOR UPDATE",
                self._match_value(id_or_prefix),
            )
            if old_row is None:
                raise KeyNotFound(id_or_prefix)
            old = KeyRecord.from_row(old_row)
            if old.state == "revoked":
                raise ValueError("a revoked key cannot be rotated")
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
