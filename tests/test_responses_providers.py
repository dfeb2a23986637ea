"""``/v1/responses`` in front of every kind of deployment: one serving the Responses API
natively (``responses_api: true``, passed through), an Anthropic one (through the chat
translation and on to the Messages API), and a group mixing native and chat deployments."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

from gateway.testing.fake_responses import NATIVE_PREFIX
from tests.conftest import FakeUpstream, Gateway
from tests.fleet import fleet_config, records


def client(gw: Gateway, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url("/v1"), api_key=key, max_retries=0)


async def upstream(fake: FakeUpstream) -> dict[str, Any]:
    return (await fake.stats())["last_request"]  # type: ignore[no-any-return]


@pytest.fixture
async def native(fake_factory: Any) -> FakeUpstream:
    return await fake_factory()  # type: ignore[no-any-return]


@pytest.fixture
async def chat(fake_factory: Any) -> FakeUpstream:
    return await fake_factory()  # type: ignore[no-any-return]


@pytest.fixture
async def gw(gateway_factory: Any, native: FakeUpstream, chat: FakeUpstream) -> Gateway:
    price = {"input_per_mtok": 1.0, "output_per_mtok": 2.0}
    return await gateway_factory(config_yaml=fleet_config(  # type: ignore[no-any-return]
        {"native": {"type": "openai", "base_url": native.url, "api_key": "sk-native", "responses_api": True},
         "chat": chat},
        [{"name": "native", "deployments": [{"provider": "native", "model": "gpt-up", "price": price}]},
         {"name": "mixed", "deployments": [{"provider": "chat", "model": "m-chat", "priority": 0},
                                           {"provider": "native", "model": "m-native", "priority": 1}]}]))


async def test_a_native_deployment_gets_the_request_as_sent(gw: Gateway, native: FakeUpstream, api_key: str) -> None:
    calls = records(gw)
    api = client(gw, api_key)
    made = await api.responses.create(model="native", input="hello native", instructions="Be brief.",
                                      metadata={"a": "b"})
    assert made.output_text == NATIVE_PREFIX + "hello native" and made.id.startswith("resp_")
    assert calls[-1].response_id.startswith("resp_fake_")  # the deployment's id, in the ledger
    assert made.store is True  # the client's flag, though the deployment was told to keep nothing
    sent = await upstream(native)
    assert sent["path"] == "/v1/responses" and sent["headers"]["authorization"] == "Bearer sk-native"
    assert sent["body"] == {"model": "gpt-up", "input": "hello native", "instructions": "Be brief.",
                            "metadata": {"a": "b"}, "store": False}
    # Usage and cost are the deployment's own counts.
    assert made.usage is not None and calls[-1].usage.prompt_tokens == made.usage.input_tokens
    assert calls[-1].usage.completion_tokens == made.usage.output_tokens and not calls[-1].usage.estimated
    assert calls[-1].cost_usd > 0 and calls[-1].protocol == "responses"
    # Stored by the gateway: retrieve, and a follow-up sends the whole conversation upstream.
    assert (await api.responses.retrieve(made.id)).output_text == made.output_text
    follow = await api.responses.create(model="native", input="and again", previous_response_id=made.id)
    assert follow.previous_response_id == made.id
    sent = await upstream(native)
    assert "previous_response_id" not in sent["body"] and sent["body"]["store"] is False
    assert sent["body"]["input"] == [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello native"}]},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": made.output_text, "annotations": [], "logprobs": []}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "and again"}]},
    ]


async def test_a_native_stream_is_relayed_as_it_came(gw: Gateway, native: FakeUpstream, api_key: str) -> None:
    calls = records(gw)
    stream = await client(gw, api_key).responses.create(model="native", input="stream this please", stream=True)
    events = [event async for event in stream]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == NATIVE_PREFIX + "stream this please"
    final = events[-1].response  # type: ignore[union-attr]
    assert final.usage is not None and calls[-1].usage.completion_tokens == final.usage.output_tokens
    assert not calls[-1].usage.estimated and calls[-1].response_id.startswith("resp_fake_")
    assert {e.response.id for e in events if hasattr(e, "response")} == {final.id}  # type: ignore[union-attr]
    assert not final.id.startswith("resp_fake_")  # the gateway's id: the one it stores
    for _ in range(20):
        try:
            stored = await client(gw, api_key).responses.retrieve(final.id)
            break
        except openai.NotFoundError:
            await asyncio.sleep(0.05)
    assert stored.output_text == text and stored.store is True


async def test_a_native_stream_cut_ends_with_response_failed(gw: Gateway, native: FakeUpstream, api_key: str) -> None:
    await native.script({"cut_after_chunks": 4})
    stream = await client(gw, api_key).responses.create(model="native", input="a b c d e f", stream=True)
    events = [event async for event in stream]
    assert events[-1].type == "response.failed"
    assert [e.sequence_number for e in events] == list(range(len(events)))  # the gateway's event goes on counting
    assert events[-1].response.id == events[0].response.id  # type: ignore[union-attr]


async def test_built_in_tools_go_only_to_a_native_deployment(
    gw: Gateway, native: FakeUpstream, chat: FakeUpstream, api_key: str
) -> None:
    api = client(gw, api_key)
    plain = await api.responses.create(model="mixed", input="plain question")
    assert plain.output_text == "This is a mock answer to: plain question"  # the chat deployment, first
    assert (await upstream(chat))["path"] == "/v1/chat/completions"
    searched = await api.responses.create(model="mixed", input="news today", tools=[{"type": "web_search"}])
    assert [item.type for item in searched.output] == ["web_search_call", "message"]
    assert (await upstream(native))["body"]["tools"] == [{"type": "web_search"}]
    assert (await chat.stats())["requests"] == 1  # never offered to the chat deployment


async def test_an_anthropic_deployment_through_the_chat_translation(
    gateway_factory: Any, fake_factory: Any, api_key: str
) -> None:
    claude = await fake_factory()
    gw = await gateway_factory(config_yaml=fleet_config(
        {"claude": {"type": "anthropic", "base_url": claude.url[:-3], "api_key": "sk-ant-secret"}},
        [{"name": "claude", "deployments": [{"provider": "claude", "model": "claude-sonnet-4-5"}]}]))
    api = client(gw, api_key)
    made = await api.responses.create(model="claude", input="hello claude", instructions="Be kind.",
                                      max_output_tokens=64)
    assert made.output_text and made.status == "completed" and made.usage is not None
    sent = await upstream(claude)
    assert sent["path"] == "/v1/messages" and sent["body"]["system"] in ("Be kind.", [{"type": "text",
                                                                                      "text": "Be kind."}])
    assert sent["body"]["max_tokens"] == 64
    stream = await api.responses.create(model="claude", input="stream from claude", stream=True,
                                        previous_response_id=made.id)
    events = [event async for event in stream]
    assert events[-1].type == "response.completed" and events[-1].response.output_text  # type: ignore[union-attr]
    sent = await upstream(claude)
    assert [m["role"] for m in sent["body"]["messages"]] == ["user", "assistant", "user"]


def test_responses_api_is_an_openai_provider_setting_and_retention_a_number(tmp_path: Any) -> None:
    from gateway.core.config import ConfigError, load_config, load_settings

    path = tmp_path / "gateway.yaml"
    path.write_text("providers:\n  c: {type: anthropic, api_key: k, responses_api: true}\n"
                    "models: [{name: m, deployments: [{provider: c, model: x}]}]\n")
    with pytest.raises(ConfigError) as refused:
        load_config(load_settings({"GATEWAY_CONFIG": str(path)}), {"GATEWAY_CONFIG": str(path)})
    assert str(refused.value).startswith("providers.c.responses_api: ")
    assert load_settings({"RESPONSES_RETENTION_DAYS": "7"}).responses_retention_days == 7.0
    with pytest.raises(ConfigError) as bad:
        load_settings({"RESPONSES_RETENTION_DAYS": "0"})
    assert str(bad.value).startswith("RESPONSES_RETENTION_DAYS: ")


async def test_with_guardrails_a_native_deployment_gets_the_screened_chat_translation(
    gateway_factory: Any, native: FakeUpstream, api_key: str
) -> None:
    gw = await gateway_factory(config_yaml=fleet_config(
        {"native": {"type": "openai", "base_url": native.url, "api_key": "sk-native", "responses_api": True}},
        [{"name": "guarded", "guardrails": ["topics"],
          "deployments": [{"provider": "native", "model": "gpt-up"}]}],
        guardrails={"policies": {"topics": {"type": "terms", "mode": "block", "terms": ["project falcon"]}}}))
    api = client(gw, api_key)
    with pytest.raises(openai.BadRequestError) as blocked:
        await api.responses.create(model="guarded", input="tell me about Project Falcon")
    assert blocked.value.code == "guardrail_blocked"
    assert (await native.stats())["requests"] == 0  # a refused prompt never goes upstream
    made = await api.responses.create(model="guarded", input="tell me about the weather")
    assert made.output_text == "This is a mock answer to: tell me about the weather"
    assert (await upstream(native))["path"] == "/v1/chat/completions"  # screened as chat
    with pytest.raises(openai.BadRequestError) as builtin:  # only the native wire could run it
        await api.responses.create(model="guarded", input="news", tools=[{"type": "web_search"}])
    assert builtin.value.code == "unsupported_tool"
