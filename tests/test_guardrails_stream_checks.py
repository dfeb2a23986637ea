"""Webhook (and other I/O) output policies on streams, through a running gateway: the
text so far is checked at intervals beside the stream, a refusal cuts the stream with
one error event, the stream's end waits for the last check, and the first chunk never
waits for any."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from tests.conftest import FakeUpstream, Gateway, auth, chat_body, config_for, free_port, sse_payloads


class Webhook:
    """A guard service on loopback: blocks any text holding ``word``, after ``delay``."""

    def __init__(self, word: str = "forbidden", delay: float = 0.0) -> None:
        self.word = word
        self.delay = delay
        self.seen: list[dict[str, Any]] = []

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.seen.append(body)
        await asyncio.sleep(self.delay)
        if any(self.word in text for text in body["texts"]):
            return web.json_response({"action": "block", "reasons": ["off-limits"]})
        return web.json_response({"action": "allow"})


async def _webhook(aiohttp_server: Any, hook: Webhook) -> str:
    app = web.Application()
    app.router.add_post("/check", hook.handle)
    server = await aiohttp_server(app)
    return str(server.make_url("/check"))


def _config(fake: FakeUpstream, **policies: dict[str, Any]) -> str:
    return config_for(
        fake.url, guardrails={"policies": policies},
        models=[{"name": name, "deployments": [{"provider": "fake", "model": "m"}], "guardrails": [name]}
                for name in policies],
    )


async def _stream(gw: Gateway, key: str, model: str, prompt: str, request_id: str, **extra: Any) -> list[bytes]:
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(prompt, model=model, stream=True, **extra),
                              headers={**auth(key), "x-request-id": request_id})
    assert resp.status == 200
    return sse_payloads(await resp.read())


def _text(payloads: list[bytes]) -> str:
    chunks = [orjson.loads(p) for p in payloads if p != b"[DONE]"]
    return "".join((c["choices"][0]["delta"].get("content") or "") for c in chunks if c.get("choices"))


async def _ledger(gw: Gateway, db_pool: Any, request_id: str) -> Any:
    assert await gw.state.billing.flush()
    return await db_pool.fetchrow("SELECT outcome, guardrails FROM usage_ledger WHERE request_id = $1", request_id)


async def test_a_webhook_block_mid_stream_cuts_it_with_one_error_event(
    gateway_factory: Any, fake_factory: Any, aiohttp_server: Any, api_key: str, db_pool: Any
) -> None:
    hook = Webhook()
    url = await _webhook(aiohttp_server, hook)
    fake = await fake_factory(chunks=40, chunk_delay_ms=25)
    gw = await gateway_factory(config_yaml=_config(
        fake, review={"type": "webhook", "url": url, "direction": "output", "stream_check_chars": 20}))
    payloads = await _stream(gw, api_key, "review", "forbidden words here", "stream-check-cut", mock_completion_words=80)
    assert b"[DONE]" not in payloads
    errors = [p for p in payloads if b'"error"' in p]
    assert len(errors) == 1 and payloads[-1] == errors[0] and b"guardrail_blocked" in errors[0]
    # Cut well before the end: the check answered while the stream went on.
    assert 0 < len(_text(payloads[:-1]).split()) < 60
    assert hook.seen and all(s["direction"] == "output" and s["policy"] == "review" for s in hook.seen)
    row = await _ledger(gw, db_pool, "stream-check-cut")
    assert row["outcome"] == "blocked" and row["guardrails"] == "review:blocked"


async def test_the_end_of_a_stream_waits_for_the_last_check(
    gateway_factory: Any, fake_factory: Any, aiohttp_server: Any, api_key: str, db_pool: Any
) -> None:
    hook = Webhook(word="omega")
    url = await _webhook(aiohttp_server, hook)
    fake = await fake_factory(chunks=8)
    gw = await gateway_factory(config_yaml=_config(
        fake, review={"type": "webhook", "url": url, "direction": "output", "stream_check_chars": 100_000}))
    # Only the final check (the interval is never reached) sees the whole text, "omega" included.
    payloads = await _stream(gw, api_key, "review", "alpha beta omega", "stream-check-end")
    assert b"[DONE]" not in payloads and b"guardrail_blocked" in payloads[-1]
    assert len(hook.seen) == 1 and "omega" in hook.seen[0]["texts"][0]
    assert (await _ledger(gw, db_pool, "stream-check-end"))["guardrails"] == "review:blocked"

    payloads = await _stream(gw, api_key, "review", "alpha beta gamma", "stream-check-pass")
    assert payloads[-1] == b"[DONE]" and "gamma" in _text(payloads)
    row = await _ledger(gw, db_pool, "stream-check-pass")
    assert row["outcome"] == "ok" and row["guardrails"] is None


async def test_log_mode_and_both_fail_modes_on_a_stream(
    gateway_factory: Any, fake_factory: Any, aiohttp_server: Any, api_key: str, db_pool: Any
) -> None:
    url = await _webhook(aiohttp_server, Webhook())
    down = f"http://127.0.0.1:{free_port()}/check"
    fake = await fake_factory(chunks=6)
    gw = await gateway_factory(config_yaml=_config(
        fake,
        watch={"type": "webhook", "url": url, "mode": "log", "direction": "output", "stream_check_chars": 10},
        closed={"type": "webhook", "url": down, "direction": "output", "timeout_seconds": 0.3},
        opened={"type": "webhook", "url": down, "direction": "output", "timeout_seconds": 0.3, "fail_open": True},
    ))
    payloads = await _stream(gw, api_key, "watch", "forbidden but only watched", "stream-check-log")
    assert payloads[-1] == b"[DONE]" and "forbidden" in _text(payloads)
    assert (await _ledger(gw, db_pool, "stream-check-log"))["guardrails"] == "watch:logged"

    payloads = await _stream(gw, api_key, "closed", "hello", "stream-check-closed")
    assert b"[DONE]" not in payloads and b"guardrail_blocked" in payloads[-1]
    assert (await _ledger(gw, db_pool, "stream-check-closed"))["guardrails"] == "closed:blocked"

    payloads = await _stream(gw, api_key, "opened", "hello", "stream-check-open")
    assert payloads[-1] == b"[DONE]"
    assert (await _ledger(gw, db_pool, "stream-check-open"))["guardrails"] == "opened:failed_open"


async def test_a_rewrite_cannot_change_what_a_stream_already_sent_and_is_recorded_as_logged(
    gateway_factory: Any, fake_factory: Any, aiohttp_server: Any, api_key: str, db_pool: Any
) -> None:
    async def rewrite(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"action": "rewrite", "texts": ["x" for _ in body["texts"]], "reasons": ["tone"]})

    app = web.Application()
    app.router.add_post("/check", rewrite)
    url = str((await aiohttp_server(app)).make_url("/check"))
    fake = await fake_factory(chunks=6)
    gw = await gateway_factory(config_yaml=_config(
        fake, tone={"type": "webhook", "url": url, "mode": "redact", "direction": "output", "stream_check_chars": 5}))
    payloads = await _stream(gw, api_key, "tone", "a plain answer", "stream-check-rewrite")
    assert payloads[-1] == b"[DONE]" and "plain" in _text(payloads)
    assert (await _ledger(gw, db_pool, "stream-check-rewrite"))["guardrails"] == "tone:logged"
    # The same policy on a whole answer does rewrite it.
    resp = await gw.data.post("/v1/chat/completions", json=chat_body("a plain answer", model="tone"), headers=auth(api_key))
    assert (await resp.json())["choices"][0]["message"]["content"] == "x"


async def test_a_slow_check_never_delays_the_first_chunk(
    gateway_factory: Any, fake_factory: Any, aiohttp_server: Any, api_key: str
) -> None:
    hook = Webhook(delay=1.0)
    url = await _webhook(aiohttp_server, hook)
    fake = await fake_factory(chunks=10, chunk_delay_ms=20)
    gw = await gateway_factory(config_yaml=_config(fake, review={
        "type": "webhook", "url": url, "direction": "output", "timeout_seconds": 3, "stream_check_chars": 5}))
    started = time.monotonic()
    first_text_at: float | None = None
    async with aiohttp.ClientSession() as session, session.post(
        gw.url("/v1/chat/completions"), json=chat_body("a calm answer", model="review", stream=True),
        headers=auth(api_key),
    ) as resp:
        async for line in resp.content:
            if line.startswith(b"data: {") and b'"content":"' in line and first_text_at is None:
                first_text_at = time.monotonic() - started
        total = time.monotonic() - started
    assert first_text_at is not None and first_text_at < 0.6  # the 1 s check runs beside the stream
    assert total >= 1.0  # and the end waited for it
    assert len(hook.seen) >= 1


async def test_anthropic_messages_streams_end_with_their_own_error_event(
    gateway_factory: Any, fake_factory: Any, aiohttp_server: Any, api_key: str, db_pool: Any
) -> None:
    url = await _webhook(aiohttp_server, Webhook(word="omega"))
    fake = await fake_factory(chunks=8)
    gw = await gateway_factory(config_yaml=_config(
        fake, review={"type": "webhook", "url": url, "direction": "output", "stream_check_chars": 10}))
    resp = await gw.data.post("/v1/messages", headers={"x-api-key": api_key, "x-request-id": "stream-check-anthropic"},
                              json={"model": "review", "max_tokens": 50, "stream": True,
                                    "messages": [{"role": "user", "content": "alpha beta omega"}]})
    assert resp.status == 200
    raw = await resp.read()
    events = [orjson.loads(p) for p in sse_payloads(raw)]
    assert events[-1]["type"] == "error" and sum(1 for e in events if e["type"] == "error") == 1
    assert not any(e["type"] == "message_stop" for e in events)
    assert (await _ledger(gw, db_pool, "stream-check-anthropic"))["guardrails"] == "review:blocked"
