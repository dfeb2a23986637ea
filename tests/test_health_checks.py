"""Active health checks: a provider whose probes fail is skipped before a user's call
reaches it, heals by probe, shows in /admin/providers and /metrics, and never bills."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from gateway.core.config import ConfigError, load_config, load_settings
from tests.conftest import FakeUpstream, auth, chat_body
from tests.fleet import fleet_config, records, served_by

ADMIN_TOKEN = "admin-secret-for-health-tests-0123"
ADMIN = auth(ADMIN_TOKEN)
FAST = {"interval_seconds": 0.05, "timeout_seconds": 0.3, "unhealthy_after": 2, "healthy_after": 1}


def probed(fake: FakeUpstream, **check: Any) -> dict[str, Any]:
    return {"type": "openai", "base_url": fake.url, "api_key": "sk-x", "health_check": {**FAST, **check}}


def pair(a: FakeUpstream, b: FakeUpstream, **check: Any) -> str:
    return fleet_config(
        {"a": probed(a, **check), "b": b},
        [{"name": "m", "deployments": [{"provider": "a", "model": "m", "priority": 0},
                                       {"provider": "b", "model": "m", "priority": 1}]}],
    )


async def set_models(fake: FakeUpstream, status: int, delay_ms: int = 0) -> None:
    async with fake.session.post(f"{fake.url[:-3]}/_fake/models", json={"status": status, "delay_ms": delay_ms}) as r:
        assert r.status == 200


async def provider_entry(gw: Any, name: str) -> dict[str, Any]:
    body = await (await gw.management.get("/admin/providers", headers=ADMIN)).json()
    return next(p for p in body["providers"] if p["name"] == name)


async def wait_health(gw: Any, name: str, healthy: bool) -> dict[str, Any]:
    for _ in range(100):
        entry = await provider_entry(gw, name)
        check = entry["health_check"]
        if check is not None and check["probes"] > 0 and check["healthy"] is healthy:
            return entry
        await asyncio.sleep(0.03)
    pytest.fail(f"provider {name} never became {'healthy' if healthy else 'unhealthy'}: {entry}")


async def healthy_metric(gw: Any, provider: str) -> float:
    text = await (await gw.management.get("/metrics")).text()
    prefix = f'gateway_provider_healthy{{provider="{provider}"}} '
    return float(next(line for line in text.splitlines() if line.startswith(prefix)).split()[-1])


async def test_a_failing_provider_is_skipped_before_a_call_hits_it_and_heals_by_probe(
    gateway_factory: Any, fake_factory: Any, api_key: str
) -> None:
    a, b = await fake_factory(), await fake_factory()
    gw = await gateway_factory(env={"ADMIN_TOKEN": ADMIN_TOKEN}, config_yaml=pair(a, b))
    calls = records(gw)
    await wait_health(gw, "a", True)
    assert await healthy_metric(gw, "a") == 1

    await set_models(a, 503)
    entry = await wait_health(gw, "a", False)
    assert entry["health_check"]["consecutive_failures"] >= 2
    assert "503" in entry["health_check"]["last_error"]
    assert await healthy_metric(gw, "a") == 0
    body = await (await gw.management.get("/admin/providers", headers=ADMIN)).json()
    assert next(d for d in body["deployments"] if d["id"] == "a/m")["healthy"] is False

    # a still answers chat, but no user's call is sent there while its probes fail.
    for _ in range(3):
        resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="m"), headers=auth(api_key))
        assert resp.status == 200
    assert await served_by(a, b) == [0, 3]
    assert [c.provider for c in calls] == ["b"] * 3 and all(c.failovers == 0 for c in calls)

    await set_models(a, 200)
    await wait_health(gw, "a", True)
    assert await healthy_metric(gw, "a") == 1
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="m"), headers=auth(api_key))
    assert resp.status == 200
    assert await served_by(a, b) == [1, 3]


async def test_a_probe_that_times_out_counts_as_failed(gateway_factory: Any, fake_factory: Any) -> None:
    a, b = await fake_factory(), await fake_factory()
    gw = await gateway_factory(env={"ADMIN_TOKEN": ADMIN_TOKEN}, config_yaml=pair(a, b, timeout_seconds=0.1))
    await set_models(a, 200, delay_ms=1000)
    entry = await wait_health(gw, "a", False)
    assert "no answer within 0.1s" in entry["health_check"]["last_error"]


async def test_every_deployment_unhealthy_answers_503_with_the_probe_interval(
    gateway_factory: Any, fake_factory: Any, api_key: str
) -> None:
    a = await fake_factory()
    yaml = fleet_config({"a": probed(a, interval_seconds=2)}, [{"name": "m", "deployments": [{"provider": "a", "model": "m"}]}])
    await set_models(a, 500)
    gw = await gateway_factory(env={"ADMIN_TOKEN": ADMIN_TOKEN}, config_yaml=yaml)
    for _ in range(100):
        if not gw.state.probes.healthy("a"):
            break
        await asyncio.sleep(0.05)
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="m"), headers=auth(api_key))
    assert resp.status == 503
    assert (await resp.json())["error"]["code"] == "circuit_open"
    assert resp.headers["Retry-After"] == "2"
    assert await served_by(a) == [0]


async def test_probes_never_bill_and_only_opted_in_providers_are_probed(
    gateway_factory: Any, fake_factory: Any, db_pool: Any
) -> None:
    a, b = await fake_factory(), await fake_factory()
    gw = await gateway_factory(env={"ADMIN_TOKEN": ADMIN_TOKEN}, config_yaml=pair(a, b))
    calls = records(gw)
    ledger_before = await db_pool.fetchval("SELECT count(*) FROM usage_ledger")
    await asyncio.sleep(0.4)
    stats_a, stats_b = await a.stats(), await b.stats()
    assert stats_a["by_path"].get("/v1/models", 0) >= 3  # probed every 50 ms
    assert stats_b["by_path"].get("/v1/models", 0) == 0  # no health_check: never probed
    assert stats_a["last_request"]["headers"]["authorization"] == "Bearer sk-x"
    assert calls == []
    assert await db_pool.fetchval("SELECT count(*) FROM usage_ledger") == ledger_before
    assert (await provider_entry(gw, "b"))["health_check"] is None


def test_health_check_config(tmp_path: Path) -> None:
    def load(check: Any) -> Any:
        path = tmp_path / "g.yaml"
        path.write_text(fleet_config(
            {"a": {"type": "openai", "base_url": "http://127.0.0.1:9/v1", "health_check": check}},
            [{"name": "m", "deployments": [{"provider": "a", "model": "m"}]}],
        ))
        env = {"GATEWAY_CONFIG": str(path), "DATABASE_URL": "postgresql://x/y"}
        return load_config(load_settings(env), env).providers["a"].health_check

    assert load(True).interval == 10.0 and load(True).unhealthy_after == 2
    assert load({"interval_seconds": 3, "timeout_seconds": 1}).interval == 3.0
    assert load(None) is None
    with pytest.raises(ConfigError, match=r"providers\.a\.health_check\.bogus: unknown key"):
        load({"bogus": 1})
    with pytest.raises(ConfigError, match=r"providers\.a\.health_check\.unhealthy_after: expected a value >= 1"):
        load({"unhealthy_after": 0})


async def test_a_reload_starts_and_stops_health_checks(gateway_factory: Any, fake_factory: Any) -> None:
    a, b = await fake_factory(), await fake_factory()
    plain = fleet_config({"a": a, "b": b}, [{"name": "m", "deployments": [{"provider": "a", "model": "m"}]}])
    gw = await gateway_factory(env={"ADMIN_TOKEN": ADMIN_TOKEN}, config_yaml=plain)
    assert (await provider_entry(gw, "a"))["health_check"] is None
    path = Path(gw.state.settings.config_path)
    path.write_text(pair(a, b))
    assert (await gw.management.post("/admin/config/reload", headers=ADMIN)).status == 200
    await set_models(a, 503)
    await wait_health(gw, "a", False)
    path.write_text(plain)
    assert (await gw.management.post("/admin/config/reload", headers=ADMIN)).status == 200
    await asyncio.sleep(0.05)
    assert (await provider_entry(gw, "a"))["health_check"] is None
    assert gw.state.probes.healthy("a")  # no longer probed: only its calls judge it
    probes = (await a.stats())["by_path"].get("/v1/models", 0)
    await asyncio.sleep(0.2)
    assert (await a.stats())["by_path"].get("/v1/models", 0) == probes
