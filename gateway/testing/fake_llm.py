"""Deterministic, OpenAI- and Anthropic-shaped fake LLM answers, for tests and bench/.

The OpenAI-shaped answers are the ``mock`` provider's own
(:mod:`gateway.providers.mock_text`) and the counts :mod:`gateway.core.tokens`'s, re-exported
here; this module adds Anthropic's Messages shapes (answers, tool use, the stream's named
events, errors) that the standalone fake upstream (:mod:`gateway.testing.fake_provider`)
serves for the ``anthropic`` provider. A capped Anthropic answer stops with
``"max_tokens"``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from gateway.core.tokens import anthropic_input_tokens, count_tokens, prompt_tokens
from gateway.providers.mock_text import (  # the private helpers the Anthropic shapes share
    _ANSWER_PREFIX,
    DONE_EVENT,
    MODEL_IDS,
    _answer_words,
    _messages,
    _model,
    _pieces,
    completion,
    completion_text,
    completion_tokens,
    embeddings,
    encode_event,
    include_usage,
    models_list,
    openai_error,
    stream_chunks,
    usage,
)

__all__ = [
    "DONE_EVENT",
    "MODEL_IDS",
    "anthropic_error",
    "anthropic_input_tokens",
    "anthropic_message",
    "anthropic_stream_events",
    "anthropic_tool_use",
    "completion",
    "completion_text",
    "completion_tokens",
    "count_tokens",
    "embeddings",
    "encode_anthropic_event",
    "encode_event",
    "include_usage",
    "models_list",
    "openai_error",
    "openai_tool_call",
    "openai_tool_chunks",
    "openai_tool_completion",
    "prompt_tokens",
    "stream_chunks",
    "usage",
]


def anthropic_tool_use(body: Mapping[str, Any], *, message_id: str) -> dict[str, Any] | None:
    """Return the ``tool_use`` block the fake answers with, or ``None`` for a text answer.

    When the body offers ``tools`` (and ``tool_choice`` is not ``none``) and its last
    user turn holds no ``tool_result``, the fake calls the first tool (or the one
    ``tool_choice`` names) with a fixed, nested, non-ASCII input built from the prompt,
    so a test can check that arguments arrive intact through a translating gateway.
    """
    tools = body.get("tools")
    if not isinstance(tools, list) or not tools or not isinstance(tools[0], dict):
        return None
    choice = body.get("tool_choice")
    choice = choice if isinstance(choice, dict) else {}
    if choice.get("type") == "none":
        return None
    for message in reversed(_messages(body)):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list) and any(
                isinstance(p, dict) and p.get("type") == "tool_result" for p in content
            ):
                return None
            break
    name = choice.get("name") if choice.get("type") == "tool" else tools[0].get("name")
    prompt = " ".join(_answer_words(body)[0][len(_ANSWER_PREFIX):])
    return {
        "type": "tool_use",
        "id": f"toolu_{message_id}",
        "name": name,
        "input": {
            "query": prompt,
            "limit": 3,
            "filters": {"lang": "en", "tags": ["a", "b"], "strict": True, "ratio": 0.25},
            "note": 'naïve ✓ "quoted" \\ back\nslash',
        },
    }


def _tool_intro(tool_use: Mapping[str, Any]) -> str:
    return f"Calling {tool_use['name']}."


def anthropic_message(body: Mapping[str, Any], *, message_id: str) -> dict[str, Any]:
    """Return the Anthropic Messages ``message`` object answering ``body``."""
    tool_use = anthropic_tool_use(body, message_id=message_id)
    if tool_use is not None:
        intro = _tool_intro(tool_use)
        return {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": _model(body),
            "content": [{"type": "text", "text": intro}, tool_use],
            "stop_reason": "tool_use",
            "stop_sequence": None,
            "usage": {
                "input_tokens": anthropic_input_tokens(body),
                "output_tokens": count_tokens(intro) + count_tokens(orjson.dumps(tool_use["input"]).decode()),
            },
        }
    words, cut = _answer_words(body)
    text = " ".join(words)
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": _model(body),
        "content": [{"type": "text", "text": text}],
        "stop_reason": "max_tokens" if cut else "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": anthropic_input_tokens(body),
            "output_tokens": count_tokens(text),
        },
    }


def encode_anthropic_event(obj: Mapping[str, Any]) -> bytes:
    """Encode one Anthropic SSE event: ``event: <type>``, ``data: <json>``, blank line."""
    return b"event: " + str(obj["type"]).encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


def anthropic_stream_events(
    body: Mapping[str, Any], *, message_id: str, n_chunks: int | None = None
) -> list[bytes]:
    """Return the encoded Anthropic SSE events streaming the answer to ``body``.

    ``message_start``, ``content_block_start``, one ``content_block_delta``
    (``text_delta``) per piece, ``content_block_stop``, ``message_delta`` (stop
    reason and ``usage.output_tokens``) and ``message_stop``.  When the fake calls a
    tool (:func:`anthropic_tool_use`), a text block introduces it and a ``tool_use``
    block follows, its input streamed as ``input_json_delta`` pieces.
    """
    tool_use = anthropic_tool_use(body, message_id=message_id)
    if tool_use is not None:
        return _anthropic_tool_stream(body, message_id, tool_use)
    words, cut = _answer_words(body)
    n_output = count_tokens(" ".join(words))
    start = {
        "type": "message_start",
        "message": {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": _model(body),
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": anthropic_input_tokens(body), "output_tokens": 1},
        },
    }
    events = [
        encode_anthropic_event(start),
        encode_anthropic_event(
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            }
        ),
    ]
    events.extend(
        encode_anthropic_event(
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": piece},
            }
        )
        for piece in _pieces(words, n_chunks)
    )
    events.append(encode_anthropic_event({"type": "content_block_stop", "index": 0}))
    events.append(
        encode_anthropic_event(
            {
                "type": "message_delta",
                "delta": {
                    "stop_reason": "max_tokens" if cut else "end_turn",
                    "stop_sequence": None,
                },
                "usage": {"output_tokens": n_output},
            }
        )
    )
    events.append(encode_anthropic_event({"type": "message_stop"}))
    return events


def _anthropic_tool_stream(body: Mapping[str, Any], message_id: str, tool_use: Mapping[str, Any]) -> list[bytes]:
    """The encoded events of a stream that introduces and calls a tool."""
    message = anthropic_message(body, message_id=message_id)
    arguments = orjson.dumps(tool_use["input"]).decode()
    third = max(1, len(arguments) // 3)
    pieces = [arguments[:third], arguments[third : 2 * third], arguments[2 * third :]]
    events: list[dict[str, Any]] = [
        {"type": "message_start", "message": {**message, "content": [], "stop_reason": None,
                                              "usage": {**message["usage"], "output_tokens": 1}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": _tool_intro(tool_use)}},
        {"type": "content_block_stop", "index": 0},
        {"type": "ping"},
        {"type": "content_block_start", "index": 1,
         "content_block": {"type": "tool_use", "id": tool_use["id"], "name": tool_use["name"], "input": {}}},
        *({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": p}}
          for p in pieces),
        {"type": "content_block_stop", "index": 1},
        {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
         "usage": {"output_tokens": message["usage"]["output_tokens"]}},
        {"type": "message_stop"},
    ]
    return [encode_anthropic_event(e) for e in events]


def anthropic_error(message: str, error_type: str) -> dict[str, Any]:
    """Return an Anthropic error body ``{"type": "error", "error": {...}}``."""
    return {"type": "error", "error": {"type": error_type, "message": message}}


# --------------------------------------------------------------------------- OpenAI tool calls
def openai_tool_call(body: Mapping[str, Any], *, call_id: str) -> dict[str, Any] | None:
    """Return the ``tool_calls`` entry the fake's OpenAI wire answers with, or ``None``.

    The OpenAI twin of :func:`anthropic_tool_use`: when ``tools`` are offered (and
    ``tool_choice`` is not ``"none"``) and no ``tool`` result came since the last assistant turn,
    the fake calls the first tool (or the one ``tool_choice`` names) with the same
    fixed, nested, non-ASCII input.
    """
    tools = body.get("tools")
    if not isinstance(tools, list) or not tools or not isinstance(tools[0], dict):
        return None
    choice = body.get("tool_choice")
    if choice == "none":
        return None
    messages = _messages(body)
    for message in reversed(messages):  # a tool's result since the last assistant turn: answer it
        role = message.get("role") if isinstance(message, dict) else None
        if role == "tool":
            return None
        if role == "assistant":
            break
    given = tools[0].get("function")
    function: dict[str, Any] = given if isinstance(given, dict) else {}
    name = function.get("name")
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name", name)
    user = next((m for m in reversed(messages) if isinstance(m, dict) and m.get("role") == "user"), None)
    as_anthropic = {"tools": [{"name": name}], "messages": [user] if user is not None else []}
    tool_use = anthropic_tool_use(as_anthropic, message_id=call_id)
    assert tool_use is not None
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": orjson.dumps(tool_use["input"]).decode()}}


def openai_tool_completion(body: Mapping[str, Any], call: Mapping[str, Any], *, response_id: str,
                           created: int) -> dict[str, Any]:
    """The ``chat.completion`` that calls ``call`` (no text), finish reason ``tool_calls``."""
    n_completion = count_tokens(call["function"]["arguments"])
    return {
        "id": response_id, "object": "chat.completion", "created": created, "model": _model(body),
        "choices": [{"index": 0, "logprobs": None, "finish_reason": "tool_calls",
                     "message": {"role": "assistant", "content": None, "refusal": None, "tool_calls": [call]}}],
        "usage": usage(prompt_tokens(_messages(body)), n_completion),
    }


def openai_tool_chunks(body: Mapping[str, Any], call: Mapping[str, Any], *, response_id: str,
                       created: int) -> list[dict[str, Any]]:
    """The chunks streaming ``call``: name first, its arguments in three pieces, the
    finish reason, and the usage chunk when asked (as OpenAI streams tool calls)."""
    arguments = call["function"]["arguments"]
    third = max(1, len(arguments) // 3)
    with_usage = include_usage(body)

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        obj: dict[str, Any] = {"id": response_id, "object": "chat.completion.chunk", "created": created,
                               "model": _model(body),
                               "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                            "finish_reason": finish_reason}]}
        if with_usage:
            obj["usage"] = None
        return obj

    chunks = [chunk({"role": "assistant", "content": None, "tool_calls": [
        {"index": 0, "id": call["id"], "type": "function", "function": {"name": call["function"]["name"],
                                                                        "arguments": ""}}]})]
    chunks += [chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
               for piece in (arguments[:third], arguments[third:2 * third], arguments[2 * third:])]
    chunks.append(chunk({}, "tool_calls"))
    if with_usage:
        final = openai_tool_completion(body, call, response_id=response_id, created=created)
        chunks.append({"id": response_id, "object": "chat.completion.chunk", "created": created,
                       "model": _model(body), "choices": [], "usage": final["usage"]})
    return chunks
