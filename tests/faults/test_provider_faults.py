"""Provider faults, through a real ``llm-gateway serve`` process: a 5xx storm, a hang, a
slow trickle, a cut mid-stream, garbage (invalid JSON with 200, a wrong content type,
an SSE line of several MB, and one over the gateway's bound).

Common to every case: the gateway never answers a 500 of its own and never a traceback;
every error is the contract's shape (§6), before the first byte as JSON, after it as
one ``data: {"error": ...}`` event without ``[DONE]`` (§5); every call that reached the
provider leaves exactly one ledger row (§11).
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import asyncpg

from tests.conftest import FakeUpstream, auth, chat_body
from tests.faults.support import (
    Answer,
    assert_contract_answer,
    assert_error_shape,
    assert_ledger_exactly_once,
    chat,
    ledger_rows,
)

NO_RETRIES = {"UPSTREAM_MAX_RETRIES": "0"}
#: For cases that fail one call after another on purpose: keep the circuit out of it.
PATIENT_BREAKER = {"fail_max": 1000, "reset_timeout_seconds": 1}


async def test_5xx_storm_answers_in_shape_opens_the_circuit_and_recovers(
    start_gateway: Any, fake: FakeUpstream, api_key: str, db_pool: asyncpg.Pool
) -> None:
    """Fault: the provider answers 500/502/503 to everything for a while.

    Client sees: each call either the provider's own 5xx (relayed with its body, after
    the retries) or, once the circuit opens, a fast 503 ``circuit_open`` with
    Retry-After; never a gateway 500. When the storm ends, calls succeed again after
    the breaker's reset timeout. Ledger: every call once (circuit_open ones included:
    they were admitted and routed).
    """
    gw = await start_gateway(fake, circuit_breaker={"fail_max": 3, "reset_timeout_seconds": 2})
    await fake.script(*({"status": s} for s in [500, 502, 503] * 30))
    async with aiohttp.ClientSession() as session:
        storm = await asyncio.gather(*(chat(session, gw.url, api_key, stream=i % 2 == 1) for i in range(24)))
        # The first wave was admitted while the circuit was closed; the next finds it open.
        storm += await asyncio.gather(*(chat(session, gw.url, api_key, stream=i % 2 == 1) for i in range(6)))
        for answer in storm:
            assert_contract_answer(answer, allowed={500, 502, 503})
            error = answer.json()["error"]
            if answer.status == 503 and error["code"] == "circuit_open":
                continue
            assert error["type"] == "fake", error  # the provider's own answer, relayed
        assert any(a.json()["error"]["code"] == "circuit_open" for a in storm)

        async with session.delete(f"{fake.url[:-3]}/_fake/script"):
            pass
        recovered: list[Answer] = []
        for _ in range(50):  # bounded: the breaker resets after 2 s
            answer = await chat(session, gw.url, api_key)
            recovered.append(answer)
            assert_contract_answer(answer, allowed={200, 503})
            if answer.status == 200:
                break
            await asyncio.sleep(0.2)
        assert recovered[-1].status == 200
        stream = await chat(session, gw.url, api_key, stream=True)
        assert stream.status == 200 and stream.stream_end == "done"
    assert "Traceback" not in gw.log()
    await assert_ledger_exactly_once(db_pool, [a.request_id for a in [*storm, *recovered, stream]])


async def test_provider_hang_is_a_504_for_whole_calls_and_streams(
    start_gateway: Any, fake: FakeUpstream, api_key: str, db_pool: asyncpg.Pool
) -> None:
    """Fault: the provider accepts the connection and never sends a byte.

    Client sees: 504 ``upstream_timeout`` (JSON, nothing was relayed yet) after
    REQUEST_TIMEOUT_SECONDS, for a whole call and for a stream; the next call is served.
    The gateway drops the hung upstream request rather than leaving it open. Ledger:
    each call once.
    """
    gw = await start_gateway(fake, env={**NO_RETRIES, "REQUEST_TIMEOUT_SECONDS": "1"})
    await fake.script({"hang": True}, {"hang": True})
    async with aiohttp.ClientSession() as session:
        hung = await asyncio.gather(chat(session, gw.url, api_key), chat(session, gw.url, api_key, stream=True))
        for answer in hung:
            assert_contract_answer(answer, allowed={504})
            assert answer.json()["error"]["code"] == "upstream_timeout"
        after = await chat(session, gw.url, api_key, stream=True)
        assert after.status == 200 and after.stream_end == "done"
    for _ in range(40):
        if (await fake.stats())["requests_cancelled"] == 2:
            break
        await asyncio.sleep(0.05)
    assert (await fake.stats())["requests_cancelled"] == 2  # the gateway let go of both
    await assert_ledger_exactly_once(db_pool, [a.request_id for a in [*hung, after]])
    rows = await ledger_rows(db_pool, [a.request_id for a in hung])
    assert {(r["status"], r["outcome"], r["prompt_tokens"] + r["completion_tokens"]) for r in rows.values()} == {
        (504, "upstream_error", 0)
    }


async def test_slow_trickle_is_relayed_as_it_comes_and_a_silence_past_the_idle_bound_ends_it(
    start_gateway: Any, fake: FakeUpstream, api_key: str, db_pool: asyncpg.Pool
) -> None:
    """Fault: the provider sends its chunks slowly (under the idle bound), then one stream
    goes silent for longer than the bound.

    Client sees: the slow stream relayed chunk by chunk as they arrive (the first chunk
    reaches the client while the provider is still sending) and ending ``[DONE]``; a
    slow whole answer under the timeout is a 200; the stream that goes silent ends with
    one ``upstream_timeout`` error event and no ``[DONE]``. Ledger: each call once.
    """
    gw = await start_gateway(fake, env={**NO_RETRIES, "REQUEST_TIMEOUT_SECONDS": "1.5"})
    await fake.script({"chunk_delay_ms": 300, "chunks": 6})
    answers: list[Answer] = []
    async with aiohttp.ClientSession() as session:
        rid = "f-trickle-stream"
        async with session.post(
            f"{gw.url}/v1/chat/completions", json=chat_body("one two three four five six", stream=True),
            headers={**auth(api_key), "x-request-id": rid},
        ) as resp:
            assert resp.status == 200
            await resp.content.readuntil(b"\n\n")
            assert (await fake.stats())["streams_completed"] == 0  # relayed, not buffered whole
            trickled = Answer(request_id=rid, status=200, stream=True, body=b"data: x\n\n" + await resp.read())
        assert trickled.stream_end == "done"
        answers.append(trickled)

        await fake.script({"delay_ms": 600})
        slow_whole = await chat(session, gw.url, api_key)
        assert_contract_answer(slow_whole, allowed={200})
        answers.append(slow_whole)

        await fake.script({"chunk_delay_ms": 4000, "chunks": 3})
        silent = await chat(session, gw.url, api_key, stream=True, content="a b c")
        assert silent.status == 200 and silent.stream_end == "error"
        assert b'"code":"upstream_timeout"' in silent.body
        answers.append(silent)
    await assert_ledger_exactly_once(db_pool, [a.request_id for a in answers])


async def test_cut_mid_stream_ends_with_one_error_event_and_is_never_replayed(
    start_gateway: Any, fake: FakeUpstream, api_key: str, db_pool: asyncpg.Pool
) -> None:
    """Fault: the provider drops the connection after three chunks.

    Client sees: the three chunks, then one ``upstream_error`` event, no ``[DONE]``;
    the request is not sent again (a byte had reached the client). Ledger: the call
    once, with what was delivered.
    """
    gw = await start_gateway(fake)
    await fake.script({"cut_after_chunks": 3})
    async with aiohttp.ClientSession() as session:
        cut = await chat(session, gw.url, api_key, stream=True, content="a b c d e f g h")
    assert cut.status == 200 and cut.stream_end == "error"
    assert b'"type":"upstream_error"' in cut.body
    assert (await fake.stats())["by_path"]["/v1/chat/completions"] == 1
    await assert_ledger_exactly_once(db_pool, [cut.request_id])
    outcome = await db_pool.fetchval("SELECT outcome FROM usage_ledger WHERE request_id = $1", cut.request_id)
    assert outcome == "cut"


async def test_garbage_with_200_is_an_upstream_error_never_relayed_as_an_answer(
    start_gateway: Any, fake: FakeUpstream, api_key: str, db_pool: asyncpg.Pool
) -> None:
    """Fault: the provider answers 200 with invalid JSON, or with an HTML page, to whole
    calls and to streams.

    Client sees: 502 ``upstream_unavailable`` in the contract's shape (the garbage is
    never handed over as if it were an answer; nothing was relayed yet, so it is JSON,
    not an event); with retries on, a retry that gets a good answer is a plain 200.
    Ledger: each call once.
    """
    gw = await start_gateway(fake, env=NO_RETRIES, circuit_breaker=PATIENT_BREAKER)
    answers: list[Answer] = []
    async with aiohttp.ClientSession() as session:
        for garbage in ("json", "content_type"):
            for stream in (False, True):
                await fake.script({"garbage": garbage})
                answer = await chat(session, gw.url, api_key, stream=stream)
                assert_contract_answer(answer, allowed={502})
                assert answer.json()["error"]["code"] == "upstream_unavailable", (garbage, stream)
                answers.append(answer)
    # Default retries: garbage once, then a good answer. A 200 with garbage was delivered
    # (and maybe billed): resending it is what retry_on_timeout (off by default) allows.
    resending = {"type": "openai", "base_url": fake.url, "api_key": "sk-fake-provider-secret", "retry_on_timeout": True}
    retrying = await start_gateway(fake, circuit_breaker=PATIENT_BREAKER, providers={"fake": resending})
    async with aiohttp.ClientSession() as session:
        for stream in (False, True):
            await fake.script({"garbage": "json"})
            answer = await chat(session, retrying.url, api_key, stream=stream)
            assert_contract_answer(answer, allowed={200})
            assert not stream or answer.stream_end == "done"
            answers.append(answer)
    await assert_ledger_exactly_once(db_pool, [a.request_id for a in answers])
    rows = await ledger_rows(db_pool, [a.request_id for a in answers])
    assert [rows[a.request_id]["status"] for a in answers] == [502, 502, 502, 502, 200, 200]


async def test_an_sse_line_of_several_megabytes_is_relayed_and_one_past_the_bound_is_refused(
    start_gateway: Any, fake: FakeUpstream, api_key: str, db_pool: asyncpg.Pool
) -> None:
    """Fault: the provider sends one event of 4 MB (a valid but huge chunk), then one of
    20 MB (over the gateway's 16 MB bound on one event).

    Client sees: the 4 MB chunk relayed whole, ending ``[DONE]`` (and a 4 MB whole
    answer relayed as a 200); the 20 MB one is a 502 ``upstream_unavailable`` before
    any byte, the gateway having buffered at most its bound. Ledger: each call once.
    """
    gw = await start_gateway(fake, env=NO_RETRIES, circuit_breaker=PATIENT_BREAKER)
    answers: list[Answer] = []
    async with aiohttp.ClientSession() as session:
        await fake.script({"garbage": "huge_line"})
        big_stream = await chat(session, gw.url, api_key, stream=True)
        assert big_stream.status == 200 and big_stream.stream_end == "done"
        assert len(big_stream.body) > 4 * 1024 * 1024
        answers.append(big_stream)

        await fake.script({"garbage": "huge_line"})
        big_whole = await chat(session, gw.url, api_key)
        assert_contract_answer(big_whole, allowed={200})
        assert len(big_whole.json()["choices"][0]["message"]["content"]) == 4 * 1024 * 1024
        answers.append(big_whole)

        await fake.script({"garbage": "huge_line", "line_bytes": 20 * 1024 * 1024})
        too_big = await chat(session, gw.url, api_key, stream=True)
        assert_contract_answer(too_big, allowed={502})
        assert_error_shape(too_big.status, too_big.body)
        answers.append(too_big)
    await assert_ledger_exactly_once(db_pool, [a.request_id for a in answers])
