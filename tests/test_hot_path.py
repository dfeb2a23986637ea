"""The chat handler's hot path: behaviour kept while it was made cheaper (see bench/)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from typing import Any

import orjson

from tests.conftest import FakeUpstream, Gateway, auth, chat_body


async def test_a_body_arriving_in_pieces_is_read_whole(gateway: Gateway, fake: FakeUpstream, api_key: str) -> None:
    raw = orjson.dumps(chat_body("x " * 100_000))

    async def pieces() -> AsyncIterator[bytes]:
        for start in range(0, len(raw), 16_384):
            yield raw[start:start + 16_384]
            await asyncio.sleep(0.005)

    resp = await gateway.data.post(
        "/v1/chat/completions", data=pieces(),
        headers={**auth(api_key), "Content-Type": "application/json", "Content-Length": str(len(raw))},
    )
    assert resp.status == 200, await resp.text()
    stats = await fake.stats()
    assert stats["last_request"]["body"]["messages"][0]["content"] == "x " * 100_000


async def _last_used(db_pool: Any, api_key_id: Any, after: Any = None, timeout: float = 10.0) -> Any:
    """Poll until the key's last_used_at is set (and later than ``after``); bounded."""
    for _ in range(int(timeout / 0.05)):
        value = await db_pool.fetchval("SELECT last_used_at FROM api_keys WHERE api_key_id = $1", api_key_id)
        if value is not None and (after is None or value > after):
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"last_used_at not updated (still {value})")


async def test_last_used_at_follows_use_though_touches_are_coalesced(
    gateway: Gateway, key_factory: Any, db_pool: Any
) -> None:
    raw, record = await key_factory(rate_limit_requests=100_000)
    for _ in range(20):  # many uses within one flush interval make one Touch
        resp = await gateway.data.post("/v1/chat/completions", json=chat_body(), headers=auth(raw))
        assert resp.status == 200
    first = await _last_used(db_pool, record.api_key_id)
    # Once flushed, the next use is recorded again.
    actor = gateway.state.auth._actor
    for _ in range(200):
        if not actor.touched_since_flush(record.api_key_id):
            break
        await asyncio.sleep(0.05)
    resp = await gateway.data.post("/v1/chat/completions", json=chat_body(), headers=auth(raw))
    assert resp.status == 200
    await _last_used(db_pool, record.api_key_id, after=first)


def test_log_records_from_the_loop_reach_the_writer_in_order_and_stop_flushes_them() -> None:
    import io
    import logging

    from gateway.observability.logs import configure_logging

    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    out = io.StringIO()
    setup = configure_logging("info", "json", stream=out)
    log = logging.getLogger("gateway.test")

    async def on_the_loop() -> None:
        for i in range(5):
            log.info("loop %d", i)
        for _ in range(200):  # batched, yet written within a moment (bounded wait)
            if out.getvalue().count("\n") >= 5:
                break
            await asyncio.sleep(0.01)
        log.info("last on the loop")

    try:
        log.info("before the loop")
        asyncio.run(on_the_loop())
        log.info("after the loop")
    finally:
        setup.stop()  # flushes the batch still pending
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in saved_handlers:
            root.addHandler(handler)
        root.setLevel(saved_level)
    messages = [orjson.loads(line)["msg"] for line in out.getvalue().splitlines()]
    assert messages == ["before the loop", *(f"loop {i}" for i in range(5)), "last on the loop", "after the loop"]


def test_the_heap_built_at_start_up_is_frozen_and_young_collections_are_rarer() -> None:
    # serve calls settle_heap() once both planes listen: what start-up built is never
    # walked by a collection again, and the youngest generation waits for more allocations.
    from gateway.edge.server import GC_YOUNG_THRESHOLD, settle_heap

    before = gc.get_threshold()
    alive_at_start_up = [object()]
    try:
        frozen = settle_heap()
        assert frozen == gc.get_freeze_count() > 0
        assert not any(o is alive_at_start_up for o in gc.get_objects())  # out of every generation scanned
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, before[1], before[2])
        made_later = [object()]
        assert any(o is made_later for o in gc.get_objects())  # later objects are collected as ever
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
