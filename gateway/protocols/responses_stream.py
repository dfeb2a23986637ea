"""A chat completions stream re-framed as the Responses API's typed events, chunk by chunk.

The events, each ``event: TYPE`` + ``data: {...}`` with a ``sequence_number`` that goes
up by one from 0: ``response.created`` and ``response.in_progress`` on the first chunk;
for text, ``response.output_item.added`` (a ``message``), ``response.content_part.added``
(an ``output_text``), ``response.output_text.delta`` per chunk, then
``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done``; for each tool call, ``response.output_item.added`` (a
``function_call``), ``response.function_call_arguments.delta`` per chunk, then
``response.function_call_arguments.done`` and ``response.output_item.done``; at
``[DONE]``, ``response.completed`` (or ``response.incomplete`` when the model hit
``max_output_tokens``) with the whole response and its usage. A stream that fails
ends with one ``response.failed`` event. Nothing follows the last event (no ``[DONE]``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from gateway.protocols.responses import as_object, new_id, response_object, response_usage
from gateway.protocols.sse import event_data

__all__ = ["END_EVENTS", "EventsFromChunks", "NativeEventsTap", "encode_event", "failed_event", "is_response_end"]

#: The events after which a Responses stream has nothing more to say.
END_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})


def encode_event(kind: str, sequence_number: int, payload: dict[str, Any]) -> bytes:
    """One typed event, framed as OpenAI frames it (``event:`` line, then ``data:``)."""
    data = orjson.dumps({"type": kind, "sequence_number": sequence_number, **payload})
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


def failed_event(response_id: str, body: Mapping[str, Any], sequence_number: int, code: str, message: str,
                 *, model: str = "") -> bytes:
    """A ``response.failed`` event for a stream the gateway has to end."""
    response = response_object(response_id, body, model=model or str(body.get("model") or ""), status="failed",
                               error={"code": code, "message": message})
    return encode_event("response.failed", sequence_number, {"response": response})


class EventsFromChunks:
    """One stream's framer: feed chat chunk payloads, then :meth:`finish` at ``[DONE]``."""

    def __init__(self, response_id: str, body: Mapping[str, Any], *, model: str, created_at: int | None = None) -> None:
        self.response_id = response_id
        self.body = body
        self.model = model
        #: When the response was made (default: the first chunk's ``created``).
        self.created_at: int | None = created_at
        self.sequence = 0
        self.started = False
        self.finished = False
        #: Output items so far, in order (the open one last).
        self.output: list[dict[str, Any]] = []
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self._text: dict[str, Any] | None = None  # the open message item
        self._calls: dict[int, dict[str, Any]] = {}  # chat tool-call index → function_call item
        self._open_call: dict[str, Any] | None = None
        #: The whole response as last sent (``response.completed`` / ``failed``).
        self.response: dict[str, Any] | None = None

    def _event(self, kind: str, payload: dict[str, Any]) -> bytes:
        event = encode_event(kind, self.sequence, payload)
        self.sequence += 1
        return event

    def _snapshot(self, status: str, **extra: Any) -> dict[str, Any]:
        return response_object(self.response_id, self.body, model=self.model, created_at=self.created_at,
                               status=status, output=list(self.output), **extra)

    def _start(self, chunk: Mapping[str, Any]) -> list[bytes]:
        self.started = True
        if isinstance(chunk.get("model"), str) and chunk["model"]:
            self.model = chunk["model"]
        created = chunk.get("created")
        if self.created_at is None and isinstance(created, int):
            self.created_at = created
        snapshot = self._snapshot("in_progress")
        self.created_at = snapshot["created_at"]
        return [self._event("response.created", {"response": snapshot}),
                self._event("response.in_progress", {"response": snapshot})]

    def _close_text(self) -> list[bytes]:
        item, self._text = self._text, None
        if item is None:
            return []
        index = self.output.index(item)
        part = item["content"][0]
        item["status"] = "completed"
        where = {"item_id": item["id"], "output_index": index}
        return [
            self._event("response.output_text.done", {**where, "content_index": 0, "text": part["text"],
                                                      "logprobs": []}),
            self._event("response.content_part.done", {**where, "content_index": 0, "part": part}),
            self._event("response.output_item.done", {"output_index": index, "item": item}),
        ]

    def _close_call(self) -> list[bytes]:
        item, self._open_call = self._open_call, None
        if item is None:
            return []
        index = self.output.index(item)
        item["status"] = "completed"
        return [
            self._event("response.function_call_arguments.done",
                        {"item_id": item["id"], "output_index": index, "arguments": item["arguments"]}),
            self._event("response.output_item.done", {"output_index": index, "item": item}),
        ]

    def _text_delta(self, text: str) -> list[bytes]:
        out = self._close_call()
        if self._text is None:
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._text = {"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                          "content": [part]}
            self.output.append(self._text)
            index = len(self.output) - 1
            out.append(self._event("response.output_item.added", {"output_index": index, "item": {
                **self._text, "content": []}}))
            out.append(self._event("response.content_part.added", {
                "item_id": self._text["id"], "output_index": index, "content_index": 0, "part": dict(part)}))
        self._text["content"][0]["text"] += text
        return [*out, self._event("response.output_text.delta", {
            "item_id": self._text["id"], "output_index": self.output.index(self._text), "content_index": 0,
            "delta": text, "logprobs": []})]

    def _call_delta(self, call: Mapping[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        index = call.get("index", 0)
        function = as_object(call.get("function"))
        item = self._calls.get(index)
        if item is None:
            out += self._close_text() + self._close_call()
            item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                    "call_id": call.get("id") or new_id("call"), "name": function.get("name") or "", "arguments": ""}
            self._calls[index] = self._open_call = item
            self.output.append(item)
            out.append(self._event("response.output_item.added", {"output_index": len(self.output) - 1,
                                                                   "item": dict(item)}))
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            item["arguments"] += arguments
            out.append(self._event("response.function_call_arguments.delta", {
                "item_id": item["id"], "output_index": self.output.index(item), "delta": arguments}))
        return out

    def feed(self, data: bytes) -> bytes:
        """The events for one chat chunk payload (JSON, not ``[DONE]``)."""
        chunk = orjson.loads(data)
        if not isinstance(chunk, dict):
            return b""
        out = [] if self.started else self._start(chunk)
        if chunk.get("usage") is not None:
            self.usage = response_usage(chunk["usage"])
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue  # a response has one answer; n>1 is not a Responses notion
            delta = as_object(choice.get("delta"))
            if isinstance(delta.get("content"), str) and delta["content"]:
                out += self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or []:
                if isinstance(call, dict):
                    out += self._call_delta(call)
            if isinstance(choice.get("finish_reason"), str):
                self.finish_reason = choice["finish_reason"]
        return b"".join(out)

    def finish(self, usage: Mapping[str, Any] | None) -> bytes:
        """The closing events at ``[DONE]``; ``usage`` (chat counts) where the stream had none."""
        out = [] if self.started else self._start({})
        out += self._close_text() + self._close_call()
        if self.usage is None:
            self.usage = response_usage(usage)
        self.finished = True
        incomplete = self.finish_reason == "length"
        self.response = self._snapshot(
            "incomplete" if incomplete else "completed", usage=self.usage,
            incomplete_reason="max_output_tokens" if incomplete else None,
        )
        kind = "response.incomplete" if incomplete else "response.completed"
        return b"".join([*out, self._event(kind, {"response": self.response})])

    def failed(self, code: str, message: str) -> bytes:
        """The one event telling the client its stream ends in failure."""
        out = [] if self.started else self._start({})
        self.response = self._snapshot("failed", usage=self.usage, error={"code": code, "message": message})
        return b"".join([*out, self._event("response.failed", {"response": self.response})])


def _event_object(event: bytes) -> dict[str, Any] | None:
    data = event_data(event)
    if data is None:
        return None
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def is_response_end(event: bytes) -> bool:
    """Whether ``event`` is a Responses stream's last (completed, incomplete or failed)."""
    if b"response." not in event:
        return False
    obj = _event_object(event)
    return obj is not None and obj.get("type") in END_EVENTS


class NativeEventsTap:
    """Reads a Responses stream relayed as its deployment sent it: the final response
    (with its usage), whether it ended, and a failure's code. The events carrying the
    whole response get the gateway's response id in place of the deployment's, so a
    client only ever sees ids the gateway stores."""

    def __init__(self, response_id: str) -> None:
        self.response_id = response_id
        self.first_event_at: float | None = None
        self.events = 0
        #: The deployment's own id (for the ledger) and last sequence number (for an event
        #: the gateway adds).
        self.upstream_id: str | None = None
        self.last_sequence = -1
        self.response: dict[str, Any] | None = None
        self.done = False
        self.error: str | None = None

    def inspect(self, event: bytes, now: float) -> bytes:
        """Account for one event; the event to relay."""
        if self.first_event_at is None:
            self.first_event_at = now
        self.events += 1
        obj = _event_object(event)
        if obj is None:
            return event
        if isinstance(obj.get("sequence_number"), int):
            self.last_sequence = obj["sequence_number"]
        kind = obj.get("type")
        if kind == "error":
            self.error = str(obj.get("code") or "error")
            return event
        response = obj.get("response")
        if not isinstance(response, dict):
            return event
        self.upstream_id = self.upstream_id or response.get("id")
        response["id"] = self.response_id
        if kind in END_EVENTS:
            self.done = True
            self.response = response
            if kind == "response.failed":
                failure = response.get("error")
                self.error = str(failure.get("code") or "failed") if isinstance(failure, dict) else "failed"
        return encode_event(str(kind), obj["sequence_number"], {
            k: v for k, v in obj.items() if k not in ("type", "sequence_number")}) if isinstance(
            obj.get("sequence_number"), int) else event
