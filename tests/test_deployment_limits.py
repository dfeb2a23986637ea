"""Routing that respects the providers' own limits: per-deployment rpm/tpm (counted across
replicas through Redis), the providers' x-ratelimit-* headers, and ``least-busy``."""

from __future__ import annotations

import asyncio
import random
import uuid
from pathlib import Path
from typing import Any

import pytest

from gateway.core.config import ConfigError, Deployment, load_config, load_settings
from gateway.relay.headroom import DeploymentLimits, parse_reset
from gateway.relay.routing import Target
from gateway.relay.strategies import order_targets
from tests.conftest import FakeUpstream, auth, chat_body, free_port
from tests.fleet import fleet_config, records, served_by


def dep(provider: str, priority: int = 0, **extra: Any) -> dict[str, Any]:
    return {"provider": provider, "model": "m", "priority": priority, **extra}


def limited_fleet(a: FakeUpstream, b: FakeUpstream, *deployments: dict[str, Any], **extra: Any) -> str:
    return fleet_config({"a": a, "b": b}, [{"name": "m", "deployments": list(deployments), **extra.pop("group", {})}], **extra)


async def chat(gw: Any, key: str) -> Any:
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="m"), headers=auth(key))
    await resp.read()
    return resp


async def test_two_deployments_with_rpm_5_take_10_calls_with_no_429(
    gateway_factory: Any, fake_factory: Any, api_key: str
) -> None:
    a, b = await fake_factory(), await fake_factory()
    # Each provider really enforces 5 a minute: its 6th request would answer 429.
    for fake in (a, b):
        await fake.script(*({} for _ in range(5)), {"status": 429, "retry_after": 60})
    gw = await gateway_factory(
        env={"UPSTREAM_MAX_RETRIES": "0"},
        config_yaml=limited_fleet(a, b, dep("a", 0, rpm=5), dep("b", 1, rpm=5)),
    )
    calls = records(gw)
    statuses = [(await chat(gw, api_key)).status for _ in range(10)]
    assert statuses == [200] * 10
    assert await served_by(a, b) == [5, 5]
    # Neither provider was ever sent the request it would have refused.
    assert (await a.stats())["script_pending"] == 1 and (await b.stats())["script_pending"] == 1
    assert all(c.failovers == 0 for c in calls)  # skipped before sending, not failed over

    # Both out of room this minute: the gateway answers 429 itself, with Retry-After.
    resp = await chat(gw, api_key)
    assert resp.status == 429
    assert (await resp.json())["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(resp.headers["Retry-After"]) <= 60
    assert await served_by(a, b) == [5, 5]


async def test_rpm_is_counted_across_replicas_through_redis(
    gateway_factory: Any, fake_factory: Any, api_key: str, redis_url: str
) -> None:
    a, b = await fake_factory(), await fake_factory()
    yaml = limited_fleet(
        a, b, dep("a", 0, rpm=3), dep("b", 1),
        rate_limits={"key_prefix": f"t{uuid.uuid4().hex[:12]}"},
    )
    env = {"REDIS_URL": redis_url}
    one, two = await gateway_factory(env=env, config_yaml=yaml), await gateway_factory(env=env, config_yaml=yaml)
    statuses = [(await chat(gw, api_key)).status for gw in (one, two) * 4]
    assert statuses == [200] * 8
    # Three a minute for a in total, not three per replica.
    assert await served_by(a, b) == [3, 5]


async def test_tpm_turns_a_deployment_away_once_its_tokens_are_spent(
    gateway_factory: Any, fake_factory: Any, api_key: str
) -> None:
    a, b = await fake_factory(), await fake_factory()
    gw = await gateway_factory(config_yaml=limited_fleet(a, b, dep("a", 0, tpm=5), dep("b", 1)))
    calls = records(gw)
    assert (await chat(gw, api_key)).status == 200
    assert calls[-1].provider == "a" and calls[-1].usage.total_tokens > 5
    for _ in range(50):  # the charge is counted by a task once the call has ended
        if gw.state.deployment_limits.headroom(_deployment(gw, "a")) == 0:
            break
        await asyncio.sleep(0.02)
    assert (await chat(gw, api_key)).status == 200
    assert calls[-1].provider == "b"
    assert await served_by(a, b) == [1, 1]


def _deployment(gw: Any, provider: str) -> Deployment:
    return next(d for m in gw.state.config.models for d in m.deployments if d.provider == provider)


async def test_a_provider_reporting_no_requests_left_is_skipped_until_its_reset(
    gateway_factory: Any, fake_factory: Any, api_key: str
) -> None:
    a, b = await fake_factory(), await fake_factory()
    await a.script({"headers": {
        "x-ratelimit-limit-requests": "100", "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "0.5s",
    }})
    gw = await gateway_factory(config_yaml=limited_fleet(a, b, dep("a", 0), dep("b", 1)))
    calls = records(gw)
    assert (await chat(gw, api_key)).status == 200 and calls[-1].provider == "a"
    assert (await chat(gw, api_key)).status == 200 and calls[-1].provider == "b"
    assert await served_by(a, b) == [1, 1]
    await asyncio.sleep(0.6)  # the provider's window has reset
    assert (await chat(gw, api_key)).status == 200 and calls[-1].provider == "a"


async def test_least_busy_sends_calls_where_the_most_headroom_is(
    gateway_factory: Any, fake_factory: Any, api_key: str
) -> None:
    a, b = await fake_factory(), await fake_factory()
    # a says it has 10 of 100 requests left; b says nothing: b has more room.
    await a.script({"headers": {"x-ratelimit-limit-requests": "100", "x-ratelimit-remaining-requests": "10"}})
    gw = await gateway_factory(
        config_yaml=limited_fleet(a, b, dep("a", 0), dep("b", 1), group={"strategy": "least-busy"})
    )
    calls = records(gw)
    providers = []
    for _ in range(3):
        assert (await chat(gw, api_key)).status == 200
        providers.append(calls[-1].provider)
    assert providers == ["a", "b", "b"]  # equal at first (priority breaks the tie), then b


def test_least_busy_orders_by_headroom_then_priority() -> None:
    a, b, c = (Deployment(provider=p, model="m", priority=i) for i, p in enumerate("abc"))
    targets = [Target(d, "m") for d in (a, b, c)]
    ordered = order_targets(
        "least-busy", targets, {}, stream=False, rng=random.Random(0), headroom={"a/m": 0.2, "b/m": 0.9}
    )
    assert [t.deployment.provider for t in ordered] == ["c", "b", "a"]  # c: no limit, untouched


async def test_headroom_of_rpm_and_of_provider_reports() -> None:
    limits = DeploymentLimits()
    d = Deployment(provider="p", model="m", rpm=4)
    assert limits.headroom(d) == 1.0
    assert await limits.take(d) is None
    assert limits.headroom(d) == 0.75
    for _ in range(3):
        assert await limits.take(d) is None
    wait = await limits.take(d)
    assert wait is not None and 0 < wait <= 60
    free = Deployment(provider="q", model="m")
    limits.observe(free.id, {"x-ratelimit-remaining-tokens": "250", "x-ratelimit-limit-tokens": "1000",
                             "x-ratelimit-reset-tokens": "6m0s"})
    assert limits.headroom(free) == 0.25
    assert await limits.take(free) is None  # some left: may be sent
    limits.observe(free.id, {"x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "2s"})
    wait = await limits.take(free)
    assert wait is not None and 1.5 < wait <= 2


@pytest.mark.parametrize(("raw", "seconds"), [
    ("1s", 1.0), ("6m0s", 360.0), ("1h2m3s", 3723.0), ("20ms", 0.02), ("1.5s", 1.5), ("7", 7.0),
    ("2m30.5s", 150.5), ("", None), ("soon", None), (None, None),
])
def test_reset_headers_parse(raw: str | None, seconds: float | None) -> None:
    assert parse_reset(raw) == (pytest.approx(seconds) if seconds is not None else None)


def test_rpm_and_tpm_config_is_checked(tmp_path: Any) -> None:
    path = tmp_path / "g.yaml"
    path.write_text(fleet_config({"a": "http://127.0.0.1:9/v1"}, [{"name": "m", "deployments": [dep("a", rpm=0)]}]))
    env = {"GATEWAY_CONFIG": str(path), "DATABASE_URL": "postgresql://x/y"}
    with pytest.raises(ConfigError, match=r"models\[0\]\.deployments\[0\]\.rpm: expected a value >= 1"):
        load_config(load_settings(env), env)
    path.write_text(fleet_config({"a": "http://127.0.0.1:9/v1"}, [{"name": "m", "deployments": [dep("a", tpm=1000)],
                                                                 "strategy": "least-busy"}]))
    config = load_config(load_settings(env), env)
    assert config.models[0].deployments[0].tpm == 1000 and config.models[0].strategy == "least-busy"


async def test_a_reload_changes_rpm_at_once(gateway_factory: Any, fake_factory: Any, api_key: str) -> None:
    a, b = await fake_factory(), await fake_factory()
    gw = await gateway_factory(
        env={"ADMIN_TOKEN": "admin-token-for-limit-tests-0123"},
        config_yaml=limited_fleet(a, b, dep("a", 0), dep("b", 1)),
    )
    assert [(await chat(gw, api_key)).status for _ in range(2)] == [200, 200]
    assert await served_by(a, b) == [2, 0]
    Path(gw.state.settings.config_path).write_text(limited_fleet(a, b, dep("a", 0, rpm=1), dep("b", 1)))
    resp = await gw.management.post("/admin/config/reload", headers=auth("admin-token-for-limit-tests-0123"))
    assert resp.status == 200
    assert [(await chat(gw, api_key)).status for _ in range(3)] == [200] * 3
    assert await served_by(a, b) == [3, 2]  # one more on a (its new minute), then b


async def test_an_unreachable_store_lets_calls_through() -> None:
    limits = DeploymentLimits(redis_url=f"redis://127.0.0.1:{free_port()}/0", timeout=0.2)
    d = Deployment(provider="p", model="m", rpm=1)
    try:
        assert [await limits.take(d) for _ in range(3)] == [None, None, None]  # the provider's 429 decides
    finally:
        await limits.close()
