"""Fixtures of the fault suite: a gateway process in front of the fake provider.

Outage proxies come from tests/conftest.py: ``pg_proxy`` (with ``via_proxy``) and
``redis_proxy`` (with ``redis_via``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytest

from tests.conftest import FakeUpstream, config_for

#: The limiter's per-IP flood guard would count every fault case's burst from 127.0.0.1
#: against one address; the cases here are about other faults.
NO_IP_GUARD: dict[str, Any] = {"per_ip": "off"}


def fault_config(fake: FakeUpstream, **extra: Any) -> str:
    """The YAML of one fake provider serving every model, without the per-IP guard."""
    extra.setdefault("rate_limits", NO_IP_GUARD)
    return config_for(fake.url, **extra)


@pytest.fixture
async def start_gateway(process_factory: Callable[..., Any]) -> Callable[..., Any]:
    """``await start_gateway(fake, env={...}, **yaml_sections)`` → a ready GatewayProcess."""

    async def start(fake: FakeUpstream, env: Mapping[str, str] | None = None, **extra: Any) -> Any:
        return await process_factory(env=dict(env or {}), config_yaml=fault_config(fake, **extra))

    return start
