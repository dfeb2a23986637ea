"""The usage ledger's rows: one :class:`UsageEvent` per chat call, and how batches land.

An event is made from a finished :class:`~gateway.core.usage.CallRecord`, written to the
local journal as one JSON line whose keys are the ledger's column names, and shipped
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

import asyncpg
import orjson

from gateway.core.usage import CallRecord

__all__ = ["NIL_UUID", "LEDGER_COLUMNS", "UsageEvent", "fetch_ledger_id", "ship_lines"]

NIL_UUID = uuid.UUID(int=0)
_INT32_MAX = 2**31 - 1
_INT16_MAX = 2**15 - 1

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


def _short(value: str | None, limit: int = 256) -> str | None:
    return value[:limit] if isinstance(value, str) else None


@dataclass(slots=True)
class UsageEvent:
    """One finished call, as the ledger stores it (field names are column names).

    Not ``frozen``: a frozen dataclass sets each of these 27 fields through
    ``object.__setattr__``, which made building one event per call cost about twice as
    much; nothing mutates an event after :meth:`from_call`.
    """

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

    @classmethod
    def from_call(cls, call: CallRecord) -> UsageEvent:
        """The event of a finished call (its cost already settled).

        Positional, and the checks inline: this runs once per call (a keyword call and
        one helper call per field made it about twice as dear). A count already inside its
        column's range (every real one) is kept as it is; anything else goes to
        :func:`_clamp`, which also turns a bool or a float into an int.
        """
        usage = call.usage
        prompt_tokens, completion_tokens = usage.prompt_tokens, usage.completion_tokens
        status, retries, failovers = call.status, call.retries, call.failovers
        response_id, served_model, provider = call.response_id, call.served_model, call.provider
        deployment, error_type, cost_diem = call.deployment, call.error_type, usage.cost_diem
        latency = call.latency
        return cls(
            call.call_id,
            call.request_id[:128],
            response_id[:256] if isinstance(response_id, str) else None,
            call.api_key_id or NIL_UUID,
            call.subject_id or NIL_UUID,
            call.requested_model[:256],
            served_model[:256] if isinstance(served_model, str) else None,
            provider[:256] if isinstance(provider, str) else None,
            deployment[:256] if isinstance(deployment, str) else None,
            prompt_tokens if type(prompt_tokens) is int and 0 <= prompt_tokens <= _INT32_MAX
            else _clamp(prompt_tokens, _INT32_MAX),
            completion_tokens if type(completion_tokens) is int and 0 <= completion_tokens <= _INT32_MAX
            else _clamp(completion_tokens, _INT32_MAX),
            usage.estimated,
            call.cost_usd,
            cost_diem if cost_diem is not None and cost_diem >= 0 else None,
            call.cost_source,
            latency if latency > 0.0 else 0.0,  # max(0.0, latency), NaN and -0.0 included
            call.ttft,
            status if type(status) is int and 0 <= status <= _INT16_MAX else _clamp(status, _INT16_MAX),
            call.outcome,
            call.stream,
            retries if type(retries) is int and 0 <= retries <= _INT16_MAX else _clamp(retries, _INT16_MAX),
            failovers if type(failovers) is int and 0 <= failovers <= _INT16_MAX else _clamp(failovers, _INT16_MAX),
            error_type[:256] if isinstance(error_type, str) else None,
            _short(call.finish_reasons[-1]) if call.finish_reasons else None,
            call.started_at,
            call.protocol,
            (",".join(f"{p}:{a}" for p, a, _ in call.guardrails)[:1024] or None) if call.guardrails else None,
        )

    def to_line(self) -> bytes:
        """One journal line: a JSON object keyed by column name, newline-terminated."""
        # Stores into a copy of a dict that has every column already (in LEDGER_COLUMNS'
        # order, the line's) cost about half what a 27-key literal does, which grows its
        # table as it goes.
        row = _ROW.copy()
        # orjson writes a stdlib UUID itself (its str() is ~0.6 µs, the same text);
        # asyncpg's UUIDs are another type it refuses, and their str() is cheap.
        call_id, api_key_id, subject_id = self.call_id, self.api_key_id, self.subject_id
        row["call_id"] = call_id if type(call_id) is uuid.UUID else str(call_id)
        row["request_id"] = self.request_id
        row["response_id"] = self.response_id
        row["api_key_id"] = api_key_id if type(api_key_id) is uuid.UUID else str(api_key_id)
        row["subject_id"] = subject_id if type(subject_id) is uuid.UUID else str(subject_id)
        row["requested_model"] = self.requested_model
        row["served_model"] = self.served_model
        row["provider"] = self.provider
        row["deployment"] = self.deployment
        row["prompt_tokens"] = self.prompt_tokens
        row["completion_tokens"] = self.completion_tokens
        row["usage_estimated"] = self.usage_estimated
        row["cost_usd"] = self.cost_usd
        row["cost_diem"] = self.cost_diem
        row["cost_source"] = self.cost_source
        row["latency_seconds"] = self.latency_seconds
        row["ttft_seconds"] = self.ttft_seconds
        row["status"] = self.status
        row["outcome"] = self.outcome
        row["streamed"] = self.streamed
        row["retries"] = self.retries
        row["failovers"] = self.failovers
        row["error_type"] = self.error_type
        row["finish_reason"] = self.finish_reason
        row["created_at"] = datetime.fromtimestamp(self.created_at, timezone.utc)
        row["protocol"] = self.protocol
        row["guardrails"] = self.guardrails
        return orjson.dumps(row, option=orjson.OPT_APPEND_NEWLINE)


#: Every column, in the line's order: what :meth:`UsageEvent.to_line` fills a copy of.
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
