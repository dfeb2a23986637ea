"""Anthropic's Messages API behind the OpenAI chat-completions shape, both ways.

Requests (OpenAI → Messages): system and developer messages become ``system``; user
content parts become text and image blocks (data URLs as base64 sources, other URLs as
URL sources); assistant ``tool_calls`` become ``tool_use`` blocks with their arguments
parsed, intact; ``tool`` messages become ``tool_result`` blocks in a user turn;
consecutive turns of one role are merged, as the Messages API wants them alternating.
``max_tokens`` (or ``max_completion_tokens``) defaults to :data:`DEFAULT_MAX_TOKENS`
because Anthropic requires it; ``stop`` becomes ``stop_sequences``; ``temperature``,
``top_p``, ``tools``, ``tool_choice``, ``parallel_tool_calls`` and ``user`` are mapped;
other OpenAI-only fields are dropped (Anthropic refuses unknown fields). What cannot be
expressed (``n`` > 1, audio or file parts, malformed tool arguments) is a 400 of ours.

Answers (Messages → OpenAI): a whole ``message`` becomes a ``chat.completion`` (text
joined, ``tool_use`` blocks as ``tool_calls`` with JSON arguments); a stream's
``message_start`` / ``content_block_*`` / ``message_delta`` / ``message_stop`` events
become ``chat.completion.chunk`` events (``input_json_delta`` as tool-call argument
pieces), a usage-only chunk when ``stream_options.include_usage`` asks (the relay always
asks, and hides it from clients who did not), then ``[DONE]``. ``input_tokens`` (plus
cache reads and writes) is ``prompt_tokens``, ``output_tokens`` ``completion_tokens``.
Anthropic's error bodies become the OpenAI error shape with the provider's status kept;
an ``error`` event mid-stream ends the stream as a provider failure.

Why one module of ~520 lines: a provider is one module with its translation beside it;
the request mapping, the answer mapping and the stream's event-by-event re-framing change
together whenever Anthropic's wire changes.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson

from gateway.core.config import ProviderConfig
from gateway.core.errors import InvalidRequest
from gateway.protocols.sse import event_data, iter_events
from gateway.providers.base import (
    IDENTITY_ENCODING,
    Provider,
    Timeouts,
    UpstreamProtocolError,
    UpstreamReply,
    client_timeout,
    fetch_model_ids,
    map_transport_errors,
    read_whole,
)

__all__ = [
    "ANTHROPIC_VERSION",
    "DEFAULT_MAX_TOKENS",
    "AnthropicProvider",
    "StreamTranslator",
    "to_chat_completion",
    "to_messages_request",
    "to_openai_error",
]

ANTHROPIC_VERSION = "2023-06-01"
#: Anthropic requires max_tokens; this is used when the client sent none.
DEFAULT_MAX_TOKENS = 4096

_FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "pause_turn": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}
_ERROR_CODES = {
    "rate_limit_error": "rate_limit_exceeded",
    "authentication_error": "invalid_api_key",
    "overloaded_error": "overloaded",
    "not_found_error": "not_found",
}
_JSON_HEADERS = {"Content-Type": "application/json"}
_DONE = b"data: [DONE]\n\n"


class AnthropicProvider(Provider):
    """Speaks the Messages API to ``base_url`` (``/v1/messages``, ``/v1/models``)."""

    system = "anthropic"
    key_header = ("x-api-key", "{}")

    def __init__(
        self, config: ProviderConfig, session: aiohttp.ClientSession, *, request_timeout: float
    ) -> None:
        super().__init__(config, request_timeout=request_timeout)
        self._session = session
        # Accept the documented base (https://api.anthropic.com) and one ending in /v1.
        root = config.base_url[:-3] if config.base_url.endswith("/v1") else config.base_url
        self._messages_url = f"{root}/v1/messages"
        self._models_url = f"{root}/v1/models?limit=1000"
        self._headers: dict[str, str] = {
            "Content-Type": "application/json",
            "anthropic-version": ANTHROPIC_VERSION,
            **IDENTITY_ENCODING,
            **dict(config.headers),
        }
        # x-api-key is added per call by keyed_headers(), so a rotated key file takes effect.
        self._address = urlsplit(config.base_url).hostname

    @property
    def address(self) -> str | None:
        return self._address

    async def list_models(self) -> list[str]:
        return await fetch_model_ids(self._session, self._models_url, self.keyed_headers(self._headers))

    async def chat(
        self,
        body: dict[str, Any],
        *,
        stream: bool,
        headers: Mapping[str, str],
        timeouts: Timeouts | None = None,
    ) -> UpstreamReply:
        payload = orjson.dumps(to_messages_request(body, stream=stream))
        keyed = self.keyed_headers(self._headers)
        send_headers = {**keyed, **headers} if headers else keyed
        with map_transport_errors():
            resp = await self._session.post(
                self._messages_url,
                data=payload,
                headers=send_headers,
                timeout=client_timeout(timeouts or self.timeouts, stream=stream),
                auto_decompress=True,
            )
        try:
            content_type = resp.headers.get("Content-Type", "")
            if stream and resp.status < 300 and content_type.startswith("text/event-stream"):
                translator = StreamTranslator(
                    model=str(body.get("model") or ""), include_usage=_wants_usage(body)
                )
                return UpstreamReply(
                    status=resp.status,
                    headers=_JSON_HEADERS,
                    events=_translated_events(resp, translator),
                    _release=resp.release,
                )
            raw = await read_whole(resp, self.config.max_response_bytes)
        except BaseException:
            resp.close()
            raise
        resp.release()
        reply_headers = dict(_JSON_HEADERS)
        if "retry-after" in resp.headers:
            reply_headers["retry-after"] = resp.headers["retry-after"]
        if resp.status >= 300:
            return UpstreamReply(status=resp.status, headers=reply_headers, body=to_openai_error(resp.status, raw))
        try:
            message = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise UpstreamProtocolError("anthropic answered a body that is not JSON") from None
        if not isinstance(message, dict) or message.get("type") != "message":
            raise UpstreamProtocolError("anthropic answered something other than a message")
        answer = to_chat_completion(message)
        if stream:
            # Asked to stream but answered whole: replay it as a one-chunk stream.
            translator = StreamTranslator(model=str(body.get("model") or ""), include_usage=_wants_usage(body))
            return UpstreamReply(
                status=resp.status, headers=_JSON_HEADERS, events=_replay_whole(message, translator)
            )
        return UpstreamReply(status=resp.status, headers=reply_headers, body=orjson.dumps(answer), answer=answer)


def _wants_usage(body: Mapping[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


async def _translated_events(resp: aiohttp.ClientResponse, translator: StreamTranslator) -> AsyncIterator[bytes]:
    with map_transport_errors():
        async for event in iter_events(resp.content.iter_any()):
            for out in translator.feed(event):
                yield out


async def _replay_whole(message: dict[str, Any], translator: StreamTranslator) -> AsyncIterator[bytes]:
    for out in translator.whole(message):
        yield out


# --------------------------------------------------------------------------- requests
def _bad(message: str, code: str = "invalid_request") -> InvalidRequest:
    return InvalidRequest(f"cannot send to an Anthropic deployment: {message}", code=code)


def _text_of(content: Any, where: str) -> str:
    """Text of a system/tool content: a string or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"{where}: only text parts are supported here")
            texts.append(part["text"])
        return "\n".join(texts)
    raise _bad(f"{where}: content must be a string or a list of parts")


def _image_block(part: Mapping[str, Any], where: str) -> dict[str, Any]:
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, dict) else image
    if not isinstance(url, str) or not url:
        raise _bad(f"{where}: image_url needs a url")
    if url.startswith("data:"):
        header, sep, data = url[5:].partition(",")
        media_type, _, encoding = header.partition(";")
        if not sep or encoding != "base64" or not media_type:
            raise _bad(f"{where}: a data URL image must be base64 (data:image/png;base64,...)")
        return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}
    return {"type": "image", "source": {"type": "url", "url": url}}


def _content_blocks(content: Any, where: str) -> list[dict[str, Any]]:
    """User or assistant content as Messages blocks (empty text is dropped: refused there)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    if not isinstance(content, list):
        raise _bad(f"{where}: content must be a string or a list of parts")
    blocks: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            if part["text"]:
                blocks.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            blocks.append(_image_block(part, f"{where}.content[{i}]"))
        else:
            raise _bad(f"{where}.content[{i}]: part type {kind!r} is not supported")
    return blocks


def _tool_use_blocks(tool_calls: Any, where: str) -> list[dict[str, Any]]:
    if tool_calls is None:
        return []
    if not isinstance(tool_calls, list):
        raise _bad(f"{where}.tool_calls must be a list")
    blocks = []
    for i, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _bad(f"{where}.tool_calls[{i}] needs function.name")
        arguments = function.get("arguments") or "{}"
        try:
            parsed = orjson.loads(arguments) if isinstance(arguments, str) else arguments
        except orjson.JSONDecodeError:
            raise _bad(f"{where}.tool_calls[{i}].function.arguments is not JSON", "invalid_tool_arguments") from None
        if not isinstance(parsed, dict):
            raise _bad(f"{where}.tool_calls[{i}].function.arguments must be a JSON object", "invalid_tool_arguments")
        blocks.append({"type": "tool_use", "id": str(call.get("id") or f"toolu_{i}"), "name": function["name"],
                       "input": parsed})
    return blocks


def _append(messages: list[dict[str, Any]], role: str, blocks: list[dict[str, Any]]) -> None:
    if not blocks:
        return
    if messages and messages[-1]["role"] == role:
        messages[-1]["content"].extend(blocks)
    else:
        messages.append({"role": role, "content": blocks})


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list")
    out = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _bad(f"tools[{i}] must be a function tool with a name")
        entry: dict[str, Any] = {
            "name": function["name"],
            "input_schema": function.get("parameters") or {"type": "object", "properties": {}},
        }
        if isinstance(function.get("description"), str):
            entry["description"] = function["description"]
        out.append(entry)
    return out


def _tool_choice(choice: Any, parallel: Any) -> dict[str, Any] | None:
    mapped: dict[str, Any] | None
    if choice is None:
        mapped = {"type": "auto"} if parallel is False else None
    elif choice == "auto":
        mapped = {"type": "auto"}
    elif choice == "none":
        mapped = {"type": "none"}
    elif choice == "required":
        mapped = {"type": "any"}
    elif isinstance(choice, dict) and isinstance((choice.get("function") or {}).get("name"), str):
        mapped = {"type": "tool", "name": choice["function"]["name"]}
    else:
        raise _bad("'tool_choice' must be auto, none, required or a function")
    if mapped is not None and parallel is False and mapped["type"] != "none":
        mapped["disable_parallel_tool_use"] = True
    return mapped


def to_messages_request(body: Mapping[str, Any], *, stream: bool) -> dict[str, Any]:
    """The Messages API body for an OpenAI chat body; InvalidRequest if not expressible."""
    if body.get("n") not in (None, 1):
        raise _bad("'n' other than 1 is not supported")
    system: list[str] = []
    messages: list[dict[str, Any]] = []
    for i, message in enumerate(body.get("messages") or []):
        role = message.get("role")
        where = f"messages[{i}]"
        if role in ("system", "developer"):
            text = _text_of(message.get("content"), where)
            if text:
                system.append(text)
        elif role == "user":
            _append(messages, "user", _content_blocks(message.get("content"), where))
        elif role == "assistant":
            blocks = _content_blocks(message.get("content"), where)
            blocks += _tool_use_blocks(message.get("tool_calls"), where)
            _append(messages, "assistant", blocks)
        elif role == "tool":
            tool_call_id = message.get("tool_call_id")
            if not isinstance(tool_call_id, str):
                raise _bad(f"{where}: a tool message needs tool_call_id")
            result = {"type": "tool_result", "tool_use_id": tool_call_id,
                      "content": _text_of(message.get("content"), where)}
            _append(messages, "user", [result])
        else:
            raise _bad(f"{where}: role {role!r} is not supported")
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS
    out: dict[str, Any] = {"model": body.get("model"), "messages": messages, "max_tokens": max_tokens}
    if system:
        out["system"] = "\n\n".join(system)
    stop = body.get("stop")
    if isinstance(stop, str):
        out["stop_sequences"] = [stop]
    elif isinstance(stop, list) and stop:
        out["stop_sequences"] = list(stop)
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            out[name] = body[name]
    if body.get("tools"):
        out["tools"] = _tools(body["tools"])
    choice = _tool_choice(body.get("tool_choice"), body.get("parallel_tool_calls"))
    if choice is not None and "tools" in out:
        out["tool_choice"] = choice
    if isinstance(body.get("user"), str):
        out["metadata"] = {"user_id": body["user"]}
    if stream:
        out["stream"] = True
    return out


# --------------------------------------------------------------------------- answers
def _usage(usage: Mapping[str, Any]) -> dict[str, Any]:
    cache_read = int(usage.get("cache_read_input_tokens") or 0)
    prompt = int(usage.get("input_tokens") or 0) + int(usage.get("cache_creation_input_tokens") or 0) + cache_read
    completion = int(usage.get("output_tokens") or 0)
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cache_read:
        out["prompt_tokens_details"] = {"cached_tokens": cache_read}
    return out


def _tool_call(block: Mapping[str, Any], index: int | None = None) -> dict[str, Any]:
    call: dict[str, Any] = {
        "id": block.get("id"),
        "type": "function",
        "function": {"name": block.get("name"), "arguments": orjson.dumps(block.get("input") or {}).decode()},
    }
    if index is not None:
        call = {"index": index, **call}
    return call


def to_chat_completion(message: Mapping[str, Any], *, created: int | None = None) -> dict[str, Any]:
    """The ``chat.completion`` for a whole Messages ``message``."""
    blocks = message.get("content") or []
    text = "".join(b.get("text", "") for b in blocks if isinstance(b, dict) and b.get("type") == "text")
    tool_calls = [_tool_call(b) for b in blocks if isinstance(b, dict) and b.get("type") == "tool_use"]
    reply: dict[str, Any] = {"role": "assistant", "content": text if text or not tool_calls else None, "refusal": None}
    if tool_calls:
        reply["tool_calls"] = tool_calls
    return {
        "id": message.get("id"),
        "object": "chat.completion",
        "created": int(time.time()) if created is None else created,
        "model": message.get("model"),
        "choices": [{
            "index": 0,
            "message": reply,
            "logprobs": None,
            "finish_reason": _FINISH_REASONS.get(str(message.get("stop_reason")), "stop"),
        }],
        "usage": _usage(message.get("usage") or {}),
    }


def to_openai_error(status: int, raw: bytes) -> bytes:
    """An Anthropic error body in the OpenAI shape (the status is kept by the caller)."""
    message, type_ = f"anthropic answered HTTP {status}", "upstream_error"
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        obj = None
    error = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(error, dict):
        message = str(error.get("message") or message)
        type_ = str(error.get("type") or type_)
    return orjson.dumps({"error": {"message": message, "type": type_, "code": _ERROR_CODES.get(type_)}})


class StreamTranslator:
    """Turns one Messages stream's events into OpenAI chunk events, in order."""

    __slots__ = ("_created", "_id", "_include_usage", "_model", "_tools", "_usage", "finished")

    def __init__(self, *, model: str, include_usage: bool, created: int | None = None) -> None:
        self._created = int(time.time()) if created is None else created
        self._id = ""
        self._model = model
        self._include_usage = include_usage
        #: Content block index → OpenAI tool-call index.
        self._tools: dict[int, int] = {}
        self._usage: dict[str, Any] = {}
        self.finished = False

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        chunk: dict[str, Any] = {
            "id": self._id,
            "object": "chat.completion.chunk",
            "created": self._created,
            "model": self._model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
        }
        if self._include_usage:
            chunk["usage"] = None  # as OpenAI does when usage is asked for
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def _usage_chunk(self) -> bytes:
        chunk = {
            "id": self._id,
            "object": "chat.completion.chunk",
            "created": self._created,
            "model": self._model,
            "choices": [],
            "usage": _usage(self._usage),
        }
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def feed(self, event: bytes) -> list[bytes]:
        """The OpenAI events for one Anthropic event (often none)."""
        data = event_data(event)
        if data is None:
            return []
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise UpstreamProtocolError("anthropic stream sent an event that is not JSON") from None
        kind = obj.get("type") if isinstance(obj, dict) else None
        if kind == "message_start":
            message = obj.get("message") or {}
            self._id = str(message.get("id") or "")
            self._model = str(message.get("model") or self._model)
            self._usage.update(message.get("usage") or {})
            return [self._chunk({"role": "assistant", "content": ""})]
        if kind == "content_block_start":
            block = obj.get("content_block") or {}
            if block.get("type") == "tool_use":
                index = self._tools.setdefault(int(obj.get("index", 0)), len(self._tools))
                call = _tool_call({**block, "input": {}}, index)
                call["function"]["arguments"] = ""  # the arguments follow as input_json_delta
                return [self._chunk({"tool_calls": [call]})]
            if block.get("type") == "text" and block.get("text"):
                return [self._chunk({"content": block["text"]})]
            return []
        if kind == "content_block_delta":
            delta = obj.get("delta") or {}
            if delta.get("type") == "text_delta":
                return [self._chunk({"content": delta.get("text", "")})]
            if delta.get("type") == "input_json_delta":
                tool_index = self._tools.get(int(obj.get("index", 0)))
                if tool_index is None:
                    return []
                piece = {"index": tool_index, "function": {"arguments": delta.get("partial_json", "")}}
                return [self._chunk({"tool_calls": [piece]})]
            return []  # thinking and signature deltas have no OpenAI counterpart
        if kind == "message_delta":
            self._usage.update({k: v for k, v in (obj.get("usage") or {}).items() if v is not None})
            reason = (obj.get("delta") or {}).get("stop_reason")
            return [self._chunk({}, _FINISH_REASONS.get(str(reason), "stop"))]
        if kind == "message_stop":
            self.finished = True
            return [self._usage_chunk(), _DONE] if self._include_usage else [_DONE]
        if kind == "error":
            error = obj.get("error") or {}
            raise UpstreamProtocolError(
                f"anthropic stream error: {error.get('type', 'error')}: {error.get('message', '')}"
            )
        return []  # ping, content_block_stop, and event types added later

    def whole(self, message: Mapping[str, Any]) -> list[bytes]:
        """A whole message replayed as chunks (a provider that would not stream)."""
        answer = to_chat_completion(message, created=self._created)
        self._id, self._model = str(answer["id"] or ""), str(answer["model"] or self._model)
        self._usage.update(message.get("usage") or {})
        choice = answer["choices"][0]
        delta: dict[str, Any] = {"role": "assistant", "content": choice["message"]["content"] or ""}
        if "tool_calls" in choice["message"]:
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(choice["message"]["tool_calls"])]
        events = [self._chunk(delta), self._chunk({}, choice["finish_reason"])]
        self.finished = True
        return [*events, self._usage_chunk(), _DONE] if self._include_usage else [*events, _DONE]
