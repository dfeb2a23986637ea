"""Azure OpenAI behind the gateway: URL forms, api-key and Entra credentials, content
filter, throttling and failover, checked through a running gateway against the fake
Azure resource (gateway/testing/fake_azure.py)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from decimal import Decimal
from typing import Any

import asyncpg
import openai
import orjson
import pytest
from aiohttp.test_utils import TestServer

from gateway.core.config import ConfigError, load_config, load_settings
from gateway.providers.azure import azure_retry_after
from gateway.testing.fake_azure import AzureFake, make_app
from tests.conftest import FakeUpstream, Gateway, auth, chat_body, sse_payloads
from tests.fleet import fleet_config, records

PRICE = {"input_per_mtok": 2.5, "output_per_mtok": 10.0}


@pytest.fixture
async def azure() -> AsyncIterator[tuple[AzureFake, str]]:
    fake = AzureFake()
    server = TestServer(make_app(fake), host="127.0.0.1")
    await server.start_server()
    yield fake, f"http://127.0.0.1:{server.port}"
    await server.close()


def azure_providers(url: str) -> dict[str, Any]:
    return {
        "az_key": {"type": "azure", "base_url": url, "api_key": "azure-key-1", "api_version": "2024-10-21"},
        "az_entra": {"type": "azure", "base_url": f"{url}/openai/v1", "tenant_id": "tenant-1",
                     "client_id": "client-1", "client_secret": "secret-1",
                     "token_url": f"{url}/tenant-1/oauth2/v2.0/token"},
    }


@pytest.fixture
async def gw(gateway_factory: Any, azure: tuple[AzureFake, str], fake: FakeUpstream) -> Gateway:
    _, url = azure
    providers = {**azure_providers(url), "backup": fake}
    return await gateway_factory(config_yaml=fleet_config(providers, [  # type: ignore[no-any-return]
        {"name": "gpt", "deployments": [{"provider": "az_key", "model": "gpt-4o-prod", "price": PRICE}]},
        {"name": "gpt-entra", "deployments": [{"provider": "az_entra", "model": "gpt-4o-prod"}]},
        {"name": "embed", "deployments": [{"provider": "az_key", "model": "embed-prod"}]},
        {"name": "embed-v1", "deployments": [{"provider": "az_entra", "model": "embed-prod"}]},
        {"name": "wrong-deployment", "deployments": [{"provider": "az_key", "model": "nope"}]},
        {"name": "mixed", "deployments": [{"provider": "az_key", "model": "gpt-4o-prod", "priority": 0},
                                          {"provider": "backup", "model": "m2", "priority": 1}]},
    ]))


def sdk(gw: Gateway, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url("/v1"), api_key=key, max_retries=0)


# ----------------------------------------------------------------------------- URLs and keys
async def test_dated_api_version_uses_deployment_urls_and_the_api_key_header(
    gw: Gateway, azure: tuple[AzureFake, str], api_key: str
) -> None:
    fake, _ = azure
    answer = await sdk(gw, api_key).chat.completions.create(
        model="gpt", messages=[{"role": "user", "content": "hello azure"}])
    assert answer.choices[0].message.content and answer.usage and answer.usage.prompt_tokens > 0
    (call,) = fake.state.model_calls()
    assert call.path == "/openai/deployments/gpt-4o-prod/chat/completions"
    assert call.query == {"api-version": "2024-10-21"}
    assert call.headers["api-key"] == "azure-key-1" and "authorization" not in call.headers
    assert call.body["messages"] == [{"role": "user", "content": "hello azure"}]


async def test_v1_form_with_an_entra_token_fetched_once_and_reused(
    gw: Gateway, azure: tuple[AzureFake, str], api_key: str
) -> None:
    fake, _ = azure
    client = sdk(gw, api_key)
    for _ in range(2):
        await client.chat.completions.create(model="gpt-entra", messages=[{"role": "user", "content": "hi"}])
    token_calls = [c for c in fake.state.calls if c.path == "/tenant-1/oauth2/v2.0/token"]
    assert len(token_calls) == 1
    assert token_calls[0].body == {"grant_type": "client_credentials", "client_id": "client-1",
                                   "client_secret": "secret-1",
                                   "scope": "https://cognitiveservices.azure.com/.default"}
    calls = fake.state.model_calls()
    assert [c.path for c in calls] == ["/openai/v1/chat/completions"] * 2
    assert all(c.query == {} and c.body["model"] == "gpt-4o-prod" for c in calls)
    assert {c.headers["authorization"] for c in calls} == {"Bearer entra-token-1"}
    assert all("api-key" not in c.headers for c in calls)


async def test_an_entra_token_near_expiry_is_refreshed_before_use(
    gateway_factory: Any, azure: tuple[AzureFake, str], api_key: str
) -> None:
    fake, url = azure
    fake.token_lifetime = 1  # refreshed at half its life
    gw = await gateway_factory(config_yaml=fleet_config(
        azure_providers(url), [{"name": "g", "deployments": [{"provider": "az_entra", "model": "gpt-4o-prod"}]}]))
    client = sdk(gw, api_key)
    await client.chat.completions.create(model="g", messages=[{"role": "user", "content": "one"}])
    await asyncio.sleep(0.6)
    await client.chat.completions.create(model="g", messages=[{"role": "user", "content": "two"}])
    assert [c.headers["authorization"] for c in fake.state.model_calls()] == [
        "Bearer entra-token-1", "Bearer entra-token-2"]


async def test_a_refused_client_secret_is_a_gateway_502_never_leaking_the_secret(
    gateway_factory: Any, azure: tuple[AzureFake, str], api_key: str
) -> None:
    fake, url = azure
    providers = azure_providers(url)
    providers["az_entra"]["client_secret"] = "wrong-secret"
    gw = await gateway_factory(config_yaml=fleet_config(
        providers, [{"name": "g", "deployments": [{"provider": "az_entra", "model": "gpt-4o-prod"}]}]))
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="g"), headers=auth(api_key))
    text = await resp.text()
    assert resp.status == 502, text
    assert "wrong-secret" not in text
    assert not fake.state.model_calls()


async def test_a_wrong_api_key_azure_refuses_is_the_gateways_502_not_the_clients_401(
    gateway_factory: Any, azure: tuple[AzureFake, str], api_key: str
) -> None:
    """Azure refuses our stale credential (401); the client's own key is fine, so it gets
    502 upstream_auth_failed (issue 17 item 4), never Azure's 401 or its message."""
    _, url = azure
    providers = azure_providers(url)
    providers["az_key"]["api_key"] = "stale-key"
    gw = await gateway_factory(config_yaml=fleet_config(
        providers, [{"name": "g", "deployments": [{"provider": "az_key", "model": "gpt-4o-prod"}]}]))
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="g"), headers=auth(api_key))
    assert resp.status == 502
    error = (await resp.json())["error"]
    assert error["code"] == "upstream_auth_failed" and "Access denied" not in error["message"]


async def test_an_unknown_api_version_and_deployment_keep_azures_404(
    gateway_factory: Any, gw: Gateway, azure: tuple[AzureFake, str], api_key: str
) -> None:
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="wrong-deployment"),
                              headers=auth(api_key))
    assert resp.status == 404
    assert (await resp.json())["error"]["code"] == "DeploymentNotFound"
    _, url = azure
    providers = azure_providers(url)
    providers["az_key"]["api_version"] = "2019-01-01"
    gw2 = await gateway_factory(config_yaml=fleet_config(
        providers, [{"name": "g", "deployments": [{"provider": "az_key", "model": "gpt-4o-prod"}]}]))
    resp = await gw2.data.post("/v1/chat/completions", json=chat_body(model="g"), headers=auth(api_key))
    assert resp.status == 404
    assert (await resp.json())["error"]["message"] == "Resource not found"


# ----------------------------------------------------------------------------- streams, embeddings, ledger
async def test_stream_relays_azures_chunks_and_bills_the_usage(
    gw: Gateway, azure: tuple[AzureFake, str], api_key: str, db_pool: asyncpg.Pool
) -> None:
    request_id = f"az-{uuid.uuid4().hex[:10]}"
    resp = await gw.data.post("/v1/chat/completions", json=chat_body("stream this please", model="gpt", stream=True),
                              headers={**auth(api_key), "x-request-id": request_id})
    assert resp.status == 200
    payloads = sse_payloads(await resp.read())
    assert payloads[-1] == b"[DONE]"
    chunks = [orjson.loads(p) for p in payloads[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text.startswith("This is a mock answer")
    assert not any(c.get("usage") for c in chunks)  # the client did not ask for usage
    assert await gw.state.billing.flush()
    row = await db_pool.fetchrow("SELECT * FROM usage_ledger WHERE request_id = $1", request_id)
    assert row["provider"] == "az_key" and row["streamed"]
    assert row["prompt_tokens"] > 0 and row["completion_tokens"] > 0 and not row["usage_estimated"]
    expected = (row["prompt_tokens"] * Decimal("2.5") + row["completion_tokens"] * Decimal("10")) / 1_000_000
    assert row["cost_usd"] == expected.quantize(Decimal("1e-10")) and row["cost_source"] == "price"


async def test_embeddings_in_both_url_forms(gw: Gateway, azure: tuple[AzureFake, str], api_key: str) -> None:
    fake, _ = azure
    client = sdk(gw, api_key)
    first = await client.embeddings.create(model="embed", input=["a", "b"])
    second = await client.embeddings.create(model="embed-v1", input="c")
    assert len(first.data) == 2 and len(second.data) == 1
    paths = [(c.path, c.query) for c in fake.state.model_calls()]
    assert paths == [("/openai/deployments/embed-prod/embeddings", {"api-version": "2024-10-21"}),
                     ("/openai/v1/embeddings", {})]


async def test_tools_pass_through_to_azure(gw: Gateway, azure: tuple[AzureFake, str], api_key: str) -> None:
    fake, _ = azure
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    await sdk(gw, api_key).chat.completions.create(
        model="gpt", messages=[{"role": "user", "content": "x"}], tools=tools, tool_choice="auto")  # type: ignore[arg-type]
    body = fake.state.model_calls()[-1].body
    assert body["tools"] == tools and body["tool_choice"] == "auto"


# ----------------------------------------------------------------------------- errors and throttling
async def test_content_filter_block_is_a_clear_400(gw: Gateway, azure: tuple[AzureFake, str], api_key: str) -> None:
    fake, _ = azure
    fake.state.script.append({"content_filter": True})
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="mixed"), headers=auth(api_key))
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["code"] == "content_filter" and error["type"] == "invalid_request_error"
    assert "content filter blocked the prompt (violence)" in error["message"]
    assert len(fake.state.model_calls()) == 1  # a 400 is the client's: no failover to the backup


async def test_429_cools_the_azure_deployment_for_retry_after_ms_and_fails_over(
    gw: Gateway, azure: tuple[AzureFake, str], fake: FakeUpstream, api_key: str
) -> None:
    azure_fake, _ = azure
    calls = records(gw)
    azure_fake.state.script.append({"status": 429, "headers": {"retry-after-ms": "45000", "retry-after": "1",
                                                               "x-ratelimit-remaining-requests": "0"}})
    client = sdk(gw, api_key)
    first = await client.chat.completions.create(model="mixed", messages=[{"role": "user", "content": "1"}])
    second = await client.chat.completions.create(model="mixed", messages=[{"role": "user", "content": "2"}])
    assert first.model == second.model == "m2"  # served by the backup
    assert len(azure_fake.state.model_calls()) == 1  # cooled: the second call went straight to the backup
    assert calls[0].failovers == 1 and calls[0].provider == "backup"


def test_azure_retry_after_prefers_the_most_precise_header() -> None:
    assert azure_retry_after({"retry-after-ms": "1500", "retry-after": "9"}) == 2
    assert azure_retry_after({"retry-after": "7"}) == 7
    assert azure_retry_after({"x-ratelimit-reset-requests": "3s"}) == 3
    assert azure_retry_after({"retry-after": "soon"}) is None
    assert azure_retry_after({}) is None


# ----------------------------------------------------------------------------- config
def _load(tmp_path: Any, provider: dict[str, Any]) -> Any:
    path = tmp_path / "g.yaml"
    path.write_text(fleet_config({"p": provider}, [{"name": "m", "deployments": [{"provider": "p", "model": "d"}]}]))
    environ = {"GATEWAY_CONFIG": str(path), "DATABASE_URL": "postgresql://x/y"}
    return load_config(load_settings(environ), environ)


def test_config_of_azure_providers(tmp_path: Any) -> None:
    config = _load(tmp_path, {"type": "azure", "base_url": "https://r.openai.azure.com", "api_key": "k",
                              "api_version": "2024-10-21"})
    assert config.providers["p"].option("api_version") == "2024-10-21"
    with pytest.raises(ConfigError, match=r"providers\.p\.tenant_id: required for Microsoft Entra"):
        _load(tmp_path, {"type": "azure", "base_url": "https://r.openai.azure.com"})
    with pytest.raises(ConfigError, match=r"providers\.p\.client_secret: required"):
        _load(tmp_path, {"type": "azure", "base_url": "https://r", "tenant_id": "t", "client_id": "c"})
    with pytest.raises(ConfigError, match=r"providers\.p\.tenant_id: set api_key or Microsoft Entra"):
        _load(tmp_path, {"type": "azure", "base_url": "https://r", "api_key": "k", "tenant_id": "t"})
    with pytest.raises(ConfigError, match=r"providers\.p\.api_version: unknown key"):
        _load(tmp_path, {"type": "openai", "base_url": "https://r", "api_key": "k", "api_version": "v1"})
