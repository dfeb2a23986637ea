"""``POST /v1/messages`` and ``/v1/messages/count_tokens``, driven by the official
``anthropic`` SDK through a running gateway, against the fake upstream over loopback:
translated to an OpenAI-wire deployment, and passed through to an Anthropic one."""

from __future__ import annotations

import asyncio
import json
from decimal import Decimal
from typing import Any

import anthropic
import orjson
import pytest

from gateway.testing.fake_llm import anthropic_input_tokens, anthropic_tool_use
from tests.conftest import FakeUpstream, Gateway, auth, chat_body
from tests.fleet import dead_url, fleet_config, records

TOOLS: list[Any] = [{
    "name": "search",
    "description": "Search the catalogue",
    "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
}]


@pytest.fixture
async def oai(fake_factory: Any) -> FakeUpstream:
    return await fake_factory()  # type: ignore[no-any-return]


@pytest.fixture
async def claude(fake_factory: Any) -> FakeUpstream:
    return await fake_factory()  # type: ignore[no-any-return]


def _config(oai: FakeUpstream, claude: FakeUpstream, **extra: Any) -> str:
    return fleet_config(
        {"oai": {"type": "openai", "base_url": oai.url, "api_key": "sk-oai-secret"},
         "claude": {"type": "anthropic", "base_url": claude.url[:-3], "api_key": "sk-ant-secret"},
         "dead": {"type": "openai", "base_url": dead_url(), "api_key": "sk-dead"}},
        [{"name": "gpt", "deployments": [{"provider": "oai", "model": "gpt-x"}]},
         {"name": "smart", "deployments": [{"provider": "claude", "model": "claude-sonnet-4-5"}]},
         {"name": "mixed", "deployments": [{"provider": "oai", "model": "gpt-x", "priority": 0},
                                           {"provider": "claude", "model": "claude-haiku", "priority": 1}]},
         {"name": "down", "deployments": [{"provider": "dead", "model": "x"}]}],
        **extra)


@pytest.fixture
async def gw(gateway_factory: Any, oai: FakeUpstream, claude: FakeUpstream) -> Gateway:
    return await gateway_factory(config_yaml=_config(  # type: ignore[no-any-return]
        oai, claude, circuit_breaker={"fail_max": 1, "reset_timeout_seconds": 60}))


def sdk(gw: Gateway, key: str, **kw: Any) -> anthropic.AsyncAnthropic:
    # The SDK appends /v1/messages itself: the base is the gateway's root, as
    # ANTHROPIC_BASE_URL=http://localhost:3000 is for Claude Code.
    return anthropic.AsyncAnthropic(base_url=gw.url(""), api_key=key, max_retries=0, **kw)


async def last_upstream(fake: FakeUpstream) -> dict[str, Any]:
    return (await fake.stats())["last_request"]  # type: ignore[no-any-return]


async def ledger_row(gw: Gateway, db_pool: Any, request_id: str) -> Any:
    assert await gw.state.billing.flush()
    rows = await db_pool.fetch("SELECT * FROM usage_ledger WHERE request_id = $1", request_id)
    assert len(rows) == 1, rows
    return rows[0]


def sse_events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each event of a raw Messages stream."""
    out = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


# ----------------------------------------------------------------------------- translated
async def test_a_whole_message_through_an_openai_deployment(
    gw: Gateway, oai: FakeUpstream, api_key: str, db_pool: Any
) -> None:
    calls = records(gw)
    message = await sdk(gw, api_key).messages.create(
        model="gpt", max_tokens=100, system=[{"type": "text", "text": "You are terse."}],
        messages=[{"role": "user", "content": "hello there"}], stop_sequences=["END"],
        metadata={"user_id": "u-1"}, extra_headers={"x-request-id": "msg-whole-1"},
        extra_body={"temperature": 0.1, "top_p": 0.9})  # sampling fields this SDK no longer types
    assert message.type == "message" and message.role == "assistant"
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == "This is a mock answer to: hello there"  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.model == "gpt-x"
    upstream = await last_upstream(oai)
    assert upstream["path"] == "/v1/chat/completions"
    assert upstream["headers"]["authorization"] == "Bearer sk-oai-secret" and api_key not in orjson.dumps(upstream).decode()
    sent = upstream["body"]
    assert sent["messages"] == [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello there"}]
    assert sent["stop"] == ["END"] and sent["max_tokens"] == 100 and sent["user"] == "u-1"
    assert sent["temperature"] == 0.1 and sent["top_p"] == 0.9 and "stream" not in sent
    # The upstream's counts, mapped back, and the same in the record and the ledger.
    assert message.usage.input_tokens == calls[-1].usage.prompt_tokens > 0
    assert message.usage.output_tokens == calls[-1].usage.completion_tokens > 0
    row = await ledger_row(gw, db_pool, "msg-whole-1")
    assert row["protocol"] == "anthropic" and row["provider"] == "oai" and row["streamed"] is False
    assert (row["prompt_tokens"], row["completion_tokens"]) == (message.usage.input_tokens, message.usage.output_tokens)
    assert row["usage_estimated"] is False


async def test_a_stream_through_an_openai_deployment_is_reframed_event_by_event(
    gw: Gateway, oai: FakeUpstream, api_key: str, db_pool: Any
) -> None:
    async with sdk(gw, api_key).messages.stream(
        model="gpt", max_tokens=100, messages=[{"role": "user", "content": "one two three four"}],
        extra_headers={"x-request-id": "msg-stream-1"},
    ) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.content[0].text == "This is a mock answer to: one two three four"  # type: ignore[union-attr]
    assert final.stop_reason == "end_turn"
    row = await ledger_row(gw, db_pool, "msg-stream-1")
    assert row["protocol"] == "anthropic" and row["streamed"] is True and row["usage_estimated"] is False
    assert (row["prompt_tokens"], row["completion_tokens"]) == (final.usage.input_tokens, final.usage.output_tokens)
    assert row["completion_tokens"] > 0
    # The wire itself, in Anthropic's documented order; the gateway asked for usage upstream.
    resp = await gw.data.post("/v1/messages", json={"model": "gpt", "max_tokens": 50, "stream": True,
                                                    "messages": [{"role": "user", "content": "a b"}]},
                              headers={"x-api-key": api_key})
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(await resp.read())
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[1] == "content_block_start"
    assert set(names[2:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert all(name == data["type"] for name, data in events)
    assert events[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] > 0
    assert (await last_upstream(oai))["body"]["stream_options"] == {"include_usage": True}


async def test_tools_both_ways_through_an_openai_deployment(gw: Gateway, oai: FakeUpstream, api_key: str) -> None:
    client = sdk(gw, api_key)
    expected = anthropic_tool_use({"tools": [{"name": "search"}], "messages": [{"role": "user", "content": "find blue cats"}]},
                                  message_id="x")
    assert expected is not None
    turn: list[Any] = [{"role": "user", "content": "find blue cats"}]
    message = await client.messages.create(model="gpt", max_tokens=100, messages=turn, tools=TOOLS,
                                           tool_choice={"type": "tool", "name": "search", "disable_parallel_tool_use": True})
    assert message.stop_reason == "tool_use"
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "search" and block.input == expected["input"]
    sent = (await last_upstream(oai))["body"]
    assert sent["tools"] == [{"type": "function", "function": {
        "name": "search", "description": "Search the catalogue", "parameters": TOOLS[0]["input_schema"]}}]
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "search"}}
    assert sent["parallel_tool_calls"] is False
    # The result goes back with the call's id; the assistant's call is the chat tool_calls.
    turn += [{"role": "assistant", "content": [b.model_dump() for b in message.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "three cats"},
                                          {"type": "text", "text": "thanks"}]}]
    message = await client.messages.create(model="gpt", max_tokens=100, messages=turn, tools=TOOLS)
    assert message.stop_reason == "end_turn"
    sent = (await last_upstream(oai))["body"]
    assert sent["messages"][1]["tool_calls"] == [{"id": block.id, "type": "function", "function": {
        "name": "search", "arguments": orjson.dumps(expected["input"]).decode()}}]
    assert sent["messages"][2] == {"role": "tool", "tool_call_id": block.id, "content": "three cats"}
    assert sent["messages"][3] == {"role": "user", "content": "thanks"}
    # Streamed: the call arrives as a tool_use block whose input_json_delta pieces add up.
    async with client.messages.stream(model="gpt", max_tokens=100, tools=TOOLS,
                                      messages=[{"role": "user", "content": "find blue cats"}]) as stream:
        final = await stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["tool_use"] and final.content[0].input == expected["input"]  # type: ignore[union-attr]


async def test_a_block_no_chat_deployment_takes_is_a_400_in_anthropic_shape(gw: Gateway, api_key: str) -> None:
    document = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}
    with pytest.raises(anthropic.BadRequestError) as bad:
        await sdk(gw, api_key).messages.create(model="gpt", max_tokens=10,
                                               messages=[{"role": "user", "content": [document]}])
    assert bad.value.body["type"] == "error"  # type: ignore[index]
    assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "document" in bad.value.body["error"]["message"]  # type: ignore[index]


async def test_a_block_only_anthropic_takes_goes_to_the_groups_anthropic_deployment(
    gw: Gateway, oai: FakeUpstream, claude: FakeUpstream, api_key: str
) -> None:
    document = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}
    message = await sdk(gw, api_key).messages.create(model="mixed", max_tokens=10, messages=[
        {"role": "user", "content": [document, {"type": "text", "text": "summarise"}]}])
    assert message.type == "message"
    assert (await oai.stats())["requests"] == 0
    assert (await last_upstream(claude))["body"]["messages"][0]["content"][0] == document


# ----------------------------------------------------------------------------- passthrough
async def test_passthrough_to_an_anthropic_deployment_changes_only_model_and_key(
    gw: Gateway, claude: FakeUpstream, api_key: str, db_pool: Any
) -> None:
    system = [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]
    history = [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "sig=="},
                                          {"type": "text", "text": "hi"}]},
        {"role": "user", "content": "tell me more"},
    ]
    message = await sdk(gw, api_key).messages.create(
        model="smart", max_tokens=64, system=system, messages=history,  # type: ignore[arg-type]
        thinking={"type": "enabled", "budget_tokens": 1024}, extra_body={"top_k": 5},
        extra_headers={"anthropic-beta": "prompt-caching-2024-07-31", "anthropic-version": "2023-06-01",
                       "x-request-id": "msg-native-1"})
    upstream = await last_upstream(claude)
    assert upstream["path"] == "/v1/messages"
    assert upstream["body"] == {"model": "claude-sonnet-4-5", "max_tokens": 64, "system": system,
                                "messages": history, "thinking": {"type": "enabled", "budget_tokens": 1024},
                                "top_k": 5}
    assert upstream["headers"]["x-api-key"] == "sk-ant-secret"
    assert upstream["headers"]["anthropic-beta"] == "prompt-caching-2024-07-31"
    assert upstream["headers"]["anthropic-version"] == "2023-06-01"  # the client's own, forwarded
    assert api_key not in orjson.dumps(upstream).decode()
    assert message.id.startswith("msg_fake_") and message.model == "claude-sonnet-4-5"
    assert message.content[0].text == "This is a mock answer to: tell me more"  # type: ignore[union-attr]
    row = await ledger_row(gw, db_pool, "msg-native-1")
    assert row["protocol"] == "anthropic" and row["provider"] == "claude"
    assert row["prompt_tokens"] == message.usage.input_tokens == anthropic_input_tokens(upstream["body"])
    assert row["completion_tokens"] == message.usage.output_tokens > 0
    assert row["response_id"] == message.id and row["finish_reason"] == "stop"


async def test_a_passthrough_stream_is_relayed_unchanged(
    gw: Gateway, claude: FakeUpstream, api_key: str, db_pool: Any
) -> None:
    body = {"model": "smart", "max_tokens": 50, "stream": True, "tools": TOOLS,
            "messages": [{"role": "user", "content": "find red dogs"}]}
    resp = await gw.data.post("/v1/messages", json=body, headers={"x-api-key": api_key, "x-request-id": "msg-native-2"})
    assert resp.status == 200
    events = sse_events(await resp.read())
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-1] == "message_stop" and "ping" in names
    deltas = "".join(d["delta"]["partial_json"] for n, d in events if n == "content_block_delta"
                     and d["delta"]["type"] == "input_json_delta")
    expected = anthropic_tool_use({"tools": TOOLS, "messages": body["messages"]}, message_id="x")
    assert expected is not None and json.loads(deltas) == expected["input"]
    row = await ledger_row(gw, db_pool, "msg-native-2")
    usage = events[-2][1]["usage"]
    assert row["completion_tokens"] == usage["output_tokens"] and row["finish_reason"] == "tool_calls"
    assert row["prompt_tokens"] == events[0][1]["message"]["usage"]["input_tokens"] > 0
    assert row["usage_estimated"] is False and row["streamed"] is True


# ----------------------------------------------------------------------------- errors
async def test_each_error_class_in_anthropic_shape(
    gw: Gateway, oai: FakeUpstream, claude: FakeUpstream, key_factory: Any, api_key: str
) -> None:
    ask: dict[str, Any] = {"max_tokens": 10, "messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(anthropic.AuthenticationError) as unauth:
        await sdk(gw, "llmg_wrong_key_0000000000").messages.create(model="gpt", **ask)
    assert unauth.value.body == {"type": "error", "error": {"type": "authentication_error", "message": "invalid API key"}}
    limited_key, _ = await key_factory(allowed_models=("gpt",))
    with pytest.raises(anthropic.PermissionDeniedError) as denied:
        await sdk(gw, limited_key).messages.create(model="smart", **ask)
    assert denied.value.body["error"]["type"] == "permission_error"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError) as missing:
        await sdk(gw, api_key).messages.create(model="no-such-model", **ask)
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    resp = await gw.data.post("/v1/messages", json={"model": "gpt", "messages": ask["messages"]},
                              headers={"x-api-key": api_key})
    assert resp.status == 400
    assert (await resp.json())["error"] == {"type": "invalid_request_error",
                                            "message": "max_tokens: Field required (a positive integer)"}
    resp = await gw.data.post("/v1/messages", data=b"{not json", headers={"x-api-key": api_key})
    assert resp.status == 400 and (await resp.json())["type"] == "error"
    huge = {"model": "gpt", **ask, "system": "x" * (gw.state.settings.body_limit + 10)}
    with pytest.raises(anthropic.RequestTooLargeError) as large:
        await sdk(gw, api_key).messages.create(**huge)
    assert large.value.body["error"]["type"] == "request_too_large"  # type: ignore[index]
    # The provider's own errors keep their status, in Anthropic's shape (a 503 is Anthropic's 529).
    await oai.script({"status": 400})
    with pytest.raises(anthropic.BadRequestError) as upstream_bad:
        await sdk(gw, api_key).messages.create(model="gpt", **ask)
    assert upstream_bad.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message": "fake failure"}}
    await oai.script({"status": 503}, {"status": 503}, {"status": 503})
    with pytest.raises(anthropic.OverloadedError) as busy:
        await sdk(gw, api_key).messages.create(model="gpt", **ask)
    assert busy.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
    await claude.script({"status": 529}, {"status": 529}, {"status": 529})  # every attempt: retries count once
    with pytest.raises(anthropic.OverloadedError):
        await sdk(gw, api_key).messages.create(model="smart", **ask)
    # The gateway's own: an unreachable upstream (api_error), then its open circuit (529).
    with pytest.raises(anthropic.InternalServerError) as unreachable:
        await sdk(gw, api_key).messages.create(model="down", **ask)
    assert unreachable.value.status_code == 502 and unreachable.value.body["error"]["type"] == "api_error"  # type: ignore[index]
    with pytest.raises(anthropic.OverloadedError) as circuit:
        await sdk(gw, api_key).messages.create(model="down", **ask)
    assert circuit.value.response.headers["retry-after"]


async def test_rate_limits_are_429_rate_limit_error_with_retry_after(gw: Gateway, key_factory: Any) -> None:
    # An hour's window: the memory sliding window is aligned to the clock, and two calls
    # on either side of a minute's edge would both fit (the library floors the previous
    # window's weighted count).
    key, _ = await key_factory(rate_limit_requests=1, rate_limit_window_seconds=3600)
    ask: dict[str, Any] = {"model": "gpt", "max_tokens": 10, "messages": [{"role": "user", "content": "x"}]}
    raw = await sdk(gw, key).messages.with_raw_response.create(**ask)
    assert raw.headers["x-ratelimit-limit-requests"] == "1" and raw.headers["x-ratelimit-remaining-requests"] == "0"
    assert raw.headers["x-request-id"]
    with pytest.raises(anthropic.RateLimitError) as limited:
        await sdk(gw, key).messages.create(**ask)
    assert limited.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    assert int(limited.value.response.headers["retry-after"]) >= 1
    with pytest.raises(anthropic.RateLimitError):  # count_tokens counts against the same window
        await sdk(gw, key).messages.count_tokens(model="gpt", messages=ask["messages"])


async def test_concurrency_and_budget_limits_hold_on_this_route(
    gw: Gateway, claude: FakeUpstream, key_factory: Any
) -> None:
    key, _ = await key_factory(max_concurrent=1)
    await claude.script({"chunk_delay_ms": 300})
    body = {"model": "smart", "max_tokens": 50, "stream": True, "messages": [{"role": "user", "content": "a b c d"}]}
    first = await gw.data.post("/v1/messages", json=body, headers={"x-api-key": key})
    assert first.status == 200
    with pytest.raises(anthropic.RateLimitError):  # the first stream still holds the key's one slot
        await sdk(gw, key).messages.create(model="gpt", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    await first.read()
    broke, _ = await key_factory(budget_usd=Decimal("0"), budget_period="total")
    with pytest.raises(anthropic.APIStatusError) as spent:
        await sdk(gw, broke).messages.create(model="gpt", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert spent.value.status_code == 402 and spent.value.body["error"]["type"] == "billing_error"  # type: ignore[index]


async def test_failover_before_the_first_byte_crosses_protocols(
    gw: Gateway, oai: FakeUpstream, claude: FakeUpstream, api_key: str
) -> None:
    calls = records(gw)
    await oai.script({"status": 500}, {"status": 500}, {"status": 500})
    async with sdk(gw, api_key).messages.stream(
        model="mixed", max_tokens=50, messages=[{"role": "user", "content": "hello there"}],
    ) as stream:
        final = await stream.get_final_message()
    assert final.id.startswith("msg_fake_")  # answered by the Anthropic deployment, natively
    assert (await last_upstream(claude))["body"]["model"] == "claude-haiku"
    assert (await oai.stats())["requests"] >= 1
    assert calls[-1].failovers == 1 and calls[-1].provider == "claude" and calls[-1].protocol == "anthropic"


async def test_a_bearer_token_is_a_key_too(gw: Gateway, api_key: str) -> None:
    client = anthropic.AsyncAnthropic(base_url=gw.url(""), auth_token=api_key, max_retries=0)
    message = await client.messages.create(model="gpt", max_tokens=10, messages=[{"role": "user", "content": "hi"}])
    assert message.type == "message"


async def test_a_cut_translated_stream_ends_with_one_error_event(gw: Gateway, oai: FakeUpstream, api_key: str) -> None:
    await oai.script({"cut_after_chunks": 3})
    resp = await gw.data.post("/v1/messages", json={"model": "gpt", "max_tokens": 50, "stream": True,
                                                    "messages": [{"role": "user", "content": "a b c d e f"}]},
                              headers={"x-api-key": api_key})
    events = sse_events(await resp.read())
    names = [name for name, _ in events]
    assert names[0] == "message_start" and "message_stop" not in names
    assert names.count("error") == 1 and names[-1] == "error"
    assert events[-1][1] == {"type": "error", "error": {"type": "api_error", "message": events[-1][1]["error"]["message"]}}
    with pytest.raises(anthropic.APIStatusError):  # the SDK raises on the error event
        await oai.script({"cut_after_chunks": 3})
        async with sdk(gw, api_key).messages.stream(model="gpt", max_tokens=50,
                                                    messages=[{"role": "user", "content": "a b c d"}]) as stream:
            async for _ in stream:
                pass


async def test_a_cut_passthrough_stream_ends_with_one_error_event(gw: Gateway, claude: FakeUpstream, api_key: str) -> None:
    calls = records(gw)
    await claude.script({"cut_after_chunks": 3})
    resp = await gw.data.post("/v1/messages", json={"model": "smart", "max_tokens": 50, "stream": True,
                                                    "messages": [{"role": "user", "content": "a b c d e f"}]},
                              headers={"x-api-key": api_key})
    names = [name for name, _ in sse_events(await resp.read())]
    assert names[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert names[3:] == ["error"]
    assert calls[-1].outcome == "cut" and calls[-1].protocol == "anthropic"


async def test_a_client_gone_mid_stream_cancels_the_upstream(gw: Gateway, claude: FakeUpstream, api_key: str) -> None:
    calls = records(gw)
    await claude.script({"chunk_delay_ms": 200})
    resp = await gw.data.post("/v1/messages", json={"model": "smart", "max_tokens": 50, "stream": True,
                                                    "messages": [{"role": "user", "content": "a b c d e f g h"}]},
                              headers={"x-api-key": api_key})
    assert (await resp.content.readuntil(b"\n\n")).startswith(b"event: message_start")
    resp.close()
    for _ in range(40):
        if (await claude.stats())["streams_cancelled"] == 1:
            break
        await asyncio.sleep(0.05)
    assert (await claude.stats())["streams_cancelled"] == 1
    for _ in range(40):
        if calls:
            break
        await asyncio.sleep(0.05)
    assert calls[-1].outcome == "cancelled" and calls[-1].usage.prompt_tokens > 0


# ----------------------------------------------------------------------------- count_tokens
async def test_count_tokens_asks_an_anthropic_deployment(gw: Gateway, claude: FakeUpstream, api_key: str) -> None:
    calls = records(gw)
    body: dict[str, Any] = {"system": "Be brief.", "messages": [{"role": "user", "content": "count these five words"}]}
    counted = await sdk(gw, api_key).messages.count_tokens(model="smart", **body)
    upstream = await last_upstream(claude)
    assert upstream["path"] == "/v1/messages/count_tokens" and upstream["body"]["model"] == "claude-sonnet-4-5"
    assert upstream["headers"]["x-api-key"] == "sk-ant-secret"
    assert counted.input_tokens == anthropic_input_tokens(upstream["body"])
    assert calls == []  # no generation, no call record, no ledger row


async def test_count_tokens_estimates_for_other_deployments(gw: Gateway, oai: FakeUpstream, api_key: str) -> None:
    client = sdk(gw, api_key)
    short = await client.messages.count_tokens(model="gpt", messages=[{"role": "user", "content": "hello"}])
    longer = await client.messages.count_tokens(
        model="gpt", system="You are a careful assistant.", tools=TOOLS,
        messages=[{"role": "user", "content": "hello, how are you doing today? " * 10}])
    assert 0 < short.input_tokens < longer.input_tokens
    assert (await oai.stats())["requests"] == 0
    with pytest.raises(anthropic.BadRequestError):
        await client.messages.count_tokens(model="gpt", messages=[])


async def test_metrics_carry_the_route(gw: Gateway, api_key: str) -> None:
    await sdk(gw, api_key).messages.create(model="gpt", max_tokens=10, messages=[{"role": "user", "content": "x"}])
    text = await (await gw.management.get("/metrics")).text()
    assert 'gateway_requests_total{route="/v1/messages",status="200"}' in text


def test_openai_durations_become_anthropic_reset_times() -> None:
    from gateway.edge.ratelimit import anthropic_ratelimit_headers, duration_seconds

    assert [duration_seconds(d) for d in ("20ms", "1s", "6m0s", "1h2m3.5s", "1m30s")] == [0.02, 1, 360, 3723.5, 90]
    out = anthropic_ratelimit_headers({
        "x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "59", "x-ratelimit-reset-requests": "1m0s",
    }, now=1_700_000_000.0)
    assert out == {"anthropic-ratelimit-requests-limit": "60", "anthropic-ratelimit-requests-remaining": "59",
                   "anthropic-ratelimit-requests-reset": "2023-11-14T22:14:20Z"}


async def test_messages_answers_carry_anthropics_rate_limit_headers_too(gw: Gateway, api_key: str) -> None:
    resp = await gw.data.post("/v1/messages", headers={"x-api-key": api_key}, json={
        "model": "gpt", "max_tokens": 10, "messages": [{"role": "user", "content": "x"}]})
    assert resp.status == 200
    assert resp.headers["anthropic-ratelimit-requests-limit"] == resp.headers["x-ratelimit-limit-requests"]
    assert resp.headers["anthropic-ratelimit-requests-remaining"] == resp.headers["x-ratelimit-remaining-requests"]
    assert resp.headers["anthropic-ratelimit-requests-reset"].endswith("Z")
    chat = await gw.data.post("/v1/chat/completions", json=chat_body(model="gpt"), headers=auth(api_key))
    assert "anthropic-ratelimit-requests-limit" not in chat.headers
