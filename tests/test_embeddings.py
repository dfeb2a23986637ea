"""``POST /v1/embeddings`` goes through the chat calls' machinery: circuit breakers,
retries, failover and fallbacks over the deployments that serve embeddings, with a
provider's own error answer relayed with its status. Two fake providers over loopback."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from actors.breaker import CircuitState
from tests.conftest import FakeUpstream, auth
from tests.fleet import dead_url, fleet_config

NO_RETRIES = {"UPSTREAM_MAX_RETRIES": "0"}
BODY = {"model": "emb", "input": ["hello world", "bye"]}


def embeddings_group(*providers: str, **extra: Any) -> dict[str, Any]:
    return {"name": "emb", "deployments": [{"provider": p, "model": "e"} for p in providers], **extra}


async def embedded(fake: FakeUpstream) -> int:
    return int((await fake.stats())["by_path"].get("/v1/embeddings", 0))


async def post(gw: Any, key: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    resp = await gw.data.post("/v1/embeddings", json=body or BODY, headers=auth(key))
    return resp.status, await resp.json()


async def test_a_deployment_that_is_down_fails_over_and_opens_its_breaker(
    gateway_factory: Any, fake_factory: Any, api_key: str
) -> None:
    b = await fake_factory()
    dead = {"type": "openai", "base_url": dead_url(), "max_retries": 1}
    gw = await gateway_factory(config_yaml=fleet_config(
        {"a": dead, "b": b}, [embeddings_group("a", "b")], circuit_breaker={"fail_max": 1, "reset_timeout_seconds": 60},
    ))
    status, answer = await post(gw, api_key)
    assert status == 200, answer
    assert answer["object"] == "list" and [d["index"] for d in answer["data"]] == [0, 1]
    assert answer["model"] == "e"  # the deployment's upstream model name was sent
    # Tried twice on a (a retry), then served by b; the failed call counts once and opens a's circuit.
    assert gw.state.breaker.health("a/e").state is CircuitState.OPEN
    assert gw.state.breaker.health("b/e").state is CircuitState.CLOSED
    status, _ = await post(gw, api_key)
    assert status == 200 and await embedded(b) == 2


async def test_error_statuses_are_retried_and_fail_over_and_the_circuit_leaves_it_alone(
    gateway_factory: Any, fake_factory: Any, api_key: str
) -> None:
    a, b = await fake_factory(), await fake_factory()
    gw = await gateway_factory(env=NO_RETRIES, config_yaml=fleet_config(
        {"a": a, "b": b}, [embeddings_group("a", "b")], circuit_breaker={"fail_max": 2, "reset_timeout_seconds": 60},
    ))
    await a.script({"status": 503}, {"status": 500})
    for _ in range(2):
        assert (await post(gw, api_key))[0] == 200
    assert [await embedded(a), await embedded(b)] == [2, 2]
    assert gw.state.breaker.health("a/e").state is CircuitState.OPEN
    for _ in range(3):  # open: a is passed over without a call
        assert (await post(gw, api_key))[0] == 200
    assert [await embedded(a), await embedded(b)] == [2, 5]


async def test_a_providers_own_refusal_is_relayed_with_its_status_and_no_failover(
    gateway_factory: Any, fake_factory: Any, api_key: str
) -> None:
    a, b = await fake_factory(), await fake_factory()
    gw = await gateway_factory(config_yaml=fleet_config({"a": a, "b": b}, [embeddings_group("a", "b")]))
    await a.script({"status": 400})
    status, answer = await post(gw, api_key)
    assert status == 400 and answer == {"error": {"message": "fake failure", "type": "fake", "code": None}}
    assert [await embedded(a), await embedded(b)] == [1, 0]  # a client error: not the deployment's fault
    assert gw.state.breaker.health("a/e").failures == 0


async def test_when_every_deployment_fails_the_last_answer_is_relayed(
    gateway_factory: Any, fake_factory: Any, api_key: str
) -> None:
    a, b = await fake_factory(), await fake_factory()
    gw = await gateway_factory(env=NO_RETRIES, config_yaml=fleet_config({"a": a, "b": b}, [embeddings_group("a", "b")]))
    await a.script({"status": 502})
    await b.script({"status": 503, "retry_after": 0})
    status, answer = await post(gw, api_key)
    assert status == 503 and answer["error"]["message"] == "fake failure"
    # Nothing answers at all: the contract's 502.
    gw = await gateway_factory(env=NO_RETRIES, config_yaml=fleet_config(
        {"a": dead_url(), "b": dead_url()}, [embeddings_group("a", "b")],
    ))
    status, answer = await post(gw, api_key)
    assert status == 502 and answer["error"]["code"] == "upstream_unavailable"


async def test_fallback_groups_serve_embeddings_too(gateway_factory: Any, fake_factory: Any, api_key: str) -> None:
    a, b = await fake_factory(), await fake_factory()
    gw = await gateway_factory(env=NO_RETRIES, config_yaml=fleet_config(
        {"a": a, "b": b},
        [embeddings_group("a", fallbacks=["spare"]), {"name": "spare", "deployments": [{"provider": "b", "model": "s"}]}],
    ))
    await a.script({"status": 500})
    status, answer = await post(gw, api_key)
    assert status == 200 and answer["model"] == "s"


async def test_deployments_that_cannot_embed_are_passed_over(
    gateway_factory: Any, fake_factory: Any, api_key: str
) -> None:
    b = await fake_factory()
    claude = {"type": "anthropic", "base_url": dead_url()[:-3], "api_key": "sk-ant"}
    gw = await gateway_factory(config_yaml=fleet_config(
        {"claude": claude, "b": b},
        [embeddings_group("claude", "b"), {"name": "chat-only", "deployments": [{"provider": "claude", "model": "c"}]}],
    ))
    status, _ = await post(gw, api_key)
    assert status == 200 and await embedded(b) == 1
    assert gw.state.breaker.health("claude/c") is None  # never tried, never blamed
    status, answer = await post(gw, api_key, {"model": "chat-only", "input": "x"})
    assert status == 404 and answer["error"]["code"] == "model_not_found"
    assert "embeddings" in answer["error"]["message"]


async def test_a_spent_budget_stops_embeddings(gateway_factory: Any, fake: FakeUpstream, key_factory: Any) -> None:
    gw = await gateway_factory(config_yaml=fleet_config({"fake": fake}, [embeddings_group("fake")]))
    raw, _ = await key_factory(budget_usd=Decimal("0"), budget_period="total")
    status, answer = await post(gw, raw)
    assert status == 402 and answer["error"]["code"] == "budget_exceeded"
    assert await embedded(fake) == 0
