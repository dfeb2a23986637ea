"""Gemini on Vertex AI behind the gateway: project / location URLs, an OAuth2 access token
from a service-account key (a JWT the fake token endpoint verifies), refreshed before
expiry, chat and streams, failover; checked against gateway/testing/fake_vertex.py."""

from __future__ import annotations

import json
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
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from google.auth.compute_engine import _metadata

from gateway.core import extras
from gateway.core.config import ConfigError, load_config, load_settings
from gateway.core.tokens import count_tokens
from gateway.providers.vertex import VertexProvider
from gateway.testing.fake_vendor import unit_vector
from gateway.testing.fake_vertex import VertexFake, make_app
from tests.conftest import FakeUpstream, Gateway, auth, chat_body, sse_payloads
from tests.fleet import fleet_config, records

MODELS_PATH = "/v1/projects/fake-project/locations/europe-west4/publishers/google/models"


@pytest.fixture(scope="module")
def signing_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture
async def vertex(signing_key: rsa.RSAPrivateKey) -> AsyncIterator[tuple[VertexFake, str]]:
    fake = VertexFake(public_key=signing_key.public_key())
    server = TestServer(make_app(fake), host="127.0.0.1")
    await server.start_server()
    yield fake, f"http://127.0.0.1:{server.port}"
    await server.close()


def service_account_file(tmp_path: Path, key: rsa.RSAPrivateKey, token_uri: str, email: str) -> str:
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption()).decode()
    path = tmp_path / f"sa-{uuid.uuid4().hex[:6]}.json"
    path.write_text(json.dumps({
        "type": "service_account", "project_id": "fake-project", "private_key_id": "k1", "private_key": pem,
        "client_email": email, "client_id": "1", "token_uri": token_uri,
    }))
    return str(path)


def vertex_provider(url: str, credentials: str, **extra: Any) -> dict[str, Any]:
    return {"type": "vertex", "base_url": url, "project": "fake-project", "location": "europe-west4",
            "credentials_file": credentials, **extra}


@pytest.fixture
async def gw(gateway_factory: Any, vertex: tuple[VertexFake, str], fake: FakeUpstream, tmp_path: Path,
             signing_key: rsa.RSAPrivateKey) -> Gateway:
    vfake, url = vertex
    credentials = service_account_file(tmp_path, signing_key, f"{url}/token", vfake.client_email)
    return await gateway_factory(config_yaml=fleet_config(  # type: ignore[no-any-return]
        {"gcp": vertex_provider(url, credentials), "backup": fake},
        [{"name": "flash", "deployments": [{"provider": "gcp", "model": "gemini-2.5-flash",
                                            "price": {"input_per_mtok": 0.3, "output_per_mtok": 2.5}}]},
         {"name": "mixed", "deployments": [{"provider": "gcp", "model": "gemini-2.5-flash", "priority": 0},
                                           {"provider": "backup", "model": "m2", "priority": 1}]}]))


def sdk(gw: Gateway, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url("/v1"), api_key=key, max_retries=0)


async def test_chat_goes_to_the_project_location_url_with_a_service_account_token(
    gw: Gateway, vertex: tuple[VertexFake, str], api_key: str
) -> None:
    fake, _ = vertex
    client = sdk(gw, api_key)
    for text in ("one", "two"):
        answer = await client.chat.completions.create(model="flash", messages=[{"role": "user", "content": text}])
        assert answer.choices[0].message.content == f"This is a mock answer to: {text}"
    token_calls = [c for c in fake.state.calls if c.path == "/token"]
    assert len(token_calls) == 1  # fetched once, reused while valid
    assert token_calls[0].body["grant_type"] == "urn:ietf:params:oauth:grant-type:jwt-bearer"
    calls = fake.state.model_calls()
    assert [c.path for c in calls] == [f"{MODELS_PATH}/gemini-2.5-flash:generateContent"] * 2
    assert {c.headers["authorization"] for c in calls} == {"Bearer ya29.fake-1"}
    assert all("x-goog-api-key" not in c.headers for c in calls)


async def test_a_token_about_to_expire_is_refreshed_first(
    gateway_factory: Any, vertex: tuple[VertexFake, str], api_key: str, tmp_path: Path,
    signing_key: rsa.RSAPrivateKey,
) -> None:
    fake, url = vertex
    fake.token_lifetime = 60  # inside google-auth's refresh margin: never reused
    credentials = service_account_file(tmp_path, signing_key, f"{url}/token", fake.client_email)
    gw = await gateway_factory(config_yaml=fleet_config(
        {"gcp": vertex_provider(url, credentials)},
        [{"name": "flash", "deployments": [{"provider": "gcp", "model": "gemini-2.5-flash"}]}]))
    for _ in range(2):
        resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="flash"), headers=auth(api_key))
        assert resp.status == 200
    assert [c.headers["authorization"] for c in fake.state.model_calls()] == [
        "Bearer ya29.fake-1", "Bearer ya29.fake-2"]


async def test_a_key_the_token_endpoint_rejects_is_a_502_and_no_model_call(
    gateway_factory: Any, vertex: tuple[VertexFake, str], api_key: str, tmp_path: Path
) -> None:
    fake, url = vertex
    other_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    credentials = service_account_file(tmp_path, other_key, f"{url}/token", fake.client_email)
    gw = await gateway_factory(config_yaml=fleet_config(
        {"gcp": vertex_provider(url, credentials)},
        [{"name": "flash", "deployments": [{"provider": "gcp", "model": "gemini-2.5-flash"}]}]))
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="flash"), headers=auth(api_key))
    assert resp.status == 502
    assert "PRIVATE KEY" not in await resp.text()
    assert fake.state.issued_tokens == [] and fake.state.model_calls() == []


async def test_stream_and_ledger(gw: Gateway, vertex: tuple[VertexFake, str], api_key: str,
                                 db_pool: asyncpg.Pool) -> None:
    fake, _ = vertex
    request_id = f"vx-{uuid.uuid4().hex[:10]}"
    resp = await gw.data.post("/v1/chat/completions", json=chat_body("stream on vertex", model="flash", stream=True),
                              headers={**auth(api_key), "x-request-id": request_id})
    assert resp.status == 200
    payloads = sse_payloads(await resp.read())
    assert payloads[-1] == b"[DONE]"
    text = "".join(orjson.loads(p)["choices"][0]["delta"].get("content") or "" for p in payloads[:-1])
    assert text == "This is a mock answer to: stream on vertex"
    call = fake.state.model_calls()[-1]
    assert call.path == f"{MODELS_PATH}/gemini-2.5-flash:streamGenerateContent" and call.query == {"alt": "sse"}
    assert await gw.state.billing.flush()
    row = await db_pool.fetchrow("SELECT * FROM usage_ledger WHERE request_id = $1", request_id)
    assert row["provider"] == "gcp" and row["completion_tokens"] == 9 and row["cost_source"] == "price"


async def test_429_fails_over_from_vertex_to_another_vendor(
    gw: Gateway, vertex: tuple[VertexFake, str], api_key: str
) -> None:
    fake, _ = vertex
    calls = records(gw)
    fake.state.script.append({"status": 429, "retry_delay": "30s"})
    client = sdk(gw, api_key)
    first = await client.chat.completions.create(model="mixed", messages=[{"role": "user", "content": "1"}])
    second = await client.chat.completions.create(model="mixed", messages=[{"role": "user", "content": "2"}])
    assert first.model == second.model == "m2"
    assert len(fake.state.model_calls()) == 1 and calls[0].failovers == 1


def _load(tmp_path: Path, provider: dict[str, Any]) -> Any:
    path = tmp_path / "g.yaml"
    path.write_text(fleet_config({"gcp": provider}, [{"name": "m", "deployments": [{"provider": "gcp", "model": "x"}]}]))
    environ = {"GATEWAY_CONFIG": str(path), "DATABASE_URL": "postgresql://x/y"}
    return load_config(load_settings(environ), environ)


def test_vertex_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = _load(tmp_path, {"type": "vertex", "project": "p", "location": "global"})
    assert config.providers["gcp"].option("location") == "global"
    with pytest.raises(ConfigError, match=r"providers\.gcp\.project: required for type vertex"):
        _load(tmp_path, {"type": "vertex"})
    monkeypatch.setitem(extras.EXTRAS, "vertex", ("no_such_module_for_this_test",))
    with pytest.raises(ConfigError, match=r"^providers\.gcp\.type: vertex needs the vertex extra "
                                          r"\(pip install 'llm-gateway\[vertex\]'\)$"):
        _load(tmp_path, {"type": "vertex", "project": "p"})


async def test_the_default_endpoint_follows_the_location(tmp_path: Path) -> None:
    config = _load(tmp_path, {"type": "vertex", "project": "p", "location": "asia-northeast1"})
    async with aiohttp.ClientSession() as session:
        built = VertexProvider(config.providers["gcp"], session, request_timeout=5)
        assert built.url("gemini-2.5-flash", "generateContent") == (
            "https://asia-northeast1-aiplatform.googleapis.com/v1/projects/p/locations/asia-northeast1/"
            "publishers/google/models/gemini-2.5-flash:generateContent")


async def test_claude_on_vertex_uses_the_anthropic_publisher_and_messages_wire(
    gateway_factory: Any, vertex: tuple[VertexFake, str], api_key: str, tmp_path: Path,
    signing_key: rsa.RSAPrivateKey,
) -> None:
    fake, url = vertex
    credentials = service_account_file(tmp_path, signing_key, f"{url}/token", fake.client_email)
    gw = await gateway_factory(config_yaml=fleet_config(
        {"gcp": vertex_provider(url, credentials)},
        [{"name": "claude", "deployments": [{"provider": "gcp", "model": "claude-sonnet-4-5@20250929"}]}]))
    client = sdk(gw, api_key)
    answer = await client.chat.completions.create(
        model="claude", messages=[{"role": "system", "content": "Brief."}, {"role": "user", "content": "hi claude"}])
    assert answer.choices[0].message.content and answer.usage and answer.usage.prompt_tokens > 0
    call = fake.state.model_calls()[-1]
    anthropic_path = "/v1/projects/fake-project/locations/europe-west4/publishers/anthropic/models"
    assert call.path == f"{anthropic_path}/claude-sonnet-4-5@20250929:rawPredict"
    assert call.body["anthropic_version"] == "vertex-2023-10-16" and "model" not in call.body
    assert call.body["system"] == "Brief." and call.headers["authorization"].startswith("Bearer ya29.fake-")
    stream = await client.chat.completions.create(
        model="claude", messages=[{"role": "user", "content": "stream claude"}], stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == answer.choices[0].message.content.replace("hi claude", "stream claude")
    assert fake.state.model_calls()[-1].path == f"{anthropic_path}/claude-sonnet-4-5@20250929:streamRawPredict"


async def test_embeddings_go_to_predict_and_are_billed_from_vertex_token_counts(
    gateway_factory: Any, vertex: tuple[VertexFake, str], api_key: str, tmp_path: Path,
    signing_key: rsa.RSAPrivateKey, db_pool: asyncpg.Pool, key_factory: Any,
) -> None:
    fake, url = vertex
    credentials = service_account_file(tmp_path, signing_key, f"{url}/token", fake.client_email)
    gw = await gateway_factory(config_yaml=fleet_config(
        {"gcp": vertex_provider(url, credentials)},
        [{"name": "embed", "deployments": [{"provider": "gcp", "model": "text-embedding-005",
                                             "price": {"input_per_mtok": 25.0, "output_per_mtok": 0.0}}]}]))
    request_id = f"ve-{uuid.uuid4().hex[:10]}"
    client = openai.AsyncOpenAI(base_url=gw.url("/v1"), api_key=api_key, max_retries=0,
                                default_headers={"x-request-id": request_id})
    answer = await client.embeddings.create(model="embed", input=["first text", "second"], dimensions=64)
    assert [d.index for d in answer.data] == [0, 1]
    assert answer.data[0].embedding == pytest.approx(unit_vector("first text", 64), abs=1e-6)
    tokens = count_tokens("first text") + count_tokens("second")
    assert answer.usage.prompt_tokens == tokens
    (call,) = fake.state.model_calls()
    assert call.path == f"{MODELS_PATH}/text-embedding-005:predict"
    assert call.body == {"instances": [{"content": "first text"}, {"content": "second"}],
                         "parameters": {"outputDimensionality": 64}}
    assert call.headers["authorization"] == f"Bearer {fake.state.issued_tokens[0]}"
    assert await gw.state.billing.flush()
    row = await db_pool.fetchrow("SELECT * FROM usage_ledger WHERE request_id = $1", request_id)
    assert (row["prompt_tokens"], row["completion_tokens"]) == (tokens, 0) and not row["usage_estimated"]
    assert row["cost_usd"] == (Decimal(tokens) * 25 / 1_000_000).quantize(Decimal("1e-10"))
    # Google's refusal keeps its status; bad input is ours; a spent budget stops the call.
    resp = await gw.data.post("/v1/embeddings", json={"model": "embed", "input": ["x"] * 251}, headers=auth(api_key))
    error = (await resp.json())["error"]
    assert resp.status == 400 and error["code"] == "invalid_request" and "250" in error["message"]
    before = len(fake.state.model_calls())
    fake.state.script.append({"status": 429})
    resp = await gw.data.post("/v1/embeddings", json={"model": "embed", "input": "x"}, headers=auth(api_key))
    assert resp.status == 200 and len(fake.state.model_calls()) == before + 2  # RESOURCE_EXHAUSTED retried
    resp = await gw.data.post("/v1/embeddings", json={"model": "embed", "input": [[1, 2]]}, headers=auth(api_key))
    assert resp.status == 400 and "token arrays" in (await resp.json())["error"]["message"]
    broke, _ = await key_factory(budget_usd=Decimal("0"), budget_period="total")
    calls = len(fake.state.model_calls())
    resp = await gw.data.post("/v1/embeddings", json={"model": "embed", "input": "x"}, headers=auth(broke))
    assert resp.status == 402 and len(fake.state.model_calls()) == calls


async def test_without_a_key_file_the_metadata_servers_token_is_used(
    gateway_factory: Any, vertex: tuple[VertexFake, str], api_key: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Application Default Credentials on GCE / GKE / Cloud Run: no key file, no gcloud
    login, so google-auth finds the metadata server and takes its service account's token."""
    fake, url = vertex
    host = url.removeprefix("http://")
    for name in ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "no-gcloud"))
    monkeypatch.setenv("GCE_METADATA_IP", host)
    monkeypatch.setattr(_metadata, "_GCE_METADATA_HOST", host)  # google-auth reads it once, at import
    provider = {"type": "vertex", "base_url": url, "project": "fake-project", "location": "europe-west4"}
    gw = await gateway_factory(config_yaml=fleet_config(
        {"gcp": provider}, [{"name": "flash", "deployments": [{"provider": "gcp", "model": "gemini-2.5-flash"}]}]))
    for _ in range(2):
        resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="flash"), headers=auth(api_key))
        assert resp.status == 200, await resp.text()
    (token,) = fake.state.issued_tokens  # fetched once, then reused while valid
    assert [c.headers["authorization"] for c in fake.state.model_calls()] == [f"Bearer {token}"] * 2
    metadata = [c for c in fake.state.calls if c.path.startswith("/computeMetadata/")]
    assert any(c.path.endswith("/service-accounts/default/token") for c in metadata)
    assert all(c.headers.get("metadata-flavor") == "Google" for c in metadata)
