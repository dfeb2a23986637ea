"""Streams that fail over (only before the first byte), timeouts per route group, and
what a timeout after sending may do; /v1/models under wildcard routes; allowlists."""

from __future__ import annotations

from typing import Any

import orjson

from tests.conftest import auth, chat_body, sse_payloads
from tests.fleet import dead_url, fleet_config, records, served_by

NO_RETRIES = {"UPSTREAM_MAX_RETRIES": "0"}


def group(name: str, *deployments: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"name": name, "deployments": list(deployments), **extra}


def dep(provider: str, model: str = "m", **extra: Any) -> dict[str, Any]:
    return {"provider": provider, "model": model, **extra}


def _contents(raw: bytes) -> str:
    text = ""
    for p in sse_payloads(raw):
        if p == b"[DONE]":
            continue
        for choice in orjson.loads(p).get("choices") or []:
            text += choice.get("delta", {}).get("content") or ""
    return text


# ----------------------------------------------------------------------------- streams
async def test_stream_fails_over_before_the_first_byte(gateway_factory: Any, fake_factory: Any, api_key: str) -> None:
    a, b = await fake_factory(), await fake_factory()
    # A 200 that closes before its first event may have been billed: moving on from it
    # is what retry_on_timeout (off by default) allows.
    provider_a = {"type": "openai", "base_url": a.url, "retry_on_timeout": True}
    gw = await gateway_factory(env=NO_RETRIES, config_yaml=fleet_config({"a": provider_a, "b": b}, [group("m", dep("a"), dep("b"))]))
    calls = records(gw)
    # An error status, then a 200 whose stream closes before its first event.
    await a.script({"status": 503}, {"cut_after_chunks": 0})
    for _ in range(2):
        resp = await gw.data.post("/v1/chat/completions", json=chat_body("one two", model="m", stream=True), headers=auth(api_key))
        assert resp.status == 200
        raw = await resp.read()
        assert raw.endswith(b"data: [DONE]\n\n")
        assert _contents(raw) == "This is a mock answer to: one two"
        assert calls[-1].provider == "b" and calls[-1].failovers == 1
    assert await served_by(a, b) == [2, 2]


async def test_stream_never_fails_over_after_the_first_byte(gateway_factory: Any, fake_factory: Any, api_key: str) -> None:
    a, b = await fake_factory(), await fake_factory()
    gw = await gateway_factory(config_yaml=fleet_config({"a": a, "b": b}, [group("m", dep("a"), dep("b"))]))
    calls = records(gw)
    await a.script({"cut_after_chunks": 3})
    resp = await gw.data.post("/v1/chat/completions", json=chat_body("one two three", model="m", stream=True), headers=auth(api_key))
    assert resp.status == 200
    payloads = sse_payloads(await resp.read())
    assert b"[DONE]" not in payloads
    assert orjson.loads(payloads[-1])["error"]["code"] == "upstream_unavailable"
    assert len(payloads) == 4  # three relayed chunks, then the one error event
    assert await served_by(a, b) == [1, 0]  # the client had bytes: no replay anywhere
    assert calls[-1].outcome == "cut" and calls[-1].failovers == 0
    # A cut mid-stream is a failure of the deployment.
    assert gw.state.breaker.health("a/m").failures == 1


async def test_whole_call_over_a_connection_that_never_opened_always_fails_over(
    gateway_factory: Any, fake_factory: Any, api_key: str
) -> None:
    b = await fake_factory()
    dead = {"type": "openai", "base_url": dead_url(), "retry_on_timeout": False, "max_retries": 1}
    gw = await gateway_factory(config_yaml=fleet_config({"a": dead, "b": b}, [group("m", dep("a"), dep("b"))]))
    calls = records(gw)
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="m"), headers=auth(api_key))
    assert resp.status == 200
    assert calls[-1].retries == 1 and calls[-1].failovers == 1  # retried, then moved on


# ----------------------------------------------------------------------------- timeouts
async def test_group_timeouts_beat_provider_and_global_ones(gateway_factory: Any, fake_factory: Any, api_key: str) -> None:
    slow = await fake_factory(latency_ms=700)
    provider = {"type": "openai", "base_url": slow.url, "timeout_seconds": 0.2}
    gw = await gateway_factory(
        env={**NO_RETRIES, "REQUEST_TIMEOUT_SECONDS": "0.2"},
        config_yaml=fleet_config({"slow": provider}, [
            group("patient", dep("slow"), timeout_seconds=5),
            group("default", dep("slow")),
        ]))
    # A longer budget in the group is not capped by the provider's or the global one.
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="patient"), headers=auth(api_key))
    assert resp.status == 200
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="default"), headers=auth(api_key))
    assert resp.status == 504
    assert (await resp.json())["error"]["code"] == "upstream_timeout"


async def test_group_idle_timeout_bounds_silence_between_chunks(gateway_factory: Any, fake_factory: Any, api_key: str) -> None:
    fake = await fake_factory(chunk_delay_ms=500)
    gw = await gateway_factory(env=NO_RETRIES, config_yaml=fleet_config({"f": fake}, [
        group("hasty", dep("f"), idle_timeout_seconds=0.15),
        group("calm", dep("f"), idle_timeout_seconds=5),
    ]))
    body = chat_body("a b", model="hasty", stream=True)
    raw = await (await gw.data.post("/v1/chat/completions", json=body, headers=auth(api_key))).read()
    payloads = sse_payloads(raw)
    assert orjson.loads(payloads[-1])["error"]["code"] == "upstream_timeout"
    raw = await (await gw.data.post("/v1/chat/completions", json={**body, "model": "calm"}, headers=auth(api_key))).read()
    assert raw.endswith(b"data: [DONE]\n\n")


async def test_timeout_after_sending_is_resent_only_where_allowed(gateway_factory: Any, fake_factory: Any, api_key: str) -> None:
    careful, eager, spare = await fake_factory(latency_ms=600), await fake_factory(latency_ms=600), await fake_factory()
    gw = await gateway_factory(config_yaml=fleet_config(
        {
            "careful": {"type": "openai", "base_url": careful.url, "retry_on_timeout": False, "max_retries": 2},
            "eager": {"type": "openai", "base_url": eager.url, "retry_on_timeout": True, "max_retries": 1},
            "spare": spare,
        },
        [group("once", dep("careful"), dep("spare"), timeout_seconds=0.2),
         group("twice", dep("eager"), dep("spare"), timeout_seconds=0.2)]))
    calls = records(gw)
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="once"), headers=auth(api_key))
    # It may have run upstream: not sent again, neither here nor to the spare.
    assert resp.status == 504
    assert await served_by(careful, spare) == [1, 0]
    assert calls[-1].retries == 0 and calls[-1].failovers == 0
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="twice"), headers=auth(api_key))
    assert resp.status == 200
    assert await served_by(eager, spare) == [2, 1]  # retried once, then failed over


async def test_timeout_after_sending_is_not_resent_by_default(gateway_factory: Any, fake_factory: Any, api_key: str) -> None:
    # retry_on_timeout is opt-in: a call that may already have been billed is sent once.
    slow, spare = await fake_factory(latency_ms=600), await fake_factory()
    provider = {"type": "openai", "base_url": slow.url, "max_retries": 2}
    gw = await gateway_factory(config_yaml=fleet_config(
        {"slow": provider, "spare": spare}, [group("m", dep("slow"), dep("spare"), timeout_seconds=0.2)]))
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="m"), headers=auth(api_key))
    assert resp.status == 504
    assert (await resp.json())["error"]["code"] == "upstream_timeout"
    assert await served_by(slow, spare) == [1, 0]


# ----------------------------------------------------------------------------- models and keys
async def test_models_lists_wildcard_routes_through_their_providers(
    gateway_factory: Any, fake_factory: Any, key_factory: Any
) -> None:
    fake = await fake_factory()
    gw = await gateway_factory(config_yaml=fleet_config(
        {"v": fake, "down": dead_url()},
        [group("smart", dep("v")), group("venice/*", dep("v", "*")), group("other/*", dep("down", "*"))]))
    raw, _ = await key_factory()
    resp = await gw.data.get("/v1/models", headers=auth(raw))
    assert resp.status == 200
    ids = [m["id"] for m in (await resp.json())["data"]]
    # The fake lists mock-small, mock-large, mock-embedding; a provider that is down lists nothing.
    assert ids == ["smart", "venice/mock-embedding", "venice/mock-large", "venice/mock-small"]
    limited, _ = await key_factory(allowed_models=("venice/mock-s*", "smart"))
    ids = [m["id"] for m in (await (await gw.data.get("/v1/models", headers=auth(limited))).json())["data"]]
    assert ids == ["smart", "venice/mock-small"]
    stats = await fake.stats()
    assert stats["by_path"]["/v1/models"] == 1  # cached between calls


async def test_allowlist_and_unknown_models(gateway_factory: Any, fake_factory: Any, key_factory: Any) -> None:
    fake = await fake_factory()
    gw = await gateway_factory(config_yaml=fleet_config({"v": fake}, [group("smart", dep("v")), group("venice/*", dep("v", "*"))]))
    raw, _ = await key_factory(allowed_models=("venice/*",))
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="smart"), headers=auth(raw))
    assert resp.status == 403 and (await resp.json())["error"]["code"] == "model_not_allowed"
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="venice/llama"), headers=auth(raw))
    assert resp.status == 200 and (await resp.json())["model"] == "llama"
    open_key, _ = await key_factory()
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="nope"), headers=auth(open_key))
    assert resp.status == 404 and (await resp.json())["error"]["code"] == "model_not_found"
