"""The Anthropic provider: OpenAI requests to the Messages API and answers back, checked
with the official ``openai`` SDK as the client and the fake's Anthropic wire upstream."""

from __future__ import annotations

import json
from typing import Any

import openai
import orjson
import pytest

from gateway.core.errors import InvalidRequest
from gateway.providers.anthropic import DEFAULT_MAX_TOKENS, StreamTranslator, to_messages_request
from gateway.testing.fake_llm import anthropic_tool_use
from tests.conftest import FakeUpstream, Gateway, auth, chat_body, sse_payloads
from tests.fleet import fleet_config, records

TOOLS = [{
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the catalogue",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}]


@pytest.fixture
async def claude(fake_factory: Any) -> FakeUpstream:
    return await fake_factory()  # type: ignore[no-any-return]


@pytest.fixture
async def gw(gateway_factory: Any, claude: FakeUpstream) -> Gateway:
    base = claude.url[:-3]  # the provider's documented base URL has no /v1
    return await gateway_factory(config_yaml=fleet_config(  # type: ignore[no-any-return]
        {"claude": {"type": "anthropic", "base_url": base, "api_key": "sk-ant-secret"}},
        [{"name": "smart", "deployments": [{"provider": "claude", "model": "claude-sonnet-4-5"}]},
         {"name": "claude/*", "deployments": [{"provider": "claude", "model": "*"}]}]))


def sdk(gw: Gateway, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url("/v1"), api_key=key, max_retries=0)


async def last_upstream(fake: FakeUpstream) -> dict[str, Any]:
    return (await fake.stats())["last_request"]  # type: ignore[no-any-return]


# ----------------------------------------------------------------------------- requests
def test_request_translation() -> None:
    body = {
        "model": "claude-x",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": [{"type": "text", "text": "Use tools."}]},
            {"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                {"type": "image_url", "image_url": {"url": "https://example.test/cat.jpg"}},
            ]},
            {"role": "user", "content": "And search for it."},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"query": "cat", "n": [1, 2]}'}},
            ]},
            {"role": "tool", "tool_call_id": "call_1", "content": "a cat"},
        ],
        "stop": "END",
        "temperature": 0.2,
        "top_p": 0.9,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "user": "u-1",
        "presence_penalty": 0.5,
        "stream_options": {"include_usage": True},
    }
    out = to_messages_request(body, stream=True)
    assert out["system"] == "Be brief.\n\nUse tools."
    assert out["max_tokens"] == DEFAULT_MAX_TOKENS
    assert out["stop_sequences"] == ["END"]
    assert (out["temperature"], out["top_p"], out["stream"]) == (0.2, 0.9, True)
    assert out["tools"] == [{"name": "search", "description": "Search the catalogue",
                             "input_schema": TOOLS[0]["function"]["parameters"]}]
    assert out["tool_choice"] == {"type": "any", "disable_parallel_tool_use": True}
    assert out["metadata"] == {"user_id": "u-1"}
    assert "presence_penalty" not in out and "stream_options" not in out
    # Consecutive user turns merge; images become base64 and URL sources.
    assert [m["role"] for m in out["messages"]] == ["user", "assistant", "user"]
    assert out["messages"][0]["content"] == [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
        {"type": "image", "source": {"type": "url", "url": "https://example.test/cat.jpg"}},
        {"type": "text", "text": "And search for it."},
    ]
    assert out["messages"][1]["content"] == [
        {"type": "tool_use", "id": "call_1", "name": "search", "input": {"query": "cat", "n": [1, 2]}}]
    assert out["messages"][2]["content"] == [{"type": "tool_result", "tool_use_id": "call_1", "content": "a cat"}]
    assert to_messages_request({"model": "m", "messages": [], "max_completion_tokens": 7}, stream=False)["max_tokens"] == 7


def test_untranslatable_requests_are_400() -> None:
    def bad(**extra: Any) -> None:
        with pytest.raises(InvalidRequest):
            to_messages_request({"model": "m", "messages": [{"role": "user", "content": "x"}], **extra}, stream=False)

    bad(n=2)
    bad(messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}])
    bad(messages=[{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{oops"}}]}])
    bad(messages=[{"role": "tool", "content": "no id"}])


def test_stream_translation_of_an_error_event_is_a_provider_failure() -> None:
    from gateway.providers.base import UpstreamProtocolError

    translator = StreamTranslator(model="m", include_usage=False)
    event = b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"busy"}}\n\n'
    with pytest.raises(UpstreamProtocolError, match="overloaded_error: busy"):
        translator.feed(event)


# ----------------------------------------------------------------------------- with the SDK
async def test_non_streaming_tool_call_round_trip(gw: Gateway, claude: FakeUpstream, api_key: str) -> None:
    client = sdk(gw, api_key)
    calls = records(gw)
    messages: list[Any] = [{"role": "system", "content": "You are terse."},
                           {"role": "user", "content": "find blue cats"}]
    answer = await client.chat.completions.create(model="smart", messages=messages, tools=TOOLS, stop=["STOP"],
                                                  temperature=0.1)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Calling search."
    (call,) = choice.message.tool_calls or []
    expected_input = anthropic_tool_use(
        {"tools": [{"name": "search"}], "messages": [{"role": "user", "content": "find blue cats"}]}, message_id="x")
    assert expected_input is not None
    assert json.loads(call.function.arguments) == expected_input["input"]  # nested, non-ASCII, escapes intact
    assert call.function.name == "search" and call.id.startswith("toolu_")
    upstream = await last_upstream(claude)
    assert upstream["path"] == "/v1/messages"
    assert upstream["headers"]["x-api-key"] == "sk-ant-secret"
    assert upstream["headers"]["anthropic-version"] == "2023-06-01"
    assert api_key not in orjson.dumps(upstream).decode()
    sent = upstream["body"]
    assert sent["model"] == "claude-sonnet-4-5" and sent["system"] == "You are terse."
    assert sent["max_tokens"] == DEFAULT_MAX_TOKENS and sent["stop_sequences"] == ["STOP"]
    assert sent["tools"][0]["input_schema"] == TOOLS[0]["function"]["parameters"]
    # Usage mapped from input/output tokens, and recorded for billing.
    assert answer.usage is not None and answer.usage.prompt_tokens == calls[-1].usage.prompt_tokens > 0
    assert answer.usage.completion_tokens == calls[-1].usage.completion_tokens > 0
    # Second turn: the tool's result goes back; its arguments reach Anthropic unchanged.
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "three cats found"}]
    answer = await client.chat.completions.create(model="smart", messages=messages, tools=TOOLS)
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].message.content == "This is a mock answer to: three cats found"
    sent = (await last_upstream(claude))["body"]
    assert sent["messages"][1]["content"][1] == {"type": "tool_use", "id": call.id, "name": "search",
                                                  "input": expected_input["input"]}
    assert sent["messages"][2]["content"] == [{"type": "tool_result", "tool_use_id": call.id, "content": "three cats found"}]


async def test_streaming_tool_call_and_usage(gw: Gateway, claude: FakeUpstream, api_key: str) -> None:
    client = sdk(gw, api_key)
    stream = await client.chat.completions.create(
        model="smart", messages=[{"role": "user", "content": "find red dogs"}], tools=TOOLS, stream=True,
        stream_options={"include_usage": True})
    text, arguments, names, finish, usage = "", "", [], None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
            continue
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for call in delta.tool_calls or []:
            assert call.index == 0
            if call.function and call.function.name:
                names.append(call.function.name)
            arguments += (call.function.arguments or "") if call.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert text == "Calling search." and names == ["search"] and finish == "tool_calls"
    expected = anthropic_tool_use({"tools": [{"name": "search"}], "messages": [{"role": "user", "content": "find red dogs"}]},
                                  message_id="x")
    assert expected is not None and json.loads(arguments) == expected["input"]
    assert usage is not None and usage.prompt_tokens > 0 and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


async def test_streaming_text_without_usage_asked(gw: Gateway, claude: FakeUpstream, api_key: str) -> None:
    calls = records(gw)
    resp = await gw.data.post("/v1/chat/completions", json=chat_body("one two three", model="claude/claude-haiku", stream=True),
                              headers=auth(api_key))
    assert resp.status == 200
    raw = await resp.read()
    assert raw.endswith(b"data: [DONE]\n\n")
    chunks = [orjson.loads(p) for p in sse_payloads(raw) if p != b"[DONE]"]
    assert all(c["choices"] and "usage" not in c for c in chunks)  # no usage chunk, no usage: null
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "This is a mock answer to: one two three"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert (await last_upstream(claude))["body"]["model"] == "claude-haiku"
    # The gateway still learnt the usage (asked upstream, hidden from this client).
    assert calls[-1].usage.completion_tokens == 9 and not calls[-1].usage.estimated

    client = sdk(gw, api_key)
    stream = await client.chat.completions.create(model="smart", messages=[{"role": "user", "content": "hi"}],
                                                  stream=True, max_tokens=3)
    pieces = [c async for c in stream]
    assert pieces[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in pieces)


async def test_provider_errors_keep_status_in_openai_shape(gw: Gateway, claude: FakeUpstream, api_key: str) -> None:
    client = sdk(gw, api_key)
    await claude.script({"status": 400})
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(model="smart", messages=[{"role": "user", "content": "x"}])
    assert bad.value.status_code == 400
    assert bad.value.body == {"message": "fake failure", "type": "fake", "code": None}
    await claude.script({"status": 429, "retry_after": 60})
    with pytest.raises(openai.RateLimitError):
        await client.chat.completions.create(model="smart", messages=[{"role": "user", "content": "x"}])
    # Our own error for what Anthropic cannot take, in the contract's shape.
    with pytest.raises(openai.BadRequestError) as ours:
        await client.chat.completions.create(model="claude/x", messages=[{"role": "user", "content": "x"}], n=2)
    assert ours.value.body["type"] == "invalid_request_error"  # type: ignore[index]


async def test_stream_cut_before_message_stop_ends_with_an_error_event(gw: Gateway, claude: FakeUpstream, api_key: str) -> None:
    await claude.script({"cut_after_chunks": 4})
    resp = await gw.data.post("/v1/chat/completions", json=chat_body("a b c d e", model="smart", stream=True),
                              headers=auth(api_key))
    payloads = sse_payloads(await resp.read())
    assert b"[DONE]" not in payloads
    assert orjson.loads(payloads[-1])["error"]["code"] == "upstream_unavailable"
