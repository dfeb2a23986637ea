"""A call's ledger row and journal line are what they were before the hot path was cut.

``ledger_row`` builds a call's row in one pass, its range checks inline, and lets orjson
write stdlib UUIDs itself (there was a ``UsageEvent`` between the call and the row, built
positionally by ``UsageEvent.from_call``). The reference below is the code as it was
before both cuts (keyword construction, ``_clamp`` and ``_short`` on every field,
``str()`` of each UUID): for records of every shape, in range and out, the lines are byte
for byte the same and the values of the same types; and the journal's recovery and the
ledger read them back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import uuid
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import asyncpg
import orjson
from asyncpg.pgproto.pgproto import UUID as PgUUID

from gateway.billing import ledger
from gateway.billing.journal import Journal
from gateway.billing.ledger import (
    _INT16_MAX,
    _INT32_MAX,
    LEDGER_COLUMNS,
    NIL_UUID,
    UsageEvent,
    ledger_line,
    ledger_row,
    ship_lines,
)
from gateway.billing.reservations import micro_usd
from gateway.core.usage import CallRecord, Usage


# -- the reference: from_call and to_line as they were -----------------------------------
def _clamp(value: int, upper: int) -> int:
    return max(0, min(int(value), upper))


def _short(value: str | None, limit: int = 256) -> str | None:
    return value[:limit] if isinstance(value, str) else None


def reference_event(call: CallRecord) -> UsageEvent:
    usage = call.usage
    return UsageEvent(
        call_id=call.call_id,
        request_id=call.request_id[:128],
        response_id=_short(call.response_id),
        api_key_id=call.api_key_id or NIL_UUID,
        subject_id=call.subject_id or NIL_UUID,
        requested_model=call.requested_model[:256],
        served_model=_short(call.served_model),
        provider=_short(call.provider),
        deployment=_short(call.deployment),
        prompt_tokens=_clamp(usage.prompt_tokens, _INT32_MAX),
        completion_tokens=_clamp(usage.completion_tokens, _INT32_MAX),
        usage_estimated=usage.estimated,
        cost_usd=call.cost_usd,
        cost_diem=usage.cost_diem if usage.cost_diem is not None and usage.cost_diem >= 0 else None,
        cost_source=call.cost_source,
        latency_seconds=max(0.0, call.latency),
        ttft_seconds=call.ttft,
        status=_clamp(call.status, _INT16_MAX),
        outcome=call.outcome,
        streamed=call.stream,
        retries=_clamp(call.retries, _INT16_MAX),
        failovers=_clamp(call.failovers, _INT16_MAX),
        error_type=_short(call.error_type),
        finish_reason=_short(call.finish_reasons[-1]) if call.finish_reasons else None,
        created_at=call.started_at,
        protocol=call.protocol,
        guardrails=",".join(f"{p}:{a}" for p, a, _ in call.guardrails)[:1024] or None,
    )


def reference_line(event: UsageEvent) -> bytes:
    row: dict[str, Any] = {name: getattr(event, name) for name in (f.name for f in dataclasses.fields(event))}
    for name in ("call_id", "api_key_id", "subject_id"):
        row[name] = str(row[name])
    row["created_at"] = datetime.fromtimestamp(event.created_at, timezone.utc)
    return orjson.dumps(row, option=orjson.OPT_APPEND_NEWLINE)


# -- records of every shape -----------------------------------------------------------------
class Text(str):
    """A str subclass (a provider library's): sliced like any string."""


def records(rng: random.Random, count: int) -> list[CallRecord]:
    def uuid_of_any_type() -> uuid.UUID | None:
        choice = rng.randrange(4)
        if choice == 0:
            return None
        value = uuid.UUID(int=rng.getrandbits(128))
        return PgUUID(str(value)) if choice == 1 else value if choice == 2 else NIL_UUID

    def count_of_any_shape(upper: int) -> Any:
        return rng.choice([0, 1, 14, upper, upper + 1, -1, -(2**40), 2**63, True, False, 3.7, -0.5, 1e12,
                           rng.randrange(0, upper)])

    def text(limit: int) -> Any:
        return rng.choice([None, "", "x", "é" * (limit + 5), "a" * limit, Text("s" * (limit + 1)), "stop"])

    made = []
    for _ in range(count):
        usage = Usage(count_of_any_shape(_INT32_MAX), count_of_any_shape(_INT32_MAX),
                      cost_usd=rng.choice([None, 0.0, 1e-6]), cost_diem=rng.choice([None, -1.0, 0.0, 2.5, math.nan]),
                      estimated=rng.random() < 0.5)
        record = CallRecord(
            request_id=rng.choice(["r", "q" * 200]), api_key_id=uuid_of_any_type(), subject_id=uuid_of_any_type(),
            requested_model=rng.choice(["m", "é" * 300]), served_model=text(256), provider=text(256),
            deployment=text(256), status=count_of_any_shape(_INT16_MAX), outcome=rng.choice(["ok", "cut"]),
            stream=rng.random() < 0.5, usage=usage, response_id=text(256),
            finish_reasons=rng.choice([(), ("stop",), ("stop", "length"), (Text("x" * 300),)]),
            latency=rng.choice([0.0, -0.0, 0.00131, -1.0, math.nan, 2, 0]), ttft=rng.choice([None, 0.01]),
            retries=count_of_any_shape(_INT16_MAX), failovers=count_of_any_shape(_INT16_MAX),
            error_type=text(256), protocol=rng.choice(["chat", "anthropic"]),
            guardrails=rng.choice([(), (("pii", "masked", "input"),), (("p" * 600, "a", "d"), ("q" * 600, "b", "d"))]),
            call_id=rng.choice([uuid.uuid4(), PgUUID(str(uuid.uuid4()))]),
        )
        record.cost_usd, record.cost_source = rng.choice([(0.0, "none"), (3.2e-05, "price"), (-0.0, "price")])
        made.append(record)
    return made


_IDS = ("call_id", "api_key_id", "subject_id")


def test_rows_and_lines_are_the_same_as_before() -> None:
    for record in records(random.Random(5), 5000):
        row = ledger_row(record)
        expected = reference_event(record)
        line = ledger_line(row)
        assert line == reference_line(expected)
        assert expected.to_line() == line  # an event made by hand writes the same line
        # Values and types too: a bool count is an int in the row, a float latency stays
        # what it was; an id is itself (a stdlib UUID) or its text, the start a UTC time.
        for name in LEDGER_COLUMNS:
            value, was = row[name], getattr(expected, name)
            if name in _IDS:
                assert value == (was if type(was) is uuid.UUID else str(was))
            elif name == "created_at":
                assert value == datetime.fromtimestamp(was, timezone.utc)
            elif isinstance(was, float) and math.isnan(was):
                assert isinstance(value, float) and math.isnan(value)
            else:
                assert (value, type(value)) == (was, type(was)), name
    assert list(orjson.loads(line)) == list(LEDGER_COLUMNS)  # every column, in order


def test_a_combination_of_repeated_columns_seen_before_writes_the_same_line() -> None:
    """Calls whose repeated columns (ids, models, provider, deployment, cost source, status,
    outcome, retries, failovers, error type, finish reasons, protocol) are those of a call
    before take them from that call's (``_REPEATED``): their lines are still the reference's
    byte for byte, equal values of other types (an asyncpg UUID and a stdlib one, a str
    subclass, a count as a float or a bool) and values of no expected type (a broken
    provider's served model: a number, a list; an id or an outcome that is a number) included;
    and the table stays within its bound."""
    rng = random.Random(11)
    key = uuid.UUID(int=rng.getrandbits(128))

    def pick(usual: Any, *others: Any) -> Any:
        return usual if rng.random() < 0.85 else rng.choice(others)

    ledger._REPEATED.clear()
    hits = 0
    for record in records(rng, 10000):
        record.api_key_id, record.subject_id = pick(key, PgUUID(str(key)), None, NIL_UUID, 1, True), pick(None, key)
        record.requested_model = pick("fast-model", Text("fast-model"), "é" * 300)
        record.served_model = pick("fast-model", Text("fast-model"), None, "é" * 300, 1, True, 1.0, ["a"], {"x": 1})
        record.provider, record.deployment = pick("p", Text("p"), None), pick("d", None)
        record.status = pick(200, 200.0, True, 1, 0, -1, 2**40, _INT16_MAX + 1, 429)
        record.retries, record.failovers = pick(0, False, 0.0, 1, True), pick(0, 1)
        record.error_type, record.outcome = pick(None, "E", Text("E"), "e" * 300), pick("ok", "cut", Text("ok"), 1, True)
        record.finish_reasons = pick(("stop",), (), ("stop", Text("length")), (Text("stop"),), ("x" * 300,), (None,),
                                     ([],), ("length",) * 6 + ("stop",), ["stop"])
        repeated = (record.api_key_id, record.subject_id, record.requested_model, record.served_model,
                    record.provider, record.deployment, record.cost_source, record.status, record.outcome,
                    record.retries, record.failovers, record.error_type, record.finish_reasons[-1:], record.protocol)
        with contextlib.suppress(TypeError):
            hits += repeated in ledger._REPEATED
        row = ledger_row(record)
        expected = reference_event(record)
        assert ledger_line(row) == reference_line(expected)
        for name in ("served_model", "provider", "deployment", "status", "retries", "failovers", "error_type",
                     "finish_reason"):
            was = getattr(expected, name)
            assert (row[name], type(row[name])) == (was, type(was)), name
    assert hits > 500
    ledger._REPEATED.clear()
    for n in range(ledger.MAX_REPEATED + 5):  # clients choose model names: the table is cleared when full
        ledger_row(CallRecord(request_id="r", api_key_id=None, subject_id=None, requested_model=f"m{n}"))
    assert 0 < len(ledger._REPEATED) <= ledger.MAX_REPEATED


def test_a_line_reads_back_as_the_journal_and_the_ledger_read_it(tmp_path: Path) -> None:
    record = records(random.Random(9), 1)[0]
    record.api_key_id, record.subject_id = PgUUID(str(uuid.uuid4())), uuid.uuid4()
    record.call_id, record.cost_usd = uuid.uuid4(), 3.2e-05
    line = ledger_line(ledger_row(record))
    row = orjson.loads(line)
    assert (row["call_id"], row["api_key_id"], row["subject_id"]) == (
        str(record.call_id), str(record.api_key_id), str(record.subject_id))
    journal = Journal.open(tmp_path)
    journal.append(line, record.api_key_id, record.subject_id, micro_usd(record.cost_usd))
    journal.close()
    reopened = Journal.open(tmp_path)  # recovery parses the line for its spend
    assert reopened.unshipped_spend() == ({uuid.UUID(str(record.api_key_id)): 32}, {record.subject_id: 32})
    reopened.close()


async def test_the_ledger_takes_the_line(db_pool: asyncpg.Pool) -> None:
    record = CallRecord(request_id="events-test", api_key_id=PgUUID(str(uuid.uuid4())), subject_id=uuid.uuid4(),
                        requested_model="m", status=200, usage=Usage(14, 9), finish_reasons=("stop",))
    record.cost_usd, record.cost_source = 3.2e-05, "price"
    assert await ship_lines(db_pool, [ledger_line(ledger_row(record))]) == 1
    row = await db_pool.fetchrow("SELECT call_id, api_key_id, cost_usd FROM usage_ledger WHERE call_id = $1",
                                 record.call_id)
    assert (row["call_id"], str(row["api_key_id"]), row["cost_usd"]) == (
        record.call_id, str(record.api_key_id), Decimal("0.000032"))
