"""``/v1/responses``: OpenAI's Responses API, an adapter of the shared pipeline, and its
stored conversations.

``POST /v1/responses`` has every guarantee of chat completions (keys, limits, budgets,
routing, breakers, retries and failover before the first byte, cancellation, the ledger
with ``protocol`` = ``responses``, metrics, spans, errors in OpenAI's shape). The
request is translated to chat (:mod:`gateway.protocols.responses`) for every deployment
and the answer comes back as a ``response`` object, a stream as the typed events of
:mod:`gateway.protocols.responses_stream`.

With ``store`` true (the default) the answer is stored per subject
(:mod:`gateway.edge.response_store`) once it is complete, behind the answer. A call
with ``previous_response_id`` is sent upstream with the earlier input, the earlier
output and the new input, in order; an id unknown to the caller's subject is 400
``previous_response_not_found``. ``GET`` and ``DELETE /v1/responses/{id}`` and
``GET /v1/responses/{id}/input_items`` read the store; another subject's id is 404.

The response cache serves this route under chat's rules (docs/cache.md): its key is the
chat request sent upstream, so a follow-up is keyed on its whole rebuilt conversation
(the stored history included), never on the ``previous_response_id`` itself. A hit is
rendered as a new response (a fresh id and ``created_at``) and, with ``store`` true,
stored like a live answer, so it can be retrieved and continued from.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import orjson
from aiohttp import web

from gateway.core.errors import GatewayError, InvalidRequest, NotFound, UpstreamUnavailable
from gateway.core.usage import CallRecord, StreamTap, Usage
from gateway.edge import telemetry
from gateway.edge.dispatch import NativeCall
from gateway.edge.pipeline import Inbound, Parsed, serve
from gateway.edge.ratelimit import admit
from gateway.edge.relays import StreamRelay, TapRelay, settle_native
from gateway.edge.response_store import ResponseStore, StoredResponse
from gateway.http.bodies import bearer_token
from gateway.http.state import STATE, GatewayState
from gateway.protocols.responses import input_items, new_id, to_chat_request, to_response
from gateway.protocols.responses_stream import EventsFromChunks, NativeEventsTap, failed_event
from gateway.providers.base import UpstreamReply

if TYPE_CHECKING:
    from actors.auth import VerifiedKey

__all__ = ["RESPONSES", "RESPONSE_STORE", "OpenAIResponses", "install"]

RESPONSE_STORE = web.AppKey("response_store", ResponseStore)
_JSON = {"Content-Type": "application/json"}
#: Stored items that are the model's own output, fed back as the next turn's input.
_REPLAYED_OUTPUT = frozenset({"message", "function_call"})
#: Item fields that are the gateway's (or an earlier deployment's) bookkeeping, not input.
_NOT_INPUT = ("id", "status")


@dataclass(slots=True)
class _Call:
    """One Responses call: what its answer echoes and what is stored of it."""

    body: dict[str, Any]
    response_id: str
    #: The whole input the response answers, earlier turns first (as stored and listed).
    conversation: list[dict[str, Any]]
    store: bool
    #: When the gateway made this response (a cache hit is a new response too).
    created_at: int = field(default_factory=lambda: int(time.time()))
    subject_id: uuid.UUID | None = None
    api_key_id: uuid.UUID | None = None
    saver: ResponseStore | None = field(default=None, repr=False)

    def keep(self, response: dict[str, Any]) -> None:
        """Settle a finished ``response``: the client's ``store`` and ``previous_response_id``
        in it (a native deployment was sent neither), then stored behind the answer if asked.
        A failed or cut response is neither."""
        if response.get("status") not in ("completed", "incomplete") or not isinstance(response.get("id"), str):
            return
        response["store"] = self.store
        response["previous_response_id"] = self.body.get("previous_response_id")
        if self.store and self.saver is not None and self.subject_id is not None and self.api_key_id is not None:
            self.saver.save(self.subject_id, self.api_key_id, response, self.conversation)


@dataclass(frozen=True, slots=True)
class _ResponsesParsed(Parsed):
    call: _Call | None = None


def _call_of(parsed: Parsed) -> _Call:
    assert isinstance(parsed, _ResponsesParsed) and parsed.call is not None
    return parsed.call


def _native(call: _Call, chat_error: GatewayError | None) -> NativeCall:
    """The request a deployment serving ``/responses`` gets: the client's, holding no state
    upstream (the gateway stores it), the whole conversation after a previous response."""
    body = {k: v for k, v in call.body.items() if k != "previous_response_id"}
    body["store"] = False
    if call.body.get("previous_response_id") is not None:
        body["input"] = [{k: v for k, v in item.items() if k not in _NOT_INPUT} for item in call.conversation]
    return NativeCall(body=body, protocol="responses", chat_error=chat_error)


def _usage_of(response: dict[str, Any] | None) -> Usage | None:
    usage = response.get("usage") if isinstance(response, dict) else None
    if not isinstance(usage, dict):
        return None
    return Usage(prompt_tokens=int(usage.get("input_tokens") or 0), completion_tokens=int(usage.get("output_tokens") or 0))


def _replayed(stored: StoredResponse) -> list[dict[str, Any]]:
    output = stored.response.get("output")
    return [item for item in output if isinstance(item, dict) and item.get("type") in _REPLAYED_OUTPUT] if isinstance(
        output, list) else []


class _ResponsesRelay(TapRelay):
    """A chat deployment's chunks, re-framed as the Responses API's typed events."""

    def __init__(self, tap: StreamTap, framer: EventsFromChunks, call: _Call, prompt_estimate: int) -> None:
        super().__init__(tap)
        self.framer = framer
        self.call = call
        self.prompt_estimate = prompt_estimate

    def chunk(self, event: bytes, data: bytes) -> bytes | None:
        return self.framer.feed(data) or None

    def end(self, event: bytes) -> bytes | None:
        usage = self.tap.final_usage(self.prompt_estimate)
        return self.framer.finish({"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens})

    @property
    def done(self) -> bool:
        return self.framer.finished

    def error_event(self, error: GatewayError) -> bytes:
        return self.framer.failed(error.error_code or error.type, error.message)

    def settle(self, record: CallRecord, started: float, prompt_estimate: int) -> None:
        super().settle(record, started, prompt_estimate)
        if self.framer.finished and self.framer.response is not None:
            self.call.keep(self.framer.response)


class _NativeRelay(StreamRelay):
    """A Responses deployment's events, relayed unchanged and read on the way."""

    unfinished = "upstream closed the stream before response.completed"

    def __init__(self, call: _Call) -> None:
        self.tap = NativeEventsTap(call.response_id)
        self.call = call

    def feed(self, event: bytes) -> bytes | None:
        out = self.tap.inspect(event, time.monotonic())
        if self.tap.error is not None:
            self.told = True  # the deployment's own failure event reaches the client as it is
        return out

    @property
    def done(self) -> bool:
        return self.tap.done

    def error_event(self, error: GatewayError) -> bytes:
        return failed_event(self.call.response_id, self.call.body, self.tap.last_sequence + 1,
                            error.error_code or error.type, error.message)

    def settle(self, record: CallRecord, started: float, prompt_estimate: int) -> None:
        tap, response = self.tap, self.tap.response
        settle_native(record, started, prompt_estimate, first_event_at=tap.first_event_at, events=tap.events,
                      usage=_usage_of(response), error=tap.error)
        record.response_id = tap.upstream_id
        if response is not None:
            record.served_model = response.get("model") or record.served_model
            self.call.keep(response)


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"'{name}' must be a boolean", code=f"invalid_{name}")
    return value


class OpenAIResponses(Inbound):
    """OpenAI's Responses API over chat deployments, with stored conversations."""

    name: ClassVar[str] = "responses"
    cacheable: ClassVar[bool] = True
    prepares: ClassVar[bool] = True

    def parse(self, body: dict[str, Any], request: web.Request) -> Parsed:
        model = body.get("model")
        if not isinstance(model, str) or not model.strip():
            raise InvalidRequest("'model' must be a non-empty string", code="invalid_model")
        stream, store = _bool(body, "stream", False), _bool(body, "store", True)
        previous = body.get("previous_response_id")
        if previous is not None and (not isinstance(previous, str) or not previous):
            raise InvalidRequest("'previous_response_id' must be a string", code="invalid_previous_response_id")
        for name in ("metadata", "text"):
            if body.get(name) is not None and not isinstance(body[name], dict):
                raise InvalidRequest(f"'{name}' must be an object", code=f"invalid_{name}")
        items = input_items(body.get("input"))
        call = _Call(body=body, response_id=new_id("resp"), conversation=items, store=store)
        # Validated here (400 before any state is read); rebuilt in prepare() with history.
        try:
            chat, chat_error = to_chat_request(body, items), None
        except InvalidRequest as exc:
            # Only a deployment serving /responses can take it: dispatch sends it to those alone.
            chat, chat_error = {"model": model, "messages": []}, exc
        return _ResponsesParsed(model=model, stream=stream, body=chat, call=call, native=_native(call, chat_error))

    async def prepare(self, parsed: Parsed, key: VerifiedKey, request: web.Request) -> Parsed:
        call = _call_of(parsed)
        call.subject_id, call.api_key_id = key.subject_id, key.api_key_id
        call.saver = request.app[RESPONSE_STORE]
        previous = call.body.get("previous_response_id")
        if previous is None:
            return parsed
        stored = await call.saver.load(previous, key.subject_id)
        if stored is None:
            raise InvalidRequest(f"Previous response with id '{previous}' not found.",
                                 code="previous_response_not_found")
        call.conversation = [*stored.input_items, *_replayed(stored), *call.conversation]
        chat_error = parsed.native.chat_error if parsed.native is not None else None
        chat = parsed.body if chat_error is not None else to_chat_request(call.body, call.conversation)
        return dataclasses.replace(parsed, body=chat, native=_native(call, chat_error))

    def answer(self, reply: UpstreamReply, answer: dict[str, Any] | None, parsed: Parsed) -> web.Response:
        if not reply.ok:  # the provider's own error: its status and body, as on chat
            return self.unstreamed(reply)
        if answer is None or not isinstance(answer.get("choices"), list):
            raise UpstreamUnavailable("upstream answered something other than a chat completion")
        call = _call_of(parsed)
        response = to_response(answer, call.body, call.response_id, model=parsed.model, created_at=call.created_at)
        call.keep(response)
        return web.Response(status=200, body=orjson.dumps(response), headers=_JSON)

    def native_answer(self, reply: UpstreamReply, record: CallRecord, parsed: Parsed) -> web.Response:
        try:
            response = orjson.loads(reply.body) if reply.ok else None
        except orjson.JSONDecodeError:
            response = None
        if not isinstance(response, dict):
            return web.Response(status=reply.status, body=reply.body, headers=dict(reply.headers))
        usage = _usage_of(response)
        if usage is not None:
            record.usage = usage
        call = _call_of(parsed)
        record.response_id = response.get("id")  # the deployment's, for the ledger
        record.served_model = response.get("model") or record.served_model
        response["id"] = call.response_id  # the client sees (and continues from) the gateway's
        call.keep(response)  # the client's store and previous_response_id, not ours upstream
        return web.Response(status=reply.status, body=orjson.dumps(response), headers=_JSON)

    def unstreamed(self, reply: UpstreamReply) -> web.Response:
        if reply.wire != "chat":
            return web.Response(status=reply.status, body=reply.body, headers=dict(reply.headers))
        if reply.ok:
            raise UpstreamUnavailable("upstream answered a whole body to a stream request")
        return web.Response(status=reply.status, body=reply.body,
                            headers={"Content-Type": reply.headers.get("Content-Type", "application/json")})

    def relay(self, reply: UpstreamReply, parsed: Parsed, keep_text: bool, prompt_estimate: int) -> StreamRelay:
        call = _call_of(parsed)
        if reply.wire != "chat":
            return _NativeRelay(call)
        framer = EventsFromChunks(call.response_id, call.body, model=parsed.model, created_at=call.created_at)
        return _ResponsesRelay(StreamTap(client_wants_usage=True, keep_text=keep_text), framer, call,
                               prompt_estimate)


RESPONSES = OpenAIResponses()


async def create(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses``."""
    return await serve(request, RESPONSES)


async def _caller(request: web.Request) -> tuple[GatewayState, VerifiedKey, ResponseStore]:
    state = request.app[STATE]
    key = await state.auth.authenticate(bearer_token(request))
    telemetry.key_known(request, key.api_key_id)
    await admit(request, key, state.limiter)
    return state, key, request.app[RESPONSE_STORE]


def _not_found(response_id: str) -> NotFound:
    return NotFound(f"Response with id '{response_id}' not found.", code="response_not_found")


async def retrieve(request: web.Request) -> web.Response:
    """``GET /v1/responses/{id}``: the caller's subject's stored response."""
    _, key, store = await _caller(request)
    response_id = request.match_info["response_id"]
    stored = await store.load(response_id, key.subject_id)
    if stored is None:
        raise _not_found(response_id)
    return web.Response(body=orjson.dumps(stored.response), headers=_JSON)


async def delete(request: web.Request) -> web.Response:
    """``DELETE /v1/responses/{id}``."""
    _, key, store = await _caller(request)
    response_id = request.match_info["response_id"]
    if not await store.delete(response_id, key.subject_id):
        raise _not_found(response_id)
    return web.Response(body=orjson.dumps({"id": response_id, "object": "response", "deleted": True}),
                        headers=_JSON)


def _limit(raw: str | None) -> int:
    if raw is None:
        return 20
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise InvalidRequest("'limit' must be an integer from 1 to 100", code="invalid_limit")
    return limit


async def list_input_items(request: web.Request) -> web.Response:
    """``GET /v1/responses/{id}/input_items``: ``order`` (desc by default), ``after``, ``limit``."""
    _, key, store = await _caller(request)
    response_id = request.match_info["response_id"]
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("'order' must be asc or desc", code="invalid_order")
    limit = _limit(request.query.get("limit"))
    stored = await store.load(response_id, key.subject_id)
    if stored is None:
        raise _not_found(response_id)
    items = stored.input_items if order == "asc" else stored.input_items[::-1]
    after = request.query.get("after")
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise InvalidRequest(f"'after': no item {after!r} in this response's input", code="invalid_after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    body = {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}
    return web.Response(body=orjson.dumps(body), headers=_JSON)


def install(app: web.Application, state: GatewayState) -> None:
    """The Responses routes and their store, on the data plane ``app``."""

    store = ResponseStore(state.pool, retention_days=state.settings.responses_retention_days)
    app[RESPONSE_STORE] = store

    async def store_ctx(app: web.Application) -> AsyncIterator[None]:
        yield
        await store.close()  # the stores still being written, before the pool closes

    app.cleanup_ctx.append(store_ctx)
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{response_id}", retrieve)
    app.router.add_delete("/v1/responses/{response_id}", delete)
    app.router.add_get("/v1/responses/{response_id}/input_items", list_input_items)
