"""The admin audit trail: who changed what, when, and to which key or subject budget.

Every change made through the admin API writes one ``admin_audit`` row in the same
transaction as the change itself, so a change without its row (or a row without its
change) cannot exist. Reads are not recorded: they change nothing and show no secret.
A row never holds a raw key, a key hash or the admin token.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg
import orjson

from gateway.auth.keys import Database

__all__ = ["ACTIONS", "AuditEntry", "AuditLog"]

#: Every action the trail knows, one per kind of admin change. Budget rows name their
#: subject in ``detail`` (``api_key_id`` is null: a subject budget covers all its keys).
ACTIONS = (
    "key.create", "key.update", "key.revoke", "key.rotate", "budget.set", "budget.clear",
    # The console's sessions: who signed in (and how, with which role), who signed out.
    "session.sign_in", "session.sign_out",
)

_COLUMNS = "audit_id, at, actor, action, api_key_id, request_id, remote, detail"


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """One recorded admin action."""

    audit_id: int
    at: datetime
    #: ADMIN_TOKEN_NAME, or ``token:`` + the first 12 hex digits of the token's SHA-256.
    actor: str
    action: str
    api_key_id: uuid.UUID | None
    request_id: str | None
    remote: str | None
    #: What changed (field: {"from", "to"}), ids of keys made, the subject of a budget,
    #: a reason if one was given.
    detail: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.audit_id,
            "at": self.at.isoformat(),
            "actor": self.actor,
            "action": self.action,
            "api_key_id": str(self.api_key_id) if self.api_key_id else None,
            "request_id": self.request_id,
            "remote": self.remote,
            "detail": self.detail,
        }

    @classmethod
    def from_row(cls, row: asyncpg.Record) -> AuditEntry:
        return cls(
            audit_id=row["audit_id"],
            at=row["at"],
            actor=row["actor"],
            action=row["action"],
            api_key_id=row["api_key_id"],
            request_id=row["request_id"],
            remote=row["remote"],
            detail=orjson.loads(row["detail"]),
        )


class AuditLog:
    """Write and page the trail; bind it to the connection of the change it records."""

    def __init__(self, db: Database) -> None:
        self._db = db

    async def record(
        self,
        *,
        actor: str,
        action: str,
        api_key_id: uuid.UUID | None,
        detail: dict[str, Any],
        request_id: str | None = None,
        remote: str | None = None,
    ) -> int:
        """Append one entry; returns its id."""
        if action not in ACTIONS:
            raise ValueError(f"unknown audit action {action!r}")
        audit_id = await self._db.fetchval(
            """INSERT INTO admin_audit (actor, action, api_key_id, request_id, remote, detail)
            VALUES ($1, $2, $3, $4, $5, $6::jsonb) RETURNING audit_id""",
            actor, action, api_key_id, request_id, remote,
            orjson.dumps(detail, default=str).decode(),
        )
        return int(audit_id)

    async def page(
        self,
        *,
        limit: int = 100,
        after: int | None = None,
        api_key_id: uuid.UUID | None = None,
        action: str | None = None,
    ) -> list[AuditEntry]:
        """Entries newest first; ``after`` is the last id of the previous page."""
        rows = await self._db.fetch(
            f"""SELECT {_COLUMNS} FROM admin_audit
            WHERE ($2::bigint IS NULL OR audit_id < $2)
              AND ($3::uuid IS NULL OR api_key_id = $3)
              AND ($4::text IS NULL OR action = $4)
            ORDER BY audit_id DESC LIMIT $1""",
            limit, after, api_key_id, action,
        )
        return [AuditEntry.from_row(r) for r in rows]
