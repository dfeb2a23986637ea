"""One data-plane call, whatever protocol the client speaks: the pipeline every
generation route shares, with a small :class:`Inbound` adapter per protocol.

auth → per-key limits → body → parse (the adapter: its own validation, and the
request in the internal chat shape) → route (allowlist) → budget → cache → dispatch
(breakers, retries, failover) → relay → record. The adapter decides only what differs
between protocols: how the request is read, how a whole answer and a stream are
rendered in its shape, and its mid-stream error event. Errors before the first byte are
raised as :class:`~gateway.core.errors.GatewayError` and rendered by the error
middleware in the route's own shape (:func:`gateway.http.errors.error_shape_for`).

A deployment that speaks the client's protocol natively gets the request as the client
sent it (:class:`~gateway.edge.dispatch.NativeCall`), and its answer is relayed as it
came (``reply.wire`` says which shape a reply is in); every other deployment gets the
chat shape and its answer is re-framed by the adapter. A whole answer is returned with
the provider's status; a stream is relayed event by event as it arrives, never buffered
whole. After the first byte an error is one event in the protocol's shape and the
stream ends. A client gone cancels the upstream; the record still carries what was
delivered.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import orjson
from aiohttp import web

from gateway.billing.pricing import settle_cost
from gateway.cache.keys import CacheTicket, EndStream, replay
from gateway.cache.store import CacheEntry
from gateway.core.errors import GatewayError, GuardrailBlocked, UpstreamTimeout, UpstreamUnavailable
from gateway.core.tokens import prompt_tokens
from gateway.core.usage import CallRecord, Usage, usage_from_answer
from gateway.edge import telemetry
from gateway.edge.dispatch import NativeCall, dispatch
from gateway.edge.ratelimit import admit
from gateway.edge.relays import StreamCut, StreamRelay
from gateway.edge.request_capture import BodyCapture, capture_for
from gateway.guardrails.engine import GuardrailEngine
from gateway.guardrails.policies import Decision
from gateway.guardrails.relays import stream_guard
from gateway.guardrails.stream_checks import stream_checks
from gateway.http.admission import ShuttingDown, is_shutdown
from gateway.http.bodies import bearer_token, read_json_body
from gateway.http.chunked import body_of
from gateway.http.middleware import request_id_of
from gateway.http.state import STATE, GatewayState
from gateway.protocols.anthropic_stream import StreamBroken
from gateway.providers.base import ProviderError, UpstreamReply, UpstreamTimeoutError, watched
from gateway.relay.routing import Route, Target

if TYPE_CHECKING:
    from actors.auth import VerifiedKey

__all__ = ["SSE_HEADERS", "Inbound", "Parsed", "finish_record", "serve", "tell_listeners"]

log = logging.getLogger("gateway.chat")

#: Native protocols whose requests and answers the guardrail policies can read as sent.
GUARDED_NATIVE = frozenset({"anthropic"})

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx: do not buffer the relay
}


@dataclass(frozen=True, slots=True)
class Parsed:
    """A request as the pipeline needs it, whatever protocol it came in."""

    model: str
    stream: bool
    #: The request in the internal (chat completions) shape, for chat deployments.
    body: dict[str, Any]
    #: The request as sent, for deployments speaking the protocol natively (None: none do).
    native: NativeCall | None = None
    #: The client asked for a stream's usage (chat's ``stream_options.include_usage``).
    wants_usage: bool = False


class Inbound:
    """What one inbound protocol decides; the pipeline does the rest."""

    #: Recorded as the call's ``protocol`` (ledger, logs).
    name: ClassVar[str] = "chat"
    #: Whether the response cache serves this protocol.
    cacheable: ClassVar[bool] = False
    #: Whether :meth:`prepare` must run (it may read state, e.g. a stored conversation).
    prepares: ClassVar[bool] = False

    def parse(self, body: dict[str, Any], request: web.Request) -> Parsed:
        raise NotImplementedError

    async def prepare(self, parsed: Parsed, key: VerifiedKey, request: web.Request) -> Parsed:
        """The request completed with what only the key's subject may read (before routing)."""
        return parsed

    def answer(self, reply: UpstreamReply, answer: dict[str, Any] | None, parsed: Parsed) -> web.Response:
        """A whole answer in the internal shape (``reply.wire == "chat"``), for the client."""
        raise NotImplementedError

    def native_answer(self, reply: UpstreamReply, record: CallRecord, parsed: Parsed) -> web.Response:
        """A whole answer in this protocol's own shape, relayed; the record filled from it."""
        raise NotImplementedError

    def unstreamed(self, reply: UpstreamReply) -> web.Response:
        """A provider's error (or whole body) where a stream was asked for."""
        raise NotImplementedError

    def relay(self, reply: UpstreamReply, parsed: Parsed, keep_text: bool, prompt_estimate: int) -> StreamRelay:
        raise NotImplementedError


async def serve(request: web.Request, protocol: Inbound, state: GatewayState | None = None) -> web.StreamResponse:
    """Handle one generation call in ``protocol``; ``state`` is the plane's (looked up when a
    route's handler is not bound to it: ~25 instructions through aiohttp's ``request.app``)."""
    if state is None:
        state = request.app[STATE]
    key = await state.auth.authenticate(bearer_token(request))
    telemetry.key_known(request, key.api_key_id)
    # Released by the rate-limit middleware on every path; it charges record's usage then.
    permit = await admit(request, key, state.limiter)
    parsed = protocol.parse(await read_json_body(request, state.settings.body_limit), request)
    if protocol.prepares:
        parsed = await protocol.prepare(parsed, key, request)
    model, stream, body = parsed.model, parsed.stream, parsed.body
    route = state.router.resolve(model, key.policy.allowed_models)
    guard = None if state.guardrails is None else state.guardrails.engine_for(route.group.name, key.key_prefix)
    decisions: list[Decision] = []
    if guard is not None and parsed.native is not None and parsed.native.protocol not in GUARDED_NATIVE:
        # The policies read chat and Anthropic shapes only: such a call takes the chat
        # translation, where they apply to prompt and answer alike, or, if it has none, is refused.
        if parsed.native.chat_error is not None:
            raise parsed.native.chat_error
        parsed = dataclasses.replace(parsed, native=None)
    if guard is not None:
        try:
            parsed, decisions = await _screen_input(guard, parsed)
        except GuardrailBlocked as exc:
            _record_refusal(state, request, protocol, key.api_key_id, key.subject_id, parsed, exc)
            raise
        body = parsed.body
    # Request logs: only what passed the input policies is ever kept (a refused prompt is not).
    capture = capture_for(state, route.group.name, key.key_prefix)
    if capture is not None:
        capture.request = parsed.native.body if parsed.native is not None else body
    cache = None if state.cache is None or not _cacheable(protocol, parsed) else state.cache.ticket(
        route.group.name, model, body, key.api_key_id, key.subject_id, request.headers
    )
    record = CallRecord(
        request_id=request_id_of(request),
        api_key_id=key.api_key_id,
        subject_id=key.subject_id,
        requested_model=model,
        stream=stream,
        protocol=protocol.name,
        # Most calls have no decision: no generator for an empty tuple (0.3 µs).
        guardrails=tuple((d.policy, d.action, d.direction) for d in decisions) if decisions else (),
    )
    # Budget hook: the call's worst case is held before anything is sent (402 if it cannot
    # be), and released at its real cost in the finally below (gateway/billing/gate.py).
    reservation = await state.billing.reserve(key, record, route, state.router, body)
    permit.track(record)
    started = time.monotonic()
    observed = telemetry.begin_call(request, state, record, body)
    try:
        response: web.StreamResponse
        if cache is not None and (hit := await cache.lookup()) is not None:
            end_stream = functools.partial(_record_then_end, state, record, started, cache.status)
            if protocol.name == "chat":
                response = await replay(request, hit, cache, body, record, SSE_HEADERS, end_stream)
            else:
                response = await _replay_in(request, protocol, hit, cache, parsed, record, started, end_stream)
        elif stream:
            response = await _stream(request, state, protocol, route, parsed, record, started, cache, guard, capture)
        else:
            response = await _whole(state, protocol, route, parsed, record, cache, guard, capture)
        if capture is not None:
            capture.answered(response)  # a whole answer's body as the client gets it
        if not response.prepared:
            # A whole answer: its ledger row is journaled, then it is sent from here rather
            # than after the handler returns, so that everything else this call still does
            # (the budget's release, metrics, the span's end, the access line) happens
            # after the client has its answer, not before: 30-40 µs less on each call's
            # latency at a low rate, where a request's path runs with cold caches.
            _finish_at(state, record, started, None if cache is None else cache.status)
            try:
                await response.prepare(request)
                await response.write_eof()
            except ConnectionError:
                pass  # gone before the answer's bytes: the call was served and is recorded as such
        return response
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
        if not record.finished:  # a whole answer or a complete stream has finished its record already
            _finish_at(state, record, started, None if cache is None else cache.status)
        state.billing.settle(reservation, record)  # budget hook: release at the real cost
        tell_listeners(state, record)
        if capture is not None:
            capture.finish(state, record)  # to the request-log actor: no encoding here
        telemetry.end_call(state, observed, record)


async def _record_then_end(
    state: GatewayState, record: CallRecord, started: float, cache_status: str | None,
    response: web.StreamResponse, ending: bytes,
) -> None:
    """Finish the record (billing journals it before this returns), then send the stream's
    ``ending``: a crash between the two loses an answer's end (the client retries), never
    the row of one it was served. Every streamed answer ends through here, live or from the
    cache; a whole answer is sent by :func:`serve` after its record is finished. The call
    listeners hear of it after the ending is out (:func:`serve`'s end).
    The ending goes out with the body's end (chunked encoding's last chunk): one write, not two."""
    _finish_at(state, record, started, cache_status)
    try:
        await response.write_eof(ending)
    except ConnectionError:
        pass  # gone before the last bytes: the call was served and is recorded as such


async def _replay_in(
    request: web.Request, protocol: Inbound, entry: CacheEntry, ticket: CacheTicket, parsed: Parsed,
    record: CallRecord, started: float, end_stream: EndStream,
) -> web.StreamResponse:
    """A cache hit for a client of another protocol: the stored chat-shaped answer rendered
    by its adapter, exactly as a live answer from a chat deployment would be."""
    record.status, record.served_model, record.response_id = 200, entry.model, entry.response_id
    record.finish_reasons = entry.finish_reasons
    record.cache_similarity = ticket.similarity
    if not entry.stream:
        answer = orjson.loads(entry.body)
        reply = UpstreamReply(status=200, headers={"Content-Type": entry.content_type}, body=entry.body, answer=answer)
        whole = protocol.answer(reply, answer, parsed)
        whole.headers.update(ticket.headers())
        record.usage = Usage(entry.prompt_tokens, entry.completion_tokens, cost_usd=0.0)
        return whole
    reply = UpstreamReply(status=200, headers={"Content-Type": "text/event-stream"})
    prompt_estimate = entry.prompt_tokens
    relay = protocol.relay(reply, parsed, False, prompt_estimate)
    response = web.StreamResponse(status=200, headers={**SSE_HEADERS, **ticket.headers()})
    sink = body_of(response, await response.prepare(request))
    ending: list[bytes] = []  # what the stored end became, held back as a live stream's is
    try:
        for event in entry.events():
            out = relay.feed(event)
            if out:
                if relay.done:
                    ending.append(out)
                elif (waiting := sink.put(out)) is not None:
                    await waiting
    except ConnectionError:
        record.outcome = "cancelled"
    relay.settle(record, started, prompt_estimate)
    # As on chat's hits: no provider was called, so there is no time to first token, and
    # the tokens say what was served (nothing was spent).
    record.ttft = None
    record.usage = Usage(entry.prompt_tokens, entry.completion_tokens, cost_usd=0.0)
    if record.outcome != "cancelled":  # else the client left: serve's end records it
        await end_stream(response, b"".join(ending))
    return response


def _cacheable(protocol: Inbound, parsed: Parsed) -> bool:
    """Whether the response cache may serve this call. A request the chat shape cannot carry
    (``native.chat_error``: only a deployment speaking the client's protocol can take it)
    is not: its chat body is a placeholder, not the request, and a native answer is not kept."""
    return protocol.cacheable and (parsed.native is None or parsed.native.chat_error is None)


def _record_refusal(
    state: GatewayState, request: web.Request, protocol: Inbound, api_key_id: Any, subject_id: Any,
    parsed: Parsed, exc: GuardrailBlocked,
) -> None:
    """A call an input policy refused still leaves its ledger row, metric and log line."""
    record = CallRecord(
        request_id=request_id_of(request), api_key_id=api_key_id, subject_id=subject_id,
        requested_model=parsed.model, stream=parsed.stream, protocol=protocol.name,
        status=exc.status, outcome="blocked", error_type=exc.error_code,
        guardrails=((exc.policy, "blocked", "input"),),
    )
    finish_record(state, record)
    tell_listeners(state, record)


def finish_record(state: GatewayState, record: CallRecord) -> None:
    """The record is final: its cost settled and its ledger row journaled (in the journal's
    file when this returns). The one step between an answer's last byte and the client:
    the call listeners are told later (:func:`tell_listeners`)."""
    record.finished = True
    settle_cost(record)  # once, so billing, metrics and logs see the same cost
    state.billing.record(record)


def _finish_at(state: GatewayState, record: CallRecord, started: float, cache_status: str | None) -> None:
    """:func:`finish_record` a call that ran since ``started`` (monotonic), its cache status set."""
    record.latency = time.monotonic() - started
    record.cache = cache_status
    finish_record(state, record)


def tell_listeners(state: GatewayState, record: CallRecord) -> None:
    """The call's billing line, then the call listeners (metrics, deployment limits'
    tokens): once per call, after its answer is out and its row journaled
    (:func:`finish_record`)."""
    state.billing.log_line(record)
    for listener in state.call_listeners:
        try:
            listener(record)
        except Exception:  # a listener must never fail the request it observes
            log.exception("call listener failed for %s", record.request_id)


async def _whole(
    state: GatewayState, protocol: Inbound, route: Route, parsed: Parsed, record: CallRecord,
    cache: CacheTicket | None,
    guard: GuardrailEngine | None = None,
    capture: BodyCapture | None = None,
) -> web.Response:
    target, reply = await dispatch(state, route, parsed.body, record, stream=False, native=parsed.native)
    if capture is not None:
        capture.request = _sent_body(parsed, reply)
    record.status = reply.status
    record.served_model = target.upstream_model
    if not reply.ok:
        record.outcome = "provider_error"
    if guard is not None and guard.output_policies and reply.ok:
        reply = await _screen_answer(guard, reply, record)
    if reply.wire != "chat":
        return protocol.native_answer(reply, record, parsed)
    answer = _settle_answer(state, reply, record, target)
    response = protocol.answer(reply, answer, parsed)
    if cache is not None:
        if reply.status == 200 and answer is not None:
            cache.store_answer(reply.body, response.headers["Content-Type"], answer, record)
        response.headers.update(cache.headers())
    return response


def _settle_answer(state: GatewayState, reply: UpstreamReply, record: CallRecord, target: Target) -> dict[str, Any] | None:
    """Fill the record from a whole answer in the internal shape; the parsed answer."""
    usage, answer = usage_from_answer(reply.body, reply.answer)
    record.usage = usage
    if answer is not None:
        record.response_id = answer.get("id")
        record.served_model = answer.get("model") or target.upstream_model
        choices = answer.get("choices")
        if isinstance(choices, list):
            if len(choices) == 1:
                # Most answers have one choice: its reason without a generator (0.35 µs).
                reason = choices[0].get("finish_reason") if isinstance(choices[0], dict) else None
                record.finish_reasons = (reason,) if isinstance(reason, str) else ()
            else:
                record.finish_reasons = tuple(
                    c["finish_reason"] for c in choices
                    if isinstance(c, dict) and isinstance(c.get("finish_reason"), str)
                )
            if state.settings.capture_genai_content:
                record.completion = _answer_text(choices)
    return answer


async def _stream(
    request: web.Request,
    state: GatewayState,
    protocol: Inbound,
    route: Route,
    parsed: Parsed,
    record: CallRecord,
    started: float,
    cache: CacheTicket | None,
    guard: GuardrailEngine | None = None,
    capture: BodyCapture | None = None,
) -> web.StreamResponse:
    body = parsed.body
    if not parsed.wants_usage:
        # Ask for usage anyway so the ledger is exact; the client never sees it.
        options = body.get("stream_options")
        body = {**body, "stream_options": {**(options if isinstance(options, dict) else {}), "include_usage": True}}
    target, reply = await dispatch(state, route, body, record, stream=True, native=parsed.native)
    if capture is not None:
        capture.request = _sent_body(parsed, reply)
    record.status = reply.status
    record.served_model = target.upstream_model
    if reply.events is None:
        # The provider answered an error (or a whole body) instead of a stream: relay it.
        if not reply.ok:
            record.outcome = "provider_error"
        return protocol.unstreamed(reply)
    prompt_estimate = prompt_tokens(body.get("messages") or [])
    relay = protocol.relay(reply, parsed, state.settings.capture_genai_content, prompt_estimate)
    screen = stream_guard(guard, reply.wire)
    checks = stream_checks(guard, reply.wire)  # webhook, moderation, hook: at intervals, beside the stream
    # Entries are kept in the internal (chat) shape and rendered per protocol on a hit; a
    # stream in a provider's own wire (passed through as sent) is not kept.
    storable = cache is not None and reply.wire == "chat"
    response = web.StreamResponse(status=200, headers=SSE_HEADERS if cache is None else {
        **SSE_HEADERS, **cache.headers()})
    concluded = False

    def conclude() -> None:
        """Fill the record from the relay (once), and store a complete stream in the cache."""
        nonlocal concluded
        if concluded:
            return
        concluded = True
        relay.settle(record, started, prompt_estimate)
        if screen is not None:
            record.guardrails += tuple((d.policy, d.action, d.direction) for d in screen.decisions())
        if checks is not None:
            checks.close()
            record.guardrails += tuple((d.policy, d.action, d.direction) for d in checks.decisions())
        if storable and cache is not None and relay.done and record.outcome != "blocked":
            cache.store_stream(record)

    #: What the upstream's last event(s) became: the stream's end marker, held back until
    #: the call's record is in the journal.
    ending: list[bytes] = []
    # Most streams have none of the hooks: one test per event rules the four out.
    hooked = screen is not None or storable or checks is not None or capture is not None
    try:
        sink = body_of(response, await response.prepare(request))

        def deliver(event: bytes) -> Awaitable[None] | None:
            """One upstream event through the hooks and the relay to the client; what to
            await before the next (a write's drain). It may run inside the upstream
            connection's ``data_received`` (``EventStream.relay`` pushes), so it never awaits."""
            if hooked:
                if screen is not None:
                    event = screen.feed(event)  # before the cache too: it must never keep what was redacted
                if storable and cache is not None:
                    cache.collect(event)  # as the provider sent it (bar redactions): stored once complete
                if checks is not None:
                    checks.observe(event)  # raises if a check that has answered refused the text
                if capture is not None:
                    capture.streamed(event, reply.wire)  # after the window: never a redacted text
            out = relay.feed(event)
            if out:
                if relay.done:
                    ending.append(out)
                else:
                    return sink.put(out)
            return None

        await watched(reply.events).relay(deliver)
        if not relay.done:
            raise StreamCut(relay.unfinished)
        if checks is not None:
            await checks.finish()  # the end waits for the last check: a refused stream never ends as a success
        # Complete: journal the call, then send its end, so a crash between the two loses
        # an answer's end (the client retries) rather than a record of what it was served.
        await reply.release()
        conclude()
        await _record_then_end(state, record, started, None if cache is None else cache.status,
                               response, b"".join(ending))
    except GuardrailBlocked as exc:
        # An output policy matched mid-stream: the client gets one error event, never the text.
        record.outcome, record.error_type = "blocked", exc.error_code
        try:
            await response.write(relay.error_event(exc))
        except ConnectionError:
            pass
    except (ProviderError, StreamCut, StreamBroken) as exc:
        record.outcome = "cut"
        # "_StreamCut": the ledger's value for a stream that broke, since before the pipeline.
        record.error_type = "_StreamCut" if isinstance(exc, StreamCut | StreamBroken) else type(exc).__name__
        error = UpstreamTimeout("upstream went silent mid-stream") if isinstance(
            exc, UpstreamTimeoutError
        ) else UpstreamUnavailable(f"upstream stream failed: {exc}")
        if not relay.told:
            try:
                await response.write(relay.error_event(error))
            except ConnectionError:
                pass
    except ConnectionError:
        record.outcome = "cancelled"  # the client went away mid-write
    except asyncio.CancelledError as exc:
        if not is_shutdown(exc) or not response.prepared:
            raise  # a client gone, or nothing sent yet (the admission gate answers 503)
        # The shutdown's grace period is over: the client is still there, tell it why
        # the stream ends (one error event, no end marker) rather than dropping the socket.
        asyncio.current_task().uncancel()  # type: ignore[union-attr]
        record.outcome = "cut"
        record.error_type = "shutdown"
        try:
            await response.write(relay.error_event(ShuttingDown("gateway shutting down: stream cut")))
        except ConnectionError:
            pass
    finally:
        await reply.release()
        conclude()
    return response


def _sent_body(parsed: Parsed, reply: UpstreamReply) -> dict[str, Any]:
    """The request body the deployment that answered got (for request logs): the native
    one when it spoke the client's protocol, else the chat shape."""
    if parsed.native is not None and reply.wire != "chat":
        return parsed.native.body
    return parsed.body


async def _screen_input(guard: GuardrailEngine, parsed: Parsed) -> tuple[Parsed, list[Decision]]:
    """The request after the input policies: the chat body, and the native one if any
    (a native deployment gets what the client sent, so it is screened too)."""
    body, decisions = await guard.screen_input(parsed.body)
    native = parsed.native
    if native is not None and guard.input_policies:
        native_body, native_decisions = await guard.screen_input(native.body)
        if native_body is not native.body:
            native = dataclasses.replace(native, body=native_body)
        decisions += [d for d in native_decisions if d not in decisions]
    if body is parsed.body and native is parsed.native:
        return parsed, decisions
    return dataclasses.replace(parsed, body=body, native=native), decisions


async def _screen_answer(guard: GuardrailEngine, reply: UpstreamReply, record: CallRecord) -> UpstreamReply:
    """A whole answer after the output policies (chat or native shape); a block raises."""
    answer = reply.answer
    if answer is None:
        try:
            answer = orjson.loads(reply.body)
        except orjson.JSONDecodeError:
            return reply
        if not isinstance(answer, dict):
            return reply
    try:
        screened, decisions = await guard.screen_answer(answer)
    except GuardrailBlocked as exc:
        record.guardrails += ((exc.policy, "blocked", "output"),)
        record.outcome = "blocked"
        raise
    record.guardrails += tuple((d.policy, d.action, d.direction) for d in decisions)
    if screened is answer:
        return reply
    return dataclasses.replace(reply, body=orjson.dumps(screened), answer=screened)


def _answer_text(choices: list[Any]) -> str | None:
    """The first choice's message text of a whole answer (for content capture only)."""
    first = choices[0] if choices else None
    message = first.get("message") if isinstance(first, dict) else None
    content = message.get("content") if isinstance(message, dict) else None
    return content if isinstance(content, str) else None
