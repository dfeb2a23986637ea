"""A small Server-Sent Events reader for relaying provider streams byte for byte.

Why not aiohttp-sse-client: it reconnects (re-sending the POST) when a stream ends, drops
raw bytes and error bodies, and fails on long lines (see shared notes). This reader
splits the raw byte stream into events at blank lines and yields each event's bytes
unchanged, so the relay can forward exactly what the provider sent.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator

import orjson

__all__ = ["EventTooLarge", "iter_events", "event_data", "stream_texts"]

#: Largest single event accepted; bounds memory on a provider that never ends an event.
MAX_EVENT_BYTES = 16 * 1024 * 1024


class EventTooLarge(ValueError):
    """An event grew past MAX_EVENT_BYTES without a terminating blank line."""


async def iter_events(
    chunks: AsyncIterable[bytes], *, max_event_bytes: int = MAX_EVENT_BYTES
) -> AsyncIterator[bytes]:
    """Yield each complete event (ending with its blank line) from a byte stream.

    CRLF line ends are folded to LF. Bytes after the last blank line (an unterminated
    event) are yielded at the end, terminated, so nothing the provider sent is lost.
    """
    buf = bytearray()
    scan_from = 0  # where the next search for a blank line starts; never rescans a byte
    held_cr = False  # the previous chunk ended in "\r": it may be half of a CRLF
    async for chunk in chunks:
        if not chunk:
            continue
        size = len(chunk)
        if (not buf and not held_cr and chunk.endswith(b"\n\n")
                # Its only blank line is its end: a one-line event's first newline is its
                # end's (one memchr), else no "\n\n" before the end. rfind and the
                # one-byte finds are C's fast searches; `in` and find of two bytes cost
                # four times as much on a 200-byte chunk.
                and (chunk.find(b"\n") == size - 2 or chunk.rfind(b"\n\n", 0, size - 1) < 0)
                and chunk.find(b"\r") < 0):
            # The common case of a relayed stream: a read that is exactly one whole event.
            # It is yielded as it came, without copying it through the buffer (the same
            # bytes the general path would yield).
            if chunk[0] > 0x20 or chunk.strip():
                yield chunk
            continue
        if held_cr:
            chunk = b"\r" + chunk
        held_cr = chunk.endswith(b"\r")
        if held_cr:
            chunk = chunk[:-1]
        # Folding each chunk on its own (with a held trailing CR) keeps the work linear
        # and never moves bytes already scanned, whatever the split.
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
            del buf[:start]  # one deletion per chunk, not one per event
        scan_from = max(0, len(buf) - 1)
        if len(buf) > max_event_bytes:
            raise EventTooLarge(f"SSE event over {max_event_bytes} bytes")
    if held_cr:
        buf += b"\r"  # a lone CR at the very end: keep the byte
    tail = bytes(buf).strip(b"\n")
    if tail.strip():
        yield tail + b"\n\n"


def event_data(event: bytes) -> bytes | None:
    """The joined ``data:`` payload of one event, or None if it has none (comments etc.)."""
    if event.startswith(b"data: ") and (
        # The common case, one data line: its first newline is the second last byte and the
        # last is one too (a memchr, cheaper than counting them), else exactly two newlines.
        (event.find(b"\n") == len(event) - 2 and event[-1] == 0x0A) or event.count(b"\n") == 2
    ):
        return event[6:-2]
    parts = []
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            value = line[5:]
            parts.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(parts) if parts else None


def stream_texts(event: bytes, wire: str) -> list[tuple[int, str]]:
    """The (index, text) deltas of one stream event in ``wire`` (chat chunks, Anthropic
    events, Responses events); [] for anything else."""
    data = event_data(event)
    if data is None or data == b"[DONE]":
        return []
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return []
    if not isinstance(obj, dict):
        return []
    out: list[tuple[int, str]] = []
    if wire == "chat":
        choices = obj.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if isinstance(delta, dict) and isinstance(delta.get("content"), str):
                index = choice.get("index", 0)
                out.append((index if isinstance(index, int) else 0, delta["content"]))
    elif wire == "anthropic":
        delta = obj.get("delta")
        if obj.get("type") == "content_block_delta" and isinstance(delta, dict) and isinstance(delta.get("text"), str):
            index = obj.get("index", 0)
            out.append((index if isinstance(index, int) else 0, delta["text"]))
    elif wire == "responses" and obj.get("type") == "response.output_text.delta" and isinstance(obj.get("delta"), str):
        index = obj.get("output_index", 0)
        out.append((index if isinstance(index, int) else 0, obj["delta"]))
    return out
