"""AWS Bedrock behind the gateway: Converse / ConverseStream with SigV4 (verified by the
fake by recomputing it), the binary event stream with its CRCs, credentials from the
standard AWS chain, tools, throttling and failover, usage in the ledger."""

from __future__ import annotations

import base64
import json
import struct
import uuid
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import openai
import orjson
import pytest
from aiohttp.test_utils import TestServer
from botocore.eventstream import EventStreamBuffer

from gateway.core import extras
from gateway.core.config import ConfigError, Deployment, load_config, load_settings
from gateway.core.errors import InvalidRequest
from gateway.core.tokens import count_tokens
from gateway.protocols.bedrock import to_converse
from gateway.protocols.chat import UpstreamAnswerError
from gateway.protocols.embeddings import embeddings_list
from gateway.providers.bedrock import BedrockProvider
from gateway.testing.fake_bedrock import BedrockFake, make_app
from gateway.testing.fake_vendor import unit_vector
from tests.conftest import FakeUpstream, Gateway, auth, chat_body, sse_payloads
from tests.fleet import fleet_config, records

HAIKU = "anthropic.claude-3-5-haiku-20241022-v1:0"
TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search",
                                           "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}]
PRICE = {"input_per_mtok": 0.8, "output_per_mtok": 4.0}


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> BedrockFake:
    """The standard chain sees only these environment credentials (no files, no IMDS)."""
    fake = BedrockFake()
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", fake.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", fake.secret_key)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return fake


@pytest.fixture
async def bedrock(aws_env: BedrockFake) -> AsyncIterator[tuple[BedrockFake, str]]:
    server = TestServer(make_app(aws_env), host="127.0.0.1")
    await server.start_server()
    yield aws_env, f"http://127.0.0.1:{server.port}"
    await server.close()


def bedrock_provider(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "bedrock", "base_url": url, "region": "eu-west-1", **extra}


@pytest.fixture
async def gw(gateway_factory: Any, bedrock: tuple[BedrockFake, str], fake: FakeUpstream) -> Gateway:
    _, url = bedrock
    return await gateway_factory(config_yaml=fleet_config(  # type: ignore[no-any-return]
        {"aws": bedrock_provider(url), "backup": fake},
        [{"name": "haiku", "deployments": [{"provider": "aws", "model": HAIKU, "price": PRICE}]},
         {"name": "mixed", "deployments": [{"provider": "aws", "model": HAIKU, "priority": 0},
                                           {"provider": "backup", "model": "m2", "priority": 1}]}]))


def sdk(gw: Gateway, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url("/v1"), api_key=key, max_retries=0)


def test_request_translation() -> None:
    out = to_converse({"model": HAIKU, "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Look"},
                                     {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,/9j/4A=="}}]},
        {"role": "assistant", "content": "Calling.", "tool_calls": [
            {"id": "tu_1", "type": "function", "function": {"name": "search", "arguments": '{"query": "x"}'}}]},
        {"role": "tool", "tool_call_id": "tu_1", "content": '{"hits": 1}'},
        {"role": "user", "content": "thanks"},
    ], "max_tokens": 64, "temperature": 0.3, "top_p": 0.8, "stop": ["END"], "tools": TOOLS, "tool_choice": "required",
        "presence_penalty": 1})
    assert out["system"] == [{"text": "Be brief."}]
    assert [m["role"] for m in out["messages"]] == ["user", "assistant", "user"]
    assert out["messages"][0]["content"][1] == {"image": {"format": "jpeg", "source": {"bytes": "/9j/4A=="}}}
    assert out["messages"][1]["content"] == [{"text": "Calling."}, {"toolUse": {"toolUseId": "tu_1", "name": "search",
                                                                                  "input": {"query": "x"}}}]
    assert out["messages"][2]["content"] == [{"toolResult": {"toolUseId": "tu_1", "content": [{"json": {"hits": 1}}]}},
                                             {"text": "thanks"}]
    assert out["inferenceConfig"] == {"maxTokens": 64, "temperature": 0.3, "topP": 0.8, "stopSequences": ["END"]}
    assert out["toolConfig"]["toolChoice"] == {"any": {}}
    assert out["toolConfig"]["tools"][0]["toolSpec"]["inputSchema"] == {"json": TOOLS[0]["function"]["parameters"]}
    assert set(out) == {"messages", "system", "inferenceConfig", "toolConfig"}
    with pytest.raises(InvalidRequest):
        to_converse({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.test/cat.png"}}]}]})


async def test_a_signed_converse_call(gw: Gateway, bedrock: tuple[BedrockFake, str], api_key: str) -> None:
    fake, _ = bedrock
    answer = await sdk(gw, api_key).chat.completions.create(
        model="haiku", messages=[{"role": "system", "content": "Terse."}, {"role": "user", "content": "hello aws"}],
        max_tokens=32)
    assert answer.choices[0].message.content == "This is a mock answer to: hello aws"
    assert answer.choices[0].finish_reason == "stop" and answer.id.startswith("bedrock-req-")
    assert answer.usage is not None and answer.usage.prompt_tokens == 3
    (call,) = fake.state.model_calls()
    assert call.path == f"/model/{HAIKU}/converse"
    assert call.body["system"] == [{"text": "Terse."}] and call.body["inferenceConfig"] == {"maxTokens": 32}
    (signature,) = fake.signatures  # recomputed and matched by the fake
    assert {"host", "x-amz-date", "content-type"} <= set(signature["signed_headers"])


async def test_session_tokens_and_profile_files_come_from_the_standard_chain(
    gateway_factory: Any, bedrock: tuple[BedrockFake, str], api_key: str, monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    fake, url = bedrock
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    credentials = tmp_path / "credentials"
    credentials.write_text(f"[team]\naws_access_key_id = {fake.access_key}\n"
                           f"aws_secret_access_key = {fake.secret_key}\naws_session_token = sess-token-1\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    gw = await gateway_factory(config_yaml=fleet_config(
        {"aws": bedrock_provider(url, profile="team")},
        [{"name": "haiku", "deployments": [{"provider": "aws", "model": HAIKU}]}]))
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="haiku"), headers=auth(api_key))
    assert resp.status == 200, await resp.text()
    assert fake.signatures[-1]["token"] == "sess-token-1"
    assert "x-amz-security-token" in fake.signatures[-1]["signed_headers"]


async def test_a_wrong_secret_fails_aws_signature_check(
    gateway_factory: Any, bedrock: tuple[BedrockFake, str], api_key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, url = bedrock
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    gw = await gateway_factory(config_yaml=fleet_config(
        {"aws": bedrock_provider(url)}, [{"name": "haiku", "deployments": [{"provider": "aws", "model": HAIKU}]}]))
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="haiku"), headers=auth(api_key))
    # AWS refused our signature (403): the gateway's credential is wrong, not the client's
    # key, so the client gets 502 upstream_auth_failed (issue 17 item 4), not AWS's 403.
    assert resp.status == 502
    error = (await resp.json())["error"]
    assert error["code"] == "upstream_auth_failed" and "InvalidSignature" not in error["message"]
    assert "not-the-secret" not in json.dumps(error)


async def test_converse_stream_frames_become_chunks_and_usage_is_billed(
    gw: Gateway, api_key: str, db_pool: asyncpg.Pool
) -> None:
    request_id = f"br-{uuid.uuid4().hex[:10]}"
    resp = await gw.data.post("/v1/chat/completions", json=chat_body("stream from aws", model="haiku", stream=True),
                              headers={**auth(api_key), "x-request-id": request_id})
    assert resp.status == 200
    payloads = sse_payloads(await resp.read())
    assert payloads[-1] == b"[DONE]"
    chunks = [orjson.loads(p) for p in payloads[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == \
        "This is a mock answer to: stream from aws"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert not any(c.get("usage") for c in chunks)
    assert await gw.state.billing.flush()
    row = await db_pool.fetchrow("SELECT * FROM usage_ledger WHERE request_id = $1", request_id)
    assert row["provider"] == "aws" and row["streamed"] and not row["usage_estimated"]
    assert (row["prompt_tokens"], row["completion_tokens"]) == (3, 9)
    assert row["cost_source"] == "price" and row["cost_usd"] > 0


async def test_tool_use_whole_and_streamed(gw: Gateway, bedrock: tuple[BedrockFake, str], api_key: str) -> None:
    fake, _ = bedrock
    client = sdk(gw, api_key)
    messages: list[Any] = [{"role": "user", "content": "find it"}]
    first = await client.chat.completions.create(model="haiku", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
    (call,) = first.choices[0].message.tool_calls or []
    assert first.choices[0].finish_reason == "tool_calls"
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == (
        "tooluse_fake1", "search", {"query": "find it"})
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "found"}]
    second = await client.chat.completions.create(model="haiku", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
    assert second.choices[0].message.content == 'Tool said: [{"text":"found"}]'
    assert fake.state.model_calls()[-1].body["messages"][2]["content"] == [
        {"toolResult": {"toolUseId": "tooluse_fake1", "content": [{"text": "found"}]}}]
    stream = await client.chat.completions.create(model="haiku", messages=messages[:1], tools=TOOLS,  # type: ignore[arg-type]
                                                  stream=True)
    arguments, finish = "", None
    async for chunk in stream:
        for choice in chunk.choices:
            for piece in choice.delta.tool_calls or []:
                arguments += (piece.function.arguments or "") if piece.function else ""
            finish = choice.finish_reason or finish
    assert json.loads(arguments) == {"query": "find it"} and finish == "tool_calls"


async def test_throttling_cools_bedrock_and_fails_over_to_another_vendor(
    gw: Gateway, bedrock: tuple[BedrockFake, str], api_key: str
) -> None:
    fake, _ = bedrock
    calls = records(gw)
    fake.state.script.append({"status": 429})
    client = sdk(gw, api_key)
    first = await client.chat.completions.create(model="mixed", messages=[{"role": "user", "content": "1"}])
    second = await client.chat.completions.create(model="mixed", messages=[{"role": "user", "content": "2"}])
    assert first.model == second.model == "m2"
    assert len(fake.state.model_calls()) == 1  # cooled after its ThrottlingException
    assert calls[0].failovers == 1 and calls[0].provider == "backup"


@pytest.mark.parametrize("step", [{"stream_exception": "throttlingException"}, {"corrupt_crc": True}])
async def test_a_broken_event_stream_ends_with_one_error_event(
    gw: Gateway, bedrock: tuple[BedrockFake, str], api_key: str, step: dict[str, Any]
) -> None:
    fake, _ = bedrock
    fake.state.script.append(step)
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="haiku", stream=True),
                              headers=auth(api_key))
    assert resp.status == 200
    payloads = sse_payloads(await resp.read())
    assert payloads[-1] != b"[DONE]"
    error = orjson.loads(payloads[-1])["error"]
    expected = "throttlingException" if "stream_exception" in step else "ChecksumMismatch"
    assert expected in error["message"]


def test_a_bedrock_provider_without_its_extra_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(extras.EXTRAS, "bedrock", ("no_such_module_for_this_test",))
    path = tmp_path / "g.yaml"
    path.write_text(fleet_config({"aws": {"type": "bedrock", "region": "us-east-1"}},
                                 [{"name": "m", "deployments": [{"provider": "aws", "model": "x"}]}]))
    environ = {"GATEWAY_CONFIG": str(path), "DATABASE_URL": "postgresql://x/y"}
    with pytest.raises(ConfigError) as caught:
        load_config(load_settings(environ), environ)
    assert str(caught.value) == ("providers.aws.type: bedrock needs the bedrock extra "
                                 "(pip install 'llm-gateway[bedrock]')")


# --------------------------------------------------------------------------- regions per deployment
TITAN = "amazon.titan-embed-text-v2:0"
COHERE = "cohere.embed-english-v3"
EMBED_PRICE = {"input_per_mtok": 20.0, "output_per_mtok": 0.0}


async def test_each_deployment_is_signed_for_and_sent_to_its_own_region(
    gateway_factory: Any, bedrock: tuple[BedrockFake, str], api_key: str
) -> None:
    fake, url = bedrock
    calls = records(gw := await gateway_factory(config_yaml=fleet_config(
        # {region} in base_url: one fake endpoint per region, as bedrock-runtime.{region}.amazonaws.com is.
        {"aws": bedrock_provider(url + "/{region}")},
        [{"name": "home", "deployments": [{"provider": "aws", "model": HAIKU}]},
         {"name": "abroad", "deployments": [{"provider": "aws", "model": HAIKU, "region": "us-east-1"}]},
         {"name": "both", "deployments": [{"provider": "aws", "model": HAIKU, "region": "ap-southeast-2"},
                                          {"provider": "aws", "model": HAIKU}]}])))
    client = sdk(gw, api_key)
    for group in ("home", "abroad", "both"):
        await client.chat.completions.create(model=group, messages=[{"role": "user", "content": group}])
    paths = [c.path for c in fake.state.model_calls()]
    assert paths == [f"/eu-west-1/model/{HAIKU}/converse", f"/us-east-1/model/{HAIKU}/converse",
                     f"/ap-southeast-2/model/{HAIKU}/converse"]
    assert [s["region"] for s in fake.signatures] == ["eu-west-1", "us-east-1", "ap-southeast-2"]
    # Each region is its own deployment: its own breaker, metrics and ledger entry.
    assert [c.deployment for c in calls] == [f"aws/{HAIKU}", f"aws/{HAIKU}@us-east-1", f"aws/{HAIKU}@ap-southeast-2"]


async def test_a_signature_scoped_to_another_region_than_the_endpoints_is_refused(
    gateway_factory: Any, bedrock: tuple[BedrockFake, str], api_key: str
) -> None:
    fake, url = bedrock
    gw = await gateway_factory(config_yaml=fleet_config(  # the fake's root endpoint is eu-west-1
        {"aws": bedrock_provider(url)},
        [{"name": "wrong", "deployments": [{"provider": "aws", "model": HAIKU, "region": "us-east-1"}]}]))
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="wrong"), headers=auth(api_key))
    assert resp.status == 502 and (await resp.json())["error"]["code"] == "upstream_auth_failed"
    assert fake.signatures == []  # AWS's 403: "Credential should be scoped to a valid region"


async def test_the_default_endpoint_host_follows_the_deployments_region(tmp_path: Path) -> None:
    path = tmp_path / "g.yaml"
    path.write_text(fleet_config({"aws": {"type": "bedrock", "region": "eu-central-1"}},
                                 [{"name": "m", "deployments": [{"provider": "aws", "model": HAIKU}]}]))
    environ = {"GATEWAY_CONFIG": str(path), "DATABASE_URL": "postgresql://x/y"}
    config = load_config(load_settings(environ), environ)
    async with aiohttp.ClientSession() as session:
        provider = BedrockProvider(config.providers["aws"], session, request_timeout=5)
        tokyo = provider.for_deployment(Deployment(provider="aws", model=HAIKU, region="ap-northeast-1"))
        assert provider.url(HAIKU, "converse").startswith("https://bedrock-runtime.eu-central-1.amazonaws.com/")
        assert tokyo.url(HAIKU, "converse").startswith("https://bedrock-runtime.ap-northeast-1.amazonaws.com/")
        assert tokyo.address == "bedrock-runtime.ap-northeast-1.amazonaws.com"
        assert provider.for_deployment(Deployment(provider="aws", model=HAIKU)) is provider
        assert provider.for_deployment(Deployment(provider="aws", model=HAIKU, region="ap-northeast-1")) is tokyo


def test_only_bedrock_deployments_take_a_region(tmp_path: Path) -> None:
    path = tmp_path / "g.yaml"
    path.write_text(fleet_config({"oa": {"type": "openai", "base_url": "http://127.0.0.1:9"}},
                                 [{"name": "m", "deployments": [{"provider": "oa", "model": "x", "region": "eu"}]}]))
    environ = {"GATEWAY_CONFIG": str(path), "DATABASE_URL": "postgresql://x/y"}
    with pytest.raises(ConfigError, match=r"^models\[0\]\.deployments\[0\]\.region: provider 'oa' is of type openai; "
                                          r"only bedrock deployments take a region$"):
        load_config(load_settings(environ), environ)


# --------------------------------------------------------------------------- embeddings (InvokeModel)
@pytest.fixture
async def embed_gw(gateway_factory: Any, bedrock: tuple[BedrockFake, str]) -> Gateway:
    _, url = bedrock
    return await gateway_factory(config_yaml=fleet_config(  # type: ignore[no-any-return]
        {"aws": bedrock_provider(url + "/{region}")},
        [{"name": "titan", "deployments": [{"provider": "aws", "model": TITAN, "region": "us-east-1",
                                             "price": EMBED_PRICE}]},
         {"name": "cohere", "deployments": [{"provider": "aws", "model": COHERE, "price": EMBED_PRICE}]},
         {"name": "haiku", "deployments": [{"provider": "aws", "model": HAIKU}]}]))


async def test_titan_embeddings_one_signed_invoke_per_input_billed_from_its_token_counts(
    embed_gw: Gateway, bedrock: tuple[BedrockFake, str], api_key: str, db_pool: asyncpg.Pool
) -> None:
    fake, _ = bedrock
    request_id = f"be-{uuid.uuid4().hex[:10]}"
    client = openai.AsyncOpenAI(base_url=embed_gw.url("/v1"), api_key=api_key, max_retries=0,
                                default_headers={"x-request-id": request_id})
    # The SDK asks for base64 by default: the vectors come back encoded and decode to the fake's.
    answer = await client.embeddings.create(model="titan", input=["alpha beta", "gamma"], dimensions=256)
    assert [d.index for d in answer.data] == [0, 1]
    assert answer.data[0].embedding == pytest.approx(unit_vector("alpha beta", 256), abs=1e-6)
    assert len(answer.data[1].embedding) == 256
    tokens = count_tokens("alpha beta") + count_tokens("gamma")
    assert answer.usage.prompt_tokens == tokens
    calls = fake.state.model_calls()
    assert sorted(c.body["inputText"] for c in calls) == ["alpha beta", "gamma"]
    assert {c.path for c in calls} == {f"/us-east-1/model/{TITAN}/invoke"}
    assert all(c.body["dimensions"] == 256 for c in calls)
    assert [s["region"] for s in fake.signatures] == ["us-east-1", "us-east-1"]
    assert await embed_gw.state.billing.flush()
    row = await db_pool.fetchrow("SELECT * FROM usage_ledger WHERE request_id = $1", request_id)
    assert row["provider"] == "aws" and (row["prompt_tokens"], row["completion_tokens"]) == (tokens, 0)
    assert not row["usage_estimated"] and row["cost_source"] == "price"
    assert row["cost_usd"] == (Decimal(tokens) * 20 / 1_000_000).quantize(Decimal("1e-10"))


async def test_cohere_embeddings_one_invoke_for_all_inputs_tokens_from_the_header(
    embed_gw: Gateway, bedrock: tuple[BedrockFake, str], api_key: str
) -> None:
    fake, _ = bedrock
    resp = await embed_gw.data.post("/v1/embeddings", json={"model": "cohere", "input": ["one", "two two"]},
                                    headers=auth(api_key))
    assert resp.status == 200, await resp.text()
    answer = await resp.json()
    assert [len(d["embedding"]) for d in answer["data"]] == [1024, 1024]
    assert answer["usage"]["prompt_tokens"] == count_tokens("one") + count_tokens("two two")
    (call,) = fake.state.model_calls()
    assert call.path == f"/eu-west-1/model/{COHERE}/invoke"
    assert call.body == {"texts": ["one", "two two"], "input_type": "search_document"}


async def test_bedrock_embeddings_refuse_what_they_cannot_map_and_obey_budgets(
    embed_gw: Gateway, bedrock: tuple[BedrockFake, str], api_key: str, key_factory: Any
) -> None:
    fake, _ = bedrock
    resp = await embed_gw.data.post("/v1/embeddings", json={"model": "haiku", "input": "x"}, headers=auth(api_key))
    assert resp.status == 400 and (await resp.json())["error"]["code"] == "model_not_supported"
    resp = await embed_gw.data.post("/v1/embeddings", json={"model": "titan", "input": [[1, 2, 3]]},
                                    headers=auth(api_key))
    assert resp.status == 400 and "token arrays" in (await resp.json())["error"]["message"]
    resp = await embed_gw.data.post("/v1/embeddings", json={"model": "cohere", "input": ["t"] * 97},
                                    headers=auth(api_key))
    assert resp.status == 400 and "at most 96" in (await resp.json())["error"]["message"]
    spent, _ = await key_factory(budget_usd=Decimal("0"), budget_period="total")
    resp = await embed_gw.data.post("/v1/embeddings", json={"model": "titan", "input": "x"}, headers=auth(spent))
    assert resp.status == 402 and (await resp.json())["error"]["code"] == "budget_exceeded"
    assert fake.state.model_calls() == []


async def test_throttled_embeddings_are_retried_and_keep_their_429(
    embed_gw: Gateway, bedrock: tuple[BedrockFake, str], api_key: str
) -> None:
    fake, _ = bedrock
    fake.state.script.append({"status": 429})
    resp = await embed_gw.data.post("/v1/embeddings", json={"model": "cohere", "input": "x"}, headers=auth(api_key))
    assert resp.status == 200 and len(fake.state.model_calls()) == 2  # the ThrottlingException was retried
    fake.state.script.extend([{"status": 429}] * 10)
    resp = await embed_gw.data.post("/v1/embeddings", json={"model": "cohere", "input": "x"}, headers=auth(api_key))
    assert resp.status == 429 and (await resp.json())["error"]["code"] == "rate_limit_exceeded"


# --------------------------------------------------------------------------- pass-through, re-signed
async def _ledger(gw: Gateway, pool: asyncpg.Pool, request_id: str) -> asyncpg.Record:
    assert await gw.state.billing.flush()
    rows = await pool.fetch("SELECT * FROM usage_ledger WHERE request_id = $1", request_id)
    assert len(rows) == 1, rows
    return rows[0]


@pytest.mark.parametrize("model_in_path", [HAIKU, HAIKU.replace(":", "%3A")])
async def test_passthrough_re_signs_the_forwarded_request_and_bills_its_usage(
    gw: Gateway, bedrock: tuple[BedrockFake, str], api_key: str, db_pool: asyncpg.Pool, model_in_path: str
) -> None:
    fake, _ = bedrock
    request_id = f"bp-{uuid.uuid4().hex[:10]}"
    raw_body = b'{"messages": [{"role": "user", "content": [{"text": "native converse"}]}],  "inferenceConfig": {}}'
    resp = await gw.data.post(f"/passthrough/aws/model/{model_in_path}/converse", data=raw_body, headers={
        **auth(api_key), "Content-Type": "application/json", "x-request-id": request_id, "x-custom": "kept"})
    assert resp.status == 200, await resp.text()
    answer = await resp.json()
    assert answer["output"]["message"]["content"] == [{"text": "This is a mock answer to: native converse"}]
    call = fake.state.model_calls()[-1]
    assert call.path == f"/model/{HAIKU}/converse" and call.body == orjson.loads(raw_body)
    assert call.headers["authorization"].startswith("AWS4-HMAC-SHA256 ") and api_key not in str(call.headers)
    assert call.headers["x-custom"] == "kept"
    assert fake.signatures[-1]["region"] == "eu-west-1"  # recomputed over the body as forwarded
    row = await _ledger(gw, db_pool, request_id)
    assert (row["prompt_tokens"], row["completion_tokens"]) == (answer["usage"]["inputTokens"],
                                                                answer["usage"]["outputTokens"])
    assert row["requested_model"] == HAIKU and row["cost_source"] == "price" and row["cost_usd"] > 0


async def test_passthrough_relays_the_event_stream_byte_for_byte_and_reads_its_usage(
    gw: Gateway, bedrock: tuple[BedrockFake, str], api_key: str, db_pool: asyncpg.Pool
) -> None:
    request_id = f"bs-{uuid.uuid4().hex[:10]}"
    body = {"messages": [{"role": "user", "content": [{"text": "stream it natively"}]}]}
    resp = await gw.data.post(f"/passthrough/aws/model/{HAIKU}/converse-stream", json=body,
                              headers={**auth(api_key), "x-request-id": request_id})
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "application/vnd.amazon.eventstream"
    frames = EventStreamBuffer()
    frames.add_data(await resp.read())  # every frame's CRCs still hold
    events = [(m.headers[":event-type"], orjson.loads(m.payload)) for m in frames]
    text = "".join(p["delta"]["text"] for kind, p in events if kind == "contentBlockDelta")
    assert text == "This is a mock answer to: stream it natively"
    usage = events[-1][1]["usage"]
    row = await _ledger(gw, db_pool, request_id)
    assert row["streamed"] and row["ttft_seconds"] is not None
    assert (row["prompt_tokens"], row["completion_tokens"]) == (usage["inputTokens"], usage["outputTokens"])


async def test_passthrough_invoke_model_is_billed_from_bedrocks_token_headers(
    embed_gw: Gateway, bedrock: tuple[BedrockFake, str], api_key: str, db_pool: asyncpg.Pool
) -> None:
    request_id = f"bi-{uuid.uuid4().hex[:10]}"
    resp = await embed_gw.data.post(f"/passthrough/aws/model/{COHERE}/invoke",
                                    json={"texts": ["native embed"], "input_type": "search_query"},
                                    headers={**auth(api_key), "x-request-id": request_id})
    assert resp.status == 200, await resp.text()
    tokens = int(resp.headers["X-Amzn-Bedrock-Input-Token-Count"])
    assert (await resp.json())["response_type"] == "embeddings_floats"
    row = await _ledger(embed_gw, db_pool, request_id)
    assert (row["prompt_tokens"], row["completion_tokens"]) == (tokens, 0) and tokens > 0
    assert row["requested_model"] == COHERE and row["cost_source"] == "price"


@pytest.mark.parametrize("lifetime", [3600, 840])
async def test_temporary_container_credentials_are_refreshed_when_botocore_says_they_are_due(
    gateway_factory: Any, bedrock: tuple[BedrockFake, str], api_key: str, monkeypatch: pytest.MonkeyPatch,
    lifetime: int,
) -> None:
    fake, url = bedrock
    fake.container_lifetime = lifetime  # 840 s: inside botocore's 15-minute advisory refresh window
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", f"{url}/container-credentials")
    gw = await gateway_factory(config_yaml=fleet_config(
        {"aws": bedrock_provider(url)}, [{"name": "haiku", "deployments": [{"provider": "aws", "model": HAIKU}]}]))
    for _ in range(2):
        resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="haiku"), headers=auth(api_key))
        assert resp.status == 200, await resp.text()
    tokens = [s["token"] for s in fake.signatures]
    assert all(t in fake.state.issued_tokens for t in tokens)
    if lifetime == 3600:
        assert tokens[0] == tokens[1] and len(fake.state.issued_tokens) == 1  # valid: fetched once
    else:
        assert tokens[0] != tokens[1]  # due for refresh: fetched again before the second call


async def test_passthrough_invoke_with_response_stream_relays_chunks_and_bills_the_invocation_metrics(
    gw: Gateway, api_key: str, db_pool: asyncpg.Pool
) -> None:
    request_id = f"bw-{uuid.uuid4().hex[:10]}"
    body = {"anthropic_version": "bedrock-2023-05-31", "max_tokens": 64,
            "messages": [{"role": "user", "content": "invoke and stream"}]}
    resp = await gw.data.post(f"/passthrough/aws/model/{HAIKU}/invoke-with-response-stream", json=body,
                              headers={**auth(api_key), "x-request-id": request_id})
    assert resp.status == 200 and resp.headers["Content-Type"] == "application/vnd.amazon.eventstream"
    frames = EventStreamBuffer()
    frames.add_data(await resp.read())
    events = [orjson.loads(base64.b64decode(orjson.loads(m.payload)["bytes"])) for m in frames]
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
    metrics = events[-1]["amazon-bedrock-invocationMetrics"]
    row = await _ledger(gw, db_pool, request_id)
    assert row["streamed"] and row["requested_model"] == HAIKU
    assert (row["prompt_tokens"], row["completion_tokens"]) == (metrics["inputTokenCount"], metrics["outputTokenCount"])
    assert row["prompt_tokens"] > 0 and row["completion_tokens"] > 0


async def test_a_whole_answer_past_max_response_bytes_is_a_provider_failure(
    gateway_factory: Any, bedrock: tuple[BedrockFake, str], api_key: str
) -> None:
    _, url = bedrock
    gw = await gateway_factory(config_yaml=fleet_config(  # a 1024-float Cohere answer is ~20 KiB
        {"aws": bedrock_provider(url, max_response_bytes=4096, max_retries=0)},
        [{"name": "cohere", "deployments": [{"provider": "aws", "model": COHERE}]}]))
    resp = await gw.data.post("/v1/embeddings", json={"model": "cohere", "input": "x"}, headers=auth(api_key))
    assert resp.status == 502 and (await resp.json())["error"]["code"] == "upstream_unavailable"


def test_translated_embeddings_answer_base64_when_asked() -> None:
    floats = embeddings_list([[0.5, -0.25]], model="m", prompt_tokens=3, body={"input": "x"})
    assert floats["data"][0]["embedding"] == [0.5, -0.25] and floats["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    encoded = embeddings_list([[0.5, -0.25]], model="m", prompt_tokens=3, body={"encoding_format": "base64"})
    assert struct.unpack("<2f", base64.b64decode(encoded["data"][0]["embedding"])) == (0.5, -0.25)
    with pytest.raises(UpstreamAnswerError):
        embeddings_list([["not", "numbers"]], model="m", prompt_tokens=0, body={})


async def test_web_identity_credentials_come_from_sts(
    gateway_factory: Any, bedrock: tuple[BedrockFake, str], api_key: str, monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """EKS IRSA / any OIDC federation: a role and a token file; botocore asks STS."""
    fake, url = bedrock
    token_file = tmp_path / "token"
    token_file.write_text(fake.web_identity_token)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_ROLE_ARN", "arn:aws:iam::123456789012:role/gateway")
    monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(token_file))
    monkeypatch.setenv("AWS_ENDPOINT_URL_STS", f"{url}/sts")
    gw = await gateway_factory(config_yaml=fleet_config(
        {"aws": bedrock_provider(url)}, [{"name": "haiku", "deployments": [{"provider": "aws", "model": HAIKU}]}]))
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="haiku"), headers=auth(api_key))
    assert resp.status == 200, await resp.text()
    (sts,) = [c for c in fake.state.calls if c.path == "/sts"]
    assert sts.body["RoleArn"] == "arn:aws:iam::123456789012:role/gateway"
    assert fake.signatures[-1]["token"] == fake.state.issued_tokens[0] == "web-identity-token-1"
    token_file.write_text("a token STS does not accept")
    fake.signatures.clear()
    gw2 = await gateway_factory(config_yaml=fleet_config(
        {"aws": bedrock_provider(url)}, [{"name": "haiku", "deployments": [{"provider": "aws", "model": HAIKU}]}]))
    resp = await gw2.data.post("/v1/chat/completions", json=chat_body(model="haiku"), headers=auth(api_key))
    assert resp.status == 502 and fake.signatures == []  # no credentials: nothing is sent to Bedrock
    assert (await resp.json())["error"]["code"] == "upstream_unavailable"


def _instance_role_only(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    """The standard chain finds nothing before the instance metadata service, which is the fake's."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_EC2_METADATA_DISABLED",
                 "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"{url}/")


async def test_instance_role_credentials_come_from_the_metadata_service_with_a_session_token(
    gateway_factory: Any, bedrock: tuple[BedrockFake, str], api_key: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """EC2 (or any host with an instance profile): botocore asks IMDSv2 for a session token,
    then the role's name and its temporary credentials, each GET carrying the token, and
    the calls are signed with them (fetched once while valid). Their refresh is botocore's
    ``RefreshableCredentials``, as for container credentials (tested above); for IMDS
    botocore also stretches credentials near their end by a random 12-20 minutes, so a
    refresh cannot be timed here without its clock."""
    fake, url = bedrock
    _instance_role_only(monkeypatch, url)
    gw = await gateway_factory(config_yaml=fleet_config(
        {"aws": bedrock_provider(url)}, [{"name": "haiku", "deployments": [{"provider": "aws", "model": HAIKU}]}]))
    for _ in range(2):
        resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="haiku"), headers=auth(api_key))
        assert resp.status == 200, await resp.text()
    metadata = [c for c in fake.state.calls if c.path.startswith("/latest/")]
    assert (metadata[0].method, metadata[0].path) == ("PUT", "/latest/api/token")
    gets = [c for c in metadata if c.method == "GET"]
    assert [c.path for c in gets[:2]] == ["/latest/meta-data/iam/security-credentials/",
                                          "/latest/meta-data/iam/security-credentials/gateway-instance-role"]
    assert all(c.headers["x-aws-ec2-metadata-token"] in fake.imds_sessions for c in gets)
    tokens = [s["token"] for s in fake.signatures]
    assert tokens == ["imds-token-1", "imds-token-1"] and fake.state.issued_tokens == ["imds-token-1"]


async def test_an_instance_without_a_role_is_no_credentials_and_nothing_is_sent_to_bedrock(
    gateway_factory: Any, bedrock: tuple[BedrockFake, str], api_key: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake, url = bedrock
    fake.imds_role = None  # the metadata service answers, but no instance profile is attached
    _instance_role_only(monkeypatch, url)
    gw = await gateway_factory(config_yaml=fleet_config(
        {"aws": bedrock_provider(url, max_retries=0)},
        [{"name": "haiku", "deployments": [{"provider": "aws", "model": HAIKU}]}]))
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="haiku"), headers=auth(api_key))
    assert resp.status == 502, await resp.text()
    assert (await resp.json())["error"]["code"] == "upstream_unavailable"
    assert fake.signatures == [] and fake.state.model_calls() == []
    assert any(c.path == "/latest/meta-data/iam/security-credentials/" for c in fake.state.calls)


async def test_passthrough_at_a_region_goes_to_that_configured_region_and_no_other(
    gateway_factory: Any, bedrock: tuple[BedrockFake, str], api_key: str, db_pool: asyncpg.Pool
) -> None:
    """``/passthrough/{provider}@{region}/...``: the endpoint and the SigV4 scope of that
    region, when the operator configured it for the provider (its own region, or one of its
    deployments'); any other is a 400 with nothing sent, so a client cannot move its data
    to a region the operator did not choose."""
    fake, url = bedrock
    gw = await gateway_factory(config_yaml=fleet_config(
        {"aws": bedrock_provider(url + "/{region}")},  # one fake endpoint per region
        [{"name": "abroad", "deployments": [{"provider": "aws", "model": HAIKU, "region": "us-east-1",
                                              "price": PRICE}]}]))
    body = {"messages": [{"role": "user", "content": [{"text": "which region"}]}]}
    request_id = f"br-{uuid.uuid4().hex[:10]}"
    resp = await gw.data.post(f"/passthrough/aws@us-east-1/model/{HAIKU}/converse", json=body,
                              headers={**auth(api_key), "x-request-id": request_id})
    assert resp.status == 200, await resp.text()
    own_id = f"bo-{uuid.uuid4().hex[:10]}"
    resp = await gw.data.post(f"/passthrough/aws@eu-west-1/model/{HAIKU}/converse", json=body,
                              headers={**auth(api_key), "x-request-id": own_id})
    assert resp.status == 200, await resp.text()  # the provider's own region, named
    resp = await gw.data.post(f"/passthrough/aws/model/{HAIKU}/converse", json=body, headers=auth(api_key))
    assert resp.status == 200, await resp.text()  # no region: the provider's own
    assert [c.path for c in fake.state.model_calls()] == [
        f"/us-east-1/model/{HAIKU}/converse", f"/eu-west-1/model/{HAIKU}/converse", f"/eu-west-1/model/{HAIKU}/converse"]
    assert [s["region"] for s in fake.signatures] == ["us-east-1", "eu-west-1", "eu-west-1"]
    row = await _ledger(gw, db_pool, request_id)
    assert row["deployment"] == "aws/passthrough@us-east-1" and row["provider"] == "aws"
    assert row["cost_source"] == "price" and row["prompt_tokens"] > 0
    assert (await _ledger(gw, db_pool, own_id))["deployment"] == "aws/passthrough"  # as without it

    fake.signatures.clear()
    resp = await gw.data.post(f"/passthrough/aws@ap-southeast-2/model/{HAIKU}/converse", json=body,
                              headers=auth(api_key))  # a region the fake serves, but not configured here
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["code"] == "region_not_configured" and "eu-west-1, us-east-1" in error["message"]
    assert fake.signatures == [] and len(fake.state.model_calls()) == 3


async def test_passthrough_at_a_region_of_a_provider_without_regions_is_refused(
    gateway_factory: Any, fake: FakeUpstream, api_key: str
) -> None:
    gw = await gateway_factory(config_yaml=fleet_config(
        {"oai": {"type": "openai", "base_url": fake.url, "api_key": "sk-upstream"}},
        [{"name": "m", "deployments": [{"provider": "oai", "model": "test-model"}]}]))
    resp = await gw.data.post("/passthrough/oai@us-east-1/v1/models", headers=auth(api_key))
    assert resp.status == 400
    assert (await resp.json())["error"]["code"] == "region_not_configured"
