"""Anthropic's stream of named events ↔ the internal chat chunk stream, event by event.

* :class:`ChunksFromEvents` (outbound, the ``anthropic`` provider): ``message_start`` /
  ``content_block_*`` / ``message_delta`` / ``message_stop`` become
  ``chat.completion.chunk`` events (``input_json_delta`` as tool-call argument pieces),
  a usage-only chunk when ``stream_options.include_usage`` asks (the relay always asks,
  and hides it from clients who did not), then ``[DONE]``. An ``error`` event raises
  :class:`StreamBroken`.
* :class:`EventsFromChunks` (inbound, ``POST /v1/messages`` to a chat deployment): chat
  chunks become ``message_start``, then per content run a ``content_block_start`` /
  ``content_block_delta`` (``text_delta`` or ``input_json_delta``) / ``content_block_stop``,
  and at ``[DONE]`` one ``message_delta`` (stop reason, usage) and ``message_stop``.
  The stop reason waits for ``[DONE]`` because the usage chunk comes after the finish.
* :class:`NativeStreamTap` (inbound, passed through to an Anthropic deployment): reads
  ids, stop reason and usage off the events relayed unchanged.

Each holds only what the next event needs: nothing is buffered.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import orjson

from gateway.core.usage import Usage
from gateway.protocols.anthropic import (
    FINISH_REASONS,
    STOP_REASONS,
    anthropic_usage,
    chat_tool_call,
    chat_usage,
    to_chat_completion,
)
from gateway.protocols.sse import event_data

__all__ = [
    "ChunksFromEvents", "EventsFromChunks", "NativeStreamTap", "StreamBroken", "encode_event", "is_message_stop",
]

_DONE = b"data: [DONE]\n\n"


class StreamBroken(ValueError):
    """A stream event is not JSON, or the stream reported an error mid-way."""


def encode_event(obj: Mapping[str, Any]) -> bytes:
    """One Anthropic SSE event: ``event: <type>``, ``data: <json>``, blank line."""
    return b"event: " + str(obj["type"]).encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


class ChunksFromEvents:
    """Turns one Messages stream's events into OpenAI chunk events, in order (outbound)."""

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
            "usage": chat_usage(self._usage),
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
            raise StreamBroken("anthropic stream sent an event that is not JSON") from None
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
                call = chat_tool_call({**block, "input": {}}, index)
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
            return [self._chunk({}, FINISH_REASONS.get(str(reason), "stop"))]
        if kind == "message_stop":
            self.finished = True
            return [self._usage_chunk(), _DONE] if self._include_usage else [_DONE]
        if kind == "error":
            error = obj.get("error") or {}
            raise StreamBroken(
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


class EventsFromChunks:
    """Re-frames one chat stream (the internal shape) as Anthropic's named events."""

    __slots__ = ("_block", "_blocks", "_input_tokens", "_kind", "_model", "_started", "_stop_reason", "_tools",
                 "finished")

    def __init__(self, *, model: str, input_tokens: int) -> None:
        self._model = model
        #: The prompt estimate for ``message_start`` (the real count arrives in message_delta).
        self._input_tokens = input_tokens
        self._started = False
        #: The open content block's index (-1: none) and kind (text | tool_use).
        self._block = -1
        self._kind = ""
        self._blocks = 0
        #: Chat tool-call index → content block index.
        self._tools: dict[int, int] = {}
        self._stop_reason = "end_turn"
        self.finished = False

    def _start(self, chunk: Mapping[str, Any]) -> bytes:
        self._started = True
        message: dict[str, Any] = {
            "id": str(chunk.get("id") or ""), "type": "message", "role": "assistant",
            "model": str(chunk.get("model") or self._model), "content": [], "stop_reason": None,
            "stop_sequence": None, "usage": {"input_tokens": self._input_tokens, "output_tokens": 0},
        }
        return encode_event({"type": "message_start", "message": message})

    def _open(self, kind: str, block: dict[str, Any]) -> bytes:
        out = self._close()
        self._block, self._kind = self._blocks, kind
        self._blocks += 1
        return out + encode_event({"type": "content_block_start", "index": self._block, "content_block": block})

    def _close(self) -> bytes:
        if self._block < 0:
            return b""
        index, self._block, self._kind = self._block, -1, ""
        return encode_event({"type": "content_block_stop", "index": index})

    def feed(self, data: bytes) -> bytes:
        """The Anthropic events (concatenated, often none) for one chat chunk payload."""
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise StreamBroken("upstream sent an event that is not JSON") from None
        if not isinstance(chunk, dict):
            return b""
        out = b"" if self._started else self._start(chunk)
        choices = chunk.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else None
        if choice is None:
            return out
        given = choice.get("delta")
        delta: dict[str, Any] = given if isinstance(given, dict) else {}
        text = delta.get("content")
        if isinstance(text, str) and text:
            if self._kind != "text":
                out += self._open("text", {"type": "text", "text": ""})
            out += encode_event({"type": "content_block_delta", "index": self._block,
                                 "delta": {"type": "text_delta", "text": text}})
        for call in delta.get("tool_calls") or ():
            if not isinstance(call, dict):
                continue
            position = call.get("index", 0)
            named = call.get("function")
            function: dict[str, Any] = named if isinstance(named, dict) else {}
            block = self._tools.get(position)
            if block is None:
                out += self._open("tool_use", {"type": "tool_use", "id": str(call.get("id") or ""),
                                               "name": str(function.get("name") or ""), "input": {}})
                block = self._tools[position] = self._block
            arguments = function.get("arguments")
            if isinstance(arguments, str) and arguments:
                out += encode_event({"type": "content_block_delta", "index": block,
                                     "delta": {"type": "input_json_delta", "partial_json": arguments}})
        reason = choice.get("finish_reason")
        if isinstance(reason, str):
            self._stop_reason = STOP_REASONS.get(reason, "end_turn")
        return out

    def finish(self, usage: Usage) -> bytes:
        """The closing events, at the chat stream's ``[DONE]``, with the call's usage."""
        out = (b"" if self._started else self._start({})) + self._close()
        self.finished = True
        counts = anthropic_usage({"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens})
        return out + encode_event({
            "type": "message_delta",
            "delta": {"stop_reason": self._stop_reason, "stop_sequence": None},
            "usage": {"input_tokens": counts["input_tokens"], "output_tokens": counts["output_tokens"]},
        }) + encode_event({"type": "message_stop"})


class NativeStreamTap:
    """Watches a Messages stream relayed unchanged: id, model, stop reason, usage, end."""

    __slots__ = ("_usage", "chunks", "done", "error", "finish_reason", "first_event_at", "model", "response_id")

    def __init__(self) -> None:
        self._usage: dict[str, Any] = {}
        self.response_id: str | None = None
        self.model: str | None = None
        self.finish_reason: str | None = None
        self.first_event_at: float | None = None
        self.chunks = 0
        #: ``message_stop`` seen: the stream is complete.
        self.done = False
        #: The stream's own ``error`` event (relayed as is), e.g. ``overloaded_error: ...``.
        self.error: str | None = None

    def inspect(self, event: bytes) -> None:
        """Account for one event; raises StreamBroken if its data is not JSON."""
        data = event_data(event)
        if data is None:
            return
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise StreamBroken("anthropic stream sent an event that is not JSON") from None
        kind = obj.get("type") if isinstance(obj, dict) else None
        if kind == "ping" or kind is None:
            return
        if self.first_event_at is None:
            self.first_event_at = time.monotonic()
        self.chunks += 1
        if kind == "message_start":
            given = obj.get("message")
            message: dict[str, Any] = given if isinstance(given, dict) else {}
            self.response_id = message.get("id")
            self.model = message.get("model")
            self._usage.update(message.get("usage") or {})
        elif kind == "message_delta":
            self._usage.update({k: v for k, v in (obj.get("usage") or {}).items() if v is not None})
            reason = (obj.get("delta") or {}).get("stop_reason")
            if isinstance(reason, str):
                self.finish_reason = FINISH_REASONS.get(reason, "stop")
        elif kind == "message_stop":
            self.done = True
        elif kind == "error":
            given = obj.get("error")
            error: dict[str, Any] = given if isinstance(given, dict) else {}
            self.error = f"{error.get('type', 'error')}: {error.get('message', '')}"

    def usage(self) -> Usage | None:
        """The stream's usage in chat terms, or None if it reported none."""
        if not self._usage:
            return None
        counts = chat_usage(self._usage)
        return Usage(prompt_tokens=counts["prompt_tokens"], completion_tokens=counts["completion_tokens"])


def is_message_stop(event: bytes) -> bool:
    """Whether ``event`` is a Messages stream's last (``message_stop``)."""
    if b"message_stop" not in event:
        return False
    data = event_data(event)
    if data is None:
        return False
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return False
    return isinstance(obj, dict) and obj.get("type") == "message_stop"
