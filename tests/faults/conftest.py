"""Fixtures of the fault suite: a gateway process in front of the fake provider, and a
cuttable proxy in front of Redis (PostgreSQL's is ``pg_proxy`` in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from tests.chaos import TcpProxy
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


@pytest.fixture
async def redis_proxy(redis_url: str) -> AsyncIterator[TcpProxy]:
    """A cuttable TCP proxy in front of the test Redis (never stop the shared server)."""
    parts = urlsplit(redis_url)
    proxy = await TcpProxy.start(parts.hostname or "127.0.0.1", parts.port or 6379)
    yield proxy
    await proxy.close()


def redis_through(redis_url: str, proxy: TcpProxy) -> str:
    """``redis_url`` rewritten to go through ``proxy``."""
    parts = urlsplit(redis_url)
    return urlunsplit((parts.scheme, f"127.0.0.1:{proxy.port}", parts.path, parts.query, ""))
