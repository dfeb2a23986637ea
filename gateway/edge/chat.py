"""``POST /v1/chat/completions``: authenticate, validate, route, call, relay, record.

The handler is thin: decisions come from actors (auth; limits, breakers and billing as
they land), the provider call from :mod:`gateway.relay.retry`, and the relay is here:
a whole answer is returned with the provider's status and body; a stream is relayed
event by event as it arrives, never buffered whole. Before the first byte an error is
contract JSON; after it, one ``data: {"error": ...}`` event and the stream ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import web

from gateway.billing.pricing import settle_cost
from gateway.cache.keys import CacheTicket, replay
from gateway.core.errors import (
    GatewayError,
    InvalidRequest,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from gateway.core.tokens import prompt_tokens
from gateway.core.usage import CallRecord, StreamTap, usage_from_answer
from gateway.edge import telemetry
from gateway.edge.dispatch import dispatch
from gateway.edge.ratelimit import admit
from gateway.http.admission import ShuttingDown, is_shutdown
from gateway.http.bodies import bearer_token, read_json_body
from gateway.http.errors import error_event
from gateway.http.middleware import request_id_of
from gateway.http.state import STATE, GatewayState
from gateway.protocols.sse import event_data
from gateway.providers.base import ProviderError, UpstreamTimeoutError
from gateway.relay.routing import Route

__all__ = ["chat_completions", "parse_chat_body"]

log = logging.getLogger("gateway.chat")

_SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx: do not buffer the relay
}
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


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    key = await state.auth.authenticate(bearer_token(request))
    telemetry.key_known(request, key.api_key_id)
    # Released by the rate-limit middleware on every path; it charges record's usage then.
    permit = await admit(request, key)
    body = await read_json_body(request, state.settings.body_limit)
    model, stream = parse_chat_body(body)
    route = state.router.resolve(model, key.policy.allowed_models)
    cache = None if state.cache is None else state.cache.ticket(
        route.group.name, model, body, key.api_key_id, key.subject_id, request.headers
    )
    record = CallRecord(
        request_id=request_id_of(request),
        api_key_id=key.api_key_id,
        subject_id=key.subject_id,
        requested_model=model,
        stream=stream,
    )
    # Budget hook: the call's worst case is held before anything is sent (402 if it cannot
    # be), and released at its real cost in the finally below (gateway/billing/gate.py).
    reservation = await state.billing.reserve(key, record, route, state.router, body)
    permit.track(record)
    started = time.monotonic()
    observed = telemetry.begin_call(request, record, body)
    try:
        if cache is not None and (hit := await cache.lookup()) is not None:
            return await replay(request, hit, cache, body, record, _SSE_HEADERS)
        if stream:
            return await _stream(request, state, route, body, record, started, cache)
        return await _whole(state, route, body, record, cache)
    except asyncio.CancelledError as exc:
        record.outcome = "cancelled"
        # 499: the client went away; 503: the shutdown ended it (the admission gate answers so).
        record.status = record.status or (503 if is_shutdown(exc) else 499)
        raise
    except GatewayError as exc:
        record.status = exc.status
        record.outcome = record.outcome if record.outcome != "ok" else "upstream_error"
        record.error_type = exc.error_code
        raise
    finally:
        record.latency = time.monotonic() - started
        record.cache = None if cache is None else cache.status
        _finish(state, record)
        state.billing.settle(reservation, record)  # budget hook: release at the real cost
        telemetry.end_call(request, observed, record)


def _finish(state: GatewayState, record: CallRecord) -> None:
    settle_cost(record)  # once, so billing, metrics and logs see the same cost
    for listener in state.call_listeners:
        try:
            listener(record)
        except Exception:  # a listener must never fail the request it observes
            log.exception("call listener failed for %s", record.request_id)


async def _whole(
    state: GatewayState, route: Route, body: dict[str, Any], record: CallRecord, cache: CacheTicket | None
) -> web.Response:
    target, reply = await dispatch(state, route, body, record, stream=False)
    record.status = reply.status
    record.served_model = target.upstream_model
    usage, answer = usage_from_answer(reply.body)
    record.usage = usage
    if answer is not None:
        record.response_id = answer.get("id")
        record.served_model = answer.get("model") or target.upstream_model
        choices = answer.get("choices")
        if isinstance(choices, list):
            record.finish_reasons = tuple(
                c["finish_reason"] for c in choices if isinstance(c, dict) and isinstance(c.get("finish_reason"), str)
            )
            if state.settings.capture_genai_content:
                record.completion = _answer_text(choices)
    if not reply.ok:
        record.outcome = "provider_error"
    headers = {"Content-Type": reply.headers.get("Content-Type", "application/json")}
    if cache is not None:
        if reply.status == 200 and answer is not None:
            cache.store_answer(reply.body, headers["Content-Type"], answer, record)
        headers.update(cache.headers())
    return web.Response(status=reply.status, body=reply.body, headers=headers)


async def _stream(
    request: web.Request,
    state: GatewayState,
    route: Route,
    body: dict[str, Any],
    record: CallRecord,
    started: float,
    cache: CacheTicket | None,
) -> web.StreamResponse:
    client_wants_usage = _wants_usage(body)
    if not client_wants_usage:
        # Ask for usage anyway so the ledger is exact; the client never sees it.
        options = body.get("stream_options")
        body = {**body, "stream_options": {**(options if isinstance(options, dict) else {}), "include_usage": True}}
    target, reply = await dispatch(state, route, body, record, stream=True)
    record.status = reply.status
    record.served_model = target.upstream_model
    if reply.events is None:
        # The provider answered an error (or a whole body) instead of a stream: relay it.
        if not reply.ok:
            record.outcome = "provider_error"
        return web.Response(
            status=reply.status,
            body=reply.body,
            headers={"Content-Type": reply.headers.get("Content-Type", "application/json")},
        )
    tap = StreamTap(client_wants_usage=client_wants_usage, keep_text=state.settings.capture_genai_content)
    strip_usage_null = not client_wants_usage
    response = web.StreamResponse(status=200, headers=_SSE_HEADERS if cache is None else {
        **_SSE_HEADERS, **cache.headers()})
    try:
        await response.prepare(request)
        async for event in reply.events:
            if cache is not None:
                cache.collect(event)  # raw, as the provider sent it: stored once complete
            data = event_data(event)
            if data is not None and not tap.inspect(data):
                if tap.malformed:
                    raise _StreamCut("upstream sent an event that is not JSON")
                continue
            if strip_usage_null and _USAGE_NULL in event:
                event = event.replace(_USAGE_NULL, b"")
            await response.write(event)
        if not tap.done:
            raise _StreamCut("upstream closed the stream before [DONE]")
    except (ProviderError, _StreamCut) as exc:
        record.outcome = "cut"
        record.error_type = type(exc).__name__
        error = UpstreamTimeout("upstream went silent mid-stream") if isinstance(
            exc, UpstreamTimeoutError
        ) else UpstreamUnavailable(f"upstream stream failed: {exc}")
        try:
            await response.write(error_event(error))
        except ConnectionError:
            pass
    except ConnectionError:
        record.outcome = "cancelled"  # the client went away mid-write
    except asyncio.CancelledError as exc:
        if not is_shutdown(exc) or not response.prepared:
            raise  # a client gone, or nothing sent yet (the admission gate answers 503)
        # The shutdown's grace period is over: the client is still there, tell it why
        # the stream ends (one error event, no [DONE]) rather than dropping the socket.
        asyncio.current_task().uncancel()  # type: ignore[union-attr]
        record.outcome = "cut"
        record.error_type = "shutdown"
        try:
            await response.write(error_event(ShuttingDown("gateway shutting down: stream cut")))
        except ConnectionError:
            pass
    finally:
        await reply.release()
        if tap.first_chunk_at is not None:
            record.ttft = tap.first_chunk_at - started
        record.response_id = tap.response_id
        record.served_model = tap.response_model or record.served_model
        record.finish_reasons = tuple(tap.finish_reasons)
        record.usage = tap.final_usage(prompt_tokens(body.get("messages") or []))
        record.chunks = tap.chunks
        record.completion = tap.kept_text()
        if cache is not None and tap.done:
            cache.store_stream(record)
    return response


def _answer_text(choices: list[Any]) -> str | None:
    """The first choice's message text of a whole answer (for content capture only)."""
    first = choices[0] if choices else None
    message = first.get("message") if isinstance(first, dict) else None
    content = message.get("content") if isinstance(message, dict) else None
    return content if isinstance(content, str) else None


class _StreamCut(Exception):
    """The provider ended the stream without ``[DONE]``."""
