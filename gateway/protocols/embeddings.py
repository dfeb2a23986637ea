"""The OpenAI embeddings shape, for every provider that translates embeddings (Gemini,
Vertex AI, Bedrock): the texts of a request's ``input`` and the ``list`` answer.

``input`` is a string or a list of strings (token arrays are refused: no vendor mapped
here takes them). The answer's vectors are float lists, or base64 of little-endian
float32 when the request asks ``encoding_format: "base64"`` (the OpenAI SDKs ask it by
default and decode either).
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gateway.core.errors import InvalidRequest
from gateway.protocols.chat import UpstreamAnswerError

__all__ = ["embedding_inputs", "embeddings_list"]


def embedding_inputs(body: Mapping[str, Any], bad: Callable[[str], InvalidRequest]) -> list[str]:
    """The texts to embed; ``bad(message)`` is raised for any other ``input``."""
    raw = body.get("input")
    inputs = [raw] if isinstance(raw, str) else raw
    if not isinstance(inputs, list) or not inputs or not all(isinstance(t, str) for t in inputs):
        raise bad("embeddings 'input' must be a string or a list of strings (token arrays are not supported)")
    return inputs


def _vector(values: Any, index: int) -> list[float]:
    if not isinstance(values, list) or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        raise UpstreamAnswerError(f"embedding {index} is not a list of numbers")
    return values


def embeddings_list(
    vectors: Sequence[Any], *, model: str, prompt_tokens: int, body: Mapping[str, Any]
) -> dict[str, Any]:
    """OpenAI's embeddings answer for ``vectors`` (one per input, in order).

    Raises UpstreamAnswerError when a vector is not a list of numbers.
    """
    as_base64 = body.get("encoding_format") == "base64"
    data = []
    for index, values in enumerate(vectors):
        vector = _vector(values, index)
        embedding: list[float] | str = (
            base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode() if as_base64 else vector)
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
