"""The relays' body writer (``gateway.http.chunked``): one plain call per event writes what
``StreamResponse.write`` would, on the wire and in aiohttp's counts, and everything it does
not cover goes through aiohttp itself."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.http.chunked import DRAIN_AFTER, Body, ChunkedBody, body_of

PIECES = [b"data: one\n\n", b"", b"data: " + "two ünïcode".encode() + b"\n\n", b"x" * 5000]


async def _raw_exchange(port: int, request: bytes) -> bytes:
    """The server's whole answer to ``request``, bytes as sent (the framing included)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(-1), 10)
    writer.close()
    return raw


def _app(seen: dict[str, Any], *, direct: bool, compress: bool = False, length: int | None = None) -> web.Application:
    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        if compress:
            response.enable_compression()
        if length is not None:
            response.content_length = length
        writer = await response.prepare(request)
        body = body_of(response, writer) if direct else Body(response)
        seen["kind"] = type(body)
        for piece in PIECES:
            waiting = body.put(piece)
            if waiting is not None:
                await waiting
        await response.write_eof(b"data: [DONE]\n\n")
        seen["body_length"] = response.body_length
        return response

    app = web.Application()
    app.router.add_get("/", handler)
    return app


async def _serve(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, port


async def test_the_direct_writer_sends_and_counts_exactly_what_aiohttps_write_does() -> None:
    answers: dict[bool, bytes] = {}
    lengths: dict[bool, int] = {}
    sent: dict[bool, int] = {}
    for direct in (True, False):
        seen: dict[str, Any] = {}
        runner, port = await _serve(_app(seen, direct=direct))
        try:
            raw = await _raw_exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        finally:
            await runner.cleanup()
        assert seen["kind"] is (ChunkedBody if direct else Body)
        head, _, answers[direct] = raw.partition(b"\r\n\r\n")
        sent[direct] = len(raw)
        assert b"Transfer-Encoding: chunked" in head
        lengths[direct] = seen["body_length"]
    assert answers[True] == answers[False]  # frame for frame, the empty piece skipped as aiohttp skips it
    assert answers[True].endswith(b"\r\n0\r\n\r\n") and b"data: [DONE]" in answers[True]
    assert lengths[True] == lengths[False] == sent[True]  # aiohttp's count: the headers and every frame


async def test_a_client_reads_every_event_through_the_direct_writer() -> None:
    seen: dict[str, Any] = {}
    runner, port = await _serve(_app(seen, direct=True))
    try:
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/") as resp:
            body = await resp.read()
    finally:
        await runner.cleanup()
    assert body == b"".join(PIECES) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("case", ["compressed", "with a length", "HTTP/1.0"])
async def test_what_the_direct_writer_does_not_cover_goes_through_aiohttp(case: str) -> None:
    seen: dict[str, Any] = {}
    total = len(b"".join(PIECES)) + len(b"data: [DONE]\n\n")
    app = _app(seen, direct=True, compress=case == "compressed", length=total if case == "with a length" else None)
    runner, port = await _serve(app)
    try:
        if case == "HTTP/1.0":
            raw = await _raw_exchange(port, b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
            assert raw.partition(b"\r\n\r\n")[2] == b"".join(PIECES) + b"data: [DONE]\n\n"  # unchunked
        else:
            headers = {"Accept-Encoding": "gzip"} if case == "compressed" else {}
            async with aiohttp.ClientSession() as session, \
                    session.get(f"http://127.0.0.1:{port}/", headers=headers) as resp:
                assert await resp.read() == b"".join(PIECES) + b"data: [DONE]\n\n"
                if case == "compressed":
                    assert resp.headers["Content-Encoding"] == "gzip"
    finally:
        await runner.cleanup()
    assert seen["kind"] is Body


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.sent: list[bytes] = []
        self.closing = False

    def write(self, data: Any) -> None:
        self.sent.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closing


class _Protocol:
    def __init__(self) -> None:
        self.transport: _Transport | None = _Transport()


class _Writer:
    """What ``ChunkedBody`` reads of aiohttp's ``StreamWriter``, with a drain that is noted."""

    def __init__(self) -> None:
        self.protocol = _Protocol()
        self.buffer_size = 0
        self.output_size = 0
        self.drained = 0

    async def drain(self) -> None:
        self.drained += 1


async def test_the_direct_writer_asks_for_a_drain_past_aiohttps_bound_and_refuses_a_closing_transport() -> None:
    writer = _Writer()
    transport = writer.protocol.transport
    assert transport is not None
    body = ChunkedBody(web.StreamResponse(), writer)  # type: ignore[arg-type]
    piece = b"y" * 1000
    waits = 0
    for _ in range(200):  # 200 KB: past the bound three times
        waiting = body.put(piece)
        if waiting is not None:
            waits += 1
            await waiting
    frame = len(b"3e8\r\n") + 1000 + len(b"\r\n")
    assert waits == writer.drained == 200 // (DRAIN_AFTER // frame + 1) == 3
    assert writer.buffer_size <= DRAIN_AFTER
    assert writer.output_size == 200 * frame and sum(map(len, transport.sent)) == writer.output_size
    assert transport.sent[0] == b"3e8\r\n" + piece + b"\r\n"
    transport.closing = True
    with pytest.raises(ConnectionError):
        body.put(piece)
    writer.protocol.transport = None  # the connection lost
    with pytest.raises(ConnectionError):
        body.put(piece)
