"""What the gateway accepts from a provider's wire: compressed answers, answers too large
to hold, and what a client may learn when the provider cannot be reached."""

from __future__ import annotations

import logging
from typing import Any

import orjson

from tests.conftest import auth, chat_body, sse_payloads
from tests.fleet import dead_url, fleet_config, served_by


def _one(provider: dict[str, Any], model: str = "m") -> str:
    return fleet_config({"up": provider}, [{"name": model, "deployments": [{"provider": "up", "model": model}]}])


def _contents(raw: bytes) -> str:
    text = ""
    for p in sse_payloads(raw):
        if p != b"[DONE]":
            for choice in orjson.loads(p).get("choices") or []:
                text += choice.get("delta", {}).get("content") or ""
    return text


# ----------------------------------------------------------------------------- compression
async def test_the_gateway_asks_providers_for_uncompressed_answers(
    gateway_factory: Any, fake_factory: Any, api_key: str
) -> None:
    fake = await fake_factory(compress="accepted")
    gw = await gateway_factory(config_yaml=_one({"type": "openai", "base_url": fake.url}))
    resp = await gw.data.post("/v1/chat/completions", json=chat_body("one two", model="m"), headers=auth(api_key))
    assert resp.status == 200, await resp.text()
    assert (await fake.stats())["last_request"]["headers"].get("accept-encoding") == "identity"


async def test_answers_compressed_anyway_are_decoded_whole_and_streamed(
    gateway_factory: Any, fake_factory: Any, api_key: str
) -> None:
    fake = await fake_factory(compress="always")
    gw = await gateway_factory(config_yaml=_one({"type": "openai", "base_url": fake.url}))
    resp = await gw.data.post("/v1/chat/completions", json=chat_body("one two", model="m"), headers=auth(api_key))
    assert resp.status == 200, await resp.text()
    answer = await resp.json()
    assert answer["choices"][0]["message"]["content"] == "This is a mock answer to: one two"
    assert answer["usage"]["total_tokens"] > 0
    resp = await gw.data.post(
        "/v1/chat/completions", json=chat_body("one two", model="m", stream=True), headers=auth(api_key)
    )
    raw = await resp.read()
    assert resp.status == 200 and raw.endswith(b"data: [DONE]\n\n"), raw[-300:]
    assert _contents(raw) == "This is a mock answer to: one two"
    resp = await gw.data.post("/v1/embeddings", json={"model": "m", "input": "hi"}, headers=auth(api_key))
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["data"][0]["embedding"]


async def test_anthropic_answers_compressed_anyway_are_decoded(
    gateway_factory: Any, fake_factory: Any, api_key: str
) -> None:
    fake = await fake_factory(compress="always")
    gw = await gateway_factory(config_yaml=_one({"type": "anthropic", "base_url": fake.url[:-3], "api_key": "sk-ant"}))
    resp = await gw.data.post("/v1/chat/completions", json=chat_body("one two", model="m"), headers=auth(api_key))
    assert resp.status == 200, await resp.text()
    assert "one two" in (await resp.json())["choices"][0]["message"]["content"]
    resp = await gw.data.post(
        "/v1/chat/completions", json=chat_body("one two", model="m", stream=True), headers=auth(api_key)
    )
    raw = await resp.read()
    assert resp.status == 200 and raw.endswith(b"data: [DONE]\n\n"), raw[-300:]


# ----------------------------------------------------------------------------- size bound
async def test_a_whole_answer_over_the_providers_bound_is_a_502(
    gateway_factory: Any, fake_factory: Any, api_key: str
) -> None:
    fake = await fake_factory()
    provider = {"type": "openai", "base_url": fake.url, "max_response_bytes": 4096, "max_retries": 0}
    gw = await gateway_factory(config_yaml=_one(provider))
    small = await gw.data.post("/v1/chat/completions", json=chat_body("short", model="m"), headers=auth(api_key))
    assert small.status == 200
    big = await gw.data.post(
        "/v1/chat/completions", json=chat_body("big", model="m", mock_completion_words=2000), headers=auth(api_key)
    )
    assert big.status == 502
    error = (await big.json())["error"]
    assert (error["type"], error["code"]) == ("upstream_error", "upstream_unavailable")


async def test_the_response_bound_is_validated_at_start(gateway_factory: Any, fake_factory: Any) -> None:
    from gateway.core.config import ConfigError

    fake = await fake_factory()
    try:
        await gateway_factory(config_yaml=_one({"type": "openai", "base_url": fake.url, "max_response_bytes": 10}))
    except ConfigError as exc:
        assert "providers.up.max_response_bytes" in str(exc)
    else:
        raise AssertionError("a 10-byte bound was accepted")


# ----------------------------------------------------------------------------- what a client learns
async def test_a_client_never_sees_upstream_addresses_but_the_log_does(
    gateway_factory: Any, api_key: str, caplog: Any
) -> None:
    dead = dead_url()
    host_port = dead.split("//")[1].split("/")[0]
    gw = await gateway_factory(env={"UPSTREAM_MAX_RETRIES": "0"}, config_yaml=_one({"type": "openai", "base_url": dead}))
    with caplog.at_level(logging.WARNING, logger="gateway.upstream"):
        resp = await gw.data.post(
            "/v1/chat/completions", json=chat_body(model="m"), headers={**auth(api_key), "x-request-id": "req-123"}
        )
    assert resp.status == 502
    error = (await resp.json())["error"]
    assert (error["type"], error["code"]) == ("upstream_error", "upstream_unavailable")
    assert host_port not in error["message"] and "127.0.0.1" not in error["message"]
    assert "connect to host" not in error["message"].lower()
    assert "req-123" in error["message"]
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name == "gateway.upstream")
    assert "req-123" in logged and host_port in logged


async def test_a_provider_refusing_our_credential_is_a_502_not_the_clients_401(
    gateway_factory: Any, fake_factory: Any, api_key: str, caplog: Any
) -> None:
    locked = await fake_factory(require_key="sk-right")
    gw = await gateway_factory(config_yaml=_one({"type": "openai", "base_url": locked.url, "api_key": "sk-wrong"}))
    with caplog.at_level(logging.ERROR, logger="gateway.upstream"):
        resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="m"), headers=auth(api_key))
    assert resp.status == 502
    error = (await resp.json())["error"]
    assert (error["type"], error["code"]) == ("upstream_error", "upstream_auth_failed")
    assert any(r.levelno == logging.ERROR and "credential" in r.getMessage() for r in caplog.records)
    metrics = await (await gw.management.get("/metrics")).text()
    assert 'gateway_upstream_auth_failures_total{provider="up"} 1.0' in metrics
    # The same for a stream and for embeddings.
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="m", stream=True), headers=auth(api_key))
    assert resp.status == 502 and (await resp.json())["error"]["code"] == "upstream_auth_failed"
    resp = await gw.data.post("/v1/embeddings", json={"model": "m", "input": "x"}, headers=auth(api_key))
    assert resp.status == 502 and (await resp.json())["error"]["code"] == "upstream_auth_failed"


async def test_a_refused_credential_fails_over_to_a_deployment_whose_key_works(
    gateway_factory: Any, fake_factory: Any, api_key: str
) -> None:
    locked, spare = await fake_factory(require_key="sk-right"), await fake_factory()
    gw = await gateway_factory(config_yaml=fleet_config(
        {"locked": {"type": "openai", "base_url": locked.url, "api_key": "sk-wrong"}, "spare": spare},
        [{"name": "m", "deployments": [{"provider": "locked", "model": "m"}, {"provider": "spare", "model": "m"}]}]))
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="m"), headers=auth(api_key))
    assert resp.status == 200
    assert await served_by(locked, spare) == [1, 1]


# ----------------------------------------------------------------------------- parsed once
class _CountingJson:
    """Stands in for ``orjson`` in a module: counts parses of one exact body."""

    def __init__(self) -> None:
        self.parsed: list[bytes] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(orjson, name)

    def loads(self, data: Any) -> Any:
        self.parsed.append(bytes(data) if isinstance(data, bytes | bytearray | memoryview) else data.encode())
        return orjson.loads(data)


async def test_a_whole_answer_is_parsed_once(
    gateway_factory: Any, fake_factory: Any, api_key: str, monkeypatch: Any
) -> None:
    import gateway.core.usage
    import gateway.providers.openai

    counting = _CountingJson()
    monkeypatch.setattr(gateway.providers.openai, "orjson", counting)
    monkeypatch.setattr(gateway.core.usage, "orjson", counting)
    fake = await fake_factory()
    gw = await gateway_factory(config_yaml=_one({"type": "openai", "base_url": fake.url}))
    for path, body in (
        ("/v1/chat/completions", chat_body("one two", model="m")),
        ("/v1/embeddings", {"model": "m", "input": "one two"}),
    ):
        counting.parsed.clear()
        resp = await gw.data.post(path, json=body, headers=auth(api_key))
        assert resp.status == 200
        answer = await resp.read()
        assert counting.parsed.count(answer) == 1, (path, len(counting.parsed))


# ----------------------------------------------------------------------------- read_whole
async def _served_once(aiohttp_server: Any, handler: Any) -> tuple[Any, str]:
    from aiohttp import web

    app = web.Application()
    app.router.add_get("/", handler)
    server = await aiohttp_server(app)
    return server, str(server.make_url("/"))


async def test_a_body_read_whole_is_the_same_whether_it_came_with_the_headers_or_after(aiohttp_server: Any) -> None:
    # read_whole takes a body that arrived with its headers in one step, and reads one
    # still arriving chunk by chunk: both give every byte, and both hold the bound.
    import asyncio

    import aiohttp
    from aiohttp import web

    from gateway.providers.base import UpstreamBodyTooLarge, read_whole

    body = b'{"answer": "' + b"word " * 400 + b'"}'

    async def whole(_request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    async def in_pieces(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for start in range(0, len(body), 500):
            await response.write(body[start:start + 500])
            await asyncio.sleep(0.01)
        await response.write_eof()
        return response

    for handler in (whole, in_pieces):
        _server, url = await _served_once(aiohttp_server, handler)
        async with aiohttp.ClientSession() as session:
            async with session.get(url) as resp:
                assert await read_whole(resp, 1 << 20) == body
            async with session.get(url) as resp:
                try:
                    await read_whole(resp, len(body) - 1)
                except UpstreamBodyTooLarge:
                    pass
                else:
                    raise AssertionError(f"{handler.__name__}: a body over the bound was read whole")


async def test_a_compressed_body_whose_decoded_size_passes_the_bound_is_refused(aiohttp_server: Any) -> None:
    # The declared length is the compressed one: the bound is held on the decoded bytes,
    # also when they all came with the headers.
    import gzip

    import aiohttp
    from aiohttp import web

    from gateway.providers.base import UpstreamBodyTooLarge, read_whole

    decoded = b"x" * 100_000
    packed = gzip.compress(decoded)

    async def handler(_request: web.Request) -> web.Response:
        return web.Response(body=packed, headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})

    _server, url = await _served_once(aiohttp_server, handler)
    async with aiohttp.ClientSession() as session:
        async with session.get(url) as resp:
            assert resp.content_length == len(packed) < 10_000
            try:
                await read_whole(resp, 10_000)
            except UpstreamBodyTooLarge:
                pass
            else:
                raise AssertionError("a decoded body over the bound was read whole")
        async with session.get(url) as resp:
            assert await read_whole(resp, 200_000) == decoded
