"""A small Server-Sent Events reader for relaying provider streams byte for byte.

Why not aiohttp-sse-client: it reconnects (re-sending the POST) when a stream ends, drops
raw bytes and error bodies, and fails on long lines (see shared notes). This reader
splits the raw byte stream into events at blank lines and yields each event's bytes
unchanged, so the relay can forward exactly what the provider sent.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator

import orjson

__all__ = ["EventSplitter", "EventTooLarge", "iter_events", "event_data", "stream_texts"]

#: Largest single event accepted; bounds memory on a provider that never ends an event.
MAX_EVENT_BYTES = 16 * 1024 * 1024


class EventTooLarge(ValueError):
    """An event grew past MAX_EVENT_BYTES without a terminating blank line."""

    def __init__(self, message: str, events: list[bytes] | None = None) -> None:
        super().__init__(message)
        #: The complete events of the chunk that overflowed, before the one too large.
        self.events: list[bytes] = events or []


class EventSplitter:
    """The split of a byte stream into events, one chunk at a time: what :func:`iter_events`
    yields, for a reader that takes its chunks itself (a provider's event stream).

    CRLF line ends are folded to LF; an event is yielded with its blank line, byte for byte
    as it came. :meth:`feed` gives the events a chunk completes, :meth:`end` the bytes after
    the last blank line (an unterminated event), terminated, so nothing sent is lost.
    """

    __slots__ = ("_buf", "_held_cr", "_max_event_bytes", "_scan_from", "between_events")

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self._buf = bytearray()
        self._scan_from = 0  # where the next search for a blank line starts; never rescans a byte
        self._held_cr = False  # the previous chunk ended in "\r": it may be half of a CRLF
        self._max_event_bytes = max_event_bytes
        #: Nothing of an event is held (no bytes, no CR): the next chunk starts one. A reader
        #: may then take a chunk that is one whole one-line event as it is, as :meth:`feed` does.
        self.between_events = True

    def feed(self, chunk: bytes) -> list[bytes]:
        """The events ``chunk`` completes, in order (none, or often ``[chunk]`` itself).

        Raises :class:`EventTooLarge` when the event being read grows past the bound; the
        events the chunk completed before it are the exception's ``events``.
        """
        size = len(chunk)
        newline = chunk.find(b"\n")
        if (self.between_events
                # Its only blank line is its end: a one-line event's first newline is its
                # end's (one memchr, and its last byte a newline), else it ends in "\n\n"
                # with none before. rfind, the one-byte finds and `in` of an int (CR) are
                # C's fast searches (memchr); `in` of bytes and find of two bytes cost four
                # times as much on a 200-byte chunk.
                and ((newline == size - 2 and chunk[-1] == 0x0A)
                     or (chunk.endswith(b"\n\n") and chunk.rfind(b"\n\n", 0, size - 1) < 0))
                and 0x0D not in chunk):
            # The common case of a relayed stream: a read that is exactly one whole event.
            # It is given as it came, without copying it through the buffer (the same
            # bytes the general path would give).
            return [chunk] if chunk[0] > 0x20 or chunk.strip() else []
        if not chunk:
            return []
        if self.between_events and chunk.endswith(b"\n\n") and 0x0D not in chunk:
            # A read of several whole events (a stream's end: its usage chunk and [DONE]
            # together): one split gives what the loop below would, event for event (a
            # split is the same left-to-right search for blank lines), with no buffer.
            parts = chunk.split(b"\n\n")
            if not parts[-1]:  # else the last blank line was part of "\n\n\n": the loop below
                del parts[-1]
                return [part + b"\n\n" for part in parts if part.strip()]
        buf = self._buf
        if self._held_cr:
            chunk = b"\r" + chunk
        held_cr = self._held_cr = chunk.endswith(b"\r")
        if held_cr:
            chunk = chunk[:-1]
        # Folding each chunk on its own (with a held trailing CR) keeps the work linear
        # and never moves bytes already scanned, whatever the split.
        if 0x0D in chunk:
            chunk = chunk.replace(b"\r\n", b"\n")
        buf += chunk
        events = []
        start = 0
        scan_from = self._scan_from
        while True:
            end = buf.find(b"\n\n", max(scan_from, start))
            if end < 0:
                break
            event = bytes(buf[start : end + 2])
            start = end + 2
            if event.strip():
                events.append(event)
        if start:
            del buf[:start]  # one deletion per chunk, not one per event
        self._scan_from = max(0, len(buf) - 1)
        self.between_events = not buf and not held_cr
        if len(buf) > self._max_event_bytes:
            raise EventTooLarge(f"SSE event over {self._max_event_bytes} bytes", events)
        return events

    def end(self) -> bytes | None:
        """At the stream's end: what is left after the last blank line as one terminated
        event, or None (nothing but blank lines is left)."""
        buf = self._buf
        if self._held_cr:
            buf += b"\r"  # a lone CR at the very end: keep the byte
            self._held_cr = False
        tail = bytes(buf).strip(b"\n")
        buf.clear()
        self._scan_from = 0
        self.between_events = True
        return tail + b"\n\n" if tail.strip() else None


async def iter_events(
    chunks: AsyncIterable[bytes], *, max_event_bytes: int = MAX_EVENT_BYTES
) -> AsyncIterator[bytes]:
    """Yield each complete event (ending with its blank line) from a byte stream
    (:class:`EventSplitter`'s split).

    CRLF line ends are folded to LF. Bytes after the last blank line (an unterminated
    event) are yielded at the end, terminated, so nothing the provider sent is lost.
    """
    splitter = EventSplitter(max_event_bytes)
    async for chunk in chunks:
        try:
            events = splitter.feed(chunk)
        except EventTooLarge as exc:
            for event in exc.events:
                yield event
            raise
        for event in events:
            yield event
    tail = splitter.end()
    if tail is not None:
        yield tail


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
