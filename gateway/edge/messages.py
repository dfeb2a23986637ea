"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API.

The Messages adapter of the shared pipeline (:mod:`gateway.edge.pipeline`), so this
route has every guarantee of chat completions: keys (``x-api-key`` or ``Authorization:
Bearer``), per-IP and per-key limits, allowlists, budgets, routing, breakers, retries
and failover before the first byte, cancellation, the ledger (``protocol`` =
``anthropic``), metrics and spans. What is the adapter's own:

* validation of Anthropic's required fields (``model``, ``max_tokens``, ``messages``
  with user/assistant roles; ``stream`` boolean), 400 ``invalid_request_error`` else;
* an Anthropic deployment gets the body as sent (passthrough, ``anthropic-version``
  and ``anthropic-beta`` forwarded) and its answer, stream or error is relayed as is,
  usage read from Anthropic's own fields;
* any other deployment gets the chat translation (:mod:`gateway.protocols.anthropic`)
  and its answer comes back as a ``message``, its stream re-framed event by event
  (:mod:`gateway.protocols.anthropic_stream`), its errors in Anthropic's shape.
  A request only an Anthropic deployment can take (documents, server tools) goes only
  to the group's Anthropic deployments;
* errors in Anthropic's shape (rendered by :mod:`gateway.http.errors`), mid-stream as
  one ``event: error``.

The response cache serves this route under chat's rules: its entries are chat answers,
rendered as a ``message`` (or its events) on a hit (docs/cache.md).
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

import orjson
from aiohttp import web

from gateway.core.errors import GatewayError, InvalidRequest, UpstreamUnavailable
from gateway.core.tokens import PER_MESSAGE_TOKENS, estimate_text_tokens
from gateway.core.usage import CallRecord, StreamTap, Usage
from gateway.edge import telemetry
from gateway.edge.dispatch import NativeCall, timeouts_for
from gateway.edge.pipeline import Inbound, Parsed, serve
from gateway.edge.ratelimit import admit
from gateway.edge.relays import StreamRelay, TapRelay, settle_native
from gateway.http.bodies import bearer_token, read_json_body
from gateway.http.errors import anthropic_error_event, anthropic_status
from gateway.http.state import STATE
from gateway.protocols.anthropic import (
    FINISH_REASONS,
    chat_usage,
    countable_text,
    from_chat_completion,
    from_messages_request,
    to_anthropic_error,
)
from gateway.protocols.anthropic_stream import EventsFromChunks, NativeStreamTap
from gateway.providers.base import ProviderError, UpstreamReply

__all__ = ["MESSAGES", "AnthropicMessages", "count_tokens", "messages", "parse_messages_body"]

#: Client headers an Anthropic deployment reads: passed through on native calls.
_NATIVE_HEADERS = ("anthropic-version", "anthropic-beta")
_JSON = "application/json"


def _check_messages(body: dict[str, Any]) -> tuple[str, list[Any]]:
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise InvalidRequest("model: Field required (a non-empty string)", code="invalid_model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages: Field required (a non-empty list)", code="invalid_messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise InvalidRequest(f"messages.{i}.role: must be 'user' or 'assistant'", code="invalid_messages")
        content = message.get("content")
        if not isinstance(content, str | list):
            raise InvalidRequest(f"messages.{i}.content: must be a string or a list of blocks",
                                 code="invalid_messages")
        if isinstance(content, list):
            _check_blocks(content, f"messages.{i}.content")
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        if not isinstance(system, list):
            raise InvalidRequest("system: must be a string or a list of text blocks", code="invalid_system")
        _check_blocks(system, "system", only_text=True)
    return model, messages


def _check_blocks(blocks: list[Any], where: str, *, only_text: bool = False) -> None:
    """Each block an object with a string ``type``; a text block's ``text`` a string."""
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if not isinstance(kind, str) or (only_text and kind != "text"):
            raise InvalidRequest(f"{where}.{j}: must be {'a text block' if only_text else 'a block with a type'}",
                                 code="invalid_messages")
        if kind == "text" and not isinstance(block.get("text"), str):
            raise InvalidRequest(f"{where}.{j}.text: must be a string", code="invalid_messages")


def parse_messages_body(body: dict[str, Any]) -> tuple[str, bool]:
    """Validate what the gateway reads of a Messages body (the rest is the mapping's or
    the provider's to judge): ``model``, ``max_tokens``, ``messages``, ``stream``."""
    model, _ = _check_messages(body)
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise InvalidRequest("max_tokens: Field required (a positive integer)", code="invalid_max_tokens")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest("stream: must be a boolean", code="invalid_stream")
    return model, stream


def _native_headers(request: web.Request) -> dict[str, str]:
    return {name: request.headers[name] for name in _NATIVE_HEADERS if name in request.headers}


def _json(status: int, body: bytes, reply: UpstreamReply | None = None) -> web.Response:
    headers = {"Content-Type": _JSON}
    if reply is not None and reply.retry_after is not None:
        headers["retry-after"] = reply.headers.get("retry-after") or reply.headers.get("Retry-After") or ""
    return web.Response(status=status, body=body, headers=headers)


class _TranslatedRelay(TapRelay):
    """A chat deployment's chunks, re-framed as Anthropic's named events."""

    unfinished = StreamRelay.unfinished

    def __init__(self, tap: StreamTap, framer: EventsFromChunks, prompt_estimate: int) -> None:
        super().__init__(tap)
        self.framer = framer
        self.prompt_estimate = prompt_estimate

    def chunk(self, event: bytes, data: bytes) -> bytes | None:
        return self.framer.feed(data) or None

    def end(self, event: bytes) -> bytes | None:
        return self.framer.finish(self.tap.final_usage(self.prompt_estimate))

    @property
    def done(self) -> bool:
        return self.framer.finished

    def error_event(self, error: GatewayError) -> bytes:
        return anthropic_error_event(error)


class _NativeRelay(StreamRelay):
    """An Anthropic deployment's events, relayed unchanged and read on the way."""

    unfinished = "upstream closed the stream before message_stop"

    def __init__(self) -> None:
        self.tap = NativeStreamTap()

    def feed(self, event: bytes) -> bytes | None:
        self.tap.inspect(event)
        if self.tap.error is not None:
            self.told = True  # the provider's own error event reaches the client as it is
        return event

    @property
    def done(self) -> bool:
        return self.tap.done

    def error_event(self, error: GatewayError) -> bytes:
        return anthropic_error_event(error)

    def settle(self, record: CallRecord, started: float, prompt_estimate: int) -> None:
        tap = self.tap
        settle_native(record, started, prompt_estimate, first_event_at=tap.first_event_at, events=tap.chunks,
                      usage=tap.usage(), error=None if tap.error is None else tap.error.split(":", 1)[0])
        record.response_id = tap.response_id
        record.served_model = tap.model or record.served_model
        record.finish_reasons = (tap.finish_reason,) if tap.finish_reason else ()


class AnthropicMessages(Inbound):
    """Anthropic's Messages API, translated to chat or passed through to Anthropic."""

    name: ClassVar[str] = "anthropic"
    cacheable: ClassVar[bool] = True

    def parse(self, body: dict[str, Any], request: web.Request) -> Parsed:
        model, stream = parse_messages_body(body)
        try:
            chat_body = from_messages_request(body)
            chat_error = None
        except InvalidRequest as exc:
            # Only an Anthropic deployment can take it: dispatch sends it to those alone.
            chat_body = {"model": model, "messages": [], "max_tokens": body["max_tokens"]}
            chat_error = exc
        native = NativeCall(body=body, headers=_native_headers(request), chat_error=chat_error)
        return Parsed(model=model, stream=stream, body=chat_body, native=native)

    def answer(self, reply: UpstreamReply, answer: dict[str, Any] | None, parsed: Parsed) -> web.Response:
        if not reply.ok:
            return _json(anthropic_status(reply.status), to_anthropic_error(reply.status, reply.body), reply)
        if answer is None or not isinstance(answer.get("choices"), list):
            raise UpstreamUnavailable("upstream answered something other than a chat completion")
        return _json(200, orjson.dumps(from_chat_completion(answer, model=parsed.model)))

    def native_answer(self, reply: UpstreamReply, record: CallRecord, parsed: Parsed) -> web.Response:
        try:
            message = orjson.loads(reply.body) if reply.ok else None
        except orjson.JSONDecodeError:
            message = None
        if isinstance(message, dict) and isinstance(message.get("usage"), dict):
            counts = chat_usage(message["usage"])
            record.usage = Usage(prompt_tokens=counts["prompt_tokens"], completion_tokens=counts["completion_tokens"])
            record.response_id = message.get("id")
            record.served_model = message.get("model") or record.served_model
            reason = message.get("stop_reason")
            record.finish_reasons = (FINISH_REASONS.get(reason, "stop"),) if isinstance(reason, str) else ()
        return web.Response(status=reply.status, body=reply.body, headers=dict(reply.headers))

    def unstreamed(self, reply: UpstreamReply) -> web.Response:
        if reply.wire != "chat":
            return web.Response(status=reply.status, body=reply.body, headers=dict(reply.headers))
        if reply.ok:
            raise UpstreamUnavailable("upstream answered a whole body to a stream request")
        return _json(anthropic_status(reply.status), to_anthropic_error(reply.status, reply.body), reply)

    def relay(self, reply: UpstreamReply, parsed: Parsed, keep_text: bool, prompt_estimate: int) -> StreamRelay:
        if reply.wire != "chat":
            return _NativeRelay()
        tap = StreamTap(client_wants_usage=False, keep_text=keep_text)
        return _TranslatedRelay(tap, EventsFromChunks(model=parsed.model, input_tokens=prompt_estimate),
                                prompt_estimate)


MESSAGES = AnthropicMessages()


async def messages(request: web.Request) -> web.StreamResponse:
    """``POST /v1/messages``."""
    return await serve(request, MESSAGES)


async def count_tokens(request: web.Request) -> web.Response:
    """``POST /v1/messages/count_tokens``: ``{"input_tokens": N}``, no generation.

    Where the model's first deployment speaks the Messages API, its own count (or its
    own error) is the answer; otherwise, or when it cannot be reached, an estimate by
    :func:`gateway.core.tokens.estimate_text_tokens`. Not a call: no ledger row.
    """
    state = request.app[STATE]
    key = await state.auth.authenticate(bearer_token(request))
    telemetry.key_known(request, key.api_key_id)
    await admit(request, key, state.limiter)
    body = await read_json_body(request, state.settings.body_limit)
    model, _ = _check_messages(body)
    route = state.router.resolve(model, key.policy.allowed_models)
    targets = state.router.order(route, state.breaker.view, stream=False)
    if targets:
        target = targets[0]
        provider = state.providers[target.provider]
        if provider.speaks_messages:
            try:
                reply = await provider.count_tokens(
                    {**body, "model": target.upstream_model}, headers=_native_headers(request),
                    timeouts=timeouts_for(route.group, provider),
                )
            except ProviderError:
                reply = None  # unreachable: the estimate is better than no answer
            if reply is not None and reply.status < 500:
                return web.Response(status=reply.status, body=reply.body, headers=dict(reply.headers))
    text, n_messages = countable_text(body)
    tokens = await asyncio.to_thread(estimate_text_tokens, text)
    return _json(200, orjson.dumps({"input_tokens": tokens + PER_MESSAGE_TOKENS * n_messages}))
