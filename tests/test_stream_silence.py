"""``stream_chunks``: a streamed body read chunk by chunk, its silence bounded by one
lazily re-armed timer instead of aiohttp's per-read ``sock_read`` timer.

The server here sends chunks on a script (gaps in seconds, then an optional hang), over
real HTTP on loopback, so the bound is checked against aiohttp's real reader.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.providers.base import UpstreamTimeoutError, map_transport_errors, stream_chunks

IDLE = 0.4


async def _scripted_server(aiohttp_server: Any) -> Any:
    """``GET /?gaps=0.1,0.1&hang=1``: a chunk, then one more after each gap; hang: go silent."""

    async def stream(request: web.Request) -> web.StreamResponse:
        gaps = [float(g) for g in request.query.get("gaps", "").split(",") if g]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: 0\n\n")
        for n, gap in enumerate(gaps, 1):
            await asyncio.sleep(gap)
            await response.write(f"data: {n}\n\n".encode())
        if request.query.get("hang"):
            await asyncio.sleep(30)  # silent, the connection open
        return response

    app = web.Application()
    app.router.add_get("/", stream)
    return await aiohttp_server(app)


def _timeout() -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=None, sock_read=IDLE)


async def test_chunks_closer_than_the_bound_flow_for_longer_than_the_bound(aiohttp_server: Any) -> None:
    # 8 gaps of 0.15 s: 1.2 s in all, three bounds, every silence under one.
    server = await _scripted_server(aiohttp_server)
    async with aiohttp.ClientSession() as session:
        resp = await session.get(server.make_url("/?gaps=" + ",".join(["0.15"] * 8)), timeout=_timeout())
        received = b"".join([chunk async for chunk in stream_chunks(resp)])
        resp.release()
    assert received == b"".join(f"data: {n}\n\n".encode() for n in range(9))


async def test_a_silence_past_the_bound_fails_the_read_as_a_timeout_and_drops_the_connection(
    aiohttp_server: Any,
) -> None:
    # Three chunks 0.2 s apart (past one bound in all), then silence: the read fails one
    # bound after the last chunk, not one bound after the start.
    server = await _scripted_server(aiohttp_server)
    async with aiohttp.ClientSession() as session:
        resp = await session.get(server.make_url("/?gaps=0.2,0.2&hang=1"), timeout=_timeout())
        chunks: list[bytes] = []
        last_chunk_at = time.monotonic()
        with pytest.raises(UpstreamTimeoutError), map_transport_errors():
            async for chunk in stream_chunks(resp):
                chunks.append(chunk)
                last_chunk_at = time.monotonic()
        silent_for = time.monotonic() - last_chunk_at
        assert b"".join(chunks) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        assert IDLE * 0.9 <= silent_for < IDLE + 1.0
        assert resp.closed and resp.connection is None  # a half-read body is never reused
        # The session goes on: the next request gets a connection of its own.
        again = await session.get(server.make_url("/?gaps=0.05"), timeout=_timeout())
        assert b"".join([c async for c in stream_chunks(again)]) == b"data: 0\n\ndata: 1\n\n"
        again.release()


async def test_a_slow_reader_is_not_a_silent_upstream(aiohttp_server: Any) -> None:
    # The relay's client takes its time: the next read comes two bounds after the last,
    # while the upstream kept sending. What waits unread is not a silence: no timeout.
    server = await _scripted_server(aiohttp_server)
    async with aiohttp.ClientSession() as session:
        resp = await session.get(server.make_url("/?gaps=" + ",".join(["0.1"] * 10)), timeout=_timeout())
        chunks = stream_chunks(resp)
        received = [await chunks.__anext__()]
        await asyncio.sleep(IDLE * 2)
        received += [chunk async for chunk in chunks]
        resp.release()
    assert b"".join(received) == b"".join(f"data: {n}\n\n".encode() for n in range(11))


async def test_a_stream_released_mid_way_is_not_failed_later(aiohttp_server: Any) -> None:
    # A relay whose client left releases the upstream and stops reading: the timer, when it
    # fires, finds the response closed and leaves it be.
    server = await _scripted_server(aiohttp_server)
    async with aiohttp.ClientSession() as session:
        resp = await session.get(server.make_url("/?hang=1"), timeout=_timeout())
        chunks = stream_chunks(resp)
        assert await chunks.__anext__() == b"data: 0\n\n"
        resp.release()
        released_with = resp.content.exception()  # aiohttp's own "Connection closed", if any
        await asyncio.sleep(IDLE * 2)
        assert resp.content.exception() is released_with
        assert not isinstance(released_with, aiohttp.ServerTimeoutError)


async def test_without_a_read_bound_the_body_is_aiohttps_own_iterator(aiohttp_server: Any) -> None:
    server = await _scripted_server(aiohttp_server)
    async with aiohttp.ClientSession() as session:
        resp = await session.get(server.make_url("/?gaps=0.05"), timeout=aiohttp.ClientTimeout(total=5))
        chunks = stream_chunks(resp)
        assert isinstance(chunks, aiohttp.streams.AsyncStreamIterator)
        assert b"".join([c async for c in chunks]) == b"data: 0\n\ndata: 1\n\n"
        resp.release()
