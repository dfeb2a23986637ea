"""The chat handler's hot path: behaviour kept while it was made cheaper (see bench/)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson

from tests.conftest import FakeUpstream, Gateway, auth, chat_body


async def test_a_body_arriving_in_pieces_is_read_whole(gateway: Gateway, fake: FakeUpstream, api_key: str) -> None:
    raw = orjson.dumps(chat_body("x " * 100_000))

    async def pieces() -> AsyncIterator[bytes]:
        for start in range(0, len(raw), 16_384):
            yield raw[start:start + 16_384]
            await asyncio.sleep(0.005)

    resp = await gateway.data.post(
        "/v1/chat/completions", data=pieces(),
        headers={**auth(api_key), "Content-Type": "application/json", "Content-Length": str(len(raw))},
    )
    assert resp.status == 200, await resp.text()
    stats = await fake.stats()
    assert stats["last_request"]["body"]["messages"][0]["content"] == "x " * 100_000
