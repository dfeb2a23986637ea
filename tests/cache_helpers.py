"""Helpers shared by the response-cache tests."""

from __future__ import annotations

import asyncio
from typing import Any

import yaml

from tests.conftest import FakeUpstream, Gateway, auth, chat_body, config_for

__all__ = ["ask", "cached_config", "settle", "upstream_calls"]


def cached_config(
    fake_url: str, policy: dict[str, Any] | None = None, *, name: str = "cached", **cache_settings: Any
) -> str:
    """A config whose group ``name`` caches with ``policy``; ``*`` passes everything else through."""
    models = [
        {"name": name, "deployments": [{"provider": "fake", "model": "mock-small"}],
         "cache": policy if policy is not None else {"mode": "exact"}},
        {"name": "*", "deployments": [{"provider": "fake", "model": "*"}]},
    ]
    extra: dict[str, Any] = {"models": models}
    if cache_settings:
        extra["cache"] = cache_settings
    return config_for(fake_url, **extra)


def with_models(config_yaml: str, *groups: dict[str, Any]) -> str:
    doc = yaml.safe_load(config_yaml)
    doc["models"] = [*groups, *doc["models"]]
    return yaml.safe_dump(doc)


async def ask(
    gateway: Gateway, key: str, content: str = "what is a cache", *, headers: dict[str, str] | None = None,
    model: str = "cached", **body: Any,
) -> tuple[Any, bytes]:
    """POST one chat call; returns (response, raw body)."""
    payload = chat_body(content, model=model, **{"temperature": 0, **body})
    resp = await gateway.data.post("/v1/chat/completions", json=payload, headers={**auth(key), **(headers or {})})
    return resp, await resp.read()


async def upstream_calls(fake: FakeUpstream) -> int:
    return int((await fake.stats())["by_path"].get("/v1/chat/completions", 0))


async def settle(gateway: Gateway, stores: int) -> None:
    """Wait (bounded) until the cache actor has taken ``stores`` answers."""
    counters = gateway.state.cache.counters
    for _ in range(500):
        if counters.stores >= stores:
            await asyncio.sleep(0)  # let the actor finish the message it is on
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"cache took {counters.stores} stores, expected {stores}")
