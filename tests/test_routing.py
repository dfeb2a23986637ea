"""Model groups over several fake providers: strategies, failover, fallbacks, timeouts."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from actors.breaker import CircuitState, Health
from gateway.core.config import ConfigError, Deployment, Price, ProviderConfig, parse_config
from gateway.providers.base import Provider
from gateway.relay.routing import Router, Target, timeouts_for
from gateway.relay.strategies import order_targets
from tests.conftest import auth, chat_body
from tests.fleet import dead_url, fleet_config, records, served_by

NO_RETRIES = {"UPSTREAM_MAX_RETRIES": "0"}


def group(name: str, *deployments: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"name": name, "deployments": list(deployments), **extra}


def dep(provider: str, model: str = "m", **extra: Any) -> dict[str, Any]:
    return {"provider": provider, "model": model, **extra}


# ----------------------------------------------------------------------------- strategies
def _targets(*deployments: Deployment) -> list[Target]:
    return [Target(d, d.model) for d in deployments]


def test_priority_orders_by_priority_then_config_order() -> None:
    a, b, c = Deployment("a", "m", priority=1), Deployment("b", "m", priority=0), Deployment("c", "m", priority=1)
    ordered = order_targets("priority", _targets(a, b, c), {}, stream=False, rng=random.Random(0))
    assert [t.deployment.provider for t in ordered] == ["b", "a", "c"]


def test_weighted_first_picks_follow_weights_and_zero_weight_is_a_spare() -> None:
    a, b, spare = Deployment("a", "m", weight=9), Deployment("b", "m", weight=1), Deployment("s", "m", weight=0)
    rng = random.Random(1234)
    firsts = Counter(
        order_targets("weighted", _targets(a, b, spare), {}, stream=False, rng=rng)[0].deployment.provider
        for _ in range(2000)
    )
    assert firsts["s"] == 0
    assert 0.07 < firsts["b"] / 2000 < 0.13  # a 10 % canary
    # The spare is always last: the failover order keeps it for when the others fail.
    assert order_targets("weighted", _targets(spare, a, b), {}, stream=False, rng=rng)[-1].deployment.provider == "s"


def test_least_latency_uses_ttft_for_streams_and_measures_the_unknown_first() -> None:
    a, b, c = Deployment("a", "m"), Deployment("b", "m"), Deployment("c", "m")
    health = {"a/m": Health(latency=0.5, ttft=0.05), "b/m": Health(latency=0.2, ttft=0.3)}
    whole = order_targets("least-latency", _targets(a, b, c), health, stream=False, rng=random.Random(0))
    streamed = order_targets("least-latency", _targets(a, b, c), health, stream=True, rng=random.Random(0))
    assert [t.deployment.provider for t in whole] == ["c", "b", "a"]  # c unmeasured: tried first
    assert [t.deployment.provider for t in streamed] == ["c", "a", "b"]
    # Equal numbers: priority, then config order decide, every time.
    tie = {"a/m": Health(latency=0.1), "b/m": Health(latency=0.1), "c/m": Health(latency=0.1)}
    assert [t.deployment.provider for t in order_targets(
        "least-latency", _targets(a, b, c), tie, stream=False, rng=random.Random(0))] == ["a", "b", "c"]


def test_least_cost_puts_unpriced_last() -> None:
    dear = Deployment("dear", "m", price=Price(3.0, 15.0))
    cheap = Deployment("cheap", "m", price=Price(0.5, 1.5))
    unknown = Deployment("unknown", "m")
    ordered = order_targets("least-cost", _targets(unknown, dear, cheap), {}, stream=False, rng=random.Random(0))
    assert [t.deployment.provider for t in ordered] == ["cheap", "dear", "unknown"]


async def test_priority_group_is_served_by_its_first_deployment(gateway_factory: Any, fake_factory: Any, api_key: str) -> None:
    a, b = await fake_factory(), await fake_factory()
    gw = await gateway_factory(config_yaml=fleet_config(
        {"a": a, "b": b}, [group("smart", dep("a", priority=1), dep("b", "b-model", priority=0))]))
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="smart"), headers=auth(api_key))
    assert resp.status == 200
    assert (await resp.json())["model"] == "b-model"
    assert await served_by(a, b) == [0, 1]


async def test_weighted_group_splits_traffic(gateway_factory: Any, fake_factory: Any, api_key: str) -> None:
    a, b, spare = await fake_factory(), await fake_factory(), await fake_factory()
    gw = await gateway_factory(config_yaml=fleet_config(
        {"a": a, "b": b, "s": spare},
        [group("canary", dep("a", weight=3), dep("b", weight=1), dep("s", weight=0), strategy="weighted")]))
    gw.state.router.rng = random.Random(42)
    for _ in range(40):
        resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="canary"), headers=auth(api_key))
        assert resp.status == 200
    n_a, n_b, n_spare = await served_by(a, b, spare)
    assert n_a + n_b == 40 and n_spare == 0
    assert n_a > n_b > 0


async def test_least_latency_group_prefers_the_fast_deployment(gateway_factory: Any, fake_factory: Any, api_key: str) -> None:
    slow, fast = await fake_factory(latency_ms=400), await fake_factory()
    gw = await gateway_factory(config_yaml=fleet_config(
        {"slow": slow, "fast": fast}, [group("quick", dep("slow"), dep("fast"), strategy="least-latency")]))
    for _ in range(5):
        resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="quick"), headers=auth(api_key))
        assert resp.status == 200
    # Each is measured once (unmeasured counts as fastest), then the fast one keeps winning.
    assert await served_by(slow, fast) == [1, 4]
    # Streams are ranked by time to first token.
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="quick", stream=True), headers=auth(api_key))
    await resp.read()
    assert await served_by(slow, fast) == [1, 5]
    assert gw.state.breaker.health("fast/m").ttft is not None


async def test_least_cost_group_uses_the_cheapest_then_the_next(gateway_factory: Any, fake_factory: Any, api_key: str) -> None:
    dear, cheap = await fake_factory(), await fake_factory()
    gw = await gateway_factory(env=NO_RETRIES, config_yaml=fleet_config(
        {"dear": dear, "cheap": cheap},
        [group("thrifty", dep("dear", price={"input_per_mtok": 3, "output_per_mtok": 15}),
               dep("cheap", price={"input_per_mtok": 0.1, "output_per_mtok": 0.4}), strategy="least-cost")]))
    assert (await gw.data.post("/v1/chat/completions", json=chat_body(model="thrifty"), headers=auth(api_key))).status == 200
    assert await served_by(dear, cheap) == [0, 1]
    await cheap.script({"status": 500})
    assert (await gw.data.post("/v1/chat/completions", json=chat_body(model="thrifty"), headers=auth(api_key))).status == 200
    assert await served_by(dear, cheap) == [1, 2]


# ----------------------------------------------------------------------------- failover
async def test_failover_follows_priority_order_and_is_recorded(gateway_factory: Any, fake_factory: Any, api_key: str) -> None:
    a, c = await fake_factory(), await fake_factory()
    gw = await gateway_factory(env={"UPSTREAM_MAX_RETRIES": "1"}, config_yaml=fleet_config(
        {"a": a, "b": dead_url(), "c": c},
        [group("m", dep("a", priority=0), dep("b", priority=1), dep("c", priority=2))]))
    calls = records(gw)
    await a.script({"status": 500}, {"status": 502})
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="m"), headers=auth(api_key))
    assert resp.status == 200
    assert await served_by(a, c) == [2, 1]
    record = calls[-1]
    assert record.provider == "c" and record.deployment == "c/m"
    assert record.failovers == 2  # a → b → c
    assert record.retries == 2  # once on a (500 then 502), once on b (refused twice)
    assert record.fallback_model is None


async def test_provider_client_errors_are_relayed_without_failover(gateway_factory: Any, fake_factory: Any, api_key: str) -> None:
    a, b = await fake_factory(), await fake_factory()
    gw = await gateway_factory(config_yaml=fleet_config({"a": a, "b": b}, [group("m", dep("a"), dep("b"))]))
    await a.script({"status": 400})
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="m"), headers=auth(api_key))
    assert resp.status == 400
    assert (await resp.json())["error"]["message"] == "fake failure"
    assert await served_by(a, b) == [1, 0]


async def test_last_provider_error_is_relayed_when_every_deployment_fails(gateway_factory: Any, fake_factory: Any, api_key: str) -> None:
    a, b = await fake_factory(), await fake_factory()
    gw = await gateway_factory(env=NO_RETRIES, config_yaml=fleet_config({"a": a, "b": b}, [group("m", dep("a"), dep("b"))]))
    await a.script({"status": 500})
    await b.script({"status": 503})
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="m"), headers=auth(api_key))
    assert resp.status == 503
    assert (await resp.json())["error"]["message"] == "fake failure"


async def test_fallbacks_are_tried_in_order_after_the_group_fails(gateway_factory: Any, fake_factory: Any, api_key: str) -> None:
    a, b, c = await fake_factory(), await fake_factory(), await fake_factory()
    gw = await gateway_factory(env=NO_RETRIES, config_yaml=fleet_config(
        {"a": a, "b": b, "c": c},
        [group("smart", dep("a", "big"), fallbacks=["fast", "cheap/tiny"]),
         group("fast", dep("b", "small")),
         group("cheap/*", dep("c", "*"))]))
    calls = records(gw)
    await a.script({"status": 500})
    await b.script({"status": 500})
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="smart"), headers=auth(api_key))
    assert resp.status == 200
    assert (await resp.json())["model"] == "tiny"  # through the wildcard group, its rest upstream
    assert await served_by(a, b, c) == [1, 1, 1]
    assert calls[-1].fallback_model == "cheap/tiny"
    assert calls[-1].requested_model == "smart"
    assert calls[-1].failovers == 2
    # While the group's own deployment answers, no fallback is touched.
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="smart"), headers=auth(api_key))
    assert resp.status == 200 and calls[-1].fallback_model is None


def test_fallback_names_are_checked_at_start(tmp_path: Any) -> None:
    from gateway.core.config import load_config, load_settings

    def load(models: list[dict[str, Any]]) -> Any:
        path = tmp_path / "g.yaml"
        path.write_text(fleet_config({"a": "http://127.0.0.1:9/v1"}, models))
        return load_config(load_settings({"GATEWAY_CONFIG": str(path)}), {})

    assert load([group("x", dep("a"), fallbacks=["w/anything"]), group("w/*", dep("a", "*"))])
    with pytest.raises(ConfigError, match=r"models\[0\]\.fallbacks: unknown model 'nope'"):
        load([group("x", dep("a"), fallbacks=["nope"])])
    with pytest.raises(ConfigError, match="falls back to itself"):
        load([group("x", dep("a"), fallbacks=["x"])])
    with pytest.raises(ConfigError, match=r"models\[0\]\.timeout_seconds: expected a number"):
        load([group("x", dep("a"), timeout_seconds="soon")])


async def test_429_cools_the_deployment_and_moves_on(gateway_factory: Any, fake_factory: Any, api_key: str) -> None:
    a, b = await fake_factory(), await fake_factory()
    gw = await gateway_factory(config_yaml=fleet_config({"a": a, "b": b}, [group("m", dep("a"), dep("b"))]))
    await a.script({"status": 429, "retry_after": 30})
    for _ in range(3):
        resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="m"), headers=auth(api_key))
        assert resp.status == 200
    # One 429, no waiting on it, and it is left alone while it cools (not a failure).
    assert await served_by(a, b) == [1, 3]
    (status_a,) = [s for s in gw.state.deployment_health() if s.deployment == "a/m"]
    assert status_a.state is CircuitState.CLOSED and status_a.consecutive_failures == 0
    assert status_a.cooling_for_seconds is not None and status_a.cooling_for_seconds > 20


async def test_nothing_healthy_is_503_circuit_open_with_retry_after(gateway_factory: Any, fake_factory: Any, api_key: str) -> None:
    a = await fake_factory()
    gw = await gateway_factory(config_yaml=fleet_config({"a": a}, [group("m", dep("a"))]))
    await a.script({"status": 429, "retry_after": 30})
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="m"), headers=auth(api_key))
    # The only deployment, and longer than the gateway waits: the provider's 429 is relayed.
    assert resp.status == 429
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="m"), headers=auth(api_key))
    assert resp.status == 503
    assert (await resp.json())["error"] == {
        "message": "no healthy deployment for model 'm'", "type": "service_unavailable", "code": "circuit_open"}
    assert 20 <= int(resp.headers["Retry-After"]) <= 30
    assert await served_by(a) == [1]



class _RegionViews(Provider):
    """A provider whose deployments each go through a view of their own (as Bedrock's regions)."""

    def __init__(self, config: ProviderConfig) -> None:
        super().__init__(config, request_timeout=30.0)
        self.views: dict[str, Provider] = {}

    def for_deployment(self, deployment: Deployment) -> Provider:
        return self.views.setdefault(deployment.id, Provider(self.config, request_timeout=30.0))


def test_a_router_with_providers_resolves_each_targets_provider_and_timeouts_once() -> None:
    """Dispatch takes a target's provider and timeouts from the target when its router was
    built with the generation's providers, and looks them up per call otherwise: both the same."""
    config = parse_config(json.dumps({
        "providers": {
            "a": {"base_url": "http://a.test", "api_key": "k", "timeout_seconds": 7, "idle_timeout_seconds": 3},
            "b": {"base_url": "http://b.test", "api_key": "k"},
        },
        "models": [
            group("own", dep("a"), dep("b", priority=1)),
            group("timed", dep("a"), dep("b", priority=1), timeout_seconds=2, connect_timeout_seconds=1),
            group("any/*", dep("a", "*")),
        ],
    }), Path("routing.yaml"))
    providers: dict[str, Provider] = {name: _RegionViews(c) for name, c in config.providers.items()}
    router, bare = Router(config, providers=providers), Router(config)
    for model in ("own", "timed", "any/x"):
        route, plain = router.resolve(model), bare.resolve(model)
        assert route.targets == plain.targets
        for target, unresolved in zip(route.targets, plain.targets, strict=True):
            # What dispatch looks up per call for a target without them.
            looked_up = route.router.providers[target.provider].for_deployment(target.deployment)  # type: ignore[union-attr]
            assert target.timeouts == timeouts_for(route.group, looked_up)
            assert target.client is looked_up and target.client is not providers[target.provider]
            assert unresolved.client is None and unresolved.timeouts is None
            for built in (target, unresolved, Target(target.deployment, "other")):
                assert (built.deployment_id, built.provider) == (built.deployment.id, built.deployment.provider)
    timed = router.resolve("timed").targets[0].timeouts
    assert timed is not None and (timed.connect, timed.total, timed.idle) == (1.0, 2.0, 3.0)
