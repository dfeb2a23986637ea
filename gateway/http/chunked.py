"""A streamed answer's body written event by event with one plain call per event.

``StreamResponse.write`` costs two coroutines and four Python frames per call
(``StreamResponse.write``, ``StreamWriter.write``, its chunk framing, its ``_writelines``):
about 170 bytecode instructions before the bytes reach the transport, on every event of
every stream. :class:`ChunkedBody` does what those do for the body the relays write, a
chunked and uncompressed one with its headers sent at ``prepare()``: the chunk's size
line, the chunk and its CRLF as one ``transport.write``; the writer's byte counts kept
(aiohttp's access log and ``body_length`` read them); a drain once 64 KiB went out since
the last (aiohttp's own bound); a closing transport refused with aiohttp's own
``ClientConnectionResetError`` (a ``ConnectionError``). Anything else (a compressed body,
an HTTP/1.0 client's unchunked one, another writer) goes through ``StreamResponse.write``
itself (:func:`body_of`).

The end of the body is still ``StreamResponse.write_eof``: it reads the same counts.
"""

from __future__ import annotations

from collections.abc import Awaitable

from aiohttp import ClientConnectionResetError, web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http_writer import StreamWriter

__all__ = ["Body", "ChunkedBody", "body_of"]

#: Bytes written without a drain before the next write waits for one (``StreamWriter.write``'s LIMIT).
DRAIN_AFTER = 0x10000


class Body:
    """A prepared response's body: :meth:`put` writes one piece, and returns what to await
    before the next (None: nothing)."""

    __slots__ = ("_response",)

    def __init__(self, response: web.StreamResponse) -> None:
        self._response = response

    def put(self, data: bytes) -> Awaitable[None] | None:
        return self._response.write(data)


class ChunkedBody(Body):
    """A chunked, uncompressed body written straight to the transport (see the module)."""

    __slots__ = ("_protocol", "_writer")

    def __init__(self, response: web.StreamResponse, writer: StreamWriter) -> None:
        super().__init__(response)
        self._writer = writer
        #: The connection's protocol: its ``transport`` is read at each write, as aiohttp
        #: reads it (None once the connection is lost), without the writer's property call.
        self._protocol = writer.protocol

    def put(self, data: bytes) -> Awaitable[None] | None:
        writer = self._writer
        transport = self._protocol.transport
        if transport is None or transport.is_closing():
            raise ClientConnectionResetError("Cannot write to closing transport")  # as aiohttp: a ConnectionError
        if not data:
            return None  # an empty chunk would end a chunked body
        frame = b"%x\r\n%b\r\n" % (len(data), data)
        transport.write(frame)
        size = len(frame)
        writer.output_size += size
        buffered = writer.buffer_size = writer.buffer_size + size
        if buffered > DRAIN_AFTER:
            writer.buffer_size = 0
            return writer.drain()
        return None


def body_of(response: web.StreamResponse, writer: AbstractStreamWriter | None) -> Body:
    """How to write ``response``'s body (``writer``: what its ``prepare()`` returned)."""
    if (
        type(writer) is StreamWriter
        and writer.chunked  # HTTP/1.1 without a length: aiohttp chose chunked at prepare()
        and not response.compression
        and writer.length is None
        and getattr(writer, "on_body_write", None) is None  # a byte counter's hook (newer aiohttp)
    ):
        send_headers = getattr(writer, "send_headers", None)  # aiohttp ≥ 3.12 may hold them
        if send_headers is not None:
            send_headers()
        return ChunkedBody(response, writer)
    return Body(response)
