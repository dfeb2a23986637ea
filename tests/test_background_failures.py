"""Background work that keeps shared state fresh (spend refresh for budgets, LISTEN for
revocations) fails loudly: a WARNING, a metric and a line in /readyz, never DEBUG only."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from tests.conftest import FakeUpstream, config_for, via_proxy


async def _metric(gw: Any, task: str) -> float:
    text = await (await gw.management.get("/metrics")).text()
    for line in text.splitlines():
        if line.startswith(f'gateway_background_failures_total{{task="{task}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_spend_refresh_and_listen_failures_are_warned_counted_and_in_readyz(
    pg_proxy: Any, gateway_factory: Any, fake: FakeUpstream, database_url: str, caplog: Any
) -> None:
    gw = await gateway_factory(
        env={"DATABASE_URL": via_proxy(database_url, pg_proxy.port)}, config_yaml=config_for(fake.url)
    )
    assert "budgets" not in (await (await gw.data.get("/readyz")).json()).get("degraded", {})
    for _ in range(200):  # up to 10 s
        if gw.state.auth.listening:
            break
        await asyncio.sleep(0.05)
    with caplog.at_level(logging.WARNING):
        await pg_proxy.cut()
        deadline = time.monotonic() + 30
        degraded: dict[str, str] = {}
        while time.monotonic() < deadline:
            degraded = (await (await gw.data.get("/readyz")).json()).get("degraded", {})
            if "budgets" in degraded and await _metric(gw, "key_listen") >= 1:
                break
            await asyncio.sleep(0.2)
        assert "shared budgets may be stale" in degraded.get("budgets", ""), degraded
        assert await _metric(gw, "spend_refresh") >= 1
        assert await _metric(gw, "key_listen") >= 1
        warned = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert any(r.name == "gateway.billing" and "spend refresh failed" in r.getMessage() for r in warned)
        assert any(r.name == "gateway.auth" and "LISTEN connect failed" in r.getMessage() for r in warned)
        await pg_proxy.restore()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if "budgets" not in (await (await gw.data.get("/readyz")).json()).get("degraded", {}):
                break
            await asyncio.sleep(0.2)
        assert "budgets" not in (await (await gw.data.get("/readyz")).json()).get("degraded", {})
