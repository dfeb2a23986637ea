"""A newcomer's first hour, scripted: what ``--version``, ``--help``, a taken port, the
start-up output, ``/readyz``, ``/metrics`` and ``/v1/models`` show (issue 18).

Processes are real ``python -m gateway`` runs against the test database; the rest runs
an in-process gateway in front of the fake provider over loopback.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from actors.limiter import describe_ip_guard
from gateway import __version__
from gateway.auth.keys import (
    DEFAULT_KEY_RPM,
    DEFAULT_KEY_WINDOW_SECONDS,
    DEV_KEY,
    DEV_KEY_RPM,
    DEV_KEY_WINDOW_SECONDS,
    KeyPolicy,
    KeyStore,
)
from gateway.core.config import RateLimitSettings, load_config, load_settings
from gateway.relay.routing import ModelCatalog
from gateway.testing.fake_llm import MODEL_IDS
from tests.conftest import REPO, FakeUpstream, Gateway, auth, free_port, wait_until_ready

#: How long ``/v1/models`` may take while a provider hangs: the catalog's one-second
#: bound on a cold list, plus room for a loaded 2-core machine.
MODELS_BOUND_SECONDS = 2.5


def _env(database_url: str, tmp_path: Path, **extra: str) -> dict[str, str]:
    """A newcomer's environment: no XDG_RUNTIME_DIR (root, containers), no config file."""
    environ = {
        k: v for k, v in os.environ.items()
        if not k.startswith(("GATEWAY_", "OTEL_", "LOG_")) and k != "XDG_RUNTIME_DIR"
    }
    environ.update({
        "DATABASE_URL": database_url,
        "BIND_ADDR": f"127.0.0.1:{free_port()}",
        "MANAGEMENT_BIND_ADDR": f"127.0.0.1:{free_port()}",
        "LLM_GATEWAY_HOME": str(tmp_path / "home"),
        "VENICE_API_KEY": "",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
        **extra,
    })
    return environ


def _gateway(*args: str, env: dict[str, str], cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args], env=env, cwd=str(cwd),
        capture_output=True, text=True, timeout=timeout, check=False,
    )


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port something else is listening on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield int(holder.getsockname()[1])


# ----------------------------------------------------------------------------- the command
def test_version_prints_the_package_version(tmp_path: Path) -> None:
    result = _gateway("--version", env=_env("", tmp_path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"llm-gateway {__version__}\n" and result.stderr == ""


def test_setup_cfg_takes_the_version_from_the_package() -> None:
    # One place for the version: a release edits gateway/__init__.py only.
    assert "version = attr: gateway.__version__" in (REPO / "setup.cfg").read_text()


def test_serve_help_describes_the_command_its_options_and_the_environment(tmp_path: Path) -> None:
    result = _gateway("serve", "--help", env=_env("", tmp_path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # argparse wraps lines to the terminal width
    assert "Apply the database migrations, then serve the data plane (BIND_ADDR" in text
    assert "least severe log line written to stderr" in text  # --log-level has help
    assert "Configuration comes from environment variables" in text and "README" in text


def test_keys_create_help_states_the_default_limits(tmp_path: Path) -> None:
    result = _gateway("keys", "create", "--help", env=_env("", tmp_path), cwd=tmp_path)
    text = " ".join(result.stdout.split())
    assert f"{DEFAULT_KEY_RPM} requests per {DEFAULT_KEY_WINDOW_SECONDS} seconds" in text
    assert f"requests per window (default {DEFAULT_KEY_RPM})" in text


# ----------------------------------------------------------------------------- a taken port
def test_a_taken_data_port_is_one_line_before_anything_starts(tmp_path: Path, taken_port: int) -> None:
    # No DATABASE_URL: without the check first, the embedded database would start and the
    # development key be announced before the bind failed.
    env = _env("", tmp_path, BIND_ADDR=f"127.0.0.1:{taken_port}")
    started = time.monotonic()
    result = _gateway("serve", env=env, cwd=tmp_path)
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr == (
        f"llm-gateway: BIND_ADDR 127.0.0.1:{taken_port} is in use (set BIND_ADDR to another port)\n"
    )
    assert time.monotonic() - started < 15
    assert not (tmp_path / "home" / "pgdata").exists()  # no embedded database was started


def test_a_taken_management_port_names_its_variable(database_url: str, tmp_path: Path, taken_port: int) -> None:
    env = _env(database_url, tmp_path, MANAGEMENT_BIND_ADDR=f"127.0.0.1:{taken_port}")
    result = _gateway("serve", env=env, cwd=tmp_path)
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr == (
        f"llm-gateway: MANAGEMENT_BIND_ADDR 127.0.0.1:{taken_port} is in use"
        " (set MANAGEMENT_BIND_ADDR to another port)\n"
    )


# ----------------------------------------------------------------------------- start-up output
async def test_start_up_prints_only_our_own_lines(database_url: str, tmp_path: Path) -> None:
    env = _env(database_url, tmp_path, LOG_FORMAT="json")
    out_path, err_path = tmp_path / "stdout", tmp_path / "stderr"
    with out_path.open("wb") as out, err_path.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve"], env=env, cwd=str(tmp_path), stdout=out, stderr=err,
        )
    try:
        await wait_until_ready(f"http://{env['BIND_ADDR']}", proc=proc)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    stdout, stderr = out_path.read_text(), err_path.read_text()
    assert stdout.splitlines() == [
        f"llm-gateway {__version__} serving data plane on http://{env['BIND_ADDR']}"
        f" and management plane on http://{env['MANAGEMENT_BIND_ADDR']}"
    ]
    # stderr holds our JSON log lines and nothing else: no warning of a library.
    lines = [json.loads(line) for line in stderr.splitlines()]  # fails on any non-JSON line
    assert lines and all(line["logger"].startswith("gateway.") for line in lines), stderr
    assert all(line["level"] == "info" for line in lines), stderr
    # The limiter's start line states the guard as the configuration spells it.
    defaults = load_config(load_settings({"DATABASE_URL": database_url}), {})
    limiter_lines = [line["msg"] for line in lines if line["msg"].startswith("rate limits: ")]
    assert limiter_lines == [limiter_lines[0]]
    assert limiter_lines[0].startswith(f"rate limits: {describe_ip_guard(defaults.rate_limits)}; ")
    assert limiter_lines[0].startswith(f"rate limits: per-IP {defaults.rate_limits.per_ip} ")


def test_the_guard_description_leads_with_the_configured_rate() -> None:
    assert describe_ip_guard(RateLimitSettings(per_ip="100/second")) == (
        "per-IP 100/second with a burst of 100 (at most 200 in 1 s and 1000 in 10 s per address)"
    )
    assert describe_ip_guard(RateLimitSettings(per_ip="off")) == "per-IP off"
    assert describe_ip_guard(RateLimitSettings(per_ip="20/minute", per_ip_burst=0)) == "per-IP 20/minute (no burst)"
    assert describe_ip_guard(RateLimitSettings(per_ip="20/minute", per_ip_burst=5)) == (
        "per-IP 20/minute with a burst of 5 (at most 25 in 60 s and 200 in 600 s per address)"
    )


# ----------------------------------------------------------------------------- the dev key
async def test_the_development_key_gets_room_to_try_things_out(db_pool: asyncpg.Pool) -> None:
    await db_pool.execute("DELETE FROM api_keys WHERE key_prefix = $1", DEV_KEY[:12])
    store = KeyStore(db_pool)
    window = {"requests": DEV_KEY_RPM, "window_seconds": DEV_KEY_WINDOW_SECONDS}
    assert await store.ensure(DEV_KEY, "development", **window) is True
    assert await store.ensure(DEV_KEY, "development", **window) is False  # seeded once
    policy = (await store.get(DEV_KEY[:12])).policy
    assert (policy.rate_limit_requests, policy.rate_limit_window_seconds) == (DEV_KEY_RPM, DEV_KEY_WINDOW_SECONDS)
    assert DEV_KEY_RPM > 100 * DEFAULT_KEY_RPM

    # Seeded by an earlier version with the default window: raised on the next start.
    await db_pool.execute(
        "UPDATE api_keys SET rate_limit_requests = $2, rate_limit_window_seconds = $3 WHERE key_prefix = $1",
        DEV_KEY[:12], DEFAULT_KEY_RPM, DEFAULT_KEY_WINDOW_SECONDS,
    )
    assert await store.ensure(DEV_KEY, "development", **window) is False
    assert (await store.get(DEV_KEY[:12])).policy.rate_limit_requests == DEV_KEY_RPM

    # A window an operator chose is theirs.
    await db_pool.execute("UPDATE api_keys SET rate_limit_requests = 500 WHERE key_prefix = $1", DEV_KEY[:12])
    await store.ensure(DEV_KEY, "development", **window)
    assert (await store.get(DEV_KEY[:12])).policy.rate_limit_requests == 500
    await db_pool.execute("DELETE FROM api_keys WHERE key_prefix = $1", DEV_KEY[:12])
    assert KeyPolicy().rate_limit_requests == DEFAULT_KEY_RPM  # new keys keep the documented default


# ----------------------------------------------------------------------------- /readyz, /metrics
async def test_readyz_names_every_check_with_its_state(gateway: Gateway) -> None:
    resp = await gateway.data.get("/readyz")
    for _ in range(50):  # the key listener connects just after start
        if resp.status == 200:
            break
        await asyncio.sleep(0.05)
        resp = await gateway.data.get("/readyz")
    body = await resp.json()
    actors = {f"actor:{ref.name}" for ref in gateway.state.supervisor.refs()}
    assert resp.status == 200 and body["status"] == "ok"
    assert actors and body["checks"] == {
        "server": "ok", "database": "ok", "key_invalidation": "ok", "rate_limits": "ok", **dict.fromkeys(actors, "ok"),
    }

    gateway.state.draining = True
    try:
        resp = await gateway.data.get("/readyz")
        body = await resp.json()
    finally:
        gateway.state.draining = False
    assert resp.status == 503 and body["status"] == "unavailable"
    assert body["checks"]["server"] == "shutting down" and body["checks"]["database"] == "ok"


async def test_metrics_carry_the_build_info(gateway: Gateway) -> None:
    text = await (await gateway.management.get("/metrics")).text()
    assert (
        f'gateway_build_info{{python="{platform.python_version()}",version="{__version__}"}} 1.0' in text
    ), [line for line in text.splitlines() if "build_info" in line]


# ----------------------------------------------------------------------------- /v1/models
def _wildcard_config(fake_url: str) -> str:
    import yaml

    return yaml.safe_dump({
        "providers": {"fake": {"type": "openai", "base_url": fake_url, "api_key": "sk-fake-provider-secret"}},
        "models": [
            {"name": "fixed", "deployments": [{"provider": "fake", "model": "m1"}]},
            {"name": "fake/*", "deployments": [{"provider": "fake", "model": "*"}]},
        ],
    })


async def _hang_model_lists(fake: FakeUpstream, times: int = 5) -> None:
    steps = [{"hang": True}] * times
    async with fake.session.post(f"{fake.url[:-3]}/_fake/script", json={"route": "models", "steps": steps}) as r:
        assert r.status == 200, await r.text()


async def _models(gw: Gateway, key: str) -> tuple[float, list[str]]:
    started = time.monotonic()
    resp = await gw.data.get("/v1/models", headers=auth(key))
    assert resp.status == 200, await resp.text()
    body: dict[str, Any] = await resp.json()
    return time.monotonic() - started, [m["id"] for m in body["data"]]


async def test_models_answer_from_cache_within_a_bound_while_the_provider_hangs(
    fake: FakeUpstream, gateway_factory: Any, api_key: str
) -> None:
    # ``fake`` first: fixtures stop in reverse, so the gateway (and its hanging call) goes
    # before the fake provider, whose shutdown would otherwise wait for that call.
    gw = await gateway_factory(config_yaml=_wildcard_config(fake.url))
    gw.state.router.catalog = ModelCatalog(ttl=0.3, failure_ttl=0.3)  # expire quickly, as 5 minutes would
    listed = sorted(["fixed", *(f"fake/{model_id}" for model_id in MODEL_IDS)])

    _took, names = await _models(gw, api_key)
    assert names == listed
    _took, names = await _models(gw, api_key)  # fresh: from the cache, no provider call
    assert names == listed and (await fake.stats())["by_path"]["/v1/models"] == 1

    await _hang_model_lists(fake)
    await asyncio.sleep(0.4)  # the list is now stale; the provider hangs from here on
    for _ in range(3):
        took, names = await _models(gw, api_key)
        assert names == listed  # the last good list, not an empty one
        assert took < MODELS_BOUND_SECONDS
    assert (await fake.stats())["by_path"]["/v1/models"] == 2  # one refresh, still hanging, shared


async def test_models_do_not_wait_on_a_provider_that_never_answered(
    fake: FakeUpstream, gateway_factory: Any, api_key: str
) -> None:
    # ``fake`` first: fixtures stop in reverse, so the gateway (and its hanging call) goes
    # before the fake provider, whose shutdown would otherwise wait for that call.
    await _hang_model_lists(fake)
    gw = await gateway_factory(config_yaml=_wildcard_config(fake.url))
    took, names = await _models(gw, api_key)
    # Nothing known yet: the exact groups now, within the bound; the provider's later.
    assert names == ["fixed"]
    assert took < MODELS_BOUND_SECONDS
    chat = await gw.data.post(
        "/v1/chat/completions", headers=auth(api_key),
        json={"model": "fake/anything", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert chat.status == 200  # every name the wildcard matches works, listed or not
