"""A standalone fake LLM upstream over real HTTP (OpenAI and Anthropic wires).

Tests and the benchmark run it on 127.0.0.1 in place of a real provider::

    python -m gateway.testing.fake_provider --host 127.0.0.1 --port 9100 \
        [--latency-ms N] [--chunks N] [--chunk-delay-ms N] [--cost] \
        [--require-key KEY] [--compress accepted|always] [--uvloop]

Routes: ``POST /v1/chat/completions``, ``POST /v1/embeddings``, ``POST /v1/responses`` (OpenAI's
Responses API, :mod:`gateway.testing.fake_responses`), ``POST /v1/messages``,
``POST /v1/messages/count_tokens`` and ``GET /v1/models`` and ``/v1/echo`` (any method: what arrived, for pass-through tests). Offered ``tools``, both
wires answer with a tool call (until the last turn is the tool's result).  Failures are scripted through ``POST /_fake/script``
(``{"steps": [step, ...]}``, a FIFO popped by each chat or messages request;
``DELETE`` clears it); ``GET /_fake/stats`` reports what was received and
``POST /_fake/reset`` zeroes stats and script; ``POST /_fake/models`` sets the status
(and delay) of ``GET /v1/models``, for health probes.  A step may hold ``status``
(with ``retry_after``), ``delay_ms``, ``hang``, ``cut_after_chunks``, ``garbage``
(``"json"``, ``"content_type"`` or ``"huge_line"``, whose size ``line_bytes`` sets),
``chunks``, ``chunk_delay_ms`` and ``headers`` (added to a whole or a status answer,
e.g. ``x-ratelimit-remaining-requests``).  ``{"route": "models", "steps": [...]}`` fills a
second FIFO, popped only by ``GET /v1/models`` (which honours ``delay_ms``, ``hang`` and
``status``), so a model list can hang while chat calls go on; ``POST /_fake/models``
sets how the model list answers from then on.  Requests to ``/_fake/*`` are not counted
in the stats.

Why one module of ~600 lines: one fake upstream process with its scripting API; tests and
bench/ start it as ``python -m gateway.testing.fake_provider``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import signal
import sys
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import orjson
from aiohttp import web
from multidict import CIMultiDictProxy

from gateway.testing.fake_llm import (
    DONE_EVENT,
    anthropic_error,
    anthropic_input_tokens,
    anthropic_message,
    anthropic_stream_events,
    completion,
    embeddings,
    encode_anthropic_event,
    encode_event,
    models_list,
    openai_error,
    openai_tool_call,
    openai_tool_chunks,
    openai_tool_completion,
    stream_chunks,
)
from gateway.testing.fake_responses import responses_answer, responses_events

__all__ = ["STATE_KEY", "FakeConfig", "FakeState", "main", "make_app"]


_GARBAGE_KINDS: Final[frozenset[str]] = frozenset({"json", "content_type", "huge_line"})
_HUGE_LINE_BYTES: Final[int] = 4 * 1024 * 1024
_STEP_KEYS: Final[frozenset[str]] = frozenset(
    {
        "status",
        "retry_after",
        "delay_ms",
        "hang",
        "cut_after_chunks",
        "garbage",
        "chunks",
        "chunk_delay_ms",
        "line_bytes",
        "headers",
    }
)
_MAX_BODY_BYTES: Final[int] = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class FakeConfig:
    """Behaviour of the fake provider when no scripted step says otherwise."""

    latency_ms: int = 0
    """Delay before answering headers, for every chat / messages request."""
    chunks: int | None = None
    """Content pieces per stream (``None``: one per word)."""
    chunk_delay_ms: int = 0
    """Delay between two stream events."""
    cost: bool = False
    """Add a Venice-style ``cost`` object to OpenAI answers and usage chunks."""
    require_key: str | None = None
    """When set, the key clients must send (``Authorization: Bearer`` / ``x-api-key``)."""
    compress: str | None = None
    """Compress chat, messages and embeddings answers (whole and streamed) with gzip:
    ``"accepted"`` when the request's ``Accept-Encoding`` allows it (as most providers
    do), ``"always"`` even when it asked for identity (a misbehaving proxy)."""


@dataclass(slots=True)
class FakeState:
    """Everything the fake provider remembers: config, script and statistics."""

    config: FakeConfig
    script: deque[dict[str, Any]] = field(default_factory=deque)
    #: Steps for ``GET /v1/models`` only (``"route": "models"`` when scripting).
    models_script: deque[dict[str, Any]] = field(default_factory=deque)
    ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    requests: int = 0
    by_path: dict[str, int] = field(default_factory=dict)
    streams_started: int = 0
    streams_completed: int = 0
    streams_cancelled: int = 0
    streams_cut: int = 0
    requests_cancelled: int = 0
    last_path: str | None = None
    last_headers: CIMultiDictProxy[str] | None = None
    last_body: bytes = b""
    #: Set by ``POST /_fake/models``: the status ``GET /v1/models`` answers (200: the
    #: list) and a delay before it, so a health probe can be failed and healed.
    models_status: int = 200
    models_delay_ms: int = 0

    def reset(self) -> None:
        """Zero the statistics and clear the script (the id counter keeps going)."""
        self.script.clear()
        self.models_script.clear()
        self.requests = 0
        self.by_path = {}
        self.streams_started = 0
        self.streams_completed = 0
        self.streams_cancelled = 0
        self.streams_cut = 0
        self.requests_cancelled = 0
        self.last_path = None
        self.last_headers = None
        self.last_body = b""
        self.models_status = 200
        self.models_delay_ms = 0

    async def record(self, request: web.Request) -> bytes:
        """Count ``request``, remember it as the last one and return its body."""
        raw = await request.read()
        path = request.path
        self.requests += 1
        self.by_path[path] = self.by_path.get(path, 0) + 1
        self.last_path = path
        self.last_headers = request.headers
        self.last_body = raw
        return raw

    def next_step(self) -> dict[str, Any]:
        """Pop the next scripted step, or return an empty step."""
        return self.script.popleft() if self.script else {}

    def stats(self) -> dict[str, Any]:
        """Return the statistics as a JSON-ready object."""
        last: dict[str, Any] | None = None
        if self.last_path is not None:
            headers = self.last_headers.items() if self.last_headers is not None else ()
            last = {
                "path": self.last_path,
                "headers": {k.lower(): v for k, v in headers},
                "body": _loads(self.last_body),
            }
        return {
            "requests": self.requests,
            "by_path": dict(self.by_path),
            "streams_started": self.streams_started,
            "streams_completed": self.streams_completed,
            "streams_cancelled": self.streams_cancelled,
            "streams_cut": self.streams_cut,
            "requests_cancelled": self.requests_cancelled,
            "script_pending": len(self.script),
            "models_script_pending": len(self.models_script),
            "last_request": last,
        }


STATE_KEY: Final = web.AppKey("fake_provider_state", FakeState)
"""Where :func:`make_app` stores the app's :class:`FakeState`."""


def _loads(raw: bytes) -> Any:
    """Parse JSON, returning ``None`` for an empty or invalid body."""
    if not raw:
        return None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


def _json(obj: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    """Return a JSON response serialised with orjson."""
    return web.Response(
        body=orjson.dumps(obj), status=status, headers=headers, content_type="application/json"
    )


# --------------------------------------------------------------------------- wires


@dataclass(frozen=True, slots=True)
class _Wire:
    """What differs between the OpenAI and the Anthropic routes."""

    anthropic: bool

    def authorized(self, request: web.Request, key: str | None) -> bool:
        """Tell whether the request carries the required key (if any)."""
        if key is None:
            return True
        if self.anthropic:
            return request.headers.get("x-api-key") == key
        return request.headers.get("Authorization") == f"Bearer {key}"

    def error(self, status: int, message: str, error_type: str, code: str | None) -> web.Response:
        """Return an error response in this wire's shape."""
        body = (
            anthropic_error(message, error_type)
            if self.anthropic
            else openai_error(message, error_type, code)
        )
        return _json(body, status)

    def unauthorized(self) -> web.Response:
        """Return the provider's 401 answer."""
        if self.anthropic:
            return self.error(401, "invalid x-api-key", "authentication_error", None)
        return self.error(401, "Incorrect API key provided.", "invalid_request_error", "invalid_api_key")


_OPENAI: Final = _Wire(anthropic=False)
_ANTHROPIC: Final = _Wire(anthropic=True)


def _number(step: Mapping[str, Any], key: str, default: float) -> float:
    """Return a non-negative number of a step, or ``default`` when absent."""
    value = step.get(key)
    return float(value) if value is not None else default


def _validate_step(step: Any) -> str | None:
    """Return what is wrong with a scripted step, or ``None`` when it is valid."""
    if not isinstance(step, dict):
        return "each step must be an object"
    unknown = set(step) - _STEP_KEYS
    if unknown:
        return f"unknown step keys: {sorted(unknown)}"

    def is_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    def is_number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0

    if "status" in step and not (is_int(step["status"]) and 100 <= step["status"] <= 599):
        return "status must be an HTTP status code"
    if "retry_after" in step and not (is_number(step["retry_after"]) or isinstance(step["retry_after"], str)):
        return "retry_after must be a number of seconds or a string"
    for key in ("delay_ms", "chunk_delay_ms"):
        if key in step and not is_number(step[key]):
            return f"{key} must be a non-negative number"
    if "cut_after_chunks" in step and not (
        is_int(step["cut_after_chunks"]) and step["cut_after_chunks"] >= 0
    ):
        return "cut_after_chunks must be a non-negative integer"
    if "chunks" in step and not (step["chunks"] is None or (is_int(step["chunks"]) and step["chunks"] >= 1)):
        return "chunks must be a positive integer or null"
    if "hang" in step and not isinstance(step["hang"], bool):
        return "hang must be a boolean"
    if "garbage" in step and step["garbage"] not in _GARBAGE_KINDS:
        return f"garbage must be one of {sorted(_GARBAGE_KINDS)}"
    if "line_bytes" in step and not (is_int(step["line_bytes"]) and 1 <= step["line_bytes"] <= _MAX_BODY_BYTES):
        return "line_bytes must be a positive integer (the size of a huge_line)"
    headers = step.get("headers", {})
    if not (isinstance(headers, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items())):
        return "headers must be an object of strings"
    return None


# --------------------------------------------------------------------------- answers
_COMPRESS_MODES: Final[frozenset[str]] = frozenset({"accepted", "always"})


def _compressed(response: web.StreamResponse, config: FakeConfig) -> web.StreamResponse:
    """``response`` with gzip turned on as ``config.compress`` says (before it is prepared)."""
    if config.compress == "always":
        response.enable_compression(web.ContentCoding.gzip)
    elif config.compress == "accepted":
        response.enable_compression()  # aiohttp picks gzip/deflate from Accept-Encoding, or none
    return response



def _status_response(wire: _Wire, step: Mapping[str, Any]) -> web.Response:
    """Answer a scripted failure status (with ``Retry-After`` when asked)."""
    headers: dict[str, str] = dict(step.get("headers") or {})
    retry_after = step.get("retry_after")
    if retry_after is not None:
        if isinstance(retry_after, float) and retry_after.is_integer():
            retry_after = int(retry_after)
        headers["Retry-After"] = str(retry_after)
    if wire.anthropic:
        body: dict[str, Any] = anthropic_error("fake failure", "fake")
    else:
        body = {"error": {"message": "fake failure", "type": "fake", "code": None}}
    return _json(body, int(step["status"]), headers)


def _garbage_response(
    wire: _Wire, kind: str, body: Mapping[str, Any], stream: bool, state: FakeState, line_bytes: int | None = None
) -> web.Response:
    """Answer a scripted garbage response of the given kind with status 200."""
    if kind == "content_type":
        return web.Response(
            text="<html><body><h1>fake provider page</h1></body></html>",
            content_type="text/html",
        )
    if kind == "json":
        if not stream:
            return web.Response(
                body=b'{"id": "chatcmpl-fake", "choices": [{', content_type="application/json"
            )
        prefix = b"event: content_block_delta\n" if wire.anthropic else b""
        tail = b"" if wire.anthropic else DONE_EVENT
        return web.Response(
            body=prefix + b'data: {"choices": [{"delta":\n\n' + tail,
            content_type="text/event-stream",
        )
    # huge_line: one ~4 MB line (or ``line_bytes``), a valid chunk / message with a huge text.
    huge = "x" * int(line_bytes or _HUGE_LINE_BYTES)
    response_id = f"chatcmpl-fake-{next(state.ids)}"
    if wire.anthropic:
        delta = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": huge}}
        if stream:
            return web.Response(body=encode_anthropic_event(delta), content_type="text/event-stream")
        message = anthropic_message(body, message_id=f"msg_fake_{response_id}")
        message["content"] = [{"type": "text", "text": huge}]
        return _json(message)
    if stream:
        chunk = {
            "id": response_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": body.get("model", "mock"),
            "choices": [{"index": 0, "delta": {"content": huge}, "finish_reason": None}],
        }
        return web.Response(body=encode_event(chunk) + DONE_EVENT, content_type="text/event-stream")
    answer = completion(body, response_id=response_id, created=int(time.time()))
    answer["choices"][0]["message"]["content"] = huge
    return _json(answer)


async def _stream(
    request: web.Request,
    state: FakeState,
    events: list[bytes],
    tail: bytes,
    chunk_delay: float,
    cut_after: int | None,
) -> web.StreamResponse:
    """Write ``events`` one by one (``chunk_delay`` apart), then ``tail``.

    With ``cut_after`` only that many events are written, then the connection is
    closed abruptly (no terminating chunk, no ``tail``).  A client going away is
    counted in ``streams_cancelled``.
    """
    response = web.StreamResponse(headers={"Cache-Control": "no-cache"})
    response.content_type = "text/event-stream"
    _compressed(response, state.config)
    state.streams_started += 1
    try:
        await response.prepare(request)
        limit = len(events) if cut_after is None else min(cut_after, len(events))
        for index in range(limit):
            if index and chunk_delay:
                await asyncio.sleep(chunk_delay)
            await response.write(events[index])
        if cut_after is not None:
            state.streams_cut += 1
            response.force_close()
            transport = request.transport
            if transport is not None:
                transport.close()
            return response
        if tail:
            await response.write(tail)
        await response.write_eof()
    except asyncio.CancelledError:
        state.streams_cancelled += 1
        raise
    except ConnectionError:
        state.streams_cancelled += 1
        return response
    state.streams_completed += 1
    return response


async def _answer(request: web.Request, wire: _Wire) -> web.StreamResponse:
    """Serve a chat completion or an Anthropic message, honouring the script."""
    state = request.app[STATE_KEY]
    config = state.config
    raw = await state.record(request)
    if not wire.authorized(request, config.require_key):
        return wire.unauthorized()
    body = _loads(raw)
    if not isinstance(body, dict):
        return wire.error(400, "request body must be a JSON object", "invalid_request_error", "invalid_json")
    step = state.next_step()
    delay = (config.latency_ms + _number(step, "delay_ms", 0)) / 1000
    try:
        if delay:
            await asyncio.sleep(delay)
        if step.get("hang"):
            await asyncio.Event().wait()
    except asyncio.CancelledError:
        state.requests_cancelled += 1
        raise
    if "status" in step:
        return _status_response(wire, step)
    stream = body.get("stream") is True
    garbage = step.get("garbage")
    if garbage is not None:
        return _garbage_response(wire, str(garbage), body, stream, state, step.get("line_bytes"))
    n = next(state.ids)
    chunks = step.get("chunks", config.chunks)
    call = None if wire.anthropic else openai_tool_call(body, call_id=f"call_fake_{n}")
    if not stream:
        if call is not None:
            return _json(openai_tool_completion(body, call, response_id=f"chatcmpl-fake-{n}", created=int(time.time())))
        if wire.anthropic:
            return _compressed(_json(anthropic_message(body, message_id=f"msg_fake_{n}")), config)
        return _compressed(_json(
            completion(body, response_id=f"chatcmpl-fake-{n}", created=int(time.time()), cost=config.cost),
            headers=step.get("headers"),
        ), config)
    if wire.anthropic:
        events = anthropic_stream_events(body, message_id=f"msg_fake_{n}", n_chunks=chunks)
        tail = b""
    elif call is not None:
        events = [encode_event(chunk) for chunk in openai_tool_chunks(
            body, call, response_id=f"chatcmpl-fake-{n}", created=int(time.time()))]
        tail = DONE_EVENT
    else:
        events = [
            encode_event(chunk)
            for chunk in stream_chunks(
                body,
                response_id=f"chatcmpl-fake-{n}",
                created=int(time.time()),
                n_chunks=chunks,
                cost=config.cost,
            )
        ]
        tail = DONE_EVENT
    chunk_delay = _number(step, "chunk_delay_ms", config.chunk_delay_ms) / 1000
    cut_after = step.get("cut_after_chunks")
    return await _stream(request, state, events, tail, chunk_delay, cut_after)


# --------------------------------------------------------------------------- handlers


async def _responses(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses`` (OpenAI's Responses API, served natively); of a step it
    honours ``status``, ``delay_ms``, ``chunk_delay_ms`` and ``cut_after_chunks``."""
    state = request.app[STATE_KEY]
    body = _loads(await state.record(request))
    if not isinstance(body, dict):
        return _OPENAI.error(400, "request body must be a JSON object", "invalid_request_error", "invalid_json")
    step = state.next_step()
    delay = (state.config.latency_ms + _number(step, "delay_ms", 0)) / 1000
    if delay:
        await asyncio.sleep(delay)
    if "status" in step:
        return _status_response(_OPENAI, step)
    response_id = f"resp_fake_{next(state.ids)}"
    if body.get("stream") is not True:
        return _json(responses_answer(body, response_id=response_id))
    chunk_delay = _number(step, "chunk_delay_ms", state.config.chunk_delay_ms) / 1000
    return await _stream(request, state, responses_events(body, response_id=response_id), b"", chunk_delay,
                         step.get("cut_after_chunks"))


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions`` (OpenAI wire)."""
    return await _answer(request, _OPENAI)


async def _messages(request: web.Request) -> web.StreamResponse:
    """``POST /v1/messages`` (Anthropic wire)."""
    return await _answer(request, _ANTHROPIC)


async def _count_tokens(request: web.Request) -> web.StreamResponse:
    """``POST /v1/messages/count_tokens`` (Anthropic wire): the fake's own input count.

    Pops the script; of a step it honours ``status`` (with ``retry_after``)."""
    state = request.app[STATE_KEY]
    raw = await state.record(request)
    if not _ANTHROPIC.authorized(request, state.config.require_key):
        return _ANTHROPIC.unauthorized()
    body = _loads(raw)
    if not isinstance(body, dict):
        return _ANTHROPIC.error(400, "request body must be a JSON object", "invalid_request_error", None)
    step = state.next_step()
    if "status" in step:
        return _status_response(_ANTHROPIC, step)
    return _json({"input_tokens": anthropic_input_tokens(body)})


async def _embeddings(request: web.Request) -> web.StreamResponse:
    """``POST /v1/embeddings``: deterministic small vectors.

    Pops the script like a chat request; of a step it honours ``delay_ms``, ``hang`` and
    ``status`` (with ``retry_after``), so embeddings failover can be tested too.
    """
    state = request.app[STATE_KEY]
    raw = await state.record(request)
    if not _OPENAI.authorized(request, state.config.require_key):
        return _OPENAI.unauthorized()
    body = _loads(raw)
    if not isinstance(body, dict):
        return _OPENAI.error(
            400, "request body must be a JSON object", "invalid_request_error", "invalid_json"
        )
    step = state.next_step()
    try:
        if step.get("delay_ms"):
            await asyncio.sleep(_number(step, "delay_ms", 0) / 1000)
        if step.get("hang"):
            await asyncio.Event().wait()
    except asyncio.CancelledError:
        state.requests_cancelled += 1
        raise
    if "status" in step:
        return _status_response(_OPENAI, step)
    return _compressed(_json(embeddings(body)), state.config)


async def _models(request: web.Request) -> web.StreamResponse:
    """``GET /v1/models``; pops the models script (``delay_ms``, ``hang``, ``status``)."""
    state = request.app[STATE_KEY]
    await state.record(request)
    if not _OPENAI.authorized(request, state.config.require_key):
        return _OPENAI.unauthorized()
    step = state.models_script.popleft() if state.models_script else {}
    try:
        if step.get("delay_ms"):
            await asyncio.sleep(_number(step, "delay_ms", 0) / 1000)
        elif state.models_delay_ms:
            await asyncio.sleep(state.models_delay_ms / 1000)
        if step.get("hang"):
            await asyncio.Event().wait()
    except asyncio.CancelledError:
        state.requests_cancelled += 1
        raise
    if "status" in step:
        return _status_response(_OPENAI, step)
    if state.models_status != 200:
        return _OPENAI.error(state.models_status, "model list unavailable (scripted)", "server_error", None)
    return _json(models_list(created=1_700_000_000))


async def _echo(request: web.Request) -> web.StreamResponse:
    """``/v1/echo`` (any method): what arrived, for pass-through tests; no usage object."""
    state = request.app[STATE_KEY]
    raw = await state.record(request)
    return _json({"method": request.method, "query": dict(request.query), "body_bytes": len(raw)})


async def _models_behaviour(request: web.Request) -> web.StreamResponse:
    """``POST /_fake/models`` ``{"status": 503, "delay_ms": 0}``: how the model list answers
    from now on (``{"status": 200}`` heals it)."""
    state = request.app[STATE_KEY]
    body = _loads(await request.read())
    if not isinstance(body, dict):
        return _json({"error": "expected a JSON object"}, 400)
    status, delay = body.get("status", 200), body.get("delay_ms", 0)
    if not (isinstance(status, int) and 100 <= status <= 599) or not (isinstance(delay, int) and delay >= 0):
        return _json({"error": "status must be an HTTP status, delay_ms a non-negative integer"}, 400)
    state.models_status, state.models_delay_ms = status, delay
    return _json({"status": status, "delay_ms": delay})


async def _script_add(request: web.Request) -> web.StreamResponse:
    """``POST /_fake/script``: append ``{"steps": [...]}`` to the script (with
    ``"route": "models"``, to the script of ``GET /v1/models``)."""
    state = request.app[STATE_KEY]
    body = _loads(await request.read())
    steps = body.get("steps") if isinstance(body, dict) else None
    if not isinstance(steps, list):
        return _OPENAI.error(400, 'body must be {"steps": [step, ...]}', "invalid_request_error", None)
    route = body.get("route", "chat")
    if route not in ("chat", "models"):
        return _OPENAI.error(400, 'route must be "chat" (the default) or "models"', "invalid_request_error", None)
    for step in steps:
        problem = _validate_step(step)
        if problem is not None:
            return _OPENAI.error(400, problem, "invalid_request_error", None)
    queue = state.models_script if route == "models" else state.script
    queue.extend(steps)
    return _json({"pending": len(queue)})


async def _script_clear(request: web.Request) -> web.StreamResponse:
    """``DELETE /_fake/script``: drop every pending step (both scripts)."""
    state = request.app[STATE_KEY]
    state.script.clear()
    state.models_script.clear()
    return _json({"pending": 0})


async def _stats(request: web.Request) -> web.StreamResponse:
    """``GET /_fake/stats``."""
    return _json(request.app[STATE_KEY].stats())


async def _reset(request: web.Request) -> web.StreamResponse:
    """``POST /_fake/reset``: zero the statistics and clear the script."""
    request.app[STATE_KEY].reset()
    return _json({"reset": True})


def make_app(config: FakeConfig | None = None) -> web.Application:
    """Build the fake provider's aiohttp application.

    Run it with ``handler_cancellation=True`` on the runner so that a client
    going away cancels its handler (the test server does this already).
    """
    app = web.Application(client_max_size=_MAX_BODY_BYTES)
    app[STATE_KEY] = FakeState(config or FakeConfig())
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_post("/v1/embeddings", _embeddings)
    app.router.add_post("/v1/responses", _responses)
    app.router.add_post("/v1/messages", _messages)
    app.router.add_post("/v1/messages/count_tokens", _count_tokens)
    app.router.add_get("/v1/models", _models)
    app.router.add_route("*", "/v1/echo", _echo)
    app.router.add_post("/_fake/script", _script_add)
    app.router.add_delete("/_fake/script", _script_clear)
    app.router.add_get("/_fake/stats", _stats)
    app.router.add_post("/_fake/reset", _reset)
    app.router.add_post("/_fake/models", _models_behaviour)
    return app


# --------------------------------------------------------------------------- main


def _non_negative_int(text: str) -> int:
    """Parse a non-negative integer command-line value."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_int(text: str) -> int:
    """Parse a positive integer command-line value."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    """Return the command-line parser."""
    parser = argparse.ArgumentParser(
        prog="python -m gateway.testing.fake_provider", description="Fake OpenAI/Anthropic upstream."
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=_non_negative_int, default=9100, help="0 picks a free port")
    parser.add_argument("--latency-ms", type=_non_negative_int, default=0)
    parser.add_argument("--chunks", type=_positive_int, default=None)
    parser.add_argument("--chunk-delay-ms", type=_non_negative_int, default=0)
    parser.add_argument("--cost", action="store_true", help="add Venice-style cost objects")
    parser.add_argument("--require-key", default=None, metavar="KEY")
    parser.add_argument("--compress", choices=sorted(_COMPRESS_MODES), default=None,
                        help="gzip answers: when Accept-Encoding allows it, or always")
    parser.add_argument("--uvloop", action="store_true", help="use uvloop when installed")
    return parser


async def _serve(host: str, port: int, config: FakeConfig) -> None:
    """Serve the fake provider until SIGINT or SIGTERM."""
    runner = web.AppRunner(make_app(config), handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, backlog=2048, reuse_address=True)
        await site.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(signum, stop.set)
        bound_port = runner.addresses[0][1] if runner.addresses else port
        print(f"fake provider listening on http://{host}:{bound_port}", flush=True)
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the fake provider from the command line; return the exit status."""
    args = _parser().parse_args(argv)
    config = FakeConfig(
        latency_ms=args.latency_ms,
        chunks=args.chunks,
        chunk_delay_ms=args.chunk_delay_ms,
        cost=args.cost,
        require_key=args.require_key,
        compress=args.compress,
    )
    coro = _serve(args.host, args.port, config)
    try:
        if args.uvloop:
            try:
                import uvloop
            except ImportError:
                asyncio.run(coro)
            else:
                uvloop.run(coro)
        else:
            asyncio.run(coro)
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        print(f"fake provider: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
