"""The ``mock`` provider's answers: deterministic, OpenAI-shaped, with usage.

Pure functions with no I/O and no module-level mutable state, served by the in-process
``mock`` provider and, through :mod:`gateway.testing.fake_llm`, by the standalone fake
upstream, so both answer identically for the same body.

The answer to a request is ``"This is a mock answer to: <first 8 words of the last
user message>"``.  ``max_tokens`` / ``max_completion_tokens`` (in words) cap it; a
capped answer finishes with ``"length"``.  The non-standard body field
``mock_completion_words`` (a positive integer) asks for an answer of exactly that many
words, padded with filler words, which lets a benchmark choose the output size through
a gateway that forwards unknown fields. Tokens are counted by :mod:`gateway.core.tokens`.
"""

from __future__ import annotations

import base64
import hashlib
import struct
from collections.abc import Mapping
from typing import Any, Final

import orjson

from gateway.core.tokens import count_tokens, prompt_tokens

__all__ = [
    "DONE_EVENT",
    "MODEL_IDS",
    "completion",
    "completion_text",
    "completion_tokens",
    "embeddings",
    "encode_event",
    "include_usage",
    "models_list",
    "openai_error",
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
_USD_PER_PROMPT_TOKEN: Final[float] = 0.5 / 1e6
_USD_PER_COMPLETION_TOKEN: Final[float] = 1.5 / 1e6
_DEFAULT_EMBEDDING_DIMS: Final[int] = 8
_MAX_EMBEDDING_DIMS: Final[int] = 4096


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


def _messages(body: Mapping[str, Any]) -> list[Any]:
    """Return the body's ``messages`` list, or an empty list when it is not one."""
    messages = body.get("messages")
    return messages if isinstance(messages, list) else []


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
