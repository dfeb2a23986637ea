"""A streamed answer's record is journaled before its end marker is sent, live or from the
response cache, on every route: a crash between the two then loses the end of an answer
(the client retries), never the ledger row of one it was served.

The order is read on the gateway's own side: ``StreamResponse.write``, the relays' direct
chunk writer (``ChunkedBody.put``) and ``write_eof`` (which sends a stream's end with the
body's last chunk) are wrapped to note when the end marker goes out, and billing's
``record`` (which appends the journal line) to note when the row is in the journal.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from gateway.http.chunked import ChunkedBody
from tests.cache_helpers import cached_config, settle
from tests.conftest import FakeUpstream, Gateway, auth

#: Bytes only an end event holds, per protocol: chat's [DONE], Anthropic's message_stop,
#: the Responses API's response.completed.
END_MARKERS = (b"data: [DONE]", b"event: message_stop", b"event: response.completed")


def _watch_order(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, gw: Gateway) -> list[str]:
    order: list[str] = []
    original_write, original_eof = web.StreamResponse.write, web.StreamResponse.write_eof
    original_put = ChunkedBody.put

    def note(data: bytes | bytearray | memoryview) -> None:
        if any(marker in bytes(data) for marker in END_MARKERS):
            order.append("end sent")
        elif data:
            order.append("chunk sent")

    async def write(self: web.StreamResponse, data: bytes | bytearray | memoryview) -> None:
        note(data)
        await original_write(self, data)

    async def write_eof(self: web.StreamResponse, data: bytes = b"") -> None:
        if not self._eof_sent:
            note(data)
        await original_eof(self, data)

    def put(self: ChunkedBody, data: bytes) -> Awaitable[None] | None:
        note(data)
        return original_put(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", write)
    monkeypatch.setattr(ChunkedBody, "put", put)
    monkeypatch.setattr(web.StreamResponse, "write_eof", write_eof)
    handle = type(gw.state.billing)
    journal = handle.record

    def record(self: Any, call: Any) -> None:
        journal(self, call)  # the line is in the journal's file when this returns
        order.append(f"journaled {call.cache}")

    monkeypatch.setattr(handle, "record", record)
    _watch_billing_line(monkeypatch, caplog, order)
    return order


def _watch_billing_line(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, order: list[str]) -> None:
    """Note when a call's billing line is logged (made of its journaled row)."""
    import actors.billing

    caplog.set_level(logging.INFO, logger="gateway.billing")  # lines are made at INFO only

    log_billing = actors.billing._log_billing

    def logged(row: Any) -> None:
        log_billing(row)
        order.append("billing line")

    monkeypatch.setattr(actors.billing, "_log_billing", logged)


async def _logged(order: list[str], lines: int = 1) -> None:
    """Wait (bounded) for the handler to log ``lines`` billing lines: it does so after the
    answer's end is sent, so maybe after the client has read it."""
    for _ in range(200):
        if order.count("billing line") >= lines:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"no billing line after the answer: {order}")


def _chat(gw: Gateway, key: str) -> Callable[[], Awaitable[Any]]:
    body = {"model": "cached", "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "the order of things"}]}
    return lambda: gw.data.post("/v1/chat/completions", json=body, headers=auth(key))


def _messages(gw: Gateway, key: str) -> Callable[[], Awaitable[Any]]:
    body = {"model": "cached", "temperature": 0, "stream": True, "max_tokens": 50,
            "messages": [{"role": "user", "content": "the order of things"}]}
    return lambda: gw.data.post("/v1/messages", json=body, headers={"x-api-key": key})


def _responses(gw: Gateway, key: str) -> Callable[[], Awaitable[Any]]:
    body = {"model": "cached", "temperature": 0, "stream": True, "input": "the order of things"}
    return lambda: gw.data.post("/v1/responses", json=body, headers=auth(key))


@pytest.mark.parametrize("route", [_chat, _messages, _responses], ids=["chat", "messages", "responses"])
async def test_a_streamed_answer_is_journaled_before_its_end_live_and_from_the_cache(
    gateway_factory: Any, fake: FakeUpstream, api_key: str, monkeypatch: pytest.MonkeyPatch, route: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    gw: Gateway = await gateway_factory(config_yaml=cached_config(fake.url))
    order = _watch_order(monkeypatch, caplog, gw)
    call = route(gw, api_key)

    live = await call()
    assert live.status == 200 and live.headers["x-gateway-cache"] == "miss"
    raw = await live.read()
    assert any(marker in raw for marker in END_MARKERS)
    # The row before the end; the billing line once the end is out.
    await _logged(order)
    assert order[-3:] == ["journaled miss", "end sent", "billing line"], order
    await settle(gw, 1)

    order.clear()
    hit = await call()
    assert hit.status == 200 and hit.headers["x-gateway-cache"] == "hit"
    raw = await hit.read()
    assert any(marker in raw for marker in END_MARKERS)
    # What the answer holds goes first, then its row, then its end, then the row's line.
    await _logged(order)
    assert order[0] == "chunk sent" and order[-3:] == ["journaled hit", "end sent", "billing line"], order
    assert order.count("journaled hit") == 1 and order.count("billing line") == 1


@pytest.mark.parametrize("route", [_chat, _messages, _responses], ids=["chat", "messages", "responses"])
async def test_a_streamed_answer_s_end_goes_out_with_the_body_s_end_in_one_write(
    gateway_factory: Any, fake: FakeUpstream, api_key: str, monkeypatch: pytest.MonkeyPatch, route: Any,
) -> None:
    """The end marker is handed to ``write_eof`` (chunked encoding's last chunk goes with
    it): one socket write per stream, not one for the end and one for the terminator."""
    gw: Gateway = await gateway_factory(config_yaml=cached_config(fake.url))
    writes: list[bytes] = []
    ends: list[bytes] = []
    original_write, original_eof = web.StreamResponse.write, web.StreamResponse.write_eof
    original_put = ChunkedBody.put

    # The fake provider answers in this process too: only the gateway's answers count.
    async def write(self: web.StreamResponse, data: bytes | bytearray | memoryview) -> None:
        if "x-gateway-cache" in self.headers:
            writes.append(bytes(data))
        await original_write(self, data)

    async def write_eof(self: web.StreamResponse, data: bytes = b"") -> None:
        if not self._eof_sent and "x-gateway-cache" in self.headers:
            ends.append(bytes(data))
        await original_eof(self, data)

    def put(self: ChunkedBody, data: bytes) -> Awaitable[None] | None:
        if "x-gateway-cache" in self._response.headers:
            writes.append(bytes(data))
        return original_put(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", write)
    monkeypatch.setattr(ChunkedBody, "put", put)
    monkeypatch.setattr(web.StreamResponse, "write_eof", write_eof)
    for expected in ("miss", "hit"):
        writes.clear()
        ends.clear()
        resp = await route(gw, api_key)()
        assert resp.status == 200 and resp.headers["x-gateway-cache"] == expected
        raw = await resp.read()
        assert len(ends) == 1 and any(marker in ends[0] for marker in END_MARKERS), ends
        assert ends[0] and raw.endswith(ends[0])
        assert not any(marker in w for w in writes for marker in END_MARKERS), writes
        await settle(gw, 1)


def _whole_call(gw: Gateway, key: str, route: str) -> Callable[[], Awaitable[Any]]:
    if route == "chat":
        body: dict[str, Any] = {"model": "cached", "temperature": 0,
                                "messages": [{"role": "user", "content": "a whole answer"}]}
        return lambda: gw.data.post("/v1/chat/completions", json=body, headers=auth(key))
    if route == "messages":
        body = {"model": "cached", "temperature": 0, "max_tokens": 50,
                "messages": [{"role": "user", "content": "a whole answer"}]}
        return lambda: gw.data.post("/v1/messages", json=body, headers={"x-api-key": key})
    body = {"model": "cached", "temperature": 0, "input": "a whole answer"}
    return lambda: gw.data.post("/v1/responses", json=body, headers=auth(key))


@pytest.mark.parametrize("route", ["chat", "messages", "responses"])
async def test_a_whole_answer_goes_out_after_its_row_and_before_the_listeners_hear_of_it(
    gateway_factory: Any, fake: FakeUpstream, api_key: str, monkeypatch: pytest.MonkeyPatch, route: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Nothing but the journal stands between a whole answer and its client: the row is
    journaled, the answer sent, and only then is the row's billing line logged and are the
    call listeners (metrics, the deployments' token counts) told, live and from the cache
    alike."""
    gw: Gateway = await gateway_factory(config_yaml=cached_config(fake.url))
    order: list[str] = []
    handle = type(gw.state.billing)
    journal, original_eof = handle.record, web.StreamResponse.write_eof

    def record(self: Any, call: Any) -> None:
        journal(self, call)
        order.append(f"journaled {call.cache}")

    async def write_eof(self: web.StreamResponse, data: bytes = b"") -> None:
        # The fake provider answers in this process too: only the gateway's answers count.
        if not self._eof_sent and "x-gateway-cache" in self.headers:
            order.append("answer sent")
        await original_eof(self, data)

    monkeypatch.setattr(handle, "record", record)
    monkeypatch.setattr(web.StreamResponse, "write_eof", write_eof)
    _watch_billing_line(monkeypatch, caplog, order)
    gw.state.call_listeners.append(lambda call: order.append(f"told {call.cache}"))
    call = _whole_call(gw, api_key, route)
    for expected in ("miss", "hit"):
        order.clear()
        answer = await call()
        assert answer.status == 200 and answer.headers["x-gateway-cache"] == expected
        await answer.read()
        await _logged(order)  # the listeners are told in the same step, right after the line
        assert order == [f"journaled {expected}", "answer sent", "billing line", f"told {expected}"], order
        await settle(gw, 1)
