"""What every fault case checks, written once: answers in the contract's shape, stream
endings, the ledger's "exactly once", and the gateway process's memory.

    answer = await chat(session, gw.url, key, stream=True)
    assert_contract_answer(answer)          # never a gateway 500, never a traceback
    assert answer.stream_end in ("done", "error")
    await assert_ledger_exactly_once(db_pool, [answer.request_id])
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import asyncpg
import orjson

from tests.conftest import auth, chat_body, sse_payloads

__all__ = [
    "Answer",
    "assert_contract_answer",
    "assert_error_shape",
    "assert_ledger_exactly_once",
    "assert_no_ledger_rows",
    "chat",
    "ledger_rows",
    "ledger_table_exists",
    "rss_kib",
    "stream_end",
]

#: Where the contract's §11 ledger lives once billing is in (one row per request).
LEDGER_TABLE = "usage_ledger"
#: Words a body must never carry: a Python traceback, an asyncpg or aiohttp internal.
_LEAKS = (b"Traceback", b'File "', b"asyncpg.", b"aiohttp.", b"Exception:")


@dataclass
class Answer:
    """One chat call as the client saw it (status 0: no HTTP answer at all)."""

    request_id: str
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    stream: bool = False
    #: The transport failure, when there was one (connection reset, timeout...).
    failure: str | None = None

    @property
    def stream_end(self) -> str:
        """How a stream ended: done ([DONE]), error (one error event), broken, or n/a."""
        return stream_end(self.body) if self.stream and self.status == 200 else "n/a"

    def json(self) -> Any:
        return orjson.loads(self.body)


def stream_end(raw: bytes) -> str:
    """``done`` when it ends with [DONE]; ``error`` with exactly one error event last and
    no [DONE]; ``broken`` otherwise (cut without a word, or an error event not last)."""
    payloads = sse_payloads(raw)
    if payloads and payloads[-1] == b"[DONE]":
        return "done" if not any(p.startswith(b'{"error"') for p in payloads) else "broken"
    errors = [i for i, p in enumerate(payloads) if p.startswith(b'{"error"')]
    if errors == [len(payloads) - 1]:
        error = orjson.loads(payloads[-1])["error"]
        assert set(error) == {"message", "type", "code"}, error
        return "error"
    return "broken"


async def chat(
    session: aiohttp.ClientSession,
    base_url: str,
    key: str,
    *,
    stream: bool = False,
    body: dict[str, Any] | None = None,
    content: str = "hello fault",
    request_id: str | None = None,
    timeout: float = 30.0,
) -> Answer:
    """One chat call read to its end; transport failures become ``Answer.failure``."""
    answer = Answer(request_id=request_id or f"f-{uuid.uuid4().hex[:20]}", stream=stream)
    payload = body if body is not None else chat_body(content, stream=stream)
    try:
        async with session.post(
            f"{base_url}/v1/chat/completions",
            json=payload,
            headers={**auth(key), "x-request-id": answer.request_id},
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            answer.status = resp.status
            answer.headers = dict(resp.headers)
            try:
                answer.body = await resp.read()
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
                answer.failure = type(exc).__name__
    except (TimeoutError, aiohttp.ClientError) as exc:
        answer.failure = type(exc).__name__
    return answer


def assert_error_shape(status: int, body: bytes) -> dict[str, Any]:
    """The contract's §6 error body; returns its ``error`` object."""
    assert not any(leak in body for leak in _LEAKS), body[:500]
    parsed = orjson.loads(body)
    assert isinstance(parsed, dict) and set(parsed) == {"error"}, parsed
    error = parsed["error"]
    assert set(error) == {"message", "type", "code"}, error
    assert isinstance(error["message"], str) and isinstance(error["type"], str)
    assert error["code"] is None or isinstance(error["code"], str)
    return dict(error)


def assert_contract_answer(answer: Answer, *, allowed: set[int] | None = None) -> None:
    """Never a 500 of the gateway's own, never a traceback; errors in the contract's shape.

    A provider's own error is relayed with its status and body (contract §6), which the
    fake writes in the same shape, so every error body is checked the same way.
    """
    assert answer.status != 0, f"no HTTP answer for {answer.request_id}: {answer.failure}"
    if allowed is not None:
        assert answer.status in allowed, (answer.status, answer.body[:300])
    assert not any(leak in answer.body for leak in _LEAKS), answer.body[:500]
    if answer.status >= 400:
        error = assert_error_shape(answer.status, answer.body)
        assert error.get("code") != "internal_error", error
        if answer.status == 503 and error["type"] == "service_unavailable":  # the gateway's own 503
            assert answer.headers.get("Retry-After", "").isdigit(), answer.headers
    elif answer.status == 200 and not answer.stream:
        assert isinstance(answer.json(), dict)


async def ledger_rows(pool: asyncpg.Pool, request_ids: list[str]) -> dict[str, asyncpg.Record]:
    """The ledger row of each request id (call after :func:`assert_ledger_exactly_once`)."""
    rows = await pool.fetch(f"SELECT * FROM {LEDGER_TABLE} WHERE request_id = ANY($1)", request_ids)
    return {r["request_id"]: r for r in rows}


async def assert_no_ledger_rows(pool: asyncpg.Pool, request_ids: list[str], *, settle: float = 0.5) -> None:
    """Calls refused before any work leave no row (checked after shipping had time)."""
    await asyncio.sleep(settle)
    count = await pool.fetchval(f"SELECT count(*) FROM {LEDGER_TABLE} WHERE request_id = ANY($1)", request_ids)
    assert count == 0, f"{count} ledger row(s) for calls refused before any work"


async def ledger_table_exists(pool: asyncpg.Pool) -> bool:
    return bool(await pool.fetchval("SELECT to_regclass($1) IS NOT NULL", LEDGER_TABLE))


async def assert_ledger_exactly_once(
    pool: asyncpg.Pool, request_ids: list[str], *, within: float = 20.0
) -> None:
    """Every request id has exactly one ledger row, once shipping has caught up.

    Polls (bounded by ``within`` seconds) until each id is there, then checks none is
    there twice (a row is keyed by the gateway's own call id, so a doubled event would
    show as two rows with one request id).
    """
    assert await ledger_table_exists(pool), f"no {LEDGER_TABLE} table: the billing migration did not run"
    ids = sorted(set(request_ids))
    assert len(ids) == len(request_ids), "request ids must be unique per call"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    counts: dict[str, int] = {}
    while True:
        rows = await pool.fetch(
            f"SELECT request_id, count(*) AS n FROM {LEDGER_TABLE} WHERE request_id = ANY($1) GROUP BY 1", ids
        )
        counts = {r["request_id"]: r["n"] for r in rows}
        if len(counts) == len(ids) or loop.time() > deadline:
            break
        await asyncio.sleep(0.1)
    missing = [i for i in ids if i not in counts]
    doubled = {i: n for i, n in counts.items() if n != 1}
    assert not missing and not doubled, f"ledger: {len(missing)} lost {missing[:5]}, doubled {doubled}"


def rss_kib(pid: int) -> int:
    """Resident memory of a process in KiB, from /proc/<pid>/status (Linux)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")
