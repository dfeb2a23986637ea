"""``POST /v1/chat/completions``: the chat completions adapter of the shared pipeline.

The pipeline (:mod:`gateway.edge.pipeline`) authenticates, limits, routes, dispatches,
relays and records; this module says what is chat's own. The gateway validates only
``model``, ``messages`` and ``stream``; everything else reaches the provider unchanged.
A whole answer is returned with the provider's status and body; a stream's events are
relayed as the provider sent them, except a usage-only chunk (and ``"usage": null``) the
client did not ask for. After the first byte an error is one ``data: {"error": ...}``
event and the stream ends without ``[DONE]``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from aiohttp import web

from gateway.core.errors import GatewayError, InvalidRequest
from gateway.core.usage import CallRecord, StreamTap
from gateway.edge.pipeline import Inbound, Parsed, StreamCut, StreamRelay, serve
from gateway.http.errors import error_event
from gateway.protocols.sse import event_data
from gateway.providers.base import UpstreamReply

__all__ = ["CHAT", "ChatCompletions", "chat_completions", "parse_chat_body", "settle_from_tap"]

_USAGE_NULL = b',"usage":null'


def parse_chat_body(body: dict[str, Any]) -> tuple[str, bool]:
    """Validate the three fields the gateway reads; everything else passes through."""
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise InvalidRequest("'model' must be a non-empty string", code="invalid_model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list", code="invalid_messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequest(f"messages[{i}] must be an object with a string 'role'", code="invalid_messages")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean", code="invalid_stream")
    return model, stream


def _wants_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


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


class _ChatRelay(StreamRelay):
    """Chat chunks relayed byte for byte, the unasked-for usage hidden."""

    unfinished = "upstream closed the stream before [DONE]"

    def __init__(self, tap: StreamTap) -> None:
        self.tap = tap
        self.strip_usage_null = not tap.client_wants_usage

    def feed(self, event: bytes) -> bytes | None:
        data = event_data(event)
        if data is not None and not self.tap.inspect(data):
            if self.tap.malformed:
                raise StreamCut("upstream sent an event that is not JSON")
            return None
        if self.strip_usage_null and _USAGE_NULL in event:
            return event.replace(_USAGE_NULL, b"")
        return event

    @property
    def done(self) -> bool:
        return self.tap.done

    def error_event(self, error: GatewayError) -> bytes:
        return error_event(error)

    def settle(self, record: CallRecord, started: float, prompt_estimate: int) -> None:
        settle_from_tap(self.tap, record, started, prompt_estimate)


class ChatCompletions(Inbound):
    """OpenAI chat completions: the internal shape itself, so nothing is translated."""

    name: ClassVar[str] = "chat"
    cacheable: ClassVar[bool] = True

    def parse(self, body: dict[str, Any], request: web.Request) -> Parsed:
        model, stream = parse_chat_body(body)
        return Parsed(model=model, stream=stream, body=body, wants_usage=stream and _wants_usage(body))

    def answer(self, reply: UpstreamReply, answer: dict[str, Any] | None, parsed: Parsed) -> web.Response:
        return web.Response(status=reply.status, body=reply.body,
                            headers={"Content-Type": reply.headers.get("Content-Type", "application/json")})

    def unstreamed(self, reply: UpstreamReply) -> web.Response:
        return web.Response(status=reply.status, body=reply.body,
                            headers={"Content-Type": reply.headers.get("Content-Type", "application/json")})

    def relay(self, reply: UpstreamReply, parsed: Parsed, keep_text: bool, prompt_estimate: int) -> StreamRelay:
        return _ChatRelay(StreamTap(client_wants_usage=parsed.wants_usage, keep_text=keep_text))


CHAT = ChatCompletions()


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await serve(request, CHAT)
