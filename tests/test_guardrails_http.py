"""Guardrails through a running gateway: each mode on the prompt and the answer, whole and
streamed (a card number split across chunks), on chat completions and Anthropic Messages,
with the decisions in the ledger, the metrics and the span, never the matched text."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import FakeUpstream, Gateway, auth, chat_body, config_for, sse_payloads

CARD = "4111 1111 1111 1111"
POLICIES = {
    "no-secrets": {"type": "pii", "mode": "block", "detectors": ["api_key", "private_key"]},
    "mask-email": {"type": "pii", "mode": "redact", "detectors": ["email"]},
    "mask-out": {"type": "pii", "mode": "redact", "direction": "output"},
    "stop-cards": {"type": "pii", "mode": "block", "direction": "output", "detectors": ["card_number"]},
    "watch-ip": {"type": "pii", "mode": "log", "detectors": ["ip_address"]},
}


def _config(fake: FakeUpstream) -> str:
    deployment = [{"provider": "fake", "model": "m"}]
    return config_for(
        fake.url,
        guardrails={"policies": POLICIES, "keys": {}},
        models=[
            {"name": "in", "deployments": deployment, "guardrails": ["no-secrets", "mask-email", "watch-ip"]},
            {"name": "out", "deployments": deployment, "guardrails": ["mask-out"]},
            {"name": "strict", "deployments": deployment, "guardrails": ["stop-cards"]},
            {"name": "open", "deployments": deployment},
        ],
    )


@pytest.fixture
async def gw(gateway_factory: Any, fake_factory: Any) -> tuple[Gateway, FakeUpstream]:
    fake: FakeUpstream = await fake_factory(chunks=12)
    return await gateway_factory(config_yaml=_config(fake)), fake


async def _ledger(gw: Gateway, db_pool: Any, request_id: str) -> Any:
    assert await gw.state.billing.flush()
    return await db_pool.fetchrow("SELECT * FROM usage_ledger WHERE request_id = $1", request_id)


async def test_a_blocked_prompt_never_goes_upstream_and_names_the_policy(
    gw: tuple[Gateway, FakeUpstream], api_key: str, db_pool: Any
) -> None:
    gateway, fake = gw
    before = (await fake.stats())["requests"]
    secret = "sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z"
    resp = await gateway.data.post("/v1/chat/completions", json=chat_body(f"my key is {secret}", model="in"),
                                   headers={**auth(api_key), "x-request-id": "guard-block-1"})
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["code"] == "guardrail_blocked" and "no-secrets" in error["message"] and secret not in error["message"]
    assert (await fake.stats())["requests"] == before
    row = await _ledger(gateway, db_pool, "guard-block-1")
    assert row["outcome"] == "blocked" and row["status"] == 400 and row["guardrails"] == "no-secrets:blocked"
    metrics = await (await gateway.management.get("/metrics")).text()
    assert 'gateway_guardrail_decisions_total{action="blocked",direction="input",policy="no-secrets"} 1.0' in metrics
    assert secret not in metrics


async def test_a_redacted_prompt_reaches_the_provider_redacted_and_log_mode_only_counts(
    gw: tuple[Gateway, FakeUpstream], api_key: str, db_pool: Any
) -> None:
    gateway, fake = gw
    resp = await gateway.data.post(
        "/v1/chat/completions", json=chat_body("mail jane@example.com from 203.0.113.7", model="in"),
        headers={**auth(api_key), "x-request-id": "guard-redact-1"},
    )
    assert resp.status == 200
    sent = (await fake.stats())["last_request"]["body"]["messages"][0]["content"]
    assert sent == "mail [REDACTED:email] from 203.0.113.7"  # the IP is only logged
    row = await _ledger(gateway, db_pool, "guard-redact-1")
    assert row["outcome"] == "ok" and set(row["guardrails"].split(",")) == {"mask-email:redacted", "watch-ip:logged"}


async def test_an_answer_is_redacted_whole_and_streamed_with_the_match_split_across_chunks(
    gw: tuple[Gateway, FakeUpstream], api_key: str
) -> None:
    gateway, _ = gw
    # The fake answers with the prompt's first words, so the answer carries the card number.
    prompt = f"card {CARD} ok"
    resp = await gateway.data.post("/v1/chat/completions", json=chat_body(prompt, model="out"), headers=auth(api_key))
    text = (await resp.json())["choices"][0]["message"]["content"]
    assert "4111" not in text and "[REDACTED:card_number]" in text

    resp = await gateway.data.post("/v1/chat/completions", json=chat_body(prompt, model="out", stream=True),
                                   headers=auth(api_key))
    assert resp.status == 200
    raw = await resp.read()
    payloads = sse_payloads(raw)
    assert payloads[-1] == b"[DONE]"
    import orjson

    chunks = [orjson.loads(p) for p in payloads[:-1]]
    pieces = [c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices")]
    assert sum(1 for p in pieces if p) >= 1 and len(chunks) >= 5  # the stream kept its chunks
    streamed = "".join(pieces)
    assert "4111" not in streamed.replace(" ", "") and "[REDACTED:card_number]" in streamed
    assert streamed == text  # the same text as the whole answer


async def test_an_output_block_ends_a_stream_with_one_error_event_and_a_whole_answer_with_400(
    gw: tuple[Gateway, FakeUpstream], api_key: str, db_pool: Any
) -> None:
    gateway, _ = gw
    prompt = f"card {CARD} ok"
    resp = await gateway.data.post("/v1/chat/completions", json=chat_body(prompt, model="strict"), headers=auth(api_key))
    assert resp.status == 400 and (await resp.json())["error"]["code"] == "guardrail_blocked"
    resp = await gateway.data.post("/v1/chat/completions", json=chat_body(prompt, model="strict", stream=True),
                                   headers={**auth(api_key), "x-request-id": "guard-stream-block"})
    raw = await resp.read()
    payloads = sse_payloads(raw)
    assert b"[DONE]" not in payloads and b"4111" not in raw
    assert b"guardrail_blocked" in payloads[-1] and sum(1 for p in payloads if b'"error"' in p) == 1
    row = await _ledger(gateway, db_pool, "guard-stream-block")
    assert row["outcome"] == "blocked" and row["guardrails"] == "stop-cards:blocked"


async def test_anthropic_messages_get_the_same_policies_in_their_own_error_shape(
    gw: tuple[Gateway, FakeUpstream], api_key: str
) -> None:
    gateway, fake = gw
    body = {"model": "in", "max_tokens": 20,
            "messages": [{"role": "user", "content": "key: sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z"}]}
    resp = await gateway.data.post("/v1/messages", json=body, headers={"x-api-key": api_key})
    assert resp.status == 400
    assert (await resp.json())["error"]["type"] == "invalid_request_error"
    body["messages"][0]["content"] = "write to jane@example.com"
    resp = await gateway.data.post("/v1/messages", json=body, headers={"x-api-key": api_key})
    assert resp.status == 200
    assert (await fake.stats())["last_request"]["body"]["messages"][0]["content"] == "write to [REDACTED:email]"


async def test_a_group_without_policies_is_untouched(gw: tuple[Gateway, FakeUpstream], api_key: str) -> None:
    gateway, _ = gw
    resp = await gateway.data.post("/v1/chat/completions", json=chat_body(f"card {CARD}", model="open"),
                                   headers=auth(api_key))
    assert resp.status == 200 and CARD in (await resp.json())["choices"][0]["message"]["content"]


async def test_a_fail_closed_webhook_that_is_down_refuses_and_a_fail_open_one_lets_through(
    gateway_factory: Any, fake: FakeUpstream, api_key: str
) -> None:
    from tests.conftest import free_port

    down = f"http://127.0.0.1:{free_port()}/check"
    config = config_for(fake.url, guardrails={"policies": {
        "closed": {"type": "webhook", "url": down, "timeout_seconds": 0.5},
        "open": {"type": "webhook", "url": down, "timeout_seconds": 0.5, "fail_open": True},
    }}, models=[
        {"name": "c", "deployments": [{"provider": "fake", "model": "m"}], "guardrails": ["closed"]},
        {"name": "o", "deployments": [{"provider": "fake", "model": "m"}], "guardrails": ["open"]},
    ])
    gateway = await gateway_factory(config_yaml=config)
    resp = await gateway.data.post("/v1/chat/completions", json=chat_body(model="c"), headers=auth(api_key))
    assert resp.status == 400 and (await resp.json())["error"]["code"] == "guardrail_blocked"
    resp = await gateway.data.post("/v1/chat/completions", json=chat_body(model="o"), headers=auth(api_key))
    assert resp.status == 200


async def test_a_key_brings_its_own_policies(gateway_factory: Any, fake: FakeUpstream, key_factory: Any, db_pool: Any) -> None:
    key, record = await key_factory()
    prefix = record.key_prefix
    config = config_for(fake.url, guardrails={"policies": POLICIES, "keys": {prefix: ["mask-email"]}})
    gateway = await gateway_factory(config_yaml=config)
    resp = await gateway.data.post("/v1/chat/completions", json=chat_body("to jane@example.com"), headers=auth(key))
    assert resp.status == 200
    assert (await fake.stats())["last_request"]["body"]["messages"][0]["content"] == "to [REDACTED:email]"
