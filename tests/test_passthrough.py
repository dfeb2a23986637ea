"""``/passthrough/{provider}/{path}``: the provider's own API relayed unchanged, behind the
gateway's key, allowlist, limits and budget, and billed from a usage object when one
comes back (else zero tokens with cost_source 'passthrough')."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from decimal import Decimal
from typing import Any

import asyncpg
import orjson
import pytest
from aiohttp.test_utils import TestServer

from gateway.protocols.usage_shapes import recognised_usage
from gateway.testing.fake_gemini import GeminiFake
from gateway.testing.fake_gemini import make_app as gemini_app
from tests.conftest import FakeUpstream, Gateway, auth, sse_payloads
from tests.fleet import fleet_config

PRICE = {"input_per_mtok": 1.0, "output_per_mtok": 4.0}


@pytest.fixture
async def upstream(fake_factory: Any) -> FakeUpstream:
    return await fake_factory(require_key="sk-provider-secret")  # type: ignore[no-any-return]


@pytest.fixture
async def gemini() -> AsyncIterator[tuple[GeminiFake, str]]:
    fake = GeminiFake()
    server = TestServer(gemini_app(fake), host="127.0.0.1")
    await server.start_server()
    yield fake, f"http://127.0.0.1:{server.port}"
    await server.close()


@pytest.fixture
async def gw(gateway_factory: Any, upstream: FakeUpstream, gemini: tuple[GeminiFake, str]) -> Gateway:
    return await gateway_factory(config_yaml=fleet_config(  # type: ignore[no-any-return]
        {"openai": {"type": "openai", "base_url": upstream.url, "api_key": "sk-provider-secret"},
         "google": {"type": "gemini", "base_url": gemini[1], "api_key": "gemini-key-1"},
         "local": {"type": "mock"}},
        [{"name": "gpt", "deployments": [{"provider": "openai", "model": "gpt-4o", "price": PRICE}]}]))


def rid() -> str:
    return f"pt-{uuid.uuid4().hex[:10]}"


async def ledger(gw: Gateway, pool: asyncpg.Pool, request_id: str) -> asyncpg.Record:
    assert await gw.state.billing.flush()
    rows = await pool.fetch("SELECT * FROM usage_ledger WHERE request_id = $1", request_id)
    assert len(rows) == 1, rows
    return rows[0]


async def test_a_whole_call_is_relayed_unchanged_with_the_provider_credential_and_billed(
    gw: Gateway, upstream: FakeUpstream, api_key: str, db_pool: asyncpg.Pool
) -> None:
    request_id = rid()
    raw_body = b'{"model": "gpt-4o",   "messages": [{"role": "user", "content": "relay me"}], "odd_field": [1]}'
    resp = await gw.data.post("/passthrough/openai/chat/completions?trace=1", data=raw_body, headers={
        **auth(api_key), "Content-Type": "application/json", "x-request-id": request_id, "x-custom": "kept"})
    assert resp.status == 200, await resp.text()
    answer = await resp.json()
    stats = await upstream.stats()
    last = stats["last_request"]
    assert last["path"] == "/v1/chat/completions"
    assert last["body"] == orjson.loads(raw_body)
    assert last["headers"]["authorization"] == "Bearer sk-provider-secret"  # never the gateway key
    assert last["headers"]["x-custom"] == "kept"
    row = await ledger(gw, db_pool, request_id)
    assert (row["prompt_tokens"], row["completion_tokens"]) == (
        answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"])
    assert row["provider"] == "openai" and row["requested_model"] == "gpt-4o"
    assert row["cost_source"] == "price"
    expected = (row["prompt_tokens"] * Decimal(1) + row["completion_tokens"] * Decimal(4)) / 1_000_000
    assert row["cost_usd"] == expected.quantize(Decimal("1e-10"))


async def test_a_stream_is_relayed_event_by_event_and_its_usage_billed(
    gw: Gateway, api_key: str, db_pool: asyncpg.Pool
) -> None:
    request_id = rid()
    body = {"model": "gpt-4o", "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "stream me"}]}
    resp = await gw.data.post("/passthrough/openai/chat/completions", json=body,
                              headers={**auth(api_key), "x-request-id": request_id})
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    payloads = sse_payloads(await resp.read())
    assert payloads[-1] == b"[DONE]"
    usage = orjson.loads(payloads[-2])["usage"]
    row = await ledger(gw, db_pool, request_id)
    assert row["streamed"] and row["ttft_seconds"] is not None
    assert (row["prompt_tokens"], row["completion_tokens"]) == (usage["prompt_tokens"], usage["completion_tokens"])


async def test_an_answer_without_usage_is_recorded_with_zero_tokens_as_passthrough(
    gw: Gateway, api_key: str, db_pool: asyncpg.Pool
) -> None:
    request_id = rid()
    resp = await gw.data.get("/passthrough/openai/models", headers={**auth(api_key), "x-request-id": request_id})
    assert resp.status == 200
    assert (await resp.json())["object"] == "list"
    row = await ledger(gw, db_pool, request_id)
    assert row["prompt_tokens"] == 0 and row["completion_tokens"] == 0
    assert row["cost_source"] == "passthrough" and row["cost_usd"] == 0
    assert row["requested_model"] == "passthrough/openai"


async def test_gemini_native_calls_get_the_google_key_and_their_usage_metadata_billed(
    gw: Gateway, gemini: tuple[GeminiFake, str], api_key: str, db_pool: asyncpg.Pool
) -> None:
    fake, _ = gemini
    request_id = rid()
    body = {"contents": [{"role": "user", "parts": [{"text": "native call"}]}]}
    resp = await gw.data.post("/passthrough/google/v1beta/models/gemini-2.5-flash:generateContent", json=body,
                              headers={**auth(api_key), "x-request-id": request_id})
    assert resp.status == 200, await resp.text()
    answer = await resp.json()
    assert answer["candidates"][0]["content"]["parts"][0]["text"] == "This is a mock answer to: native call"
    call = fake.state.model_calls()[-1]
    assert call.headers["x-goog-api-key"] == "gemini-key-1" and "authorization" not in call.headers
    row = await ledger(gw, db_pool, request_id)
    assert row["prompt_tokens"] == answer["usageMetadata"]["promptTokenCount"]
    assert row["completion_tokens"] == answer["usageMetadata"]["candidatesTokenCount"]


async def test_provider_errors_are_relayed_with_their_status(gw: Gateway, upstream: FakeUpstream, api_key: str) -> None:
    await upstream.script({"status": 429, "retry_after": 3})
    resp = await gw.data.post("/passthrough/openai/chat/completions", json={"model": "x", "messages": []},
                              headers=auth(api_key))
    assert resp.status == 429 and resp.headers.get("Retry-After") == "3"


async def test_the_keys_allowlist_limits_and_budget_apply(gw: Gateway, key_factory: Any) -> None:
    models_only, _ = await key_factory(allowed_models=("gpt",))
    resp = await gw.data.get("/passthrough/openai/models", headers=auth(models_only))
    assert resp.status == 403
    assert (await resp.json())["error"]["code"] == "provider_not_allowed"
    allowed, _ = await key_factory(allowed_models=("gpt", "passthrough/open*"))
    assert (await gw.data.get("/passthrough/openai/models", headers=auth(allowed))).status == 200
    assert (await gw.data.get("/passthrough/google/v1beta/models", headers=auth(allowed))).status == 403
    one_a_minute, _ = await key_factory(rate_limit_requests=1)
    assert (await gw.data.get("/passthrough/openai/models", headers=auth(one_a_minute))).status == 200
    limited = await gw.data.get("/passthrough/openai/models", headers=auth(one_a_minute))
    assert limited.status == 429 and limited.headers.get("Retry-After")
    broke, _ = await key_factory(budget_usd=Decimal("0"), budget_period="total")
    resp = await gw.data.get("/passthrough/openai/models", headers=auth(broke))
    assert resp.status == 402


async def test_no_key_unknown_provider_and_a_provider_without_a_url(gw: Gateway, api_key: str) -> None:
    assert (await gw.data.get("/passthrough/openai/models")).status == 401
    for name in ("nobody", "local"):
        resp = await gw.data.get(f"/passthrough/{name}/models", headers=auth(api_key))
        assert resp.status == 404
        assert (await resp.json())["error"]["code"] == "provider_not_found"


def test_usage_shapes_of_each_wire() -> None:
    assert recognised_usage({"usage": {"prompt_tokens": 3, "completion_tokens": 4}}) == (3, 4)
    assert recognised_usage({"type": "message_start", "message": {"usage": {
        "input_tokens": 5, "cache_read_input_tokens": 2, "output_tokens": 1}}}) == (7, 1)
    assert recognised_usage({"type": "response.completed", "response": {"usage": {
        "input_tokens": 9, "output_tokens": 8}}}) == (9, 8)
    assert recognised_usage({"usageMetadata": {"promptTokenCount": 6, "candidatesTokenCount": 2,
                                               "thoughtsTokenCount": 3}}) == (6, 5)
    assert recognised_usage({"usage": {"inputTokens": 4, "outputTokens": 6, "cacheReadInputTokens": 1}}) == (5, 6)
    assert recognised_usage({"type": "message_stop", "amazon-bedrock-invocationMetrics": {
        "inputTokenCount": 11, "outputTokenCount": 12, "invocationLatency": 300}}) == (11, 12)
    assert recognised_usage({"embedding": [0.1], "inputTextTokenCount": 7}) == (7, 0)
    assert recognised_usage({"data": []}) is None
