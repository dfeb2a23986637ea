"""The official ``openai`` SDK as a client, and SIGTERM during a stream (real process)."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import aiohttp
import openai
import pytest

from tests.conftest import FakeUpstream, Gateway, auth, chat_body, config_for, sse_payloads


async def test_openai_sdk_non_stream_and_stream(gateway: Gateway, api_key: str) -> None:
    client = openai.AsyncOpenAI(base_url=gateway.url("/v1"), api_key=api_key, max_retries=0)
    try:
        answer = await client.chat.completions.create(
            model="sdk-model", messages=[{"role": "user", "content": "hi from the sdk"}]
        )
        assert answer.choices[0].message.content == "This is a mock answer to: hi from the sdk"
        assert answer.usage is not None and answer.usage.total_tokens > 0

        pieces = []
        stream = await client.chat.completions.create(
            model="sdk-model", messages=[{"role": "user", "content": "hi from the sdk"}], stream=True
        )
        async for chunk in stream:
            assert chunk.usage is None  # not asked for: never shown
            pieces.extend(c.delta.content or "" for c in chunk.choices)
        assert "".join(pieces) == "This is a mock answer to: hi from the sdk"

        with_usage = await client.chat.completions.create(
            model="sdk-model", messages=[{"role": "user", "content": "x"}], stream=True,
            stream_options={"include_usage": True},
        )
        usages = [c.usage async for c in with_usage if c.usage is not None]
        assert len(usages) == 1 and usages[0].completion_tokens > 0

        models = await client.models.list()
        assert isinstance(models.data, list)
    finally:
        await client.close()


async def test_openai_sdk_sees_contract_errors(gateway: Gateway) -> None:
    client = openai.AsyncOpenAI(base_url=gateway.url("/v1"), api_key="llmg_not_a_real_key_at_all_0000", max_retries=0)
    try:
        with pytest.raises(openai.AuthenticationError) as info:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert info.value.code == "invalid_api_key"
    finally:
        await client.close()


async def test_sigterm_lets_open_streams_finish_then_exits_zero(
    process_factory: Any, fake_factory: Any, api_key: str
) -> None:
    fake: FakeUpstream = await fake_factory(chunk_delay_ms=100)
    gw = await process_factory(env={"SHUTDOWN_GRACE_SECONDS": "20"}, config_yaml=config_for(fake.url))
    async with aiohttp.ClientSession() as session:
        resp = await session.post(
            f"{gw.url}/v1/chat/completions", json=chat_body("one two three four five six seven eight", stream=True),
            headers=auth(api_key),
        )
        assert resp.status == 200
        await resp.content.readuntil(b"\n\n")  # the stream is open
        gw.signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        # New connections are refused while the open stream drains.
        with pytest.raises(aiohttp.ClientConnectionError):
            async with session.get(f"{gw.url}/healthz", timeout=aiohttp.ClientTimeout(total=2)) as r:
                await r.read()
        rest = await resp.read()
    assert sse_payloads(rest)[-1] == b"[DONE]"
    assert await asyncio.to_thread(gw.wait, 30) == 0, gw.log()


async def test_sigterm_cuts_streams_that_outlive_the_grace_period(
    process_factory: Any, fake_factory: Any, api_key: str
) -> None:
    fake: FakeUpstream = await fake_factory(chunk_delay_ms=500)
    gw = await process_factory(env={"SHUTDOWN_GRACE_SECONDS": "1"}, config_yaml=config_for(fake.url))
    async with aiohttp.ClientSession() as session:
        resp = await session.post(
            f"{gw.url}/v1/chat/completions", json=chat_body("w " * 40, stream=True), headers=auth(api_key)
        )
        await resp.content.readuntil(b"\n\n")
        gw.signal(signal.SIGTERM)
        try:
            rest = await resp.read()
        except aiohttp.ClientPayloadError:
            rest = b""
    assert b"[DONE]" not in rest
    assert await asyncio.to_thread(gw.wait, 30) == 0, gw.log()
