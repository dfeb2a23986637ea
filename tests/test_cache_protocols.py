"""The response cache on every generation route: Anthropic Messages and legacy completions
are stored in the internal chat shape and rendered by their own adapter on a hit, whole
and streamed, without calling the provider; a redacted stream is stored redacted."""

from __future__ import annotations

from typing import Any

import anthropic
import orjson
import yaml

from tests.cache_helpers import cached_config, settle, upstream_calls
from tests.conftest import FakeUpstream, Gateway, auth, sse_payloads


def _messages(text: str = "what is a cache", **extra: Any) -> dict[str, Any]:
    # The SDK (2.14) takes temperature only through extra_body; 0 makes the call cacheable.
    return {"model": "cached", "max_tokens": 50, "extra_body": {"temperature": 0},
            "messages": [{"role": "user", "content": text}], **extra}


async def test_anthropic_messages_hit_the_cache_whole_and_streamed(
    gateway_factory: Any, fake: FakeUpstream, api_key: str
) -> None:
    gw: Gateway = await gateway_factory(config_yaml=cached_config(fake.url))
    client = anthropic.AsyncAnthropic(base_url=gw.url(""), api_key=api_key, max_retries=0)
    first = await client.messages.with_raw_response.create(**_messages())
    assert first.headers["x-gateway-cache"] == "miss"
    await settle(gw, 1)
    second = await client.messages.with_raw_response.create(**_messages())
    assert second.headers["x-gateway-cache"] == "hit"
    one, two = await first.parse(), await second.parse()
    assert two.type == "message" and two.content[0].text == one.content[0].text  # type: ignore[union-attr]
    assert two.usage.input_tokens == one.usage.input_tokens and two.stop_reason == one.stop_reason
    assert await upstream_calls(fake) == 1

    # Streamed: stored once complete, then replayed as Anthropic's named events.
    async with client.messages.stream(**_messages("stream me")) as stream:
        live = await stream.get_final_message()
    await settle(gw, 2)
    raw_body = {k: v for k, v in _messages("stream me").items() if k != "extra_body"}
    resp = await gw.data.post("/v1/messages", json={**raw_body, "temperature": 0, "stream": True},
                              headers={"x-api-key": api_key})
    assert resp.headers["x-gateway-cache"] == "hit"
    raw = await resp.read()
    names = [line[7:] for line in raw.split(b"\n") if line.startswith(b"event: ")]
    assert names[0] == b"message_start" and names[-1] == b"message_stop"
    text = "".join(
        d["delta"]["text"] for d in (orjson.loads(p) for p in sse_payloads(raw))
        if d.get("type") == "content_block_delta" and d["delta"].get("type") == "text_delta"
    )
    assert text == live.content[0].text  # type: ignore[union-attr]
    assert await upstream_calls(fake) == 2


async def test_completions_hit_the_cache(gateway_factory: Any, fake: FakeUpstream, api_key: str) -> None:
    gw: Gateway = await gateway_factory(config_yaml=cached_config(fake.url))
    body = {"model": "cached", "prompt": "say something", "temperature": 0, "max_tokens": 20}
    first = await gw.data.post("/v1/completions", json=body, headers=auth(api_key))
    assert first.headers["x-gateway-cache"] == "miss"
    await settle(gw, 1)
    second = await gw.data.post("/v1/completions", json=body, headers=auth(api_key))
    assert second.headers["x-gateway-cache"] == "hit"
    assert (await second.json())["choices"][0]["text"] == (await first.json())["choices"][0]["text"]
    assert await upstream_calls(fake) == 1


async def test_a_redacted_stream_is_stored_redacted(gateway_factory: Any, fake_factory: Any, api_key: str) -> None:
    fake: FakeUpstream = await fake_factory(chunks=8)
    doc = yaml.safe_load(cached_config(fake.url))
    doc["models"][0]["guardrails"] = ["mask"]
    doc["guardrails"] = {"policies": {"mask": {"type": "pii", "mode": "redact", "direction": "output"}}}
    gw: Gateway = await gateway_factory(config_yaml=yaml.safe_dump(doc))
    body = {"model": "cached", "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "card 4111 1111 1111 1111 now"}]}
    live = await (await gw.data.post("/v1/chat/completions", json=body, headers=auth(api_key))).read()
    await settle(gw, 1)
    hit = await gw.data.post("/v1/chat/completions", json=body, headers=auth(api_key))
    assert hit.headers["x-gateway-cache"] == "hit"
    replayed = await hit.read()
    for raw in (live, replayed):
        assert b"4111" not in raw and b"[REDACTED:card_number]" in raw
