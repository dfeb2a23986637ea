"""The relay under provider faults: retries, mid-stream cuts, timeouts, disconnects."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import orjson

from tests.conftest import FakeUpstream, Gateway, auth, chat_body, config_for, sse_payloads


async def test_non_stream_is_retried_until_the_provider_answers(gateway: Gateway, fake: FakeUpstream, api_key: str) -> None:
    await fake.script({"status": 503}, {"status": 500})
    resp = await gateway.data.post("/v1/chat/completions", json=chat_body(), headers=auth(api_key))
    assert resp.status == 200
    assert (await fake.stats())["by_path"]["/v1/chat/completions"] == 3


async def test_retry_after_from_the_provider_is_honoured(gateway: Gateway, fake: FakeUpstream, api_key: str) -> None:
    await fake.script({"status": 429, "retry_after": 1})
    started = time.monotonic()
    resp = await gateway.data.post("/v1/chat/completions", json=chat_body(), headers=auth(api_key))
    assert resp.status == 200
    # A behavioural bound, not a performance one: the retry waited for the provider's word.
    assert time.monotonic() - started >= 0.95


async def test_provider_error_keeps_its_status_and_body_after_retries(gateway: Gateway, fake: FakeUpstream, api_key: str) -> None:
    await fake.script({"status": 500}, {"status": 500}, {"status": 500})
    resp = await gateway.data.post("/v1/chat/completions", json=chat_body(), headers=auth(api_key))
    assert resp.status == 500
    assert await resp.json() == {"error": {"message": "fake failure", "type": "fake", "code": None}}
    assert (await fake.stats())["by_path"]["/v1/chat/completions"] == 3  # 1 + VENICE_MAX_RETRIES (2)


async def test_non_retryable_provider_error_is_relayed_at_once(gateway: Gateway, fake: FakeUpstream, api_key: str) -> None:
    await fake.script({"status": 400})
    resp = await gateway.data.post("/v1/chat/completions", json=chat_body(), headers=auth(api_key))
    assert resp.status == 400
    assert (await fake.stats())["by_path"]["/v1/chat/completions"] == 1


async def test_max_retries_comes_from_the_environment(gateway_factory: Any, fake: FakeUpstream, api_key: str) -> None:
    gw = await gateway_factory(env={"VENICE_MAX_RETRIES": "0"}, config_yaml=config_for(fake.url))
    await fake.script({"status": 503})
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(), headers=auth(api_key))
    assert resp.status == 503
    assert (await fake.stats())["by_path"]["/v1/chat/completions"] == 1


async def test_unreachable_provider_is_502(gateway_factory: Any, api_key: str) -> None:
    from tests.conftest import free_port

    gw = await gateway_factory(config_yaml=config_for(f"http://127.0.0.1:{free_port()}/v1"))
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(), headers=auth(api_key))
    assert resp.status == 502
    error = (await resp.json())["error"]
    assert (error["type"], error["code"]) == ("upstream_error", "upstream_unavailable")
    assert "sk-fake-provider-secret" not in error["message"]


async def test_upstream_timeout_is_504(gateway_factory: Any, fake: FakeUpstream, api_key: str) -> None:
    gw = await gateway_factory(
        env={"REQUEST_TIMEOUT_SECONDS": "0.3", "VENICE_MAX_RETRIES": "0"}, config_yaml=config_for(fake.url)
    )
    await fake.script({"hang": True})
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(), headers=auth(api_key))
    assert resp.status == 504
    assert (await resp.json())["error"]["code"] == "upstream_timeout"


async def test_stream_retried_before_the_first_byte(gateway: Gateway, fake: FakeUpstream, api_key: str) -> None:
    await fake.script({"status": 502})
    resp = await gateway.data.post("/v1/chat/completions", json=chat_body(stream=True), headers=auth(api_key))
    assert resp.status == 200
    assert (await resp.read()).endswith(b"data: [DONE]\n\n")


async def test_mid_stream_cut_ends_with_one_error_event_and_no_done(gateway: Gateway, fake: FakeUpstream, api_key: str) -> None:
    await fake.script({"cut_after_chunks": 3})
    resp = await gateway.data.post("/v1/chat/completions", json=chat_body("a b c d e f g h", stream=True), headers=auth(api_key))
    assert resp.status == 200
    payloads = sse_payloads(await resp.read())
    assert b"[DONE]" not in payloads
    events = [orjson.loads(p) for p in payloads]
    assert [e for e in events if "error" in e] == [events[-1]]
    assert events[-1]["error"]["type"] == "upstream_error"
    assert sum(1 for e in events if "choices" in e) == 3
    # Never retried once a byte reached the client.
    assert (await fake.stats())["by_path"]["/v1/chat/completions"] == 1


async def test_stream_that_goes_silent_gets_a_timeout_event(gateway_factory: Any, fake: FakeUpstream, api_key: str) -> None:
    gw = await gateway_factory(env={"REQUEST_TIMEOUT_SECONDS": "0.5"}, config_yaml=config_for(fake.url))
    await fake.script({"chunk_delay_ms": 3000, "chunks": 3})
    resp = await gw.data.post("/v1/chat/completions", json=chat_body("a b c", stream=True), headers=auth(api_key))
    events = [orjson.loads(p) for p in sse_payloads(await resp.read()) if p != b"[DONE]"]
    assert events[-1]["error"]["code"] == "upstream_timeout"


async def test_client_disconnect_cancels_the_upstream_within_a_second(gateway: Gateway, fake: FakeUpstream, api_key: str) -> None:
    await fake.script({"chunk_delay_ms": 200, "chunks": 50})
    records: list[Any] = []
    gateway.state.call_listeners.append(records.append)
    async with aiohttp.ClientSession() as session:
        resp = await session.post(gateway.url("/v1/chat/completions"), json=chat_body("w " * 60, stream=True), headers=auth(api_key))
        assert resp.status == 200
        await resp.content.readuntil(b"\n\n")
        await resp.content.readuntil(b"\n\n")
        resp.close()  # the client hangs up mid-stream
    disconnected = time.monotonic()
    while time.monotonic() - disconnected < 1.0:
        if (await fake.stats())["streams_cancelled"] == 1:
            break
        await asyncio.sleep(0.05)
    stats = await fake.stats()
    assert stats["streams_cancelled"] == 1, stats
    assert stats["streams_completed"] == 0
    # The call is still recorded, with the usage delivered so far.
    for _ in range(20):
        if records:
            break
        await asyncio.sleep(0.05)
    assert records and records[0].outcome == "cancelled"
    assert records[0].usage.completion_tokens > 0


async def test_client_disconnect_before_the_answer_cancels_a_non_stream_call(gateway: Gateway, fake: FakeUpstream, api_key: str) -> None:
    await fake.script({"hang": True})
    async with aiohttp.ClientSession() as session:
        task = asyncio.ensure_future(session.post(gateway.url("/v1/chat/completions"), json=chat_body(), headers=auth(api_key)))
        for _ in range(40):
            if (await fake.stats())["by_path"].get("/v1/chat/completions"):
                break
            await asyncio.sleep(0.025)
        task.cancel()
    # The gateway's upstream request is abandoned: the fake sees its handler cancelled.
    for _ in range(40):
        stats = await fake.stats()
        if stats["requests_cancelled"] >= 1:
            break
        await asyncio.sleep(0.025)
    assert (await fake.stats())["requests_cancelled"] == 1
