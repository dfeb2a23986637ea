"""Helpers for routing tests: a config over several fake providers, and the call records.

    a, b = await fake_factory(), await fake_factory()
    yaml = fleet_config({"a": a, "b": b}, [{"name": "m", "deployments": [...]}])
    gw = await gateway_factory(config_yaml=yaml)
    calls = records(gw)   # every finished call's CallRecord, in order
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from gateway.core.usage import CallRecord
from tests.conftest import FakeUpstream, free_port

__all__ = ["dead_url", "fleet_config", "records", "served_by"]


def dead_url() -> str:
    """A base URL on loopback where nothing listens: the connection never opens."""
    return f"http://127.0.0.1:{free_port()}/v1"


def fleet_config(
    providers: Mapping[str, FakeUpstream | str | Mapping[str, Any]],
    models: list[dict[str, Any]],
    **extra: Any,
) -> str:
    """YAML with one OpenAI-wire provider per fake (or URL, or full provider mapping)."""
    doc_providers: dict[str, Any] = {}
    for name, p in providers.items():
        if isinstance(p, FakeUpstream):
            doc_providers[name] = {"type": "openai", "base_url": p.url, "api_key": f"sk-{name}"}
        elif isinstance(p, str):
            doc_providers[name] = {"type": "openai", "base_url": p, "api_key": f"sk-{name}"}
        else:
            doc_providers[name] = dict(p)
    doc: dict[str, Any] = {"providers": doc_providers, "models": models}
    doc.update(extra)
    return yaml.safe_dump(doc)


def records(gw: Any) -> list[CallRecord]:
    """Subscribe to the gateway's finished calls; the returned list fills as calls end."""
    seen: list[CallRecord] = []
    gw.state.call_listeners.append(seen.append)
    return seen


async def served_by(*fakes: FakeUpstream) -> list[int]:
    """Chat requests each fake has received so far (both wires)."""
    counts = []
    for fake in fakes:
        stats = await fake.stats()
        by_path = stats["by_path"]
        counts.append(by_path.get("/v1/chat/completions", 0) + by_path.get("/v1/messages", 0))
    return counts
