"""The Gemini API behind the gateway: the mapping both ways (unit), and chat, streams,
tools, embeddings, safety blocks, throttling and failover through a running gateway
against the fake Gemini API (gateway/testing/fake_gemini.py), with the openai SDK."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import openai
import orjson
import pytest
from aiohttp.test_utils import TestServer

from gateway.core.errors import InvalidRequest
from gateway.protocols.gemini import StreamTranslator, to_chat_completion, to_generate_content
from gateway.testing.fake_gemini import GeminiFake, make_app
from tests.conftest import FakeUpstream, Gateway, auth, chat_body, sse_payloads
from tests.fleet import fleet_config, records

TOOLS = [{"type": "function", "function": {
    "name": "search", "description": "Search the catalogue",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]
PRICE = {"input_per_mtok": 0.3, "output_per_mtok": 2.5}


@pytest.fixture
async def gemini() -> AsyncIterator[tuple[GeminiFake, str]]:
    fake = GeminiFake()
    server = TestServer(make_app(fake), host="127.0.0.1")
    await server.start_server()
    yield fake, f"http://127.0.0.1:{server.port}"
    await server.close()


@pytest.fixture
async def gw(gateway_factory: Any, gemini: tuple[GeminiFake, str], fake: FakeUpstream) -> Gateway:
    _, url = gemini
    return await gateway_factory(config_yaml=fleet_config(  # type: ignore[no-any-return]
        {"google": {"type": "gemini", "base_url": url, "api_key": "gemini-key-1"}, "backup": fake},
        [{"name": "flash", "deployments": [{"provider": "google", "model": "gemini-2.5-flash", "price": PRICE}]},
         {"name": "embed", "deployments": [{"provider": "google", "model": "gemini-embedding-001"}]},
         {"name": "mixed", "deployments": [{"provider": "google", "model": "gemini-2.5-flash", "priority": 0},
                                           {"provider": "backup", "model": "m2", "priority": 1}]}]))


def sdk(gw: Gateway, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url("/v1"), api_key=key, max_retries=0)


# ----------------------------------------------------------------------------- mapping (unit)
def test_request_translation() -> None:
    out = to_generate_content({
        "model": "gemini-2.5-flash",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": [{"type": "text", "text": "Use tools."}]},
            {"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                {"type": "image_url", "image_url": {"url": "gs://bucket/cat.jpg"}}]},
            {"role": "user", "content": "And search for it."},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"query": "cat"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"hits": 3}'},
            {"role": "tool", "tool_call_id": "call_1", "content": "plain text"},
        ],
        "temperature": 0.2, "top_p": 0.9, "max_tokens": 50, "stop": "END", "seed": 7,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
        "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "search"}},
        "stream_options": {"include_usage": True}, "user": "u-1",
    })
    assert out["systemInstruction"] == {"parts": [{"text": "Be brief.\n\nUse tools."}]}
    assert [c["role"] for c in out["contents"]] == ["user", "model", "user"]
    assert out["contents"][0]["parts"] == [
        {"text": "What is this?"},
        {"inlineData": {"mimeType": "image/png", "data": "iVBORw0KGgo="}},
        {"fileData": {"fileUri": "gs://bucket/cat.jpg"}},
        {"text": "And search for it."}]
    assert out["contents"][1]["parts"] == [{"functionCall": {"name": "search", "args": {"query": "cat"}, "id": "call_1"}}]
    assert out["contents"][2]["parts"] == [
        {"functionResponse": {"id": "call_1", "name": "search", "response": {"hits": 3}}},
        {"functionResponse": {"id": "call_1", "name": "search", "response": {"result": "plain text"}}}]
    assert out["generationConfig"] == {
        "temperature": 0.2, "topP": 0.9, "seed": 7, "maxOutputTokens": 50, "stopSequences": ["END"],
        "responseMimeType": "application/json", "responseJsonSchema": {"type": "object"}}
    assert out["tools"] == [{"functionDeclarations": [{"name": "search", "description": "Search the catalogue",
                                                       "parametersJsonSchema": TOOLS[0]["function"]["parameters"]}]}]
    assert out["toolConfig"] == {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["search"]}}
    assert set(out) == {"contents", "systemInstruction", "generationConfig", "tools", "toolConfig"}


def test_untranslatable_requests_are_400() -> None:
    def bad(**extra: Any) -> None:
        with pytest.raises(InvalidRequest):
            to_generate_content({"model": "m", "messages": [{"role": "user", "content": "x"}], **extra})

    bad(n=2)
    bad(messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}])
    bad(messages=[{"role": "tool", "tool_call_id": "never-called", "content": "x"}])
    bad(messages=[{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{oops"}}]}])
    bad(response_format={"type": "json_schema", "json_schema": {}})


def test_answer_translation_usage_finish_reasons_and_stable_tool_ids() -> None:
    answer = {"candidates": [{"content": {"role": "model", "parts": [
        {"text": "thinking...", "thought": True}, {"text": "Calling."},
        {"functionCall": {"name": "search", "args": {"query": "x"}}}]}, "finishReason": "STOP"}],
        "usageMetadata": {"promptTokenCount": 10, "candidatesTokenCount": 4, "thoughtsTokenCount": 3,
                          "cachedContentTokenCount": 6, "totalTokenCount": 17},
        "modelVersion": "gemini-2.5-flash", "responseId": "r-1"}
    out = to_chat_completion(answer, model="flash", created=1)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Calling."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "search", "arguments": '{"query":"x"}'}
    assert out["usage"] == {"prompt_tokens": 10, "completion_tokens": 7, "total_tokens": 17,
                            "prompt_tokens_details": {"cached_tokens": 6}}
    assert to_chat_completion(answer, model="flash")["choices"][0]["message"]["tool_calls"][0]["id"] == call["id"]
    # The same call streamed gets the same id.
    translator = StreamTranslator(model="flash", include_usage=True)
    events = translator.feed(answer) + translator.close()
    streamed = [orjson.loads(e[6:]) for e in events[:-1]]
    ids = [tc["id"] for c in streamed for ch in c["choices"] for tc in ch["delta"].get("tool_calls", [])]
    assert ids == [call["id"]]
    assert streamed[-1]["usage"]["completion_tokens"] == 7
    capped = {"candidates": [{"content": {"parts": [{"text": "x"}]}, "finishReason": "MAX_TOKENS"}]}
    assert to_chat_completion(capped, model="m")["choices"][0]["finish_reason"] == "length"
    unsafe = {"candidates": [{"content": {"parts": []}, "finishReason": "SAFETY"}]}
    assert to_chat_completion(unsafe, model="m")["choices"][0]["finish_reason"] == "content_filter"


# ----------------------------------------------------------------------------- through the gateway
async def test_non_streaming_call_uses_gemini_urls_key_header_and_maps_usage(
    gw: Gateway, gemini: tuple[GeminiFake, str], api_key: str
) -> None:
    fake, _ = gemini
    answer = await sdk(gw, api_key).chat.completions.create(
        model="flash", messages=[{"role": "system", "content": "Terse."}, {"role": "user", "content": "hello gemini"}],
        temperature=0.1, max_tokens=20)
    assert answer.choices[0].message.content == "This is a mock answer to: hello gemini"
    assert answer.choices[0].finish_reason == "stop" and answer.model == "gemini-2.5-flash"
    assert answer.usage is not None and answer.usage.prompt_tokens > 0 and answer.usage.completion_tokens > 0
    (call,) = fake.state.model_calls()
    assert call.path == "/v1beta/models/gemini-2.5-flash:generateContent"
    assert call.headers["x-goog-api-key"] == "gemini-key-1" and "authorization" not in call.headers
    assert call.body["systemInstruction"] == {"parts": [{"text": "Terse."}]}
    assert call.body["generationConfig"] == {"temperature": 0.1, "maxOutputTokens": 20}


async def test_stream_is_translated_chunk_by_chunk_and_billed(
    gw: Gateway, gemini: tuple[GeminiFake, str], api_key: str, db_pool: asyncpg.Pool
) -> None:
    fake, _ = gemini
    request_id = f"gem-{uuid.uuid4().hex[:10]}"
    resp = await gw.data.post("/v1/chat/completions",
                              json=chat_body("stream four words", model="flash", stream=True),
                              headers={**auth(api_key), "x-request-id": request_id})
    assert resp.status == 200
    payloads = sse_payloads(await resp.read())
    assert payloads[-1] == b"[DONE]"
    chunks = [orjson.loads(p) for p in payloads[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == "This is a mock answer to: stream four words"
    assert len([c for c in chunks if c["choices"][0]["delta"].get("content")]) == 9  # word by word
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert not any(c.get("usage") for c in chunks)  # the client did not ask for usage
    call = fake.state.model_calls()[-1]
    assert call.path == "/v1beta/models/gemini-2.5-flash:streamGenerateContent" and call.query == {"alt": "sse"}
    assert await gw.state.billing.flush()
    row = await db_pool.fetchrow("SELECT * FROM usage_ledger WHERE request_id = $1", request_id)
    assert row["provider"] == "google" and row["streamed"] and not row["usage_estimated"]
    assert row["completion_tokens"] == 9 and row["prompt_tokens"] == 3
    assert row["cost_source"] == "price" and row["cost_usd"] > 0


async def test_tool_call_round_trip_with_stable_ids(gw: Gateway, gemini: tuple[GeminiFake, str], api_key: str) -> None:
    fake, _ = gemini
    client = sdk(gw, api_key)
    messages: list[Any] = [{"role": "user", "content": "find blue cats"}]
    first = await client.chat.completions.create(model="flash", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "search" and json.loads(call.function.arguments) == {"query": "find blue cats",
                                                                                       "n": [1, 2]}
    assert call.id.startswith("call_")
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"cats": 2}'}]
    second = await client.chat.completions.create(model="flash", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
    assert second.choices[0].message.content == 'Tool said: {"cats":2}'
    sent = fake.state.model_calls()[-1].body["contents"]
    assert sent[1] == {"role": "model", "parts": [{"functionCall": {"name": "search", "args": {
        "query": "find blue cats", "n": [1, 2]}, "id": call.id}}]}
    assert sent[2]["parts"] == [{"functionResponse": {"id": call.id, "name": "search", "response": {"cats": 2}}}]


async def test_streamed_tool_call(gw: Gateway, api_key: str) -> None:
    stream = await sdk(gw, api_key).chat.completions.create(
        model="flash", messages=[{"role": "user", "content": "look up"}], tools=TOOLS, stream=True)  # type: ignore[arg-type]
    calls, finish = [], None
    async for chunk in stream:
        for choice in chunk.choices:
            calls += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert [c.function.name for c in calls if c.function] == ["search"]


async def test_safety_block_is_a_clear_400_whole_and_streamed(gw: Gateway, api_key: str) -> None:
    for stream in (False, True):
        resp = await gw.data.post("/v1/chat/completions", json=chat_body("BLOCKME now", model="mixed", stream=stream),
                                  headers=auth(api_key))
        assert resp.status == 400, await resp.text()
        error = (await resp.json())["error"]
        assert error["code"] == "content_filter" and "Gemini blocked the prompt (SAFETY)" in error["message"]


async def test_429_with_retry_info_cools_gemini_and_fails_over_to_another_vendor(
    gw: Gateway, gemini: tuple[GeminiFake, str], api_key: str
) -> None:
    fake, _ = gemini
    calls = records(gw)
    fake.state.script.append({"status": 429, "retry_delay": "40s"})
    client = sdk(gw, api_key)
    first = await client.chat.completions.create(model="mixed", messages=[{"role": "user", "content": "1"}])
    second = await client.chat.completions.create(model="mixed", messages=[{"role": "user", "content": "2"}])
    assert first.model == second.model == "m2"
    assert len(fake.state.model_calls()) == 1  # cooled for 40 s: the second went straight to the backup
    assert calls[0].failovers == 1 and calls[0].provider == "backup"


async def test_one_input_embeds_via_embed_content(gw: Gateway, gemini: tuple[GeminiFake, str], api_key: str) -> None:
    fake, _ = gemini
    answer = await sdk(gw, api_key).embeddings.create(model="embed", input="solo")
    assert [d.index for d in answer.data] == [0] and len(answer.data[0].embedding) == 8
    call = fake.state.model_calls()[-1]
    assert call.path == "/v1beta/models/gemini-embedding-001:embedContent"
    assert call.body == {"model": "models/gemini-embedding-001", "content": {"parts": [{"text": "solo"}]}}


async def test_embeddings_via_batch_embed_contents(gw: Gateway, gemini: tuple[GeminiFake, str], api_key: str) -> None:
    fake, _ = gemini
    answer = await sdk(gw, api_key).embeddings.create(model="embed", input=["alpha", "beta"], dimensions=8)
    assert [d.index for d in answer.data] == [0, 1] and len(answer.data[0].embedding) == 8
    assert answer.data[0].embedding != answer.data[1].embedding
    assert answer.usage.prompt_tokens == 2
    call = fake.state.model_calls()[-1]
    assert call.path == "/v1beta/models/gemini-embedding-001:batchEmbedContents"
    assert call.body["requests"][0] == {"model": "models/gemini-embedding-001", "outputDimensionality": 8,
                                        "content": {"parts": [{"text": "alpha"}]}}


async def test_a_bad_gemini_key_is_an_authentication_error(
    gateway_factory: Any, gemini: tuple[GeminiFake, str], api_key: str
) -> None:
    _, url = gemini
    gw = await gateway_factory(config_yaml=fleet_config(
        {"google": {"type": "gemini", "base_url": url, "api_key": "stale"}},
        [{"name": "flash", "deployments": [{"provider": "google", "model": "gemini-2.5-flash"}]}]))
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="flash"), headers=auth(api_key))
    assert resp.status == 400  # Google's own status for a bad key, kept
    error = (await resp.json())["error"]
    assert error["code"] == "invalid_api_key" and "API key not valid" in error["message"]
