"""Stored Responses API answers in PostgreSQL, per subject (``sql/0012_responses.sql``).

A response is stored after it is answered, as a task: storing never delays a byte of
the answer. Until the row is written, this process's own readers wait for that task
(a follow-up sent the moment an answer arrived finds it); every other replica reads
the row once it is committed. Rows are per subject: another subject's id reads as
absent. Rows older than ``RESPONSES_RETENTION_DAYS`` are never read, and are purged
every :data:`PURGE_EVERY` stores (by whichever replica makes them). A failed store is logged and the answer stands.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from typing import Any

import asyncpg
import orjson

from gateway.core.errors import ServiceUnavailable

__all__ = ["PURGE_EVERY", "ResponseStore", "StoredResponse"]

log = logging.getLogger("gateway.responses")

#: Stores between two purges of expired rows (cheap: the purge uses the expiry index).
PURGE_EVERY = 100
#: How long shutdown waits for stores still being written.
_CLOSE_WAIT_SECONDS = 5.0

_INSERT = (
    "INSERT INTO stored_responses (id, subject_id, api_key_id, response, input_items, expires_at)"
    " VALUES ($1, $2, $3, $4::jsonb, $5::jsonb, now() + make_interval(secs => $6))"
    " ON CONFLICT (id) DO NOTHING"
)
_SELECT = (
    "SELECT response::text, input_items::text FROM stored_responses"
    " WHERE id = $1 AND subject_id = $2 AND expires_at > now()"
)
_DELETE = "DELETE FROM stored_responses WHERE id = $1 AND subject_id = $2 AND expires_at > now()"
_PURGE = "DELETE FROM stored_responses WHERE expires_at <= now()"


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One stored answer and the whole input it answered (earlier turns first)."""

    response: dict[str, Any]
    input_items: list[dict[str, Any]]


class ResponseStore:
    """Writes answers behind the response, reads them for retrieve and follow-ups."""

    def __init__(self, pool: asyncpg.Pool, *, retention_days: float, purge_every: int = PURGE_EVERY) -> None:
        self._pool = pool
        self._purge_every = purge_every
        self._retention_seconds = retention_days * 86400.0
        self._pending: dict[str, asyncio.Task[None]] = {}
        self._stores = 0

    def save(self, subject_id: uuid.UUID, api_key_id: uuid.UUID, response: dict[str, Any],
             input_items: list[dict[str, Any]]) -> None:
        """Store ``response`` in the background; returns at once."""
        response_id = response["id"]
        task = asyncio.create_task(self._write(subject_id, api_key_id, response, input_items))
        self._pending[response_id] = task
        task.add_done_callback(lambda _: self._pending.pop(response_id, None))

    async def _write(self, subject_id: uuid.UUID, api_key_id: uuid.UUID, response: dict[str, Any],
                     input_items: list[dict[str, Any]]) -> None:
        self._stores += 1
        try:
            async with self._pool.acquire() as conn:
                await conn.execute(_INSERT, response["id"], subject_id, api_key_id,
                                   orjson.dumps(response).decode(), orjson.dumps(input_items).decode(),
                                   self._retention_seconds)
                if self._stores % self._purge_every == 0:
                    await conn.execute(_PURGE)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            log.warning("response %s not stored: %s: %s", response["id"], type(exc).__name__, exc)

    async def _settled(self, response_id: str) -> None:
        task = self._pending.get(response_id)
        if task is not None:
            await asyncio.shield(task)

    async def load(self, response_id: str, subject_id: uuid.UUID) -> StoredResponse | None:
        """The subject's stored response ``response_id``; None when absent, expired or another's."""
        await self._settled(response_id)
        try:
            row = await self._pool.fetchrow(_SELECT, response_id, subject_id)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            raise ServiceUnavailable(f"stored responses are unavailable: {type(exc).__name__}") from None
        if row is None:
            return None
        return StoredResponse(response=orjson.loads(row[0]), input_items=orjson.loads(row[1]))

    async def delete(self, response_id: str, subject_id: uuid.UUID) -> bool:
        """Delete the subject's stored response; False when there was none."""
        await self._settled(response_id)
        try:
            status = await self._pool.execute(_DELETE, response_id, subject_id)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            raise ServiceUnavailable(f"stored responses are unavailable: {type(exc).__name__}") from None
        return bool(status.endswith(" 1"))

    async def close(self) -> None:
        """Wait (bounded) for the stores still being written."""
        pending = list(self._pending.values())
        if pending:
            await asyncio.wait(pending, timeout=_CLOSE_WAIT_SECONDS)
