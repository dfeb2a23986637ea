"""Tests of the deterministic fake LLM and the standalone fake provider."""

from __future__ import annotations

import asyncio
import base64
import struct
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestClient
from pytest_aiohttp import AiohttpClient

from gateway.testing.fake_llm import (
    DONE_EVENT,
    anthropic_stream_events,
    completion,
    completion_text,
    encode_event,
    prompt_tokens,
    stream_chunks,
)
from gateway.testing.fake_provider import FakeConfig, make_app

CHAT = "/v1/chat/completions"
BODY: dict[str, Any] = {
    "model": "gpt-fake",
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Tell me about the weather in Paris on a sunny spring day please"},
    ],
}


def sse_data(raw: bytes) -> list[bytes]:
    """Return the ``data:`` payloads of an SSE byte stream, in order."""
    out = []
    for event in raw.split(b"\n\n"):
        for line in event.split(b"\n"):
            if line.startswith(b"data: "):
                out.append(line[len(b"data: ") :])
    return out


def sse_events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """Return the ``(event, data)`` pairs of an Anthropic SSE byte stream."""
    out = []
    for event in raw.split(b"\n\n"):
        if not event.strip():
            continue
        name, data = event.split(b"\n")
        assert name.startswith(b"event: ") and data.startswith(b"data: ")
        out.append((name[7:].decode(), orjson.loads(data[6:])))
    return out


async def fake(aiohttp_client: AiohttpClient, config: FakeConfig | None = None) -> TestClient[Any, Any]:
    """Start the fake provider and return a client of it."""
    return await aiohttp_client(make_app(config))


async def stats(client: TestClient[Any, Any]) -> dict[str, Any]:
    """Return the fake provider's statistics."""
    async with client.get("/_fake/stats") as resp:
        assert resp.status == 200
        result: dict[str, Any] = await resp.json()
        return result


async def script(client: TestClient[Any, Any], *steps: dict[str, Any]) -> None:
    """Append steps to the fake provider's script."""
    async with client.post("/_fake/script", json={"steps": list(steps)}) as resp:
        assert resp.status == 200, await resp.text()


# --------------------------------------------------------------------------- pure functions


def test_prompt_tokens_counts_text_parts_and_per_message_overhead() -> None:
    messages = [
        {"role": "user", "content": "one two three"},
        {"role": "user", "content": [{"type": "text", "text": "four five"}, {"type": "image_url"}]},
    ]
    assert prompt_tokens(messages) == 3 + 3 + 2 + 3


@pytest.mark.parametrize("n_chunks", [None, 1, 2, 3, 5, 1000])
def test_stream_pieces_concatenate_to_completion_text(n_chunks: int | None) -> None:
    chunks = stream_chunks(BODY, response_id="x", created=1, n_chunks=n_chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    pieces = [c["choices"][0]["delta"]["content"] for c in chunks[1:-1]]
    assert "".join(pieces) == completion_text(BODY)
    if n_chunks is not None and n_chunks <= len(completion_text(BODY).split()):
        assert len(pieces) == n_chunks
    assert all("usage" not in c for c in chunks)


def test_completion_text_honours_max_tokens_and_mock_words() -> None:
    assert completion_text(BODY) == "This is a mock answer to: Tell me about the weather in Paris on"
    cut = completion(BODY | {"max_tokens": 4}, response_id="x", created=1)
    assert cut["choices"][0]["message"]["content"] == "This is a mock"
    assert cut["choices"][0]["finish_reason"] == "length"
    assert cut["usage"]["completion_tokens"] == 4
    assert len(completion_text(BODY | {"mock_completion_words": 50}).split()) == 50
    capped = BODY | {"mock_completion_words": 50, "max_completion_tokens": 20}
    assert len(completion_text(capped).split()) == 20


def test_encode_event() -> None:
    assert encode_event({"a": 1}) == b'data: {"a":1}\n\n'
    assert DONE_EVENT == b"data: [DONE]\n\n"


# --------------------------------------------------------------------------- OpenAI wire


async def test_non_stream_shape_and_usage(aiohttp_client: AiohttpClient) -> None:
    client = await fake(aiohttp_client)
    async with client.post(CHAT, json=BODY) as resp:
        assert resp.status == 200
        assert resp.content_type == "application/json"
        data = await resp.json()
    assert data["object"] == "chat.completion"
    assert data["id"].startswith("chatcmpl-fake-")
    assert data["model"] == "gpt-fake"
    choice = data["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == completion_text(BODY)
    assert choice["finish_reason"] == "stop"
    usage = data["usage"]
    assert usage["prompt_tokens"] == prompt_tokens(BODY["messages"])
    assert usage["completion_tokens"] == len(completion_text(BODY).split())
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert "cost" not in data


async def test_cost_is_added_when_configured(aiohttp_client: AiohttpClient) -> None:
    client = await fake(aiohttp_client, FakeConfig(cost=True))
    async with client.post(CHAT, json=BODY) as resp:
        data = await resp.json()
    usage = data["usage"]
    expected = (usage["prompt_tokens"] * 0.5 + usage["completion_tokens"] * 1.5) / 1e6
    assert data["cost"] == {"usd": pytest.approx(expected), "diem": pytest.approx(expected)}


async def test_stream_concatenates_and_ends_with_done(aiohttp_client: AiohttpClient) -> None:
    client = await fake(aiohttp_client)
    async with client.post(CHAT, json=BODY | {"stream": True}) as resp:
        assert resp.status == 200
        assert resp.content_type == "text/event-stream"
        raw = await resp.read()
    assert raw.endswith(DONE_EVENT)
    payloads = sse_data(raw)
    assert payloads[-1] == b"[DONE]"
    chunks = [orjson.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == completion_text(BODY)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all("usage" not in c for c in chunks)


async def test_include_usage_chunk_only_when_asked(aiohttp_client: AiohttpClient) -> None:
    client = await fake(aiohttp_client, FakeConfig(cost=True))
    body = BODY | {"stream": True, "stream_options": {"include_usage": True}}
    async with client.post(CHAT, json=body) as resp:
        chunks = [orjson.loads(p) for p in sse_data(await resp.read())[:-1]]
    final = chunks[-1]
    assert final["choices"] == []
    assert final["usage"]["prompt_tokens"] == prompt_tokens(BODY["messages"])
    assert final["usage"]["completion_tokens"] == len(completion_text(BODY).split())
    assert final["cost"]["usd"] > 0
    assert all(c["usage"] is None for c in chunks[:-1])
    assert all(c["choices"] for c in chunks[:-1])

    body["stream_options"] = {"include_usage": False}
    async with client.post(CHAT, json=body) as resp:
        chunks = [orjson.loads(p) for p in sse_data(await resp.read())[:-1]]
    assert all(c["choices"] and "usage" not in c for c in chunks)


async def test_chunks_config_and_step_override(aiohttp_client: AiohttpClient) -> None:
    client = await fake(aiohttp_client, FakeConfig(chunks=2))
    body = BODY | {"stream": True}
    async with client.post(CHAT, json=body) as resp:
        assert len(sse_data(await resp.read())) == 1 + 2 + 1 + 1  # role, pieces, finish, DONE
    await script(client, {"chunks": 4, "chunk_delay_ms": 1})
    async with client.post(CHAT, json=body) as resp:
        assert len(sse_data(await resp.read())) == 1 + 4 + 1 + 1


async def test_script_status_and_retry_after(aiohttp_client: AiohttpClient) -> None:
    client = await fake(aiohttp_client)
    await script(client, {"status": 429, "retry_after": 2}, {"status": 503})
    assert (await stats(client))["script_pending"] == 2
    async with client.post(CHAT, json=BODY) as resp:
        assert resp.status == 429
        assert resp.headers["Retry-After"] == "2"
        assert await resp.json() == {"error": {"message": "fake failure", "type": "fake", "code": None}}
    async with client.post(CHAT, json=BODY | {"stream": True}) as resp:
        assert resp.status == 503
        assert "Retry-After" not in resp.headers
    async with client.post(CHAT, json=BODY) as resp:
        assert resp.status == 200
    async with client.post("/_fake/script", json={"steps": [{"status": "x"}]}) as resp:
        assert resp.status == 400
    async with client.post("/_fake/script", json={"steps": [{"bogus": 1}]}) as resp:
        assert resp.status == 400
    await script(client, {"status": 500})
    async with client.delete("/_fake/script") as resp:
        assert resp.status == 200
    async with client.post(CHAT, json=BODY) as resp:
        assert resp.status == 200


async def test_cut_after_chunks_breaks_stream_without_done(aiohttp_client: AiohttpClient) -> None:
    client = await fake(aiohttp_client)
    await script(client, {"cut_after_chunks": 3})
    received = b""
    async with client.post(CHAT, json=BODY | {"stream": True}) as resp:
        assert resp.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            async for data in resp.content.iter_any():
                received += data
    payloads = sse_data(received)
    assert len(payloads) == 3
    assert b"[DONE]" not in received
    s = await stats(client)
    assert s["streams_cut"] == 1
    assert s["streams_completed"] == 0
    # The provider keeps serving new connections afterwards.
    async with client.post(CHAT, json=BODY | {"stream": True}) as resp:
        assert (await resp.read()).endswith(DONE_EVENT)


async def test_garbage_steps(aiohttp_client: AiohttpClient) -> None:
    client = await fake(aiohttp_client)
    await script(client, {"garbage": "json"}, {"garbage": "content_type"}, {"garbage": "huge_line"})
    async with client.post(CHAT, json=BODY) as resp:
        assert resp.status == 200
        with pytest.raises(orjson.JSONDecodeError):
            orjson.loads(await resp.read())
    async with client.post(CHAT, json=BODY) as resp:
        assert resp.status == 200
        assert resp.content_type == "text/html"
    async with client.post(CHAT, json=BODY | {"stream": True}) as resp:
        raw = await resp.read()
    first_line = raw.split(b"\n", 1)[0]
    assert len(first_line) > 4_000_000
    assert raw.endswith(DONE_EVENT)


async def test_delay_and_hang(aiohttp_client: AiohttpClient) -> None:
    client = await fake(aiohttp_client)
    await script(client, {"delay_ms": 50}, {"hang": True})
    loop = asyncio.get_running_loop()
    start = loop.time()
    async with client.post(CHAT, json=BODY) as resp:
        assert resp.status == 200
    assert loop.time() - start >= 0.045
    with pytest.raises(asyncio.TimeoutError):
        async with client.post(CHAT, json=BODY, timeout=aiohttp.ClientTimeout(total=0.2)):
            pass
    for _ in range(100):
        if (await stats(client))["requests_cancelled"] == 1:
            break
        await asyncio.sleep(0.01)
    assert (await stats(client))["requests_cancelled"] == 1


async def test_stats_counts_and_last_request(aiohttp_client: AiohttpClient) -> None:
    client = await fake(aiohttp_client)
    async with client.post(CHAT, json=BODY):
        pass
    async with client.post(CHAT, json=BODY | {"stream": True}) as resp:
        await resp.read()
    async with client.get("/v1/models") as resp:
        assert [m["id"] for m in (await resp.json())["data"]]
    async with client.post(CHAT, json=BODY, headers={"X-Custom-Thing": "yes"}) as resp:
        await resp.read()
    s = await stats(client)
    assert s["requests"] == 4
    assert s["by_path"] == {CHAT: 3, "/v1/models": 1}
    assert s["streams_started"] == 1
    assert s["streams_completed"] == 1
    assert s["streams_cancelled"] == 0
    last = s["last_request"]
    assert last["path"] == CHAT
    assert last["headers"]["x-custom-thing"] == "yes"
    assert last["body"] == BODY

    async with client.post("/_fake/reset") as resp:
        assert resp.status == 200
    s = await stats(client)
    assert s["requests"] == 0 and s["by_path"] == {} and s["last_request"] is None


async def test_client_disconnect_mid_stream_is_counted(aiohttp_client: AiohttpClient) -> None:
    client = await fake(aiohttp_client, FakeConfig(chunk_delay_ms=50))
    resp = await client.post(CHAT, json=BODY | {"stream": True})
    await resp.content.readuntil(b"\n\n")
    resp.close()  # drop the connection mid-stream
    for _ in range(200):
        if (await stats(client))["streams_cancelled"] == 1:
            break
        await asyncio.sleep(0.01)
    s = await stats(client)
    assert s["streams_cancelled"] == 1
    assert s["streams_completed"] == 0


async def test_embeddings(aiohttp_client: AiohttpClient) -> None:
    client = await fake(aiohttp_client)
    body = {"model": "emb", "input": ["hello world", "bye"]}
    async with client.post("/v1/embeddings", json=body) as resp:
        first = await resp.json()
    async with client.post("/v1/embeddings", json=body) as resp:
        assert await resp.json() == first
    assert first["object"] == "list"
    assert [d["index"] for d in first["data"]] == [0, 1]
    assert len(first["data"][0]["embedding"]) == 8
    assert first["data"][0]["embedding"] != first["data"][1]["embedding"]
    assert first["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    async with client.post("/v1/embeddings", json=body | {"encoding_format": "base64"}) as resp:
        encoded = (await resp.json())["data"][0]["embedding"]
    floats = struct.unpack("<8f", base64.b64decode(encoded))
    assert floats == pytest.approx(first["data"][0]["embedding"], rel=1e-6)


async def test_embeddings_follow_the_script(aiohttp_client: AiohttpClient) -> None:
    client = await fake(aiohttp_client)
    await script(client, {"status": 503, "retry_after": 2}, {"delay_ms": 1}, {"status": 400})
    body = {"model": "emb", "input": "hello"}
    async with client.post("/v1/embeddings", json=body) as resp:
        assert resp.status == 503 and resp.headers["Retry-After"] == "2"
        assert (await resp.json())["error"]["message"] == "fake failure"
    async with client.post("/v1/embeddings", json=body) as resp:
        assert resp.status == 200 and (await resp.json())["object"] == "list"
    async with client.post("/v1/embeddings", json=body) as resp:
        assert resp.status == 400
    async with client.post("/v1/embeddings", json=body) as resp:
        assert resp.status == 200  # the script is used up
    assert (await stats(client))["script_pending"] == 0


# --------------------------------------------------------------------------- Anthropic wire

ANTHROPIC_BODY: dict[str, Any] = {
    "model": "claude-fake",
    "max_tokens": 1024,
    "system": "Be brief.",
    "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello there Claude"}]}],
}


async def test_anthropic_non_stream(aiohttp_client: AiohttpClient) -> None:
    client = await fake(aiohttp_client)
    async with client.post("/v1/messages", json=ANTHROPIC_BODY) as resp:
        assert resp.status == 200
        data = await resp.json()
    assert data["type"] == "message" and data["role"] == "assistant"
    assert data["model"] == "claude-fake"
    assert data["content"] == [{"type": "text", "text": "This is a mock answer to: Hello there Claude"}]
    assert data["stop_reason"] == "end_turn"
    assert data["usage"] == {"input_tokens": 3 + 3 + 2, "output_tokens": 9}


async def test_anthropic_stream_event_sequence(aiohttp_client: AiohttpClient) -> None:
    client = await fake(aiohttp_client)
    async with client.post("/v1/messages", json=ANTHROPIC_BODY | {"stream": True}) as resp:
        assert resp.content_type == "text/event-stream"
        events = sse_events(await resp.read())
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    assert all(name == data["type"] for name, data in events)
    text = "".join(data["delta"]["text"] for name, data in events if name == "content_block_delta")
    assert text == completion_text(ANTHROPIC_BODY)
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == "end_turn"
    assert delta["usage"]["output_tokens"] == len(text.split())
    assert events[0][1]["message"]["usage"]["input_tokens"] == 8
    two = anthropic_stream_events(ANTHROPIC_BODY, message_id="m", n_chunks=2)
    assert sum(event.startswith(b"event: content_block_delta\n") for event in two) == 2


async def test_anthropic_cut_and_max_tokens(aiohttp_client: AiohttpClient) -> None:
    client = await fake(aiohttp_client)
    async with client.post("/v1/messages", json=ANTHROPIC_BODY | {"max_tokens": 3}) as resp:
        data = await resp.json()
    assert data["stop_reason"] == "max_tokens"
    assert data["usage"]["output_tokens"] == 3
    await script(client, {"cut_after_chunks": 2})
    received = b""
    async with client.post("/v1/messages", json=ANTHROPIC_BODY | {"stream": True}) as resp:
        with pytest.raises(aiohttp.ClientPayloadError):
            async for data_ in resp.content.iter_any():
                received += data_
    assert [name for name, _ in sse_events(received)] == ["message_start", "content_block_start"]


# --------------------------------------------------------------------------- auth


async def test_require_key(aiohttp_client: AiohttpClient) -> None:
    client = await fake(aiohttp_client, FakeConfig(require_key="sk-secret"))
    async with client.post(CHAT, json=BODY) as resp:
        assert resp.status == 401
        error = (await resp.json())["error"]
        assert error["code"] == "invalid_api_key"
        assert isinstance(error["message"], str) and error["type"]
    async with client.post(CHAT, json=BODY, headers={"Authorization": "Bearer wrong"}) as resp:
        assert resp.status == 401
    async with client.post(CHAT, json=BODY, headers={"Authorization": "Bearer sk-secret"}) as resp:
        assert resp.status == 200
    async with client.get("/v1/models") as resp:
        assert resp.status == 401
    async with client.post("/v1/messages", json=ANTHROPIC_BODY) as resp:
        assert resp.status == 401
        assert (await resp.json())["type"] == "error"
    async with client.post("/v1/messages", json=ANTHROPIC_BODY, headers={"x-api-key": "sk-secret"}) as resp:
        assert resp.status == 200
    # A rejected request does not consume a scripted step.
    await script(client, {"status": 500})
    async with client.post(CHAT, json=BODY) as resp:
        assert resp.status == 401
    assert (await stats(client))["script_pending"] == 1
