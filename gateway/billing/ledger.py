"""The usage ledger's rows: one per chat call, and how batches land.

A row is made from a finished :class:`~gateway.core.usage.CallRecord` (:func:`ledger_row`),
written to the local journal as one JSON line whose keys are the ledger's column names, and shipped
many lines at a time by :func:`ship_lines`: one ``INSERT ... SELECT FROM
json_populate_recordset(...) ON CONFLICT (call_id) DO NOTHING``. The line on disk *is*
the row, so nothing is decoded or re-encoded between the journal and PostgreSQL, and a
batch shipped twice (a crash between commit and truncation) inserts nothing the second
time.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import asyncpg
import orjson

from gateway.core.usage import CallRecord

__all__ = ["NIL_UUID", "LEDGER_COLUMNS", "UsageEvent", "fetch_ledger_id", "ledger_line", "ledger_row", "ship_lines"]

NIL_UUID = uuid.UUID(int=0)
_INT32_MAX = 2**31 - 1
_INT16_MAX = 2**15 - 1
#: The bits a count inside its column's range never has: an int is in ``0.._INT32_MAX``
#: exactly when it has none of these (a negative one has them all), so one ``&`` checks
#: several counts at once: ``not (a | b) & _OUTSIDE_INT32``.
_OUTSIDE_INT32 = ~_INT32_MAX
_OUTSIDE_INT16 = ~_INT16_MAX
_UUID = uuid.UUID

#: Columns an event fills (``recorded_at`` is the database's; two columns are generated).
LEDGER_COLUMNS = (
    "call_id", "request_id", "response_id", "api_key_id", "subject_id", "requested_model",
    "served_model", "provider", "deployment", "prompt_tokens", "completion_tokens",
    "usage_estimated", "cost_usd", "cost_diem", "cost_source", "latency_seconds",
    "ttft_seconds", "status", "outcome", "streamed", "retries", "failovers", "error_type",
    "finish_reason", "created_at", "protocol", "guardrails",
)

_COLUMN_LIST = ", ".join(LEDGER_COLUMNS)
_INSERT = (
    f"INSERT INTO usage_ledger ({_COLUMN_LIST})"
    f" SELECT {_COLUMN_LIST} FROM json_populate_recordset(NULL::usage_ledger, $1::json)"
    " ON CONFLICT (call_id) DO NOTHING"
)


def _clamp(value: int, upper: int) -> int:
    """Keep a count inside its column's range: a broken provider must not jam a batch."""
    return max(0, min(int(value), upper))


def ledger_row(call: CallRecord) -> dict[str, object]:
    """A finished call's ledger row (its cost already settled): a dict keyed by column name,
    in :data:`LEDGER_COLUMNS`' order, that orjson writes as its journal line
    (:func:`ledger_line`).

    One pass from the call to the row. There used to be a :class:`UsageEvent` between them,
    its 27 fields set and then read again into the row, once per call (about 530 bytecode
    instructions). Stores into a copy of a dict that has every column already cost about
    half what a 27-key literal does. The columns that repeat from call to call (who called
    which model where, how it ended: :data:`_REPEATED`) come in that copy, checked once per
    combination (:func:`_repeated_columns`); the rest are checked inline: token counts both
    inside their columns' range (every real one) are kept as they are, checked together by
    their bits (a check each took 22 instructions); otherwise they go to :func:`_clamp`,
    which also turns a bool or a float into an int (and keeps an int in range as it is).
    orjson writes a stdlib UUID itself (its ``str()`` is ~0.6 µs, the same text); asyncpg's
    UUIDs are another type it refuses, and their ``str()`` is cheap.
    """
    usage = call.usage
    repeated = (call.api_key_id, call.subject_id, call.requested_model, call.served_model, call.provider,
                call.deployment, call.cost_source, call.status, call.outcome, call.retries, call.failovers,
                call.error_type, call.finish_reasons[-1:], call.protocol)
    try:
        row = _REPEATED[repeated].copy()
    except (KeyError, TypeError):  # a new combination, or an unhashable value (a broken provider's)
        row = _repeated_columns(repeated).copy()
    call_id = call.call_id
    row["call_id"] = call_id if type(call_id) is _UUID else str(call_id)
    row["request_id"] = call.request_id[:128]
    response_id = call.response_id
    row["response_id"] = response_id[:256] if isinstance(response_id, str) else None
    prompt_tokens, completion_tokens = usage.prompt_tokens, usage.completion_tokens
    if type(prompt_tokens) is int and type(completion_tokens) is int \
            and not (prompt_tokens | completion_tokens) & _OUTSIDE_INT32:
        row["prompt_tokens"] = prompt_tokens
        row["completion_tokens"] = completion_tokens
    else:
        row["prompt_tokens"] = _clamp(prompt_tokens, _INT32_MAX)
        row["completion_tokens"] = _clamp(completion_tokens, _INT32_MAX)
    row["usage_estimated"] = usage.estimated
    row["cost_usd"] = call.cost_usd
    cost_diem = usage.cost_diem
    row["cost_diem"] = cost_diem if cost_diem is not None and cost_diem >= 0 else None
    latency = call.latency
    row["latency_seconds"] = latency if latency > 0.0 else 0.0  # max(0.0, latency), NaN and -0.0 included
    row["ttft_seconds"] = call.ttft
    row["streamed"] = call.stream
    row["created_at"] = datetime.fromtimestamp(call.started_at, timezone.utc)
    row["guardrails"] = (",".join(f"{p}:{a}" for p, a, _ in call.guardrails)[:1024] or None) \
        if call.guardrails else None
    return row


def ledger_line(row: dict[str, object]) -> bytes:
    """A ledger row's journal line: a JSON object keyed by column name, newline-terminated."""
    return orjson.dumps(row, option=orjson.OPT_APPEND_NEWLINE)


@dataclass(slots=True)
class UsageEvent:
    """A ledger row as an object (field names are column names), for code that makes rows
    without a call: tools, and tests that fill a ledger. A call's own row is
    :func:`ledger_row`'s."""

    call_id: uuid.UUID
    request_id: str
    response_id: str | None
    api_key_id: uuid.UUID
    subject_id: uuid.UUID
    requested_model: str
    served_model: str | None
    provider: str | None
    deployment: str | None
    prompt_tokens: int
    completion_tokens: int
    usage_estimated: bool
    cost_usd: float
    cost_diem: float | None
    cost_source: str
    latency_seconds: float
    ttft_seconds: float | None
    status: int
    outcome: str
    streamed: bool
    retries: int
    failovers: int
    error_type: str | None
    finish_reason: str | None
    #: When the call started, Unix seconds.
    created_at: float
    #: The protocol the client spoke (chat | anthropic).
    protocol: str = "chat"
    #: The guardrail policies that acted, ``policy:action`` comma-joined (None: none).
    guardrails: str | None = None

    def row(self) -> dict[str, object]:
        """The row as :func:`ledger_row` makes a call's: ids as orjson writes them, the
        start as a UTC time."""
        row: dict[str, object] = {name: getattr(self, name) for name in LEDGER_COLUMNS}
        for name in ("call_id", "api_key_id", "subject_id"):
            value = row[name]
            if type(value) is not uuid.UUID:
                row[name] = str(value)
        row["created_at"] = datetime.fromtimestamp(self.created_at, timezone.utc)
        return row

    def to_line(self) -> bytes:
        """Its journal line (:func:`ledger_line`)."""
        return ledger_line(self.row())


#: What :func:`ledger_row` reads of a call for the columns that repeat from call to call:
#: the ids, the requested and served models, provider, deployment, the cost's source, the
#: status, outcome, retries, failovers, error type, last finish reason (as a tuple of it,
#: or none) and protocol (the key of :data:`_REPEATED`).
_Repeated = tuple[Any, ...]
#: Combinations of those, each with its columns filled in a copy of :data:`_ROW`
#: (:func:`_repeated_columns`): the same for a key's calls to one deployment that end
#: alike. Cleared when :data:`MAX_REPEATED` (clients choose model names). A row checking
#: them at every call took 348 bytecode instructions; 184 with the combination looked up.
_REPEATED: dict[_Repeated, dict[str, object]] = {}
MAX_REPEATED = 512


def _repeated_columns(repeated: _Repeated) -> dict[str, object]:
    """The columns that ``repeated`` gives, checked (a copy of :data:`_ROW` with them set);
    remembered in :data:`_REPEATED` when each value is of the type it is meant to be: a
    UUID or None, a string or None (each at most its column's width), a count in range, a
    tuple of such a string or none. Any combination equal to such a one (``==``, as the table finds
    it) then writes the same text: nothing else equals a UUID, None or a string (a str
    subclass slices to the same text), and a number equal to a count in range is clamped
    to that count; whereas a float or a bool kept as it is would not write as the int it
    equals. A combination with another value (a broken provider's served model, unhashable
    even) has its columns checked at every call, as before."""
    (api_key_id, subject_id, requested_model, served_model, provider, deployment, cost_source, status, outcome,
     retries, failovers, error_type, finish_reasons, protocol) = repeated
    columns = _ROW.copy()
    key_id, subject = api_key_id or NIL_UUID, subject_id or NIL_UUID
    columns["api_key_id"] = key_id if type(key_id) is _UUID else str(key_id)
    columns["subject_id"] = subject if type(subject) is _UUID else str(subject)
    columns["requested_model"] = requested_model[:256]
    columns["served_model"] = served_model[:256] if isinstance(served_model, str) else None
    columns["provider"] = provider[:256] if isinstance(provider, str) else None
    columns["deployment"] = deployment[:256] if isinstance(deployment, str) else None
    columns["cost_source"] = cost_source
    columns["status"] = _clamp(status, _INT16_MAX)
    columns["outcome"] = outcome
    columns["retries"] = _clamp(retries, _INT16_MAX)
    columns["failovers"] = _clamp(failovers, _INT16_MAX)
    columns["error_type"] = error_type[:256] if isinstance(error_type, str) else None
    reason = finish_reasons[-1] if finish_reasons else None
    columns["finish_reason"] = reason[:256] if isinstance(reason, str) else None
    columns["protocol"] = protocol
    if (all(value is None or isinstance(value, _UUID) for value in (api_key_id, subject_id))
            and all(type(value) is str and len(value) <= 256 for value in (requested_model, cost_source, outcome, protocol))
            and all(value is None or (type(value) is str and len(value) <= 256)
                    for value in (served_model, provider, deployment, error_type))
            and all(type(value) is int and 0 <= value <= _INT16_MAX for value in (status, retries, failovers))
            and type(finish_reasons) is tuple
            and all(type(value) is str and len(value) <= 256 for value in finish_reasons)):
        if len(_REPEATED) >= MAX_REPEATED:
            _REPEATED.clear()
        _REPEATED[repeated] = columns
    return columns


#: Every column, in the line's order: what :func:`ledger_row` fills a copy of.
_ROW: dict[str, object] = dict.fromkeys(LEDGER_COLUMNS)


async def ship_lines(conn: asyncpg.Connection | asyncpg.Pool, lines: Sequence[bytes]) -> int:
    """Insert journal lines into the ledger in one statement; returns how many were new.

    Lines whose ``call_id`` is already in the ledger are skipped, so shipping a batch
    again is harmless. One bad line fails the whole statement (a ``DataError`` or a
    constraint violation): the caller then ships line by line to find it.
    """
    if not lines:
        return 0
    payload = b"[" + b",".join(line.rstrip(b"\n") for line in lines) + b"]"
    status = await conn.execute(_INSERT, payload.decode("utf-8"))
    return int(str(status).rsplit(" ", 1)[-1])


async def fetch_ledger_id(conn: asyncpg.Connection | asyncpg.Pool) -> uuid.UUID:
    """This database's ledger id (journals are filed under it)."""
    value = await conn.fetchval("SELECT ledger_id FROM ledger_identity")
    if value is None:
        raise RuntimeError("ledger_identity is empty: run the migrations")
    return uuid.UUID(str(value))
