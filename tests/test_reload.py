"""Config reload without a restart: the admin API and SIGHUP, under load, refused files,
what carries over (breaker history, provider pools), masking, and ``--workers``."""

from __future__ import annotations

import asyncio
import hashlib
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from gateway.core.config import Deployment as Dep
from gateway.core.config import GatewayConfig, ModelGroup, ProviderConfig, load_settings
from gateway.edge.reload import ProviderPools
from tests.conftest import auth, chat_body
from tests.fleet import fleet_config, records, served_by

ADMIN_TOKEN = "admin-secret-for-reload-tests-0123"
ADMIN = auth(ADMIN_TOKEN)


def group(name: str, *providers: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "deployments": [{"provider": p, "model": "m"} for p in providers], **extra}


def config_path(gw: Any) -> Path:
    path = gw.state.settings.config_path
    assert path is not None
    return Path(path)


async def reload(gw: Any) -> tuple[int, dict[str, Any]]:
    resp = await gw.management.post("/admin/config/reload", headers=ADMIN)
    return resp.status, await resp.json()


async def metric(gw: Any, name: str) -> float:
    text = await (await gw.management.get("/metrics")).text()
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


async def test_a_stream_opened_before_a_reload_finishes_on_the_old_route(
    gateway_factory: Any, fake_factory: Any, api_key: str
) -> None:
    a, b = await fake_factory(), await fake_factory()
    gw = await gateway_factory(
        env={"ADMIN_TOKEN": ADMIN_TOKEN}, config_yaml=fleet_config({"a": a}, [group("m", "a")])
    )
    calls = records(gw)
    old_provider = gw.state.providers["a"]
    await a.script({"chunks": 6, "chunk_delay_ms": 150})
    resp = await gw.data.post("/v1/chat/completions", json=chat_body("one two", model="m", stream=True), headers=auth(api_key))
    assert resp.status == 200
    first = await resp.content.readline()
    assert first.startswith(b"data: ")

    # Mid-stream: the route now goes to b only, and provider a is gone.
    config_path(gw).write_text(fleet_config({"b": b}, [group("m", "b")]))
    status, body = await reload(gw)
    assert status == 200, body
    assert body["ok"] is True and body["changed"] is True and body["active"]["generation"] == 2

    # Calls after the reload use the new route, while the old stream is still open.
    after = await gw.data.post("/v1/chat/completions", json=chat_body(model="m"), headers=auth(api_key))
    assert after.status == 200
    assert not gw.state.provider_pools.closed(old_provider), "a's pool closed under its open stream"

    rest = await resp.read()
    assert rest.endswith(b"data: [DONE]\n\n")  # the old stream finished whole, on a
    assert await served_by(a, b) == [1, 1]
    assert [c.provider for c in calls] == ["b", "a"]
    # The removed provider's connection pool closes after its last call.
    for _ in range(50):
        if gw.state.provider_pools.closed(old_provider):
            break
        await asyncio.sleep(0.02)
    assert gw.state.provider_pools.closed(old_provider)
    assert "a" not in gw.state.providers


async def test_calls_during_a_reload_under_load_all_succeed(
    gateway_factory: Any, fake_factory: Any, api_key: str
) -> None:
    a, b = await fake_factory(latency_ms=20), await fake_factory(latency_ms=20)
    gw = await gateway_factory(
        env={"ADMIN_TOKEN": ADMIN_TOKEN}, config_yaml=fleet_config({"a": a, "b": b}, [group("m", "a")])
    )
    calls = records(gw)

    async def one() -> int:
        resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="m"), headers=auth(api_key))
        await resp.read()
        return resp.status

    load = [asyncio.create_task(one()) for _ in range(30)]
    await asyncio.sleep(0.01)
    config_path(gw).write_text(fleet_config({"a": a, "b": b}, [group("m", "b")]))
    status, _ = await reload(gw)
    load += [asyncio.create_task(one()) for _ in range(30)]
    assert status == 200
    assert await asyncio.gather(*load) == [200] * 60
    # Every call after the reload went to b; a served only calls routed before it.
    assert calls[-1].provider == "b"
    served = await served_by(a, b)
    assert sum(served) == 60 and served[1] >= 30


async def test_a_broken_file_changes_nothing_and_is_reported(
    gateway_factory: Any, fake_factory: Any, api_key: str
) -> None:
    a = await fake_factory()
    gw = await gateway_factory(
        env={"ADMIN_TOKEN": ADMIN_TOKEN}, config_yaml=fleet_config({"a": a}, [group("m", "a")])
    )
    before = await (await gw.management.get("/admin/config", headers=ADMIN)).json()
    assert await metric(gw, "gateway_config_last_reload_success") == 1

    # Valid YAML, but a deployment names a provider that does not exist.
    config_path(gw).write_text(fleet_config({"a": a}, [group("m", "a"), group("n", "nope")]))
    status, body = await reload(gw)
    assert status == 422
    assert body["error"]["code"] == "invalid_config"
    assert body["error"]["message"] == "models[1].deployments[0].provider: unknown provider 'nope'"
    assert body["reload"]["ok"] is False

    # Not YAML at all.
    config_path(gw).write_text("providers: [unclosed\n")
    status, body = await reload(gw)
    assert status == 422 and str(config_path(gw)) in body["error"]["message"]

    after = await (await gw.management.get("/admin/config", headers=ADMIN)).json()
    assert after["active"] == before["active"]  # same hash, load time, generation
    assert after["last_reload"]["ok"] is False
    assert await metric(gw, "gateway_config_last_reload_success") == 0
    assert await metric(gw, "gateway_config_reload_failures_total") == 2
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="m"), headers=auth(api_key))
    assert resp.status == 200
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="n"), headers=auth(api_key))
    assert resp.status == 404

    # Fixed: the next reload applies and the metric says so.
    config_path(gw).write_text(fleet_config({"a": a}, [group("m", "a"), group("n", "a")]))
    status, body = await reload(gw)
    assert status == 200 and body["ok"] is True
    assert await metric(gw, "gateway_config_last_reload_success") == 1
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="n"), headers=auth(api_key))
    assert resp.status == 200


async def test_breaker_history_carries_over_only_for_unchanged_deployments(
    gateway_factory: Any, fake_factory: Any, api_key: str
) -> None:
    a, b = await fake_factory(), await fake_factory()
    providers = {"a": a, "b": b}
    gw = await gateway_factory(
        env={"ADMIN_TOKEN": ADMIN_TOKEN},
        config_yaml=fleet_config(providers, [group("ma", "a"), group("mb", "b")]),
    )
    for model in ("ma", "mb"):
        resp = await gw.data.post("/v1/chat/completions", json=chat_body(model=model), headers=auth(api_key))
        assert resp.status == 200
    await asyncio.sleep(0.05)  # outcomes are tells
    assert gw.state.breaker.health("a/m").calls == 1 and gw.state.breaker.health("b/m").calls == 1
    kept_a = gw.state.providers["a"]

    # b's provider changes (a new header); a is untouched; prices change on a's group.
    doc = fleet_config(
        {"a": a, "b": {"type": "openai", "base_url": b.url, "api_key": "sk-b", "headers": {"x-team": "blue"}}},
        [group("ma", "a"), group("mb", "b")],
    )
    config_path(gw).write_text(doc)
    status, body = await reload(gw)
    assert status == 200, body
    await asyncio.sleep(0.05)
    assert gw.state.breaker.health("a/m") is not None and gw.state.breaker.health("a/m").calls == 1
    assert gw.state.breaker.health("b/m") is None  # forgotten: it points somewhere new
    assert gw.state.providers["a"] is kept_a  # same object, same connection pool
    assert gw.state.providers["b"].config.headers == (("x-team", "blue"),)


async def test_admin_config_shows_hash_load_time_and_source_with_secrets_masked(
    gateway_factory: Any, fake_factory: Any
) -> None:
    a = await fake_factory()
    secret_url = a.url.replace("http://", "http://user:pa55word@")
    gw = await gateway_factory(
        env={"ADMIN_TOKEN": ADMIN_TOKEN},
        config_yaml=fleet_config(
            {"a": {"type": "openai", "base_url": secret_url, "api_key": "sk-very-secret-key",
                   "headers": {"api-key": "hdr-secret"}}},
            [group("m", "a")],
        ),
    )
    started = time.time()
    resp = await gw.management.get("/admin/config", headers=ADMIN)
    assert resp.status == 200
    body = await resp.json()
    text = orjson.dumps(body).decode()
    assert "sk-very-secret-key" not in text and "hdr-secret" not in text and "pa55word" not in text
    active = body["active"]
    path = config_path(gw)
    assert active["source"] == str(path)
    assert active["hash"] == "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    assert active["loaded_at"] <= started and active["generation"] == 1
    provider = body["config"]["providers"]["a"]
    assert provider["api_key"] == "***" and provider["headers"] == {"api-key": "***"}
    assert body["config"]["models"][0]["name"] == "m"
    assert (await gw.management.get("/admin/config")).status in (401, 403)  # admin only


async def test_a_reload_rereads_file_secrets(
    gateway_factory: Any, fake_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = await fake_factory()
    key_file = tmp_path / "a_key"
    key_file.write_text("sk-first")
    doc = fleet_config(
        {"a": {"type": "openai", "base_url": a.url, "api_key": "${A_KEY}"}}, [group("m", "a")]
    )
    # A reload reads the process environment, as the running gateway would.
    monkeypatch.setenv("A_KEY_FILE", str(key_file))
    gw = await gateway_factory(env={"ADMIN_TOKEN": ADMIN_TOKEN, "A_KEY_FILE": str(key_file)}, config_yaml=doc)
    assert gw.state.providers["a"].config.api_key == "sk-first"
    key_file.write_text("sk-second")
    status, body = await reload(gw)
    assert status == 200 and body["changed"] is False  # same file, new secret
    assert gw.state.providers["a"].config.api_key == "sk-second"


# ----------------------------------------------------------------------------- processes
async def _chat(session: aiohttp.ClientSession, url: str, key: str, model: str) -> int:
    async with session.post(f"{url}/v1/chat/completions", json=chat_body(model=model), headers=auth(key)) as r:
        await r.read()
        return r.status


async def test_sighup_reloads_a_running_gateway(process_factory: Any, fake_factory: Any, api_key: str) -> None:
    a = await fake_factory()
    gp = await process_factory(
        env={"ADMIN_TOKEN": ADMIN_TOKEN}, config_yaml=fleet_config({"a": a}, [group("m", "a")])
    )
    path = Path(gp.env["GATEWAY_CONFIG"])
    async with aiohttp.ClientSession() as session:
        assert await _chat(session, gp.url, api_key, "n") == 404
        path.write_text(fleet_config({"a": a}, [group("m", "a"), group("n", "a")]))
        gp.signal(signal.SIGHUP)
        for _ in range(100):
            async with session.get(f"{gp.management_url}/admin/config", headers=ADMIN) as r:
                if (await r.json())["active"]["generation"] == 2:
                    break
            await asyncio.sleep(0.05)
        else:
            pytest.fail(f"SIGHUP did not reload; log:\n{gp.log()}")
        assert await _chat(session, gp.url, api_key, "n") == 200
    # Log lines reach the file in batches (every 20 ms, from a writer thread): wait, bounded.
    for _ in range(100):
        if "config reloaded (sighup)" in gp.log():
            break
        await asyncio.sleep(0.05)
    assert "config reloaded (sighup)" in gp.log()


async def _both_workers_serving(session: aiohttp.ClientSession, gp: Any) -> None:
    """The aggregated /metrics has both workers' samples once both serve."""
    for _ in range(200):
        async with session.get(f"{gp.management_url}/metrics") as r:
            text = await r.text()
        if 'worker="0"' in text and 'worker="1"' in text:
            return
        await asyncio.sleep(0.1)
    pytest.fail(f"workers did not both start; log:\n{gp.log()}")


async def test_every_worker_reloads(process_factory: Any, fake_factory: Any, api_key: str) -> None:
    a, b = await fake_factory(), await fake_factory()
    gp = await process_factory(
        env={"ADMIN_TOKEN": ADMIN_TOKEN}, config_yaml=fleet_config({"a": a, "b": b}, [group("m", "a")]),
        args=("--workers", "2", "--per-worker-limits"),  # memory limits: each worker its own
    )
    path = Path(gp.env["GATEWAY_CONFIG"])
    async with aiohttp.ClientSession() as session:
        await _both_workers_serving(session, gp)
        # Broken first: refused by the supervisor, so no worker changes.
        path.write_text(fleet_config({"a": a}, [group("m", "zzz")]))
        async with session.post(f"{gp.management_url}/admin/config/reload", headers=ADMIN) as r:
            assert r.status == 422
            assert "unknown provider 'zzz'" in (await r.json())["error"]["message"]
        path.write_text(fleet_config({"a": a, "b": b}, [group("m", "b")]))
        async with session.post(f"{gp.management_url}/admin/config/reload", headers=ADMIN) as r:
            body = await r.json()
            assert r.status == 200, body
        digest = body["active"]["hash"]
        assert len(body["workers"]) == 2
        assert all(w["ok"] and w["hash"] == digest for w in body["workers"]), body["workers"]
        assert len({w["pid"] for w in body["workers"]}) == 2
        statuses = [await _chat(session, gp.url, api_key, "m") for _ in range(12)]
    assert statuses == [200] * 12
    assert await served_by(a, b) == [0, 12]  # whichever worker took it, the new route


async def test_a_reload_changes_the_per_ip_guard_at_once(gateway_factory: Any, fake_factory: Any, api_key: str) -> None:
    a = await fake_factory()
    gw = await gateway_factory(
        env={"ADMIN_TOKEN": ADMIN_TOKEN},
        config_yaml=fleet_config({"a": a}, [group("m", "a")], rate_limits={"per_ip": "off"}),
    )

    async def statuses() -> list[int]:
        out = []
        for _ in range(3):
            resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="m"), headers=auth(api_key))
            await resp.read()
            out.append(resp.status)
        return out

    assert await statuses() == [200, 200, 200]
    # per_ip counts failed attempts only (issue 17 item 6); per_ip_all caps every request
    # (its burst is its rate: at most 2 in the first minute).
    config_path(gw).write_text(fleet_config(
        {"a": a}, [group("m", "a")], rate_limits={"per_ip": "off", "per_ip_all": "1/minute"},
    ))
    status, body = await reload(gw)
    assert status == 200 and body["needs_restart"] == []
    assert await statuses() == [200, 200, 429]


async def test_replaced_providers_stay_open_until_every_older_request_is_done() -> None:
    def config(*names: str) -> GatewayConfig:
        return GatewayConfig(
            providers={n: ProviderConfig(name=n, type="mock") for n in names},
            models=(ModelGroup(name="m", deployments=tuple(Dep(provider=n, model="m") for n in names)),),
        )

    pools = ProviderPools(load_settings({"DATABASE_URL": "postgresql://x/y"}))
    first = pools.build(config("x", "y"))
    old_request = pools.enter()  # a stream of generation 1, still open
    second = pools.build(config("y"), keep=first)
    pools.retire(first, second)  # x is gone from generation 2
    newer_request = pools.enter()
    third = pools.build(config("z"), keep=second)
    pools.retire(second, third)  # y is gone from generation 3
    await asyncio.sleep(0)
    assert second["y"] is first["y"]  # unchanged: the same object
    assert not pools.closed(first["x"]) and not pools.closed(first["y"])
    pools.leave(newer_request)  # generation 2 drained, but generation 1 still runs (and used y)
    await asyncio.sleep(0.01)
    assert not pools.closed(first["x"]) and not pools.closed(first["y"])
    pools.leave(old_request)
    await asyncio.sleep(0.01)
    assert pools.closed(first["x"]) and pools.closed(first["y"]) and not pools.closed(third["z"])
    # Closing a provider closes its whole answers' connections too, at shutdown as well.
    assert first["x"].http.closed and first["y"].http.closed and not third["z"].http.closed
    await pools.close_all()
    assert third["z"].http.closed
