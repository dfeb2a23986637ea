"""Signals to a real gateway process under traffic: SIGTERM with 100 streams open (a
grace period long enough, and one too short), and SIGKILL mid-traffic then a restart.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import pytest

from tests.conftest import FakeUpstream, auth, chat_body
from tests.faults.support import Answer, assert_contract_answer, assert_ledger_exactly_once, chat, ledger_rows

STREAMS = 100


async def _open_streams(
    session: aiohttp.ClientSession, url: str, key: str, n: int, *, model: str = "test-model"
) -> list[tuple[str, aiohttp.ClientResponse]]:
    """``n`` streams, each read up to its first event (so all are open at once)."""

    async def one(i: int) -> tuple[str, aiohttp.ClientResponse]:
        rid = f"f-term-{i:03d}-{time.monotonic_ns() % 10**9}"
        resp = await session.post(
            f"{url}/v1/chat/completions", json=chat_body("w " * 80, stream=True, model=model),
            headers={**auth(key), "x-request-id": rid},
        )
        assert resp.status == 200, await resp.text()
        await resp.content.readuntil(b"\n\n")
        return rid, resp

    return await asyncio.gather(*(one(i) for i in range(n)))


async def _finish(rid: str, resp: aiohttp.ClientResponse) -> Answer:
    answer = Answer(request_id=rid, status=200, stream=True, body=b"data: {}\n\n")
    try:
        answer.body += await resp.read()
    except aiohttp.ClientError as exc:
        answer.failure = type(exc).__name__
    return answer


async def test_sigterm_with_100_open_streams_lets_them_all_finish(
    start_gateway: Any, fake_factory: Any, api_key: str, db_pool: asyncpg.Pool
) -> None:
    """Fault: SIGTERM while 100 streams are open, with a grace period longer than they
    need.

    Visible: new connections are refused at once; every open stream runs to its
    ``[DONE]``; the process exits 0. Ledger: all 100 calls exactly once (billing drains
    before the process ends).
    """
    fake: FakeUpstream = await fake_factory(chunk_delay_ms=100, chunks=20)
    gw = await start_gateway(fake, env={"SHUTDOWN_GRACE_SECONDS": "30"})
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        streams = await _open_streams(session, gw.url, api_key, STREAMS)
        gw.signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        with pytest.raises(aiohttp.ClientConnectionError):
            async with session.get(f"{gw.url}/healthz", timeout=aiohttp.ClientTimeout(total=2)) as r:
                await r.read()
        answers = await asyncio.gather(*(_finish(rid, resp) for rid, resp in streams))
    assert [a.stream_end for a in answers] == ["done"] * STREAMS, [a.failure for a in answers if a.failure]
    assert await asyncio.to_thread(gw.wait, 30) == 0, gw.log()
    await assert_ledger_exactly_once(db_pool, [a.request_id for a in answers])


async def test_sigterm_past_the_grace_period_ends_each_stream_with_an_error_event(
    start_gateway: Any, fake_factory: Any, api_key: str, db_pool: asyncpg.Pool
) -> None:
    """Fault: SIGTERM while 100 long streams (and 5 slow whole calls) are open, with a
    1 s grace period.

    Visible: at the end of the grace period each stream still open gets one error event
    (503 ``shutting_down``) and ends without ``[DONE]`` (none is left without a word);
    each whole call still waiting gets a 503 ``shutting_down`` with Retry-After; the
    process exits 0 soon after. Ledger: every call once (the cut streams with what they
    delivered).
    """
    streamer: FakeUpstream = await fake_factory(chunk_delay_ms=200, chunks=60)
    slow: FakeUpstream = await fake_factory(latency_ms=20_000)
    gw = await start_gateway(
        streamer,
        env={"SHUTDOWN_GRACE_SECONDS": "1"},
        providers={
            "fake": {"type": "openai", "base_url": streamer.url, "api_key": "sk-a"},
            "slow": {"type": "openai", "base_url": slow.url, "api_key": "sk-b"},
        },
        models=[
            {"name": "slow-model", "deployments": [{"provider": "slow", "model": "m"}]},
            {"name": "*", "deployments": [{"provider": "fake", "model": "*"}]},
        ],
    )
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        streams = await _open_streams(session, gw.url, api_key, STREAMS)
        waiting = [
            asyncio.ensure_future(chat(session, gw.url, api_key, body=chat_body(model="slow-model")))
            for _ in range(5)
        ]
        for _ in range(200):  # bounded: until the slow provider holds all five
            if (await slow.stats())["requests"] >= 5:
                break
            await asyncio.sleep(0.05)
        started = time.monotonic()
        gw.signal(signal.SIGTERM)
        answers = await asyncio.gather(*(_finish(rid, resp) for rid, resp in streams))
        whole = await asyncio.gather(*waiting)
    code = await asyncio.to_thread(gw.wait, 30)
    took = time.monotonic() - started
    ends = [a.stream_end for a in answers]
    assert set(ends) <= {"done", "error"} and "error" in ends, ends
    assert all(b'"code":"shutting_down"' in a.body for a in answers if a.stream_end == "error")
    for answer in whole:
        assert_contract_answer(answer, allowed={503})
        assert answer.json()["error"]["code"] == "shutting_down"
    assert code == 0, gw.log()
    assert took < 15, took  # grace 1 s + abort 2 s + actors; generous
    await assert_ledger_exactly_once(db_pool, [a.request_id for a in [*answers, *whole]])
    rows = await ledger_rows(db_pool, [a.request_id for a in [*answers, *whole]])
    for answer in answers:
        row = rows[answer.request_id]
        if answer.stream_end == "error":  # cut by the shutdown, with what it had delivered
            assert (row["outcome"], row["error_type"], row["usage_estimated"]) == ("cut", "shutdown", True), dict(row)
    assert {(rows[a.request_id]["outcome"], rows[a.request_id]["status"]) for a in whole} == {("cancelled", 503)}


async def test_sigkill_during_traffic_then_restart_replays_the_journal_once(
    process_factory: Any, fake_factory: Any, api_key: str, db_pool: asyncpg.Pool, tmp_path: Path
) -> None:
    """Fault: SIGKILL (no drain at all) while calls are being answered; then the gateway
    is started again on the same journal.

    Visible: calls in flight at the kill get no answer (or a broken stream); the new
    process serves at once. Ledger: every call the client saw answered is there exactly
    once after the restart (the journal is shipped; nothing doubled, even for events
    that may have been shipped just before the kill).
    """
    from tests.faults.conftest import fault_config

    fake = await fake_factory(latency_ms=30, chunk_delay_ms=20)
    journal = tmp_path / "journal"
    # Ship rarely, so most events are only in the journal when the kill comes.
    env = {"BILLING_JOURNAL_DIR": str(journal), "BILLING_SHIP_INTERVAL_SECONDS": "3600"}
    config = fault_config(fake)
    gw = await process_factory(env=env, config_yaml=config)
    answered: list[Answer] = []
    async with aiohttp.ClientSession() as session:
        traffic = [asyncio.ensure_future(chat(session, gw.url, api_key, stream=i % 2 == 0)) for i in range(60)]
        await asyncio.sleep(0.4)
        # On a loaded machine 0.4 s may pass before any answer: then wait (bounded) for the
        # first, so there is something to check; the kill still lands mid-traffic.
        if not any(t.done() for t in traffic):
            await asyncio.wait(traffic, timeout=15, return_when=asyncio.FIRST_COMPLETED)
            await asyncio.sleep(0.2)
        gw.signal(signal.SIGKILL)
        for answer in await asyncio.gather(*traffic):
            if answer.status == 200 and answer.failure is None and (not answer.stream or answer.stream_end == "done"):
                answered.append(answer)
    await asyncio.to_thread(gw.wait, 10)
    assert answered, "nothing was answered before the kill: make the traffic start sooner"
    restarted = await process_factory(env={**env, "BILLING_SHIP_INTERVAL_SECONDS": "0.1"}, config_yaml=config)
    async with aiohttp.ClientSession() as session:
        after = await chat(session, restarted.url, api_key)
    assert_contract_answer(after, allowed={200})
    await assert_ledger_exactly_once(db_pool, [a.request_id for a in [*answered, after]])
