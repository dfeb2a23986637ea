"""The response cache on ``/v1/responses``, driven by the official ``openai`` SDK: a hit is
a new response (fresh id, the stored answer's output and usage), whole or as typed
events, stored and continuable when ``store`` is true; a follow-up is keyed on its whole
rebuilt conversation; a hit's ledger row, metrics and headers are those of chat's hits."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import openai
import pytest

from tests.cache_helpers import cached_config, settle, upstream_calls
from tests.conftest import FakeUpstream, Gateway
from tests.fleet import fleet_config
from tests.test_metrics import scrape, total, value
from tests.test_responses import WEATHER


def client(gw: Gateway, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url("/v1"), api_key=key, max_retries=0)


async def create(api: openai.AsyncOpenAI, **body: Any) -> tuple[str | None, Any]:
    """One ``responses.create`` at temperature 0 (cacheable): its cache header and response."""
    raw = await api.responses.with_raw_response.create(**{"model": "cached", "temperature": 0, **body})
    return raw.headers.get("x-gateway-cache"), raw.parse()


async def test_a_response_is_served_from_the_cache_after_a_miss(
    gateway_factory: Any, fake: FakeUpstream, api_key: str
) -> None:
    gw: Gateway = await gateway_factory(config_yaml=cached_config(fake.url))
    api = client(gw, api_key)
    status, live = await create(api, input="what is a cache", instructions="Be brief.", metadata={"n": "1"})
    assert status == "miss"
    await settle(gw, 1)
    await asyncio.sleep(1.05)  # created_at is in whole seconds: the hit's is later than the stored answer's
    raw = await api.responses.with_raw_response.create(model="cached", temperature=0, input="what is a cache",
                                                       instructions="Be brief.", metadata={"n": "2"})
    hit = raw.parse()
    assert raw.headers["x-gateway-cache"] == "hit" and raw.headers["x-gateway-cache-key"]
    assert await upstream_calls(fake) == 1
    # A new response in the Responses shape: its own id and time, the stored answer's output and usage,
    # and the fields this request sent (metadata is not part of the key).
    assert hit.object == "response" and hit.status == "completed" and hit.id.startswith("resp_")
    assert hit.id != live.id and hit.created_at > live.created_at
    assert hit.output_text == live.output_text and hit.output[0].type == "message"
    assert hit.output[0].id != live.output[0].id
    assert hit.usage is not None and live.usage is not None
    assert (hit.usage.input_tokens, hit.usage.output_tokens, hit.usage.total_tokens) == (
        live.usage.input_tokens, live.usage.output_tokens, live.usage.total_tokens)
    assert hit.metadata == {"n": "2"} and hit.instructions == "Be brief." and hit.store is True

    # store true (the default): the hit is stored as a response of its own, and can be continued.
    fetched = await api.responses.retrieve(hit.id)
    assert fetched.id == hit.id and fetched.output_text == live.output_text
    items = await api.responses.input_items.list(hit.id)
    assert [i.content[0].text for i in items.data] == ["what is a cache"]  # type: ignore[union-attr]
    follow = await api.responses.create(model="cached", input="and why?", previous_response_id=hit.id)
    assert follow.previous_response_id == hit.id
    messages = (await fake.stats())["last_request"]["body"]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]  # instructions are not carried over
    assert messages[1]["content"] == live.output_text

    # store false: served from the cache, kept nowhere.
    status, unstored = await create(api, input="what is a cache", instructions="Be brief.", store=False)
    assert status == "hit" and unstored.store is False
    await asyncio.sleep(0.2)  # a store would have landed by now
    with pytest.raises(openai.NotFoundError):
        await api.responses.retrieve(unstored.id)
    assert await upstream_calls(fake) == 2  # the follow-up only


async def test_only_what_chat_would_cache_is_cached(gateway_factory: Any, fake: FakeUpstream, api_key: str) -> None:
    gw: Gateway = await gateway_factory(config_yaml=cached_config(fake.url))
    api = client(gw, api_key)
    await create(api, input="shared question")
    await settle(gw, 1)
    # The entry is the chat request sent upstream: a chat completions client asking the
    # same question is served it too, and the other way round.
    chat = await api.chat.completions.with_raw_response.create(
        model="cached", temperature=0, messages=[{"role": "user", "content": "shared question"}])
    assert chat.headers["x-gateway-cache"] == "hit"
    assert chat.parse().choices[0].message.content == "This is a mock answer to: shared question"
    sampled = await api.responses.with_raw_response.create(model="cached", input="shared question")
    assert sampled.headers["x-gateway-cache"] == "bypass"  # no temperature 0: it samples, so never cached
    status, _ = await create(api, input="shared question", extra_headers={"Cache-Control": "no-store"})
    assert status == "bypass"
    status, _ = await create(api, input="shared question", max_output_tokens=40)  # another request
    assert status == "miss"
    assert await upstream_calls(fake) == 4
    # A group without a cache policy: the client opts in per request, as on chat.
    opt_in = {"x-gateway-cache": "use"}
    assert (await create(api, model="gpt-x", input="opted in"))[0] is None
    assert (await create(api, model="gpt-x", input="opted in", extra_headers=opt_in))[0] == "miss"
    await settle(gw, 3)
    assert (await create(api, model="gpt-x", input="opted in", extra_headers=opt_in))[0] == "hit"
    assert await upstream_calls(fake) == 6


async def test_a_streamed_hit_is_the_typed_events_of_a_new_response(
    gateway_factory: Any, fake: FakeUpstream, api_key: str
) -> None:
    gw: Gateway = await gateway_factory(config_yaml=cached_config(fake.url))
    api = client(gw, api_key)
    body = {"model": "cached", "temperature": 0, "input": "stream a cached answer", "stream": True}
    first = await api.responses.with_raw_response.create(**body)  # type: ignore[call-overload]
    live = [event async for event in first.parse()]
    assert first.headers["x-gateway-cache"] == "miss"
    await settle(gw, 1)
    await asyncio.sleep(1.05)  # created_at is in whole seconds
    second = await api.responses.with_raw_response.create(**body)  # type: ignore[call-overload]
    replayed = [event async for event in second.parse()]
    assert second.headers["x-gateway-cache"] == "hit" and second.headers["Content-Type"] == "text/event-stream"
    assert await upstream_calls(fake) == 1
    assert [e.type for e in replayed] == [e.type for e in live]
    assert replayed[0].type == "response.created" and replayed[-1].type == "response.completed"
    assert [e.sequence_number for e in replayed] == list(range(len(replayed)))
    text = "".join(e.delta for e in replayed if e.type == "response.output_text.delta")
    assert text == "".join(e.delta for e in live if e.type == "response.output_text.delta") != ""
    done, was = replayed[-1].response, live[-1].response  # type: ignore[union-attr]
    assert done.id != was.id and replayed[0].response.id == done.id  # type: ignore[union-attr]
    assert done.created_at > was.created_at
    assert done.output_text == text and done.usage is not None and was.usage is not None
    assert (done.usage.input_tokens, done.usage.output_tokens) == (was.usage.input_tokens, was.usage.output_tokens)
    # Stored like a live stream, once complete.
    assert (await api.responses.retrieve(done.id)).output_text == text
    # A whole answer to the same question is another entry.
    status, whole = await create(api, input="stream a cached answer")
    assert status == "miss" and whole.output_text == text


async def test_a_follow_up_is_keyed_on_its_whole_conversation(
    gateway_factory: Any, fake: FakeUpstream, api_key: str
) -> None:
    gw: Gateway = await gateway_factory(config_yaml=cached_config(fake.url))
    api = client(gw, api_key)
    _, ada = await create(api, input="My name is Ada.")
    _, bob = await create(api, input="My name is Bob.")
    await settle(gw, 2)
    status, to_ada = await create(api, input="What is my name?", previous_response_id=ada.id)
    assert status == "miss"
    sent = (await fake.stats())["last_request"]["body"]["messages"]
    assert [m["content"] for m in sent] == ["My name is Ada.", ada.output_text, "What is my name?"]
    # The same new input after another history is another request: the provider answers it.
    status, _ = await create(api, input="What is my name?", previous_response_id=bob.id)
    assert status == "miss"
    await settle(gw, 4)
    assert await upstream_calls(fake) == 4
    # Another chain whose stored history is the same conversation (its first turn a hit)...
    status, ada_again = await create(api, input="My name is Ada.")
    assert status == "hit" and ada_again.id != ada.id
    status, again = await create(api, input="What is my name?", previous_response_id=ada_again.id)
    assert status == "hit" and await upstream_calls(fake) == 4
    assert again.output_text == to_ada.output_text and again.previous_response_id == ada_again.id
    # ...and the hit is stored with that whole conversation, as a live follow-up is.
    items = await api.responses.input_items.list(again.id, order="asc")
    assert [i.type for i in items.data] == ["message", "message", "message"]
    assert [i.content[0].text for i in items.data] == [  # type: ignore[union-attr]
        "My name is Ada.", ada.output_text, "What is my name?"]
    # An unknown previous response is refused before the cache is read.
    with pytest.raises(openai.BadRequestError) as unknown:
        await create(api, input="What is my name?", previous_response_id="resp_unknown")
    assert unknown.value.code == "previous_response_not_found"


async def test_a_hit_has_the_ledger_row_metrics_and_headers_of_a_chat_hit(
    gateway_factory: Any, fake: FakeUpstream, api_key: str, db_pool: Any
) -> None:
    gw: Gateway = await gateway_factory(config_yaml=cached_config(fake.url))
    api = client(gw, api_key)
    tag = uuid.uuid4().hex[:8]
    chat = {"model": "cached", "temperature": 0, "messages": [{"role": "user", "content": "ledger question"}]}
    heads: dict[str, Any] = {}
    for stream in (False, True):
        kind = "stream" if stream else "whole"
        ids = {name: f"rc-{tag}-{kind}-{name}" for name in ("miss", "chat", "responses")}
        for name in ("miss", "chat"):
            raw = await api.chat.completions.with_raw_response.create(  # type: ignore[call-overload]
                **chat, stream=stream, extra_headers={"x-request-id": ids[name]})
            if stream:
                [chunk async for chunk in raw.parse()]
            heads[f"chat-{kind}"] = raw.headers
            await settle(gw, 1 + stream)
        raw = await api.responses.with_raw_response.create(  # type: ignore[call-overload]
            model="cached", temperature=0, input="ledger question", stream=stream,
            extra_headers={"x-request-id": ids["responses"]})
        if stream:
            [event async for event in raw.parse()]
        heads[f"responses-{kind}"] = raw.headers
        assert await gw.state.billing.flush()
        rows = {r["request_id"]: dict(r) for r in await db_pool.fetch(
            "SELECT * FROM usage_ledger WHERE request_id = ANY($1)", list(ids.values()))}
        miss, chat_hit, responses_hit = (rows[ids[n]] for n in ("miss", "chat", "responses"))
        assert chat_hit["cost_source"] == responses_hit["cost_source"] == "cache" != miss["cost_source"]
        assert (chat_hit["protocol"], responses_hit["protocol"]) == ("chat", "responses")
        own = {"call_id", "request_id", "protocol", "latency_seconds", "created_at", "recorded_at"}
        assert {k: v for k, v in responses_hit.items() if k not in own} == {
            k: v for k, v in chat_hit.items() if k not in own}
        assert responses_hit["cost_usd"] == 0 and responses_hit["provider"] is None
        assert responses_hit["ttft_seconds"] is None and responses_hit["streamed"] is stream
        assert responses_hit["prompt_tokens"] == miss["prompt_tokens"] > 0
        assert responses_hit["completion_tokens"] == miss["completion_tokens"] > 0
        assert responses_hit["response_id"] == miss["response_id"]
    for kind in ("whole", "stream"):
        chat_head, responses_head = heads[f"chat-{kind}"], heads[f"responses-{kind}"]
        assert responses_head["x-gateway-cache"] == chat_head["x-gateway-cache"] == "hit"
        assert responses_head["x-gateway-cache-key"] == chat_head["x-gateway-cache-key"]

    _, samples = await scrape(gw)
    assert value(samples, "gateway_cache_requests_total", result="hit") == 4
    assert value(samples, "gateway_cache_requests_total", result="miss") == 2
    assert total(samples, "gateway_upstream_requests_total") == 2  # the misses; no hit is an upstream call
    assert value(samples, "gateway_requests_total", route="/v1/responses", status="200") == 2
    prompt = rows[ids["miss"]]["prompt_tokens"]
    assert value(samples, "gateway_cache_hit_tokens_total", type="input") == 4 * prompt


async def test_a_request_only_a_native_deployment_can_take_is_not_cached(
    gateway_factory: Any, fake_factory: Any, api_key: str
) -> None:
    chat, native = await fake_factory(), await fake_factory()
    gw: Gateway = await gateway_factory(config_yaml=fleet_config(
        {"native": {"type": "openai", "base_url": native.url, "api_key": "sk-native", "responses_api": True},
         "chat": chat},
        [{"name": "cached", "cache": {"mode": "exact"},
          "deployments": [{"provider": "chat", "model": "m-chat", "priority": 0},
                          {"provider": "native", "model": "m-native", "priority": 1}]}]))
    api = client(gw, api_key)
    for _ in range(2):  # a built-in tool: the chat shape cannot carry it, so the cache never applies
        status, searched = await create(api, input="news today", tools=[{"type": "web_search"}])
        assert status is None and searched.output[0].type == "web_search_call"
    assert int((await native.stats())["by_path"].get("/v1/responses", 0)) == 2
    counters = gw.state.cache.counters
    assert (counters.misses, counters.hits, counters.bypasses) == (0, 0, 0)
    # A request chat can carry, on the same group, is cached as usual.
    assert (await create(api, input="plain question"))[0] == "miss"
    await settle(gw, 1)
    assert (await create(api, input="plain question"))[0] == "hit"


async def test_a_tool_call_hit_can_be_answered_and_continued(
    gateway_factory: Any, fake: FakeUpstream, api_key: str
) -> None:
    gw: Gateway = await gateway_factory(config_yaml=cached_config(fake.url))
    api = client(gw, api_key)
    _, live = await create(api, input="Weather in Paris?", tools=[WEATHER])
    await settle(gw, 1)
    status, hit = await create(api, input="Weather in Paris?", tools=[WEATHER])
    assert status == "hit" and await upstream_calls(fake) == 1
    call, was = hit.output[0], live.output[0]
    assert call.type == was.type == "function_call" and call.name == "get_weather"
    assert (call.call_id, call.arguments) == (was.call_id, was.arguments)  # type: ignore[union-attr]
    # The agent answers the call, continuing from the hit's stored response.
    follow = await api.responses.create(model="cached", previous_response_id=hit.id, tools=[WEATHER],  # type: ignore[list-item]
                                        input=[{"type": "function_call_output", "call_id": call.call_id,
                                                "output": "sunny"}])
    assert follow.previous_response_id == hit.id and follow.output_text
    sent = (await fake.stats())["last_request"]["body"]["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "tool"]
    assert sent[1]["tool_calls"][0]["id"] == call.call_id and sent[2]["tool_call_id"] == call.call_id
