"""Graceful shutdown of a real ``llm-gateway serve`` process on SIGTERM (non-streaming calls;
streams are covered with the chat relay's tests).

SIGTERM: stop accepting, let in-flight requests finish within SHUTDOWN_GRACE_SECONDS,
stop the actors, exit 0.
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import aiohttp

from tests.conftest import auth, chat_body, config_for


async def _refused(url: str) -> bool:
    """True when a new connection to ``url`` is refused (nobody listens any more)."""
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        try:
            async with session.get(f"{url}/healthz", timeout=aiohttp.ClientTimeout(total=1)) as resp:
                await resp.read()
        except aiohttp.ClientConnectorError:
            return True
        except (aiohttp.ClientError, TimeoutError):
            return False
    return False


async def _until(predicate: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


async def test_sigterm_lets_an_in_flight_request_finish_refuses_new_ones_and_exits_0(
    process_factory: Any, fake_factory: Any, api_key: str
) -> None:
    fake = await fake_factory()
    gp = await process_factory(config_yaml=config_for(fake.url), env={"SHUTDOWN_GRACE_SECONDS": "20"})
    await fake.script({"delay_ms": 2000})  # a slow upstream: the call is in flight for 2 s
    async with aiohttp.ClientSession() as session:
        in_flight = asyncio.ensure_future(
            session.post(f"{gp.url}/v1/chat/completions", json=chat_body("slow one"), headers=auth(api_key))
        )

        async def upstream_has_it() -> bool:
            return bool((await fake.stats())["requests"] == 1)

        await _until(upstream_has_it, 10)
        gp.signal(signal.SIGTERM)
        await _until(lambda: _refused(gp.url), 5)  # no new connections while draining
        assert not in_flight.done()  # refused while the slow call is still running
        resp = await asyncio.wait_for(in_flight, 15)
        assert resp.status == 200
        answer = await resp.json()
        assert answer["choices"][0]["message"]["content"].startswith("This is a mock answer to: slow one")
    assert await asyncio.to_thread(gp.wait, 15) == 0
    log = gp.log()
    assert "received SIGTERM: draining" in log and "Traceback" not in log


async def test_sigterm_does_not_wait_past_the_grace_period(
    process_factory: Any, fake_factory: Any, api_key: str
) -> None:
    fake = await fake_factory()
    gp = await process_factory(config_yaml=config_for(fake.url), env={"SHUTDOWN_GRACE_SECONDS": "0.5"})
    await fake.script({"hang": True})  # an upstream that never answers
    async with aiohttp.ClientSession() as session:
        in_flight = asyncio.ensure_future(
            session.post(f"{gp.url}/v1/chat/completions", json=chat_body(), headers=auth(api_key))
        )

        async def upstream_has_it() -> bool:
            return bool((await fake.stats())["requests"] == 1)

        await _until(upstream_has_it, 10)
        gp.signal(signal.SIGTERM)
        # The process gives the request its grace, then cancels it and still exits cleanly.
        assert await asyncio.to_thread(gp.wait, 15) == 0
        try:
            resp = await asyncio.wait_for(in_flight, 5)
            assert resp.status >= 500
        except aiohttp.ClientError:
            pass  # or the connection is simply closed
    async def upstream_call_cancelled() -> bool:
        return bool((await fake.stats())["requests_cancelled"] == 1)

    await _until(upstream_call_cancelled, 5)  # the upstream call did not outlive the gateway


async def test_a_second_sigterm_skips_the_wait_but_not_the_orderly_exit(
    process_factory: Any, fake_factory: Any, api_key: str
) -> None:
    fake = await fake_factory()
    gp = await process_factory(config_yaml=config_for(fake.url), env={"SHUTDOWN_GRACE_SECONDS": "60"})
    await fake.script({"hang": True})
    async with aiohttp.ClientSession() as session:
        in_flight = asyncio.ensure_future(
            session.post(f"{gp.url}/v1/chat/completions", json=chat_body(), headers=auth(api_key))
        )

        async def upstream_has_it() -> bool:
            return bool((await fake.stats())["requests"] == 1)

        await _until(upstream_has_it, 10)
        gp.signal(signal.SIGTERM)
        await _until(lambda: _refused(gp.url), 5)
        gp.signal(signal.SIGTERM)
        assert await asyncio.to_thread(gp.wait, 15) == 0  # well before the 60 s grace
        try:
            await asyncio.wait_for(in_flight, 5)
        except aiohttp.ClientError:
            pass  # the connection was dropped
    log = gp.log()
    assert "second signal" in log and "Traceback" not in log
