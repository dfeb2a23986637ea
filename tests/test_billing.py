"""The ledger end to end: one row per call with exact tokens and cost, for every kind of call.

An in-process gateway in front of the fake provider; rows are read back from the real
ledger after ``billing.flush()`` (which returns once the journal is shipped).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from decimal import Decimal
from typing import Any

import asyncpg
import orjson
import pytest

from gateway.testing import fake_llm
from tests.conftest import FakeUpstream, Gateway, auth, chat_body, config_for, sse_payloads

#: USD per million tokens; chosen so costs are exact decimals.
PRICE_IN = Decimal("1000")
PRICE_OUT = Decimal("3000")


def priced_config(fake_url: str, *, priced: bool = True) -> str:
    deployment: dict[str, Any] = {"provider": "fake", "model": "*"}
    if priced:
        deployment["price"] = {"input_per_mtok": float(PRICE_IN), "output_per_mtok": float(PRICE_OUT)}
    return config_for(fake_url, models=[{"name": "*", "deployments": [deployment]}])


def price_of(prompt: int, completion: int) -> Decimal:
    return ((prompt * PRICE_IN + completion * PRICE_OUT) / 1_000_000).quantize(Decimal("1e-10"))


async def ledger_row(pool: asyncpg.Pool, request_id: str) -> asyncpg.Record:
    rows = await pool.fetch("SELECT * FROM usage_ledger WHERE request_id = $1", request_id)
    assert len(rows) == 1, f"{len(rows)} ledger rows for {request_id}"
    return rows[0]


@pytest.fixture
async def priced(gateway_factory: Any, fake: FakeUpstream) -> Gateway:
    return await gateway_factory(config_yaml=priced_config(fake.url))  # type: ignore[no-any-return]


def rid() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


async def test_non_streaming_call_has_one_row_with_exact_tokens_and_price(
    priced: Gateway, api_key: str, db_pool: asyncpg.Pool, key_factory: Any
) -> None:
    raw, key = await key_factory(rate_limit_requests=1000)
    request_id = rid()
    body = chat_body("count these five words", model="small")
    resp = await priced.data.post(
        "/v1/chat/completions", json=body, headers={**auth(raw), "x-request-id": request_id}
    )
    assert resp.status == 200
    answer = await resp.json()
    assert await priced.state.billing.flush()
    row = await ledger_row(db_pool, request_id)
    usage = answer["usage"]
    assert (row["prompt_tokens"], row["completion_tokens"]) == (usage["prompt_tokens"], usage["completion_tokens"])
    assert row["prompt_tokens"] == fake_llm.prompt_tokens(body["messages"])
    assert row["cost_usd"] == price_of(usage["prompt_tokens"], usage["completion_tokens"])
    assert row["cost_source"] == "price"
    assert row["api_key_id"] == key.api_key_id and row["subject_id"] == key.subject_id
    assert row["requested_model"] == "small" and row["served_model"] == "small"
    assert row["provider"] == "fake" and row["deployment"] == "fake/*"
    assert row["response_id"] == answer["id"]
    assert row["status"] == 200 and row["outcome"] == "ok" and row["finish_reason"] == "stop"
    assert not row["streamed"] and not row["cancelled"] and not row["failed_over"] and not row["usage_estimated"]
    assert row["latency_seconds"] > 0 and row["ttft_seconds"] is None
    # ... and the daily rollup agrees with the ledger.
    daily = await db_pool.fetchrow(
        "SELECT requests, prompt_tokens, completion_tokens, cost_usd FROM usage_daily WHERE api_key_id = $1",
        key.api_key_id,
    )
    assert tuple(daily) == (1, row["prompt_tokens"], row["completion_tokens"], row["cost_usd"])


async def test_stream_is_billed_from_the_usage_the_client_never_saw(
    priced: Gateway, fake: FakeUpstream, api_key: str, db_pool: asyncpg.Pool
) -> None:
    request_id = rid()
    body = chat_body("stream me some words please", stream=True)
    resp = await priced.data.post("/v1/chat/completions", json=body, headers={**auth(api_key), "x-request-id": request_id})
    raw = await resp.read()
    payloads = [orjson.loads(p) for p in sse_payloads(raw) if p != b"[DONE]"]
    # Hidden from a client that did not ask: no usage-only chunk, no "usage": null.
    assert payloads and all(p["choices"] and "usage" not in p for p in payloads)
    assert (await fake.stats())["last_request"]["body"]["stream_options"] == {"include_usage": True}
    assert await priced.state.billing.flush()
    row = await ledger_row(db_pool, request_id)
    prompt, completion = fake_llm.prompt_tokens(body["messages"]), fake_llm.completion_tokens(body)
    assert (row["prompt_tokens"], row["completion_tokens"]) == (prompt, completion)
    assert row["cost_usd"] == price_of(prompt, completion)
    assert row["streamed"] and row["outcome"] == "ok" and not row["usage_estimated"]
    assert row["ttft_seconds"] is not None and 0 < row["ttft_seconds"] <= row["latency_seconds"]
    assert row["response_id"] == payloads[0]["id"]


async def test_usage_chunk_is_shown_to_a_client_that_asked(
    priced: Gateway, api_key: str, db_pool: asyncpg.Pool
) -> None:
    request_id = rid()
    body = chat_body("show me the usage", stream=True, stream_options={"include_usage": True})
    resp = await priced.data.post("/v1/chat/completions", json=body, headers={**auth(api_key), "x-request-id": request_id})
    payloads = [orjson.loads(p) for p in sse_payloads(await resp.read()) if p != b"[DONE]"]
    usage_chunks = [p for p in payloads if p["choices"] == []]
    assert len(usage_chunks) == 1 and payloads[-1] is usage_chunks[0]
    shown = usage_chunks[0]["usage"]
    assert all(p["usage"] is None for p in payloads[:-1])  # OpenAI's shape: null until the last
    assert await priced.state.billing.flush()
    row = await ledger_row(db_pool, request_id)
    assert (row["prompt_tokens"], row["completion_tokens"]) == (shown["prompt_tokens"], shown["completion_tokens"])


async def test_the_providers_own_cost_wins_over_the_price_table(
    gateway_factory: Any, fake_factory: Any, api_key: str, db_pool: asyncpg.Pool
) -> None:
    venice_like = await fake_factory(cost=True)
    gw = await gateway_factory(config_yaml=priced_config(venice_like.url))
    ids = [rid(), rid()]
    body = chat_body("what does it cost")
    answer = await (await gw.data.post("/v1/chat/completions", json=body, headers={**auth(api_key), "x-request-id": ids[0]})).json()
    stream = chat_body("what does it cost", stream=True)
    await (await gw.data.post("/v1/chat/completions", json=stream, headers={**auth(api_key), "x-request-id": ids[1]})).read()
    assert await gw.state.billing.flush()
    for request_id in ids:
        row = await ledger_row(db_pool, request_id)
        assert row["cost_source"] == "provider"
        assert row["cost_usd"] == Decimal(str(answer["cost"]["usd"])).quantize(Decimal("1e-10"))
        assert row["cost_diem"] == Decimal(str(answer["cost"]["diem"])).quantize(Decimal("1e-10"))


async def test_a_stream_cut_by_the_provider_records_what_was_delivered(
    priced: Gateway, fake: FakeUpstream, api_key: str, db_pool: asyncpg.Pool
) -> None:
    await fake.script({"cut_after_chunks": 4})
    request_id = rid()
    body = chat_body("one two three four five six seven", stream=True)
    resp = await priced.data.post("/v1/chat/completions", json=body, headers={**auth(api_key), "x-request-id": request_id})
    payloads = sse_payloads(await resp.read())
    assert b"[DONE]" not in payloads and b'"error"' in payloads[-1]
    delivered = "".join(
        c["delta"].get("content") or "" for p in payloads[:-1] for c in orjson.loads(p)["choices"]
    )
    assert delivered and len(delivered) < len(fake_llm.completion_text(body))
    assert await priced.state.billing.flush()
    row = await ledger_row(db_pool, request_id)
    prompt, completion = fake_llm.prompt_tokens(body["messages"]), (len(delivered) + 3) // 4
    assert (row["prompt_tokens"], row["completion_tokens"]) == (prompt, completion)
    assert row["usage_estimated"] and row["outcome"] == "cut" and row["streamed"]
    assert row["cost_usd"] == price_of(prompt, completion)


async def test_a_stream_the_client_abandons_is_recorded_as_cancelled(
    priced: Gateway, fake: FakeUpstream, api_key: str, db_pool: asyncpg.Pool
) -> None:
    await fake.script({"chunks": 40, "chunk_delay_ms": 50})
    request_id = rid()
    body = chat_body("a long answer " * 10, stream=True, mock_completion_words=200)
    resp = await priced.data.post("/v1/chat/completions", json=body, headers={**auth(api_key), "x-request-id": request_id})
    seen = b""
    while seen.count(b"data: ") < 3:
        seen += await resp.content.readany()
    resp.close()  # the client hangs up mid-stream
    row = None
    for _ in range(100):  # the handler notices the disconnect on its next write
        await priced.state.billing.flush()
        rows = await db_pool.fetch("SELECT * FROM usage_ledger WHERE request_id = $1", request_id)
        if rows:
            row = rows[0]
            break
        await asyncio.sleep(0.05)
    assert row is not None, "the cancelled stream left no ledger row"
    full = fake_llm.count_tokens(fake_llm.completion_text(body))
    assert row["outcome"] == "cancelled" and row["cancelled"] and row["streamed"] and row["usage_estimated"]
    assert row["prompt_tokens"] == fake_llm.prompt_tokens(body["messages"])
    # Counted from what was relayed before the hang-up: some of the answer, not all of it.
    assert 0 < row["completion_tokens"] < full
    assert row["cost_usd"] == price_of(row["prompt_tokens"], row["completion_tokens"])
    stats = await fake.stats()
    assert stats["streams_completed"] == 0


async def test_failed_calls_are_rows_too(
    gateway_factory: Any, fake: FakeUpstream, api_key: str, db_pool: asyncpg.Pool
) -> None:
    from tests.conftest import free_port

    dead = f"http://127.0.0.1:{free_port()}/v1"
    gw = await gateway_factory(
        env={"UPSTREAM_MAX_RETRIES": "0"},
        config_yaml=config_for(
            fake.url,
            providers={
                "fake": {"type": "openai", "base_url": fake.url, "api_key": "k"},
                "dead": {"type": "openai", "base_url": dead, "api_key": "k"},
            },
            models=[
                {"name": "gone", "deployments": [{"provider": "dead", "model": "x"}]},
                {"name": "*", "deployments": [{"provider": "fake", "model": "*", "price": {"input_per_mtok": 1.0}}]},
            ],
        ),
    )
    unreachable, refused = rid(), rid()
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="gone"), headers={**auth(api_key), "x-request-id": unreachable})
    assert resp.status == 502
    await fake.script({"status": 400})
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(), headers={**auth(api_key), "x-request-id": refused})
    assert resp.status == 400
    assert await gw.state.billing.flush()
    row = await ledger_row(db_pool, unreachable)
    assert (row["status"], row["outcome"], row["error_type"]) == (502, "upstream_error", "upstream_unavailable")
    assert (row["prompt_tokens"], row["completion_tokens"], row["cost_usd"], row["cost_source"]) == (0, 0, 0, "none")
    assert row["provider"] == "dead"
    row = await ledger_row(db_pool, refused)
    assert (row["status"], row["outcome"], row["cost_usd"]) == (400, "provider_error", 0)
    daily = await db_pool.fetchval("SELECT sum(errors) FROM usage_daily WHERE model IN ('gone', 'test-model')")
    assert daily >= 2


async def test_failover_is_flagged(gateway_factory: Any, fake_factory: Any, api_key: str, db_pool: asyncpg.Pool) -> None:
    first, second = await fake_factory(), await fake_factory()
    gw = await gateway_factory(
        env={"UPSTREAM_MAX_RETRIES": "0"},
        config_yaml=config_for(
            first.url,
            providers={
                "a": {"type": "openai", "base_url": first.url, "api_key": "k"},
                "b": {"type": "openai", "base_url": second.url, "api_key": "k"},
            },
            models=[{"name": "m", "deployments": [
                {"provider": "a", "model": "m1", "priority": 0},
                {"provider": "b", "model": "m2", "priority": 1, "price": {"input_per_mtok": 1000.0, "output_per_mtok": 3000.0}},
            ]}],
        ),
    )
    await first.script({"status": 503})
    request_id = rid()
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="m"), headers={**auth(api_key), "x-request-id": request_id})
    assert resp.status == 200
    usage = (await resp.json())["usage"]
    assert await gw.state.billing.flush()
    row = await ledger_row(db_pool, request_id)
    assert row["failed_over"] and row["failovers"] == 1
    assert (row["provider"], row["served_model"], row["deployment"]) == ("b", "m2", "b/m2")
    # Priced with the deployment that served it.
    assert row["cost_usd"] == price_of(usage["prompt_tokens"], usage["completion_tokens"])


async def test_unpriced_models_are_flagged_and_cost_nothing(
    gateway_factory: Any, fake: FakeUpstream, api_key: str, db_pool: asyncpg.Pool
) -> None:
    gw = await gateway_factory(config_yaml=priced_config(fake.url, priced=False))
    request_id = rid()
    assert (await gw.data.post("/v1/chat/completions", json=chat_body(model="free-lunch"), headers={**auth(api_key), "x-request-id": request_id})).status == 200
    assert await gw.state.billing.flush()
    row = await ledger_row(db_pool, request_id)
    assert (row["cost_usd"], row["cost_source"]) == (0, "unpriced")
    assert "free-lunch" in gw.state.billing.stats().unpriced_models


async def test_one_billing_log_line_per_call(
    priced: Gateway, api_key: str, caplog: pytest.LogCaptureFixture
) -> None:
    request_id = rid()
    with caplog.at_level(logging.INFO, logger="gateway.billing"):
        await (await priced.data.post("/v1/chat/completions", json=chat_body(), headers={**auth(api_key), "x-request-id": request_id})).read()
        assert await priced.state.billing.flush()
    lines = [
        r.fields for r in caplog.records  # type: ignore[attr-defined]
        if r.name == "gateway.billing" and r.getMessage() == "billing" and r.fields["request_id"] == request_id  # type: ignore[attr-defined]
    ]
    assert len(lines) == 1
    line = lines[0]
    assert line["request_id"] == request_id
    assert uuid.UUID(line["api_key_id"]) and line["cost_usd"] > 0 and line["response_id"].startswith("chatcmpl")
    assert api_key not in json.dumps(line)


async def test_an_embeddings_call_has_one_billing_log_line_too(
    priced: Gateway, api_key: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Embeddings calls are journaled outside the chat pipeline: their line is logged there."""
    request_id = rid()
    with caplog.at_level(logging.INFO, logger="gateway.billing"):
        resp = await priced.data.post(
            "/v1/embeddings", json={"model": "any-embedder", "input": ["hello"]},
            headers={**auth(api_key), "x-request-id": request_id},
        )
        assert resp.status == 200, await resp.text()
        await resp.read()
    lines = [
        r.fields for r in caplog.records  # type: ignore[attr-defined]
        if r.name == "gateway.billing" and r.getMessage() == "billing" and r.fields["request_id"] == request_id  # type: ignore[attr-defined]
    ]
    assert len(lines) == 1, lines
    assert lines[0]["model"] == "any-embedder" and lines[0]["prompt_tokens"] > 0 and lines[0]["cost_usd"] > 0


async def test_metrics_show_the_billing_backlog_and_the_unpriced_calls(
    gateway_factory: Any, fake: FakeUpstream, api_key: str
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    gw = await gateway_factory(env={"BILLING_SHIP_INTERVAL_SECONDS": "3600"}, config_yaml=priced_config(fake.url, priced=False))

    async def sample(name: str, **labels: str) -> float:
        text = await (await gw.management.get("/metrics")).text()
        return sum(
            s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == name and labels.items() <= s.labels.items()
        )

    for _ in range(3):
        assert (await gw.data.post("/v1/chat/completions", json=chat_body(model="no-price"), headers=auth(api_key))).status == 200
    await asyncio.sleep(0.01)  # the actor takes the three events in
    assert await sample("gateway_billing_pending_events") == 3
    assert await sample("gateway_unpriced_calls_total", model="no-price") == 3
    assert await gw.state.billing.flush()
    assert await sample("gateway_billing_pending_events") == 0
