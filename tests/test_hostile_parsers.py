"""Property-based tests of the two parsers that face untrusted bytes: the chat body
validation and the SSE reader."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.core.errors import InvalidRequest
from gateway.edge.chat import parse_chat_body
from gateway.protocols.sse import EventTooLarge, event_data, iter_events
from tests.conftest import split_at

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.dictionaries(st.sampled_from(["model", "messages", "stream", "temperature", "x"]), json_values))
def test_chat_body_validation_accepts_or_raises_invalid_request_only(body: dict[str, Any]) -> None:
    try:
        model, stream = parse_chat_body(body)
    except InvalidRequest as exc:
        assert exc.status == 400 and exc.error_code and exc.error_code.startswith("invalid_")
        return
    assert isinstance(model, str) and model.strip()
    assert isinstance(stream, bool)
    assert isinstance(body["messages"], list) and body["messages"]
    assert all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in body["messages"])


async def _chunks(parts: list[bytes]) -> AsyncIterator[bytes]:
    for p in parts:
        yield p


def _collect(parts: list[bytes], **kwargs: Any) -> list[bytes]:
    async def run() -> list[bytes]:
        return [e async for e in iter_events(_chunks(parts), **kwargs)]

    return asyncio.run(run())


payload = st.binary(max_size=60).filter(lambda b: b"\n" not in b and b"\r" not in b)


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=200, deadline=None)
@given(st.lists(payload, min_size=1, max_size=8), st.lists(st.integers(min_value=0), max_size=10))
def test_sse_reader_yields_every_event_whatever_the_chunking(datas: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(b"data: " + d + b"\n\n" for d in datas)
    events = _collect(split_at(stream, cuts))
    assert [event_data(e) for e in events] == datas
    assert b"".join(events) == stream  # byte for byte


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.binary(max_size=300), st.lists(st.integers(min_value=0), max_size=6))
def test_sse_reader_never_loses_or_invents_bytes(data: bytes, cuts: list[int]) -> None:
    events = _collect(split_at(data, cuts))
    normalised = data.replace(b"\r\n", b"\n")
    joined = b"".join(events)
    # Events carry every non-blank byte of the input, in order, each closed by a blank line.
    assert re.sub(rb"\s", b"", joined) == re.sub(rb"\s", b"", normalised)
    assert all(e.endswith(b"\n\n") and e.strip() for e in events)


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([b"data: ", b"data:", b"event: e", b"x", b"[DONE]", b" ", b"\n", b"\r", b":"]),
                max_size=12))
def test_sse_reader_yields_a_read_of_one_event_as_the_general_path_does(parts: list[bytes]) -> None:
    # A read that is one whole event takes the fast path; byte by byte takes the buffer's.
    data = b"".join(parts) + b"\n\n"
    assert _collect([data]) == _collect([data[i : i + 1] for i in range(len(data))])


line_ends = st.sampled_from([b"\n", b"\r\n"])


@st.composite
def mixed_streams(draw: st.DrawFn) -> tuple[bytes, list[bytes]]:
    """A stream whose events end their lines with LF, CRLF or a mix, and its payloads."""
    datas = draw(st.lists(payload, min_size=1, max_size=5))
    stream = b"".join(b"data: " + d + draw(line_ends) + draw(line_ends) for d in datas)
    return stream, datas


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=60, deadline=None)
@given(mixed_streams())
def test_sse_reader_splits_crlf_and_mixed_streams_at_every_offset(case: tuple[bytes, list[bytes]]) -> None:
    stream, datas = case
    expected = stream.replace(b"\r\n", b"\n")
    for offset in range(len(stream) + 1):
        events = _collect([stream[:offset], stream[offset:]])
        assert [event_data(e) for e in events] == datas, offset
        assert b"".join(events) == expected, offset


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=200, deadline=None)
@given(mixed_streams(), st.lists(st.integers(min_value=0), max_size=10))
def test_sse_reader_crlf_and_mixed_streams_whatever_the_chunking(
    case: tuple[bytes, list[bytes]], cuts: list[int]
) -> None:
    stream, datas = case
    events = _collect(split_at(stream, cuts))
    assert [event_data(e) for e in events] == datas
    assert b"".join(events) == stream.replace(b"\r\n", b"\n")


def test_sse_reader_keeps_events_apart_when_a_crlf_blank_line_issplit_at() -> None:
    events = _collect([b"data: a\r\n\r", b"\ndata: b\r\n\r\n"])
    assert [event_data(e) for e in events] == [b"a", b"b"]


def test_sse_reader_folds_a_large_crlf_event_in_linear_time() -> None:
    # Re-folding the whole buffer on every chunk took ~2 s here (0.03 s folded per chunk).
    big = b"data: " + b"z\r\n" * 400_000 + b"\r\n"
    started = time.perf_counter()
    events = _collect([big[i : i + 1024] for i in range(0, len(big), 1024)])
    assert time.perf_counter() - started < 1.0
    assert len(events) == 1 and events[0].count(b"\n") == 400_001


def test_sse_reader_crlf_and_multiline_data() -> None:
    events = _collect([b"event: x\r\ndata: a\r\n", b"data: b\r\n\r\n: comment\n\n"])
    assert [event_data(e) for e in events] == [b"a\nb", None]


def test_sse_reader_bounds_an_event_that_never_ends() -> None:
    with pytest.raises(EventTooLarge):
        _collect([b"data: " + b"x" * 5000] * 10, max_event_bytes=20_000)


def test_sse_reader_accepts_a_long_line_under_the_bound() -> None:
    big = b"data: " + b"y" * 3_000_000 + b"\n\n"
    events = _collect(split_at(big, [65536 * i for i in range(1, 40)]))
    assert events == [big]


def test_sse_reader_passes_whole_event_reads_through_and_still_splits_the_rest() -> None:
    """Reads that are exactly one event each (a relayed stream's usual shape) come out as
    they went in; short reads, blank reads and reads holding two events are still split."""
    one, two = b"data: {\"a\":1}\n\n", b"data: [DONE]\n\n"
    assert _collect([one, two]) == [one, two]
    assert _collect([b"d", b"a", b"ta: x\n", b"\n", b"\n\n", one + two]) == [b"data: x\n\n", one, two]
    assert _collect([b" \n\n", one]) == [one]  # a blank event is not an event
