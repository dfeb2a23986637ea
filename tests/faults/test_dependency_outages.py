"""PostgreSQL and Redis going away under a real gateway process, through cuttable TCP
proxies (the shared servers are never stopped), and PostgreSQL absent at start.

What the gateway does when PostgreSQL is unreachable **at start**: it does not wait or
retry; it exits with status 1 and one line on stderr naming the problem (contract §2:
every command exits non-zero with one clear line on an unreachable database), within
the connect timeout (5 s) even when the address swallows packets. The orchestrator's
restart policy (or compose's ``depends_on: service_healthy``) does the waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import asyncpg
import orjson

from tests.chaos import TcpProxy
from tests.conftest import FakeUpstream, free_port, redis_via, via_proxy
from tests.faults.support import Answer, assert_contract_answer, assert_ledger_exactly_once, chat


async def _readyz(session: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, Any]]:
    async with session.get(f"{url}/readyz", timeout=aiohttp.ClientTimeout(total=5)) as r:
        return r.status, orjson.loads(await r.read())


async def _until(predicate: Any, within: float, every: float = 0.1) -> bool:
    """Poll an async predicate until true, at most ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(every)
    return bool(await predicate())


async def test_postgres_cut_under_traffic_then_restored(
    start_gateway: Any, fake: FakeUpstream, api_key: str, key_factory: Any, database_url: str,
    pg_proxy: TcpProxy, db_pool: asyncpg.Pool,
) -> None:
    """Fault: every connection to PostgreSQL drops mid-traffic and new ones are refused,
    for a while; then it answers again.

    Client sees: a key already verified keeps working throughout (200s, streams end
    ``[DONE]``); a key never seen fails closed with 401 (not a 500, not a database
    error); ``/readyz`` answers 503 naming the database while it is away and 200 again
    after, with no restart; the new key works once the database is back. Ledger: every
    answered call exactly once, the ones made during the outage shipped after it.
    """
    gw = await start_gateway(fake, env={"DATABASE_URL": via_proxy(database_url, pg_proxy.port)})
    answered: list[Answer] = []
    async with aiohttp.ClientSession() as session:
        for stream in (False, True):  # the key is verified and cached from here on
            answered.append(await chat(session, gw.url, api_key, stream=stream))

        await pg_proxy.cut()
        new_key, _ = await key_factory(name="made during the outage")  # written directly, not via the proxy
        for i in range(20):
            answered.append(await chat(session, gw.url, api_key, stream=i % 2 == 1))
        unknown = await chat(session, gw.url, new_key)
        assert_contract_answer(unknown, allowed={401})
        status, body = await _readyz(session, gw.url)
        assert status == 503 and body["checks"]["database"].startswith("unreachable"), body

        await pg_proxy.restore()
        assert await _until(lambda: _ready(session, gw.url), within=15), "not ready again after the outage"
        after = await chat(session, gw.url, new_key)
        assert_contract_answer(after, allowed={200})
        answered.append(after)
    for answer in answered:
        assert_contract_answer(answer, allowed={200})
        assert not answer.stream or answer.stream_end == "done"
    assert "Traceback" not in gw.log(), gw.log()
    await assert_ledger_exactly_once(db_pool, [a.request_id for a in answered])


async def _ready(session: aiohttp.ClientSession, url: str) -> bool:
    status, _ = await _readyz(session, url)
    return status == 200


async def test_postgres_unreachable_at_start_exits_one_clear_line(
    process_factory: Any, fake: FakeUpstream
) -> None:
    """Fault: nothing listens at DATABASE_URL when ``serve`` starts.

    Operator sees: exit status 1 within seconds, one line on stderr saying the database
    cannot be reached, no traceback, and not the password from the URL.
    """
    dsn = f"postgresql://gateway:pg-password-never-printed@127.0.0.1:{free_port()}/gateway"
    gw = await process_factory(env={"DATABASE_URL": dsn}, ready=False)
    code = await asyncio.to_thread(gw.wait, 30)
    output = gw.log()
    assert code == 1, output
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("llm-gateway: cannot connect to the database"), output
    assert "Traceback" not in output and "pg-password-never-printed" not in output


@contextlib.asynccontextmanager
async def _black_hole() -> AsyncIterator[int]:
    """A port that accepts TCP connections and never says a word (a hung database)."""
    held: list[asyncio.StreamWriter] = []

    async def accept(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    try:
        yield int(server.sockets[0].getsockname()[1])
    finally:
        for writer in held:
            writer.transport.abort()
        server.close()


async def test_postgres_that_accepts_but_never_answers_at_start_exits_within_the_connect_timeout(
    process_factory: Any, fake: FakeUpstream
) -> None:
    """Fault: the database's address accepts connections and then says nothing.

    Operator sees: no hang; exit status 1 after the 5 s connect timeout, one clear line.
    """
    async with _black_hole() as port:
        gw = await process_factory(env={"DATABASE_URL": f"postgresql://postgres@127.0.0.1:{port}/x"}, ready=False)
        code = await asyncio.to_thread(gw.wait, 30)
    output = gw.log()
    assert code == 1, output
    assert "cannot connect to the database" in output and "Traceback" not in output, output


async def test_redis_cut_under_traffic_then_restored(
    start_gateway: Any, fake: FakeUpstream, api_key: str, redis_url: str, redis_proxy: TcpProxy,
    db_pool: asyncpg.Pool,
) -> None:
    """Fault: Redis (the shared rate-limit store) drops every connection mid-traffic and
    refuses new ones for a while, then comes back.

    Client sees: every call still answered (limits fall back to this process's memory,
    never a 500 and never a refusal because the store is away); ``/readyz`` stays 200
    (a degraded limiter is not an outage) and reports the degradation until Redis is
    back. Ledger: every call once.
    """
    gw = await start_gateway(fake, env={"REDIS_URL": redis_via(redis_url, redis_proxy.port)})
    answered: list[Answer] = []
    async with aiohttp.ClientSession() as session:
        for i in range(4):
            answered.append(await chat(session, gw.url, api_key, stream=i % 2 == 1))
        await redis_proxy.cut()
        for i in range(16):
            answered.append(await chat(session, gw.url, api_key, stream=i % 2 == 1))
        status, body = await _readyz(session, gw.url)
        assert status == 200 and body.get("degraded"), body  # still ready, and says why not fully
        await redis_proxy.restore()

        async def healthy() -> bool:
            status, body = await _readyz(session, gw.url)
            return status == 200 and not body.get("degraded")

        assert await _until(healthy, within=15), "the limiter did not go back to Redis"
        for i in range(4):
            answered.append(await chat(session, gw.url, api_key, stream=i % 2 == 1))
    for answer in answered:
        assert_contract_answer(answer, allowed={200})
    assert "Traceback" not in gw.log(), gw.log()
    await assert_ledger_exactly_once(db_pool, [a.request_id for a in answered])
