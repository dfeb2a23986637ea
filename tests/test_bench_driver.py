"""The bench's load drivers tell when their warm-up ends (``on_measure``), so a server's CPU
is read over the requests they count, not over the warm-up's too."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web

from bench.driver import Call, closed_loop, open_loop


class _Server:
    """A loopback server that notes, per request, whether the warm-up had ended."""

    def __init__(self) -> None:
        self.measuring = False
        self.before = 0
        self.after = 0
        self.hooks = 0

    def hook(self) -> None:
        self.hooks += 1
        self.measuring = True

    async def handle(self, request: web.Request) -> web.Response:
        await request.read()
        if self.measuring:
            self.after += 1
        else:
            self.before += 1
        await asyncio.sleep(0.005)
        return web.json_response({"ok": True})


@pytest.fixture
async def server(aiohttp_server: Any) -> tuple[_Server, Call]:
    state = _Server()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", state.handle)
    srv = await aiohttp_server(app)
    return state, Call.chat(str(srv.make_url("/v1/chat/completions")), {"model": "m", "messages": []})


@pytest.mark.parametrize("kind", ["closed", "open"])
async def test_the_warm_up_end_is_told_once_between_the_warm_up_and_the_counted_requests(
    server: tuple[_Server, Call], kind: str
) -> None:
    state, call = server
    if kind == "closed":
        result = await closed_loop(lambda _i: call, concurrency=4, duration=0.4, warmup=0.3, on_measure=state.hook)
        in_flight = 4
    else:
        result = await open_loop(lambda _i: call, rate=100, duration=0.4, warmup=0.3, on_measure=state.hook)
        in_flight = 3  # at 100 a second, 5 ms each: the few scheduled around the hook
    assert state.hooks == 1
    assert state.before > 0 and result.ok > 0
    # What the server saw after the hook is what the driver counted, but for the requests
    # around that moment: in flight when it came (started before the warm-up's end, seen by
    # the server after it), or started on the boundary before the loop's timer (1 ms steps,
    # in no set order against a request due at the same time) ran the hook. A hook at the
    # run's start or end would be off by the whole warm-up's or pass's requests.
    assert abs(state.after - result.ok) <= in_flight


async def test_without_a_warm_up_the_hook_comes_first_and_a_run_over_before_it_never_calls_it(
    server: tuple[_Server, Call],
) -> None:
    state, call = server
    await closed_loop(lambda _i: call, concurrency=2, duration=0.2, on_measure=state.hook)
    assert state.hooks == 1 and state.before == 0 and state.after > 0
    late = _Server()
    await closed_loop(lambda _i: call, concurrency=2, duration=0.2, warmup=5.0, max_requests=3, on_measure=late.hook)
    await asyncio.sleep(0)
    assert late.hooks == 0
