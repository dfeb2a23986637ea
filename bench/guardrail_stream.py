"""What an output guardrail adds to a relayed stream: per chunk, and to its first chunk.

    python -m bench.guardrail_stream [--streams N]

Feeds chat SSE events (the role chunk, 50 content chunks of a few words each, one of
them carrying half of a card number and the next the other half, the finish chunk,
``[DONE]``) through the stream guard the pipeline uses (``gateway.guardrails.relays``)
with a ``pii`` policy in ``redact`` mode, and prints microseconds (median of the
streams) for the first chunk, for a content chunk, and for a whole stream. The first
chunk is what a client waits on: the role chunk is never held, so this is the guard's
whole addition to the time to first chunk. A run takes a second or two.
"""

from __future__ import annotations

import argparse
import statistics
import time

import orjson

from gateway.guardrails.engine import GuardrailEngine
from gateway.guardrails.policies import Policy
from gateway.guardrails.relays import stream_guard

__all__ = ["main", "measure"]


def _event(delta: dict[str, object], finish: str | None = None) -> bytes:
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def stream_events() -> list[bytes]:
    words = [f"word{i} and some more text " for i in range(50)]
    words[20] += "card 4111 1111 "
    words[21] = "1111 1111 then more " + words[21]
    return [_event({"role": "assistant", "content": ""}), *(_event({"content": w}) for w in words),
            _event({}, "stop"), b"data: [DONE]\n\n"]


def measure(streams: int = 200) -> dict[str, float]:
    engine = GuardrailEngine([Policy("pii", "pii", mode="redact", direction="output")])
    events = stream_events()
    first: list[float] = []
    per_chunk: list[float] = []
    whole: list[float] = []
    redacted = 0
    for _ in range(streams):
        guard = stream_guard(engine, "chat")
        assert guard is not None
        started = time.perf_counter()
        guard.feed(events[0])
        after_first = time.perf_counter()
        out = [guard.feed(event) for event in events[1:]]
        ended = time.perf_counter()
        redacted += b"4111" not in b"".join(out)
        first.append((after_first - started) * 1e6)
        per_chunk.append((ended - after_first) * 1e6 / (len(events) - 1))
        whole.append((ended - started) * 1e6)
    if redacted != streams:
        raise SystemExit("the card number split over two chunks was not redacted: the measure is void")
    return {"first_chunk_us": statistics.median(first), "per_chunk_us": statistics.median(per_chunk),
            "stream_us": statistics.median(whole)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=200, help="streams to feed (default 200)")
    args = parser.parse_args(argv)
    figures = measure(args.streams)
    print(f"pii redact on a 53-event chat stream: first chunk {figures['first_chunk_us']:.1f} µs, "
          f"per chunk {figures['per_chunk_us']:.1f} µs, whole stream {figures['stream_us']:.0f} µs")


if __name__ == "__main__":
    main()
