"""The Messages ↔ chat mappings of gateway/protocols, as pure functions (the black-box
side is tests/test_messages.py and tests/test_anthropic.py)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.core.errors import CircuitOpen, InvalidRequest, RateLimited
from gateway.core.usage import Usage
from gateway.http.errors import anthropic_error_event, error_response, error_shape_for
from gateway.protocols.anthropic import (
    anthropic_usage,
    chat_usage,
    from_chat_completion,
    from_messages_request,
    to_anthropic_error,
)
from gateway.protocols.anthropic_stream import (
    EventsFromChunks,
    NativeStreamTap,
    StreamBroken,
    is_message_stop,
)


def _request(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "hi"}], **extra}


def test_a_messages_request_in_chat_terms() -> None:
    body = _request(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind.", "cache_control": {}}],
        messages=[
            {"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}},
                {"type": "image", "source": {"type": "url", "url": "https://example.test/cat.jpg"}},
            ]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "...", "signature": "s"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "look", "input": {"q": "cat", "n": [1, 2]}},
            ]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [{"type": "text", "text": "a cat"}]}]},
        ],
        stop_sequences=["END"], top_k=3, metadata={"user_id": "u"}, stream=True,
        tools=[{"name": "look", "input_schema": {"type": "object"}}], tool_choice={"type": "any"},
    )
    out = from_messages_request(body)
    assert out["messages"] == [
        {"role": "system", "content": "Be brief.\n\nBe kind."},
        {"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR"}},
            {"type": "image_url", "image_url": {"url": "https://example.test/cat.jpg"}},
        ]},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "look", "arguments": '{"q":"cat","n":[1,2]}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "a cat"},
    ]
    assert out["stop"] == ["END"] and out["top_k"] == 3 and out["user"] == "u" and out["stream"] is True
    assert out["tools"] == [{"type": "function", "function": {"name": "look", "parameters": {"type": "object"}}}]
    assert out["tool_choice"] == "required" and "parallel_tool_calls" not in out
    assert from_messages_request(_request(tools=body["tools"], tool_choice={"type": "none"}))["tool_choice"] == "none"


@pytest.mark.parametrize("bad", [
    {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
    {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
    {"tools": [{"name": "t"}], "tool_choice": {"type": "sometimes"}},
    {"stop_sequences": "END"},
    {"system": 7},
    {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "no id"}]}]},
])
def test_what_chat_cannot_express_is_a_400(bad: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest):
        from_messages_request(_request(**bad))


def test_a_chat_answer_as_a_message() -> None:
    answer = {"id": "chatcmpl-1", "model": "gpt-x", "choices": [{"index": 0, "finish_reason": "length", "message": {
        "role": "assistant", "content": "Partial", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 6}}}
    message = from_chat_completion(answer, model="asked")
    assert message == {
        "id": "chatcmpl-1", "type": "message", "role": "assistant", "model": "gpt-x",
        "content": [{"type": "text", "text": "Partial"},
                    {"type": "tool_use", "id": "call_1", "name": "f", "input": {"_raw": "{not json"}}],
        "stop_reason": "max_tokens", "stop_sequence": None,
        "usage": {"input_tokens": 4, "output_tokens": 4, "cache_read_input_tokens": 6},
    }
    for finish, stop in [("stop", "end_turn"), ("tool_calls", "tool_use"), ("content_filter", "refusal")]:
        answer["choices"][0]["finish_reason"] = finish  # type: ignore[index]
        assert from_chat_completion(answer, model="m")["stop_reason"] == stop


def test_usage_maps_back_and_forth() -> None:
    anthropic = {"input_tokens": 4, "output_tokens": 7, "cache_read_input_tokens": 6}
    chat = chat_usage(anthropic)
    assert chat["prompt_tokens"] == 10 and chat["completion_tokens"] == 7
    assert anthropic_usage(chat) == anthropic


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    return orjson.dumps({"id": "c1", "model": "gpt-x", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def _decoded(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if block:
            name, data = block.split("\n")
            out.append((name.removeprefix("event: "), orjson.loads(data.removeprefix("data: "))))
    return out


def test_chat_chunks_become_named_events_one_by_one() -> None:
    framer = EventsFromChunks(model="asked", input_tokens=5)
    first = _decoded(framer.feed(_chunk({"role": "assistant", "content": ""})))
    assert [n for n, _ in first] == ["message_start"]
    assert first[0][1]["message"]["usage"] == {"input_tokens": 5, "output_tokens": 0}
    assert first[0][1]["message"]["model"] == "gpt-x" and first[0][1]["message"]["id"] == "c1"
    text = _decoded(framer.feed(_chunk({"content": "Hi"})))
    assert text == [("content_block_start", {"type": "content_block_start", "index": 0,
                                             "content_block": {"type": "text", "text": ""}}),
                    ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                             "delta": {"type": "text_delta", "text": "Hi"}})]
    call = _decoded(framer.feed(_chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                         "function": {"name": "f", "arguments": '{"a"'}}]})))
    assert [n for n, _ in call] == ["content_block_stop", "content_block_start", "content_block_delta"]
    assert call[1][1]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "f", "input": {}}
    assert call[2][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"a"'}
    more = _decoded(framer.feed(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": ":1}"}}]}, "tool_calls")))
    assert more == [("content_block_delta", {"type": "content_block_delta", "index": 1,
                                             "delta": {"type": "input_json_delta", "partial_json": ":1}"}})]
    assert not framer.finished
    end = _decoded(framer.finish(Usage(prompt_tokens=12, completion_tokens=3)))
    assert end == [("content_block_stop", {"type": "content_block_stop", "index": 1}),
                   ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                                      "usage": {"input_tokens": 12, "output_tokens": 3}}),
                   ("message_stop", {"type": "message_stop"})]
    assert framer.finished
    with pytest.raises(StreamBroken):
        EventsFromChunks(model="m", input_tokens=0).feed(b"{oops")


def test_a_native_stream_is_read_on_the_way() -> None:
    tap = NativeStreamTap()
    tap.inspect(b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1","model":"c",'
                b'"usage":{"input_tokens":9,"output_tokens":1,"cache_read_input_tokens":3}}}\n\n')
    tap.inspect(b'event: ping\ndata: {"type":"ping"}\n\n')
    tap.inspect(b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"max_tokens"},'
                b'"usage":{"output_tokens":20}}\n\n')
    assert not tap.done
    stop = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    assert is_message_stop(stop) and not is_message_stop(b'event: ping\ndata: {"type":"ping"}\n\n')
    tap.inspect(stop)
    assert tap.done and tap.response_id == "msg_1" and tap.finish_reason == "length" and tap.chunks == 3
    usage = tap.usage()
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (12, 20)
    tap.inspect(b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"busy"}}\n\n')
    assert tap.error == "overloaded_error: busy"


def test_errors_in_anthropic_shape_on_the_messages_routes_only() -> None:
    assert error_shape_for("/v1/messages") == error_shape_for("/v1/messages/count_tokens") == "anthropic"
    assert error_shape_for("/v1/messagesx") == error_shape_for("/v1/chat/completions") == "openai"
    busy = error_response(CircuitOpen(retry_after=2.5), "anthropic")
    assert busy.status == 529 and busy.headers["Retry-After"] == "3"
    assert orjson.loads(busy.body) == {"type": "error", "error": {  # type: ignore[arg-type]
        "type": "overloaded_error", "message": "no healthy deployment for this model"}}
    limited = error_response(RateLimited(retry_after=1), "anthropic")
    assert limited.status == 429 and orjson.loads(limited.body)["error"]["type"] == "rate_limit_error"  # type: ignore[arg-type]
    assert error_response(RateLimited(), "openai").status == 429
    event = anthropic_error_event(CircuitOpen())
    assert event.startswith(b"event: error\ndata: ") and b'"overloaded_error"' in event
    assert orjson.loads(to_anthropic_error(402, b'{"error":{"message":"pay","type":"x"}}')) == {
        "type": "error", "error": {"type": "billing_error", "message": "pay"}}
    assert orjson.loads(to_anthropic_error(500, b"<html>"))["error"]["type"] == "api_error"
