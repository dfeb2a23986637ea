"""What a stream relay is (:class:`StreamRelay`), and :class:`TapRelay`, the one every
relay of a chat deployment's stream shares, whatever protocol the client speaks.

The pipeline (:mod:`gateway.edge.pipeline`) feeds a relay each upstream event, writes
what it returns, asks it whether the stream completed, for the one error event that ends
a broken stream, and to fill the call's record. A chat stream is read the same way for
every client: each ``data:`` payload goes through a :class:`~gateway.core.usage.StreamTap`
(ids, finish reasons, usage, the usage-only chunk a client did not ask for), a payload
that is not JSON cuts the stream, and ``[DONE]`` ends it. What differs per protocol is
only what a chunk and the end become for the client: :meth:`TapRelay.chunk` and
:meth:`TapRelay.end`. A stream relayed in the deployment's own protocol (Anthropic's,
the Responses API's) is read by that protocol's tap instead; :func:`settle_native` is
what those relays record alike.
"""

from __future__ import annotations

from typing import ClassVar

from gateway.core.errors import GatewayError
from gateway.core.usage import CallRecord, StreamTap, Usage
from gateway.http.errors import error_event
from gateway.protocols.sse import event_data

__all__ = ["StreamCut", "StreamRelay", "TapRelay", "settle_from_tap", "settle_native"]


class StreamCut(Exception):
    """The stream ended before its end marker, or sent something it must not."""


class StreamRelay:
    """One stream's relay in one protocol: what each upstream event becomes for the
    client, whether the stream completed, and what the record learns from it."""

    #: The client has been told of the failure already (an upstream error event relayed).
    told: bool = False
    #: Why a stream that ended without its end marker failed.
    unfinished: ClassVar[str] = "upstream closed the stream before its end"

    def feed(self, event: bytes) -> bytes | None:
        """What to write for one upstream event (None: nothing); raises StreamCut/StreamBroken."""
        raise NotImplementedError

    @property
    def done(self) -> bool:
        raise NotImplementedError

    def error_event(self, error: GatewayError) -> bytes:
        """The one event telling the client why its stream ends."""
        raise NotImplementedError

    def settle(self, record: CallRecord, started: float, prompt_estimate: int) -> None:
        """Fill the record from what was relayed (ids, finish reasons, usage, ttft)."""
        raise NotImplementedError


def settle_from_tap(tap: StreamTap, record: CallRecord, started: float, prompt_estimate: int) -> None:
    """Fill the record from a relayed chat stream (the internal shape), whatever the client's
    protocol: ids, finish reasons, usage (reported, else estimated), chunks, text."""
    if tap.first_chunk_at is not None:
        record.ttft = tap.first_chunk_at - started
    record.response_id = tap.response_id
    record.served_model = tap.response_model or record.served_model
    record.finish_reasons = tuple(tap.finish_reasons)
    record.usage = tap.final_usage(prompt_estimate)
    record.chunks = tap.chunks
    record.completion = tap.kept_text()


def settle_native(
    record: CallRecord, started: float, prompt_estimate: int, *, first_event_at: float | None, events: int,
    usage: Usage | None, error: str | None,
) -> None:
    """Fill the record from a stream relayed in the deployment's own protocol (what every
    native relay's tap learns alike): ttft, events, usage (reported, else the prompt's
    estimate), and the deployment's own error, if it sent one."""
    if first_event_at is not None:
        record.ttft = first_event_at - started
    record.chunks = events
    record.usage = usage if usage is not None else Usage(prompt_tokens=prompt_estimate, estimated=True)
    if error is not None:
        record.error_type = error[:64]


class TapRelay(StreamRelay):
    """A chat deployment's stream read through a :class:`StreamTap`; a subclass says what
    a chunk (:meth:`chunk`), the end (:meth:`end`) and an event with no data
    (:meth:`no_data`) become for its client. By default everything is relayed as sent,
    errors are OpenAI's ``data: {"error": ...}`` event and the stream is complete at
    ``[DONE]``."""

    unfinished = "upstream closed the stream before [DONE]"

    def __init__(self, tap: StreamTap) -> None:
        self.tap = tap

    def feed(self, event: bytes) -> bytes | None:
        if self.tap.inspect_event(event):
            # Most chunks: one line, a content chunk the tap's template accounted for.
            return self.chunk(event, event[6:-2])
        data = event_data(event)
        if data is None:
            return self.no_data(event)
        if not self.tap.inspect(data):  # a usage-only chunk not asked for: the tap keeps its counts
            if self.tap.malformed:
                raise StreamCut("upstream sent an event that is not JSON")
            return None
        if data == b"[DONE]":
            return self.end(event)
        return self.chunk(event, data)

    def no_data(self, event: bytes) -> bytes | None:
        """What an event without a ``data:`` line (a comment, a keep-alive) becomes."""
        return None

    def chunk(self, event: bytes, data: bytes) -> bytes | None:
        """What one chunk (``data`` its JSON payload) becomes for the client."""
        return event

    def end(self, event: bytes) -> bytes | None:
        """What ``[DONE]`` becomes for the client."""
        return event

    @property
    def done(self) -> bool:
        return self.tap.done

    def error_event(self, error: GatewayError) -> bytes:
        return error_event(error)

    def settle(self, record: CallRecord, started: float, prompt_estimate: int) -> None:
        settle_from_tap(self.tap, record, started, prompt_estimate)
