"""Misbehaving clients against a real gateway process: hanging up (before the first
chunk, mid-stream, during a retry's wait), reading slowly, sending headers slowly, and
holding thousands of idle keep-alive connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import resource
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import asyncpg
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.conftest import FakeUpstream, auth, chat_body, config_for
from tests.faults.conftest import NO_IP_GUARD
from tests.faults.support import (
    assert_contract_answer,
    assert_ledger_exactly_once,
    chat,
    ledger_rows,
    rss_kib,
)


async def _until(predicate: Any, within: float, every: float = 0.05) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(every)
    return bool(await predicate())


async def _fake_count(fake: FakeUpstream, field: str) -> int:
    return int((await fake.stats())[field])


async def _abandon(session: aiohttp.ClientSession, url: str, key: str, rid: str, body: dict[str, Any]) -> asyncio.Task[Any]:
    """Start a call that the test will abandon (cancel) mid-way."""

    async def call() -> None:
        async with session.post(
            f"{url}/v1/chat/completions", json=body, headers={**auth(key), "x-request-id": rid}
        ) as resp:
            await resp.read()

    return asyncio.ensure_future(call())


async def test_client_gone_before_the_first_chunk_cancels_the_upstream(
    start_gateway: Any, fake: FakeUpstream, api_key: str, db_pool: asyncpg.Pool
) -> None:
    """Fault: a streaming client hangs up while the provider is still thinking (no byte
    relayed yet).

    Visible: the provider's request is cancelled within a second; the gateway serves the
    next call. Ledger: the abandoned call once (outcome cancelled, no tokens billed as
    delivered).
    """
    gw = await start_gateway(fake)
    await fake.script({"delay_ms": 5000})
    async with aiohttp.ClientSession() as session:
        call = await _abandon(session, gw.url, api_key, "f-gone-early", chat_body(stream=True))
        assert await _until(lambda: _received(fake, 1), within=5)
        call.cancel()
        gone = time.monotonic()
        assert await _until(lambda: _fake_count_is(fake, "requests_cancelled", 1), within=3)
        assert time.monotonic() - gone < 2.0  # generous (polling, a busy box): the contract says 1 s
        after = await chat(session, gw.url, api_key, stream=True)
    assert after.status == 200 and after.stream_end == "done"
    await assert_ledger_exactly_once(db_pool, ["f-gone-early", after.request_id])
    row = (await ledger_rows(db_pool, ["f-gone-early"]))["f-gone-early"]
    assert (row["outcome"], row["status"], row["completion_tokens"]) == ("cancelled", 499, 0)


async def _received(fake: FakeUpstream, n: int) -> bool:
    return (await fake.stats())["by_path"].get("/v1/chat/completions", 0) >= n


async def _fake_count_is(fake: FakeUpstream, field: str, n: int) -> bool:
    return await _fake_count(fake, field) >= n


async def test_client_gone_mid_stream_cancels_the_upstream_and_keeps_what_was_delivered(
    start_gateway: Any, fake: FakeUpstream, api_key: str, db_pool: asyncpg.Pool
) -> None:
    """Fault: a streaming client hangs up after two chunks of a long stream.

    Visible: the provider's stream is cancelled within a second (it is never read to
    the end, so nothing more is generated or billed upstream). Ledger: the call once,
    outcome ``cancelled``, with the completion tokens delivered so far.
    """
    gw = await start_gateway(fake)
    await fake.script({"chunk_delay_ms": 200, "chunks": 40})
    rid = "f-gone-mid-stream"
    async with aiohttp.ClientSession() as session:
        resp = await session.post(
            f"{gw.url}/v1/chat/completions", json=chat_body("w " * 60, stream=True),
            headers={**auth(api_key), "x-request-id": rid},
        )
        assert resp.status == 200
        await resp.content.readuntil(b"\n\n")
        await resp.content.readuntil(b"\n\n")
        resp.close()
        assert await _until(lambda: _fake_count_is(fake, "streams_cancelled", 1), within=3)
    assert (await fake.stats())["streams_completed"] == 0
    await assert_ledger_exactly_once(db_pool, [rid])
    row = await db_pool.fetchrow("SELECT outcome, completion_tokens FROM usage_ledger WHERE request_id = $1", rid)
    assert row["outcome"] == "cancelled" and row["completion_tokens"] > 0


async def test_client_gone_during_a_retry_wait_sends_no_retry(
    start_gateway: Any, fake: FakeUpstream, api_key: str, db_pool: asyncpg.Pool
) -> None:
    """Fault: the provider answers 503 with ``Retry-After: 2``; while the gateway waits
    to retry, the client hangs up.

    Visible: the retry is never sent (the provider sees exactly one request, even after
    the wait would have ended); the next call is served. Ledger: the abandoned call once.
    """
    gw = await start_gateway(fake)
    await fake.script({"status": 503, "retry_after": 2})
    async with aiohttp.ClientSession() as session:
        call = await _abandon(session, gw.url, api_key, "f-gone-in-retry", chat_body())
        assert await _until(lambda: _received(fake, 1), within=5)
        await asyncio.sleep(0.2)  # the gateway is now sleeping before its retry
        call.cancel()
        await asyncio.sleep(2.5)  # past the Retry-After: a retry would have been sent by now
        assert (await fake.stats())["by_path"]["/v1/chat/completions"] == 1
        after = await chat(session, gw.url, api_key)
    assert_contract_answer(after, allowed={200})
    await assert_ledger_exactly_once(db_pool, ["f-gone-in-retry", after.request_id])


# ----------------------------------------------------------------------------- slow reader
class _Firehose:
    """An OpenAI-wire upstream that streams 64 KiB chunks as fast as TCP lets it.

    The fake provider precomputes its streams (fine for their usual size); this case
    needs a provider that would go on for gigabytes, so that only backpressure, not
    the stream's end, can keep the gateway's memory flat. It counts what it managed to
    send.
    """

    CHUNK = b"data: " + orjson.dumps({
        "id": "chatcmpl-firehose", "object": "chat.completion.chunk", "created": 0, "model": "firehose",
        "choices": [{"index": 0, "delta": {"content": "x" * 65536}, "finish_reason": None}],
    }) + b"\n\n"

    def __init__(self) -> None:
        self.sent = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        with contextlib.suppress(ConnectionError):
            for _ in range(100_000):  # bounded: 6.5 GB, far more than any test reads
                await response.write(self.CHUNK)
                self.sent += len(self.CHUNK)
        return response


@contextlib.asynccontextmanager
async def _firehose() -> AsyncIterator[tuple[_Firehose, str]]:
    hose = _Firehose()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", hose.handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield hose, f"http://127.0.0.1:{server.port}/v1"
    finally:
        await server.close()


async def test_a_slow_reader_does_not_make_the_gateway_buffer_the_stream(
    process_factory: Any, api_key: str
) -> None:
    """Fault: a client reads a fast, endless stream at about a kilobyte a second (a tiny
    receive window, 64 bytes every 50 ms), for five seconds.

    Visible: the gateway relays at the client's pace: its resident memory stays within a
    generous 48 MiB of where it started (a gateway that buffered would hold everything
    the provider can push over loopback in that time, gigabytes), and backpressure
    reaches the provider (it manages to send only what the buffers between hold). No
    ledger check: the stream never ends while the test looks.
    """
    async with _firehose() as (hose, url):
        gw = await process_factory(config_yaml=config_for(url, rate_limits=NO_IP_GUARD))
        async with aiohttp.ClientSession() as session, session.post(  # warm up the relay's paths
            f"{gw.url}/v1/chat/completions", json=chat_body(stream=True), headers=auth(api_key)
        ) as resp:
            await resp.content.readexactly(256 * 1024)
        await asyncio.sleep(0.5)
        baseline = rss_kib(gw.proc.pid)
        hose.sent = 0

        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", gw.port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=1024)
        body = orjson.dumps(chat_body(stream=True))
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {api_key}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
        )
        await writer.drain()
        peak, consumed = baseline, 0
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            consumed += len(await reader.read(64))
            peak = max(peak, rss_kib(gw.proc.pid))
            await asyncio.sleep(0.05)
        writer.transport.abort()
    grown_mib = (peak - baseline) / 1024
    assert consumed > 0
    assert grown_mib < 48, f"gateway RSS grew {grown_mib:.1f} MiB while a client read {consumed} bytes"
    # Loopback socket buffers on both hops hold some MB; a gateway reading ahead would
    # have let the provider push far more.
    assert hose.sent < 96 * 1024 * 1024, f"provider pushed {hose.sent} bytes to a client that read {consumed}"
    print(f"slow reader: RSS {baseline} KiB -> peak {peak} KiB; provider sent {hose.sent} B; client read {consumed} B")


# ----------------------------------------------------------------------------- slowloris
async def test_slowloris_headers_are_cut_off_and_never_tie_up_the_server(
    start_gateway: Any, fake: FakeUpstream, api_key: str
) -> None:
    """Fault: 50 clients each send a request head one byte at a time, never finishing.

    Visible: meanwhile every other client is served normally; and each slow connection
    is closed by the gateway once it has gone ``CLIENT_IDLE_TIMEOUT_SECONDS`` (here 2 s)
    without a complete request head, so such clients cannot pile up forever. No ledger
    check: no call is made by them.
    """
    gw = await start_gateway(fake, env={"CLIENT_IDLE_TIMEOUT_SECONDS": "2"})
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {api_key}\r\n" + "X-Pad: " + "a" * 200

    async def slowloris() -> float:
        """Dribble the head a byte per 0.1 s; seconds until the gateway hung up."""
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        started = time.monotonic()
        try:
            for ch in head:
                writer.write(ch.encode())
                await writer.drain()
                try:
                    if await asyncio.wait_for(reader.read(1), timeout=0.1) == b"":
                        return time.monotonic() - started  # closed by the gateway
                except TimeoutError:
                    pass
            return float("inf")  # never closed while we dribbled
        except ConnectionError:
            return time.monotonic() - started
        finally:
            writer.transport.abort()

    dribblers = [asyncio.ensure_future(slowloris()) for _ in range(50)]
    async with aiohttp.ClientSession() as session:
        await asyncio.sleep(0.5)
        served = [await chat(session, gw.url, api_key, stream=i % 2 == 1) for i in range(10)]
    closed_after = await asyncio.gather(*dribblers)
    for answer in served:
        assert_contract_answer(answer, allowed={200})
    assert all(t < 6 for t in closed_after), sorted(closed_after)[-5:]


# ----------------------------------------------------------------------------- idle keep-alive
IDLE_CONNECTIONS = 2000


async def test_thousands_of_idle_keep_alive_connections_do_not_starve_traffic(
    start_gateway: Any, fake: FakeUpstream, api_key: str
) -> None:
    """Fault: 2,000 clients each make one request and then keep their connection open,
    idle.

    Visible: new clients are served as usual (calls, streams, health) while they idle,
    and the idle connections are still usable afterwards (kept alive, not dropped). The
    gateway raises its own open-file limit to the hard limit at start for this. No
    ledger check beyond the normal calls (which other cases cover).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = IDLE_CONNECTIONS + 500
    if hard < need:
        pytest.skip(f"open-file hard limit {hard} < {need}: cannot hold {IDLE_CONNECTIONS} connections")
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    gw = await start_gateway(fake)
    request = b"GET /healthz HTTP/1.1\r\nHost: gw\r\n\r\n"

    async def idle_client() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(request)
        await reader.readuntil(b'{"status":"ok"}')
        return reader, writer

    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        for _ in range(IDLE_CONNECTIONS // 200):  # in batches: the listen backlog is finite
            idle += await asyncio.gather(*(idle_client() for _ in range(200)))
        rss = rss_kib(gw.proc.pid)
        async with aiohttp.ClientSession() as session:
            served = await asyncio.gather(*(chat(session, gw.url, api_key, stream=i % 2 == 1) for i in range(20)))
        for answer in served:
            assert_contract_answer(answer, allowed={200})
        for reader, writer in idle[:: IDLE_CONNECTIONS // 20]:  # still alive and usable
            writer.write(request)
            await asyncio.wait_for(reader.readuntil(b'{"status":"ok"}'), timeout=5)
        print(f"{len(idle)} idle keep-alive connections: gateway RSS {rss} KiB")
    finally:
        for _, writer in idle:
            writer.transport.abort()


# ----------------------------------------------------------------------------- slow bodies
async def _send_in_pieces(port: int, head: bytes, pieces: list[bytes], pause: float) -> tuple[int, bytes, float]:
    """Send ``head`` then each piece ``pause`` apart; the status, body and seconds taken."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = time.monotonic()
    try:
        writer.write(head)
        for piece in pieces:
            await asyncio.sleep(pause)
            writer.write(piece)
            await writer.drain()
        head_part = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=30)
        took = time.monotonic() - started  # to the answer (the socket may linger after)
        length = re.search(rb"(?i)content-length: *(\d+)", head_part)
        body = await reader.readexactly(int(length.group(1))) if length else b""
    finally:
        writer.transport.abort()
    return int(head_part.split(b" ")[1]), body, took


def _chat_head(key: str, length: int) -> bytes:
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nConnection: close\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {key}\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


async def test_a_body_sent_in_pieces_is_read_whole_and_one_that_never_ends_is_a_408(
    start_gateway: Any, fake: FakeUpstream, api_key: str
) -> None:
    """Fault: a client sends its body slowly, in three pieces 0.3 s apart; another sends a
    tenth of what its Content-Length promised and then nothing.

    Visible: the slow but complete body is read whole and answered 200 (not taken for
    truncated JSON); the unfinished one gets a 408 ``request_timeout`` in the contract's
    shape once ``CLIENT_IDLE_TIMEOUT_SECONDS`` (here 1.5 s) have passed, so it cannot
    hold a request slot for ever; the gateway serves others meanwhile. No ledger row for
    the 408 (refused before any work).
    """
    gw = await start_gateway(fake, env={"CLIENT_IDLE_TIMEOUT_SECONDS": "1.5"})
    body = orjson.dumps(chat_body("a body that arrives in three pieces"))
    third = len(body) // 3
    status, raw, _ = await _send_in_pieces(
        gw.port, _chat_head(api_key, len(body)), [body[:third], body[third: 2 * third], body[2 * third:]], 0.3
    )
    assert status == 200, raw[:300]

    stuck = asyncio.ensure_future(_send_in_pieces(gw.port, _chat_head(api_key, 1000), [b'{"model": "x",'], 0.05))
    async with aiohttp.ClientSession() as session:
        meanwhile = await chat(session, gw.url, api_key)
    status, raw, took = await stuck
    assert_contract_answer(meanwhile, allowed={200})
    assert status == 408, raw[:300]
    assert orjson.loads(raw)["error"]["code"] == "request_timeout"
    assert took < 6, took
