"""``/v1/responses`` (OpenAI's Responses API) through chat translation, with stored
conversations, driven by the official ``openai`` SDK against the fake upstream."""

from __future__ import annotations

import asyncio
import uuid
from decimal import Decimal
from typing import Any

import openai
import orjson
import pytest

from gateway.core.errors import InvalidRequest
from gateway.edge.response_store import ResponseStore
from gateway.protocols.responses import input_items, to_chat_request, to_response
from gateway.protocols.responses_stream import EventsFromChunks
from tests.conftest import FakeUpstream, Gateway, auth, config_for, pair_config
from tests.fleet import records

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def sdk(url: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)


def client(gw: Gateway, key: str) -> openai.AsyncOpenAI:
    return sdk(gw.url("/v1"), key)


async def test_a_whole_response(gateway: Gateway, fake: FakeUpstream, api_key: str, db_pool: Any) -> None:
    calls = records(gateway)
    response = await client(gateway, api_key).responses.create(
        model="gpt-x", input="Say hello there", instructions="Be brief.", max_output_tokens=50, temperature=0,
        metadata={"ticket": "42"}, extra_headers={"x-request-id": "resp-whole-1"})
    assert response.id.startswith("resp_") and response.object == "response" and response.status == "completed"
    assert response.output_text == "This is a mock answer to: Say hello there"
    assert response.output[0].type == "message" and response.output[0].content[0].type == "output_text"
    assert response.metadata == {"ticket": "42"} and response.instructions == "Be brief."
    assert response.max_output_tokens == 50 and response.store is True
    assert response.usage is not None and response.usage.input_tokens == calls[-1].usage.prompt_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    sent = (await fake.stats())["last_request"]
    assert sent["path"] == "/v1/chat/completions"
    assert sent["body"]["messages"] == [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Say hello there"}]
    assert sent["body"]["max_tokens"] == 50 and sent["body"]["temperature"] == 0 and "metadata" not in sent["body"]
    assert await gateway.state.billing.flush()
    row = await db_pool.fetchrow("SELECT * FROM usage_ledger WHERE request_id = 'resp-whole-1'")
    assert row["protocol"] == "responses" and row["completion_tokens"] == response.usage.output_tokens


async def test_a_streamed_response_has_the_typed_events_in_sequence(gateway: Gateway, api_key: str) -> None:
    calls = records(gateway)
    api = client(gateway, api_key)
    stream = await api.responses.create(model="gpt-x", input="one two three", stream=True)
    events = [event async for event in stream]
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "This is a mock answer to: one two three"
    done = events[-1].response  # type: ignore[union-attr]
    assert done.output_text == text and done.usage is not None
    assert done.usage.output_tokens == calls[-1].usage.completion_tokens > 0 and not calls[-1].usage.estimated
    # Stored once complete, behind the stream: the same object comes back.
    fetched = await api.responses.retrieve(done.id)
    assert fetched.output_text == text and fetched.status == "completed"


async def test_function_tools_and_a_follow_up_with_previous_response_id(
    gateway: Gateway, fake: FakeUpstream, api_key: str
) -> None:
    api = client(gateway, api_key)
    first = await api.responses.create(model="gpt-x", input="Weather in Paris?", tools=[WEATHER])  # type: ignore[list-item]
    call = first.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    assert orjson.loads(call.arguments)
    sent = (await fake.stats())["last_request"]["body"]
    assert sent["tools"] == [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    second = await api.responses.create(
        model="gpt-x", previous_response_id=first.id, tools=[WEATHER],  # type: ignore[list-item]
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"}])
    assert second.previous_response_id == first.id and second.output_text.startswith("This is a mock answer")
    # The upstream got the rebuilt conversation: earlier input, earlier output, new input.
    messages = (await fake.stats())["last_request"]["body"]["messages"]
    assert messages == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21C"},
    ]
    items = await api.responses.input_items.list(second.id, order="asc")
    assert [i.type for i in items.data] == ["message", "function_call", "function_call_output"]


async def test_a_streamed_tool_call(gateway: Gateway, api_key: str) -> None:
    stream = await client(gateway, api_key).responses.create(
        model="gpt-x", input="Weather in Oslo?", tools=[WEATHER], stream=True)  # type: ignore[list-item]
    events = [event async for event in stream]
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.name == "get_weather"  # type: ignore[union-attr]
    assert orjson.loads(done.arguments) and kinds[-1] == "response.completed"  # type: ignore[union-attr]
    assert events[-1].response.output[0].arguments == done.arguments  # type: ignore[union-attr]


async def test_retrieve_delete_input_items_and_store_false(gateway: Gateway, api_key: str) -> None:
    api = client(gateway, api_key)
    made = await api.responses.create(model="gpt-x", input=[
        {"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "input_text", "text": "second"}]}])
    fetched = await api.responses.retrieve(made.id)
    assert fetched.id == made.id and fetched.output_text == made.output_text
    listed = await api.responses.input_items.list(made.id)  # newest first, as OpenAI lists them
    assert [i.content[0].text for i in listed.data] == ["second", "ok", "first"]  # type: ignore[union-attr]
    page = await api.responses.input_items.list(made.id, order="asc", limit=2)
    assert page.has_more and len(page.data) == 2
    rest = await api.responses.input_items.list(made.id, order="asc", after=page.last_id)
    assert [i.content[0].text for i in rest.data] == ["second"]  # type: ignore[union-attr]
    await api.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError) as gone:
        await api.responses.retrieve(made.id)
    assert gone.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        await api.responses.delete(made.id)
    unstored = await api.responses.create(model="gpt-x", input="keep nothing", store=False)
    assert unstored.store is False
    await asyncio.sleep(0.2)  # a store would have landed by now
    with pytest.raises(openai.NotFoundError):
        await api.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as bad:
        await api.responses.create(model="gpt-x", input="next", previous_response_id=unstored.id)
    assert bad.value.code == "previous_response_not_found"


async def test_another_subject_cannot_see_or_continue_a_response(gateway: Gateway, key_factory: Any) -> None:
    subject = uuid.uuid4()
    mine, _ = await key_factory("mine", subject_id=subject)
    same_subject, _ = await key_factory("mine too", subject_id=subject)
    theirs, _ = await key_factory("theirs")
    made = await client(gateway, mine).responses.create(model="gpt-x", input="secret plans")
    # Another key of the same subject sees it.
    assert (await client(gateway, same_subject).responses.retrieve(made.id)).id == made.id
    other = client(gateway, theirs)
    with pytest.raises(openai.NotFoundError):
        await other.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        await other.responses.input_items.list(made.id)
    with pytest.raises(openai.NotFoundError):
        await other.responses.delete(made.id)
    with pytest.raises(openai.BadRequestError) as refused:
        await other.responses.create(model="gpt-x", input="go on", previous_response_id=made.id)
    assert refused.value.code == "previous_response_not_found"
    assert refused.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    assert (await client(gateway, mine).responses.retrieve(made.id)).id == made.id  # still there


async def test_bad_requests_limits_and_keys_in_openai_shape(gateway: Gateway, key_factory: Any, api_key: str) -> None:
    api = client(gateway, api_key)
    for extra in ({"input": "x", "tools": [{"type": "web_search"}]}, {"input": []},
                  {"input": [{"type": "input_file", "file_id": "f"}]}, {"input": "x", "stream": "yes"},
                  {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}):
        with pytest.raises(openai.BadRequestError) as bad:
            await api.responses.create(model="m", **extra)  # type: ignore[call-overload]
        assert bad.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as builtin:
        await api.responses.create(model="m", input="x", tools=[{"type": "web_search"}])  # type: ignore[list-item]
    assert builtin.value.code == "unsupported_tool"
    with pytest.raises(openai.AuthenticationError):
        await client(gateway, "llmg_wrong_key_0000000000").responses.create(model="m", input="x")
    with pytest.raises(openai.AuthenticationError):
        await client(gateway, "llmg_wrong_key_0000000000").responses.retrieve("resp_x")
    limited, _ = await key_factory("one an hour", rate_limit_requests=1, rate_limit_window_seconds=3600)
    await client(gateway, limited).responses.create(model="m", input="x")
    with pytest.raises(openai.RateLimitError) as limit:
        await client(gateway, limited).responses.create(model="m", input="x")
    assert limit.value.code == "rate_limit_exceeded"
    resp = await gateway.data.post("/v1/responses", data=b"{", headers=auth(api_key))
    assert resp.status == 400 and set((await resp.json())["error"]) >= {"message", "type", "code"}


async def test_a_cut_stream_ends_with_response_failed(gateway: Gateway, fake: FakeUpstream, api_key: str) -> None:
    await fake.script({"cut_after_chunks": 3})
    stream = await client(gateway, api_key).responses.create(model="m", input="a b c d e f g", stream=True)
    events = [event async for event in stream]
    assert events[-1].type == "response.failed"
    assert events[-1].response.error.code == "upstream_unavailable"  # type: ignore[union-attr]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    await asyncio.sleep(0.2)
    with pytest.raises(openai.NotFoundError):  # a failed stream is not stored
        await client(gateway, api_key).responses.retrieve(events[-1].response.id)  # type: ignore[union-attr]


async def test_stored_conversations_are_shared_by_replicas(
    process_factory: Any, fake: FakeUpstream, api_key: str
) -> None:
    config = config_for(fake.url)
    first, second = await process_factory(config_yaml=config), await process_factory(config_yaml=config)
    made = await sdk(f"{first.url}/v1", api_key).responses.create(model="gpt-x", input="My name is Ada.")
    other = sdk(f"{second.url}/v1", api_key)
    for _ in range(50):  # stored behind the answer: give the first replica's write a moment
        try:
            fetched = await other.responses.retrieve(made.id)
            break
        except openai.NotFoundError:
            await asyncio.sleep(0.05)
    assert fetched.output_text == made.output_text
    follow = await other.responses.create(model="gpt-x", input="What is my name?", previous_response_id=made.id)
    assert follow.output_text == "This is a mock answer to: What is my name?"
    messages = (await fake.stats())["last_request"]["body"]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[1]["content"] == made.output_text
    # A restart keeps them: a third process finds the follow-up.
    third = await process_factory(config_yaml=config)
    assert (await sdk(f"{third.url}/v1", api_key).responses.retrieve(follow.id)).previous_response_id == made.id


def test_the_mapping_both_ways() -> None:
    body = {"model": "m", "instructions": "sys", "max_output_tokens": 9, "tool_choice": {"type": "function",
            "name": "f"}, "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"},
                                              "strict": True}}, "tools": [{"type": "function", "name": "f"}]}
    items = input_items([{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/i.png"}]},
                         {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                         {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
                         {"type": "function_call_output", "call_id": "c1", "output": "one"},
                         {"type": "reasoning", "summary": []}])
    assert all(i["id"] for i in items)
    chat = to_chat_request(body, items)
    assert chat["messages"][0] == {"role": "system", "content": "sys"}
    assert chat["messages"][1]["content"] == [{"type": "image_url", "image_url": {"url": "https://x/i.png"}}]
    assert [c["id"] for c in chat["messages"][2]["tool_calls"]] == ["c1", "c2"]  # parallel calls: one turn
    assert chat["messages"][3] == {"role": "tool", "tool_call_id": "c1", "content": "one"}
    assert len(chat["messages"]) == 4
    assert chat["max_tokens"] == 9 and chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "out",
                                       "schema": {"type": "object"}, "strict": True}}
    with pytest.raises(InvalidRequest):
        to_chat_request({"model": "m", "tools": [{"type": "file_search"}]}, items)
    answer = {"id": "c", "model": "up", "created": 5, "choices": [{"index": 0, "finish_reason": "length",
              "message": {"role": "assistant", "content": "cut"}}], "usage": {"prompt_tokens": 3,
                                                                              "completion_tokens": 2}}
    response = to_response(answer, body, "resp_1", model="m")
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["usage"]["total_tokens"] == 5 and response["output"][0]["content"][0]["text"] == "cut"


def test_the_stream_framer_numbers_every_event() -> None:
    framer = EventsFromChunks("resp_1", {"model": "m"}, model="m")
    out = framer.feed(orjson.dumps({"id": "c", "model": "m", "choices": [{"index": 0, "delta": {"content": "Hi"}}]}))
    out += framer.feed(orjson.dumps({"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "call_1", "function": {"name": "f", "arguments": "{\"a\""}}]}}]}))
    out += framer.feed(orjson.dumps({"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": {"arguments": ":1}"}}]}, "finish_reason": "tool_calls"}]}))
    out += framer.finish({"prompt_tokens": 1, "completion_tokens": 2})
    events = [orjson.loads(block.split(b"data: ", 1)[1]) for block in out.split(b"\n\n") if block]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call"]
    assert final["output"][1]["arguments"] == "{\"a\":1}" and final["usage"]["total_tokens"] == 3


async def test_budgets_failover_metrics_and_request_ids_hold_on_this_route(
    gateway_factory: Any, fake_factory: Any, key_factory: Any, api_key: str
) -> None:
    first, second = await fake_factory(), await fake_factory()
    gw = await gateway_factory(config_yaml=pair_config(first.url, second.url))
    calls = records(gw)
    await first.script({"status": 503}, {"status": 503}, {"status": 503})
    stream = await client(gw, api_key).responses.create(model="pair", input="fail over", stream=True,
                                                        extra_headers={"x-request-id": "resp-failover-1"})
    events = [event async for event in stream]
    assert events[-1].type == "response.completed" and calls[-1].deployment == "second/m2"
    assert calls[-1].failovers == 1 and calls[-1].request_id == "resp-failover-1"
    raw = await client(gw, api_key).responses.with_raw_response.create(
        model="pair", input="x", extra_headers={"x-request-id": "resp-id-2"})
    assert raw.headers["x-request-id"] == "resp-id-2" and raw.headers["x-ratelimit-limit-requests"]
    broke, _ = await key_factory(budget_usd=Decimal("0"), budget_period="total")
    with pytest.raises(openai.APIStatusError) as spent:
        await client(gw, broke).responses.create(model="pair", input="x")
    assert spent.value.status_code == 402 and spent.value.code == "budget_exceeded"
    metrics = await (await gw.management.get("/metrics")).text()
    assert 'gateway_requests_total{route="/v1/responses",status="200"}' in metrics


async def test_a_client_gone_cancels_the_upstream(gateway: Gateway, fake: FakeUpstream, api_key: str) -> None:
    calls = records(gateway)
    await fake.script({"chunk_delay_ms": 300})
    resp = await gateway.data.post("/v1/responses", json={"model": "m", "input": "a b c d e f g h", "stream": True},
                                   headers=auth(api_key))
    assert resp.status == 200 and b"response.created" in await resp.content.readuntil(b"\n\n")
    resp.close()
    for _ in range(40):
        if (await fake.stats())["streams_cancelled"]:
            break
        await asyncio.sleep(0.05)
    assert (await fake.stats())["streams_cancelled"] == 1
    for _ in range(40):
        if calls and calls[-1].outcome == "cancelled":
            break
        await asyncio.sleep(0.05)
    assert calls[-1].outcome == "cancelled"


async def test_storing_never_delays_the_answer(gateway: Gateway, api_key: str, db_pool: Any) -> None:
    api = client(gateway, api_key)
    async with db_pool.acquire() as conn:
        transaction = conn.transaction()
        await transaction.start()
        await conn.execute("LOCK TABLE stored_responses IN ACCESS EXCLUSIVE MODE")  # every write waits
        try:
            made = await asyncio.wait_for(api.responses.create(model="m", input="quick"), timeout=5)
            stream = await asyncio.wait_for(api.responses.create(model="m", input="quick too", stream=True), 5)
            streamed = [event async for event in stream]
            assert made.output_text and streamed[-1].type == "response.completed"
            assert await conn.fetchval("SELECT count(*) FROM stored_responses WHERE id = $1", made.id) == 0
        finally:
            await transaction.rollback()
    # The writes land once the table is free again.
    assert (await api.responses.retrieve(made.id)).id == made.id
    assert (await api.responses.retrieve(streamed[-1].response.id)).status == "completed"  # type: ignore[union-attr]


async def test_retention_sets_the_expiry_and_an_expired_response_is_gone(
    gateway_factory: Any, fake: FakeUpstream, api_key: str, db_pool: Any
) -> None:
    gw = await gateway_factory(env={"RESPONSES_RETENTION_DAYS": "2"}, config_yaml=config_for(fake.url))
    api = client(gw, api_key)
    made = await api.responses.create(model="m", input="keep me two days")
    assert (await api.responses.retrieve(made.id)).id == made.id
    kept = await db_pool.fetchval("SELECT expires_at - created_at FROM stored_responses WHERE id = $1", made.id)
    assert abs(kept.total_seconds() - 2 * 86400) < 5
    await db_pool.execute("UPDATE stored_responses SET expires_at = now() - interval '1 second' WHERE id = $1",
                          made.id)
    with pytest.raises(openai.NotFoundError):
        await api.responses.retrieve(made.id)
    with pytest.raises(openai.BadRequestError) as expired:
        await api.responses.create(model="m", input="next", previous_response_id=made.id)
    assert expired.value.code == "previous_response_not_found"


async def test_the_store_purges_expired_rows_and_keeps_the_rest(db_pool: Any) -> None:
    subject, key = uuid.uuid4(), uuid.uuid4()
    await db_pool.execute(
        "INSERT INTO stored_responses (id, subject_id, api_key_id, response, input_items, expires_at)"
        " VALUES ('resp_old', $1, $2, '{}', '[]', now() - interval '1 day')", subject, key)
    store = ResponseStore(db_pool, retention_days=1, purge_every=2)
    for n in range(2):
        store.save(subject, key, {"id": f"resp_new_{n}", "status": "completed"}, [])
    await store.close()
    ids = {r["id"] for r in await db_pool.fetch("SELECT id FROM stored_responses WHERE subject_id = $1", subject)}
    assert ids == {"resp_new_0", "resp_new_1"}
    loaded = await store.load("resp_new_1", subject)
    assert loaded is not None and loaded.response["status"] == "completed"
    assert await store.load("resp_new_1", uuid.uuid4()) is None  # another subject
