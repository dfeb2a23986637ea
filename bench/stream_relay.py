"""CPU per event of a chat stream's relay path, in process: the gateway's own share of S3.

    python -m bench.stream_relay [--streams N] [--rounds R] [--per-read K] [--hide-usage] [--openai]

Drives the per-chunk path a chat stream relayed to a chat client takes, with the real
code at every step but the sockets: the OpenAI provider's event stream
(``gateway.providers.openai._events``: one ``EventStream``, the silence bound, the SSE
split of ``EventSplitter`` and the transport error mapping in one ``__anext__``) reading a
fake aiohttp response whose ``content.readany()`` hands over ``K`` events per read
(default 1, as in S3, where chunks come 20 ms apart), the first event read by dispatch's
``_first_event``, the breaker's watch (``_watch``: a hook on the stream, no generator
of its own), the chat adapter's relay (``_ChatRelay`` over a
``StreamTap``) and a copy of the loop of ``pipeline._stream`` (its guard, cache, checks
and capture hooks off, as in the bench), writing into a response that only counts what
it is given. Each stream is S3's: the role chunk, 50 content chunks (236-byte events), the
finish chunk, the usage chunk and ``[DONE]``, every chunk with ``"usage":null`` (the
gateway always asks for usage). ``--hide-usage`` is a client that did not ask for it
(``"usage":null`` stripped, the usage chunk hidden). ``--openai`` sends the chunks as
OpenAI's API does: ``service_tier``, ``system_fingerprint`` and a random ``obfuscation``
string of random length in every chunk.

Prints the process CPU (``time.process_time``) per upstream event and the writes per
event, median of the rounds. The first round's streams are checked (usage, finish
reason, id, bytes written): a path that got one wrong voids the measure. What a real
``response.write`` and socket read cost is the same for the bare relay and is not in
here (per write, see ``writes/event``). A run takes a few seconds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import uvloop

from gateway.core.usage import CallRecord
from gateway.edge.chat import CHAT
from gateway.edge.dispatch import _first_event, _watch
from gateway.edge.pipeline import Parsed
from gateway.providers.base import UpstreamReply
from gateway.providers.openai import _events

__all__ = ["main", "measure", "stream_events"]

WORDS = 50


def _chunk(delta: dict[str, Any], finish: str | None = None, *, openai: bool = False) -> dict[str, Any]:
    chunk: dict[str, Any] = {"id": "chatcmpl-bench0123456789", "object": "chat.completion.chunk",
                             "created": 1733000000, "model": "bench-stream"}
    if openai:
        chunk.update(service_tier="default", system_fingerprint="fp_34a54111")
    chunk["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    chunk["usage"] = None
    return chunk


def stream_events(openai: bool = False) -> list[bytes]:
    """S3's stream as the fake provider sends it (``stream_options.include_usage`` on)."""
    chunks = [_chunk({"role": "assistant", "content": ""}, openai=openai)]
    chunks += [_chunk({"content": f" word{i} and a few more"}, openai=openai) for i in range(WORDS)]
    chunks.append(_chunk({}, "stop", openai=openai))
    chunks.append({"id": "chatcmpl-bench0123456789", "object": "chat.completion.chunk", "created": 1733000000,
                   "model": "bench-stream", "choices": [],
                   "usage": {"prompt_tokens": 12, "completion_tokens": 250, "total_tokens": 262}})
    if openai:
        pads = random.Random(23)
        for chunk in chunks:
            chunk["obfuscation"] = "".join(pads.choices("abcdefghijkLMNOPQ0123456789", k=pads.randint(2, 16)))
    return [b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks] + [b"data: [DONE]\n\n"]


class _Content:
    """``resp.content``: one awaited ``readany`` per read, as aiohttp's stream reader is."""

    __slots__ = ("_reads", "total_bytes")

    def __init__(self, reads: list[bytes]) -> None:
        self._reads = iter(reads)
        self.total_bytes = 0  # what aiohttp's reader counts as received

    async def readany(self) -> bytes:
        for read in self._reads:
            self.total_bytes += len(read)
            return read
        return b""

    def set_exception(self, exc: BaseException) -> None:
        raise AssertionError(f"the stream's idle bound fired during the measure: {exc}")


class _Protocol:
    """The connection's protocol: the request's ``sock_read``, taken over by the ``EventStream``."""

    read_timeout: float | None = 300.0


class _Connection:
    def __init__(self) -> None:
        self.protocol = _Protocol()


class _Response:
    """The upstream aiohttp response, as ``_events`` (an ``EventStream``) reads it."""

    closed = False

    def __init__(self, reads: list[bytes]) -> None:
        self.content = _Content(reads)
        self.connection = _Connection()

    def close(self) -> None:
        self.closed = True


class _Breaker:
    """The breaker handle ``_watch`` has the stream report a cut to."""

    def __init__(self) -> None:
        self.failures = 0

    def report(self, deployment: str, outcome: Any, **_: Any) -> None:
        self.failures += 1


class _Sink:
    """The client's response: counts what is written."""

    __slots__ = ("bytes", "writes")

    def __init__(self) -> None:
        self.writes = 0
        self.bytes = 0

    async def write(self, data: bytes) -> None:
        self.writes += 1
        self.bytes += len(data)


async def _relay_one(reads: list[bytes], parsed: Parsed, breaker: _Breaker, sink: _Sink) -> CallRecord:
    """One stream through provider → _first_event → _watch → relay → the _stream loop."""
    reply = UpstreamReply(status=200, headers={"Content-Type": "text/event-stream"},
                          events=_events(_Response(reads)))  # type: ignore[arg-type]
    first = await _first_event(reply)
    _watch(reply, first, "bench/stream", breaker)  # type: ignore[arg-type]
    relay = CHAT.relay(reply, parsed, False, 12)
    events: AsyncIterator[bytes] = reply.events  # type: ignore[assignment]
    # pipeline._stream's loop, its hooks off (None in the bench): the one test that rules
    # them out is made per event, their bodies never run.
    screen = storable = checks = capture = None
    hooked = screen is not None or storable or checks is not None or capture is not None
    ending: list[bytes] = []
    async for event in events:
        if hooked:
            pass
        out = relay.feed(event)
        if out:
            if relay.done:
                ending.append(out)
            else:
                await sink.write(out)
    if ending:
        await sink.write(b"".join(ending))
    record = CallRecord(request_id="bench", api_key_id=None, subject_id=None, requested_model="bench-stream")
    relay.settle(record, 0.0, 12)
    return record


def _check(record: CallRecord, sink: _Sink, expected_bytes: int, breaker: _Breaker) -> None:
    usage = record.usage
    if (usage.prompt_tokens, usage.completion_tokens, usage.estimated) != (12, 250, False) \
            or record.finish_reasons != ("stop",) or record.response_id != "chatcmpl-bench0123456789" \
            or record.served_model != "bench-stream" or sink.bytes != expected_bytes or breaker.failures:
        raise SystemExit(f"the relay got the stream wrong ({record}, {sink.bytes} bytes, "
                         f"expected {expected_bytes}): the measure is void")


async def _rounds(
    streams: int, rounds: int, per_read: int, hide_usage: bool, openai: bool
) -> tuple[list[float], float]:
    events = stream_events(openai)
    reads = [b"".join(events[i:i + per_read]) for i in range(0, len(events), per_read)]
    if hide_usage:
        expected = sum(len(e.replace(b',"usage":null', b"")) for e in events[:-2]) + len(events[-1])
    else:
        expected = sum(map(len, events))
    parsed = Parsed(model="bench-stream", stream=True, body={}, wants_usage=not hide_usage)
    per_event: list[float] = []
    writes = 0.0
    for round_ in range(rounds):
        breaker = _Breaker()
        sinks = [_Sink() for _ in range(streams)]
        started = time.process_time()
        for sink in sinks:
            record = await _relay_one(reads, parsed, breaker, sink)
        spent = time.process_time() - started
        if round_ == 0:
            _check(record, sinks[-1], expected, breaker)
            writes = sinks[-1].writes / len(events)
        per_event.append(spent * 1e6 / (streams * len(events)))
    return per_event, writes


def measure(
    streams: int = 1000, rounds: int = 5, per_read: int = 1, hide_usage: bool = False, openai: bool = False
) -> dict[str, float]:
    per_event, writes = uvloop.run(_rounds(streams, rounds, per_read, hide_usage, openai))
    return {"per_event_us": statistics.median(per_event), "writes_per_event": writes}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.stream_relay", description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1000, help="streams per round (default 1000)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; the median is printed (default 5)")
    parser.add_argument("--per-read", type=int, default=1, help="events per upstream read (default 1)")
    parser.add_argument("--hide-usage", action="store_true", help="a client that did not ask for usage")
    parser.add_argument("--openai", action="store_true", help="chunks shaped as OpenAI's (random padding)")
    args = parser.parse_args(argv)
    figures = measure(args.streams, args.rounds, args.per_read, args.hide_usage, args.openai)
    print(f"chat stream relay ({len(stream_events())} events{', OpenAI shape' if args.openai else ''}, "
          f"{args.per_read}/read, {'usage hidden' if args.hide_usage else 'usage asked for'}): "
          f"{figures['per_event_us']:.2f} µs per event, {figures['writes_per_event']:.2f} writes/event")


if __name__ == "__main__":
    main()
