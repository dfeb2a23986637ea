"""``POST /v1/completions`` (OpenAI's legacy completions) through chat translation,
driven by the official ``openai`` SDK against the fake upstream over loopback."""

from __future__ import annotations

from typing import Any

import openai
import orjson
import pytest

from gateway.core.errors import InvalidRequest
from gateway.protocols.completions import from_completions_request, to_text_completion_chunk
from tests.conftest import FakeUpstream, Gateway, auth, sse_payloads
from tests.fleet import records


def sdk(gw: Gateway, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url("/v1"), api_key=key, max_retries=0)


async def test_a_whole_completion(gateway: Gateway, fake: FakeUpstream, api_key: str, db_pool: Any) -> None:
    calls = records(gateway)
    answer = await sdk(gateway, api_key).completions.create(
        model="gpt-x", prompt="Say hello there", temperature=0, stop=["\n"],
        extra_headers={"x-request-id": "cmpl-whole-1"})
    assert answer.object == "text_completion"
    assert answer.choices[0].text == "This is a mock answer to: Say hello there"
    assert answer.choices[0].finish_reason == "stop" and answer.choices[0].index == 0
    assert answer.usage is not None and answer.usage.prompt_tokens == calls[-1].usage.prompt_tokens > 0
    sent = (await fake.stats())["last_request"]
    assert sent["path"] == "/v1/chat/completions"
    assert sent["body"]["messages"] == [{"role": "user", "content": "Say hello there"}]
    assert sent["body"]["max_tokens"] == 16 and sent["body"]["stop"] == ["\n"] and sent["body"]["temperature"] == 0
    assert await gateway.state.billing.flush()
    row = await db_pool.fetchrow("SELECT * FROM usage_ledger WHERE request_id = 'cmpl-whole-1'")
    assert row["protocol"] == "completions" and row["completion_tokens"] == answer.usage.completion_tokens


async def test_a_streamed_completion(gateway: Gateway, api_key: str) -> None:
    calls = records(gateway)
    stream = await sdk(gateway, api_key).completions.create(
        model="gpt-x", prompt=["one two three"], max_tokens=50, stream=True, stream_options={"include_usage": True})
    text, finish, usage = "", None, None
    async for chunk in stream:
        assert chunk.object == "text_completion"
        if chunk.usage is not None:
            usage = chunk.usage
            continue
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    assert text == "This is a mock answer to: one two three" and finish == "stop"
    assert usage is not None and usage.completion_tokens == calls[-1].usage.completion_tokens > 0
    # Without include_usage no usage chunk reaches the client; the ledger still has the counts.
    resp = await gateway.data.post("/v1/completions", json={"model": "gpt-x", "prompt": "a b", "stream": True},
                                   headers=auth(api_key))
    payloads = sse_payloads(await resp.read())
    assert payloads[-1] == b"[DONE]"
    chunks = [orjson.loads(p) for p in payloads[:-1]]
    assert all(c["choices"] and "usage" not in c for c in chunks)
    assert calls[-1].usage.completion_tokens > 0 and not calls[-1].usage.estimated


async def test_a_cut_stream_ends_with_one_error_event(gateway: Gateway, fake: FakeUpstream, api_key: str) -> None:
    await fake.script({"cut_after_chunks": 3})
    resp = await gateway.data.post("/v1/completions", json={"model": "m", "prompt": "a b c d e", "stream": True},
                                   headers=auth(api_key))
    payloads = sse_payloads(await resp.read())
    assert b"[DONE]" not in payloads
    assert orjson.loads(payloads[-1])["error"]["code"] == "upstream_unavailable"


async def test_what_chat_cannot_do_is_a_400_in_the_contract_shape(gateway: Gateway, api_key: str) -> None:
    client = sdk(gateway, api_key)
    for extra in ({"prompt": ["one", "two"]}, {"prompt": "x", "echo": True}, {"prompt": "x", "suffix": "y"},
                  {"prompt": [1, 2, 3]}):
        with pytest.raises(openai.BadRequestError) as bad:
            await client.completions.create(model="m", **extra)  # type: ignore[call-overload]
        assert bad.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(openai.AuthenticationError):
        await sdk(gateway, "llmg_wrong_key_0000000000").completions.create(model="m", prompt="x")


def test_the_mapping() -> None:
    body = from_completions_request({"model": "m", "prompt": "p", "max_tokens": 5, "n": 2, "seed": 1, "best_of": 1})
    assert body == {"model": "m", "messages": [{"role": "user", "content": "p"}], "max_tokens": 5, "n": 2, "seed": 1}
    with pytest.raises(InvalidRequest):
        from_completions_request({"model": "m", "prompt": "p", "best_of": 3})
    role_only = orjson.dumps({"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                      "finish_reason": None}]})
    assert to_text_completion_chunk(role_only) is None
    piece = to_text_completion_chunk(orjson.dumps({"id": "c", "created": 1, "model": "m", "choices": [
        {"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]}))
    assert piece is not None and orjson.loads(piece[6:]) == {"id": "c", "object": "text_completion", "created": 1,
                                                             "model": "m", "choices": [{"text": "Hi", "index": 0,
                                                                                        "logprobs": None,
                                                                                        "finish_reason": None}]}
