"""Deterministic, OpenAI- and Anthropic-shaped fake LLM answers.

Pure functions with no I/O and no module-level mutable state.  They are shared by
the gateway's in-process ``mock`` provider and by the standalone fake upstream
(:mod:`gateway.testing.fake_provider`), so both answer identically for the same body.

The answer to a request is ``"This is a mock answer to: <first 8 words of the last
user message>"``.  ``max_tokens`` / ``max_completion_tokens`` (in words) cap it; a
capped answer finishes with ``"length"`` (Anthropic: ``"max_tokens"``).  The
non-standard body field ``mock_completion_words`` (a positive integer) asks for an
answer of exactly that many words, padded with filler words, which lets a
benchmark choose the output size through a gateway that forwards unknown fields.
Tokens are counted as whitespace-separated words.
"""

from __future__ import annotations

import base64
import hashlib
import struct
from collections.abc import Mapping, Sequence
from typing import Any, Final

import orjson

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
    "prompt_tokens",
    "stream_chunks",
    "usage",
]

DONE_EVENT: Final[bytes] = b"data: [DONE]\n\n"
"""The SSE event that ends an OpenAI stream."""

MODEL_IDS: Final[tuple[str, ...]] = ("mock-small", "mock-large", "mock-embedding")
"""Model names listed by :func:`models_list`."""

_ANSWER_PREFIX: Final[tuple[str, ...]] = ("This", "is", "a", "mock", "answer", "to:")
_EMPTY_ANSWER: Final[tuple[str, ...]] = ("This", "is", "a", "mock", "answer.")
_FILLER: Final[tuple[str, ...]] = (
    "lorem",
    "ipsum",
    "dolor",
    "sit",
    "amet",
    "consectetur",
    "adipiscing",
    "elit",
    "sed",
    "do",
    "eiusmod",
    "tempor",
)
_PROMPT_WORDS: Final[int] = 8
_PER_MESSAGE_TOKENS: Final[int] = 3
_USD_PER_PROMPT_TOKEN: Final[float] = 0.5 / 1e6
_USD_PER_COMPLETION_TOKEN: Final[float] = 1.5 / 1e6
_DEFAULT_EMBEDDING_DIMS: Final[int] = 8
_MAX_EMBEDDING_DIMS: Final[int] = 4096


# --------------------------------------------------------------------------- tokens


def count_tokens(text: str) -> int:
    """Return the deterministic token count of ``text``: its words, at least 1."""
    return max(1, len(text.split()))


def _content_text(content: Any) -> str:
    """Return the text of a message content: a string or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [
            part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
        ]
        # An Anthropic tool result is answered like a user's text.
        texts += [
            part["content"] for part in content
            if isinstance(part, dict) and part.get("type") == "tool_result" and isinstance(part.get("content"), str)
        ]
        return " ".join(texts)
    return ""


def _content_tokens(content: Any) -> int:
    """Count the tokens of a string content, or of each text part of a list content."""
    if isinstance(content, str):
        return count_tokens(content)
    if isinstance(content, list):
        return sum(
            count_tokens(part["text"])
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return 0


def prompt_tokens(messages: Sequence[Any]) -> int:
    """Count prompt tokens: every string content / text part, plus 3 per message."""
    total = 0
    for message in messages:
        total += _PER_MESSAGE_TOKENS
        if isinstance(message, dict):
            total += _content_tokens(message.get("content"))
    return total


def _messages(body: Mapping[str, Any]) -> list[Any]:
    """Return the body's ``messages`` list, or an empty list when it is not one."""
    messages = body.get("messages")
    return messages if isinstance(messages, list) else []


def anthropic_input_tokens(body: Mapping[str, Any]) -> int:
    """Count the input tokens of an Anthropic Messages body (``system`` + messages)."""
    return prompt_tokens(_messages(body)) + _content_tokens(body.get("system"))


# --------------------------------------------------------------------------- answer


def _positive_int(value: Any) -> int | None:
    """Return ``value`` when it is a positive ``int`` (not a bool), else ``None``."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def _answer_words(body: Mapping[str, Any]) -> tuple[list[str], bool]:
    """Return the answer's words and whether ``max_tokens`` cut it."""
    prompt: list[str] = []
    for message in reversed(_messages(body)):
        if isinstance(message, dict) and message.get("role") == "user":
            prompt = _content_text(message.get("content")).split()[:_PROMPT_WORDS]
            break
    words = [*_ANSWER_PREFIX, *prompt] if prompt else list(_EMPTY_ANSWER)
    wanted = _positive_int(body.get("mock_completion_words"))
    if wanted is not None:
        if len(words) < wanted:
            words.extend(_FILLER[i % len(_FILLER)] for i in range(wanted - len(words)))
        del words[wanted:]
    limit = _positive_int(body.get("max_completion_tokens"))
    if limit is None:
        limit = _positive_int(body.get("max_tokens"))
    if limit is not None and len(words) > limit:
        return words[:limit], True
    return words, False


def completion_text(body: Mapping[str, Any]) -> str:
    """Return the deterministic answer text for an OpenAI or Anthropic body."""
    return " ".join(_answer_words(body)[0])


def completion_tokens(body: Mapping[str, Any]) -> int:
    """Return the number of completion tokens of the answer to ``body``."""
    return count_tokens(completion_text(body))


def usage(prompt: int, completion_: int) -> dict[str, int]:
    """Return an OpenAI ``usage`` object."""
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion_,
        "total_tokens": prompt + completion_,
    }


def _cost(prompt: int, completion_: int) -> dict[str, float]:
    """Return a Venice-style ``cost`` object for the given token counts."""
    usd = prompt * _USD_PER_PROMPT_TOKEN + completion_ * _USD_PER_COMPLETION_TOKEN
    return {"usd": usd, "diem": usd}


def _model(body: Mapping[str, Any]) -> str:
    """Return the body's model name (``"mock"`` when absent)."""
    model = body.get("model")
    return model if isinstance(model, str) else "mock"


def include_usage(body: Mapping[str, Any]) -> bool:
    """Tell whether an OpenAI stream body asks for a final usage chunk."""
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


# --------------------------------------------------------------------------- OpenAI


def completion(
    body: Mapping[str, Any], *, response_id: str, created: int, cost: bool = False
) -> dict[str, Any]:
    """Return the OpenAI ``chat.completion`` object answering ``body``.

    With ``cost`` a Venice-style top-level ``"cost": {"usd", "diem"}`` is added.
    """
    words, cut = _answer_words(body)
    text = " ".join(words)
    n_prompt = prompt_tokens(_messages(body))
    n_completion = count_tokens(text)
    result: dict[str, Any] = {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": _model(body),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": None,
                "finish_reason": "length" if cut else "stop",
            }
        ],
        "usage": usage(n_prompt, n_completion),
    }
    if cost:
        result["cost"] = _cost(n_prompt, n_completion)
    return result


def _pieces(words: list[str], n_chunks: int | None) -> list[str]:
    """Split the words into pieces whose concatenation is ``" ".join(words)``.

    By default one piece per word; otherwise ``n_chunks`` pieces of nearly equal
    word counts (at most one piece per word).  Every piece but the first starts
    with the space that separates it from the previous one.
    """
    n = len(words) if n_chunks is None else max(1, min(n_chunks, len(words)))
    size, extra = divmod(len(words), n)
    pieces: list[str] = []
    start = 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        piece = " ".join(words[start:end])
        pieces.append(piece if i == 0 else " " + piece)
        start = end
    return pieces


def stream_chunks(
    body: Mapping[str, Any],
    *,
    response_id: str,
    created: int,
    n_chunks: int | None = None,
    cost: bool = False,
) -> list[dict[str, Any]]:
    """Return the ``chat.completion.chunk`` objects OpenAI would stream for ``body``.

    A role chunk, the content pieces, a chunk with the finish reason and, only when
    ``stream_options.include_usage`` is true, a usage-only chunk (``choices: []``,
    plus ``cost`` when asked).  With ``include_usage`` every other chunk carries
    ``"usage": null`` as OpenAI does; without it no chunk has a ``usage`` key.
    """
    words, cut = _answer_words(body)
    model = _model(body)
    with_usage = include_usage(body)

    def chunk(delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "id": response_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": finish_reason,
                }
            ],
        }
        if with_usage:
            obj["usage"] = None
        return obj

    chunks = [chunk({"role": "assistant", "content": ""}, None)]
    chunks.extend(chunk({"content": piece}, None) for piece in _pieces(words, n_chunks))
    chunks.append(chunk({}, "length" if cut else "stop"))
    if with_usage:
        n_prompt = prompt_tokens(_messages(body))
        n_completion = count_tokens(" ".join(words))
        final: dict[str, Any] = {
            "id": response_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [],
            "usage": usage(n_prompt, n_completion),
        }
        if cost:
            final["cost"] = _cost(n_prompt, n_completion)
        chunks.append(final)
    return chunks


def encode_event(obj: Mapping[str, Any]) -> bytes:
    """Encode one OpenAI SSE event: ``data: <json>`` and a blank line."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def openai_error(message: str, error_type: str, code: str | None = None) -> dict[str, Any]:
    """Return an OpenAI error body ``{"error": {"message", "type", "code"}}``."""
    return {"error": {"message": message, "type": error_type, "code": code}}


def _embedding_inputs(value: Any) -> list[str]:
    """Normalise an embeddings ``input`` (string, list of strings or token ids)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):
            return [" ".join(str(v) for v in value)]
        return [v if isinstance(v, str) else orjson.dumps(v).decode() for v in value]
    return [""]


def _vector(text: str, dims: int) -> list[float]:
    """Return a deterministic unit vector of ``dims`` floats derived from ``text``."""
    raw = hashlib.shake_256(text.encode()).digest(2 * dims)
    values = [(v - 32767.5) / 32767.5 for v in struct.unpack(f"<{dims}H", raw)]
    norm = sum(v * v for v in values) ** 0.5 or 1.0
    return [v / norm for v in values]


def embeddings(body: Mapping[str, Any]) -> dict[str, Any]:
    """Return the OpenAI embeddings list answering ``body``.

    Vectors have 8 dimensions (or ``dimensions``, up to 4096) and honour
    ``encoding_format: "base64"`` (little-endian float32, as the OpenAI SDK asks).
    """
    inputs = _embedding_inputs(body.get("input"))
    dims = min(_positive_int(body.get("dimensions")) or _DEFAULT_EMBEDDING_DIMS, _MAX_EMBEDDING_DIMS)
    as_base64 = body.get("encoding_format") == "base64"
    data: list[dict[str, Any]] = []
    for index, text in enumerate(inputs):
        vector = _vector(text, dims)
        embedding: list[float] | str = (
            base64.b64encode(struct.pack(f"<{dims}f", *vector)).decode() if as_base64 else vector
        )
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    n_prompt = sum(count_tokens(text) for text in inputs)
    return {
        "object": "list",
        "data": data,
        "model": _model(body),
        "usage": {"prompt_tokens": n_prompt, "total_tokens": n_prompt},
    }


def models_list(created: int = 0) -> dict[str, Any]:
    """Return the OpenAI model list of :data:`MODEL_IDS`."""
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "fake"} for name in MODEL_IDS
        ],
    }


# --------------------------------------------------------------------------- Anthropic


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
