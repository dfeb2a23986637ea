"""The chat-completions proxy end to end: gateway in-process, fake provider over loopback."""

from __future__ import annotations

import asyncio
from typing import Any
from unittest import mock

import orjson
import pytest
from aiohttp import web
from aiohttp.streams import StreamReader
from aiohttp.test_utils import make_mocked_request

from gateway.core.errors import RequestTooLarge
from gateway.http.bodies import read_body
from tests.conftest import FakeUpstream, Gateway, auth, chat_body, sse_payloads


async def test_non_streaming_call_relays_the_provider_answer(gateway: Gateway, fake: FakeUpstream, api_key: str) -> None:
    resp = await gateway.data.post("/v1/chat/completions", json=chat_body("hello there world", temperature=0.3), headers=auth(api_key))
    assert resp.status == 200
    body = await resp.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"].startswith("This is a mock answer to: hello there world")
    assert body["usage"]["prompt_tokens"] > 0 and body["usage"]["completion_tokens"] > 0
    assert resp.headers["x-request-id"]
    stats = await fake.stats()
    upstream = stats["last_request"]
    # The provider credential is added server-side; the client's key never goes upstream.
    assert upstream["headers"]["authorization"] == "Bearer sk-fake-provider-secret"
    assert api_key not in orjson.dumps(upstream).decode()
    # Every field the gateway does not validate reaches the provider unchanged.
    assert upstream["body"]["temperature"] == 0.3


async def test_stream_is_relayed_byte_for_byte(gateway: Gateway, fake: FakeUpstream, api_key: str) -> None:
    body = chat_body("one two three four", stream=True, stream_options={"include_usage": True})
    direct = await fake.session.post(f"{fake.url}/chat/completions", json=body)
    direct_raw = await direct.read()
    resp = await gateway.data.post("/v1/chat/completions", json=body, headers=auth(api_key))
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    raw = await resp.read()

    def normalise(data: bytes) -> list[Any]:
        out = []
        for p in sse_payloads(data):
            if p == b"[DONE]":
                out.append("[DONE]")
                continue
            obj = orjson.loads(p)
            obj.pop("id"), obj.pop("created")  # per-call values
            out.append(obj)
        return out

    assert normalise(raw) == normalise(direct_raw)
    assert raw.endswith(b"data: [DONE]\n\n")


async def test_usage_chunk_hidden_when_client_did_not_ask(gateway: Gateway, fake: FakeUpstream, api_key: str) -> None:
    resp = await gateway.data.post("/v1/chat/completions", json=chat_body("a b c", stream=True), headers=auth(api_key))
    raw = await resp.read()
    payloads = [orjson.loads(p) for p in sse_payloads(raw) if p != b"[DONE]"]
    assert payloads and all(p["choices"] for p in payloads)
    assert all("usage" not in p for p in payloads)
    # ... while the provider was asked for usage so the gateway can record it.
    stats = await fake.stats()
    assert stats["last_request"]["body"]["stream_options"] == {"include_usage": True}


async def test_missing_unknown_and_malformed_keys_get_one_401(gateway: Gateway) -> None:
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic abc"}, auth("llmg_x' OR 1=1; --"),
                    auth("llmg_" + "x" * 43), {"x-api-key": "llmg_" + "é" * 40}, auth("llmg_" + "a" * 10_000)):
        resp = await gateway.data.post("/v1/chat/completions", json=chat_body(), headers=headers)
        assert resp.status == 401
        assert await resp.json() == {"error": {"message": "invalid API key", "type": "authentication_error", "code": "invalid_api_key"}}


async def test_x_api_key_header_is_accepted(gateway: Gateway, api_key: str) -> None:
    resp = await gateway.data.post("/v1/chat/completions", json=chat_body(), headers={"x-api-key": api_key})
    assert resp.status == 200


async def test_revoked_and_expired_keys_fail(gateway: Gateway, key_factory: Any, db_pool: Any) -> None:
    raw, record = await key_factory()
    assert (await gateway.data.post("/v1/chat/completions", json=chat_body(), headers=auth(raw))).status == 200
    await db_pool.execute("UPDATE api_keys SET expires_at = now() - interval '1 second' WHERE api_key_id = $1", record.api_key_id)
    await asyncio.sleep(0.3)  # the NOTIFY evicts the cached key
    assert (await gateway.data.post("/v1/chat/completions", json=chat_body(), headers=auth(raw))).status == 401


async def test_validation_errors(gateway: Gateway, api_key: str) -> None:
    cases = [
        (b"{not json", "invalid_json"),
        (b"[1,2]", "invalid_json"),
        (orjson.dumps({"messages": [{"role": "user", "content": "x"}]}), "invalid_model"),
        (orjson.dumps({"model": "", "messages": [{"role": "user"}]}), "invalid_model"),
        (orjson.dumps({"model": "m", "messages": []}), "invalid_messages"),
        (orjson.dumps({"model": "m", "messages": [{"content": "x"}]}), "invalid_messages"),
        (orjson.dumps({"model": "m", "messages": [{"role": 1}]}), "invalid_messages"),
        (orjson.dumps({"model": "m", "messages": [{"role": "user"}], "stream": "yes"}), "invalid_stream"),
    ]
    for raw, code in cases:
        resp = await gateway.data.post("/v1/chat/completions", data=raw, headers=auth(api_key))
        assert resp.status == 400, raw
        body = await resp.json()
        assert body["error"]["type"] == "invalid_request_error"
        assert body["error"]["code"] == code


async def test_body_over_the_limit_is_413(gateway_factory: Any, fake: FakeUpstream, api_key: str) -> None:
    from tests.conftest import config_for

    gw = await gateway_factory(env={"REQUEST_BODY_LIMIT_BYTES": "2000"}, config_yaml=config_for(fake.url))
    resp = await gw.data.post("/v1/chat/completions", json=chat_body("x" * 5000), headers=auth(api_key))
    assert resp.status == 413
    assert (await resp.json())["error"]["code"] == "request_too_large"


@pytest.mark.parametrize("chunks", [[b'{"a": 1}'], [b'{"a":', b' 1}', b" "], [], [b"x" * 1500], [b"x" * 700] * 3])
async def test_a_body_all_here_is_read_as_request_read_reads_it(chunks: list[bytes]) -> None:
    """read_body takes a body that has all arrived without request.read(): the same bytes,
    the same refusals (over its limit; over aiohttp's cap, the 413 the error layer renders)."""

    def request() -> web.Request:
        payload = StreamReader(mock.Mock(_reading_paused=False), 2**16, loop=asyncio.get_running_loop())
        for chunk in chunks:
            payload.feed_data(chunk)
        payload.feed_eof()
        return make_mocked_request("POST", "/v1/chat/completions", payload=payload, client_max_size=2000)

    for limit in (1000, 5000):
        try:
            raw = await request().read()
            expected: bytes | str = f"over {limit}" if len(raw) > limit else raw
        except web.HTTPRequestEntityTooLarge:
            expected = str(RequestTooLarge())  # what error_answer makes of it
        try:
            got: bytes | str = await read_body(request(), limit)
        except RequestTooLarge as exc:
            got = f"over {limit}" if str(exc) == f"request body over {limit} bytes" else str(exc)
        assert got == expected, (limit, len(b"".join(chunks)))


async def test_request_id_is_kept_or_made(gateway: Gateway, api_key: str) -> None:
    resp = await gateway.data.get("/healthz", headers={"x-request-id": "client-id-42"})
    assert resp.headers["x-request-id"] == "client-id-42"
    resp = await gateway.data.get("/healthz", headers={"x-request-id": "bad id with spaces"})
    assert resp.headers["x-request-id"] != "bad id with spaces"
    resp = await gateway.data.post("/v1/chat/completions", json=chat_body(stream=True), headers={**auth(api_key), "x-request-id": "stream-id"})
    assert resp.headers["x-request-id"] == "stream-id"
    assert resp.headers["X-Content-Type-Options"] == "nosniff"


async def test_healthz_is_exactly_ok(gateway: Gateway) -> None:
    resp = await gateway.data.get("/healthz")
    assert resp.status == 200 and await resp.json() == {"status": "ok"}
    resp = await gateway.management.get("/healthz")
    assert resp.status == 200 and await resp.json() == {"status": "ok"}


async def test_readyz_reports_ok(gateway: Gateway) -> None:
    for _ in range(50):
        resp = await gateway.data.get("/readyz")
        if resp.status == 200:
            break
        await asyncio.sleep(0.05)
    assert resp.status == 200
