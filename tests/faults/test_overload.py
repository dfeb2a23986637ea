"""Overload: offered load at about three times what the gateway admits.

Capacity here is set, not measured: ``MAX_IN_FLIGHT=8`` in front of a provider taking
0.3 s per call admits about 27 calls a second; the test offers about 80 a second, open
loop (a new call every 12.5 ms whatever the answers do), for 2.5 seconds.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import asyncpg

from tests.faults.support import (
    Answer,
    assert_contract_answer,
    assert_ledger_exactly_once,
    assert_no_ledger_rows,
    chat,
)

IN_FLIGHT = 8
OFFERED_PER_SECOND = 80
SECONDS = 2.5


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


async def test_three_times_capacity_is_shed_fast_and_the_gateway_recovers(
    start_gateway: Any, fake_factory: Any, api_key: str, db_pool: asyncpg.Pool
) -> None:
    """Fault: three times more calls arrive than the gateway admits at once.

    Visible: the excess gets a fast 503 ``overloaded`` with ``Retry-After`` (the
    gateway sheds instead of queueing), the calls it accepts keep a bounded latency
    (their p99 stays near the provider's own 0.3 s, far below what a queue would
    build), health checks still answer during the overload, and once the load drops
    every call succeeds again. Ledger: each accepted call once; a shed call leaves no
    row (it was refused before any work).
    """
    fake = await fake_factory(latency_ms=300)
    gw = await start_gateway(fake, env={"MAX_IN_FLIGHT": str(IN_FLIGHT)})
    timings: dict[str, float] = {}

    async def timed(session: aiohttp.ClientSession, i: int) -> Answer:
        started = time.monotonic()
        answer = await chat(session, gw.url, api_key, stream=i % 3 == 0, timeout=30)
        timings[answer.request_id] = time.monotonic() - started
        return answer

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        calls: list[asyncio.Future[Answer]] = []
        health: list[int] = []
        began = time.monotonic()
        for i in range(int(OFFERED_PER_SECOND * SECONDS)):
            calls.append(asyncio.ensure_future(timed(session, i)))
            if i % 40 == 20:
                async with session.get(f"{gw.url}/healthz") as r:
                    health.append(r.status)
            await asyncio.sleep(max(0.0, began + (i + 1) / OFFERED_PER_SECOND - time.monotonic()))
        answers = await asyncio.gather(*calls)
        recovered = [await chat(session, gw.url, api_key, stream=i % 2 == 1) for i in range(10)]

    accepted = [a for a in answers if a.status == 200]
    shed = [a for a in answers if a.status == 503]
    for answer in answers:
        assert_contract_answer(answer, allowed={200, 503})
    assert all(a.json()["error"]["code"] == "overloaded" for a in shed)
    assert all(a.headers.get("Retry-After") == "1" for a in shed)
    assert all(a.stream_end == "done" for a in accepted if a.stream)
    # ~2/3 expected; a busy machine offers less than planned, so ask for a fifth.
    assert len(shed) > len(answers) / 5, (len(accepted), len(shed))
    assert len(accepted) >= 20
    # Generous sanity bounds only: shedding is immediate; the accepted never queue.
    assert _p99([timings[a.request_id] for a in shed]) < 1.0
    assert _p99([timings[a.request_id] for a in accepted]) < 3.0
    assert health == [200] * len(health)
    for answer in recovered:
        assert_contract_answer(answer, allowed={200})
    print(
        f"overload: {len(answers)} offered, {len(accepted)} accepted "
        f"(p99 {_p99([timings[a.request_id] for a in accepted]):.3f}s), {len(shed)} shed "
        f"(p99 {_p99([timings[a.request_id] for a in shed]):.3f}s)"
    )
    await assert_ledger_exactly_once(db_pool, [a.request_id for a in [*accepted, *recovered]])
    await assert_no_ledger_rows(db_pool, [a.request_id for a in shed])
