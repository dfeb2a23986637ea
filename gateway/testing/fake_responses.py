"""OpenAI Responses API answers of the fake upstream (``POST /v1/responses``): a
deployment that serves the Responses API natively, for the gateway's passthrough tests.

The answer's text is "This is a native answer to: " and the last input text, one
``message`` item; a ``web_search`` tool adds a ``web_search_call`` item first (what only
a native deployment can do). Streams are the documented typed events with
``sequence_number`` from 0, ending ``response.completed``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import orjson

__all__ = ["NATIVE_PREFIX", "responses_answer", "responses_events"]

NATIVE_PREFIX = "This is a native answer to: "


def _last_text(body: Mapping[str, Any]) -> str:
    value = body.get("input")
    if isinstance(value, str):
        return value
    for item in reversed(value if isinstance(value, list) else []):
        content = item.get("content") if isinstance(item, dict) else None
        if isinstance(content, str):
            return content
        for part in reversed(content if isinstance(content, list) else []):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                return str(part["text"])
        if isinstance(item, dict) and isinstance(item.get("output"), str):
            return str(item["output"])
    return ""


def responses_answer(body: Mapping[str, Any], *, response_id: str, status: str = "completed") -> dict[str, Any]:
    """The whole ``response`` object for ``body``."""
    text = NATIVE_PREFIX + _last_text(body)
    output: list[dict[str, Any]] = []
    tools = body.get("tools")
    if isinstance(tools, list) and any(isinstance(t, dict) and t.get("type") == "web_search" for t in tools):
        output.append({"id": f"ws_{response_id}", "type": "web_search_call", "status": "completed",
                       "action": {"type": "search", "query": _last_text(body)}})
    output.append({"id": f"msg_{response_id}", "type": "message", "status": "completed", "role": "assistant",
                   "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
    words = max(1, len(_last_text(body).split()))
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()), "status": status,
        "error": None, "incomplete_details": None, "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"), "model": body.get("model"), "output": output,
        "parallel_tool_calls": True, "previous_response_id": body.get("previous_response_id"),
        "store": body.get("store", True), "temperature": body.get("temperature"), "text": {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"), "tools": tools or [], "top_p": body.get("top_p"),
        "truncation": "disabled", "metadata": body.get("metadata") or {},
        "usage": {"input_tokens": 7 + words, "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": 6 + words, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": 13 + 2 * words},
    }


def _event(kind: str, sequence: int, payload: dict[str, Any]) -> bytes:
    data = orjson.dumps({"type": kind, "sequence_number": sequence, **payload})
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


def responses_events(body: Mapping[str, Any], *, response_id: str) -> list[bytes]:
    """The typed events of a streamed answer to ``body``, one delta per word."""
    final = responses_answer(body, response_id=response_id)
    message = final["output"][-1]
    index = len(final["output"]) - 1
    text = message["content"][0]["text"]
    started = {**final, "status": "in_progress", "output": [], "usage": None}
    kinds: list[tuple[str, dict[str, Any]]] = [("response.created", {"response": started}),
                                               ("response.in_progress", {"response": started})]
    kinds.append(("response.output_item.added", {"output_index": index, "item": {**message, "content": [],
                                                                                 "status": "in_progress"}}))
    where = {"item_id": message["id"], "output_index": index, "content_index": 0}
    kinds.append(("response.content_part.added", {**where, "part": {**message["content"][0], "text": ""}}))
    for n, word in enumerate(text.split(" ")):
        kinds.append(("response.output_text.delta", {**where, "delta": word if n == 0 else " " + word,
                                                     "logprobs": []}))
    kinds.append(("response.output_text.done", {**where, "text": text, "logprobs": []}))
    kinds.append(("response.content_part.done", {**where, "part": message["content"][0]}))
    kinds.append(("response.output_item.done", {"output_index": index, "item": message}))
    kinds.append(("response.completed", {"response": final}))
    return [_event(kind, n, payload) for n, (kind, payload) in enumerate(kinds)]
