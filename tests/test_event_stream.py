"""``EventSplitter`` and ``EventStream``: one class-based iterator per provider stream in
place of the generator layers (silence bound, SSE split, error mapping, breaker watch).

The splitter is checked against the reader it replaced (kept here as the reference),
over random splits of random streams; the stream against ``iter_events`` over the same
reads, and for what the layers did: transport errors as ProviderError, the overflow after
the events before it, and the breaker told of a cut or broken stream only.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.protocols.sse import MAX_EVENT_BYTES, EventSplitter, EventTooLarge, iter_events
from gateway.providers.base import (
    TRANSPORT_FAILURES,
    EventStream,
    ProviderError,
    UpstreamConnectError,
    UpstreamProtocolError,
    UpstreamTimeoutError,
    map_transport_errors,
    stream_chunks,
    transport_error,
    watched,
)
from tests.conftest import split_at


async def _reference_iter_events(
    chunks: AsyncIterable[bytes], *, max_event_bytes: int = MAX_EVENT_BYTES
) -> AsyncIterator[bytes]:
    """``iter_events`` as it was before the splitter (b49b873), verbatim but for its name."""
    buf = bytearray()
    scan_from = 0
    held_cr = False
    async for chunk in chunks:
        if not chunk:
            continue
        size = len(chunk)
        if (not buf and not held_cr and chunk.endswith(b"\n\n")
                and (chunk.find(b"\n") == size - 2 or chunk.rfind(b"\n\n", 0, size - 1) < 0)
                and chunk.find(b"\r") < 0):
            if chunk[0] > 0x20 or chunk.strip():
                yield chunk
            continue
        if held_cr:
            chunk = b"\r" + chunk
        held_cr = chunk.endswith(b"\r")
        if held_cr:
            chunk = chunk[:-1]
        if b"\r" in chunk:
            chunk = chunk.replace(b"\r\n", b"\n")
        buf += chunk
        start = 0
        while True:
            end = buf.find(b"\n\n", max(scan_from, start))
            if end < 0:
                break
            event = bytes(buf[start : end + 2])
            start = end + 2
            if event.strip():
                yield event
        if start:
            del buf[:start]
        scan_from = max(0, len(buf) - 1)
        if len(buf) > max_event_bytes:
            raise EventTooLarge(f"SSE event over {max_event_bytes} bytes")
    if held_cr:
        buf += b"\r"
    tail = bytes(buf).strip(b"\n")
    if tail.strip():
        yield tail + b"\n\n"


async def _aiter(parts: list[bytes]) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


async def _drain(events: AsyncIterator[bytes]) -> tuple[list[bytes], BaseException | None]:
    out: list[bytes] = []
    try:
        async for event in events:
            out.append(event)
    except Exception as exc:
        return out, exc
    return out, None


def _splitter_events(parts: list[bytes], max_event_bytes: int = MAX_EVENT_BYTES) -> tuple[list[bytes], type | None]:
    splitter = EventSplitter(max_event_bytes)
    out: list[bytes] = []
    for part in parts:
        try:
            out += splitter.feed(part)
        except EventTooLarge as exc:
            return out + exc.events, EventTooLarge
    tail = splitter.end()
    return out + ([tail] if tail is not None else []), None


# Streams made of the bytes that matter to the split: lines, blank lines, CR, CRLF, spaces.
_atoms = st.sampled_from([b"data: x", b"data: {\"a\":1}", b"\n", b"\r\n", b"\r", b"\n\n", b" ", b":c", b"id: 7",
                          b"event: e", b"data: [DONE]", b"\t"])
_streams = st.lists(_atoms, max_size=40).map(b"".join)


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=400, deadline=None)
@given(_streams, st.lists(st.integers(min_value=0), max_size=12), st.sampled_from([MAX_EVENT_BYTES, 8, 20]))
def test_the_splitter_gives_what_the_old_reader_gave_whatever_thesplit_at(
    stream: bytes, cuts: list[int], limit: int
) -> None:
    parts = split_at(stream, cuts)

    async def run() -> None:
        expected, error = await _drain(_reference_iter_events(_aiter(parts), max_event_bytes=limit))
        assert _splitter_events(parts, limit) == (expected, type(error) if error is not None else None)
        got, got_error = await _drain(iter_events(_aiter(parts), max_event_bytes=limit))
        assert got == expected and type(got_error) is type(error)

    asyncio.run(run())


def test_a_chunk_that_is_one_event_is_given_as_it_came() -> None:
    chunk = b'data: {"a":1}\n\n'
    assert EventSplitter().feed(chunk)[0] is chunk
    assert EventSplitter().feed(b"data: a\ndata: b\n\n")[0] == b"data: a\ndata: b\n\n"


def test_a_read_of_several_whole_events_is_split_as_the_loop_splits_it() -> None:
    """The split of a read made only of whole events (a stream's usage chunk and [DONE] in
    one read) is the general path's, blank lines and a third newline included."""
    for chunk in (b'data: {"usage":1}\n\ndata: [DONE]\n\n', b"data: a\n\n\ndata: b\n\n",
                  b"data: a\n\n\n\ndata: b\n\n", b"data: a\n\n\n", b": c\n\n\n\n",
                  b"data: a\n\n \n\ndata: b\n\n"):
        assert _splitter_events([chunk]) == (_reference_split(chunk), None), chunk


def _reference_split(chunk: bytes) -> list[bytes]:
    async def run() -> list[bytes]:
        return (await _drain(_reference_iter_events(_aiter([chunk]))))[0]

    return asyncio.run(run())


def test_an_overflowing_chunk_gives_its_complete_events_on_the_error() -> None:
    splitter = EventSplitter(max_event_bytes=10)
    with pytest.raises(EventTooLarge) as caught:
        splitter.feed(b"data: 1\n\ndata: 2\n\ndata: 3456789012")
    assert caught.value.events == [b"data: 1\n\n", b"data: 2\n\n"]


# -- EventStream, over a fake aiohttp response -------------------------------------------


class _Content:
    def __init__(self, reads: list[bytes | BaseException]) -> None:
        self._reads = list(reads)
        self.total_bytes = 0
        self.calls = 0

    async def readany(self) -> bytes:
        self.calls += 1
        await asyncio.sleep(0)  # a read suspends, as aiohttp's does when nothing is buffered
        if not self._reads:
            return b""
        read = self._reads.pop(0)
        if isinstance(read, BaseException):
            raise read
        self.total_bytes += len(read)
        return read

    def set_exception(self, exc: BaseException) -> None:
        raise AssertionError(exc)


class _Protocol:
    read_timeout: float | None = None


class _Connection:
    protocol = _Protocol()


class _Response:
    closed = False
    connection = _Connection()

    def __init__(self, reads: list[bytes | BaseException]) -> None:
        self.content = _Content(reads)

    def close(self) -> None:
        self.closed = True


def _stream(reads: list[bytes | BaseException], translate: Callable[[bytes], list[bytes]] | None = None
            ) -> EventStream:
    return EventStream(_Response(reads), translate)  # type: ignore[arg-type]


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=150, deadline=None)
@given(_streams, st.lists(st.integers(min_value=0), max_size=12))
def test_the_stream_gives_what_the_generator_layers_gave(stream: bytes, cuts: list[int]) -> None:
    parts = [part for part in split_at(stream, cuts) if part]  # aiohttp reads b"" only at the end

    async def run() -> None:
        expected, _ = await _drain(_reference_iter_events(_aiter(parts)))
        assert await _drain(_stream(list(parts))) == (expected, None)
        doubled = [o for e in expected for o in (e, e.upper())]
        assert await _drain(_stream(list(parts), lambda e: [e, e.upper()])) == (doubled, None)

    asyncio.run(run())


# Reads as a stream's mostly are (one whole event on one line, given without the
# splitter), between reads that leave the splitter holding something: part of an event, a
# CR, a CRLF event, a blank one.
_reads = st.lists(st.sampled_from([b'data: {"a":1}\n\n', b"data: x\n\n", b"data: [DONE]\n\n", b":c\n\n",
                                   b" data: x\n\n", b"\t\n\n", b"data: x\r\n\r\n", b"data: x\r\n\n",
                                   b"data: x\r", b"\n\n", b"data: a\rb\n\n", b"data: y", b"\n", b"\r\n",
                                   b"data: a\ndata: b\n\n", b"data: x\n\ndata: y\n\n"]), min_size=1, max_size=12)


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=300, deadline=None)
@given(_reads)
def test_a_read_of_one_whole_event_is_that_event_whatever_came_before(reads: list[bytes]) -> None:
    async def run() -> None:
        expected, _ = await _drain(_reference_iter_events(_aiter(reads)))
        assert await _drain(_stream(list(reads))) == (expected, None)

    asyncio.run(run())


async def test_a_read_of_one_whole_event_is_given_as_it_came() -> None:
    reads = [b'data: {"a":1}\n\n', b"data: x", b'data: {"b":2}\n\n', b'data: {"c":3}\n\n']
    stream = _stream(list(reads))
    got = [event async for event in stream]
    assert got == [reads[0], b'data: xdata: {"b":2}\n\n', reads[3]]
    assert got[0] is reads[0] and got[2] is reads[3]  # as they came (the splitter held nothing), not copied


@pytest.mark.parametrize(("failure", "mapped"), [
    (aiohttp.ClientPayloadError("cut"), UpstreamProtocolError),
    (aiohttp.SocketTimeoutError("silent"), UpstreamTimeoutError),
    (TimeoutError(), UpstreamTimeoutError),
    (ConnectionResetError(), UpstreamProtocolError),
    (aiohttp.ServerDisconnectedError(), UpstreamProtocolError),
])
async def test_transport_errors_become_what_map_transport_errors_makes_them(
    failure: BaseException, mapped: type[ProviderError]
) -> None:
    with pytest.raises(ProviderError) as expected, map_transport_errors():
        raise failure
    events, error = await _drain(_stream([b"data: 1\n\n", failure]))
    assert events == [b"data: 1\n\n"]
    assert type(error) is mapped is type(expected.value) and str(error) == str(expected.value)
    assert error.__cause__ is failure


@pytest.mark.parametrize("failure", [
    aiohttp.ClientConnectorError(aiohttp.client_reqrep.ConnectionKey("h", 80, False, True, None, None, None), OSError()),
    aiohttp.ClientPayloadError("cut"),
    aiohttp.SocketTimeoutError("silent"),
    aiohttp.ServerDisconnectedError(),
    aiohttp.ClientResponseError(None, (), status=500),  # type: ignore[arg-type]
    TimeoutError(),
    ConnectionResetError(),
    BrokenPipeError(),
    EventTooLarge("big"),
    UpstreamProtocolError("already ours"),
    KeyError("x"),
    ValueError("odd"),
])
async def test_the_transport_failures_caught_by_try_are_what_map_transport_errors_maps(failure: BaseException) -> None:
    """``except TRANSPORT_FAILURES: raise transport_error(exc)`` (the hot path's form) and
    ``with map_transport_errors():`` raise the same for every failure, and let the same pass."""
    with pytest.raises(BaseException) as by_with, map_transport_errors():
        raise failure
    try:
        try:
            raise failure
        except TRANSPORT_FAILURES as exc:
            raise transport_error(exc) from exc
    except BaseException as exc:
        by_try = exc
    assert type(by_try) is type(by_with.value) and str(by_try) == str(by_with.value)
    assert by_try.__cause__ is by_with.value.__cause__
    assert (by_try is failure) is (by_with.value is failure)


async def test_other_errors_and_cancellation_pass_as_they_are() -> None:
    odd = KeyError("x")
    assert (await _drain(_stream([odd])))[1] is odd
    stream = _stream([asyncio.CancelledError()])
    with pytest.raises(asyncio.CancelledError):
        await anext(stream)
    with pytest.raises(StopAsyncIteration):  # over, as a generator is after its error
        await anext(stream)


async def test_an_overflow_comes_after_the_events_before_it() -> None:
    big = b"data: " + b"x" * (MAX_EVENT_BYTES + 1)
    events, error = await _drain(_stream([b"data: 1\n\ndata: 2\n\n" + big]))
    assert events == [b"data: 1\n\n", b"data: 2\n\n"]
    assert isinstance(error, UpstreamProtocolError) and isinstance(error.__cause__, EventTooLarge)
    assert str(error) == f"upstream stream broken: SSE event over {MAX_EVENT_BYTES} bytes"


async def test_without_a_bound_the_stream_reads_on_and_with_one_it_takes_it_over() -> None:
    resp = _Response([b"data: 1\n\n"])
    resp.connection = _Connection()
    resp.connection.protocol = _Protocol()
    resp.connection.protocol.read_timeout = 30.0
    stream = EventStream(resp)  # type: ignore[arg-type]
    assert resp.connection.protocol.read_timeout is None  # aiohttp's per-read timer is ours now
    assert stream._timer is not None
    assert await _drain(stream) == ([b"data: 1\n\n"], None)
    assert stream._timer is None  # disarmed at the end


# -- the breaker's watch --------------------------------------------------------------------


def _is_done(event: bytes) -> bool:
    return event == b"data: [DONE]\n\n"


async def _watched_run(
    events: AsyncIterator[bytes], *, stop_after: int | None = None
) -> tuple[list[bytes], BaseException | None, int]:
    failures: list[int] = []
    first = await anext(events)
    reply_events = watched(events)
    reply_events.watch(first, _is_done, b"[DONE]", lambda: failures.append(1))
    out: list[bytes] = []
    error: BaseException | None = None
    try:
        async for event in reply_events:
            out.append(event)
            if stop_after is not None and len(out) == stop_after:
                break  # the relay stops reading: its client left
        else:
            with pytest.raises(StopAsyncIteration):  # over for good, and told only once
                await anext(reply_events)
    except Exception as exc:
        error = exc
    return out, error, len(failures)


async def _generator(reads: list[bytes | BaseException]) -> AsyncIterator[bytes]:
    for read in reads:
        if isinstance(read, BaseException):
            raise read
        yield read


@pytest.mark.parametrize("kind", ["stream", "wrapped generator"])
async def test_the_breaker_hears_of_a_cut_or_broken_stream_only(kind: str) -> None:
    def events(reads: list[bytes | BaseException]) -> AsyncIterator[bytes]:
        return _stream(reads) if kind == "stream" else _generator(reads)

    a, b, done = b"data: a\n\n", b"data: b\n\n", b"data: [DONE]\n\n"
    assert await _watched_run(events([a, b, done])) == ([a, b, done], None, 0)
    assert await _watched_run(events([done])) == ([done], None, 0)  # the end came first
    assert await _watched_run(events([a, b])) == ([a, b], None, 1)  # ended without [DONE]
    out, error, failures = await _watched_run(events([a, b, UpstreamConnectError("x")]))
    assert (out, type(error), failures) == ([a, b], UpstreamConnectError, 1)
    out, error, failures = await _watched_run(events([a, done, UpstreamConnectError("x")]))
    assert (out, failures) == ([a, done], 1)  # broken after its end is still broken
    assert await _watched_run(events([a, b, b, done]), stop_after=2) == ([a, b], None, 0)  # client left
    odd = KeyError("x")  # not the provider's failure (e.g. a translator's StreamBroken)
    assert await _watched_run(events([a, b, odd])) == ([a, b], odd, 0)


async def test_the_first_event_comes_back_before_the_rest_of_its_chunk() -> None:
    stream = _stream([b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"])
    out, error, failures = await _watched_run(stream)
    assert (out, error, failures) == ([b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"], None, 0)


async def test_stream_chunks_still_reads_chunks_behind_the_bound() -> None:
    resp = _Response([b"da", b"ta: 1\n\n"])
    resp.connection = _Connection()
    resp.connection.protocol = _Protocol()
    resp.connection.protocol.read_timeout = 30.0
    assert [c async for c in stream_chunks(resp)] == [b"da", b"ta: 1\n\n"]  # type: ignore[arg-type]


# -- relay: events pushed from a real aiohttp reader, fed as aiohttp's parser feeds it -------


class _ParserSide:
    """A reader's protocol as aiohttp's reader sees it: paused and resumed by its flow control."""

    connected = True

    def __init__(self) -> None:
        self.paused = False

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self, resume_parser: bool = True) -> None:
        self.paused = False


class _LiveResponse:
    """A streamed response whose body is aiohttp's own StreamReader, fed by the test."""

    closed = False

    def __init__(self, read_timeout: float | None = None) -> None:
        self.protocol = _ParserSide()
        # A small limit: a few hundred events are past its flow control's high-water mark.
        self.content = aiohttp.StreamReader(self.protocol, 2**10, loop=asyncio.get_running_loop())  # type: ignore[arg-type]
        self.connection = _Connection()
        self.connection.protocol = _Protocol()
        self.connection.protocol.read_timeout = read_timeout
        self.released: list[int] = []
        self.content.on_eof(lambda: self.released.append(1))  # as ClientResponse gives its connection back

    def feed(self, *chunks: bytes) -> None:
        """What aiohttp's parser does with a chunked body's chunks (one network read)."""
        for chunk in chunks:
            self.content.begin_http_chunk_receiving()
            self.content.feed_data(chunk)
            self.content.end_http_chunk_receiving()

    def close(self) -> None:
        self.closed = True


async def _pushed_run(
    reads: list[list[bytes]], *, drains: frozenset[int] = frozenset(), translate: Callable[[bytes], list[bytes]] | None = None,
) -> tuple[list[bytes], BaseException | None, int]:
    """``EventStream.relay`` over ``reads`` (each a network read of one or more chunks,
    the relay running between two): the events given, the error, how many were given
    inside the parser's feed (pushed, not read). The events whose index is in ``drains``
    ask the relay to wait (a write's drain) before the next."""
    resp = _LiveResponse()
    stream = EventStream(resp, translate)  # type: ignore[arg-type]
    got: list[bytes] = []
    feeding = False
    pushed = 0

    async def drain() -> None:
        await asyncio.sleep(0)

    def deliver(event: bytes) -> Awaitable[None] | None:
        nonlocal pushed
        pushed += feeding
        got.append(event)
        return drain() if len(got) - 1 in drains else None

    relay = asyncio.create_task(stream.relay(deliver))
    await asyncio.sleep(0)
    for read in reads:
        feeding = True
        resp.feed(*read)
        feeding = False
        for _ in range(3):
            await asyncio.sleep(0)
    resp.content.feed_eof()
    try:
        await relay
    except Exception as exc:
        return got, exc, pushed
    assert resp.content.__class__ is aiohttp.StreamReader and resp.released == [1]  # the reader is its own again
    return got, None, pushed


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=200, deadline=None)
@given(_streams, st.lists(st.integers(min_value=0), max_size=12), st.lists(st.integers(min_value=1, max_value=3), max_size=12),
       st.frozensets(st.integers(min_value=0, max_value=20)))
def test_pushed_events_are_what_iterating_gives(stream: bytes, cuts: list[int], group_sizes: list[int],
                                                drains: frozenset[int]) -> None:
    parts = [part for part in split_at(stream, cuts) if part]
    reads: list[list[bytes]] = []
    for size in group_sizes or [1]:
        if parts:
            reads.append(parts[:size])
            parts = parts[size:]
    reads += [[part] for part in parts]
    flat = [part for read in reads for part in read]

    async def run() -> None:
        expected, _ = await _drain(_reference_iter_events(_aiter(flat)))
        got, error, _ = await _pushed_run(reads, drains=drains)
        assert (got, error) == (expected, None)
        doubled = [o for e in expected for o in (e, e.upper())]
        got, error, _ = await _pushed_run(reads, drains=drains, translate=lambda e: [e, e.upper()])
        assert (got, error) == (doubled, None)

    asyncio.run(run())


async def test_each_event_is_given_inside_the_parsers_feed_without_a_read() -> None:
    events = [b'data: {"n":%d}\n\n' % n for n in range(5)]
    got, error, pushed = await _pushed_run([[event] for event in events])
    assert (got, error, pushed) == (events, None, 5)


async def test_chunks_that_come_while_a_write_waits_are_given_after_it_in_order() -> None:
    resp = _LiveResponse()
    stream = EventStream(resp)  # type: ignore[arg-type]
    got: list[bytes] = []
    drained = asyncio.Event()

    def deliver(event: bytes) -> Awaitable[None] | None:
        got.append(event)
        return drained.wait() if len(got) == 1 else None

    relay = asyncio.create_task(stream.relay(deliver))
    await asyncio.sleep(0)
    many = [b"data: %d\n\n" % n for n in range(300)]  # more chunks than the reader holds unpaused
    resp.feed(many[0])
    for _ in range(3):
        await asyncio.sleep(0)
    resp.feed(*many[1:])
    assert got == many[:1]  # held while the write waits: in the reader's buffer
    assert resp.protocol.paused  # and the reader's own flow control paused the connection
    drained.set()
    for _ in range(5):
        await asyncio.sleep(0)
    assert got == many and not resp.protocol.paused  # read, and reading resumed
    resp.feed(b"data: [DONE]\n\n")
    assert got[-1] == b"data: [DONE]\n\n"  # pushed again
    resp.content.feed_eof()
    await relay


async def test_a_relay_that_raises_while_pushed_raises_in_the_relaying_coroutine() -> None:
    resp = _LiveResponse()
    stream = EventStream(resp)  # type: ignore[arg-type]
    got: list[bytes] = []
    refused = KeyError("refused")

    def deliver(event: bytes) -> None:
        got.append(event)
        if len(got) == 2:
            raise refused

    relay = asyncio.create_task(stream.relay(deliver))
    await asyncio.sleep(0)
    resp.feed(b"data: 1\n\n", b"data: 2\n\n", b"data: 3\n\n")
    with pytest.raises(KeyError) as raised:
        await relay
    assert raised.value is refused and got == [b"data: 1\n\n", b"data: 2\n\n"]  # nothing after it
    assert resp.content.__class__ is aiohttp.StreamReader
    resp.feed(b"data: 4\n\n")
    assert got == [b"data: 1\n\n", b"data: 2\n\n"]


async def test_a_failed_connection_while_pushed_is_the_providers_failure() -> None:
    resp = _LiveResponse()
    stream = EventStream(resp)  # type: ignore[arg-type]
    failures: list[int] = []
    resp.feed(b"data: 1\n\n")
    first = await anext(stream)
    stream.watch(first, _is_done, b"[DONE]", lambda: failures.append(1))
    got: list[bytes] = []
    relay = asyncio.create_task(stream.relay(lambda event: got.append(event)))  # type: ignore[func-returns-value]
    await asyncio.sleep(0)
    resp.feed(b"data: 2\n\n")
    resp.content.set_exception(aiohttp.ClientPayloadError("cut"))
    with pytest.raises(UpstreamProtocolError):
        await relay
    assert got == [b"data: 1\n\n", b"data: 2\n\n"] and failures == [1]


async def test_an_overflow_while_pushed_comes_after_the_events_before_it() -> None:
    big = b"data: " + b"x" * (MAX_EVENT_BYTES + 1)
    got, error, _ = await _pushed_run([[b"data: 1\n\n"], [b"data: 2\n\ndata: 3\n\n" + big]])
    assert got == [b"data: 1\n\n", b"data: 2\n\n", b"data: 3\n\n"]
    assert isinstance(error, UpstreamProtocolError) and isinstance(error.__cause__, EventTooLarge)


async def test_a_cancelled_relay_leaves_the_reader_its_own() -> None:
    resp = _LiveResponse()
    stream = EventStream(resp)  # type: ignore[arg-type]
    got: list[bytes] = []
    relay = asyncio.create_task(stream.relay(lambda event: got.append(event)))  # type: ignore[func-returns-value]
    await asyncio.sleep(0)
    resp.feed(b"data: 1\n\n")
    relay.cancel()  # the client left
    with pytest.raises(asyncio.CancelledError):
        await relay
    assert resp.content.__class__ is aiohttp.StreamReader and resp.content._timer is not stream
    resp.feed(b"data: 2\n\n")
    assert got == [b"data: 1\n\n"]  # nothing given after


async def test_the_silence_bound_ends_a_pushed_stream() -> None:
    resp = _LiveResponse(read_timeout=0.05)
    stream = EventStream(resp)  # type: ignore[arg-type]
    got: list[bytes] = []
    relay = asyncio.create_task(stream.relay(lambda event: got.append(event)))  # type: ignore[func-returns-value]
    await asyncio.sleep(0)
    resp.feed(b"data: 1\n\n")
    with pytest.raises(UpstreamTimeoutError):
        await asyncio.wait_for(relay, 5)
    assert got == [b"data: 1\n\n"] and resp.closed
