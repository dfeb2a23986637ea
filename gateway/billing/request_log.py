"""Request logs: the bodies of the calls ``request_logs:`` opts in, as PostgreSQL rows.

What a row holds (``sql/0017_request_logs.sql``): the call's ids, key, model, protocol,
status, outcome and guardrail decisions; the request as it was sent upstream (after the
input policies' redactions, so never the raw text a ``redact`` policy replaced); the
answer as the client got it (the whole body, after the output policies, or a stream's
assembled text); each body cut to ``max_body_bytes`` of UTF-8 and marked
``*_truncated`` with its full size in ``*_bytes``; and ``expires_at``, the call's start
plus ``retention_days``.

Written like the ledger's rows: the edge hands a :class:`CapturedCall` (references, no
encoding) to :mod:`actors.request_logs`, which turns it into one JSON line keyed by
column name (:func:`to_line`), journals it (:mod:`gateway.billing.journal`: group
commit, fsync, replay after a crash) and ships batches with :func:`ship_lines`, one
``INSERT ... ON CONFLICT (call_id) DO NOTHING``: a batch shipped twice inserts nothing
the second time. :func:`purge_expired` deletes what has outlived its retention; reads
(:class:`RequestLogStore`) never show an expired row, purged yet or not.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Literal

import asyncpg
import orjson

from gateway.core.usage import CallRecord

__all__ = [
    "COLUMNS",
    "CapturedCall",
    "RequestLogStore",
    "cut_body",
    "purge_expired",
    "ship_lines",
    "to_line",
]

ResponseKind = Literal["body", "text"]

#: Columns a line fills (``recorded_at`` is the database's).
COLUMNS = (
    "call_id", "request_id", "api_key_id", "key_prefix", "subject_id", "requested_model",
    "model_group", "served_model", "protocol", "streamed", "status", "outcome", "guardrails",
    "request_body", "request_bytes", "request_truncated", "response_body", "response_kind",
    "response_bytes", "response_truncated", "created_at", "expires_at",
)
_COLUMN_LIST = ", ".join(COLUMNS)
_INSERT = (
    f"INSERT INTO request_logs ({_COLUMN_LIST})"
    f" SELECT {_COLUMN_LIST} FROM json_populate_recordset(NULL::request_logs, $1::json)"
    " ON CONFLICT (call_id) DO NOTHING"
)
#: Rows one purge statement deletes (short transactions; the purge loops until done).
PURGE_BATCH = 5000
_INT16_MAX = 2**15 - 1
_INT32_MAX = 2**31 - 1


@dataclass(frozen=True, slots=True)
class CapturedCall:
    """One finished call whose bodies are to be stored, as the edge hands it over.

    Holds references only (the request as a parsed JSON value, the answer as bytes or
    text): encoding, cutting and writing cost the request-log actor, not the response.
    """

    record: CallRecord
    model_group: str
    key_prefix: str | None
    #: The request as sent upstream (a JSON value), None when nothing was sent.
    request: Any
    #: The answer as the client got it: a whole body (bytes), a stream's text, or None.
    response: bytes | str | None
    response_kind: ResponseKind | None
    retention_days: float
    max_body_bytes: int
    #: The stream's text outgrew what was collected of it (the edge stops at the cap).
    response_cut_short: bool = False


def cut_body(text: str, max_bytes: int) -> tuple[str, int, bool]:
    """``text`` as stored: at most ``max_bytes`` of UTF-8 (never half a character), its
    full size in bytes, and whether it was cut. NUL becomes U+FFFD (PostgreSQL's text
    cannot hold it)."""
    if "\x00" in text:
        text = text.replace("\x00", "\ufffd")
    raw = text.encode("utf-8", "replace")
    if len(raw) <= max_bytes:
        return text, len(raw), False
    return raw[:max_bytes].decode("utf-8", "ignore"), len(raw), True


def _request_text(request: Any) -> str | None:
    if request is None:
        return None
    try:
        return orjson.dumps(request).decode("utf-8")
    except (TypeError, orjson.JSONEncodeError):
        return str(request)


def _short(value: str | None, limit: int = 256) -> str | None:
    return value[:limit] if isinstance(value, str) else None


def to_line(call: CapturedCall) -> bytes:
    """One journal line: a JSON object keyed by column name, newline-terminated."""
    record = call.record
    request_body, request_bytes, request_truncated = None, 0, False
    request_text = _request_text(call.request)
    if request_text is not None:
        request_body, request_bytes, request_truncated = cut_body(request_text, call.max_body_bytes)
    response_body, response_bytes, response_truncated = None, 0, False
    if call.response is not None:
        text = call.response if isinstance(call.response, str) else call.response.decode("utf-8", "replace")
        response_body, response_bytes, response_truncated = cut_body(text, call.max_body_bytes)
        response_truncated = response_truncated or call.response_cut_short
    created = datetime.fromtimestamp(record.started_at, timezone.utc)
    return orjson.dumps(
        {
            "call_id": str(record.call_id),
            "request_id": record.request_id[:128],
            "api_key_id": str(record.api_key_id) if record.api_key_id else None,
            "key_prefix": call.key_prefix,
            "subject_id": str(record.subject_id) if record.subject_id else None,
            "requested_model": record.requested_model[:256],
            "model_group": _short(call.model_group),
            "served_model": _short(record.served_model),
            "protocol": record.protocol,
            "streamed": record.stream,
            "status": max(0, min(record.status, _INT16_MAX)),
            "outcome": record.outcome,
            "guardrails": ",".join(f"{p}:{a}" for p, a, _ in record.guardrails)[:1024] or None,
            "request_body": request_body,
            "request_bytes": min(request_bytes, _INT32_MAX),
            "request_truncated": request_truncated,
            "response_body": response_body,
            "response_kind": call.response_kind if call.response is not None else None,
            "response_bytes": min(response_bytes, _INT32_MAX),
            "response_truncated": response_truncated,
            "created_at": created,
            "expires_at": created + timedelta(days=call.retention_days),
        },
        option=orjson.OPT_APPEND_NEWLINE,
    )


async def ship_lines(conn: asyncpg.Connection | asyncpg.Pool, lines: Sequence[bytes]) -> int:
    """Insert journal lines in one statement; returns how many were new (a line whose
    ``call_id`` is already stored is skipped, so shipping a batch again is harmless)."""
    if not lines:
        return 0
    payload = b"[" + b",".join(line.rstrip(b"\n") for line in lines) + b"]"
    status = await conn.execute(_INSERT, payload.decode("utf-8"))
    return int(str(status).rsplit(" ", 1)[-1])


async def purge_expired(conn: asyncpg.Connection | asyncpg.Pool, batch: int = PURGE_BATCH) -> int:
    """Delete every row whose retention has passed, ``batch`` rows per statement."""
    total = 0
    while True:
        status = await conn.execute(
            "DELETE FROM request_logs WHERE call_id IN"
            " (SELECT call_id FROM request_logs WHERE expires_at <= now() LIMIT $1)",
            batch,
        )
        deleted = int(str(status).rsplit(" ", 1)[-1])
        total += deleted
        if deleted < batch:
            return total


# -- reading ------------------------------------------------------------------------
_SUMMARY = (
    "call_id, request_id, api_key_id, key_prefix, subject_id, requested_model, model_group,"
    " served_model, protocol, streamed, status, outcome, guardrails, request_bytes,"
    " request_truncated, response_kind, response_bytes, response_truncated, created_at, expires_at"
)


def _row_json(row: asyncpg.Record) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in row.items():
        if isinstance(value, uuid.UUID):
            value = str(value)
        elif isinstance(value, datetime):
            value = value.isoformat()
        out[name] = value
    return out


class RequestLogStore:
    """The admin API's reads: pages newest first, and one call's bodies."""

    def __init__(self, conn: asyncpg.Connection | asyncpg.Pool) -> None:
        self._conn = conn

    async def page(
        self, *, limit: int, api_key_id: uuid.UUID | None = None, key_prefix: str | None = None,
        model: str | None = None, since: datetime | None = None, after: uuid.UUID | None = None,
    ) -> list[dict[str, Any]]:
        """Up to ``limit`` calls, newest first (bodies left out), after the call ``after``."""
        where = ["expires_at > now()"]
        args: list[Any] = []

        def arg(value: Any) -> str:
            args.append(value)
            return f"${len(args)}"

        if api_key_id is not None:
            where.append(f"api_key_id = {arg(api_key_id)}")
        if key_prefix is not None:
            where.append(f"key_prefix = {arg(key_prefix)}")
        if model is not None:
            m = arg(model)
            where.append(f"(requested_model = {m} OR model_group = {m})")
        if since is not None:
            where.append(f"created_at >= {arg(since)}")
        if after is not None:
            a = arg(after)
            # Keyset paging: strictly older than the previous page's last call.
            where.append(
                f"(created_at, call_id) < (SELECT created_at, call_id FROM request_logs WHERE call_id = {a})"
            )
        rows = await self._conn.fetch(
            f"SELECT {_SUMMARY} FROM request_logs WHERE {' AND '.join(where)}"
            f" ORDER BY created_at DESC, call_id DESC LIMIT {arg(limit)}",
            *args,
        )
        return [_row_json(r) for r in rows]

    async def get(self, ref: str) -> dict[str, Any] | None:
        """One call with its bodies, by request id (its newest call) or call id; None if
        there is none, or it has expired."""
        call_id: uuid.UUID | None = None
        try:
            call_id = uuid.UUID(ref)
        except ValueError:
            pass
        row = await self._conn.fetchrow(
            f"SELECT {_SUMMARY}, request_body, response_body FROM request_logs"
            " WHERE (request_id = $1 OR call_id = $2) AND expires_at > now()"
            " ORDER BY created_at DESC, call_id DESC LIMIT 1",
            ref, call_id,
        )
        return None if row is None else _row_json(row)
